// PipelineStep: the pipeline strategy's optimizer step (parallel/pipeline/pipeline_parallel.h:
// its schedule run by the executor over every stage and replica) behind the trainer's
// StepRunner, beside TrainStep's data-parallel one.
#pragma once

#include "optim/loss_scaler.h"
#include "parallel/pipeline/pipeline_parallel.h"
#include "train/step_runner.h"

namespace shardtrain {

class PipelineStep final : public StepRunner {
 public:
  /// All references must outlive the PipelineStep; `pipeline` must be set up.
  PipelineStep(PipelineParallel& pipeline, LossScaler& scaler, TrainStepOptions options)
      : pipeline_(pipeline), scaler_(scaler), options_(options) {}

  /// One step of the pipeline's schedule over options.accumulation_steps micro-batches (M);
  /// PipelineParallel::run_step says what `next` does for PipeDream-2BW.
  StepResult run(int64_t step, double lr, const MicroBatchSource& batches,
                 const MicroBatchSource* next) override {
    return pipeline_.run_step(step, lr, batches, scaler_, options_, next);
  }

 private:
  PipelineParallel& pipeline_;
  LossScaler& scaler_;
  TrainStepOptions options_;
};

}  // namespace shardtrain
