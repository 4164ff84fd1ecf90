// One trainer skeleton for every model family. The order of a run — the backend and the ranks'
// agreement, --offload auto's placement, the model, --resume, the data and the run's length, the
// strategy and its parameters, the monitors and the banner, the epoch loop with its evaluations
// and checkpoints, the end — is written once, in run_training; a ModelFamily brings what differs
// (GPT-2: trainer.cpp; image classifiers: image_trainer.cpp). A feature of the skeleton reaches
// every family that has what it needs; one a family lacks (the pipeline and --offload auto need a
// GPT-2 model) is refused in one place, validate()'s check_model_family (config/validate.cpp),
// before any work.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "backend/backend.h"
#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "comm/scalar_all_reduce.h"
#include "config/config.h"
#include "model/model.h"
#include "monitor/metrics.h"
#include "monitor/monitor.h"
#include "optim/loss_scaler.h"
#include "parallel/strategy.h"
#include "train/train_common.h"

namespace shardtrain {

/// What the family's hooks get once the run is set up (references into run_training's frame).
struct RunContext {
  const TrainConfig& cfg;  ///< as run: after --offload auto's placement
  Communicator& comm;
  Backend& backend;
  Console& out;
  LossScaler& scaler;
  Strategy& strategy;
  const RunPlan& plan;
  TrainingProgress& progress;
  MetricsWriter& metrics;
  Monitor& monitor;
  /// The resumed checkpoint, or null.
  const CheckpointInfo* resume = nullptr;
  bool rank0() const { return comm.rank() == 0; }
};

/// What a model family brings to run_training, called in the order declared here.
class ModelFamily {
 public:
  virtual ~ModelFamily() = default;

  // ---- set-up ----
  /// Before the backend: what needs no device (the image data set; the GPT-2 shape).
  virtual void prepare(const TrainConfig& cfg, Console& out) = 0;
  /// What the ranks must agree on besides the configuration (check_ranks_agree): the model's
  /// resolved shape, or its name.
  virtual std::string agreement_shape(const TrainConfig& cfg) const = 0;
  /// --offload auto: `cfg` with the plan that fits this machine (a family validate() lets through
  /// with it overrides this).
  virtual TrainConfig place(const TrainConfig& cfg, Backend& backend, Communicator& comm,
                            Console& out);
  /// Builds the model on `backend` and checks the run against it.
  virtual void build_model(const TrainConfig& cfg, Backend& backend, Communicator& comm,
                           Console& out) = 0;
  /// The model build_model built.
  virtual Model& model() = 0;
  /// The checkpoint --resume names, checked to hold this very model; nullopt without --resume.
  virtual std::optional<CheckpointInfo> read_resume(const TrainConfig& cfg) = 0;
  /// Loads what is left of the data and plans the run's length over the data-parallel
  /// replicas.
  virtual RunPlan plan(const TrainConfig& cfg, Communicator& comm, Console& out) = 0;
  /// The strategy of `cfg` (make_strategy; a family with a pipeline builds it here).
  virtual std::unique_ptr<Strategy> make_strategy(const TrainConfig& cfg, Backend& backend,
                                                  Communicator& comm);
  /// Sets the strategy up on the model: zeroed when `resuming` (the checkpoint is loaded next),
  /// else from --init-from or the model's initialization.
  virtual void set_up_parameters(Strategy& strategy, const TrainConfig& cfg, bool resuming) = 0;
  /// After the checkpoint's state is loaded into the strategy: what else it holds (batch-norm
  /// statistics).
  virtual void after_resume(const CheckpointInfo& /*ck*/, int /*rank*/) {}
  /// The start-up banner (rank 0 prints) and run.json (rank 0 writes).
  virtual void announce(const RunContext& run) = 0;

  // ---- the loop ----
  /// What a step's throughput counts (tokens or images) for the step log.
  virtual Throughput throughput(const RunContext& run) const = 0;
  /// Sets up the steps (readers, TrainStep) and fills `loop`'s per-family numbers
  /// (units_per_step, seq_len, bar_unit); `clock`: wall_clock_breakdown's device clock, or null.
  virtual void start_loop(const RunContext& run, EpochLoop& loop, StreamClock* clock) = 0;
  /// Runs the optimizer step run.progress.step of `epoch` at `lr`. Collective.
  virtual StepResult step(const RunContext& run, int64_t epoch, double lr) = 0;
  /// Before and after each step (GPT-2's --trace window); after_step before the save interval.
  virtual void before_step(const RunContext& /*run*/) {}
  virtual void after_step(const RunContext& /*run*/) {}
  /// Evaluates on the held-out data (collective), prints and records it under `epoch`.
  virtual void evaluate(const RunContext& run, int64_t epoch) = 0;
  /// Saves a sharded checkpoint of the run at run.progress; returns its directory. Collective.
  virtual std::string save(const RunContext& run) = 0;

  // ---- the end ----
  /// After the loop, before the last save: `losses` of this run's steps, `seconds` of its loop,
  /// from step `first_step` on (what the family reports of its strategy).
  virtual void finish(const RunContext& run, LossHistory losses, double seconds,
                      int64_t first_step) = 0;
  /// The run's last line, after the last save (`checkpoint`: its directory, or "").
  virtual void report_done(const RunContext& run, const std::string& checkpoint) = 0;

  // ---- teardown (also when a hook threw): device memory goes before its owner ----
  /// Frees what start_loop made (its steps hold the strategy): before the strategy goes.
  virtual void end_loop() noexcept = 0;
  /// Frees the model and the data (their device and pinned memory): before the backend goes.
  virtual void release() noexcept = 0;
};

/// Trains `family`'s model per `requested` (validated) on this rank of `comm`: the skeleton above.
/// Prints progress on rank 0 and writes metrics.jsonl, run.json and checkpoints under
/// cfg.output_dir. Throws the Error subclasses of the family's hooks.
void run_training(ModelFamily& family, const TrainConfig& requested, Communicator& comm);

}  // namespace shardtrain
