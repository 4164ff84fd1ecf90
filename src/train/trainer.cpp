#include "train/trainer.h"

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>

#include "checkpoint/checkpoint.h"
#include "checkpoint/sharded_checkpoint.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/philox.h"
#include "core/strings.h"
#include "data/bpe_tokenizer.h"
#include "data/dataset.h"
#include "io/atomic_file.h"
#include "memory/param_layout.h"
#include "model/gpt2.h"
#include "monitor/metrics.h"
#include "monitor/monitor.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "parallel/pipeline/pipeline_parallel.h"
#include "parallel/strategy.h"
#include "train/automatic_placement.h"
#include "train/flops_profiler.h"
#include "train/pipeline_step.h"
#include "train/rank_agreement.h"
#include "train/strategy_from_config.h"
#include "train/train_common.h"
#include "train/train_step.h"
#include "train/training_run.h"

namespace shardtrain {
namespace fs = std::filesystem;
using Clock = TrainClock;
using nlohmann::json;

namespace {

/// Parameters of the largest layer of `layout` (its tensors' elements, without padding): what
/// ZeRO-3's persistence threshold is compared with.
int64_t largest_layer_numel(const ParamLayout& layout) {
  int64_t largest = 0;
  for (const LayerRange& layer : layout.layers()) {
    int64_t n = 0;
    for (const ParamTensor& t : layer.tensors) n += t.numel;
    largest = std::max(largest, n);
  }
  return largest;
}

}  // namespace

GPT2Evaluation evaluate_gpt2(GPT2Model& model, const PackedDataset& data, int64_t batch,
                             const Communicator& comm, ScalarAllReduce& reduce) {
  GPT2Evaluation ev;
  const auto t0 = Clock::now();
  const int64_t T = data.max_length();
  std::vector<int32_t> tokens, targets;
  double totals[2] = {0, 0};  // Σ per-sample mean losses, samples
  for (const EvalMicroBatch& mb :
       eval_micro_batches(data.size(), batch, comm.world_size(), comm.rank())) {
    data.batch(mb.start, mb.count, tokens, targets);
    const double loss = model.forward(tokens.data(), targets.data(), mb.count, T, 1.0f, false);
    if (!mb.counted) continue;  // padding: only there to join the others' collectives
    totals[0] += loss * static_cast<double>(mb.count);
    totals[1] += static_cast<double>(mb.count);
  }
  reduce.sum(totals);
  ev.samples = static_cast<int64_t>(totals[1]);
  ev.loss = ev.samples ? totals[0] / totals[1] : ev.loss;
  ev.seconds = seconds_since(t0);
  return ev;
}

std::unique_ptr<Backend> make_backend(const std::string& device, int local_rank,
                                      Precision precision) {
  const bool cuda = device == "cuda" || (device != "cpu" && cuda_available());
  if (!cuda) {
    check_cpu_precision(precision);
    return make_cpu_backend();
  }
  const DType dt = precision == Precision::kFp32   ? DType::kF32
                   : precision == Precision::kFp16 ? DType::kF16
                                                   : DType::kBF16;
  return make_cuda_backend(local_rank, dt);
}

namespace {

/// Throws CheckpointError when `info` holds an image model, naming it and the GPT-2 model of the
/// run.
void require_gpt2_run(const CheckpointInfo& info, const GPT2Config& model) {
  check<CheckpointError>(!info.image,
                         "checkpoint {} holds {} but this run trains GPT-2 model '{}' ({}): pass "
                         "{} {} to continue the image model, or a GPT-2 checkpoint",
                         info.dir.string(), checkpoint_model_description(info), model.name,
                         model.shape_string(), knob_for(&TrainConfig::model).name(),
                         info.image ? info.image->name : "");
}

}  // namespace

GPT2Config resolve_train_model(const TrainConfig& cfg) {
  GPT2Config c;
  if (cfg.model.empty() && !cfg.resume.empty()) {
    const CheckpointInfo info = read_checkpoint_info(cfg.resume);
    check<CheckpointError>(
        !info.image, "checkpoint {} holds {}: pass {} {} (and its data) to resume it",
        info.dir.string(), checkpoint_model_description(info), knob_for(&TrainConfig::model).name(),
        info.image ? info.image->name : "");
    c = info.model;
  } else {
    c = resolve_model(cfg.model);
  }
  if (cfg.dropout >= 0) {  // --dropout overrides the model's three probabilities
    c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = static_cast<float>(cfg.dropout);
    validate_dropout(c, "--dropout");
  }
  return c;
}

namespace {

/// Checks the model against the run before any work (a validated config, a pipeline's layer
/// count) and warns about ZeRO-3's persistence threshold against the largest layer and head sizes
/// the fused flash-attention kernels lack. Throws ConfigError.
void check_model(const TrainConfig& cfg, const GPT2Config& model_cfg, const GPT2Model& model,
                 Backend& backend, Console& out) {
  check<ConfigError>(cfg.plan == plan_of(cfg),
                     "TrainConfig.plan (ZeRO stage {}) does not match strategy '{}' and its "
                     "zero_optimization section: call validate() on the config before train()",
                     cfg.plan.zero_stage, to_string(cfg.strategy));
  if (cfg.strategy == StrategyKind::kPipeline) check_pipeline_model(cfg, model_cfg.n_layer);
  for (const std::string& w : model_config_warnings(cfg, largest_layer_numel(model.layout())))
    out.warn(w);
  // Custom shapes may have head sizes the fused flash-attention kernels lack (32, 64, 128 in
  // bf16/fp16): those run, on the materialized attention kernels.
  const int head_size = model_cfg.n_embd / model_cfg.n_head;
  if (backend.kind() == DeviceKind::kCUDA && backend.compute_dtype() != DType::kF32 &&
      head_size != 32 && head_size != 64 && head_size != 128 &&
      backend.attention_saves_probs(head_size))
    out.warn(fmt::format(
        "head size {} (n_embd {} / n_head {}): the fused flash-attention kernels take head sizes "
        "32, 64 and 128, so attention runs on the materialized kernels (slower, and they keep "
        "batch·n_head·T² probabilities per layer)",
        head_size, model_cfg.n_embd, model_cfg.n_head));
}

/// The checkpoint --resume names, read before any work so that a mismatch fails first. Throws
/// CheckpointError for an image model's checkpoint, another shape or another optimizer's state.
std::optional<CheckpointInfo> read_resume(const TrainConfig& cfg, const GPT2Config& model_cfg) {
  if (cfg.resume.empty()) return std::nullopt;
  CheckpointInfo resume = read_checkpoint_info(cfg.resume);
  require_gpt2_run(resume, model_cfg);
  check<CheckpointError>(resume.model.same_shape(model_cfg),
                         "checkpoint {} holds model '{}' ({}) but this run asks for '{}' ({}): "
                         "leave {} out to resume with the checkpoint's shape",
                         resume.dir.string(), resume.model.name, resume.model.shape_string(),
                         model_cfg.name, model_cfg.shape_string(),
                         knob_for(&TrainConfig::model).name());
  check_state_kind(resume.optimizer, cfg.optimizer);  // AdamW m/v cannot seed SGD's buffer
  return resume;
}

/// The run's token data: the training split packed into samples of max_length + 1 tokens (at
/// most --num-samples), and the validation split (at most --eval-samples) when there is one.
struct GPT2Data {
  std::string name;
  PackedDataset train;
  std::optional<PackedDataset> valid;
  double seconds = 0;  ///< loading (and tokenizing, when not cached)
};

GPT2Data load_gpt2_data(const TrainConfig& cfg, const GPT2Config& model, Console& out) {
  const auto t0 = Clock::now();
  BpeTokenizer tokenizer = BpeTokenizer::load_default();
  const DatasetFiles files =
      resolve_dataset(cfg.dataset, cfg.train_file, cfg.valid_file, cfg.data_dir);
  const fs::path cache_dir = cfg.cache_dir.empty() ? default_cache_dir() : fs::path(cfg.cache_dir);
  auto log = [&](const std::string& m) { out.line("data: {}", m); };
  // Every id indexes the embedding: one out of the vocabulary would read and write past it.
  // A token file (or cache) is mapped read-only and shared by the node's ranks, not copied.
  auto tokens = [&](const fs::path& file) {
    TokenStore ids = load_token_store(file, tokenizer, cache_dir, log);
    check_token_ids(ids, model.vocab_size, file.string(), model.name);
    return ids;
  };
  PackedDataset train(tokens(files.train), cfg.max_length, files.name);
  train.limit(cfg.num_samples);
  std::optional<PackedDataset> valid;
  if (!files.valid.empty()) {
    valid.emplace(tokens(files.valid), cfg.max_length, files.name + " validation");
    if (cfg.eval_samples > 0 && cfg.eval_samples < valid->size()) valid->limit(cfg.eval_samples);
  }
  return GPT2Data{files.name, std::move(train), std::move(valid), seconds_since(t0)};
}

/// The full fp32 parameters [layout numel] of --init-from (Hugging Face safetensors, or a
/// shardtrain checkpoint).
std::vector<float> initial_parameters(const TrainConfig& cfg, const GPT2Config& model_cfg,
                                      GPT2Model& model) {
  std::vector<float> init(static_cast<size_t>(model.layout().numel()), 0.0f);
  const fs::path p = cfg.init_from;
  const bool hf_dir = fs::is_directory(p) && !fs::exists(p / "manifest.json");
  if (hf_dir && fs::exists(p / "model.safetensors")) {
    load_hf_weights(p / "model.safetensors", model.layout(), init.data());
  } else if (hf_dir && fs::exists(p / "model.safetensors.index.json")) {  // a sharded export
    load_hf_weights(p / "model.safetensors.index.json", model.layout(), init.data());
  } else if (fs::is_directory(p)) {
    const CheckpointInfo from = read_checkpoint_info(p);
    require_gpt2_run(from, model_cfg);
    init = load_checkpoint_params(from, model.layout());
  } else {
    load_hf_weights(p, model.layout(), init.data());
  }
  return init;
}

/// Sets `strategy` up on `model`: zeroed for a resume (the checkpoint is loaded next), from
/// --init-from, or with the model's initialisation drawn range by range (a rank never holds the
/// whole model's fp32 copy on the host: 49 GB for a 12B model).
void set_up_parameters(Strategy& strategy, GPT2Model& model, const TrainConfig& cfg,
                       const GPT2Config& model_cfg, bool resume) {
  if (resume) {
    strategy.setup(model, {});
  } else if (cfg.init_from.empty()) {
    strategy.setup_from(model, [&](int64_t offset, int64_t numel, float* out) {
      init_layout_range(model.layout(), cfg.seed, offset, numel, out);
    });
  } else {
    strategy.setup(model, initial_parameters(cfg, model_cfg, model));
  }
}

/// What the banner reports besides the config.
struct BannerFacts {
  const GPT2Config& model;
  const Backend& backend;
  const Strategy& strategy;
  const LossScaler& scaler;
  const GPT2Data& data;
  int world_size = 1;
  const RunPlan& plan;
  const std::vector<std::string>* pipeline = nullptr;  ///< the pipeline's description lines
  const CheckpointInfo* resume = nullptr;
  const TrainingProgress* progress = nullptr;
};

void print_banner(Console& out, const TrainConfig& cfg, const BannerFacts& f) {
  const bool pipelined = f.pipeline != nullptr;
  const bool low_precision =
      f.backend.kind() == DeviceKind::kCUDA && f.backend.compute_dtype() != DType::kF32;
  out.line("shardtrain {} | train {} ({} parameters) | strategy {} | {} × {} rank{}",
           SHARDTRAIN_VERSION, f.model.name, with_commas(f.model.num_parameters()),
           to_string(cfg.strategy), f.backend.description(), f.world_size,
           f.world_size > 1 ? "s" : "");
  out.line(
      "  batch: micro-batch {} × {} {} × {} {}{} = global batch {} samples × {} tokens = {} "
      "tokens/step",
      cfg.micro_batch_size, pipelined ? "micro-batches" : "accumulation",
      cfg.gradient_accumulation_steps, f.plan.replicas,
      pipelined ? "data-parallel replica" : "rank", f.plan.replicas > 1 ? "s" : "",
      f.plan.global_batch, cfg.max_length, with_commas(f.plan.global_batch * cfg.max_length));
  if (pipelined)
    for (const std::string& l : *f.pipeline) out.line("  {}", l);
  // --num-samples: the samples used, out of the corpus's (whose tokens are counted).
  const PackedDataset& train = f.data.train;
  const std::string samples =
      train.size() < train.available()
          ? fmt::format("{} training samples of the corpus's {} ({} tokens)",
                        with_commas(train.size()), with_commas(train.available()),
                        with_commas(train.num_tokens()))
          : fmt::format("{} training samples ({} tokens)", with_commas(train.size()),
                        with_commas(train.num_tokens()));
  out.line("  data: {} — {}, {} validation samples; loaded in {:.1f} s", f.data.name, samples,
           f.data.valid ? with_commas(f.data.valid->size()) : std::string("no"), f.data.seconds);
  out.line("  steps: {} ({} per epoch{}), warmup {}, {} schedule, {}, clip {:g}",
           f.plan.total_steps, f.plan.steps_per_epoch,
           cfg.max_steps > 0
               ? fmt::format(", {} {}", knob_for(&TrainConfig::max_steps).name(), cfg.max_steps)
               : fmt::format(", {} epochs", cfg.epochs),
           f.plan.warmup, to_string(cfg.lr_schedule), describe_optimizer(cfg),
           cfg.gradient_clipping);
  out.line(
      "  precision: {}{} | model states {} per rank | activation checkpointing {} | "
      "output: {}",
      dtype_name(f.backend.compute_dtype()),
      low_precision ? " compute, fp32 master weights and optimizer state" : "",
      human_bytes(static_cast<double>(f.strategy.model_state_bytes())),
      cfg.activation_checkpointing ? "on" : "off", cfg.output_dir);
  out.line("  dropout: {}",
           f.model.has_dropout()
               ? fmt::format("embd_pdrop {:g}, attn_pdrop {:g}, resid_pdrop {:g} (training "
                             "only; attention's effective p {:g}: 8-bit decisions)",
                             f.model.embd_pdrop, f.model.attn_pdrop, f.model.resid_pdrop,
                             attn_pdrop_effective(f.model.attn_pdrop))
               : std::string("off"));
  if (cfg.plan.optimizer_offload != OffloadDevice::kNone ||
      cfg.plan.param_offload != OffloadDevice::kNone) {
    const HostMemory h = f.strategy.host_memory();
    out.line(
        "  offload: optimizer on {} (ratio {:g}{}), parameters on {} | host memory per rank: {} "
        "pinned, {} pageable, {} on NVMe",
        to_string(cfg.plan.optimizer_offload), cfg.plan.optimizer_offload_ratio,
        cfg.zero.offload_moments_dtype == "bf16" ? ", bf16 moments" : "",
        cfg.plan.param_offload == OffloadDevice::kNone ? std::string("the device")
                                                       : to_string(cfg.plan.param_offload),
        human_bytes(static_cast<double>(h.pinned)), human_bytes(static_cast<double>(h.pageable)),
        human_bytes(static_cast<double>(h.nvme)));
    if (cfg.plan.param_offload == OffloadDevice::kNvme && cfg.zero.offload_param_max_in_cpu < 0)
      out.line(
          "  note: {} \"nvme\" without {} keeps the offloaded parameters in pinned host memory "
          "(2 bytes per parameter); set it to page the rest from NVMe",
          zero_knob(&ZeroConfig::offload_param_device).path,
          zero_knob(&ZeroConfig::offload_param_max_in_cpu).path);
    else if (cfg.plan.param_offload == OffloadDevice::kNvme)
      out.line(
          "  parameters: up to {} elements per rank in pinned host memory, the other layers paged "
          "from NVMe through {} pinned buffers ({}, {})",
          with_commas(cfg.zero.offload_param_max_in_cpu), cfg.zero.offload_param_buffer_count,
          zero_knob(&ZeroConfig::offload_param_max_in_cpu).path,
          zero_knob(&ZeroConfig::offload_param_buffer_count).path);
    if (const int64_t g = forward_group(cfg); g > 1)
      out.line(
          "  forward group: the first {} micro-batches of each step run their forward layer by "
          "layer, overlapping the host's update ({})",
          std::min(g, cfg.gradient_accumulation_steps),
          zero_knob(&ZeroConfig::offload_forward_group).label());
    if (speculative_update(cfg))
      out.line(
          "  speculative update: each part's host AdamW starts during backward, as soon as its "
          "gradient is final; a clipped step is rolled back and redone ({})",
          zero_knob(&ZeroConfig::offload_speculative_update).label());
    if (cfg.zero.offload_delayed_update)
      out.line(
          "  delayed parameter update (ZeRO-Offload DPU, arXiv 2101.06840 §4.3): from step 3 on, "
          "step t+1 computes on the parameters of step t-1 while the CPU runs step t's update "
          "(one step stale: W(t) = W(t-1) - lr·adamw(grad f(W(t-2))))");
  }
  if (f.scaler.enabled())
    out.line("  fp16 dynamic loss scaling: initial scale {:g}, window {}, hysteresis {}, min {:g}",
             f.scaler.scale(), cfg.loss_scale.loss_scale_window, cfg.loss_scale.hysteresis,
             cfg.loss_scale.min_loss_scale);
  if (f.resume)
    out.line("  resumed from {} at step {} (epoch {}, step {} of the epoch)",
             f.resume->dir.string(), f.progress->step, f.progress->epoch + 1,
             f.progress->step_in_epoch);
}

/// run.json: what this run is, for `shardtrain report` (train/report.h) and other readers of
/// metrics.jsonl: the configuration, the model's size and FLOPs, the ranks and the global batch.
void write_run_json(const TrainConfig& cfg, const BannerFacts& f) {
  json run = config_snapshot(cfg);
  run["model_name"] = f.model.name;
  run["parameters"] = f.model.num_parameters();
  run["flops_per_token"] = f.model.flops_per_token(cfg.max_length);
  run["peak_tflops"] = cfg.peak_tflops;
  run["on_gpu"] = f.backend.kind() == DeviceKind::kCUDA;
  run["backend"] = f.backend.description();
  run["world_size"] = f.world_size;
  run["global_batch"] = f.plan.global_batch;
  run["steps_per_epoch"] = f.plan.steps_per_epoch;
  run["total_steps"] = f.plan.total_steps;
  write_file_atomic(fs::path(cfg.output_dir) / "run.json", run.dump(2) + "\n");
}

/// Whether the FLOPs profiler (--profile-step / flops_profiler) can profile a step of this run;
/// says why not through `out`.
bool flops_profile_possible(const FlopsProfilerConfig& profile, bool pipelined, int64_t total_steps,
                            int64_t first_step, Console& out) {
  if (!profile.enabled) return false;
  if (pipelined) {
    out.line("warning: flops profiler: not supported with the pipeline strategy; no profile");
    return false;
  }
  if (profile.profile_step > total_steps) {
    out.line("warning: flops profiler: profile step {} is after the run's last step {}; no profile",
             profile.profile_step, total_steps);
  } else if (profile.profile_step <= first_step) {
    out.line("warning: flops profiler: profile step {} was run before this resumed run; no profile",
             profile.profile_step);
  }
  return true;
}

/// The profiled step: runs it with device timers around every layer's forward and backward and
/// the step's phases, then prints the FLOPs profile (rank 0) or writes it to the configured file.
StepResult profiled_gpt2_step(const TrainConfig& cfg, const GPT2Config& model_cfg, GPT2Model& model,
                              TrainStep& train_step, Backend& backend, Console& out, bool rank0,
                              int64_t step, double lr, const MicroBatchSource& batch) {
  LayerHooks* const strategy_hooks = model.hooks();
  std::unique_ptr<StreamClock> layer_clock = backend.make_stream_clock(), phase_clock;
  ProfilingHooks profiling(strategy_hooks, *layer_clock, model.num_layers());
  model.set_hooks(&profiling);
  if (train_step.clock() == nullptr) {
    phase_clock = backend.make_stream_clock();
    train_step.set_clock(phase_clock.get());
  }
  StepResult r = train_step.run(step, lr, batch);
  model.set_hooks(strategy_hooks);
  profiling.collect();
  if (phase_clock) train_step.set_clock(nullptr);
  const FlopsProfilerConfig& profile = cfg.flops_profiler;
  const int64_t B = cfg.micro_batch_size, T = cfg.max_length;
  FlopsProfileInput in;
  in.model = model_cfg;
  in.step = step + 1;
  in.tokens = B * T * cfg.gradient_accumulation_steps;
  in.seq_len = T;
  in.micro_batch = B;
  in.accumulation = cfg.gradient_accumulation_steps;
  in.layer_forward_s.assign(static_cast<size_t>(model_cfg.n_layer + 2), 0.0);
  in.layer_backward_s = in.layer_forward_s;
  for (int i = 0; i < model.num_layers(); ++i) {
    const auto g = static_cast<size_t>(model.global_layer(i));
    in.layer_forward_s[g] = profiling.forward_seconds()[static_cast<size_t>(i)];
    in.layer_backward_s[g] = profiling.backward_seconds()[static_cast<size_t>(i)];
  }
  in.phases = r.phases.value_or(PhaseTimes{});
  if (!cfg.wall_clock_breakdown) r.phases.reset();
  in.on_gpu = backend.kind() == DeviceKind::kCUDA;
  in.peak_tflops = cfg.peak_tflops;
  in.options = profile;
  const std::vector<std::string> lines = format_flops_profile(in);
  if (rank0 && !profile.output_file.empty()) {
    std::ofstream f(profile.output_file);
    for (const std::string& l : lines) f << l << '\n';
    f.close();  // a full disk shows when the buffer is written
    if (!f) {
      out.line("warning: flops profiler: cannot write '{}': {}", profile.output_file,
               std::strerror(errno));
    } else {
      out.line("flops profiler: step {} profile written to {}", in.step, profile.output_file);
    }
  } else {
    for (const std::string& l : lines) out.line("{}", l);
  }
  return r;
}

/// This rank's micro-batches: micro-batch k of step `step_in_epoch` of epoch `epoch`, from the
/// sampler, as tokens and next-token targets [B, T] int32 in buffers of its own (valid until the
/// next call).
class MicroBatchReader {
 public:
  MicroBatchReader(const DistributedSampler& sampler, const PackedDataset& data, int64_t B,
                   int64_t T)
      : sampler_(sampler),
        data_(data),
        B_(B),
        T_(T),
        tokens_(static_cast<size_t>(B * T)),
        targets_(static_cast<size_t>(B * T)),
        sample_(static_cast<size_t>(T + 1)) {}
  MicroBatch operator()(int64_t epoch, int64_t step_in_epoch, int64_t k) {
    const auto idx = sampler_.micro_batch_indices(epoch, step_in_epoch, k);
    for (int64_t i = 0; i < B_; ++i) {
      data_.sample(idx[static_cast<size_t>(i)], sample_.data());
      std::copy(sample_.begin(), sample_.end() - 1, tokens_.begin() + i * T_);
      std::copy(sample_.begin() + 1, sample_.end(), targets_.begin() + i * T_);
    }
    return MicroBatch{tokens_.data(), targets_.data(), B_, T_};
  }

 private:
  const DistributedSampler& sampler_;
  const PackedDataset& data_;
  int64_t B_, T_;
  std::vector<int32_t> tokens_, targets_, sample_;
};

/// The pipeline's validation loss over `data` (its last stage's sum, shared by every rank).
GPT2Evaluation evaluate_pipeline(PipelineParallel& pipeline, const PackedDataset& data,
                                 int64_t batch) {
  GPT2Evaluation ev;
  const auto t0 = Clock::now();
  const PipelineEvaluation pe = pipeline.evaluate(data, batch);
  ev.samples = pe.samples;
  ev.loss = pe.samples ? pe.loss_sum / static_cast<double>(pe.samples) : ev.loss;
  ev.seconds = seconds_since(t0);
  return ev;
}

/// Prints a validation and records it in metrics.jsonl and the monitors.
void report_validation(const GPT2Evaluation& ev, int64_t epoch, int64_t step, Console& out,
                       MetricsWriter& metrics, Monitor& monitor) {
  const double ppl = std::exp(ev.loss);
  out.line(
      "validation | epoch {} | step {} | loss {:.4f} | perplexity {:.2f} | {} samples in {:.1f} "
      "s",
      epoch + 1, step, ev.loss, ppl, ev.samples, ev.seconds);
  metrics.write({{"step", step},
                 {"epoch", epoch + 1},
                 {"val_loss", ev.loss},
                 {"val_ppl", ppl},
                 {"val_samples", ev.samples},
                 {"time_s", ev.seconds}});
  monitor.scalar("val/loss", ev.loss, step);
  monitor.scalar("val/perplexity", ppl, step);
}

/// Saves a sharded checkpoint of the run at `progress` under cfg.output_dir
/// (checkpoint-NNNNNN, atomic); returns its directory. Collective over `comm`.
std::string save_gpt2_checkpoint(const TrainConfig& cfg, const GPT2Config& model_cfg,
                                 const ParamLayout& layout, Strategy& strategy, Communicator& comm,
                                 const TrainingProgress& progress, const LossScaler& scaler) {
  CheckpointInfo ck;
  ck.model = model_cfg;
  ck.config = config_snapshot(cfg);
  ck.progress = progress;
  ck.loss_scaler = loss_scaler_json(scaler);
  ShardedSaveOptions opts;
  opts.consolidated_bf16_model = cfg.zero.stage3_gather_16bit_weights_on_model_save;
  return save_sharded_checkpoint(cfg.output_dir, fmt::format("checkpoint-{:06d}", progress.step),
                                 layout, strategy, comm, ck, opts)
      .string();
}

/// Prints the run's last line and records it in metrics.jsonl.
void report_done(const TrainSummary& summary, Console& out, MetricsWriter& metrics) {
  // Without a validation set nothing was measured: say so, rather than "nan" and "0.00".
  const bool validated = std::isfinite(summary.val_loss);
  const std::string validation = validated
                                     ? fmt::format("validation loss {:.4f} | perplexity {:.2f}",
                                                   summary.val_loss, summary.val_ppl)
                                     : std::string("no validation (no validation set)");
  if (summary.losses.empty())  // resumed at its last step: there was nothing left to train
    out.line(
        "done | {} steps | no step left to run: the checkpoint is at the run's last step (raise "
        "{} or {} to train on) | {}",
        summary.steps, knob_for(&TrainConfig::max_steps).name(),
        knob_for(&TrainConfig::epochs).name(), validation);
  else
    out.line("done | {} steps | {:.1f} s | loss {:.4f} → {:.4f} | {}", summary.steps,
             summary.seconds, summary.first_loss, summary.last_loss, validation);
  nlohmann::json done = {{"event", "done"},
                         {"step", summary.steps},
                         {"time_s", summary.seconds},
                         {"final_loss", summary.last_loss}};
  if (validated) {
    done["val_loss"] = summary.val_loss;
    done["val_ppl"] = summary.val_ppl;
  }
  metrics.write(done);
}

/// GPT-2 models (GPT2Model) in the trainer skeleton: WikiText-style token data packed into
/// samples of max_length + 1 tokens, --offload auto, the pipeline strategy, the FLOPs profiler and
/// --trace of an offloaded run.
class Gpt2Family final : public ModelFamily {
 public:
  explicit Gpt2Family(TrainSummary& summary) : summary_(summary) {
    summary_.val_loss = std::numeric_limits<double>::quiet_NaN();
  }

  void prepare(const TrainConfig& cfg, Console& /*out*/) override {
    model_cfg_ = resolve_train_model(cfg);
  }
  std::string agreement_shape(const TrainConfig& /*cfg*/) const override {
    return model_cfg_.shape_string();
  }
  TrainConfig place(const TrainConfig& cfg, Backend& backend, Communicator& comm,
                    Console& out) override {
    return with_automatic_placement(cfg, model_cfg_, backend, comm, out);
  }
  void build_model(const TrainConfig& cfg, Backend& backend, Communicator& /*comm*/,
                   Console& out) override {
    model_ = std::make_unique<GPT2Model>(model_cfg_, backend, cfg.activation_checkpointing);
    check_model(cfg, model_cfg_, *model_, backend, out);
  }
  Model& model() override { return *model_; }
  std::optional<CheckpointInfo> read_resume(const TrainConfig& cfg) override {
    return shardtrain::read_resume(cfg, model_cfg_);
  }
  // The D = world / P replicas of a pipeline share the data, its stages read the same
  // micro-batches (rank = stage·D + replica, pipeline_parallel.h).
  RunPlan plan(const TrainConfig& cfg, Communicator& comm, Console& out) override {
    data_ = std::make_unique<GPT2Data>(load_gpt2_data(cfg, model_cfg_, out));
    const bool pipelined = cfg.strategy == StrategyKind::kPipeline;
    const int replicas = comm.world_size() / (pipelined ? cfg.pipeline.stages : 1);
    sampler_ = std::make_unique<DistributedSampler>(data_->train.size(), cfg.micro_batch_size,
                                                    cfg.gradient_accumulation_steps,
                                                    comm.rank() % replicas, replicas, cfg.seed);
    return plan_run(cfg, *sampler_, replicas);
  }
  // The pipeline is a Strategy (checkpoints, memory) that also runs its own steps, evaluation and
  // trace: kept by its own type as well.
  std::unique_ptr<Strategy> make_strategy(const TrainConfig& cfg, Backend& backend,
                                          Communicator& comm) override {
    if (cfg.strategy != StrategyKind::kPipeline)
      return ModelFamily::make_strategy(cfg, backend, comm);
    std::unique_ptr<PipelineParallel> pipeline = make_pipeline_strategy(cfg, backend, comm);
    pipeline_ = pipeline.get();
    return pipeline;
  }
  void set_up_parameters(Strategy& strategy, const TrainConfig& cfg, bool resuming) override {
    shardtrain::set_up_parameters(strategy, *model_, cfg, model_cfg_, resuming);
  }
  void announce(const RunContext& run) override {
    const std::vector<std::string> pipeline_lines =
        pipeline_ ? pipeline_->describe() : std::vector<std::string>{};
    const BannerFacts facts{
        model_cfg_, run.backend,           run.strategy, run.scaler,
        *data_,     run.comm.world_size(), run.plan,     pipeline_ ? &pipeline_lines : nullptr,
        run.resume, &run.progress};
    print_banner(run.out, run.cfg, facts);
    if (run.rank0()) write_run_json(run.cfg, facts);
  }

  Throughput throughput(const RunContext& run) const override {
    return Throughput{"tokens", run.plan.tokens_per_step,
                      model_cfg_.flops_per_token(run.cfg.max_length)};
  }
  void start_loop(const RunContext& run, EpochLoop& loop, StreamClock* clock) override {
    const TrainConfig& cfg = run.cfg;
    loop.units_per_step = run.plan.tokens_per_step;
    loop.seq_len = cfg.max_length;
    const TrainStepOptions options{cfg.gradient_accumulation_steps, cfg.gradient_clipping, cfg.seed,
                                   forward_group(cfg), speculative_update(cfg)};
    train_step_ = std::make_unique<TrainStep>(*model_, run.strategy, run.comm, run.backend,
                                              run.scaler, options, clock);
    if (pipeline_) pipeline_step_ = std::make_unique<PipelineStep>(*pipeline_, run.scaler, options);
    profile_ = flops_profile_possible(cfg.flops_profiler, pipeline_ != nullptr,
                                      run.plan.total_steps, run.progress.step, run.out);
    micro_batch_ = std::make_unique<MicroBatchReader>(*sampler_, data_->train, cfg.micro_batch_size,
                                                      cfg.max_length);
    rank_scalars_ = &loop.reduce;  // 2 values, as evaluate_gpt2 needs
    // --trace of an offloaded run (rank 0): the timeline of two consecutive steps — the third
    // and fourth of the run, or the last two — so that one step's host update is seen
    // overlapping the next step's forward (monitor/step_trace.h).
    if (!pipeline_ && !cfg.trace_dir.empty() && run.rank0()) {
      step_trace_ = std::make_unique<StepTrace>(run.backend.make_device_timeline());
      trace_first_ =
          std::max<int64_t>(run.progress.step, std::min<int64_t>(2, run.plan.total_steps - 2));
    }
  }
  StepResult step(const RunContext& run, int64_t epoch, double lr) override {
    const TrainConfig& cfg = run.cfg;
    const TrainingProgress& progress = run.progress;
    MicroBatchReader& reader = *micro_batch_;
    const MicroBatchSource batch = [&](int64_t k) {
      return reader(epoch, progress.step_in_epoch, k);
    };
    // The next step's micro-batches (2bw runs their first forwards at the end of this step).
    const bool epoch_ends = progress.step_in_epoch + 1 >= run.plan.steps_per_epoch;
    const MicroBatchSource next_batch = [&](int64_t k) {
      return epoch_ends ? reader(epoch + 1, 0, k) : reader(epoch, progress.step_in_epoch + 1, k);
    };
    const bool has_next = progress.step + 1 < run.plan.total_steps;
    StepRunner& runner = pipeline_step_ ? static_cast<StepRunner&>(*pipeline_step_) : *train_step_;
    StepResult r = profile_ && progress.step + 1 == cfg.flops_profiler.profile_step
                       ? profiled_gpt2_step(cfg, model_cfg_, *model_, *train_step_, run.backend,
                                            run.out, run.rank0(), progress.step, lr, batch)
                       : runner.run(progress.step, lr, batch, has_next ? &next_batch : nullptr);
    if (r.skipped)
      run.out.line(
          "step {}: fp16 gradients overflowed at loss scale {:g}: step skipped, scale now {:g}",
          progress.step + 1, r.loss_scale, run.scaler.scale());
    return r;
  }
  void before_step(const RunContext& run) override {
    if (!step_trace_ || run.progress.step != trace_first_) return;
    run.backend.synchronize();
    step_trace_->start();
    train_step_->set_trace(step_trace_.get());
    run.strategy.set_trace(step_trace_.get());
  }
  void after_step(const RunContext& run) override {
    const int64_t step = run.progress.step;
    if (!step_trace_ || !(step == trace_first_ + 2 || step == run.plan.total_steps)) return;
    if (step <= trace_first_) return;
    run.strategy.set_trace(nullptr);
    train_step_->set_trace(nullptr);
    run.backend.synchronize();
    const std::vector<StepTrace::Segment> segments = step_trace_->finish();
    for (const std::string& l : StepTrace::write(
             run.cfg.trace_dir, segments,
             fmt::format("{}: steps {}–{} (rank 0), {} × {} micro-batches of {} tokens",
                         model_cfg_.name, trace_first_ + 1, step, run.cfg.micro_batch_size,
                         run.cfg.gradient_accumulation_steps, run.cfg.max_length)))
      run.out.line("{}", l);
    step_trace_.reset();
  }
  void evaluate(const RunContext& run, int64_t epoch) override {
    if (!data_->valid) return;
    const int64_t B = run.cfg.micro_batch_size;
    const GPT2Evaluation ev =
        pipeline_ ? evaluate_pipeline(*pipeline_, *data_->valid, B)
                  : evaluate_gpt2(*model_, *data_->valid, B, run.comm, *rank_scalars_);
    summary_.val_loss = ev.loss;
    summary_.val_ppl = std::exp(ev.loss);
    report_validation(ev, epoch, run.progress.step, run.out, run.metrics, run.monitor);
  }
  std::string save(const RunContext& run) override {
    return save_gpt2_checkpoint(run.cfg, model_cfg_, model_->layout(), run.strategy, run.comm,
                                run.progress, run.scaler);
  }

  void finish(const RunContext& run, LossHistory losses, double seconds,
              int64_t first_step) override {
    summary_.first_loss = losses.first;
    summary_.last_loss = losses.last;
    summary_.losses = std::move(losses.all);
    summary_.seconds = seconds;
    summary_.steps = run.progress.step;
    if (pipeline_)
      for (const std::string& l : pipeline_->finish_trace()) run.out.line("{}", l);
    if (speculative_update(run.cfg))
      run.out.line(
          "speculative update: {} of {} steps rolled back and redone (clipped after an unclipped "
          "step)",
          run.strategy.rolled_back_updates(), run.progress.step - first_step);
  }
  void report_done(const RunContext& run, const std::string& checkpoint) override {
    summary_.checkpoint = checkpoint;
    shardtrain::report_done(summary_, run.out, run.metrics);
  }

  void end_loop() noexcept override {
    step_trace_.reset();
    rank_scalars_ = nullptr;
    micro_batch_.reset();
    pipeline_step_.reset();
    train_step_.reset();
  }
  void release() noexcept override {
    pipeline_ = nullptr;
    sampler_.reset();
    data_.reset();
    model_.reset();
  }

 private:
  TrainSummary& summary_;
  GPT2Config model_cfg_;
  std::unique_ptr<GPT2Model> model_;
  std::unique_ptr<GPT2Data> data_;
  std::unique_ptr<DistributedSampler> sampler_;
  PipelineParallel* pipeline_ = nullptr;  ///< the strategy, when it is the pipeline
  std::unique_ptr<TrainStep> train_step_;
  std::unique_ptr<PipelineStep> pipeline_step_;
  std::unique_ptr<MicroBatchReader> micro_batch_;
  ScalarAllReduce* rank_scalars_ = nullptr;  ///< the validation's sums: the loop's reducer
  bool profile_ = false;
  std::unique_ptr<StepTrace> step_trace_;
  int64_t trace_first_ = -1;
};

}  // namespace

TrainSummary train(const TrainConfig& cfg, Communicator& comm) {
  TrainSummary summary;
  Gpt2Family family(summary);
  run_training(family, cfg, comm);
  return summary;
}

}  // namespace shardtrain
