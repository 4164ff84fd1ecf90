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

#include "core/error.h"
#include "core/philox.h"
#include "core/strings.h"
#include "data/bpe_tokenizer.h"
#include "data/dataset.h"
#include "io/atomic_file.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "io/monitor.h"
#include "io/sharded_checkpoint.h"
#include "model/gpt2.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "parallel/pipeline/pipeline_parallel.h"
#include "parallel/strategy.h"
#include "train/flops_profiler.h"
#include "train/train_common.h"
#include "train/train_step.h"

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

namespace {

/// Throws CheckpointError when `info` holds an image model, naming it and the GPT-2 model of the
/// run.
void require_gpt2_run(const CheckpointInfo& info, const GPT2Config& model) {
  check<CheckpointError>(!info.image,
                         "checkpoint {} holds {} but this run trains GPT-2 model '{}' ({}): pass "
                         "--model {} to continue the image model, or a GPT-2 checkpoint",
                         info.dir.string(), checkpoint_model_description(info), model.name,
                         model.shape_string(), info.image ? info.image->name : "");
}

}  // namespace

GPT2Config resolve_train_model(const TrainConfig& cfg) {
  GPT2Config c;
  if (cfg.model.empty() && !cfg.resume.empty()) {
    const CheckpointInfo info = read_checkpoint_info(cfg.resume);
    check<CheckpointError>(
        !info.image, "checkpoint {} holds {}: pass --model {} (and its data) to resume it",
        info.dir.string(), checkpoint_model_description(info), info.image ? info.image->name : "");
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

TrainSummary train(const TrainConfig& cfg, Communicator& comm) {
  const bool rank0 = comm.rank() == 0;
  Console out(rank0);
  TrainSummary summary;
  summary.val_loss = std::numeric_limits<double>::quiet_NaN();

  // ---- model and device ----
  GPT2Config model_cfg = resolve_train_model(cfg);
  std::unique_ptr<Backend> backend = make_backend(cfg.device, local_rank_of(comm), cfg.precision);
  const bool on_gpu = backend->kind() == DeviceKind::kCUDA;
  // Collectives must start after the kernels that produce their inputs (the backend computes on
  // its own non-default stream), and must not use that stream once the backend (declared before
  // this guard) destroys it.
  ComputeStreamScope compute_stream(comm, *backend);
  LossScaler scaler(cfg.loss_scale, backend->compute_dtype() == DType::kF16);
  GPT2Model model(model_cfg, *backend, cfg.activation_checkpointing);
  check<ConfigError>(cfg.plan == plan_of(cfg),
                     "TrainConfig.plan (ZeRO stage {}) does not match strategy '{}' and its "
                     "zero_optimization section: call validate() on the config before train()",
                     cfg.plan.zero_stage, to_string(cfg.strategy));
  const bool pipelined = cfg.strategy == StrategyKind::kPipeline;
  if (pipelined) check_pipeline_model(cfg, model_cfg.n_layer);
  for (const std::string& w : model_config_warnings(cfg, largest_layer_numel(model.layout())))
    out.warn(w);
  // Custom shapes may have head sizes the fused flash-attention kernels lack (32, 64, 128 in
  // bf16/fp16): those run, on the materialized attention kernels.
  const int head_size = model_cfg.n_embd / model_cfg.n_head;
  if (on_gpu && backend->compute_dtype() != DType::kF32 && head_size != 32 && head_size != 64 &&
      head_size != 128 && backend->attention_saves_probs(head_size))
    out.warn(fmt::format(
        "head size {} (n_embd {} / n_head {}): the fused flash-attention kernels take head sizes "
        "32, 64 and 128, so attention runs on the materialized kernels (slower, and they keep "
        "batch·n_head·T² probabilities per layer)",
        head_size, model_cfg.n_embd, model_cfg.n_head));

  // ---- resume: read the checkpoint first so a mismatch fails before any work ----
  std::optional<CheckpointInfo> resume;
  if (!cfg.resume.empty()) {
    resume = read_checkpoint_info(cfg.resume);
    require_gpt2_run(*resume, model_cfg);
    check<CheckpointError>(resume->model.same_shape(model_cfg),
                           "checkpoint {} holds model '{}' ({}) but this run asks for '{}' ({}): "
                           "leave --model out to resume with the checkpoint's shape",
                           resume->dir.string(), resume->model.name, resume->model.shape_string(),
                           model_cfg.name, model_cfg.shape_string());
    check_state_kind(resume->optimizer, cfg.optimizer);  // AdamW m/v cannot seed SGD's buffer
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

  // Pipeline: the D = world / P replicas share the data; the stages of a replica read the same
  // micro-batches (rank = stage·D + replica, pipeline_parallel.h).
  const int stages = pipelined ? cfg.pipeline.stages : 1;
  const int replicas = comm.world_size() / stages;
  DistributedSampler sampler(train_data.size(), cfg.micro_batch_size,
                             cfg.gradient_accumulation_steps, comm.rank() % replicas, replicas,
                             cfg.seed);
  const int64_t steps_per_epoch = sampler.steps_per_epoch();
  const int64_t total_steps = cfg.max_steps > 0 ? cfg.max_steps : cfg.epochs * steps_per_epoch;
  const int64_t warmup =
      cfg.warmup_steps >= 0 ? cfg.warmup_steps : std::min<int64_t>(1000, total_steps / 10);
  const int64_t T = cfg.max_length, B = cfg.micro_batch_size,
                accum = cfg.gradient_accumulation_steps;
  const int64_t tokens_per_step = sampler.global_batch() * T;

  // ---- parameters and strategy ----
  std::unique_ptr<Strategy> strategy =
      pipelined ? make_pipeline_strategy(cfg, *backend, comm) : make_strategy(cfg, *backend, comm);
  TrainingProgress progress;
  progress.seed = cfg.seed;
  {
    // Resuming loads each rank's own ranges of the checkpoint into zeroed buffers: no rank holds
    // the full fp32 parameters.
    std::vector<float> init;
    if (!resume) {
      init.assign(static_cast<size_t>(model.layout().numel()), 0.0f);
      if (!cfg.init_from.empty()) {
        const fs::path p = cfg.init_from;
        if (fs::is_directory(p) && fs::exists(p / "model.safetensors") &&
            !fs::exists(p / "manifest.json"))
          load_hf_weights(p / "model.safetensors", model.layout(), init.data());
        else if (fs::is_directory(p)) {
          const CheckpointInfo from = read_checkpoint_info(p);
          require_gpt2_run(from, model_cfg);
          init = load_checkpoint_params(from, model.layout());
        } else
          load_hf_weights(p, model.layout(), init.data());
      } else {
        model.init_parameters(init.data(), cfg.seed);
      }
    }
    strategy->setup(model, init);
  }
  if (resume) progress = resume_from(*resume, model.layout(), *strategy, comm, scaler, total_steps);

  const fs::path out_dir = cfg.output_dir;
  const std::optional<int64_t> continue_after =
      logs_continue_after(resume.has_value(), progress.step);
  MetricsWriter metrics = open_run_metrics(cfg, rank0, continue_after);
  Monitor monitor =
      open_run_monitor(cfg, comm.rank(), config_snapshot(cfg).dump(2), continue_after);

  // ---- banner ----
  out.line("shardtrain {} | train {} ({} parameters) | strategy {} | {} × {} rank{}",
           SHARDTRAIN_VERSION, model_cfg.name, with_commas(model_cfg.num_parameters()),
           to_string(cfg.strategy), backend->description(), comm.world_size(),
           comm.world_size() > 1 ? "s" : "");
  out.line(
      "  batch: micro-batch {} × {} {} × {} {}{} = global batch {} samples × {} tokens = {} "
      "tokens/step",
      B, pipelined ? "micro-batches" : "accumulation", accum, replicas,
      pipelined ? "data-parallel replica" : "rank", replicas > 1 ? "s" : "", sampler.global_batch(),
      T, with_commas(tokens_per_step));
  PipelineParallel* pipeline = strategy->as_pipeline();
  if (pipeline)
    for (const std::string& l : pipeline->describe()) out.line("  {}", l);
  out.line(
      "  data: {} — {} training samples ({} tokens), {} validation samples; loaded in {:.1f} s",
      files.name, with_commas(train_data.size()), with_commas(train_data.num_tokens()),
      valid_data ? with_commas(valid_data->size()) : std::string("no"), data_seconds);
  out.line("  steps: {} ({} per epoch{}), warmup {}, {} schedule, {}, clip {:g}", total_steps,
           steps_per_epoch,
           cfg.max_steps > 0 ? fmt::format(", --max-steps {}", cfg.max_steps)
                             : fmt::format(", {} epochs", cfg.epochs),
           warmup, to_string(cfg.lr_schedule), describe_optimizer(cfg), cfg.gradient_clipping);
  out.line(
      "  precision: {}{} | model states {} per rank | activation checkpointing {} | "
      "output: {}",
      dtype_name(backend->compute_dtype()),
      on_gpu && backend->compute_dtype() != DType::kF32
          ? " compute, fp32 master weights and optimizer state"
          : "",
      human_bytes(static_cast<double>(strategy->model_state_bytes())),
      cfg.activation_checkpointing ? "on" : "off", out_dir.string());
  out.line("  dropout: {}",
           model_cfg.has_dropout()
               ? fmt::format("embd_pdrop {:g}, attn_pdrop {:g}, resid_pdrop {:g} (training "
                             "only; attention's effective p {:g}: 8-bit decisions)",
                             model_cfg.embd_pdrop, model_cfg.attn_pdrop, model_cfg.resid_pdrop,
                             attn_pdrop_effective(model_cfg.attn_pdrop))
               : std::string("off"));
  if (cfg.plan.optimizer_offload != OffloadDevice::kNone ||
      cfg.plan.param_offload != OffloadDevice::kNone) {
    const HostMemory h = strategy->host_memory();
    out.line(
        "  offload: optimizer on {} (ratio {:g}), parameters on {} | host memory per rank: {} "
        "pinned, {} pageable, {} on NVMe",
        to_string(cfg.plan.optimizer_offload), cfg.plan.optimizer_offload_ratio,
        cfg.plan.param_offload == OffloadDevice::kNone ? std::string("the device")
                                                       : to_string(cfg.plan.param_offload),
        human_bytes(static_cast<double>(h.pinned)), human_bytes(static_cast<double>(h.pageable)),
        human_bytes(static_cast<double>(h.nvme)));
    if (cfg.plan.param_offload == OffloadDevice::kNvme)
      out.line(
          "  note: offload_param.device \"nvme\": this release keeps the offloaded parameters in "
          "pinned host memory (2 bytes per parameter); the optimizer state is on NVMe");
    if (cfg.zero.offload_delayed_update)
      out.line(
          "  delayed parameter update (ZeRO-Offload DPU, arXiv 2101.06840 §4.3): from step 3 on, "
          "step t+1 computes on the parameters of step t-1 while the CPU runs step t's update "
          "(one step stale: W(t) = W(t-1) - lr·adamw(grad f(W(t-2))))");
  }
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
    ck.loss_scaler = loss_scaler_json(scaler);
    ShardedSaveOptions opts;
    opts.consolidated_bf16_model = cfg.zero.stage3_gather_16bit_weights_on_model_save;
    const fs::path dir =
        save_sharded_checkpoint(out_dir, fmt::format("checkpoint-{:06d}", progress.step),
                                model.layout(), *strategy, comm, ck, opts);
    summary.checkpoint = dir.string();
    out.line("saved checkpoint {}", dir.string());
  };
  ScalarAllReduce rank_scalars(*backend, comm, 2);
  auto validate_now = [&](int64_t epoch) {
    if (!valid_data) return;
    GPT2Evaluation ev;
    if (pipeline) {
      const auto t0 = Clock::now();
      const PipelineEvaluation pe = pipeline->evaluate(*valid_data, B);
      ev.samples = pe.samples;
      ev.loss = pe.samples ? pe.loss_sum / static_cast<double>(pe.samples) : ev.loss;
      ev.seconds = seconds_since(t0);
    } else {
      ev = evaluate_gpt2(model, *valid_data, B, comm, rank_scalars);
    }
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
    monitor.scalar("val/loss", ev.loss, progress.step);
    monitor.scalar("val/perplexity", summary.val_ppl, progress.step);
  };

  // wall_clock_breakdown: device time of each phase, summed over the log window, in seconds.
  std::unique_ptr<StreamClock> clock =
      cfg.wall_clock_breakdown ? backend->make_stream_clock() : nullptr;
  TrainStep train_step(model, *strategy, comm, *backend, scaler,
                       TrainStepOptions{accum, cfg.gradient_clipping, cfg.seed}, clock.get());
  // FLOPs profiler (--profile-step / flops_profiler): one step, not with a pipeline schedule.
  const FlopsProfilerConfig& profile = cfg.flops_profiler;
  bool profile_enabled = profile.enabled;
  if (profile_enabled && pipeline) {
    out.line("warning: flops profiler: not supported with the pipeline strategy; no profile");
    profile_enabled = false;
  } else if (profile_enabled && profile.profile_step > total_steps) {
    out.line("warning: flops profiler: profile step {} is after the run's last step {}; no profile",
             profile.profile_step, total_steps);
  } else if (profile_enabled && profile.profile_step <= progress.step) {
    out.line("warning: flops profiler: profile step {} was run before this resumed run; no profile",
             profile.profile_step);
  }
  StepLog step_log(out, metrics, monitor, cfg,
                   Throughput{"tokens", tokens_per_step, model_cfg.flops_per_token(T)},
                   comm.world_size(), on_gpu, total_steps);
  // run.json: what this run is, for `shardtrain report` (train/report.h) and other readers of
  // metrics.jsonl: the configuration, the model's size and FLOPs, the ranks and the global batch.
  if (rank0) {
    json run = config_snapshot(cfg);
    run["model_name"] = model_cfg.name;
    run["parameters"] = model_cfg.num_parameters();
    run["flops_per_token"] = model_cfg.flops_per_token(T);
    run["peak_tflops"] = cfg.peak_tflops;
    run["on_gpu"] = on_gpu;
    run["backend"] = backend->description();
    run["world_size"] = comm.world_size();
    run["global_batch"] = sampler.global_batch();
    run["steps_per_epoch"] = steps_per_epoch;
    run["total_steps"] = total_steps;
    write_file_atomic(out_dir / "run.json", run.dump(2) + "\n");
  }
  EpochLoop loop{.cfg = cfg,
                 .out = out,
                 .metrics = metrics,
                 .monitor = monitor,
                 .backend = *backend,
                 .reduce = rank_scalars,
                 .strategy = *strategy,
                 .scaler = scaler,
                 .step_log = step_log,
                 .steps_per_epoch = steps_per_epoch,
                 .total_steps = total_steps,
                 .warmup = warmup,
                 .samples_per_step = sampler.global_batch(),
                 .units_per_step = tokens_per_step,
                 .seq_len = T};
  loop.step = [&](int64_t epoch, double lr) {
    // This rank's micro-batch k of the step, from the sampler.
    const auto micro_batch = [&](int64_t ep, int64_t step_in_epoch, int64_t k) {
      const auto idx = sampler.micro_batch_indices(ep, step_in_epoch, k);
      for (int64_t i = 0; i < B; ++i) {
        train_data.sample(idx[static_cast<size_t>(i)], sample.data());
        std::copy(sample.begin(), sample.end() - 1, tokens.begin() + i * T);
        std::copy(sample.begin() + 1, sample.end(), targets.begin() + i * T);
      }
      return MicroBatch{tokens.data(), targets.data(), B, T};
    };
    const MicroBatchSource batch = [&](int64_t k) {
      return micro_batch(epoch, progress.step_in_epoch, k);
    };
    // The next step's micro-batches (2bw runs their first forwards at the end of this step).
    const bool epoch_ends = progress.step_in_epoch + 1 >= steps_per_epoch;
    const MicroBatchSource next_batch = [&](int64_t k) {
      return epoch_ends ? micro_batch(epoch + 1, 0, k)
                        : micro_batch(epoch, progress.step_in_epoch + 1, k);
    };
    const bool has_next = progress.step + 1 < total_steps;
    // FLOPs profiler: this step with every layer timed and the phases marked.
    const bool profile_now = profile_enabled && progress.step + 1 == profile.profile_step;
    LayerHooks* const strategy_hooks = model.hooks();
    std::unique_ptr<StreamClock> layer_clock, phase_clock;
    std::unique_ptr<ProfilingHooks> profiling;
    if (profile_now) {
      layer_clock = backend->make_stream_clock();
      profiling =
          std::make_unique<ProfilingHooks>(strategy_hooks, *layer_clock, model.num_layers());
      model.set_hooks(profiling.get());
      if (train_step.clock() == nullptr) {
        phase_clock = backend->make_stream_clock();
        train_step.set_clock(phase_clock.get());
      }
    }
    StepResult r =
        pipeline ? pipeline->run_step(progress.step, lr, batch, scaler,
                                      TrainStepOptions{accum, cfg.gradient_clipping, cfg.seed},
                                      has_next ? &next_batch : nullptr)
                 : train_step.run(progress.step, lr, batch);
    if (profile_now) {
      model.set_hooks(strategy_hooks);
      profiling->collect();
      if (phase_clock) train_step.set_clock(nullptr);
      FlopsProfileInput in;
      in.model = model_cfg;
      in.step = progress.step + 1;
      in.tokens = B * T * accum;
      in.seq_len = T;
      in.micro_batch = B;
      in.accumulation = accum;
      in.layer_forward_s.assign(static_cast<size_t>(model_cfg.n_layer + 2), 0.0);
      in.layer_backward_s = in.layer_forward_s;
      for (int i = 0; i < model.num_layers(); ++i) {
        const auto g = static_cast<size_t>(model.global_layer(i));
        in.layer_forward_s[g] = profiling->forward_seconds()[static_cast<size_t>(i)];
        in.layer_backward_s[g] = profiling->backward_seconds()[static_cast<size_t>(i)];
      }
      in.phases = r.phases.value_or(PhaseTimes{});
      if (!cfg.wall_clock_breakdown) r.phases.reset();
      in.on_gpu = on_gpu;
      in.peak_tflops = cfg.peak_tflops;
      in.options = profile;
      const std::vector<std::string> lines = format_flops_profile(in);
      if (rank0 && !profile.output_file.empty()) {
        std::ofstream f(profile.output_file);
        for (const std::string& l : lines) f << l << '\n';
        if (!f) {
          out.line("warning: flops profiler: cannot write '{}': {}", profile.output_file,
                   std::strerror(errno));
        } else {
          out.line("flops profiler: step {} profile written to {}", in.step, profile.output_file);
        }
      } else {
        for (const std::string& l : lines) out.line("{}", l);
      }
    }
    if (r.skipped)
      out.line(
          "step {}: fp16 gradients overflowed at loss scale {:g}: step skipped, scale now {:g}",
          progress.step + 1, r.loss_scale, scaler.scale());
    return r;
  };
  loop.evaluate = validate_now;
  loop.after_step = [&] {
    if (cfg.save_interval > 0 && progress.step % cfg.save_interval == 0 &&
        progress.step < total_steps)
      save();
  };
  LossHistory losses = run_epochs(loop, progress);
  summary.first_loss = losses.first;
  summary.last_loss = losses.last;
  summary.losses = std::move(losses.all);
  summary.seconds = seconds_since(t_train);
  if (pipeline)
    for (const std::string& l : pipeline->finish_trace()) out.line("{}", l);
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
