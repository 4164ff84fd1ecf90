#include "train/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>

#include "core/error.h"
#include "core/strings.h"
#include "data/bpe_tokenizer.h"
#include "data/dataset.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "io/sharded_checkpoint.h"
#include "model/gpt2.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "parallel/strategy.h"

namespace shardtrain {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

size_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<size_t>(ru.ru_maxrss) * 1024;
}

json config_snapshot(const TrainConfig& c) {
  return {{"model", c.model},
          {"strategy", to_string(c.strategy)},
          {"device", c.device},
          {"precision", to_string(c.precision)},
          {"micro_batch_size", c.micro_batch_size},
          {"gradient_accumulation_steps", c.gradient_accumulation_steps},
          {"train_batch_size", c.train_batch_size},
          {"world_size", c.world_size},
          {"epochs", c.epochs},
          {"max_steps", c.max_steps},
          {"max_length", c.max_length},
          {"num_samples", c.num_samples},
          {"seed", c.seed},
          {"lr", c.lr},
          {"betas", {c.beta1, c.beta2}},
          {"eps", c.adam_eps},
          {"weight_decay", c.weight_decay},
          {"gradient_clipping", c.gradient_clipping},
          {"warmup_steps", c.warmup_steps},
          {"lr_schedule", to_string(c.lr_schedule)},
          {"min_lr_ratio", c.min_lr_ratio},
          {"dataset", c.dataset},
          {"train_file", c.train_file},
          {"valid_file", c.valid_file}};
}

/// Prints on rank 0 only; a progress bar (stdout a terminal) is erased before each line.
class Console {
 public:
  explicit Console(bool active) : active_(active), tty_(active && isatty(STDOUT_FILENO)) {}
  template <typename... Args>
  void line(fmt::format_string<Args...> f, Args&&... args) {
    if (!active_) return;
    clear_bar();
    fmt::print("{}\n", fmt::format(f, std::forward<Args>(args)...));
    std::fflush(stdout);
  }
  void warn(const std::string& msg) {
    if (!active_) return;
    clear_bar();
    fmt::print(stderr, "warning: {}\n", msg);
  }
  void bar(int64_t done, int64_t total, double loss, double tok_s) {
    if (!tty_) return;
    constexpr int kWidth = 30;
    const int fill = total > 0 ? static_cast<int>(kWidth * done / total) : 0;
    fmt::print("\r[{}{}] {}/{} loss {:.4f} {:.0f} tok/s",
               std::string(static_cast<size_t>(fill), '#'),
               std::string(static_cast<size_t>(kWidth - fill), '.'), done, total, loss, tok_s);
    std::fflush(stdout);
    bar_shown_ = true;
  }

 private:
  void clear_bar() {
    if (bar_shown_) fmt::print("\r\033[K");
    bar_shown_ = false;
  }
  bool active_, tty_;
  bool bar_shown_ = false;
};

struct Evaluation {
  double loss = std::numeric_limits<double>::quiet_NaN();
  int64_t samples = 0;
  double seconds = 0;
};

Evaluation evaluate(GPT2Model& model, const PackedDataset& data, int64_t batch,
                    const Communicator& comm) {
  Evaluation ev;
  const auto t0 = Clock::now();
  const int64_t T = data.max_length();
  std::vector<int32_t> buf(static_cast<size_t>(T + 1));
  std::vector<int32_t> tokens, targets;
  double loss_sum = 0;
  int64_t rows = 0;
  // Each rank evaluates every world-th batch; a single-rank run evaluates them all.
  for (int64_t start = comm.rank() * batch; start < data.size();
       start += batch * comm.world_size()) {
    const int64_t b = std::min(batch, data.size() - start);
    tokens.resize(static_cast<size_t>(b * T));
    targets.resize(static_cast<size_t>(b * T));
    for (int64_t i = 0; i < b; ++i) {
      data.sample(start + i, buf.data());
      std::copy(buf.begin(), buf.end() - 1, tokens.begin() + i * T);
      std::copy(buf.begin() + 1, buf.end(), targets.begin() + i * T);
    }
    loss_sum +=
        model.forward(tokens.data(), targets.data(), b, T, 1.0f, false) * static_cast<double>(b);
    rows += b;
  }
  ev.samples = rows;
  ev.loss = rows ? loss_sum / static_cast<double>(rows) : ev.loss;
  ev.seconds = seconds_since(t0);
  return ev;
}

/// Device time of the phases of optimizer steps (DeepSpeed wall_clock_breakdown), in seconds:
/// forward (with zeroing the gradients and preparing the batch), backward (with the reductions
/// it launches), the wait for the gradient reductions still running after backward
/// (Strategy::finish_gradients) and the optimizer (gradient norm, clipping, update, and for ZeRO
/// the all-gather of the updated parameters).
struct PhaseTimes {
  double forward = 0, backward = 0, reduce_wait = 0, optimizer = 0;

  /// From the intervals between the marks of one step: [forward, backward] per micro-step, then
  /// the reduction wait and the optimizer.
  static PhaseTimes from_marks(const std::vector<double>& t) {
    ST_ASSERT(t.size() >= 4 && t.size() % 2 == 0);
    PhaseTimes p;
    const size_t micro = t.size() - 2;
    for (size_t i = 0; i < micro; i += 2) {
      p.forward += t[i];
      p.backward += t[i + 1];
    }
    p.reduce_wait = t[micro];
    p.optimizer = t[micro + 1];
    return p;
  }
  PhaseTimes& operator+=(const PhaseTimes& o) {
    forward += o.forward;
    backward += o.backward;
    reduce_wait += o.reduce_wait;
    optimizer += o.optimizer;
    return *this;
  }
  PhaseTimes scaled(double f) const {
    return {forward * f, backward * f, reduce_wait * f, optimizer * f};
  }
};

/// The GPU index of this rank: LOCAL_RANK as set by launchers (torchrun, shardtrain launch,
/// SLURM, mpirun), else the rank.
int local_rank_of(const Communicator& comm) {
  for (const char* var : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}) {
    if (const char* v = std::getenv(var)) return std::atoi(v);
  }
  return comm.rank();
}

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& device, int local_rank,
                                      Precision precision) {
  const bool cuda = device == "cuda" || (device != "cpu" && cuda_available());
  if (!cuda) {
    check<ConfigError>(precision == Precision::kAuto || precision == Precision::kFp32,
                       "--precision {} needs --device cuda; the CPU path computes in fp32 (use "
                       "--precision fp32 or leave it unset)",
                       to_string(precision));
    return make_cpu_backend();
  }
  const DType dt = precision == Precision::kFp32   ? DType::kF32
                   : precision == Precision::kFp16 ? DType::kF16
                                                   : DType::kBF16;
  return make_cuda_backend(local_rank, dt);
}

TrainSummary train(const TrainConfig& cfg, Communicator& comm) {
  const bool rank0 = comm.rank() == 0;
  Console out(rank0);
  TrainSummary summary;
  summary.val_loss = std::numeric_limits<double>::quiet_NaN();

  // ---- model and device ----
  GPT2Config model_cfg = gpt2_preset(cfg.model);
  std::unique_ptr<Backend> backend = make_backend(cfg.device, local_rank_of(comm), cfg.precision);
  const bool on_gpu = backend->kind() == DeviceKind::kCUDA;
  // Collectives must start after the kernels that produce their inputs (the backend computes on
  // its own non-default stream).
  comm.set_compute_stream(backend->native_stream());
  // ... and must not use that stream once the backend (declared before this guard) destroys it.
  struct ComputeStreamReset {
    Communicator& comm;
    ~ComputeStreamReset() { comm.set_compute_stream(nullptr); }
  } compute_stream_reset{comm};
  LossScaler scaler(cfg.loss_scale, backend->compute_dtype() == DType::kF16);
  GPT2Model model(model_cfg, *backend, cfg.activation_checkpointing);

  // ---- resume: read the checkpoint first so a mismatch fails before any work ----
  std::optional<CheckpointInfo> resume;
  if (!cfg.resume.empty()) {
    resume = read_checkpoint_info(cfg.resume);
    check<CheckpointError>(resume->model.name == model_cfg.name,
                           "checkpoint {} holds model '{}' but this run asks for '{}': pass "
                           "--model {} to resume it",
                           resume->dir.string(), resume->model.name, model_cfg.name,
                           resume->model.name);
  }

  // ---- data ----
  const auto t_data = Clock::now();
  BpeTokenizer tokenizer = BpeTokenizer::load_default();
  const DatasetFiles files =
      resolve_dataset(cfg.dataset, cfg.train_file, cfg.valid_file, cfg.data_dir);
  const fs::path cache_dir = cfg.cache_dir.empty() ? default_cache_dir() : fs::path(cfg.cache_dir);
  auto log = [&](const std::string& m) { out.line("data: {}", m); };
  PackedDataset train_data(load_tokens(files.train, tokenizer, cache_dir, log), cfg.max_length,
                           files.name);
  train_data.limit(cfg.num_samples);
  std::optional<PackedDataset> valid_data;
  if (!files.valid.empty()) {
    valid_data.emplace(load_tokens(files.valid, tokenizer, cache_dir, log), cfg.max_length,
                       files.name + " validation");
    if (cfg.eval_samples > 0 && cfg.eval_samples < valid_data->size())
      valid_data->limit(cfg.eval_samples);
  }
  const double data_seconds = seconds_since(t_data);

  DistributedSampler sampler(train_data.size(), cfg.micro_batch_size,
                             cfg.gradient_accumulation_steps, comm.rank(), comm.world_size(),
                             cfg.seed);
  const int64_t steps_per_epoch = sampler.steps_per_epoch();
  const int64_t total_steps = cfg.max_steps > 0 ? cfg.max_steps : cfg.epochs * steps_per_epoch;
  const int64_t warmup =
      cfg.warmup_steps >= 0 ? cfg.warmup_steps : std::min<int64_t>(1000, total_steps / 10);
  const int64_t T = cfg.max_length, B = cfg.micro_batch_size,
                accum = cfg.gradient_accumulation_steps;
  const int64_t tokens_per_step = sampler.global_batch() * T;

  // ---- parameters and strategy ----
  std::unique_ptr<Strategy> strategy = make_strategy(cfg, *backend, comm);
  TrainingProgress progress;
  progress.seed = cfg.seed;
  {
    std::vector<float> init(static_cast<size_t>(model.layout().numel()), 0.0f);
    if (!resume) {
      if (!cfg.init_from.empty()) {
        const fs::path p = cfg.init_from;
        if (fs::is_directory(p) && fs::exists(p / "model.safetensors") &&
            !fs::exists(p / "manifest.json"))
          load_hf_weights(p / "model.safetensors", model.layout(), init.data());
        else if (fs::is_directory(p))
          init = load_checkpoint_params(read_checkpoint_info(p), model.layout());
        else
          load_hf_weights(p, model.layout(), init.data());
      } else {
        model.init_parameters(init.data(), cfg.seed);
      }
    }
    strategy->setup(model, init);
  }
  if (resume) {
    load_sharded_checkpoint(*resume, model.layout(), *strategy, comm);
    progress = resume->progress;
    check<CheckpointError>(progress.step <= total_steps,
                           "checkpoint {} is at step {} but this run has only {} steps: raise "
                           "--max-steps or --epochs to continue training",
                           resume->dir.string(), progress.step, total_steps);
  }

  const fs::path out_dir = cfg.output_dir;
  MetricsWriter metrics;
  if (rank0) {
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    check<ConfigError>(!ec, "cannot create --output-dir {}: {}", out_dir.string(), ec.message());
    metrics = MetricsWriter(out_dir / "metrics.jsonl");
  }

  // ---- banner ----
  out.line("shardtrain {} | train {} ({} parameters) | strategy {} | {} × {} rank{}",
           SHARDTRAIN_VERSION, model_cfg.name, with_commas(model_cfg.num_parameters()),
           to_string(cfg.strategy), backend->description(), comm.world_size(),
           comm.world_size() > 1 ? "s" : "");
  out.line(
      "  batch: micro-batch {} × accumulation {} × {} rank{} = global batch {} samples × {} tokens "
      "= {} tokens/step",
      B, accum, comm.world_size(), comm.world_size() > 1 ? "s" : "", sampler.global_batch(), T,
      with_commas(tokens_per_step));
  out.line(
      "  data: {} — {} training samples ({} tokens), {} validation samples; loaded in {:.1f} s",
      files.name, with_commas(train_data.size()), with_commas(train_data.num_tokens()),
      valid_data ? with_commas(valid_data->size()) : std::string("no"), data_seconds);
  out.line(
      "  steps: {} ({} per epoch{}), warmup {}, {} schedule, AdamW lr {:g} betas ({:g}, {:g}) wd "
      "{:g}, clip {:g}",
      total_steps, steps_per_epoch,
      cfg.max_steps > 0 ? fmt::format(", --max-steps {}", cfg.max_steps)
                        : fmt::format(", {} epochs", cfg.epochs),
      warmup, to_string(cfg.lr_schedule), cfg.lr, cfg.beta1, cfg.beta2, cfg.weight_decay,
      cfg.gradient_clipping);
  out.line(
      "  precision: {}{} | model states {} per rank | activation checkpointing {} | "
      "output: {}",
      dtype_name(backend->compute_dtype()),
      on_gpu && backend->compute_dtype() != DType::kF32
          ? " compute, fp32 master weights and AdamW state"
          : "",
      human_bytes(static_cast<double>(strategy->model_state_bytes())),
      cfg.activation_checkpointing ? "on" : "off", out_dir.string());
  if (scaler.enabled())
    out.line("  fp16 dynamic loss scaling: initial scale {:g}, window {}, hysteresis {}, min {:g}",
             scaler.scale(), cfg.loss_scale.loss_scale_window, cfg.loss_scale.hysteresis,
             cfg.loss_scale.min_loss_scale);
  if (resume)
    out.line("  resumed from {} at step {} (epoch {}, step {} of the epoch)", resume->dir.string(),
             progress.step, progress.epoch + 1, progress.step_in_epoch);

  // ---- loop ----
  std::vector<int32_t> tokens(static_cast<size_t>(B * T)), targets(static_cast<size_t>(B * T));
  std::vector<int32_t> sample(static_cast<size_t>(T + 1));
  const auto t_train = Clock::now();
  CheckpointInfo ck;
  ck.model = model_cfg;
  ck.config = config_snapshot(cfg);
  auto save = [&]() {
    if (!cfg.save_checkpoints) return;
    ck.progress = progress;
    if (scaler.enabled())
      ck.loss_scaler = {{"scale", scaler.scale()}, {"skipped_steps", scaler.skipped_steps()}};
    ShardedSaveOptions opts;
    opts.consolidated_bf16_model = cfg.zero.stage3_gather_16bit_weights_on_model_save;
    const fs::path dir =
        save_sharded_checkpoint(out_dir, fmt::format("checkpoint-{:06d}", progress.step),
                                model.layout(), *strategy, comm, ck, opts);
    summary.checkpoint = dir.string();
    out.line("saved checkpoint {}", dir.string());
  };
  auto validate_now = [&](int64_t epoch) {
    if (!valid_data) return;
    const Evaluation ev = evaluate(model, *valid_data, B, comm);
    summary.val_loss = ev.loss;
    summary.val_ppl = std::exp(ev.loss);
    out.line(
        "validation | epoch {} | step {} | loss {:.4f} | perplexity {:.2f} | {} samples in {:.1f} "
        "s",
        epoch + 1, progress.step, ev.loss, summary.val_ppl, ev.samples, ev.seconds);
    metrics.write({{"step", progress.step},
                   {"epoch", epoch + 1},
                   {"val_loss", ev.loss},
                   {"val_ppl", summary.val_ppl},
                   {"val_samples", ev.samples},
                   {"time_s", ev.seconds}});
  };

  double window_time = 0, window_loss = 0;
  int64_t window_steps = 0;
  // wall_clock_breakdown: device time of each phase, summed over the log window, in seconds.
  std::unique_ptr<StreamClock> clock =
      cfg.wall_clock_breakdown ? backend->make_stream_clock() : nullptr;
  PhaseTimes window_phases;
  bool validated_at_end = false;
  while (progress.step < total_steps) {
    const int64_t epoch = progress.epoch;
    const auto t_epoch = Clock::now();
    backend->reset_peak_memory();
    double epoch_loss = 0;
    int64_t epoch_steps = 0;
    while (progress.step_in_epoch < steps_per_epoch && progress.step < total_steps) {
      const auto t_step = Clock::now();
      if (clock) clock->mark();
      strategy->zero_grad();
      double loss = 0;
      for (int64_t k = 0; k < accum; ++k) {
        const auto idx = sampler.micro_batch_indices(epoch, progress.step_in_epoch, k);
        for (int64_t i = 0; i < B; ++i) {
          train_data.sample(idx[static_cast<size_t>(i)], sample.data());
          std::copy(sample.begin(), sample.end() - 1, tokens.begin() + i * T);
          std::copy(sample.begin() + 1, sample.end(), targets.begin() + i * T);
        }
        strategy->begin_micro_step(k, accum);
        loss +=
            model.forward(tokens.data(), targets.data(), B, T,
                          static_cast<float>(scaler.scale() / static_cast<double>(B * T)), true);
        if (clock) clock->mark();
        model.backward();
        if (clock) clock->mark();
      }
      loss /= static_cast<double>(accum);
      strategy->finish_gradients();
      if (clock) clock->mark();
      // Gradients hold Σ over micro-steps and ranks of ∂(loss_scale · mean micro-batch loss)/∂θ.
      const double mean_scale =
          1.0 / (static_cast<double>(accum * comm.world_size()) * scaler.scale());
      const double norm = strategy->grad_norm(mean_scale);
      const bool overflow = !std::isfinite(norm);
      const double lr = learning_rate(progress.step, cfg.lr, warmup, total_steps, cfg.lr_schedule,
                                      cfg.min_lr_ratio, cfg.warmup_min_ratio);
      const double used_scale = scaler.scale();
      if (scaler.update(overflow)) {
        out.line(
            "step {}: fp16 gradients overflowed at loss scale {:g}: step skipped, scale now {:g}",
            progress.step + 1, used_scale, scaler.scale());
      } else {
        check<RuntimeFailure>(!overflow,
                              "gradients became non-finite (norm {}) at step {}: training "
                              "diverged; lower --lr (now {:g}) or raise --warmup-steps",
                              norm, progress.step + 1, cfg.lr);
        const double clip = cfg.gradient_clipping > 0 && norm > cfg.gradient_clipping
                                ? cfg.gradient_clipping / (norm + 1e-6)
                                : 1.0;
        strategy->step(lr, mean_scale * clip);
      }
      if (clock) clock->mark();
      backend->synchronize();
      if (clock) window_phases += PhaseTimes::from_marks(clock->intervals());  // no further wait
      const double dt = seconds_since(t_step);
      ++progress.step;
      ++progress.step_in_epoch;  // before any checkpoint: the data position of the next step
      progress.tokens_seen += tokens_per_step;
      check<RuntimeFailure>(
          std::isfinite(loss),
          "loss became {} at step {}: training diverged; lower --lr (now {:g}) or "
          "raise --warmup-steps",
          loss, progress.step, cfg.lr);
      if (summary.losses.empty()) summary.first_loss = loss;
      summary.losses.push_back(loss);
      summary.last_loss = loss;
      epoch_loss += loss;
      ++epoch_steps;
      window_time += dt;
      window_loss += loss;
      ++window_steps;
      out.bar(progress.step, total_steps, loss, static_cast<double>(tokens_per_step) / dt);
      if (progress.step % cfg.log_interval == 0 || progress.step == total_steps ||
          progress.step == 1) {
        const double tok_s = static_cast<double>(tokens_per_step * window_steps) / window_time;
        // MFU: model FLOPs per token (6N + 12·L·d·T) at the measured rate, against the dense
        // bf16 peak of the ranks' GPUs (--peak-tflops each).
        const double mfu = model_cfg.flops_per_token(T) * tok_s /
                           (cfg.peak_tflops * 1e12 * static_cast<double>(comm.world_size()));
        out.line(
            "epoch {} | step {:>{}}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.3f} | {:.0f} "
            "tokens/s{} | {:.3f} s/step",
            epoch + 1, progress.step, fmt::formatted_size("{}", total_steps), total_steps, loss, lr,
            norm, tok_s, on_gpu ? fmt::format(" | MFU {:.1f}%", 100.0 * mfu) : std::string(),
            window_time / static_cast<double>(window_steps));
        json rec = {{"step", progress.step},
                    {"epoch", epoch + 1},
                    {"loss", loss},
                    {"avg_loss", window_loss / static_cast<double>(window_steps)},
                    {"lr", lr},
                    {"grad_norm", norm},
                    {"tokens_per_s", tok_s},
                    {"step_time_s", window_time / static_cast<double>(window_steps)},
                    {"tokens_seen", progress.tokens_seen}};
        if (on_gpu) rec["mfu"] = mfu;
        if (scaler.enabled()) rec["loss_scale"] = scaler.scale();
        if (clock) {
          const PhaseTimes ms = window_phases.scaled(1e3 / static_cast<double>(window_steps));
          out.line(
              "  device time per step: forward {:.2f} ms | backward {:.2f} ms | gradient "
              "reduction wait {:.2f} ms | optimizer {:.2f} ms",
              ms.forward, ms.backward, ms.reduce_wait, ms.optimizer);
          rec["forward_ms"] = ms.forward;
          rec["backward_ms"] = ms.backward;
          rec["reduce_wait_ms"] = ms.reduce_wait;
          rec["optimizer_ms"] = ms.optimizer;
          window_phases = PhaseTimes{};
        }
        metrics.write(rec);
        window_time = window_loss = 0;
        window_steps = 0;
      }
      validated_at_end = false;
      if (cfg.eval_interval > 0 && progress.step % cfg.eval_interval == 0) {
        validate_now(epoch);
        validated_at_end = true;
      }
      if (cfg.save_interval > 0 && progress.step % cfg.save_interval == 0 &&
          progress.step < total_steps)
        save();
    }
    // ---- epoch summary ----
    const double epoch_time = seconds_since(t_epoch);
    const bool complete = progress.step_in_epoch >= steps_per_epoch;
    if (epoch_steps > 0) {
      const double samples = static_cast<double>(epoch_steps * sampler.global_batch());
      // Peak memory: the GPU's peak allocated bytes, or the process's peak resident set on CPU.
      const size_t peak = on_gpu ? backend->peak_allocated_bytes() : peak_rss_bytes();
      const std::string mem =
          on_gpu ? fmt::format("peak memory {} allocated, {} reserved",
                               human_bytes(static_cast<double>(peak)),
                               human_bytes(static_cast<double>(backend->peak_reserved_bytes())))
                 : fmt::format("peak memory {}", human_bytes(static_cast<double>(peak)));
      out.line(
          "epoch {}{} | {} steps | avg loss {:.4f} | {:.1f} s | {:.1f} samples/s | {:.0f} "
          "tokens/s | {}",
          epoch + 1, complete ? "" : " (partial)", epoch_steps,
          epoch_loss / static_cast<double>(epoch_steps), epoch_time, samples / epoch_time,
          samples * static_cast<double>(T) / epoch_time, mem);
      metrics.write({{"epoch", epoch + 1},
                     {"epoch_complete", complete},
                     {"steps", epoch_steps},
                     {"avg_loss", epoch_loss / static_cast<double>(epoch_steps)},
                     {"time_s", epoch_time},
                     {"samples_per_s", samples / epoch_time},
                     {"tokens_per_s", samples * static_cast<double>(T) / epoch_time},
                     {"peak_memory_bytes", peak},
                     {"device_allocated_bytes", backend->allocated_bytes()},
                     {"device_reserved_bytes", backend->reserved_bytes()},
                     {"device_peak_allocated_bytes", backend->peak_allocated_bytes()},
                     {"device_peak_reserved_bytes", backend->peak_reserved_bytes()},
                     {"skipped_steps", scaler.skipped_steps()}});
      if (cfg.eval_interval == 0 && !validated_at_end) {
        validate_now(epoch);
        validated_at_end = true;
      }
    }
    if (complete) {
      ++progress.epoch;
      progress.step_in_epoch = 0;
    }
  }
  if (!validated_at_end)
    validate_now(progress.epoch > 0 && progress.step_in_epoch == 0 ? progress.epoch - 1
                                                                   : progress.epoch);
  summary.seconds = seconds_since(t_train);
  summary.steps = progress.step;
  if (!summary.losses.empty() || !resume) save();
  out.line(
      "done | {} steps | {:.1f} s | loss {:.4f} → {:.4f} | validation loss {:.4f} | perplexity "
      "{:.2f}",
      progress.step, summary.seconds, summary.first_loss, summary.last_loss, summary.val_loss,
      summary.val_ppl);
  metrics.write({{"event", "done"},
                 {"step", progress.step},
                 {"time_s", summary.seconds},
                 {"final_loss", summary.last_loss},
                 {"val_loss", summary.val_loss},
                 {"val_ppl", summary.val_ppl}});
  return summary;
}

}  // namespace shardtrain
