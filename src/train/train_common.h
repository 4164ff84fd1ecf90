// What the GPT-2 trainer (train/trainer.cpp) and the image trainer (train/image_trainer.cpp)
// share: the rank-0 console, the step log and the epoch summary (console + metrics.jsonl +
// monitors), the metrics writer and monitors of a run, and small helpers.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "comm/scalar_all_reduce.h"
#include "config/config.h"
#include "data/dataset.h"
#include "monitor/metrics.h"
#include "monitor/monitor.h"
#include "optim/loss_scaler.h"
#include "parallel/strategy.h"
#include "train/train_step.h"

namespace shardtrain {

using TrainClock = std::chrono::steady_clock;

double seconds_since(TrainClock::time_point t0);

/// The process's peak resident set, bytes.
size_t peak_rss_bytes();

/// The GPU index of this rank: LOCAL_RANK as set by launchers (torchrun, shardtrain launch,
/// SLURM, mpirun), else the rank.
int local_rank_of(const Communicator& comm);

/// Whether this process's stdout ends at a terminal, so that a progress bar may be redrawn there.
bool stdout_is_terminal();

/// Prints on rank 0 only; a progress bar (stdout a terminal) is erased before each line.
class Console {
 public:
  explicit Console(bool active) : active_(active), tty_(active && stdout_is_terminal()) {}
  template <typename... Args>
  void line(fmt::format_string<Args...> f, Args&&... args) {
    if (!active_) return;
    clear_bar();
    fmt::print("{}\n", fmt::format(f, std::forward<Args>(args)...));
    std::fflush(stdout);
  }
  void warn(const std::string& msg);
  /// `unit`: what `rate` counts per second ("tok", "img").
  void bar(int64_t done, int64_t total, double loss, double rate, const char* unit = "tok");

 private:
  void clear_bar();
  bool active_, tty_;
  bool bar_shown_ = false;
};

/// What a run's throughput counts: tokens (language models) or images.
struct Throughput {
  std::string unit;           ///< "tokens" or "images": console "<unit>/s", metrics "<unit>_per_s"
  int64_t per_step = 0;       ///< units per optimizer step (global)
  double flops_per_unit = 0;  ///< training FLOPs per unit, for MFU
};

/// The step log: a console line and a metrics.jsonl record every `log_interval` steps (and at
/// the first and last step), with the means over the steps since the previous line: time,
/// throughput, MFU on GPUs and (wall_clock_breakdown) the device time of each phase. The monitors
/// get every step's loss, lr, grad norm (and fp16 loss scale), and the window's throughput with
/// each line.
class StepLog {
 public:
  StepLog(Console& out, MetricsWriter& metrics, Monitor& monitor, const TrainConfig& cfg,
          Throughput throughput, int world_size, bool on_gpu, int64_t total_steps);

  /// Records step number `progress.step` (just taken, in `seconds`, at learning rate `lr`);
  /// logs when it is due. `loss_scale`: the fp16 scale now (nullopt without fp16).
  void add(const StepResult& r, double seconds, double lr, const TrainingProgress& progress,
           int64_t epoch, std::optional<double> loss_scale, double host_step_seconds = 0);

 private:
  Console& out_;
  MetricsWriter& metrics_;
  Monitor& monitor_;
  const TrainConfig& cfg_;
  Throughput throughput_;
  int world_size_;
  bool on_gpu_;
  int64_t total_steps_;
  int step_digits_;
  // Since the last log line:
  double seconds_ = 0, loss_ = 0, host_step_ = 0;
  int64_t steps_ = 0;
  PhaseTimes phases_;
};

/// The steps of one epoch this run executed.
struct EpochStats {
  int64_t epoch = 0;      ///< 0-based
  bool complete = false;  ///< the epoch's data was used up (not cut by --max-steps)
  int64_t steps = 0;      ///< > 0
  double loss_sum = 0;    ///< Σ step losses
  double seconds = 0;
  double samples = 0;         ///< global samples trained on
  int64_t seq_len = 0;        ///< T (0: images; the summary gives images/s, not tokens/s)
  int64_t skipped_steps = 0;  ///< fp16 overflows so far
  double gathered_bytes = 0;  ///< Σ over the steps of the parameter bytes this rank all-gathered
  /// Σ over the steps of the bytes this rank all-reduced across nodes (where the strategy knows).
  double cross_node_bytes = 0;
  int64_t step = 0;  ///< the optimizer step at the epoch's end (the monitors' step)
};

/// The epoch summary: a console line and a metrics.jsonl record with throughput, peak memory
/// (the GPU's peak allocated bytes, or the process's peak resident set on CPU) of every rank, and
/// the parameter bytes all-gathered and the bytes all-reduced across nodes per step. Collective
/// (the ranks' peaks are gathered).
void log_epoch(Console& out, MetricsWriter& metrics, Monitor& monitor, Backend& backend,
               ScalarAllReduce& reduce, const EpochStats& e, const HostMemory& host);

/// The outer training loop both trainers run (GPT-2's and the image models'): epochs of optimizer
/// steps from `progress` on (a resumed run continues mid-epoch), the learning-rate schedule, the
/// progress bar and the step log, evaluation every cfg.eval_interval steps (0: at each epoch's
/// end), the epoch summary, and a last evaluation when the last step had none. What differs

/// The run's length and batch, from the sampler of `replicas` data-parallel replicas: optimizer
/// steps (--max-steps, else epochs × steps per epoch), LR warmup (--warmup-steps, else a tenth of
/// the steps up to 1000) and samples and tokens per step (tokens: × max_length).
struct RunPlan {
  int replicas = 1;          ///< data-parallel replicas (pipeline: world ÷ stages)
  int64_t global_batch = 0;  ///< samples per optimizer step, all replicas
  int64_t steps_per_epoch = 0, total_steps = 0, warmup = 0;
  int64_t tokens_per_step = 0;
};
RunPlan plan_run(const TrainConfig& cfg, const DistributedSampler& sampler, int replicas);

/// between the trainers comes in as callbacks.
struct EpochLoop {
  const TrainConfig& cfg;
  Console& out;
  MetricsWriter& metrics;
  Monitor& monitor;
  Backend& backend;
  ScalarAllReduce& reduce;  ///< for the epoch summary's per-rank peaks
  Strategy& strategy;
  const LossScaler& scaler;
  StepLog& step_log;
  int64_t steps_per_epoch = 0, total_steps = 0, warmup = 0;
  int64_t samples_per_step = 0;  ///< global batch (samples)
  int64_t units_per_step = 0;    ///< tokens (samples · T) or images per step: progress.tokens_seen
  int64_t seq_len = 0;           ///< T, or 0 for images (the epoch summary's throughput)
  const char* bar_unit = "tok";  ///< the progress bar's rate unit
  /// Runs the optimizer step progress.step (0-based) of `epoch` at learning rate `lr`.
  std::function<StepResult(int64_t epoch, double lr)> step = {};
  /// Evaluates on the held-out data after the steps so far, reporting it under `epoch`.
  std::function<void(int64_t epoch)> evaluate = {};
  /// After each step and its evaluation (GPT-2: the checkpoint interval); may be empty.
  std::function<void()> after_step = {};
};

/// One forward of a rank's evaluation (eval_micro_batches): samples [start, start + count) of
/// the held-out set, whose results count (`counted`) or are thrown away (a padding micro-batch).
struct EvalMicroBatch {
  int64_t start = 0;  ///< first sample index
  int64_t count = 0;  ///< samples, ≥ 1
  bool counted = true;
  bool operator==(const EvalMicroBatch&) const = default;
};

/// The evaluation forwards of rank `rank` of `world` over a held-out set of `samples` samples, in
/// micro-batches of up to `batch` samples. The samples are split into contiguous per-rank ranges
/// (even_split: the first samples % world ranks one sample longer); the rank's range is cut into
/// micro-batches of `batch` (the last one shorter), all counted. Every rank gets the same number
/// of micro-batches — ceil(ceil(samples / world) / batch), the count of rank 0's range — because
/// a strategy may run collectives inside forward (ZeRO-3 all-gathers each layer's parameters,
/// offloaded ZeRO-1/2 publishes the last update in the first forward after a step): a rank that
/// ran one forward fewer would miss collectives the others wait in (MPI crashes, NCCL hangs). A
/// rank whose range needs fewer (or is empty: samples < world) is padded with uncounted
/// micro-batches of one sample (sample 0), whose results the caller must drop. So the counted
/// micro-batches of all ranks cover [0, samples) exactly once, in order. Empty when samples is 0
/// (every rank). Throws ConfigError when batch < 1, world < 1, rank outside [0, world) or
/// samples < 0.
std::vector<EvalMicroBatch> eval_micro_batches(int64_t samples, int64_t batch, int world, int rank);

/// Every step's loss run_epochs() ran, in order.
struct LossHistory {
  double first = 0, last = 0;
  std::vector<double> all;
};

/// Runs `loop` until progress.step reaches loop.total_steps, advancing `progress` (step,
/// step_in_epoch, epoch, tokens_seen) as it goes. Collective where its callbacks are.
LossHistory run_epochs(const EpochLoop& loop, TrainingProgress& progress);

/// The fp16 loss scaler's state as a checkpoint records it (CheckpointInfo::loss_scaler):
/// {"scale", "hysteresis_left", "clean_steps", "skipped_steps"}; null when `scaler` is disabled.
nlohmann::json loss_scaler_json(const LossScaler& scaler);
/// Continues `scaler` from a checkpoint's loss_scaler record (no-op when disabled or `j` is not
/// an object).
void restore_loss_scaler(LossScaler& scaler, const nlohmann::json& j);

/// Loads sharded checkpoint `ck` into `strategy` (the parameters and optimizer state of
/// `layout`), continues `scaler` from it and returns its progress. Collective. Throws
/// CheckpointError when the checkpoint is past the run's `total_steps` (naming --max-steps and
/// --epochs) or does not fit (load_sharded_checkpoint's errors).
TrainingProgress resume_from(const CheckpointInfo& ck, const ParamLayout& layout,
                             Strategy& strategy, Communicator& comm, LossScaler& scaler,
                             int64_t total_steps);

/// The run's configuration as JSON (run.json, the monitors' text, checkpoints).
nlohmann::json config_snapshot(const TrainConfig& c);

/// The optimizer and its hyper-parameters for the start-up banner, e.g. "AdamW lr 0.0006 betas
/// (0.9, 0.999) wd 0.01" or "SGD lr 0.1 momentum 0.9 nesterov wd 5e-05 (L2)".
std::string describe_optimizer(const TrainConfig& c);

/// Rank 0: creates cfg.output_dir, removes the partial checkpoint directories an interrupted
/// save left in it (saying so on `out`), and opens its metrics.jsonl (other ranks: a closed
/// writer).
MetricsWriter open_run_metrics(const TrainConfig& cfg, bool rank0, Console& out,
                               std::optional<int64_t> continue_after = std::nullopt);

/// TensorBoard / CSV scalars (rank 0; --tensorboard-all-ranks: every rank's own events), with
/// `config_json` (the run's configuration) first, as text.
Monitor open_run_monitor(const TrainConfig& cfg, int rank, const std::string& config_json,
                         std::optional<int64_t> continue_after = std::nullopt);
/// Where this run's logs continue: after `step` when it resumed from a checkpoint of that step;
/// from the start (0) when `launch --max-restarts` restarted the job before its first checkpoint
/// ($SHARDTRAIN_RESTART_COUNT > 0); nullopt for a first run, whose records are appended. With a
/// value, open_run_metrics drops the metrics.jsonl records of later steps and open_run_monitor
/// tells TensorBoard to drop earlier runs' events from step + 1 on: no step is logged twice.
std::optional<int64_t> logs_continue_after(bool resumed, int64_t step);

/// Points `comm`'s collectives at the backend's stream for its lifetime, and away from it after.
class ComputeStreamScope {
 public:
  ComputeStreamScope(Communicator& comm, Backend& backend) : comm_(comm) {
    comm_.set_compute_stream(backend.native_stream());
  }
  ~ComputeStreamScope() { comm_.set_compute_stream(nullptr); }
  ComputeStreamScope(const ComputeStreamScope&) = delete;
  ComputeStreamScope& operator=(const ComputeStreamScope&) = delete;

 private:
  Communicator& comm_;
};

}  // namespace shardtrain
