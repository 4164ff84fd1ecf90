// StepRunner: what the trainer calls once per optimizer step, whatever runs it — TrainStep
// (data parallelism and ZeRO: train/train_step.h) or PipelineStep (a pipeline schedule:
// train/pipeline_step.h). The trainer picks one at start-up and never asks which it has.
#pragma once

#include <cstdint>

#include "model/micro_batch.h"
#include "parallel/step_result.h"

namespace shardtrain {

class StepRunner {
 public:
  virtual ~StepRunner() = default;
  /// Runs optimizer step number `step` (0-based) at learning rate `lr` on the micro-batches
  /// `batches` gives (the step's gradient accumulation window). `next`: the next step's
  /// micro-batches, or null on the last step or before an evaluation; a schedule that starts
  /// the next step early (PipeDream-2BW) uses it, the others ignore it. Collective. Throws
  /// RuntimeFailure when training diverges (a non-finite loss or gradient without fp16).
  virtual StepResult run(int64_t step, double lr, const MicroBatchSource& batches,
                         const MicroBatchSource* next) = 0;
};

}  // namespace shardtrain
