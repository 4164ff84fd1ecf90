#include "train/train_common.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>
#include <system_error>
#include <vector>

#include "checkpoint/sharded_checkpoint.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/strings.h"
#include "optim/adamw.h"

namespace shardtrain {
namespace fs = std::filesystem;
using nlohmann::json;

double seconds_since(TrainClock::time_point t0) {
  return std::chrono::duration<double>(TrainClock::now() - t0).count();
}

size_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<size_t>(ru.ru_maxrss) * 1024;
}

int local_rank_of(const Communicator& comm) {
  for (const char* var : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}) {
    if (const char* v = std::getenv(var)) return std::atoi(v);
  }
  return comm.rank();
}

/// `shardtrain launch` says so for its ranks in SHARDTRAIN_STDOUT_TTY (its own stdout decides):
/// mpirun (Open MPI) gives each rank a pseudo-terminal as stdout even when mpirun's output goes
/// to a file or pipe, so isatty() in a rank says nothing. Under a plain mpirun (no launcher):
/// no bar.
bool stdout_is_terminal() {
  if (const char* v = std::getenv("SHARDTRAIN_STDOUT_TTY")) return std::string_view(v) == "1";
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr)
    return false;
  return isatty(STDOUT_FILENO) != 0;
}

void Console::warn(const std::string& msg) {
  if (!active_) return;
  clear_bar();
  fmt::print(stderr, "warning: {}\n", msg);
}

void Console::bar(int64_t done, int64_t total, double loss, double rate, const char* unit) {
  if (!tty_) return;
  constexpr int kWidth = 30;
  const int fill = total > 0 ? static_cast<int>(kWidth * done / total) : 0;
  fmt::print("\r[{}{}] {}/{} loss {:.4f} {:.0f} {}/s", std::string(static_cast<size_t>(fill), '#'),
             std::string(static_cast<size_t>(kWidth - fill), '.'), done, total, loss, rate, unit);
  std::fflush(stdout);
  bar_shown_ = true;
}

void Console::clear_bar() {
  if (bar_shown_) fmt::print("\r\033[K");
  bar_shown_ = false;
}

StepLog::StepLog(Console& out, MetricsWriter& metrics, Monitor& monitor, const TrainConfig& cfg,
                 Throughput throughput, int world_size, bool on_gpu, int64_t total_steps)
    : out_(out),
      metrics_(metrics),
      monitor_(monitor),
      cfg_(cfg),
      throughput_(std::move(throughput)),
      world_size_(world_size),
      on_gpu_(on_gpu),
      total_steps_(total_steps),
      step_digits_(static_cast<int>(fmt::formatted_size("{}", total_steps))) {}

void StepLog::add(const StepResult& r, double seconds, double lr, const TrainingProgress& progress,
                  int64_t epoch, std::optional<double> loss_scale, double host_step_seconds) {
  seconds_ += seconds;
  host_step_ += host_step_seconds;
  loss_ += r.loss;
  ++steps_;
  if (r.phases) phases_ += *r.phases;
  const int64_t step = progress.step;
  monitor_.scalar("train/loss", r.loss, step);
  monitor_.scalar("train/lr", lr, step);
  monitor_.scalar("train/grad_norm", r.grad_norm, step);
  if (loss_scale) monitor_.scalar("train/loss_scale", *loss_scale, step);
  if (step % cfg_.log_interval != 0 && step != total_steps_ && step != 1) return;
  const double per_step = seconds_ / static_cast<double>(steps_);
  const double rate = static_cast<double>(throughput_.per_step * steps_) / seconds_;
  const std::string rate_key = throughput_.unit + "_per_s";
  // MFU: the model's training FLOPs per unit (GPT-2: 6N + 12·L·d·T per token) at the measured
  // rate, against the dense bf16 peak of the ranks' GPUs (--peak-tflops each).
  const double mfu = throughput_.flops_per_unit * rate /
                     (cfg_.peak_tflops * 1e12 * static_cast<double>(world_size_));
  out_.line(
      "epoch {} | step {:>{}}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.3f} | {:.0f} "
      "{}/s{} | {:.3f} s/step",
      epoch + 1, step, step_digits_, total_steps_, r.loss, lr, r.grad_norm, rate, throughput_.unit,
      on_gpu_ ? fmt::format(" | MFU {:.1f}%", 100.0 * mfu) : std::string(), per_step);
  json rec = {{"step", step},
              {"epoch", epoch + 1},
              {"loss", r.loss},
              {"avg_loss", loss_ / static_cast<double>(steps_)},
              {"lr", lr},
              {"grad_norm", r.grad_norm},
              {rate_key, rate},
              {"step_time_s", per_step},
              {throughput_.unit + "_seen", progress.tokens_seen}};
  if (on_gpu_) rec["mfu"] = mfu;
  if (loss_scale) rec["loss_scale"] = *loss_scale;
  monitor_.scalar("train/" + rate_key, rate, step);
  monitor_.scalar("train/step_time_s", per_step, step);
  if (on_gpu_) monitor_.scalar("train/mfu", mfu, step);
  // The CPU optimizer step (offload) runs beside the device: host time of the last completed
  // one, averaged over the window.
  if (host_step_ > 0) rec["cpu_step_ms"] = 1e3 * host_step_ / static_cast<double>(steps_);
  if (r.phases) {
    const PhaseTimes ms = phases_.scaled(1e3 / static_cast<double>(steps_));
    out_.line(
        "  device time per step: forward {:.2f} ms | backward {:.2f} ms | gradient "
        "reduction wait {:.2f} ms | optimizer {:.2f} ms",
        ms.forward, ms.backward, ms.reduce_wait, ms.optimizer);
    rec["forward_ms"] = ms.forward;
    rec["backward_ms"] = ms.backward;
    rec["reduce_wait_ms"] = ms.reduce_wait;
    rec["optimizer_ms"] = ms.optimizer;
  }
  metrics_.write(rec);
  seconds_ = loss_ = host_step_ = 0;
  steps_ = 0;
  phases_ = PhaseTimes{};
}

std::string describe_optimizer(const TrainConfig& c) {
  if (c.optimizer == OptimizerKind::kSGD)
    return fmt::format("SGD lr {:g} momentum {:g}{} wd {:g} (L2)", c.lr, c.momentum,
                       c.nesterov ? " nesterov" : "", c.weight_decay);
  return fmt::format("AdamW lr {:g} betas ({:g}, {:g}) wd {:g}", c.lr, c.beta1, c.beta2,
                     c.weight_decay);
}

nlohmann::json config_snapshot(const TrainConfig& c) {
  // What the rows do not hold: the plan the run resolved (strategy, ZeRO stage, offload devices,
  // the pipeline's shape) and the job's shape; the knobs' values follow from their rows.
  nlohmann::json snapshot = {
      {"strategy", to_string(c.strategy)},
      {"hierarchical_all_reduce", hierarchical_reduction(c)},
      {"ranks_per_node", c.ranks_per_node},
      {"placement", {{"automatic", c.placement.automatic}}},
      {"plan",
       {{"zero_stage", c.plan.zero_stage},
        {"optimizer_offload", to_string(c.plan.optimizer_offload)},
        {"optimizer_offload_ratio", c.plan.optimizer_offload_ratio},
        {"param_offload", to_string(c.plan.param_offload)},
        {"pipeline_stages", c.plan.pipeline_stages}}},
      {"pipeline",
       {{"stages", c.pipeline.stages},
        {"schedule", to_string(c.pipeline.schedule)},
        {"virtual_stages", c.pipeline.virtual_stages},
        {"partition_method", c.pipeline.partition_method},
        {"activation_checkpoint_interval", c.pipeline.activation_checkpoint_interval}}},
      {"world_size", c.world_size},
      {"monitor",
       {{"tensorboard", c.monitor.tensorboard_dir},
        {"tensorboard_all_ranks", c.monitor.tensorboard_all_ranks},
        {"csv_monitor", c.monitor.csv_dir}}}};
  for (const KnobTable* table : all_knob_tables()) write_knob_snapshot(c, *table, snapshot);
  return snapshot;
}

std::optional<int64_t> logs_continue_after(bool resumed, int64_t step) {
  if (resumed) return step;
  const char* restarts = std::getenv("SHARDTRAIN_RESTART_COUNT");
  if (restarts != nullptr && std::atoi(restarts) > 0) return 0;
  return std::nullopt;
}

MetricsWriter open_run_metrics(const TrainConfig& cfg, bool rank0, Console& out,
                               std::optional<int64_t> continue_after) {
  if (!rank0) return MetricsWriter();
  const fs::path out_dir = cfg.output_dir;
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  check<ConfigError>(!ec, "cannot create {} {}: {}", knob_for(&TrainConfig::output_dir).name(),
                     out_dir.string(), ec.message());
  for (const fs::path& p : remove_partial_checkpoints(out_dir))
    out.line("removed {}: a partial checkpoint an interrupted save left behind", p.string());
  if (continue_after) keep_metrics_through(out_dir / "metrics.jsonl", *continue_after);
  return MetricsWriter(out_dir / "metrics.jsonl");
}

Monitor open_run_monitor(const TrainConfig& cfg, int rank, const std::string& config_json,
                         std::optional<int64_t> continue_after) {
  if (rank != 0 && !cfg.monitor.tensorboard_all_ranks) return Monitor();
  std::string config_text = "    ";  // Markdown: indented = preformatted
  for (const char c : config_json) config_text += c == '\n' ? "\n    " : std::string(1, c);
  Monitor monitor(cfg.monitor, rank, config_text);
  if (continue_after) monitor.restart_at(*continue_after + 1);
  return monitor;
}

/// The epoch summary: a console line and a metrics.jsonl record with throughput, peak memory
/// (the GPU's peak allocated bytes, or the process's peak resident set on CPU) of every rank, and
/// the parameter bytes all-gathered and the bytes all-reduced across nodes per step. Collective
/// (the ranks' peaks are gathered).
void log_epoch(Console& out, MetricsWriter& metrics, Monitor& monitor, Backend& backend,
               ScalarAllReduce& reduce, const EpochStats& e, const HostMemory& host) {
  const bool on_gpu = backend.kind() == DeviceKind::kCUDA;
  const size_t peak = on_gpu ? backend.peak_allocated_bytes() : peak_rss_bytes();
  const double mine[] = {static_cast<double>(peak),
                         static_cast<double>(on_gpu ? backend.peak_reserved_bytes() : peak)};
  const std::vector<double> all = reduce.gather(mine);  // [rank][allocated, reserved]
  std::vector<size_t> peaks;
  std::string per_rank;
  for (size_t r = 0; r < all.size() / 2; ++r) {
    peaks.push_back(static_cast<size_t>(all[2 * r]));
    per_rank += fmt::format("{}{}", r ? ", " : "", human_bytes(all[2 * r]));
  }
  std::string mem =
      on_gpu ? fmt::format("peak memory {} allocated, {} reserved",
                           human_bytes(static_cast<double>(peak)),
                           human_bytes(static_cast<double>(backend.peak_reserved_bytes())))
             : fmt::format("peak memory {}", human_bytes(static_cast<double>(peak)));
  if (peaks.size() > 1) mem += fmt::format(" (rank 0; ranks: {})", per_rank);
  const double gathered_per_step = e.gathered_bytes / static_cast<double>(e.steps);
  if (gathered_per_step > 0)
    mem += fmt::format(" | all-gathered {} per step", human_bytes(gathered_per_step));
  const double cross_node_per_step = e.cross_node_bytes / static_cast<double>(e.steps);
  if (cross_node_per_step > 0)
    mem += fmt::format(" | all-reduced across nodes {} per step", human_bytes(cross_node_per_step));
  if (host.pinned + host.pageable + host.nvme > 0)
    mem += fmt::format(" | host {} pinned, {} pageable, NVMe {}",
                       human_bytes(static_cast<double>(host.pinned)),
                       human_bytes(static_cast<double>(host.pageable)),
                       human_bytes(static_cast<double>(host.nvme)));
  const double avg_loss = e.loss_sum / static_cast<double>(e.steps);
  const double samples_per_s = e.samples / e.seconds;
  const double tokens_per_s = e.samples * static_cast<double>(e.seq_len) / e.seconds;
  // Language models: samples/s and tokens/s; image models (seq_len 0): images/s.
  const std::string rate =
      e.seq_len > 0 ? fmt::format("{:.1f} samples/s | {:.0f} tokens/s", samples_per_s, tokens_per_s)
                    : fmt::format("{:.1f} images/s", samples_per_s);
  out.line("epoch {}{} | {} steps | avg loss {:.4f} | {:.1f} s | {} | {}", e.epoch + 1,
           e.complete ? "" : " (partial)", e.steps, avg_loss, e.seconds, rate, mem);
  json rec = {{"epoch", e.epoch + 1}, {"epoch_complete", e.complete},
              {"steps", e.steps},     {"avg_loss", avg_loss},
              {"time_s", e.seconds},  {"samples_per_s", samples_per_s}};
  if (e.seq_len > 0)
    rec["tokens_per_s"] = tokens_per_s;
  else
    rec["images_per_s"] = samples_per_s;
  rec.update(json{{"peak_memory_bytes", peak},
                  {"device_allocated_bytes", backend.allocated_bytes()},
                  {"device_reserved_bytes", backend.reserved_bytes()},
                  {"device_peak_allocated_bytes", backend.peak_allocated_bytes()},
                  {"device_peak_reserved_bytes", backend.peak_reserved_bytes()},
                  {"peak_memory_bytes_per_rank", peaks},
                  {"gathered_bytes_per_step", gathered_per_step},
                  {"cross_node_bytes_per_step", cross_node_per_step},
                  {"host_pinned_bytes", host.pinned},
                  {"host_pageable_bytes", host.pageable},
                  {"nvme_bytes", host.nvme},
                  {"peak_rss_bytes", peak_rss_bytes()},
                  {"skipped_steps", e.skipped_steps}});
  metrics.write(rec);
  monitor.scalar("train/epoch_avg_loss", avg_loss, e.step);
  monitor.scalar("train/samples_per_s", e.samples / e.seconds, e.step);
  if (on_gpu) {
    monitor.scalar("memory/gpu_peak_bytes", static_cast<double>(backend.peak_allocated_bytes()),
                   e.step);
    monitor.scalar("memory/gpu_peak_reserved_bytes",
                   static_cast<double>(backend.peak_reserved_bytes()), e.step);
  }
  monitor.scalar("memory/host_peak_bytes", static_cast<double>(peak_rss_bytes()), e.step);
}

std::vector<EvalMicroBatch> eval_micro_batches(int64_t samples, int64_t batch, int world,
                                               int rank) {
  check<ConfigError>(samples >= 0 && batch >= 1 && world >= 1 && rank >= 0 && rank < world,
                     "evaluation of {} samples in micro-batches of {} on rank {} of {}: needs "
                     "samples >= 0, a micro-batch >= 1 and 0 <= rank < world",
                     samples, batch, rank, world);
  std::vector<EvalMicroBatch> out;
  for (const FlatRange& range : even_split(samples, world, rank)) {
    const int64_t end = range.offset + range.numel;
    for (int64_t start = range.offset; start < end; start += batch)
      out.push_back({start, std::min(batch, end - start), true});
  }
  // Rank 0's range is the longest (ceil(samples / world)): every rank runs its micro-batch count.
  const int64_t longest = (samples + world - 1) / world;
  const auto forwards = static_cast<size_t>((longest + batch - 1) / batch);
  while (out.size() < forwards) out.push_back({0, 1, false});
  return out;
}

LossHistory run_epochs(const EpochLoop& loop, TrainingProgress& progress) {
  const TrainConfig& cfg = loop.cfg;
  LossHistory losses;
  bool evaluated_at_end = false;
  while (progress.step < loop.total_steps) {
    const int64_t epoch = progress.epoch;
    const auto t_epoch = TrainClock::now();
    loop.backend.reset_peak_memory();
    double epoch_loss = 0, epoch_gathered = 0, epoch_cross_node = 0;
    int64_t epoch_steps = 0;
    while (progress.step_in_epoch < loop.steps_per_epoch && progress.step < loop.total_steps) {
      const auto t_step = TrainClock::now();
      const double lr = learning_rate(progress.step, cfg.lr, loop.warmup, loop.total_steps,
                                      cfg.lr_schedule, cfg.min_lr_ratio, cfg.warmup_min_ratio);
      const StepResult r = loop.step(epoch, lr);
      const double dt = seconds_since(t_step);
      ++progress.step;
      ++progress.step_in_epoch;  // before any checkpoint: the data position of the next step
      progress.tokens_seen += loop.units_per_step;
      if (losses.all.empty()) losses.first = r.loss;
      losses.all.push_back(r.loss);
      losses.last = r.loss;
      epoch_loss += r.loss;
      epoch_gathered += static_cast<double>(loop.strategy.gathered_bytes_last_step());
      epoch_cross_node += static_cast<double>(loop.strategy.cross_node_bytes_last_step());
      ++epoch_steps;
      loop.out.bar(progress.step, loop.total_steps, r.loss,
                   static_cast<double>(loop.units_per_step) / dt, loop.bar_unit);
      loop.step_log.add(
          r, dt, lr, progress, epoch,
          loop.scaler.enabled() ? std::optional<double>(loop.scaler.scale()) : std::nullopt,
          loop.strategy.host_step_seconds());
      evaluated_at_end = false;
      if (cfg.eval_interval > 0 && progress.step % cfg.eval_interval == 0) {
        loop.evaluate(epoch);
        evaluated_at_end = true;
      }
      if (loop.after_step) loop.after_step();
    }
    const bool complete = progress.step_in_epoch >= loop.steps_per_epoch;
    if (epoch_steps > 0) {
      log_epoch(loop.out, loop.metrics, loop.monitor, loop.backend, loop.reduce,
                {epoch, complete, epoch_steps, epoch_loss, seconds_since(t_epoch),
                 static_cast<double>(epoch_steps * loop.samples_per_step), loop.seq_len,
                 loop.scaler.skipped_steps(), epoch_gathered, epoch_cross_node, progress.step},
                loop.strategy.host_memory());
      if (cfg.eval_interval == 0 && !evaluated_at_end) {
        loop.evaluate(epoch);
        evaluated_at_end = true;
      }
    }
    if (complete) {
      ++progress.epoch;
      progress.step_in_epoch = 0;
    }
  }
  if (!evaluated_at_end)
    loop.evaluate(progress.epoch > 0 && progress.step_in_epoch == 0 ? progress.epoch - 1
                                                                    : progress.epoch);
  return losses;
}

nlohmann::json loss_scaler_json(const LossScaler& scaler) {
  if (!scaler.enabled()) return nullptr;
  const LossScaler::State st = scaler.state();
  return {{"scale", st.scale},
          {"hysteresis_left", st.hysteresis_left},
          {"clean_steps", st.clean_steps},
          {"skipped_steps", st.skipped_steps}};
}

TrainingProgress resume_from(const CheckpointInfo& ck, const ParamLayout& layout,
                             Strategy& strategy, Communicator& comm, LossScaler& scaler,
                             int64_t total_steps) {
  load_sharded_checkpoint(ck, layout, strategy, comm);
  // An fp16 run's loss-scale schedule continues where it stopped (other precisions have none).
  restore_loss_scaler(scaler, ck.loss_scaler);
  check<CheckpointError>(ck.progress.step <= total_steps,
                         "checkpoint {} is at step {} but this run has only {} steps: raise "
                         "{} or {} to continue training",
                         ck.dir.string(), ck.progress.step, total_steps,
                         knob_for(&TrainConfig::max_steps).name(),
                         knob_for(&TrainConfig::epochs).name());
  return ck.progress;
}

void restore_loss_scaler(LossScaler& scaler, const nlohmann::json& j) {
  if (!scaler.enabled() || !j.is_object()) return;
  LossScaler::State st = scaler.state();
  st.scale = j.value("scale", st.scale);
  st.hysteresis_left = j.value("hysteresis_left", st.hysteresis_left);
  st.clean_steps = j.value("clean_steps", st.clean_steps);
  st.skipped_steps = j.value("skipped_steps", st.skipped_steps);
  scaler.restore(st);
}

RunPlan plan_run(const TrainConfig& cfg, const DistributedSampler& sampler, int replicas) {
  RunPlan p;
  p.replicas = replicas;
  p.global_batch = sampler.global_batch();
  p.steps_per_epoch = sampler.steps_per_epoch();
  p.total_steps = cfg.max_steps > 0 ? cfg.max_steps : cfg.epochs * p.steps_per_epoch;
  p.warmup = cfg.warmup_steps >= 0 ? cfg.warmup_steps : std::min<int64_t>(1000, p.total_steps / 10);
  p.tokens_per_step = p.global_batch * cfg.max_length;
  return p;
}

}  // namespace shardtrain
