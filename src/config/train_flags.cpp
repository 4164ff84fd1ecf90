// The flags of `shardtrain train` and the merge with the DeepSpeed JSON config.
#include "config/train_flags.h"

#include <fmt/core.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>

#include "config/knob.h"
#include "core/error.h"
#include "core/strings.h"
#include "model/gpt2_config.h"

namespace shardtrain {

namespace {

// Validators with plain messages; CLI11 prefixes them with the flag ("--lr: ...").
// Their descriptions are empty so that the help shows the ranges only in the flag's text.

/// A decimal integer in [0, 2^64).
CLI::Validator unsigned_64() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t v = 0;
        const char* end = s.data() + s.size();
        auto [ptr, ec] = std::from_chars(s.data(), end, v);
        if (s.empty() || ec != std::errc() || ptr != end)
          return fmt::format("must be an integer in [0, 18446744073709551615], got '{}'", s);
        return {};
      },
      "");
}

constexpr double kInf = std::numeric_limits<double>::infinity();

CLI::Validator strategy_name() {
  return parsed_by([](const std::string& s) { parse_strategy(s); });
}

std::string or_none(const std::string& s) { return s.empty() ? "none" : s; }

bool contains(const ExplicitFlags& flags, std::string_view name) {
  return std::find(flags.begin(), flags.end(), name) != flags.end();
}

/// The flags of pipeline parallelism, as explicit_train_flags names them: its rows' and --trace.
std::vector<std::string> pipeline_flags() {
  std::vector<std::string> out;
  for (const Knob& k : pipeline_knobs())
    if (k.surfaces & kTrainFlag) out.push_back(k.explicit_name());
  out.emplace_back("trace");
  return out;
}

}  // namespace

void add_train_flags(CLI::App& cmd, TrainConfig& cfg) {
  // ---- model and placement ----
  cmd.add_option("--model", cfg.model,
                 fmt::format("GPT-2 model: a preset ({}) or the path of a Hugging Face style "
                             "config.json (n_layer, n_embd, n_head, n_positions, vocab_size) or "
                             "of a directory holding one; with --resume, leave it out to use the "
                             "checkpoint's shape (default: {})",
                             join(gpt2_preset_names(), ", "), cfg.model))
      ->type_name("NAME|PATH");
  cmd.add_option("--strategy", cfg.strategy_name,
                 fmt::format("parallelism strategy: dp|ddp (data parallel), zero1, "
                             "zero2|fsdp_stage2, zero3|fsdp_stage3, offload (zero2 + optimizer on "
                             "the CPU), infinity (zero3 + optimizer on NVMe, parameters on the "
                             "CPU), pipeline (layers cut into {} stages, ZeRO 0-2 across the "
                             "replicas) (default: {})",
                             knob_for(&TrainConfig::pipeline, &PipelineConfig::stages).name(),
                             cfg.strategy_name))
      ->type_name("NAME")
      ->check(strategy_name());
  cmd.add_option("--device", cfg.device,
                 fmt::format("auto|cpu|cuda; auto uses CUDA when a GPU is usable (default: {})",
                             cfg.device))
      ->type_name("DEVICE")
      ->check(one_of({"auto", "cpu", "cuda"}));
  cmd.add_option_function<std::string>(
         "--precision", [&cfg](const std::string& s) { cfg.precision = parse_precision(s); },
         fmt::format("auto|fp32|bf16|fp16 compute precision; auto lets the device decide "
                     "(default: {})",
                     to_string(cfg.precision)))
      ->type_name("PREC")
      ->check(one_of({"auto", "fp32", "bf16", "fp16"}));
  cmd.add_option_function<std::string>(
         "--offload", [&cfg](const std::string&) { cfg.placement.automatic = true; },
         fmt::format("auto: choose the ZeRO stage and where the optimizer state and the "
                     "parameters live (GPU, host, {}) at start-up, the plan that fits "
                     "--gpu-memory and --max-host-memory with the fewest bytes over PCIe and the "
                     "disk per step; given only {}, also the micro-batch and accumulation "
                     "predicted fastest (`shardtrain estimate --gpu-memory` shows the candidates)",
                     zero_knob(&ZeroConfig::nvme_path).name(),
                     knob_for(&TrainConfig::train_batch_size).name()))
      ->type_name("auto")
      ->check(one_of({"auto"}));
  cmd.add_option("--gpu-memory", cfg.placement.gpu_memory_gib,
                 "--offload auto: GiB of memory per GPU the plan may use (default: the GPU's "
                 "total; needed on CPU ranks)")
      ->type_name("GIB")
      ->check(number_in(0, true, kInf, false));
  cmd.add_option("--max-host-memory", cfg.placement.max_host_memory_gib,
                 "--offload auto: GiB of host memory per node the plan may use (default: the "
                 "node's available memory)")
      ->type_name("GIB")
      ->check(number_in(0, true, kInf, false));
  // The flags of the knob tables: --zero-stage, --offload-*, --grad-clip, --log-interval, ...
  for (const KnobTable* table :
       {&top_level_knobs(), &fp16_knobs(), &zero_knobs(), &aio_knobs(),
        &activation_checkpointing_knobs(), &pipeline_knobs(), &monitor_knobs()})
    add_knob_flags(cmd, cfg, *table, kTrainFlag);
  cmd.add_option("--trace", cfg.trace_dir,
                 "pipeline: write the measured per-stage pipeline timeline to this directory; "
                 "offload: the timeline of two steps (GPU compute, PCIe each way, host AdamW, "
                 "NVMe waits: offload-timeline.svg, offload-trace.json) (default: none)")
      ->type_name("DIR");
  cmd.add_flag("--no-save{false}", cfg.save_checkpoints,
               "write no checkpoint, not even at the end (for benchmarks)");
  cmd.add_option("--peak-tflops", cfg.peak_tflops,
                 fmt::format("the GPU's dense bf16 peak in TFLOP/s, for the MFU in the log "
                             "(default: {:g}, H100/H200 SXM)",
                             cfg.peak_tflops))
      ->type_name("TFLOPS")
      ->check(number_in(0.0, true, kInf, false));

  // ---- length of training ----
  cmd.add_option("--epochs", cfg.epochs,
                 fmt::format("passes over the training data (default: {})", cfg.epochs))
      ->type_name("N")
      ->check(int_at_least(1));
  cmd.add_option("--max-length", cfg.max_length,
                 fmt::format("tokens per sample (sequence length), at most the model's context "
                             "(default: {})",
                             cfg.max_length))
      ->type_name("TOKENS")
      ->check(int_at_least(1));
  cmd.add_option("--num-samples", cfg.num_samples,
                 fmt::format("training samples to use; -1 = all (default: {})", cfg.num_samples))
      ->type_name("N")
      ->check(parsed_by(minus_one_or_positive));
  cmd.add_option(
         "--seed", cfg.seed,
         fmt::format("random seed for initialisation and data order (default: {})", cfg.seed))
      ->type_name("N")
      ->check(unsigned_64());

  cmd.add_option("--dropout", cfg.dropout,
                 "dropout probability in [0, 1) for the embedding, the attention probabilities "
                 "and the residual branches (GPT-2's embd_pdrop, attn_pdrop, resid_pdrop: 0.1 in "
                 "Hugging Face's configs); overrides the model's own (default: the model's: 0 in "
                 "the presets, a config.json's values); image models: the classifier's dropout "
                 "(torchvision's dropout=), 0 also turning stochastic depth off")
      ->type_name("P")
      ->check(number_in(0.0, false, 1.0, true));

  // ---- optimizer and learning-rate schedule: --optimizer, --lr, ..., --min-lr-ratio ----
  add_knob_flags(cmd, cfg, optimizer_knobs(), kTrainFlag);
  add_knob_flags(cmd, cfg, scheduler_knobs(), kTrainFlag);

  // ---- data ----
  cmd.add_option("--dataset", cfg.dataset,
                 fmt::format("named data set: wikitext-2 (GPT-2), fashion-mnist (image models), "
                             "synthetic (image models: random 3-channel images of --image-size, "
                             "default 224, 1000 classes, for speed measurements) "
                             "(default: {})",
                             or_none(cfg.dataset)))
      ->type_name("NAME");
  cmd.add_option("--train-file", cfg.train_file,
                 "training text file (or a token file written by `shardtrain tokenize`); "
                 "instead of --dataset")
      ->type_name("PATH");
  cmd.add_option("--valid-file", cfg.valid_file,
                 "validation text or token file, with --train-file (default: none)")
      ->type_name("PATH");
  cmd.add_option("--data-dir", cfg.data_dir,
                 "directory holding the named data sets (default: the copy shipped with "
                 "shardtrain); image models: an ImageFolder root (one subfolder per class; 10% "
                 "held out), or with --dataset fashion-mnist the directory of its IDX files")
      ->type_name("DIR");
  cmd.add_option("--image-size", cfg.image_size,
                 "image models: resize every image to N × N pixels (bilinear; default: as stored)")
      ->type_name("N")
      ->check(int_at_least(1));
  cmd.add_option("--label-smoothing", cfg.label_smoothing,
                 "image models: label smoothing of the training loss in [0, 1) (default: 0)")
      ->type_name("EPS")
      ->check(number_in(0.0, false, 1.0, true));
  cmd.add_flag("--hierarchical-all-reduce", cfg.hierarchical_all_reduce,
               "dp, zero1, zero2 and zero3 across nodes: sum each gradient bucket within the "
               "node (reduce-scatter), across nodes 1/k of it per rank (k = ranks per node; dp: "
               "all-reduce then gather within the node, ZeRO: reduce-scatter) — each GPU sends "
               "1/k of the gradients over the network (default: on for jobs of several nodes "
               "with several ranks each, where it moves fewer bytes across nodes; off otherwise)");
  cmd.add_flag("--no-hierarchical-all-reduce", cfg.no_hierarchical_all_reduce,
               "one collective over all ranks for the gradients, whatever the nodes");
  cmd.add_flag("--sync-batchnorm", cfg.sync_batchnorm,
               "image models: batch norm's training statistics over all ranks (SyncBatchNorm; "
               "default: each rank's own micro-batch)");
  cmd.add_flag("--cuda-graphs,!--no-cuda-graphs", cfg.cuda_graphs,
               "image models on CUDA: capture each micro-batch's forward and backward once as a "
               "CUDA graph and replay it, one launch instead of one per op (default: on; with "
               "ddp on several ranks the gradients are all-reduced after the step's last "
               "replay instead of during backward; not used with ZeRO strategies, which gather "
               "or reduce during the passes, or with --sync-batchnorm)");
  cmd.add_option("--cache-dir", cfg.cache_dir,
                 "directory for token caches (default: $SHARDTRAIN_CACHE_DIR or "
                 "~/.cache/shardtrain)")
      ->type_name("DIR");
  cmd.add_option("--eval-samples", cfg.eval_samples,
                 fmt::format("validation samples per evaluation; -1 = the whole split "
                             "(default: {})",
                             cfg.eval_samples))
      ->type_name("N")
      ->check(parsed_by(minus_one_or_positive));

  // ---- output, logging, checkpoints ----
  cmd.add_option("--output-dir", cfg.output_dir,
                 fmt::format("directory for checkpoints and logs (default: {})", cfg.output_dir))
      ->type_name("DIR");
  cmd.add_option("--eval-interval", cfg.eval_interval,
                 fmt::format("optimizer steps between validations; 0 = at the end of each epoch "
                             "(default: {})",
                             cfg.eval_interval))
      ->type_name("STEPS")
      ->check(int_at_least(0));
  cmd.add_option("--save-interval", cfg.save_interval,
                 fmt::format("optimizer steps between checkpoints; 0 = only at the end "
                             "(default: {})",
                             cfg.save_interval))
      ->type_name("STEPS")
      ->check(int_at_least(0));
  cmd.add_option("--resume", cfg.resume,
                 "resume from a checkpoint directory, or from the latest checkpoint of an "
                 "output directory (default: none)")
      ->type_name("PATH");
  cmd.add_option("--init-from", cfg.init_from,
                 "initial weights: a shardtrain checkpoint, Hugging Face GPT-2 safetensors, or "
                 "for image models a torchvision state dict as safetensors "
                 "(tools/convert_torchvision.py) (default: none, random initialisation)")
      ->type_name("PATH");
  cmd.add_flag("--replace-head", cfg.replace_head,
               "image models with --init-from FILE.safetensors: when the file's classifier head "
               "has another class count than the data set (e.g. ImageNet's 1000), keep a freshly "
               "initialized head and load the rest (fine-tuning); without it such a file is an "
               "error");
  cmd.add_option("--deepspeed-config,--deepspeed_config", cfg.deepspeed_config,
                 "DeepSpeed JSON config (ds_config.json); flags given explicitly take "
                 "precedence over it (default: none)")
      ->type_name("PATH");
}

ExplicitFlags explicit_train_flags(const CLI::App& cmd) {
  ExplicitFlags flags;
  for (const CLI::Option* opt : cmd.get_options()) {
    if (opt->count() == 0 || opt->get_lnames().empty()) continue;
    std::string name = opt->get_lnames().front();
    std::replace(name.begin(), name.end(), '-', '_');
    flags.push_back(std::move(name));
  }
  return flags;
}

TrainConfig finalize_train_config(const CLI::App& cmd, TrainConfig cfg, int64_t model_context,
                                  std::vector<std::string>& warnings) {
  const ExplicitFlags flags = explicit_train_flags(cmd);
  if (contains(flags, "batch_size")) cfg.micro_batch_set = true;
  if (contains(flags, knob_for(&TrainConfig::gradient_accumulation_steps).explicit_name()))
    cfg.accumulation_set = true;
  if (contains(flags, "profile_step")) cfg.flops_profiler.enabled = true;

  // ---- strategy: --strategy and --zero-stage must agree ----
  try {
    cfg.strategy = parse_strategy(cfg.strategy_name);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("--strategy: {}", e.what()));
  }
  const bool strategy_flag = contains(flags, "strategy");
  const bool stage_flag = contains(flags, "zero_stage");
  if (strategy_flag) cfg.strategy_source = "--strategy";
  if (stage_flag) {
    const int stage = cfg.zero.stage;
    if (stage < 0 || stage > 3) {
      throw ConfigError(fmt::format("--zero-stage {} is not valid: use 0, 1, 2 or 3", stage));
    }
    // A pipeline runs ZeRO across its replicas (validate() refuses stage 3 with a reason).
    const bool compatible =
        zero_stage_of(cfg.strategy) == stage || cfg.strategy == StrategyKind::kPipeline;
    if (strategy_flag && !compatible) {
      throw ConfigError(fmt::format(
          "--strategy {} and --zero-stage {} contradict each other: strategy '{}' runs at ZeRO "
          "stage {}; give only one of them",
          cfg.strategy_name, stage, to_string(cfg.strategy), zero_stage_of(cfg.strategy)));
    }
    if (!strategy_flag) {
      cfg.strategy = strategy_for_zero(stage);
      cfg.strategy_name = to_string(cfg.strategy);
      cfg.strategy_source = "--zero-stage";
    }
  } else {
    cfg.zero.stage = zero_stage_of(cfg.strategy);
  }

  // ---- DeepSpeed JSON: defaults < JSON < explicit flags ----
  if (!cfg.deepspeed_config.empty()) {
    const StrategyKind before = cfg.strategy;
    const std::string before_name = cfg.strategy_name;
    std::vector<std::string> ignored;
    std::vector<std::string> overridden;
    apply_deepspeed_config(cfg.deepspeed_config, cfg, flags, ignored, overridden);
    if (!ignored.empty()) {
      warnings.push_back(fmt::format(
          "ignoring DeepSpeed config keys that shardtrain does not implement (in '{}'): {}",
          cfg.deepspeed_config, join(ignored, ", ")));
    }
    if (strategy_flag && cfg.strategy_source == "deepspeed" && cfg.strategy != before) {
      warnings.push_back(fmt::format(
          "--strategy {} contradicts {} {} in '{}': as in DeepSpeed, the config file decides, so "
          "the strategy is '{}' (drop --strategy, or change the stage in the file)",
          before_name, zero_knob(&ZeroConfig::stage).path, cfg.zero.stage, cfg.deepspeed_config,
          to_string(cfg.strategy)));
    }
    if (!overridden.empty()) {
      warnings.push_back(fmt::format("command-line flags take precedence over '{}': {}",
                                     cfg.deepspeed_config, join(overridden, ", ")));
    }
    // One config file serves a CPU smoke test and the GPU run: its bf16/fp16 section applies on
    // GPUs; the CPU path computes in fp32. (An explicit --precision bf16 on CPU stays an error.)
    const bool half = cfg.precision == Precision::kBf16 || cfg.precision == Precision::kFp16;
    if (half && cfg.device == "cpu" && !contains(flags, "precision")) {
      warnings.push_back(fmt::format(
          "'{}' enables {} ({}.enabled), which --device cpu cannot run: training in fp32 (the "
          "same file runs {} on GPUs)",
          cfg.deepspeed_config, to_string(cfg.precision), to_string(cfg.precision),
          to_string(cfg.precision)));
      cfg.precision = Precision::kFp32;
    }
  }

  if (cfg.strategy != StrategyKind::kPipeline) {
    std::vector<std::string> given;
    for (const std::string& f : pipeline_flags()) {
      // --trace also draws an offloaded run's timeline.
      if (f == "trace" && offload_asked(cfg)) continue;
      if (contains(flags, f)) given.push_back("--" + f);
    }
    for (std::string& f : given) std::replace(f.begin(), f.end(), '_', '-');
    if (!given.empty()) {
      const bool trace = std::find(given.begin(), given.end(), "--trace") != given.end();
      throw ConfigError(fmt::format(
          "{} {} for pipeline parallelism, but the strategy is '{}': add --strategy pipeline (or "
          "drop {}){}",
          join(given, ", "), given.size() == 1 ? "is a flag" : "are flags", to_string(cfg.strategy),
          given.size() == 1 ? "it" : "them",
          trace ? fmt::format("; --trace also draws the timeline of an offloaded run (--strategy "
                              "offload or infinity, {}, --offload auto)",
                              zero_knob(&ZeroConfig::offload_optimizer_device).path)
                : std::string()));
    }
  }

  validate(cfg, model_context);
  return cfg;
}

}  // namespace shardtrain
