// GPT-2 as an ordered list of layers with explicit forward and backward.
//
//   embed    : tokens [B,T] -> x0 [B,T,C]            (wte, wpe)
//   block i  : x_i [B,T,C]  -> x_{i+1} [B,T,C]        pre-LN transformer block:
//              x + attn(ln_1(x)), then + mlp(ln_2(·)), GELU (tanh approximation)
//   head     : x_L -> loss                           (ln_f, LM head tied to wte, softmax-xent)
//
// Parameters live in the flat buffers described by ParamLayout; layers hold views into them
// (bind()). The model knows nothing of strategies: a strategy observes it through LayerHooks and
// acts on the flat buffers (parallel/strategy.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "memory/flat_buffer.h"
#include "memory/param_layout.h"
#include "model/gpt2_config.h"
#include "model/model.h"

namespace shardtrain {

/// Per-micro-batch state shared by the layers of one forward/backward.
struct StepContext {
  int64_t B = 0, T = 0;
  Tensor tokens;         ///< [B,T] int32 on the device
  Tensor targets;        ///< [B,T] int32 on the device; empty for inference
  Tensor losses;         ///< [B*T] fp32 per-token losses written by the head
  float grad_scale = 1;  ///< ∂(objective)/∂(per-token loss): 1/(B·T·accumulation) · loss scale
  bool for_backward = true;  ///< keep what backward needs and compute ∂logits in the head
  /// Dropout probabilities of this micro-batch (the config's when training, else 0: evaluation,
  /// generation, for_backward false) and its seed (dropout_seed()): the same in the micro-batch's
  /// forward, its recompute under activation checkpointing and its backward.
  float embd_pdrop = 0, attn_pdrop = 0, resid_pdrop = 0;
  uint64_t dropout_seed = 0;

  /// The dropout of `site` (dropout_site) with probability p.
  Dropout dropout(float p, uint32_t site) const {
    Dropout d;
    d.p = p;
    d.seed = dropout_seed;
    d.site = site;
    return d;
  }
};

/// The dropouts of the model, each its own Philox counter word: the embedding's, and per block
/// (0-based `layer`) the attention probabilities', the attention projection's and the MLP
/// projection's (before their residual adds).
enum class DropoutKind : uint32_t { kAttnProbs = 0, kAttnResid = 1, kMlpResid = 2 };
inline constexpr uint32_t kEmbeddingDropoutSite = 0;
inline uint32_t dropout_site(int layer, DropoutKind kind) {
  return 4u * (static_cast<uint32_t>(layer) + 1u) + static_cast<uint32_t>(kind);
}

/// The dropout seed of one micro-batch: a mix of the run's seed, the data-parallel rank (a
/// pipeline's replica index), the optimizer step and the micro-batch's index within the step,
/// so that every micro-batch of a run draws its own masks and a rerun draws the same ones.
uint64_t micro_batch_dropout_seed(uint64_t run_seed, int64_t rank, int64_t step,
                                  int64_t micro_batch);

class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  const std::string& name() const { return name_; }

  /// The layer's parameter tensors (names, shapes, init), in layout order.
  virtual std::vector<ParamTensor> param_specs() const = 0;
  /// Points the layer at its parameters and gradients. `params`/`grads` are this layer's
  /// slices of the flat buffers (offsets inside are relative to the layer's first element);
  /// `grads` may be empty for inference.
  virtual void bind(const LayerRange& range, Tensor params, Tensor grads) = 0;
  /// Sizes the activation buffers for a micro-batch of [B, T].
  virtual void reserve(Backend& be, int64_t B, int64_t T) = 0;
  /// in [B,T,C] (unused by the embedding), out [B,T,C] (unused by the head).
  virtual void forward(Backend& be, StepContext& ctx, Tensor in, Tensor out) = 0;
  /// dresid [B,T,C]: ∂L/∂out on entry, ∂L/∂in on return (the head writes it, the embedding
  /// consumes it). `in` is the input given to forward().
  virtual void backward(Backend& be, StepContext& ctx, Tensor in, Tensor dresid) = 0;
  /// The input-gradient half of backward() (zero-bubble pipelines' B pass): dresid as in
  /// backward(), no parameter gradient; keeps in the current slot what backward_weight() needs.
  virtual void backward_input(Backend& be, StepContext& ctx, Tensor in, Tensor dresid) = 0;
  /// The weight-gradient half (W pass), after backward_input() of the same slot: accumulates the
  /// parameter gradients backward() would. `dresid` as backward_input() left it (the embedding
  /// reads it). B then W equals backward() bit for bit.
  virtual void backward_weight(Backend& be, StepContext& ctx, Tensor in, Tensor dresid) = 0;
  /// Selects the activation set (slot ≥ 0) the next reserve/forward/backward use: a pipeline
  /// stage keeps one per micro-batch in flight. Slot 0 is selected at construction.
  virtual void use_slot(int /*slot*/) {}

 private:
  std::string name_;
};

/// Which part of the backward backward_layers() runs (zero-bubble pipelines split it).
enum class BackwardPass { kFull, kInput, kWeight };

class GPT2Model final : public Model {
 public:
  /// Builds the layers and the parameter layout; allocates nothing on the device yet.
  GPT2Model(const GPT2Config& config, Backend& backend, bool activation_checkpointing = false);
  /// A pipeline stage's part of the model: the layers `layer_ids` of the whole model (0 = the
  /// embedding, 1..n_layer = the blocks, n_layer + 1 = the head), ascending. Its layout holds
  /// only those layers (their tensors keep their names). A stage with the head but not the
  /// embedding reads wte from set_tied_embedding(). Under activation checkpointing the blocks'
  /// recomputed set has its own memory (several micro-batches' logits may be live). Throws
  /// ConfigError for an empty or unordered list.
  GPT2Model(const GPT2Config& config, Backend& backend, bool activation_checkpointing,
            const std::vector<int>& layer_ids);
  ~GPT2Model() override;

  const GPT2Config& config() const { return config_; }
  std::string name() const override { return config_.name; }
  const ParamLayout& layout() const override { return layout_; }
  Layer& layer(int i) { return *layers_[static_cast<size_t>(i)]; }
  Backend& backend() override { return backend_; }
  /// The whole model's index of local layer `i` (as in the layer_ids constructor).
  int global_layer(int i) const { return ids_[static_cast<size_t>(i)]; }
  bool has_embedding() const { return ids_.front() == 0; }
  bool has_head() const { return ids_.back() == config_.n_layer + 1; }
  /// The embedding's wte [V, C] and its gradient, as bound now (has_embedding()).
  Tensor embedding_weight() const;
  Tensor embedding_weight_grad() const;
  /// Where the head of a stage without the embedding reads wte [V, C] and accumulates its
  /// gradient (compute dtype; the caller keeps them alive and in step with the embedding).
  void set_tied_embedding(Tensor wte, Tensor dwte);

  /// Binds every layer to the whole flat buffers (params [numel], grads [numel] or empty),
  /// both in the backend's compute dtype.
  void bind(const Tensor& params, const Tensor& grads) override;
  void bind_layer(int i, const LayerRange& r, Tensor params, Tensor grads) override {
    layer(i).bind(r, params, grads);
  }

  /// GPT-2 initialization into a host fp32 buffer of layout().numel() elements: weights
  /// normal(0, 0.02), residual projections normal(0, 0.02/sqrt(2·n_layer)) (Radford et al. 2019,
  /// §2.3), biases 0, LayerNorm weight 1. Each tensor draws from its own stream seeded by
  /// (seed, tensor name), so the result does not depend on how the buffer is sharded.
  void init_parameters(float* host_params, uint64_t seed) const override;

  /// Runs forward over all layers for tokens/targets (host int32, [B*T] each; targets may be
  /// null for inference). Returns the mean loss over the micro-batch's tokens (0 without
  /// targets). With for_backward, keeps the activations backward() needs and leaves ∂logits.
  /// With for_backward the config's dropout is on, its masks drawn from `dropout_seed`.
  double forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
                 float grad_scale, bool for_backward, uint64_t dropout_seed = 0);
  /// Model's forward: input.tokens/targets [batch · seq_len].
  double forward(const ModelInput& input, float grad_scale, bool for_backward) override {
    return forward(input.tokens, input.targets, input.batch, input.seq_len, grad_scale,
                   for_backward, input.dropout_seed);
  }
  /// Backward over all layers after forward(..., for_backward=true); accumulates into grads.
  void backward() override;

  /// Model's layer-major forward (model.h): micro-batch k in activation slot k; the head keeps
  /// one slot (slot 0) for all of them. Needs activation checkpointing and the whole model.
  bool supports_layer_major_forward() const override {
    return checkpointing_ && head_places_shared_;
  }
  void stage_micro_batch(int k, const ModelInput& input, float grad_scale) override;
  void forward_layer_major(int count) override;
  double forward_head_layer_major(int k) override;
  void backward_layer_major(int k) override;
  double head_and_backward_layer_major(int count) override;
  /// 6·N + 12·n_layer·n_embd·T FLOPs per token (Kaplan et al., arXiv 2001.08361, §2.1, with
  /// attention), times T tokens.
  double train_flops_per_sample(int64_t seq_len) const override;

  /// Logits [B*T, V] of the last forward without targets... for generation: returns the
  /// logits row of position `t` of batch row `b` (host copy, V floats).
  std::vector<float> logits_at(int64_t b, int64_t t);

  // ---- pipeline stages: several micro-batches in flight, each in an activation slot --------
  // forward()/backward() above are slot 0 over all layers. A stage runs a chunk of its layers
  // [first, last) at a time; activation(slot, first) is where the chunk's input is received
  // (the embedding's chunk reads the tokens instead) and activation(slot, last) its output.

  /// Starts micro-batch [B, T] in `slot` (≥ 0): copies tokens and targets (host int32 [B*T],
  /// either may be null when this stage does not use them) and sets ∂(objective)/∂(per-token
  /// loss) = grad_scale; `for_backward` false: inference (no ∂logits, nothing kept for
  /// backward, and no dropout). With for_backward the config's dropout probabilities apply, the
  /// masks drawn from `dropout_seed` (micro_batch_dropout_seed). Allocates the slot's buffers at
  /// first use.
  void prepare(int slot, const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
               float grad_scale, bool for_backward = true, uint64_t dropout_seed = 0);
  /// The input of local layer `i` of `slot` [B, T, C] (compute dtype); i == num_layers(): the
  /// output of the last layer (when it is not the head).
  Tensor activation(int slot, int i);
  /// The slot's residual gradient [B, T, C]: ∂L/∂(chunk output) before backward_layers(),
  /// ∂L/∂(chunk input) after it.
  Tensor activation_grad(int slot);
  /// Forward of local layers [first, last) for the micro-batch in `slot`.
  void forward_layers(int slot, int first, int last);
  /// Backward (or its B or W pass) of local layers [first, last), last first. Hooks run around
  /// the passes that accumulate parameter gradients (kFull, kWeight).
  void backward_layers(int slot, int first, int last, BackwardPass pass);
  /// Mean per-token loss of the slot's last forward through the head (synchronizes).
  double slot_loss(int slot);
  /// The per-token losses [B·T] fp32 of the slot's last forward through the head (no wait: a
  /// view of the device buffer, valid until the slot's next forward).
  Tensor slot_losses(int slot);

 private:
  /// One micro-batch's activations between layers: residual[i] is the input of layer i
  /// (residual[0] unused when layer 0 is the embedding; residual[num_layers()] the output of a
  /// stage that ends before the head).
  struct Slot {
    int64_t B = 0, T = 0;
    std::vector<FlatBuffer> residual;
    FlatBuffer dresid, tokens, targets, losses;
    StepContext ctx;
  };
  void build(const std::vector<int>& layer_ids, bool head_places_shared);
  /// Layer i's forward (no hooks) for the micro-batch in slot s.
  void layer_forward(int i, int s);
  Slot& slot(int s);
  void reserve(int s, int64_t B, int64_t T);

  GPT2Config config_;
  Backend& backend_;
  bool checkpointing_;
  /// The whole model: its head's logits host the blocks' recomputed set, so the head keeps one
  /// activation slot, slot 0, whatever slot its micro-batch is in (head_slot()).
  bool head_places_shared_ = false;
  /// The activation slot layer `i` uses for the micro-batch in slot `s`.
  int layer_slot(int i, int s) const {
    return head_places_shared_ && i == num_layers() - 1 ? 0 : s;
  }
  std::vector<int> ids_;
  ParamLayout layout_;
  std::vector<std::unique_ptr<Layer>> layers_;
  Tensor external_wte_, external_dwte_;  ///< set_tied_embedding()
  std::vector<std::unique_ptr<Slot>> slots_;
};

}  // namespace shardtrain
