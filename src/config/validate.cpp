// Validation of a TrainConfig: strategy and ZeRO stage, pipeline settings, offload, batch sizes
// (DeepSpeed's _configure_train_batch_size), with an error naming the setting and the fix.
#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>

#include "config/config.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/strings.h"
#include "model/image/image_zoo.h"

namespace shardtrain {

namespace {

// ---- validation helpers ---------------------------------------------------------------------

/// "--pipeline-stages 4, --trace 'dir'": the pipeline settings of `c` that differ from the
/// defaults.
std::vector<std::string> pipeline_settings_given(const TrainConfig& c) {
  const TrainConfig defaults;
  std::vector<std::string> out;
  for (const Knob& k : pipeline_knobs())
    if ((k.surfaces & kTrainFlag) && k.get(c) != k.get(defaults))
      out.push_back(fmt::format("{} {}", k.name(), k.print(c)));
  if (!c.trace_dir.empty() && !offload_asked(c))
    out.push_back(fmt::format("--trace '{}'", c.trace_dir));
  return out;
}

/// The pipeline settings that do not need the batch sizes or the model (validate() checks the
/// micro-batches after deriving them, check_pipeline_model() the layers).
void check_pipeline_settings(const TrainConfig& c, const std::string& file) {
  if (c.strategy != StrategyKind::kPipeline) {
    const std::vector<std::string> given = pipeline_settings_given(c);
    if (!given.empty()) {
      throw ConfigError(fmt::format(
          "{} {} pipeline parallelism, but the strategy is '{}': add --strategy pipeline (or "
          "drop {})",
          join(given, ", "), given.size() == 1 ? "is a setting of" : "are settings of",
          to_string(c.strategy), given.size() == 1 ? "it" : "them"));
    }
    return;
  }
  const PipelineConfig& p = c.pipeline;
  if (p.stages < 1) {
    throw ConfigError(fmt::format(
        "--pipeline-stages {} is not valid: use 1 or more ranks per pipeline (pipeline.stages)",
        p.stages));
  }
  if (p.virtual_stages < 1) {
    throw ConfigError(fmt::format(
        "--virtual-stages {} is not valid: use 1 or more model chunks per rank "
        "(pipeline.virtual_stages; more than 1 only with --pipeline-schedule interleaved-1f1b)",
        p.virtual_stages));
  }
  if (p.activation_checkpoint_interval < 0) {
    throw ConfigError(fmt::format(
        "--activation-checkpoint-interval {} is not valid: use 0 (off) or k >= 1 (a checkpoint "
        "every k transformer blocks) (pipeline.activation_checkpoint_interval)",
        p.activation_checkpoint_interval));
  }
  check_partition_method(p.partition_method);
  if (c.world_size >= 1 && c.world_size % p.stages != 0) {
    throw ConfigError(fmt::format(
        "world size {} is not divisible by --pipeline-stages {}: launch a multiple of {} ranks "
        "(stages × data-parallel replicas) or change the stages",
        c.world_size, p.stages, p.stages));
  }
  if (c.zero.stage == 3) {
    throw ConfigError(fmt::format(
        "ZeRO stage 3 (--zero-stage / zero_optimization.stage in {}) does not run with --strategy "
        "pipeline: each stage owns its blocks' parameters, which stage 3 would partition across "
        "the replicas; use ZeRO stage 0, 1 or 2 with the pipeline, or --strategy zero3 without it",
        file));
  }
  for (const auto& [key, device] : {std::pair<const char*, const std::string&>{
                                        "offload_optimizer", c.zero.offload_optimizer_device},
                                    {"offload_param", c.zero.offload_param_device}}) {
    if (device != "none") {
      throw ConfigError(fmt::format(
          "zero_optimization.{}.device \"{}\" in {} does not run with --strategy pipeline (the "
          "pipeline keeps its state on the GPUs): set the device to \"none\", or use --strategy "
          "offload / infinity without a pipeline",
          key, device, file));
    }
  }
  if (p.schedule == PipelineSchedule::k2BW) {
    if (c.precision == Precision::kFp16) {
      throw ConfigError(
          "--pipeline-schedule 2bw does not run with fp16 precision: dynamic loss scaling skips "
          "the steps whose gradients overflow, and 2bw's two weight versions then no longer "
          "follow its update rule (arXiv 2006.09503); use --precision bf16 or fp32, or another "
          "schedule (1f1b)");
    }
    if (c.zero.offload_delayed_update) {
      throw ConfigError(
          "--pipeline-schedule 2bw and --offload-delayed-update both delay the weight update "
          "(2bw computes with the weights of the previous version, arXiv 2006.09503): drop "
          "--offload-delayed-update");
    }
  }
  if (c.zero.offload_delayed_update || c.zero.offload_ratio != 1.0) {
    throw ConfigError(
        "--offload-delayed-update / --offload-ratio (offload_optimizer.delayed_update / ratio) "
        "need the optimizer offloaded, which --strategy pipeline does not do: drop them");
  }
}

/// After the batch sizes are derived: the schedule runs P stages, M micro-batches (the
/// gradient-accumulation steps) and V virtual stages.
void check_pipeline_micro_batches(const TrainConfig& c) {
  if (c.strategy != StrategyKind::kPipeline) return;
  const PipelineConfig& p = c.pipeline;
  const int64_t m = c.gradient_accumulation_steps;
  if (m > std::numeric_limits<int>::max()) {
    throw ConfigError(
        fmt::format("gradient_accumulation_steps {} is too large for a pipeline step (at most {} "
                    "micro-batches): use fewer accumulation steps",
                    m, std::numeric_limits<int>::max()));
  }
  check_pipeline_shape(p.schedule, PipelineShape{p.stages, static_cast<int>(m), p.virtual_stages});
  if (p.schedule == PipelineSchedule::k2BW && m < p.stages) {
    throw ConfigError(fmt::format(
        "--pipeline-schedule 2bw needs at least as many micro-batches per step "
        "(--gradient-accumulation-steps, now {}) as pipeline stages ({}): PipeDream-2BW keeps "
        "only two weight versions when micro-batches >= stages (arXiv 2006.09503); use "
        "--gradient-accumulation-steps {} or more, or fewer stages",
        m, p.stages, p.stages));
  }
}

/// "'ds.json'", or "the DeepSpeed config" without one: where messages say a key was given.
std::string config_file_name(const TrainConfig& c) {
  return c.deepspeed_config.empty() ? std::string("the DeepSpeed config")
                                    : fmt::format("'{}'", c.deepspeed_config);
}

void check_strategy(const TrainConfig& c) {
  const std::string file = config_file_name(c);
  check<ConfigError>(
      c.zero.hpz_partition_size <= 1 || c.strategy == StrategyKind::kZero3,
      "zero_hpz_partition_size {} (--zero-hpz-partition-size) shards ZeRO-3 within groups of "
      "ranks: it needs --strategy zero3 (or zero_optimization.stage 3), not {}",
      c.zero.hpz_partition_size, to_string(c.strategy));
  check<ConfigError>(c.zero.hpz_partition_size <= 1 || (c.zero.offload_optimizer_device.empty() ||
                                                        c.zero.offload_optimizer_device == "none"),
                     "zero_hpz_partition_size {} does not run with offload_optimizer: drop one",
                     c.zero.hpz_partition_size);
  check<ConfigError>(
      !c.zero.quantized_gradients || hierarchical_reduction(c) || c.zero.hpz_partition_size > 1,
      "zero_quantized_gradients (--quantized-gradients) quantizes the gradients that cross "
      "nodes: of --hierarchical-all-reduce (dp, zero1, zero2, zero3) or of zero3's hybrid "
      "sharding "
      "(--zero-hpz-partition-size); add one of them");
  check<ConfigError>(!c.hierarchical_all_reduce || !c.no_hierarchical_all_reduce,
                     "--hierarchical-all-reduce and --no-hierarchical-all-reduce contradict: give "
                     "one");
  check<ConfigError>(!c.hierarchical_all_reduce || c.strategy == StrategyKind::kDataParallel ||
                         c.strategy == StrategyKind::kZero1 || c.strategy == StrategyKind::kZero2 ||
                         c.strategy == StrategyKind::kZero3,
                     "--hierarchical-all-reduce applies to the gradient reductions of --strategy "
                     "dp (ddp for image models), zero1, zero2 and zero3, not to {}: drop it or "
                     "switch strategies",
                     to_string(c.strategy));
  check<ConfigError>(!c.hierarchical_all_reduce || c.zero.hpz_partition_size <= 1,
                     "--hierarchical-all-reduce and zero_hpz_partition_size {} both arrange "
                     "zero3's reductions around nodes: hybrid sharding already reduce-scatters "
                     "within the group and all-reduces across groups; drop one",
                     c.zero.hpz_partition_size);
  if (c.zero.stage < 0 || c.zero.stage > 3) {
    throw ConfigError(fmt::format(
        "ZeRO stage {} (--zero-stage / zero_optimization.stage) does not exist: use stage 0 "
        "(--strategy dp), 1 (zero1), 2 (zero2) or 3 (zero3)",
        c.zero.stage));
  }
  const bool offload_stage1 = c.strategy == StrategyKind::kOffload && c.zero.stage == 1;
  // A pipeline runs ZeRO stage 0, 1 or 2 across its replicas (check_pipeline_settings).
  const bool pipeline = c.strategy == StrategyKind::kPipeline;
  if (c.zero.stage != zero_stage_of(c.strategy) && !offload_stage1 && !pipeline) {
    throw ConfigError(fmt::format(
        "ZeRO stage {} (--zero-stage / zero_optimization.stage) contradicts strategy '{}', which "
        "runs at ZeRO stage {}: set the stage to {} or pick strategy '{}'",
        c.zero.stage, to_string(c.strategy), zero_stage_of(c.strategy), zero_stage_of(c.strategy),
        to_string(strategy_for_zero(c.zero.stage))));
  }
  if (c.zero.offload_param_device != "none" && c.zero.stage != 3) {
    throw ConfigError(fmt::format(
        "zero_optimization.offload_param.device \"{}\" in {} needs ZeRO stage 3 (parameters are "
        "partitioned only there), but the stage is {}: set \"stage\": 3, or remove "
        "offload_param and offload only the optimizer (offload_optimizer)",
        c.zero.offload_param_device, file, c.zero.stage));
  }
  const ParallelPlan& plan = c.plan;
  if (plan.optimizer_offload == OffloadDevice::kNone &&
      (c.zero.offload_delayed_update || c.zero.offload_ratio != 1.0)) {
    throw ConfigError(
        "--offload-delayed-update / --offload-ratio (offload_optimizer.delayed_update / ratio) "
        "need the optimizer offloaded: use --strategy offload (or infinity), or set "
        "zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\"");
  }
  if (c.zero.offload_moments_dtype != "fp32") {
    check<ConfigError>(plan.optimizer_offload != OffloadDevice::kNone || c.placement.automatic,
                       "--offload-moments-dtype {} (offload_optimizer.moments_dtype) is the dtype "
                       "of the host's AdamW moments: offload the optimizer (--strategy offload, "
                       "infinity or --offload auto), or drop it",
                       c.zero.offload_moments_dtype);
    check<ConfigError>(c.optimizer == OptimizerKind::kAdamW,
                       "--offload-moments-dtype {} needs AdamW (SGD's momentum buffer stays "
                       "fp32): drop it, or use --optimizer adamw",
                       c.zero.offload_moments_dtype);
  }
  if (c.zero.offload_forward_group > 1) {
    check<ConfigError>(c.activation_checkpointing,
                       "--offload-forward-group {} (offload_optimizer.forward_group) keeps the "
                       "layer inputs of that many micro-batches, which needs activation "
                       "checkpointing: add --activation-checkpointing, or set it to 1",
                       c.zero.offload_forward_group);
    check<ConfigError>(plan.zero_stage < 3,
                       "--offload-forward-group {} (offload_optimizer.forward_group) is not "
                       "available with ZeRO stage 3, which gathers each layer per micro-batch: "
                       "set it to 1, or use ZeRO stage 1 or 2 (--strategy offload)",
                       c.zero.offload_forward_group);
  }
  if (c.zero.offload_delayed_update && plan.param_offload != OffloadDevice::kNone) {
    throw ConfigError(
        "the delayed parameter update (--offload-delayed-update) is not available with "
        "offload_param: the parameters offloaded to the host are read by every step; drop one "
        "of the two");
  }
  const bool nvme =
      plan.optimizer_offload == OffloadDevice::kNvme || plan.param_offload == OffloadDevice::kNvme;
  if (nvme && c.zero.nvme_path.empty()) {
    throw ConfigError(
        "offloading to NVMe needs a directory for the swap files: give --nvme-path DIR (or "
        "\"nvme_path\" in zero_optimization.offload_optimizer / offload_param)");
  }
}

constexpr const char* kBatchFlags =
    "(flags: --train-batch-size, --batch-size, --gradient-accumulation-steps)";

int64_t checked_product(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    throw ConfigError(fmt::format("{} overflows ({} × {}): use smaller batch sizes", what, a, b));
  }
  return out;
}

void check_batch(TrainConfig& c) {
  if (c.world_size < 1) {
    throw ConfigError(fmt::format(
        "world size {} is not valid: it must be >= 1 (it is set by the launcher)", c.world_size));
  }
  // The batch identity counts data-parallel replicas: a pipeline's stages share one micro-batch.
  const int64_t ws = data_parallel_size(c);
  const std::string ws_name =
      c.strategy == StrategyKind::kPipeline
          ? fmt::format("data-parallel degree {} (world size {} / {} pipeline stages)", ws,
                        c.world_size, c.pipeline.stages)
          : fmt::format("world size {}", ws);
  // The sizes' ranges are their rows' (config/knobs_sections.cpp).
  const int64_t tb = c.train_batch_size;
  const int64_t micro = c.micro_batch_size;
  const int64_t gas = c.gradient_accumulation_steps;
  if (tb == 0) {
    c.train_batch_size =
        checked_product(checked_product(micro, gas, "the global batch"), ws, "the global batch");
    return;
  }
  if (c.micro_batch_set && c.accumulation_set) {
    const int64_t product =
        checked_product(checked_product(micro, gas, "the global batch"), ws, "the global batch");
    if (product == tb) return;
    std::string fix = fmt::format("set train_batch_size to {}", product);
    if (tb % (micro * ws) == 0) {
      fix += fmt::format(", or gradient_accumulation_steps to {}", tb / (micro * ws));
    } else if (tb % (gas * ws) == 0) {
      fix += fmt::format(", or train_micro_batch_size_per_gpu to {}", tb / (gas * ws));
    }
    throw ConfigError(fmt::format(
        "batch sizes do not add up: train_batch_size {} != train_micro_batch_size_per_gpu {} × "
        "gradient_accumulation_steps {} × {} = {}: {} {}",
        tb, micro, gas, ws_name, product, fix, kBatchFlags));
  }
  if (c.micro_batch_set) {
    const int64_t denom = micro * ws;
    if (tb % denom != 0) {
      throw ConfigError(fmt::format(
          "train_batch_size {} is not a multiple of train_micro_batch_size_per_gpu {} × {} = {}, "
          "so gradient_accumulation_steps cannot be derived: set train_batch_size to a multiple "
          "of {} (e.g. {}) {}",
          tb, micro, ws_name, denom, denom, std::max<int64_t>(1, tb / denom) * denom, kBatchFlags));
    }
    c.gradient_accumulation_steps = tb / denom;
    return;
  }
  if (c.accumulation_set) {
    const int64_t denom = gas * ws;
    if (tb % denom != 0) {
      throw ConfigError(fmt::format(
          "train_batch_size {} is not a multiple of gradient_accumulation_steps {} × {} = {}, so "
          "train_micro_batch_size_per_gpu cannot be derived: set train_batch_size to a multiple "
          "of {} (e.g. {}) {}",
          tb, gas, ws_name, denom, denom, std::max<int64_t>(1, tb / denom) * denom, kBatchFlags));
    }
    c.micro_batch_size = tb / denom;
    return;
  }
  // Only train_batch_size: DeepSpeed uses no accumulation and splits it over the ranks.
  if (tb % ws != 0) {
    throw ConfigError(fmt::format(
        "train_batch_size {} is not a multiple of the {}, so train_micro_batch_size_per_gpu "
        "cannot be derived: set train_batch_size to a multiple of {}, or give "
        "train_micro_batch_size_per_gpu {}",
        tb, ws_name, ws, kBatchFlags));
  }
  c.gradient_accumulation_steps = 1;
  c.micro_batch_size = tb / ws;
}

}  // namespace

// ---- validation -------------------------------------------------------------------------------

bool hierarchical_reduction(const TrainConfig& cfg) {
  if (cfg.no_hierarchical_all_reduce) return false;
  if (cfg.hierarchical_all_reduce) return true;
  const bool eligible = cfg.strategy == StrategyKind::kDataParallel ||
                        cfg.strategy == StrategyKind::kZero1 ||
                        cfg.strategy == StrategyKind::kZero2 ||
                        (cfg.strategy == StrategyKind::kZero3 && cfg.zero.hpz_partition_size <= 1);
  return eligible && cfg.ranks_per_node > 1 && cfg.world_size > cfg.ranks_per_node;
}

int64_t forward_group(const TrainConfig& cfg) {
  if (cfg.zero.offload_forward_group > 0) return cfg.zero.offload_forward_group;
  const bool overlaps = cfg.plan.optimizer_offload != OffloadDevice::kNone &&
                        cfg.plan.zero_stage < 3 && cfg.strategy != StrategyKind::kPipeline &&
                        cfg.activation_checkpointing;
  return overlaps ? std::max<int64_t>(1, cfg.gradient_accumulation_steps) : 1;
}

bool offload_asked(const TrainConfig& c) {
  return c.placement.automatic || c.strategy == StrategyKind::kOffload ||
         c.strategy == StrategyKind::kInfinity || c.zero.offload_optimizer_device != "none";
}

bool speculative_update(const TrainConfig& cfg) {
  return cfg.zero.offload_speculative_update &&
         cfg.plan.optimizer_offload != OffloadDevice::kNone && cfg.plan.zero_stage < 3 &&
         cfg.strategy != StrategyKind::kPipeline && !cfg.zero.offload_delayed_update &&
         cfg.precision != Precision::kFp16;
}

int data_parallel_size(const TrainConfig& cfg) {
  if (cfg.strategy != StrategyKind::kPipeline || cfg.pipeline.stages < 1) return cfg.world_size;
  return cfg.world_size / cfg.pipeline.stages;
}

const std::vector<std::string>& pipeline_partition_methods() {
  static const std::vector<std::string> kMethods = {"uniform", "parameters", "time"};
  return kMethods;
}

void check_partition_method(const std::string& method) {
  const auto& methods = pipeline_partition_methods();
  if (std::find(methods.begin(), methods.end(), method) != methods.end()) return;
  throw ConfigError(fmt::format(
      "unknown partition method '{}'{}: use uniform (equal block counts), parameters (balance "
      "parameter counts, the default) or time (balance measured per-layer time)",
      method, did_you_mean(method, methods)));
}

void check_pipeline_model(const TrainConfig& cfg, int n_layer) {
  if (cfg.strategy != StrategyKind::kPipeline) return;
  ST_ASSERT(n_layer >= 1);
  const PipelineConfig& p = cfg.pipeline;
  const int parts = p.stages * p.virtual_stages;
  const bool interleaved = p.schedule == PipelineSchedule::kInterleaved;
  const std::string cut =
      interleaved ? fmt::format("--pipeline-stages {} × --virtual-stages {} = {} model chunks",
                                p.stages, p.virtual_stages, parts)
                  : fmt::format("--pipeline-stages {}", p.stages);
  if (parts > n_layer) {
    throw ConfigError(fmt::format(
        "more stages than layers: {} for model '{}' with {} transformer blocks (n_layer), and each "
        "needs at least one block: use at most {} {}",
        cut, cfg.model.empty() ? "of the checkpoint" : cfg.model, n_layer, n_layer,
        interleaved ? "chunks (stages × virtual stages)" : "stages"));
  }
}

namespace {

/// What only a GPT-2 model runs — the pipeline (its transformer blocks cut into stages) and
/// --offload auto (a plan from its shape) — refused for the other model families here, in one
/// place; the trainer skeleton (train/training_run.h) runs both for every family let through.
void check_model_family(const TrainConfig& c) {
  if (!is_image_model(c.model)) return;
  check<ConfigError>(c.strategy != StrategyKind::kPipeline,
                     "--strategy pipeline trains GPT-2 models only; image model '{}' trains with "
                     "dp, zero1, zero2, zero3 or offload",
                     c.model);
  check<ConfigError>(!c.placement.automatic,
                     "--offload auto plans GPT-2 models only: drop it for {}", c.model);
}

/// --offload auto chooses the ZeRO stage and the offload itself: settings that fix them are
/// refused, naming the one to drop.
void check_automatic_placement(const TrainConfig& c) {
  const PlacementConfig& p = c.placement;
  if (!p.automatic) {
    check<ConfigError>(p.gpu_memory_gib == 0 && p.max_host_memory_gib == 0,
                       "--gpu-memory and --max-host-memory are budgets for --offload auto: add "
                       "--offload auto, or drop them");
    return;
  }
  const bool placed =
      c.strategy == StrategyKind::kOffload || c.strategy == StrategyKind::kInfinity ||
      c.zero.offload_optimizer_device != "none" || c.zero.offload_param_device != "none";
  check<ConfigError>(!placed,
                     "--offload auto chooses where the optimizer state and the parameters live, "
                     "but the run already places them (--strategy {}, offload_optimizer \"{}\", "
                     "offload_param \"{}\"): drop --offload auto, or the other setting",
                     to_string(c.strategy), c.zero.offload_optimizer_device,
                     c.zero.offload_param_device);
  check<ConfigError>(c.strategy != StrategyKind::kPipeline,
                     "--offload auto does not plan pipelines (each stage keeps its state on its "
                     "GPU): drop --offload auto, or use dp / zero1-3");
  check<ConfigError>(c.device != "cpu" || p.gpu_memory_gib > 0,
                     "--offload auto on CPU ranks needs --gpu-memory GIB (the budget it plans "
                     "for; a GPU run reads its GPU's memory)");
  check<ConfigError>(!c.zero.offload_delayed_update && c.zero.offload_ratio == 1.0,
                     "--offload auto chooses the offload ratio: drop --offload-ratio and "
                     "--offload-delayed-update");
}

}  // namespace

void check_cpu_precision(Precision precision) {
  check<ConfigError>(precision == Precision::kAuto || precision == Precision::kFp32,
                     "--precision {} needs --device cuda; the CPU path computes in fp32 (use "
                     "--precision fp32 or leave it unset)",
                     to_string(precision));
}

void validate(TrainConfig& cfg, int64_t model_context) {
  check_model_family(cfg);         // first: the pipeline and --offload auto need a GPT-2 model
  check_automatic_placement(cfg);  // next: it names the setting that conflicts with it
  // The plan is derived here, once; everything after validation reads cfg.plan.
  cfg.plan = plan_of(cfg);
  // The pipeline's rules before the rows' ranges: a pipeline flag given without the pipeline
  // is named as such.
  check_pipeline_settings(cfg, config_file_name(cfg));
  for (const KnobTable* table : all_knob_tables()) check_knob_ranges(cfg, *table);
  check_strategy(cfg);

  if (cfg.device == "cpu") check_cpu_precision(cfg.precision);
  if (cfg.monitor.tensorboard_all_ranks && cfg.monitor.tensorboard_dir.empty()) {
    throw ConfigError(
        "--tensorboard-all-ranks needs --tensorboard DIR (or an enabled \"tensorboard\" section "
        "in the DeepSpeed config): it says which ranks write there");
  }
  if (cfg.model.empty() && cfg.resume.empty()) {
    throw ConfigError(
        "--model is empty: name a model preset (e.g. --model gpt2-tiny) or the path of a "
        "config.json");
  }
  const bool image_model = is_image_model(cfg.model);
  const std::string dataset = knob_for(&TrainConfig::dataset).name();
  const std::string data_dir = knob_for(&TrainConfig::data_dir).name();
  const std::string train_file = knob_for(&TrainConfig::train_file).name();
  const std::string valid_file = knob_for(&TrainConfig::valid_file).name();
  if (image_model) {
    if (!cfg.dataset.empty() && cfg.dataset != "fashion-mnist" && cfg.dataset != "synthetic") {
      throw ConfigError(fmt::format(
          "{0} '{1}' is not an image data set: image model '{2}' trains on {0} fashion-mnist, {0} "
          "synthetic (random images, for speed measurements) or an ImageFolder directory ({3} "
          "DIR)",
          dataset, cfg.dataset, cfg.model, data_dir));
    }
    if (!cfg.train_file.empty() || !cfg.valid_file.empty()) {
      throw ConfigError(fmt::format(
          "{} / {} are text for GPT-2; image model '{}' trains on {} fashion-mnist or an "
          "ImageFolder directory ({} DIR)",
          train_file, valid_file, cfg.model, dataset, data_dir));
    }
    if (cfg.dataset.empty() && cfg.data_dir.empty()) {
      throw ConfigError(
          fmt::format("no training data for image model '{}': give {} fashion-mnist, or {} DIR (an "
                      "ImageFolder root: one subfolder of images per class)",
                      cfg.model, dataset, data_dir));
    }
  } else {
    if (cfg.dataset == "fashion-mnist" || cfg.dataset == "synthetic") {
      throw ConfigError(
          fmt::format("{} {} holds images, but model '{}' is a language model: train an "
                      "image model on it ({})",
                      dataset, cfg.dataset, cfg.model.empty() ? "of the checkpoint" : cfg.model,
                      join(image_model_names(), ", ")));
    }
    if (cfg.image_size != 0 || cfg.label_smoothing != 0 || cfg.sync_batchnorm) {
      throw ConfigError(fmt::format(
          "{}, {} and {} are for image models ({}); model '{}' is a language model",
          knob_for(&TrainConfig::image_size).name(), knob_for(&TrainConfig::label_smoothing).name(),
          knob_for(&TrainConfig::sync_batchnorm).name(), join(image_model_names(), ", "),
          cfg.model.empty() ? "of the checkpoint" : cfg.model));
    }
  }
  if (model_context > 0 && cfg.max_length > model_context) {
    throw ConfigError(
        fmt::format("--max-length {} exceeds the context of model '{}' (n_positions = {}): use "
                    "--max-length {} or less",
                    cfg.max_length, cfg.model.empty() ? "of the checkpoint" : cfg.model,
                    model_context, model_context));
  }

  check_batch(cfg);
  check_pipeline_micro_batches(cfg);
  if (cfg.strategy == StrategyKind::kPipeline && cfg.activation_checkpointing &&
      cfg.pipeline.activation_checkpoint_interval == 0) {
    cfg.pipeline.activation_checkpoint_interval = 1;  // every block, as the other strategies
  }

  if (cfg.optimizer == OptimizerKind::kAdamW && (cfg.momentum != 0.0 || cfg.nesterov)) {
    throw ConfigError(
        "--momentum and --nesterov are SGD's: add --optimizer sgd (or \"optimizer\": {\"type\": "
        "\"SGD\"}), or remove them (AdamW's momentum is --adam-beta1)");
  }
  if (cfg.nesterov && cfg.momentum == 0.0) {
    throw ConfigError(
        "--nesterov needs a momentum > 0 (as torch.optim.SGD): add --momentum 0.9, or remove "
        "--nesterov");
  }
  if (cfg.optimizer == OptimizerKind::kSGD && cfg.plan.optimizer_offload == OffloadDevice::kNvme) {
    throw ConfigError(
        "--optimizer sgd with the optimizer offloaded to NVMe (infinity, offload_optimizer.device "
        "\"nvme\") is not available: the NVMe swap file pages AdamW's master, m and v together; "
        "use --strategy offload (CPU) or zero3 with SGD, or --optimizer adamw with NVMe");
  }

  if (!cfg.dataset.empty() && !cfg.train_file.empty()) {
    throw ConfigError(fmt::format(
        "{} '{}' and {} '{}' are both given: use one of them (a named data set, or your own text "
        "files)",
        dataset, cfg.dataset, train_file, cfg.train_file));
  }
  if (cfg.dataset.empty() && cfg.train_file.empty() && !image_model) {
    throw ConfigError(
        fmt::format("no training data: give {} wikitext-2, or {} PATH (and optionally {} PATH)",
                    dataset, train_file, valid_file));
  }
  if (!cfg.valid_file.empty() && cfg.train_file.empty()) {
    throw ConfigError(fmt::format(
        "{0} '{1}' needs {2}: the named data set '{3}' has its own validation split; drop {0}, "
        "or use {2} instead of {4}",
        valid_file, cfg.valid_file, train_file, cfg.dataset, dataset));
  }

  if (cfg.output_dir.empty()) {
    throw ConfigError("--output-dir is empty: give a directory for checkpoints and logs");
  }
  if (cfg.replace_head && (cfg.init_from.empty() || !image_model)) {
    throw ConfigError(
        "--replace-head keeps a fresh classifier head when an image model's --init-from weights "
        "have another class count: give it with --init-from FILE.safetensors and an image model");
  }
  if (!cfg.resume.empty() && !cfg.init_from.empty()) {
    throw ConfigError(fmt::format(
        "--resume '{}' and --init-from '{}' are both given: --resume restores weights, optimizer "
        "and step from a checkpoint, --init-from only loads initial weights; use one",
        cfg.resume, cfg.init_from));
  }
}

std::vector<std::string> model_config_warnings(const TrainConfig& cfg,
                                               int64_t largest_layer_numel) {
  std::vector<std::string> out;
  const int64_t threshold = cfg.zero.stage3_param_persistence_threshold;
  // A layer with fewer parameters than the threshold stays replicated (parallel/zero3.cpp).
  if (cfg.plan.zero_stage == 3 && largest_layer_numel > 0 && threshold > largest_layer_numel) {
    out.push_back(fmt::format(
        "zero_optimization.stage3_param_persistence_threshold {} is above the largest layer of "
        "model '{}' ({} parameters): every layer stays replicated: zero3 then saves no parameter "
        "memory; set it to at most {} (DeepSpeed's default is 100000)",
        threshold, cfg.model.empty() ? "of the checkpoint" : cfg.model, largest_layer_numel,
        largest_layer_numel));
  }
  return out;
}

}  // namespace shardtrain
