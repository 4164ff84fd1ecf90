// What one optimizer step reports (loss, gradient norm, fp16 skips, clipping, phase times), its
// options, and the end every step shares: the overflow check, clipping and the update. Used by
// TrainStep (train/train_step.h) and the pipeline's step (parallel/pipeline/pipeline_parallel.h).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "optim/loss_scaler.h"

namespace shardtrain {

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
  /// Micro-batches at the start of each step whose forward runs layer-major (Model's
  /// forward_layer_major: layer 0 of all of them, then layer 1, …) when the model and the strategy
  /// allow it; 1 = each micro-batch on its own. The results are the same bit for bit; what
  /// changes is how long the forward overlaps a parameter update that lands layer by layer.
  int64_t forward_group = 1;
  /// Whether an offloaded optimizer may start the update during the last micro-step's backward,
  /// before the gradient norm is known (Strategy::expect_update): the step's update assumed
  /// unclipped, redone in step() when clipping changes it. Not with fp16 loss scaling.
  bool speculative_update = false;
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

}  // namespace shardtrain
