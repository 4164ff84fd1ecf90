// TrainStep: one optimizer step of data-parallel / ZeRO training, in one place.
//
//   zero_grad → for each micro-batch k: begin_micro_step(k), forward, backward
//   → finish_gradients → global gradient norm → fp16 overflow check (skip) → clipping
//   → strategy step → loss averaged over the global batch (all ranks, all micro-batches)
//
// With a forward group (TrainStepOptions::forward_group) the first micro-batches' forwards run
// layer-major; when the group is the whole step, so does the backward, as one last micro-step.
// With speculative_update the strategy is told the likely update (lr, unclipped scale) before the
// last micro-step (Strategy::expect_update), and told to undo it when step() is not called; not
// after a clipped step (the next one is likely clipped too).
//
// The trainer (train/trainer.cpp) and the MPI tests (tests/mpi/test_zero_equivalence.cpp) both
// run their steps through it; each feeds micro-batches its own way (MicroBatchSource). A pipeline
// schedule runs its own step (train/pipeline_step.h) behind the same StepRunner interface, with the
// same micro-batch and result types (model/micro_batch.h, parallel/step_result.h).
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
#include "model/micro_batch.h"
#include "monitor/step_trace.h"
#include "optim/loss_scaler.h"
#include "parallel/step_result.h"
#include "parallel/strategy.h"
#include "train/step_runner.h"

namespace shardtrain {

class TrainStep final : public StepRunner {
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
  /// The StepRunner's call: the same step (`next` is not used: each step stands alone).
  StepResult run(int64_t step, double lr, const MicroBatchSource& batches,
                 const MicroBatchSource* /*next*/) override {
    return run(step, lr, batches);
  }
  /// Records each layer's forward and backward on the compute stream into `trace` (nullable:
  /// stop) in the following steps, as GPU-compute segments of the step timeline (--trace).
  void set_trace(StepTrace* trace) { trace_ = trace; }
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
  /// The step itself (run() wraps the model's hooks around it while tracing).
  StepResult run_step(int64_t step, double lr, const MicroBatchSource& batches);
  bool last_clipped_ = false;  ///< the last step's update was clipped (no speculation next)
  StepTrace* trace_ = nullptr;
};

}  // namespace shardtrain
