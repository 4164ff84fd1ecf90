// Model: what strategies, the training step and checkpoints need of a model, whatever it is —
// GPT-2 (model/gpt2.h) or an image classifier (model/image/image_model.h).
//
// A model is an ordered list of layers over one flat parameter layout (memory/param_layout.h).
// Strategies own the flat buffers and bind them (all at once, or one layer at a time for
// ZeRO-3's gathered parameters); the model runs forward and backward over its layers, calling the
// strategy's LayerHooks around each.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "memory/param_layout.h"

namespace shardtrain {

/// Callbacks a strategy registers to act around each layer (ZeRO-3 gathers parameters before
/// a layer's forward/backward; data parallelism reduces a layer's gradients after its backward).
class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  virtual void before_forward(int /*layer*/) {}
  virtual void after_forward(int /*layer*/) {}
  virtual void before_backward(int /*layer*/) {}
  virtual void after_backward(int /*layer*/) {}
  /// After every layer of every pass, the input-gradient pass included: where a pipeline polls
  /// its transfers in flight (MPI moves a large message only while its sender is inside an MPI
  /// call, so a stage computing for long would otherwise hold its neighbour's data back).
  virtual void between_layers() {}
  /// Whether, in the micro-step begun, the hooks enqueue nothing and keep no host state that a
  /// model could skip: then a model may record its forward and backward once into a device graph
  /// and replay it without calling them (Backend::capture).
  virtual bool capturable() const { return false; }
  /// Asked by a model that records its micro-steps into device graphs (ImageModel with CUDA
  /// graphs) while capturable() is false: the hooks may give up what makes them uncapturable — a
  /// data-parallel strategy then all-reduces the gradients in finish_gradients, right after the
  /// last micro-step's replay, instead of during backward. Returns capturable() afterwards.
  virtual bool allow_capture() { return capturable(); }

  // ---- tied-embedding gradient hand-off ------------------------------------------------------
  // A model whose last layer reads its first layer's token embedding (GPT-2's LM head is tied to
  // wte [V, C]) writes that gradient twice in backward: the head first, the embedding last. So a
  // strategy that reduces gradients during backward could only reduce wte after the whole
  // backward. Instead it may reduce wte as soon as the head's after_backward() ran, and take the
  // embedding's contribution as the rows it would scatter (B·T·C, far fewer than V·C): it
  // all-gathers every rank's rows and token ids and scatter-adds them into the reduced gradient
  // (parallel/tied_embedding_grad.h).

  /// Asked by such a model before a full backward over all its layers (the head's backward not
  /// started yet), `rows` = B·T tokens of the micro-batch. True: the hooks take over the
  /// embedding's contribution to the tied gradient in this backward — the model's embedding then
  /// leaves wte's gradient alone (it may be under reduction) and calls tied_embedding_grad()
  /// once instead. False (the default): the embedding scatters into wte's gradient as usual.
  virtual bool take_tied_embedding_grad(int64_t /*rows*/) { return false; }
  /// The embedding's contribution to the tied gradient, after take_tied_embedding_grad()
  /// returned true: dwte[tokens[r], :] += dx[r, :] for every row r is what is owed.
  /// dx [rows, C] in the compute dtype: ∂L/∂(wte[tokens] + wpe) with the embedding dropout's
  /// mask already applied; tokens [rows] int32; both on the device. Called from the embedding's
  /// backward, before after_backward(0); both tensors stay valid and untouched until the
  /// strategy's finish_gradients() (the next forward overwrites them).
  virtual void tied_embedding_grad(Tensor /*dx*/, Tensor /*tokens*/) {}
};

/// One micro-batch in host memory. Language models read `tokens` [batch · seq_len] and
/// next-token `targets` [batch · seq_len]; image classifiers read `images` [batch, C, H, W] fp32
/// (normalized) and `targets` [batch] (class indices). Pointers stay valid until forward returns.
struct ModelInput {
  int64_t batch = 0;
  int64_t seq_len = 0;  ///< tokens per sample (language models); 0 for images
  const int32_t* tokens = nullptr;
  const float* images = nullptr;  ///< image models: [batch, C, H, W] fp32, normalized
  /// Image models, instead of `images`: [batch, C, H, W] uint8 pixels as decoded and augmented,
  /// normalized on the model's device as p·pixel_affine[c] + pixel_affine[C + c]
  /// (ImageTransform::affine in data/image_dataset.h).
  const uint8_t* pixels = nullptr;
  const float* pixel_affine = nullptr;
  const int32_t* targets = nullptr;
  /// The micro-batch's dropout seed (micro_batch_dropout_seed in model/gpt2.h): training draws
  /// its masks (dropout, stochastic depth) from it, identically in the micro-batch's forward,
  /// recompute and backward.
  uint64_t dropout_seed = 0;
};

/// A model's non-trained fp32 state tensor (batch norm's running_mean / running_var), saved in
/// checkpoints next to the parameters but kept by the model itself, not by the strategy.
struct ModelBuffer {
  std::string name;  ///< torchvision's state-dict name, e.g. "features.1.running_mean"
  int64_t numel = 0;
};

class Model {
 public:
  virtual ~Model() = default;

  /// "gpt2-medium", "mobilenet_v2", ...
  virtual std::string name() const = 0;
  virtual const ParamLayout& layout() const = 0;
  int num_layers() const { return layout().num_layers(); }
  virtual Backend& backend() = 0;

  /// Binds every layer to the whole flat buffers (params [numel], grads [numel] or empty), in
  /// the backend's compute dtype.
  virtual void bind(const Tensor& params, const Tensor& grads) = 0;
  /// Binds layer `layer` alone to `params`/`grads` holding exactly its range `r` (ZeRO-3's
  /// gathered copy); grads may be empty.
  virtual void bind_layer(int layer, const LayerRange& r, Tensor params, Tensor grads) = 0;
  /// The model's initialization into a host fp32 buffer of layout().numel() elements, each
  /// tensor from its own stream seeded by (seed, tensor name) so that sharding does not change it.
  virtual void init_parameters(float* host_params, uint64_t seed) const = 0;

  /// The model's state buffers in order (none for GPT-2). Their values, concatenated, are what
  /// read_state_buffers()/write_state_buffers() move: Σ numel fp32 values.
  virtual std::vector<ModelBuffer> state_buffers() const { return {}; }
  /// Copies this rank's buffers (Σ state_buffers() numel fp32, in order) to host memory `dst`.
  virtual void read_state_buffers(float* /*dst*/) {}
  /// Overwrites this rank's buffers from host memory `src` (layout as read_state_buffers).
  virtual void write_state_buffers(const float* /*src*/) {}

  void set_hooks(LayerHooks* hooks) { hooks_ = hooks; }
  LayerHooks* hooks() const { return hooks_; }

  /// Forward over all layers; returns the micro-batch's mean loss. With for_backward, keeps what
  /// backward() needs and seeds the output gradient with `grad_scale` (∂objective/∂(per-sample
  /// or per-token loss)).
  virtual double forward(const ModelInput& input, float grad_scale, bool for_backward) = 0;
  /// Backward over all layers after forward(..., for_backward=true); accumulates into grads.
  virtual void backward() = 0;
  /// forward(input, grad_scale, true) then backward() of one training micro-batch, in one call
  /// so that a model can replay them as one recorded device graph (ImageModel on CUDA). Returns
  /// the micro-batch's mean loss. The pointers of `input` must stay valid until it returns.
  virtual double train_micro_batch(const ModelInput& input, float grad_scale) {
    const double loss = forward(input, grad_scale, true);
    backward();
    return loss;
  }

  // ---- layer-major forward (several micro-batches per layer) ---------------------------------
  // A step's first micro-batches may run their forward layer by layer — layer 0 of every one of
  // them, then layer 1, … — before each finishes (its loss, then its backward) in turn. The
  // arithmetic of every micro-batch, and the order in which their gradients accumulate, are those
  // of forward()/backward() one micro-batch after the other: the results are the same bit for
  // bit. What changes is when each layer's parameters are first read: the k-th layer is needed
  // only after the layers before it have run on all the micro-batches, so a parameter update
  // that lands layer by layer (an offloaded optimizer's host step) overlaps a forward G times
  // longer (GreedySnake, arXiv 2512.17570: "vertical" scheduling of micro-batches).

  /// Whether forward_layer_major() can run now (GPT-2 under activation checkpointing).
  virtual bool supports_layer_major_forward() const { return false; }
  /// Sets micro-batch k (0, 1, … in order) of the next forward_layer_major() for training, as
  /// forward(input, grad_scale, true) would: copies its data (the pointers need not outlive the
  /// call).
  virtual void stage_micro_batch(int /*k*/, const ModelInput& /*input*/, float /*grad_scale*/) {
    throw std::logic_error("stage_micro_batch: not supported by this model");
  }
  /// Forward of every layer but the last (the head) for the `count` micro-batches staged,
  /// layer-major: the hooks' before_forward(i) and after_forward(i) run once around layer i of
  /// all of them. Keeps each micro-batch's layer inputs (count · layers · B·T·C elements in the
  /// compute dtype) until it is finished.
  virtual void forward_layer_major(int /*count*/) {
    throw std::logic_error("forward_layer_major: not supported by this model");
  }
  /// The head's forward of micro-batch k of the last forward_layer_major(); returns its mean
  /// loss. Then backward_layer_major(k), before the next k (0, 1, … in order).
  virtual double forward_head_layer_major(int /*k*/) {
    throw std::logic_error("forward_head_layer_major: not supported by this model");
  }
  /// The whole backward of micro-batch k, as backward() after its forward.
  virtual void backward_layer_major(int /*k*/) {
    throw std::logic_error("backward_layer_major: not supported by this model");
  }
  /// Instead of forward_head_layer_major(k) and backward_layer_major(k) for k = 0 … count−1:
  /// the head (forward, then backward) of every micro-batch, then the backward of each layer
  /// below it for all of them, the last layer first (layer-major backward). The hooks'
  /// before_backward(i) and after_backward(i) run once around layer i of all micro-batches, so
  /// each layer's gradient is final (Σ over the micro-batches) at its after_backward — most of
  /// a step's backward earlier than after a micro-batch-major backward, which is what lets an
  /// offloaded optimizer start each part's update while the layers below are still computed.
  /// Every gradient is the same sum in the same order as micro-batch by micro-batch, except a
  /// weight two layers write (GPT-2's tied wte: all heads first, then all embeddings): the same
  /// to fp32 rounding. Returns Σ_k of micro-batch k's mean loss (k in order). Needs no memory
  /// beyond what forward_layer_major(count) kept.
  virtual double head_and_backward_layer_major(int /*count*/) {
    throw std::logic_error("head_and_backward_layer_major: not supported by this model");
  }

  /// Dense FLOPs of one training step's forward + backward per sample (6·N·T-style analytic
  /// count), for MFU.
  virtual double train_flops_per_sample(int64_t seq_len) const = 0;

 protected:
  LayerHooks* hooks_ = nullptr;
};

}  // namespace shardtrain
