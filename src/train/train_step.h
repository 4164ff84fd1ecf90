// TrainStep: one optimizer step of data-parallel / ZeRO training, in one place.
//
//   zero_grad → for each micro-batch k: begin_micro_step(k), forward, backward
//   → finish_gradients → global gradient norm → fp16 overflow check (skip) → clipping
//   → strategy step → loss averaged over the global batch (all ranks, all micro-batches)
//
// The trainer (train/trainer.cpp) and the MPI tests (tests/mpi/test_zero_equivalence.cpp) both
// run their steps through it; each feeds micro-batches its own way (MicroBatchSource). A pipeline
// schedule will supply its own step object behind the same result type.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "comm/scalar_all_reduce.h"
#include "memory/flat_buffer.h"
#include "model/gpt2.h"
#include "optim/loss_scaler.h"
#include "parallel/strategy.h"

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

/// Device time of the phases of one or more optimizer steps (DeepSpeed wall_clock_breakdown), in
/// seconds: forward (with zeroing the gradients and preparing the batch), backward (with the
/// reductions it launches), the wait for the gradient reductions still running after backward
/// (Strategy::finish_gradients) and the optimizer (gradient norm, clipping, update, and for ZeRO
/// the all-gather of the updated parameters).
struct PhaseTimes {
  double forward = 0, backward = 0, reduce_wait = 0, optimizer = 0;

  /// From the intervals between the marks of one step: [forward, backward] per micro-step, then
  /// the reduction wait and the optimizer.
  static PhaseTimes from_marks(const std::vector<double>& t);
  PhaseTimes& operator+=(const PhaseTimes& o);
  PhaseTimes scaled(double f) const;
};

/// The narrow options of a step.
struct TrainStepOptions {
  int64_t accumulation_steps = 1;  ///< micro-batches per optimizer step on each rank (≥ 1)
  double gradient_clipping = 0;    ///< max global L2 norm of the mean gradient; 0 = off
  /// The run's seed, from which each micro-batch's dropout seed is drawn
  /// (micro_batch_dropout_seed(seed, data-parallel rank, step, micro-batch index)).
  uint64_t dropout_seed = 0;
};

/// What one step did.
struct StepResult {
  /// Mean per-token loss over the global batch (every micro-batch of every rank; the same value
  /// on every rank). The loss of the parameters before the update.
  double loss = 0;
  /// Global L2 norm of the mean gradient, before clipping (inf or NaN: fp16 overflow).
  double grad_norm = 0;
  bool skipped = false;   ///< fp16 overflow: the optimizer step was skipped, the scale lowered
  double loss_scale = 1;  ///< the fp16 loss scale the step ran with (1 without fp16)
  double clip_coef = 1;   ///< factor applied to the gradients by clipping (1 = not clipped)
  /// Device time of the phases; set when the step was given a StreamClock.
  std::optional<PhaseTimes> phases;
};

/// The end of a step whose gradients are complete and whose global gradient norm is in
/// r.grad_norm (r.loss_scale: the fp16 scale they carry): the loss scaler's overflow check
/// (r.skipped), clipping to `clip` (0 = off; r.clip_coef) and `update(mean_scale · clip
/// coefficient)`. Shared by TrainStep and the pipeline (parallel/pipeline/pipeline_parallel.h).
/// Throws RuntimeFailure when the gradients are non-finite without fp16 (training diverged),
/// naming step + 1 and the learning rate.
void clip_and_update(StepResult& r, int64_t step, double lr, double clip, double mean_scale,
                     LossScaler& scaler, const std::function<void(double)>& update);
/// Throws RuntimeFailure when r.loss is not finite (training diverged), naming the step.
void check_loss_finite(const StepResult& r, int64_t step, double lr);

class TrainStep {
 public:
  /// All references must outlive the TrainStep. `strategy` must be set up on `model` already.
  /// `clock` (nullable): marks the phases of each step (wall_clock_breakdown). Throws ConfigError
  /// for accumulation_steps < 1 or a negative gradient_clipping.
  TrainStep(Model& model, Strategy& strategy, Communicator& comm, Backend& backend,
            LossScaler& scaler, TrainStepOptions options, StreamClock* clock = nullptr);

  /// Runs optimizer step number `step` (0-based, for messages) at learning rate `lr` on the
  /// micro-batches `batches` gives. Collective. Returns when the step's device work finished.
  /// Throws RuntimeFailure when the gradients (without fp16) or the loss become non-finite
  /// (training diverged), naming the step and the learning rate.
  StepResult run(int64_t step, double lr, const MicroBatchSource& batches);
  /// Replaces the phase clock (nullable) for the following steps (the FLOPs profiler's step).
  void set_clock(StreamClock* clock) { clock_ = clock; }
  StreamClock* clock() const { return clock_; }

 private:
  Model& model_;
  Strategy& strategy_;
  Communicator& comm_;
  Backend& backend_;
  LossScaler& scaler_;
  TrainStepOptions options_;
  StreamClock* clock_;
  ScalarAllReduce loss_sum_;
};

}  // namespace shardtrain
