// The trainer skeleton every model family runs (train/training_run.h).
#include "train/training_run.h"

#include <fmt/core.h>

#include <utility>

#include "config/knob.h"
#include "core/error.h"
#include "train/rank_agreement.h"
#include "train/strategy_from_config.h"
#include "train/trainer.h"

namespace shardtrain {
namespace {

/// Calls `f` when the scope ends, however it ends.
template <typename F>
class AtScopeEnd {
 public:
  explicit AtScopeEnd(F f) : f_(std::move(f)) {}
  AtScopeEnd(const AtScopeEnd&) = delete;
  AtScopeEnd& operator=(const AtScopeEnd&) = delete;
  ~AtScopeEnd() { f_(); }

 private:
  F f_;
};

}  // namespace

TrainConfig ModelFamily::place(const TrainConfig& cfg, Backend& /*backend*/, Communicator& /*comm*/,
                               Console& /*out*/) {
  throw ConfigError(fmt::format(
      "{} auto does not plan model '{}' (validate() refuses it: call it first)",
      knob_for(&TrainConfig::placement, &PlacementConfig::automatic).name(), cfg.model));
}

std::unique_ptr<Strategy> ModelFamily::make_strategy(const TrainConfig& cfg, Backend& backend,
                                                     Communicator& comm) {
  return shardtrain::make_strategy(cfg, backend, comm);
}

void run_training(ModelFamily& family, const TrainConfig& requested, Communicator& comm) {
  Console out(comm.rank() == 0);

  // ---- model and device; --offload auto places the state before anything is allocated ----
  family.prepare(requested, out);
  std::unique_ptr<Backend> backend =
      make_backend(requested.device, local_rank_of(comm), requested.precision);
  // Collectives must start after the kernels that produce their inputs (the backend computes on
  // its own non-default stream), and must not use that stream once the backend (declared before
  // this guard) destroys it. Set before the first collective: on the legacy default stream an
  // all-gather would not wait for the copy of its input.
  ComputeStreamScope compute_stream(comm, *backend);
  // The family's model and data hold device and pinned memory of the backend: freed first.
  const AtScopeEnd release_family([&family]() noexcept { family.release(); });
  check_ranks_agree(requested, family.agreement_shape(requested), *backend, comm);  // first
  const TrainConfig cfg =
      requested.placement.automatic ? family.place(requested, *backend, comm, out) : requested;
  LossScaler scaler(cfg.loss_scale, backend->compute_dtype() == DType::kF16);
  family.build_model(cfg, *backend, comm, out);
  const std::optional<CheckpointInfo> resume = family.read_resume(cfg);
  const RunPlan plan = family.plan(cfg, comm, out);

  // ---- parameters and strategy: resuming loads each rank's own ranges of the checkpoint into
  // zeroed buffers, so no rank holds the full fp32 parameters ----
  std::unique_ptr<Strategy> strategy = family.make_strategy(cfg, *backend, comm);
  // The family's steps (start_loop) hold the strategy: freed before it.
  const AtScopeEnd end_loop([&family]() noexcept { family.end_loop(); });
  family.set_up_parameters(*strategy, cfg, resume.has_value());
  TrainingProgress progress;
  progress.seed = cfg.seed;
  if (resume) {
    progress =
        resume_from(*resume, family.model().layout(), *strategy, comm, scaler, plan.total_steps);
    family.after_resume(*resume, comm.rank());
  }
  const std::optional<int64_t> continue_after =
      logs_continue_after(resume.has_value(), progress.step);
  MetricsWriter metrics = open_run_metrics(cfg, comm.rank() == 0, out, continue_after);
  Monitor monitor =
      open_run_monitor(cfg, comm.rank(), config_snapshot(cfg).dump(2), continue_after);
  const RunContext run{cfg,
                       comm,
                       *backend,
                       out,
                       scaler,
                       *strategy,
                       plan,
                       progress,
                       metrics,
                       monitor,
                       resume ? &*resume : nullptr};
  family.announce(run);

  // ---- checkpoints ----
  std::string checkpoint;
  auto save = [&] {
    if (!cfg.save_checkpoints) return;
    checkpoint = family.save(run);
    out.line("saved checkpoint {}", checkpoint);
  };

  // ---- the loop ----
  // wall_clock_breakdown: device time of each phase, summed over the log window, in seconds.
  std::unique_ptr<StreamClock> clock =
      cfg.wall_clock_breakdown ? backend->make_stream_clock() : nullptr;
  const bool on_gpu = backend->kind() == DeviceKind::kCUDA;
  StepLog step_log(out, metrics, monitor, cfg, family.throughput(run), comm.world_size(), on_gpu,
                   plan.total_steps);
  ScalarAllReduce rank_scalars(*backend, comm, 2);
  EpochLoop loop{.cfg = cfg,
                 .out = out,
                 .metrics = metrics,
                 .monitor = monitor,
                 .backend = *backend,
                 .reduce = rank_scalars,
                 .strategy = *strategy,
                 .scaler = scaler,
                 .step_log = step_log,
                 .steps_per_epoch = plan.steps_per_epoch,
                 .total_steps = plan.total_steps,
                 .warmup = plan.warmup,
                 .samples_per_step = plan.global_batch};
  family.start_loop(run, loop, clock.get());
  loop.step = [&](int64_t epoch, double lr) {
    family.before_step(run);
    return family.step(run, epoch, lr);
  };
  loop.evaluate = [&](int64_t epoch) { family.evaluate(run, epoch); };
  loop.after_step = [&] {
    family.after_step(run);
    if (cfg.save_interval > 0 && progress.step % cfg.save_interval == 0 &&
        progress.step < plan.total_steps)
      save();
  };
  const int64_t first_step = progress.step;
  const auto t_train = TrainClock::now();
  LossHistory losses = run_epochs(loop, progress);

  // ---- the end ----
  const bool trained = !losses.all.empty();
  family.finish(run, std::move(losses), seconds_since(t_train), first_step);
  if (trained || !resume) save();
  family.report_done(run, checkpoint);
}

}  // namespace shardtrain
