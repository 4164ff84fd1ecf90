// The unit of data a training step consumes: one micro-batch of tokens or images, and the source
// a step draws its micro-batches from.
#pragma once

#include <cstdint>
#include <functional>

namespace shardtrain {

/// One micro-batch: host int32 tokens and next-token targets, [batch · seq_len] each, row-major
/// (language models), or images [batch, C, H, W] (fp32, or uint8 pixels) and class targets
/// [batch] (image models).
/// The pointers must stay valid until the model's forward returned.
struct MicroBatch {
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;
  int64_t batch = 0;    ///< samples B
  int64_t seq_len = 0;  ///< tokens per sample T (0 for images)
  const float* images = nullptr;
  /// Image models, instead of `images`: uint8 pixels and their normalization (ModelInput's).
  const uint8_t* pixels = nullptr;
  const float* pixel_affine = nullptr;
  /// Losses the micro-batch's mean is over: B·T tokens, or B images.
  int64_t loss_units() const { return seq_len > 0 ? batch * seq_len : batch; }
};

/// Gives micro-batch `k` (0 ≤ k < accumulation_steps) of the step being run. Every micro-batch of
/// a step, on every rank, must have the same B·T (the gradient and the loss average the
/// micro-batch means with equal weights).
using MicroBatchSource = std::function<MicroBatch(int64_t k)>;

}  // namespace shardtrain
