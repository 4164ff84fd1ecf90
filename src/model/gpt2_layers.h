// The three layer kinds of GPT-2 (model/gpt2.h): the embedding, the pre-LN transformer block and
// the head (ln_f, the LM head tied to wte, softmax cross-entropy), each with its forward and
// backward side by side. GPT2Model builds them; nothing else needs their types.
//
// Activation slots. A layer keeps what its backward needs in an activation set; a pipeline stage
// holds several micro-batches in flight, so each layer has one set per slot (use_slot() picks
// it, the memory of a slot is allocated at its first reserve()). The layers of one model share
// one set of transient scratch buffers (BlockScratch) across slots.
//
// Split backward (zero-bubble pipelines, Qi et al., arXiv 2401.10241 §2): backward_input() is
// the input-gradient pass B — the residual gradient only, with each linear layer's and
// LayerNorm's output gradient stashed in the slot — and backward_weight() the weight-gradient pass
// W, which accumulates the parameter gradients from the stash. B then W gives bit-for-bit the
// gradients of backward(): the same GEMMs with the same operands.
#pragma once

#include <memory>
#include <vector>

#include "model/gpt2.h"

namespace shardtrain {

struct BlockActivations;  // gpt2_layers.cpp
struct BlockScratch;

/// The tied token embedding the head reads: wte [V, C] and its gradient, in the compute dtype.
/// The embedding layer's own views, or (a pipeline's last stage) a copy set by the model.
struct TiedEmbedding {
  const Tensor* wte = nullptr;   ///< [V, C]
  const Tensor* dwte = nullptr;  ///< [V, C], accumulated into by the head's backward
};

/// Builds layer `id` of `config` (0 = embedding, 1..n_layer = block id-1, n_layer+1 = head).
/// `tied`: where the head finds wte (read at each forward/backward, so rebinding the embedding
/// is seen). `checkpointing`: blocks keep only
/// their input and recompute the rest in backward (Chen et al., arXiv 1604.06174), sharing one
/// recomputed set `shared` (null without checkpointing) and the scratch `scratch`. When
/// `head_places_shared` the head's logits memory hosts the shared set and the scratch (one slot
/// only: blocks and the head's logits are never live at once); otherwise the first block owns it.
struct LayerFactory {
  const GPT2Config& config;
  TiedEmbedding tied;
  bool checkpointing;
  bool head_places_shared;
  std::shared_ptr<BlockActivations> shared;
  std::shared_ptr<BlockScratch> scratch;

  std::unique_ptr<Layer> make(int id, bool owns_shared) const;
};

/// A factory with fresh shared buffers (the recomputed set only under checkpointing); `tied`
/// starts at the model's external wte (GPT2Model::set_tied_embedding).
LayerFactory make_layer_factory(const GPT2Config& config, TiedEmbedding tied, bool checkpointing,
                                bool head_places_shared);

/// Pointers to the embedding layer's wte and dwte views (stable while the layer lives).
TiedEmbedding embedding_views(const Layer& embedding);

/// The embedding's backward without its token part, for the tied-embedding hand-off
/// (LayerHooks::take_tied_embedding_grad): multiplies `dresid` [B,T,C] in place by the forward's
/// dropout mask/(1-p) (when dropout is on), so that it holds ∂L/∂(wte[tokens] + wpe), and
/// accumulates wpe's gradient from it; wte's gradient is not touched.
void embedding_backward_positions(Backend& be, Layer& embedding, StepContext& ctx, Tensor dresid);

/// Host copy of the logits row `row` (V floats) of the head's last forward in its current slot.
std::vector<float> head_logits_row(Backend& be, Layer& head, int64_t row);

}  // namespace shardtrain
