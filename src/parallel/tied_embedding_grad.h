// The tied-embedding gradient exchange: how a strategy that all-reduces gradients during backward
// keeps GPT-2's tied wte [V, C] from being reduced only after the whole backward.
//
// The LM head writes its part of wte's gradient first in backward and the embedding adds its
// part last, so the bucket holding wte is complete only at the very end: V·C elements (51 M for
// gpt2-medium, 80 M for gpt2-xl) of all-reduce exposed after every step (dp on 2 H200s: 0.93 of
// one GPU's per-GPU tokens/s). Instead, on the last micro-step:
//   1. after the head's backward, wte's gradient (the earlier micro-steps' full contributions
//      plus this one's LM-head part) is all-reduced on its own, overlapping the rest of backward;
//   2. the embedding does not scatter into it (LayerHooks::take_tied_embedding_grad): it hands
//      over its output gradient dx [B·T, C] and token ids [B·T], which are all-gathered from
//      every rank (world·B·T·C elements: 2 M per rank for gpt2-medium at 4 × 512, 25× fewer than
//      wte's 51 M);
//   3. finish() waits for both and scatter-adds every rank's rows into the reduced gradient with
//      the backend's embedding backward — the sum over ranks the whole-bucket all-reduce gave.
// The idea is the usual one for sparse embedding gradients — exchange the rows, not the table
// (Horovod all-gathers the values and indices of TensorFlow's IndexedSlices gradients instead of
// all-reducing them, Sergeev & Del Balso, arXiv 1802.05799) — applied to the embedding's part
// only: the tied LM head's part is dense, and is reduced early.
//
// The strategy keeps the whole-bucket path (the exchange inactive) on one rank, without
// overlap_comm, and for models that are not tied this way (a pipeline stage).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "memory/flat_buffer.h"
#include "memory/param_layout.h"

namespace shardtrain {

/// The exchange of one strategy (dp's, data_parallel.cpp). The strategy all-reduces the slice
/// [offset(), offset() + numel()) of its gradient buffer from the reader layer's after_backward()
/// while active(), leaves those elements out of the bucket that holds the embedding, and calls
/// finish() after waiting for that all-reduce.
class TiedEmbeddingGrad {
 public:
  TiedEmbeddingGrad() = default;
  /// Enabled when the communicator has several ranks, `overlap_comm` is set and `layout` is
  /// GPT-2's whole model: layer 0's first tensor "transformer.wte.weight" [V, C] is read by the
  /// last layer and no other tie exists.
  TiedEmbeddingGrad(Backend& backend, Communicator& comm, const ParamLayout& layout,
                    bool overlap_comm);

  bool enabled() const { return enabled_; }
  /// The layer whose after_backward() completes the early part (the head), and the one that holds
  /// the tied tensor (the embedding, 0); -1 when disabled.
  int reader_layer() const { return reader_; }
  int source_layer() const { return enabled_ ? 0 : -1; }
  /// wte's elements in the flat layout [offset, offset + numel); layer 0 starts with it.
  int64_t offset() const { return offset_; }
  int64_t numel() const { return numel_; }

  /// LayerHooks::take_tied_embedding_grad for a backward whose gradients are reduced (the last
  /// micro-step): true when enabled. The first call, and any call with another `rows` than the
  /// last checked, checks over the ranks (collective; one small device sync) that every rank
  /// hands over the same number of rows — the all-gathers need it; dp's micro-batches are
  /// [micro_batch, seq_len] on every rank — and throws RuntimeFailure naming the counts if not.
  /// Until finish(), active() is true.
  bool take(int64_t rows);
  bool active() const { return active_; }
  /// LayerHooks::tied_embedding_grad: starts the all-gathers of dx [rows, C] (compute dtype) and
  /// tokens [rows] int32 from every rank, in rank order.
  void gather(Tensor dx, Tensor tokens);
  /// After the all-reduce of `dwte` (wte's gradient [V·C] in the compute dtype, a slice of the
  /// strategy's gradient buffer) has been waited for: waits for the all-gathers and adds every
  /// rank's rows into dwte. Ends the exchange (active() false).
  void finish(Tensor dwte);

  /// Bytes of the gather buffers (world·rows·(C·dtype + 4)), allocated at the first take().
  size_t bytes() const { return dx_.bytes() + tokens_.bytes(); }

 private:
  Backend* backend_ = nullptr;
  Communicator* comm_ = nullptr;
  bool enabled_ = false;
  int reader_ = -1;
  int64_t offset_ = 0, numel_ = 0, vocab_ = 0, channels_ = 0;
  int64_t checked_rows_ = 0;  ///< rows every rank agreed on at the last check
  bool active_ = false, gathered_ = false;
  FlatBuffer dx_, tokens_;  ///< [world·rows·C] compute dtype, [world·rows] int32
  std::vector<std::unique_ptr<Work>> pending_;
};

}  // namespace shardtrain
