// Run configuration: strategy names, the DeepSpeed JSON config and validation.
//
// The DeepSpeed schema follows https://www.deepspeed.ai/docs/config-json/ and DeepSpeed's own
// parser (deepspeed/runtime/config.py, zero/config.py, precision_config.py, lr_schedules.py).
#include "config/config.h"

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

#include "core/error.h"
#include "core/strings.h"
#include "model/image/image_zoo.h"

namespace shardtrain {

namespace {

using nlohmann::json;

constexpr const char* kDocsUrl = "https://www.deepspeed.ai/docs/config-json/";

std::string lowercase(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

struct StrategyName {
  const char* name;
  StrategyKind kind;
};

constexpr StrategyName kStrategyNames[] = {
    {"dp", StrategyKind::kDataParallel},   {"ddp", StrategyKind::kDataParallel},
    {"zero1", StrategyKind::kZero1},       {"zero2", StrategyKind::kZero2},
    {"fsdp_stage2", StrategyKind::kZero2}, {"zero3", StrategyKind::kZero3},
    {"fsdp_stage3", StrategyKind::kZero3}, {"offload", StrategyKind::kOffload},
    {"infinity", StrategyKind::kInfinity}, {"pipeline", StrategyKind::kPipeline},
};

constexpr const char* kValidStrategies =
    "dp (alias ddp), zero1, zero2 (alias fsdp_stage2), zero3 (alias fsdp_stage3), offload, "
    "infinity, pipeline";

bool is_offload_device(const std::string& d) { return d == "none" || d == "cpu" || d == "nvme"; }

// ---- the DeepSpeed schema -------------------------------------------------------------------

using KeyList = std::vector<std::string>;

// Top-level keys shardtrain reads.
const KeyList kTopHonoured = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "zero_optimization",
    "activation_checkpointing",
    "aio",
    "pipeline",
    "tensorboard",
    "csv_monitor",
    "flops_profiler",
};

// Top-level DeepSpeed keys shardtrain accepts and ignores.
const KeyList kTopIgnored = {
    "memory_breakdown",
    "dump_state",
    "prescale_gradients",
    "gradient_predivide_factor",
    "gradient_allreduce_op",
    "sparse_gradients",
    "amp",
    "torch_autocast",
    "communication_data_type",
    "seq_parallel_comm_data_type",
    "disable_allgather",
    "wandb",
    "comet",
    "comms_logger",
    "autotuning",
    "elasticity",
    "data_efficiency",
    "curriculum_learning",
    "sparse_attention",
    "compression_training",
    "quantize_training",
    "eigenvalue",
    "progressive_layer_drop",
    "checkpoint",
    "data_types",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "graph_harvesting",
    "dataloader_drop_last",
    "vocabulary_size",
    "hybrid_engine",
    "use_data_before_expert_parallelism",
    "nebula",
    "compile",
    "timers",
    "tensor_parallel",
    "expert_parallel",
    "sequence_parallel_size",
    "weight_quantization",
    "log_level",
    "managed_gradient_accumulation",
    "allgather_size",
};

const KeyList kZeroHonoured = {
    "stage",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "cpu_offload_param",
    "stage3_prefetch_bucket_size",
    "prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "param_persistence_threshold",
    "stage3_max_live_parameters",
    "max_live_parameters",
    "stage3_max_reuse_distance",
    "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "zero_hpz_partition_size",
    "zero_quantized_gradients",
};

// zero_optimization booleans that are on by default and cannot be turned off here: ZeRO keeps
// its gradients in contiguous flat buffers and reduce-scatters them. Listed as ignored (warned
// about) only when a config sets them to false.
const KeyList kZeroOnByDefaultIgnored = {"contiguous_gradients", "reduce_scatter"};

/// A stage-3 size of zero_optimization: DeepSpeed's stage3_* key, its unprefixed alias (DeepSpeed's
/// config model accepts both), the field it sets, the smallest valid value and what it means.
struct Stage3Size {
  const char* key;
  const char* alias;
  int64_t ZeroConfig::*field;
  int64_t min;
  const char* expected;
};

const Stage3Size kStage3Sizes[] = {
    {"stage3_prefetch_bucket_size", "prefetch_bucket_size",
     &ZeroConfig::stage3_prefetch_bucket_size, 0,
     "an integer >= 0 (parameter elements gathered ahead of use; 0 = no prefetch), e.g. 5e7"},
    {"stage3_param_persistence_threshold", "param_persistence_threshold",
     &ZeroConfig::stage3_param_persistence_threshold, 0,
     "an integer >= 0 (layers with fewer parameters stay replicated; 0 = partition every layer), "
     "e.g. 1e5"},
    {"stage3_max_live_parameters", "max_live_parameters", &ZeroConfig::stage3_max_live_parameters,
     1, "an integer >= 1 (most gathered parameter elements alive at once on a rank), e.g. 1e9"},
    {"stage3_max_reuse_distance", "max_reuse_distance", &ZeroConfig::stage3_max_reuse_distance, 0,
     "an integer >= 0 (a gathered layer needed again within this many parameter elements is "
     "kept; 0 = never kept), e.g. 1e9"},
};

const KeyList kZeroIgnored = {
    "cpu_offload_use_pin_memory",
    "sub_group_size",
    "round_robin_gradients",
    "elastic_checkpoint",
    "ignore_unused_parameters",
    "load_from_fp32_weights",
    "legacy_stage1",
    "allgather_partitions",
    "use_multi_rank_bucket_allreduce",
    "zenflow",
    "leaf_module",
    "zeropp_loco_param",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "stage3_model_persistence_threshold",
    "model_persistence_threshold",
    "stage3_module_granularity_threshold",
    "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "allgather_sequential",
    "stage3_partition_stream_chunk_size",
    "partition_stream_chunk_size",
};

const KeyList kOffloadHonoured = {"device", "nvme_path", "ratio", "delayed_update"};
const KeyList kOffloadOptimizerIgnored = {
    "buffer_count",  "pin_memory",          "pipeline_read",      "pipeline_write", "fast_init",
    "super_offload", "convert_grad_on_cpu", "cpuadam_cores_perc", "pipeline",
};
const KeyList kOffloadParamIgnored = {"buffer_count", "buffer_size", "max_in_cpu", "pin_memory"};

// The top-level aio section (the NVMe swap's I/O; AioConfig). intra_op_parallelism is
// DeepSpeed's other name of thread_count; use_gds (GPUDirect Storage) is not implemented.
const KeyList kAioHonoured = {"block_size",    "queue_depth",    "thread_count",
                              "single_submit", "overlap_events", "intra_op_parallelism"};
const KeyList kAioIgnored = {"use_gds"};

// The monitor sections "tensorboard" and "csv_monitor" (DeepSpeed's monitor/config.py).
const KeyList kMonitorHonoured = {"enabled", "output_path", "job_name"};

// The flops_profiler section (DeepSpeed's profiling/config.py; FlopsProfilerConfig).
const KeyList kFlopsProfilerHonoured = {"enabled",     "profile_step", "module_depth",
                                        "top_modules", "detailed",     "output_file"};

// The top-level pipeline section (PipelineConfig). DeepSpeed's keys stages, partition (DeepSpeed's
// config name; partition_method is PipelineModule's) and activation_checkpoint_interval, and
// shardtrain's schedule and virtual_stages. seed_layers and the tensor-parallel options
// pipe_partitioned / grad_partitioned are not implemented.
const KeyList kPipelineHonoured = {"stages",    "partition_method",
                                   "partition", "activation_checkpoint_interval",
                                   "schedule",  "virtual_stages"};
const KeyList kPipelineIgnored = {"seed_layers", "pipe_partitioned", "grad_partitioned"};

const KeyList kOptimizerHonoured = {"type", "params"};
const KeyList kOptimizerIgnored = {"legacy_fusion"};
const KeyList kAdamHonoured = {"lr",      "betas",          "eps", "weight_decay", "adam_w_mode",
                               "amsgrad", "bias_correction"};
// torch.optim.SGD's arguments (dampening must be 0, maximize false: the update shardtrain runs).
const KeyList kSgdHonoured = {"lr",           "momentum",  "nesterov",
                              "weight_decay", "dampening", "maximize"};
const KeyList kSgdIgnored = {"foreach", "differentiable", "fused"};
const KeyList kAdamIgnored = {"torch_adam",    "set_grad_none", "fp32_optimizer_states",
                              "max_grad_norm", "fused",         "foreach",
                              "capturable",    "differentiable"};

const KeyList kSchedulerHonoured = {"type", "params"};
const KeyList kWarmupLrHonoured = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                   "warmup_type"};
const KeyList kWarmupDecayLrHonoured = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                        "warmup_type", "total_num_steps"};
const KeyList kWarmupCosineLrHonoured = {"total_num_steps", "warmup_min_ratio", "warmup_num_steps",
                                         "cos_min_ratio", "warmup_type"};
const KeyList kSchedulerParamsIgnored = {"last_batch_iteration"};

const KeyList kFp16Honoured = {"enabled",           "loss_scale", "initial_scale_power",
                               "loss_scale_window", "hysteresis", "min_loss_scale"};
const KeyList kFp16Ignored = {"auto_cast", "consecutive_hysteresis",
                              "fp16_master_weights_and_grads", "fused_mode"};
const KeyList kBf16Honoured = {"enabled"};
const KeyList kBf16Ignored = {"immediate_grad_update", "check_grad_overflow",
                              "bf16_master_weights_and_grads", "bf16_optimizer_states"};

// activation_checkpointing: any of these "on" turns activation checkpointing on; the options
// themselves (partitioning, CPU checkpointing, ...) are not implemented and are listed as ignored.
const KeyList kActivationCheckpointingKeys = {
    "partition_activations", "contiguous_memory_optimization",  "cpu_checkpointing",
    "number_checkpoints",    "synchronize_checkpoint_boundary", "profile"};

// Keys of the honoured sections, to say where a misplaced key belongs.
const std::vector<std::pair<std::string, const KeyList*>> kSections = {
    {"", &kTopHonoured},
    {"zero_optimization", &kZeroHonoured},
    {"optimizer.params", &kAdamHonoured},
    {"scheduler.params", &kWarmupDecayLrHonoured},
    {"scheduler.params", &kWarmupCosineLrHonoured},
    {"fp16", &kFp16Honoured},
    {"activation_checkpointing", &kActivationCheckpointingKeys},
    {"aio", &kAioHonoured},
    {"pipeline", &kPipelineHonoured},
    {"tensorboard", &kMonitorHonoured},
    {"csv_monitor", &kMonitorHonoured},
    {"flops_profiler", &kFlopsProfilerHonoured},
};

// Keys of the CONFIG dict of the DeepSpeed GPT-2 tutorials, which are flags here, not JSON keys.
const std::vector<std::pair<std::string, std::string>> kTutorialKeys = {
    {"model", "--model"},
    {"strategy", "--strategy (or zero_optimization.stage)"},
    {"batch_size", "--batch-size (or train_micro_batch_size_per_gpu)"},
    {"micro_batch_size", "--batch-size (or train_micro_batch_size_per_gpu)"},
    {"epochs", "--epochs"},
    {"num_epochs", "--epochs"},
    {"max_length", "--max-length"},
    {"num_samples", "--num-samples"},
    {"seed", "--seed"},
    {"lr", "--lr (or optimizer.params.lr)"},
    {"learning_rate", "--lr (or optimizer.params.lr)"},
    {"weight_decay", "--weight-decay (or optimizer.params.weight_decay)"},
    {"max_steps", "--max-steps"},
    {"warmup_steps", "--warmup-steps (or scheduler.params.warmup_num_steps)"},
    {"dataset", "--dataset"},
    {"output_dir", "--output-dir"},
    {"local_rank", "the launcher's environment (LOCAL_RANK)"},
};

std::string path_of(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

std::string dashed_flag(std::string_view name) {
  std::string out = "--";
  for (char c : name) out += c == '_' ? '-' : c;
  return out;
}

/// A value that turns a feature on: not false, null, 0, "", "none", "auto" or an object
/// whose "enabled" is not on.
bool is_on(const json& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v.get<double>() != 0.0;
  if (v.is_string()) {
    const auto s = lowercase(v.get<std::string>());
    return !s.empty() && s != "none" && s != "auto" && s != "false";
  }
  if (v.is_object()) {
    auto it = v.find("enabled");
    if (it != v.end()) return is_on(*it);
    return !v.empty();
  }
  return !v.empty();  // array
}

bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

std::string json_type_name(const json& v) {
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

/// Reads one DeepSpeed JSON document into a TrainConfig.
class DeepSpeedReader {
 public:
  DeepSpeedReader(std::string file, TrainConfig& cfg, const ExplicitFlags& explicit_flags,
                  std::vector<std::string>& ignored, std::vector<std::string>& overridden)
      : file_(std::move(file)),
        cfg_(cfg),
        explicit_flags_(explicit_flags),
        ignored_(ignored),
        overridden_(overridden) {}

  void apply(const json& root) {
    if (!root.is_object()) {
      fail(fmt::format("the top level is {}, expected a JSON object {{...}} of DeepSpeed keys",
                       json_type_name(root)));
    }
    check_keys(root, "", kTopHonoured, kTopIgnored);
    read_batch(root);
    if (auto v = get_number(root, "gradient_clipping", "", 0.0, false,
                            "a number >= 0 (max global gradient L2 norm; 0 = off)")) {
      assign("grad_clip", "gradient_clipping", true, cfg_.gradient_clipping, *v);
    }
    if (auto v = get_int(root, "steps_per_print", "", 1, "an integer >= 1 (steps between logs)")) {
      assign("log_interval", "steps_per_print", true, cfg_.log_interval, *v);
    }
    if (auto v = get_bool(root, "wall_clock_breakdown", "")) {
      assign("wall_clock_breakdown", "wall_clock_breakdown", true, cfg_.wall_clock_breakdown, *v);
    }
    if (const json* opt = find(root, "optimizer")) read_optimizer(*opt);
    if (const json* sched = find(root, "scheduler")) read_scheduler(*sched);
    read_precision(root);
    // Before zero_optimization: a pipeline keeps running as one at the stage read there.
    read_pipeline(root);
    if (const json* zero = find(root, "zero_optimization")) read_zero(*zero);
    if (const json* ac = find(root, "activation_checkpointing")) read_activation_checkpointing(*ac);
    if (const json* aio = find(root, "aio")) read_aio(*aio);
    if (const json* tb = find(root, "tensorboard"))
      read_monitor(*tb, "tensorboard", "tensorboard", cfg_.monitor.tensorboard_dir);
    if (const json* csv = find(root, "csv_monitor"))
      read_monitor(*csv, "csv_monitor", "csv_monitor", cfg_.monitor.csv_dir);
    if (const json* fp = find(root, "flops_profiler")) read_flops_profiler(*fp);
    for (std::string& key : ignored_) {
      if (key == "wandb")
        key =
            "wandb (Weights & Biases logs to its online service: not supported offline; use "
            "tensorboard or csv_monitor)";
    }
  }

 private:
  // ---- errors -----------------------------------------------------------------------------

  [[noreturn]] void fail(const std::string& msg) const {
    throw ConfigError(fmt::format("DeepSpeed config '{}': {}", file_, msg));
  }

  [[noreturn]] void bad_value(const std::string& path, const json& v,
                              std::string_view expected) const {
    fail(fmt::format("\"{}\": {} is not valid: expected {}", path, v.dump(), expected));
  }

  [[noreturn]] void unknown_key(const std::string& prefix, const std::string& key,
                                const KeyList& honoured, const KeyList& ignored) const {
    const std::string path = path_of(prefix, key);
    if (key == "aio" && !prefix.empty()) {
      fail(fmt::format(
          "\"{}\": the \"aio\" section belongs at the top level of the config, not inside "
          "\"{}\" (DeepSpeed reads it only there): move the \"aio\" section to the top level",
          path, prefix));
    }
    if (prefix.empty()) {
      for (const auto& [name, flag] : kTutorialKeys) {
        if (key == name) {
          fail(fmt::format(
              "\"{}\" is not a DeepSpeed config key (it belongs to the tutorials' CONFIG dict, "
              "not to ds_config.json): remove it and use {} on the command line",
              key, flag));
        }
      }
    }
    KeyList candidates = honoured;
    candidates.insert(candidates.end(), ignored.begin(), ignored.end());
    std::string msg = fmt::format("unknown key \"{}\"", path);
    if (auto best = closest_match(key, candidates)) {
      msg += fmt::format(": did you mean '{}'?", path_of(prefix, *best));
      if (lowercase(*best) == lowercase(key)) msg += " (keys are case-sensitive)";
    } else {
      // Maybe the key is valid, but in another section.
      for (const auto& [section, keys] : kSections) {
        if (section != prefix && std::find(keys->begin(), keys->end(), key) != keys->end()) {
          msg += fmt::format(": \"{}\" belongs {}", key,
                             section.empty() ? std::string("at the top level")
                                             : fmt::format("in \"{}\"", section));
          fail(msg);
        }
      }
      if (prefix.empty()) {
        msg += fmt::format(": DeepSpeed has no such key; shardtrain reads {} (see {})",
                           join(honoured, ", "), kDocsUrl);
      } else {
        msg += fmt::format(": DeepSpeed has no such key; valid keys in \"{}\": {}", prefix,
                           join(candidates, ", "));
      }
    }
    fail(msg);
  }

  /// Every key of `obj` must be in `honoured` or `ignored`; ignored keys that are "on" are
  /// recorded with their dotted path.
  void check_keys(const json& obj, const std::string& prefix, const KeyList& honoured,
                  const KeyList& ignored) {
    for (const auto& [key, value] : obj.items()) {
      if (std::find(honoured.begin(), honoured.end(), key) != honoured.end()) continue;
      if (std::find(ignored.begin(), ignored.end(), key) != ignored.end()) {
        if (is_on(value)) ignored_.push_back(path_of(prefix, key));
        continue;
      }
      unknown_key(prefix, key, honoured, ignored);
    }
  }

  // ---- typed access; absent, null and "auto" read as unset -----------------------------------

  static bool has(const json& obj, const char* key) { return obj.contains(key); }

  static const json* find(const json& obj, const char* key) {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null() || is_auto(*it)) return nullptr;
    return &*it;
  }

  const json* find_object(const json& obj, const char* key, const std::string& prefix,
                          std::string_view expected) const {
    const json* v = find(obj, key);
    if (v != nullptr && !v->is_object()) bad_value(path_of(prefix, key), *v, expected);
    return v;
  }

  std::optional<int64_t> get_int(const json& obj, const char* key, const std::string& prefix,
                                 int64_t min, std::string_view expected) const {
    const json* v = find(obj, key);
    if (v == nullptr) return std::nullopt;
    int64_t out = 0;
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() &&
          v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        bad_value(path_of(prefix, key), *v, expected);
      }
      out = v->get<int64_t>();
    } else if (v->is_number_float()) {
      // DeepSpeed configs often write sizes as 5e8.
      const double d = v->get<double>();
      if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.0e18) {
        bad_value(path_of(prefix, key), *v, expected);
      }
      out = static_cast<int64_t>(d);
    } else {
      bad_value(path_of(prefix, key), *v, expected);
    }
    if (out < min) bad_value(path_of(prefix, key), *v, expected);
    return out;
  }

  /// A finite number >= min (> min when `exclusive`).
  std::optional<double> get_number(const json& obj, const char* key, const std::string& prefix,
                                   double min, bool exclusive, std::string_view expected) const {
    const json* v = find(obj, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) bad_value(path_of(prefix, key), *v, expected);
    const double d = v->get<double>();
    if (!std::isfinite(d) || d < min || (exclusive && d == min)) {
      bad_value(path_of(prefix, key), *v, expected);
    }
    return d;
  }

  std::optional<bool> get_bool(const json& obj, const char* key, const std::string& prefix) const {
    const json* v = find(obj, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) bad_value(path_of(prefix, key), *v, "true or false");
    return v->get<bool>();
  }

  std::optional<std::string> get_string(const json& obj, const char* key, const std::string& prefix,
                                        std::string_view expected) const {
    const json* v = find(obj, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) bad_value(path_of(prefix, key), *v, expected);
    return v->get<std::string>();
  }

  // ---- assignment honouring explicit flags -----------------------------------------------------

  bool is_explicit(std::string_view flag) const {
    return std::find(explicit_flags_.begin(), explicit_flags_.end(), flag) != explicit_flags_.end();
  }

  /// Sets `field` unless `flag` was given explicitly; `in_json` says whether the value was
  /// written in the file (rather than being a DeepSpeed default), for the overridden list.
  template <typename Field, typename Value>
  bool assign(std::string_view flag, const std::string& path, bool in_json, Field& field,
              const Value& value) {
    if (is_explicit(flag)) {
      if (in_json) overridden_.push_back(fmt::format("{} over {}", dashed_flag(flag), path));
      return false;
    }
    field = static_cast<Field>(value);
    return true;
  }

  // ---- sections
  // ----------------------------------------------------------------------------------

  void read_batch(const json& root) {
    if (auto v = get_int(root, "train_batch_size", "", 1,
                         "an integer >= 1 (global batch in samples) or \"auto\"")) {
      assign("train_batch_size", "train_batch_size", true, cfg_.train_batch_size, *v);
    }
    if (auto v = get_int(root, "train_micro_batch_size_per_gpu", "", 1,
                         "an integer >= 1 (samples per device per micro-step) or \"auto\"")) {
      if (assign("batch_size", "train_micro_batch_size_per_gpu", true, cfg_.micro_batch_size, *v)) {
        cfg_.micro_batch_set = true;
      }
    }
    if (auto v = get_int(root, "gradient_accumulation_steps", "", 1,
                         "an integer >= 1 (micro-steps per optimizer step) or \"auto\"")) {
      if (assign("gradient_accumulation_steps", "gradient_accumulation_steps", true,
                 cfg_.gradient_accumulation_steps, *v)) {
        cfg_.accumulation_set = true;
      }
    }
  }

  void read_optimizer(const json& opt) {
    if (!opt.is_object()) {
      bad_value("optimizer", opt, "an object {\"type\": \"AdamW\", \"params\": {...}}");
    }
    check_keys(opt, "optimizer", kOptimizerHonoured, kOptimizerIgnored);
    std::string type = "AdamW";
    if (auto t = get_string(opt, "type", "optimizer", "an optimizer name such as \"AdamW\"")) {
      type = *t;
    }
    const std::string lower_type = lowercase(type);
    if (lower_type == "sgd") {
      read_sgd(opt);
      return;
    }
    if (lower_type != "adam" && lower_type != "adamw") {
      static const KeyList kDeepSpeedOptimizers = {
          "Adagrad", "Lamb",    "OneBitAdam", "ZeroOneAdam", "OneBitLamb",
          "MuAdam",  "MuAdamW", "MuSGD",      "Lion",        "Muon"};
      std::string hint;
      if (auto best = closest_match(type, {"Adam", "AdamW", "SGD"})) {
        hint = fmt::format(" (did you mean '{}'?)", *best);
      }
      const bool known =
          std::any_of(kDeepSpeedOptimizers.begin(), kDeepSpeedOptimizers.end(),
                      [&](const std::string& n) { return lowercase(n) == lower_type; });
      fail(
          fmt::format("\"optimizer.type\": \"{}\" is {}{}: shardtrain implements Adam/AdamW "
                      "and SGD only; set \"type\": \"AdamW\" or \"SGD\"",
                      type, known ? "not available in shardtrain" : "not a known optimizer", hint));
    }
    const json* params = find_object(opt, "params", "optimizer", "an object of Adam parameters");
    const json empty = json::object();
    const json& p = params != nullptr ? *params : empty;
    const std::string prefix = "optimizer.params";
    check_keys(p, prefix, kAdamHonoured, kAdamIgnored);
    assign("optimizer", "optimizer.type", true, cfg_.optimizer, OptimizerKind::kAdamW);

    // Parameters the section omits take DeepSpeed's (FusedAdam) defaults.
    auto lr = has(p, "lr") ? get_number(p, "lr", prefix, 0.0, true,
                                        "a learning rate > 0 (e.g. 6e-4) or \"auto\"")
                           : std::optional<double>(1e-3);
    if (lr) assign("lr", prefix + ".lr", has(p, "lr"), cfg_.lr, *lr);

    std::optional<double> b1 = 0.9, b2 = 0.999;
    if (has(p, "betas")) {
      b1.reset();
      b2.reset();
      if (const json* betas = find(p, "betas")) {
        constexpr std::string_view kBetas =
            "[beta1, beta2], two numbers in [0, 1) such as [0.9, 0.999]";
        if (!betas->is_array() || betas->size() != 2) bad_value(prefix + ".betas", *betas, kBetas);
        for (std::size_t i = 0; i < 2; ++i) {
          const json& b = (*betas)[i];
          if (!b.is_number() || !std::isfinite(b.get<double>()) || b.get<double>() < 0.0 ||
              b.get<double>() >= 1.0) {
            bad_value(prefix + ".betas", *betas, kBetas);
          }
        }
        b1 = (*betas)[0].get<double>();
        b2 = (*betas)[1].get<double>();
      }
    }
    if (b1) assign("adam_beta1", prefix + ".betas[0]", has(p, "betas"), cfg_.beta1, *b1);
    if (b2) assign("adam_beta2", prefix + ".betas[1]", has(p, "betas"), cfg_.beta2, *b2);

    auto eps = has(p, "eps")
                   ? get_number(p, "eps", prefix, 0.0, true, "a number > 0 (e.g. 1e-8) or \"auto\"")
                   : std::optional<double>(1e-8);
    if (eps) assign("adam_eps", prefix + ".eps", has(p, "eps"), cfg_.adam_eps, *eps);

    auto wd = has(p, "weight_decay") ? get_number(p, "weight_decay", prefix, 0.0, false,
                                                  "a number >= 0 (0 = no weight decay) or \"auto\"")
                                     : std::optional<double>(0.0);
    if (wd)
      assign("weight_decay", prefix + ".weight_decay", has(p, "weight_decay"), cfg_.weight_decay,
             *wd);

    // DeepSpeed runs "Adam" as AdamW (decoupled weight decay) unless adam_w_mode is false.
    if (auto w_mode = get_bool(p, "adam_w_mode", prefix)) {
      if (!*w_mode && lower_type == "adam" && cfg_.weight_decay > 0.0) {
        fail(fmt::format(
            "\"{}.adam_w_mode\": false asks for Adam with L2 regularisation (weight_decay {}), "
            "which shardtrain does not implement: remove adam_w_mode to get AdamW (decoupled "
            "weight decay), or set weight_decay to 0",
            prefix, cfg_.weight_decay));
      }
    }
    if (auto amsgrad = get_bool(p, "amsgrad", prefix); amsgrad && *amsgrad) {
      fail(
          fmt::format("\"{}.amsgrad\": true is not available in shardtrain: remove it or set "
                      "it to false",
                      prefix));
    }
    if (auto bc = get_bool(p, "bias_correction", prefix); bc && !*bc) {
      fail(
          fmt::format("\"{}.bias_correction\": false is not available in shardtrain (Adam "
                      "always bias-corrects): remove it or set it to true",
                      prefix));
    }
  }

  /// optimizer {"type": "SGD", "params": {lr, momentum, nesterov, weight_decay}}: torch.optim.SGD
  /// (parameters the section omits take PyTorch's defaults, lr DeepSpeed's 1e-3).
  void read_sgd(const json& opt) {
    const std::string prefix = "optimizer.params";
    const json* params = find_object(opt, "params", "optimizer", "an object of SGD parameters");
    const json empty = json::object();
    const json& p = params != nullptr ? *params : empty;
    check_keys(p, prefix, kSgdHonoured, kSgdIgnored);
    assign("optimizer", "optimizer.type", true, cfg_.optimizer, OptimizerKind::kSGD);
    auto lr = has(p, "lr") ? get_number(p, "lr", prefix, 0.0, true,
                                        "a learning rate > 0 (e.g. 0.1) or \"auto\"")
                           : std::optional<double>(1e-3);
    if (lr) assign("lr", prefix + ".lr", has(p, "lr"), cfg_.lr, *lr);
    auto momentum = has(p, "momentum") ? get_number(p, "momentum", prefix, 0.0, false,
                                                    "a number in [0, 1) (e.g. 0.9) or \"auto\"")
                                       : std::optional<double>(0.0);
    if (momentum)
      assign("momentum", prefix + ".momentum", has(p, "momentum"), cfg_.momentum, *momentum);
    auto wd = has(p, "weight_decay") ? get_number(p, "weight_decay", prefix, 0.0, false,
                                                  "a number >= 0 (0 = no weight decay) or \"auto\"")
                                     : std::optional<double>(0.0);
    if (wd)
      assign("weight_decay", prefix + ".weight_decay", has(p, "weight_decay"), cfg_.weight_decay,
             *wd);
    const std::optional<bool> nesterov = get_bool(p, "nesterov", prefix);
    assign("nesterov", prefix + ".nesterov", nesterov.has_value(), cfg_.nesterov,
           nesterov.value_or(false));
    if (const json* d = find(p, "dampening");
        d != nullptr && !(d->is_number() && d->get<double>() == 0.0)) {
      fail(
          fmt::format("\"{}.dampening\": {} is not available in shardtrain (SGD runs with "
                      "dampening 0): remove it or set it to 0",
                      prefix, d->dump()));
    }
    if (auto mx = get_bool(p, "maximize", prefix); mx && *mx) {
      fail(
          fmt::format("\"{}.maximize\": true is not available in shardtrain: remove it or "
                      "set it to false",
                      prefix));
    }
  }

  void read_warmup_type(const json& p, const std::string& prefix) {
    if (auto t = get_string(p, "warmup_type", prefix, "\"linear\" or \"log\"")) {
      if (*t == "log") {
        ignored_.push_back(prefix + ".warmup_type");  // shardtrain warms up linearly
      } else if (*t != "linear") {
        bad_value(prefix + ".warmup_type", p.at("warmup_type"), "\"linear\" or \"log\"");
      }
    }
  }

  void read_total_steps(const json& p, const std::string& prefix) {
    if (auto total = get_int(p, "total_num_steps", prefix, 1,
                             "an integer >= 1 (optimizer steps) or \"auto\"")) {
      if (is_explicit("max_steps")) {
        overridden_.push_back(fmt::format("--max-steps over {}.total_num_steps", prefix));
      } else if (cfg_.max_steps == -1) {
        cfg_.max_steps = *total;
      }
    }
  }

  void read_scheduler(const json& sched) {
    if (!sched.is_object()) {
      bad_value("scheduler", sched, "an object {\"type\": \"WarmupCosineLR\", \"params\": {...}}");
    }
    check_keys(sched, "scheduler", kSchedulerHonoured, {});
    static const KeyList kTypes = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                                   "LRRangeTest"};
    auto type = get_string(sched, "type", "scheduler", "a scheduler name such as \"WarmupLR\"");
    const json* params =
        find_object(sched, "params", "scheduler", "an object of scheduler parameters");
    if (!type) {
      if (params != nullptr) {
        fail(
            "\"scheduler.params\" is given without \"scheduler.type\": set \"type\" to "
            "WarmupLR, WarmupDecayLR or WarmupCosineLR");
      }
      return;
    }
    if (*type == "OneCycle" || *type == "LRRangeTest") {
      fail(
          fmt::format("\"scheduler.type\": \"{}\" is not available in shardtrain: use "
                      "WarmupLR (constant after warmup), WarmupDecayLR (linear decay) or "
                      "WarmupCosineLR (cosine decay)",
                      *type));
    }
    if (*type != "WarmupLR" && *type != "WarmupDecayLR" && *type != "WarmupCosineLR") {
      std::string hint;
      if (auto best = closest_match(*type, kTypes))
        hint = fmt::format(": did you mean '{}'?", *best);
      fail(
          fmt::format("\"scheduler.type\": \"{}\" is not a DeepSpeed scheduler{}; shardtrain "
                      "supports WarmupLR, WarmupDecayLR and WarmupCosineLR",
                      *type, hint));
    }
    const json empty = json::object();
    const json& p = params != nullptr ? *params : empty;
    const std::string prefix = "scheduler.params";

    if (*type == "WarmupCosineLR") {
      check_keys(p, prefix, kWarmupCosineLrHonoured, kSchedulerParamsIgnored);
      assign("lr_schedule", "scheduler.type", true, cfg_.lr_schedule, LrSchedule::kCosine);
      read_total_steps(p, prefix);
      auto ratio_expected = "a number in [0, 1] (fraction of the optimizer's lr)";
      auto warm_min = has(p, "warmup_min_ratio")
                          ? get_number(p, "warmup_min_ratio", prefix, 0.0, false, ratio_expected)
                          : std::optional<double>(0.0);
      if (warm_min) {
        if (*warm_min > 1.0)
          bad_value(prefix + ".warmup_min_ratio", p.at("warmup_min_ratio"), ratio_expected);
        cfg_.warmup_min_ratio = *warm_min;
      }
      auto warmup = has(p, "warmup_num_steps")
                        ? get_int(p, "warmup_num_steps", prefix, 0, "an integer >= 0 or \"auto\"")
                        : std::optional<int64_t>(1000);
      if (warmup) {
        assign("warmup_steps", prefix + ".warmup_num_steps", has(p, "warmup_num_steps"),
               cfg_.warmup_steps, *warmup);
      }
      auto cos_min = has(p, "cos_min_ratio")
                         ? get_number(p, "cos_min_ratio", prefix, 0.0, false, ratio_expected)
                         : std::optional<double>(0.0001);
      if (cos_min) {
        if (*cos_min > 1.0)
          bad_value(prefix + ".cos_min_ratio", p.at("cos_min_ratio"), ratio_expected);
        assign("min_lr_ratio", prefix + ".cos_min_ratio", has(p, "cos_min_ratio"),
               cfg_.min_lr_ratio, *cos_min);
      }
      read_warmup_type(p, prefix);
      return;
    }

    // WarmupLR and WarmupDecayLR: warm up from warmup_min_lr to warmup_max_lr (which overrides
    // the optimizer's lr, as in DeepSpeed), then constant or linear decay to warmup_min_lr.
    const bool decay = *type == "WarmupDecayLR";
    check_keys(p, prefix, decay ? kWarmupDecayLrHonoured : kWarmupLrHonoured,
               kSchedulerParamsIgnored);
    assign("lr_schedule", "scheduler.type", true, cfg_.lr_schedule,
           decay ? LrSchedule::kLinear : LrSchedule::kConstant);
    if (decay) read_total_steps(p, prefix);
    auto max_lr = has(p, "warmup_max_lr") ? get_number(p, "warmup_max_lr", prefix, 0.0, true,
                                                       "a learning rate > 0 or \"auto\"")
                                          : std::optional<double>(0.001);
    if (max_lr) assign("lr", prefix + ".warmup_max_lr", has(p, "warmup_max_lr"), cfg_.lr, *max_lr);
    auto min_lr = has(p, "warmup_min_lr") ? get_number(p, "warmup_min_lr", prefix, 0.0, false,
                                                       "a learning rate >= 0 or \"auto\"")
                                          : std::optional<double>(0.0);
    if (min_lr) {
      const double peak = max_lr ? *max_lr : cfg_.lr;
      if (*min_lr > peak) {
        fail(
            fmt::format("\"{0}.warmup_min_lr\": {1} is larger than warmup_max_lr {2}: the "
                        "warmup starts at warmup_min_lr and rises to warmup_max_lr; set "
                        "warmup_min_lr to at most {2}",
                        prefix, *min_lr, peak));
      }
      cfg_.warmup_min_ratio = *min_lr / peak;
      if (decay) {
        assign("min_lr_ratio", prefix + ".warmup_min_lr", has(p, "warmup_min_lr"),
               cfg_.min_lr_ratio, *min_lr / peak);
      }
    }
    auto warmup = has(p, "warmup_num_steps")
                      ? get_int(p, "warmup_num_steps", prefix, 0, "an integer >= 0 or \"auto\"")
                      : std::optional<int64_t>(1000);
    if (warmup) {
      assign("warmup_steps", prefix + ".warmup_num_steps", has(p, "warmup_num_steps"),
             cfg_.warmup_steps, *warmup);
    }
    read_warmup_type(p, prefix);
  }

  void read_precision(const json& root) {
    if (find(root, "bf16") != nullptr && find(root, "bfloat16") != nullptr) {
      fail("both \"bf16\" and \"bfloat16\" (its old name) are given: keep only \"bf16\"");
    }
    std::optional<bool> bf16, fp16;
    std::string bf16_key = find(root, "bf16") != nullptr ? "bf16" : "bfloat16";
    if (const json* bf = find_object(root, bf16_key.c_str(), "", "an object {\"enabled\": true}")) {
      check_keys(*bf, bf16_key, kBf16Honoured, kBf16Ignored);
      bf16 = get_bool(*bf, "enabled", bf16_key);
    }
    if (const json* fp = find_object(root, "fp16", "", "an object {\"enabled\": true, ...}")) {
      const std::string prefix = "fp16";
      check_keys(*fp, prefix, kFp16Honoured, kFp16Ignored);
      fp16 = get_bool(*fp, "enabled", prefix);
      LossScaleConfig& ls = cfg_.loss_scale;
      if (auto v = get_number(*fp, "loss_scale", prefix, 0.0, false,
                              "a number >= 0 (0 = dynamic loss scaling)")) {
        ls.loss_scale = *v;
      }
      if (auto v = get_int(*fp, "initial_scale_power", prefix, 0,
                           "an integer in [0, 63] (initial dynamic scale 2^power)")) {
        if (*v > 63) {
          bad_value("fp16.initial_scale_power", fp->at("initial_scale_power"),
                    "an integer in [0, 63] (initial dynamic scale 2^power)");
        }
        ls.initial_scale_power = static_cast<int>(*v);
      }
      if (auto v = get_int(*fp, "loss_scale_window", prefix, 1,
                           "an integer >= 1 (steps without overflow before the scale grows)")) {
        ls.loss_scale_window = *v;
      }
      if (auto v = get_int(*fp, "hysteresis", prefix, 1,
                           "an integer >= 1 (overflows tolerated before the scale shrinks)")) {
        if (*v > std::numeric_limits<int>::max()) {
          bad_value("fp16.hysteresis", fp->at("hysteresis"), "an integer >= 1");
        }
        ls.hysteresis = static_cast<int>(*v);
      }
      if (auto v = get_number(*fp, "min_loss_scale", prefix, 0.0, true, "a number > 0")) {
        ls.min_loss_scale = *v;
      }
    }
    if (bf16.value_or(false) && fp16.value_or(false)) {
      fail(
          fmt::format("\"{}.enabled\" and \"fp16.enabled\" are both true: enable at most one "
                      "(bf16 needs no loss scaling; fp16 uses the fp16 loss-scale settings)",
                      bf16_key));
    }
    if (bf16 || fp16) {
      Precision p = Precision::kFp32;  // both written as false: DeepSpeed trains in fp32
      std::string path = bf16 ? bf16_key + ".enabled" : "fp16.enabled";
      if (bf16.value_or(false)) {
        p = Precision::kBf16;
        path = bf16_key + ".enabled";
      } else if (fp16.value_or(false)) {
        p = Precision::kFp16;
        path = "fp16.enabled";
      }
      assign("precision", path, true, cfg_.precision, p);
    }
  }

  std::string read_offload(const json& z, const char* key, const KeyList& ignored,
                           std::string current) {
    const std::string prefix = path_of("zero_optimization", key);
    const json* off = find_object(z, key, "zero_optimization",
                                  "an object {\"device\": \"none\" | \"cpu\" | \"nvme\", ...}");
    if (off == nullptr) return current;
    check_keys(*off, prefix, kOffloadHonoured, ignored);
    if (auto dev = get_string(*off, "device", prefix, "\"none\", \"cpu\" or \"nvme\"")) {
      if (!is_offload_device(*dev)) {
        bad_value(prefix + ".device", off->at("device"), "\"none\", \"cpu\" or \"nvme\"");
      }
      current = *dev;
    }
    if (auto path = get_string(*off, "nvme_path", prefix, "a directory path")) {
      cfg_.zero.nvme_path = *path;
    }
    const char* fraction = "a number in [0, 1] (the fraction of the optimizer state offloaded)";
    if (has(*off, "ratio")) {
      if (std::string(key) != "offload_optimizer")
        throw ConfigError(
            fmt::format("{}.ratio in '{}': ratio belongs to offload_optimizer, not "
                        "{}; move it there",
                        prefix, file_, key));
      auto r = get_number(*off, "ratio", prefix, 0.0, false, fraction);
      if (r && *r > 1.0) bad_value(prefix + ".ratio", off->at("ratio"), fraction);
      if (r) cfg_.zero.offload_ratio = *r;
    }
    if (has(*off, "delayed_update")) {
      if (std::string(key) != "offload_optimizer")
        throw ConfigError(
            fmt::format("{}.delayed_update in '{}': the delayed update belongs to "
                        "offload_optimizer; move it there",
                        prefix, file_));
      if (auto v = get_bool(*off, "delayed_update", prefix)) cfg_.zero.offload_delayed_update = *v;
    }
    return current;
  }

  void read_zero(const json& z) {
    ZeroConfig& zc = cfg_.zero;
    std::optional<int64_t> stage;
    if (z.is_boolean()) {
      stage = z.get<bool>() ? 1 : 0;  // deprecated form: true = stage 1
    } else if (!z.is_object()) {
      bad_value("zero_optimization", z, "an object {\"stage\": 0, ...}");
    } else {
      const std::string prefix = "zero_optimization";
      KeyList known = kZeroHonoured;
      known.insert(known.end(), kZeroOnByDefaultIgnored.begin(), kZeroOnByDefaultIgnored.end());
      check_keys(z, prefix, known, kZeroIgnored);
      stage = get_int(z, "stage", prefix, 0, "a ZeRO stage 0, 1, 2 or 3");
      if (stage && *stage > 3)
        bad_value("zero_optimization.stage", z.at("stage"), "a ZeRO stage 0, 1, 2 or 3");
      if (auto v = get_int(z, "reduce_bucket_size", prefix, 1, "an integer >= 1 (elements)")) {
        zc.reduce_bucket_size = *v;
        zc.reduce_bucket_size_set = true;
      }
      if (auto v = get_int(z, "allgather_bucket_size", prefix, 1, "an integer >= 1 (elements)")) {
        zc.allgather_bucket_size = *v;
      }
      if (auto v = get_bool(z, "overlap_comm", prefix)) zc.overlap_comm = *v;
      for (const std::string& key : kZeroOnByDefaultIgnored) {
        if (auto v = get_bool(z, key.c_str(), prefix); v && !*v)
          ignored_.push_back(path_of(prefix, key) + ": false");
      }
      read_stage3(z);
      // Deprecated spellings of offload_optimizer / offload_param {"device": "cpu"}.
      if (auto v = get_bool(z, "cpu_offload", prefix); v && *v) zc.offload_optimizer_device = "cpu";
      if (auto v = get_bool(z, "cpu_offload_param", prefix); v && *v) {
        zc.offload_param_device = "cpu";
      }
      zc.offload_optimizer_device = read_offload(z, "offload_optimizer", kOffloadOptimizerIgnored,
                                                 zc.offload_optimizer_device);
      zc.offload_param_device =
          read_offload(z, "offload_param", kOffloadParamIgnored, zc.offload_param_device);
    }
    if (!stage) return;
    const std::string path = z.is_boolean() ? "zero_optimization" : "zero_optimization.stage";
    if (!assign("zero_stage", path, true, zc.stage, *stage)) return;
    // As in DeepSpeed, the config's stage decides the strategy; a pipeline stays one and runs
    // that stage across its data-parallel replicas (validate() allows stages 0, 1 and 2).
    if (cfg_.strategy == StrategyKind::kPipeline) return;
    cfg_.strategy = strategy_for_zero(static_cast<int>(*stage), zc.offload_optimizer_device,
                                      zc.offload_param_device);
    cfg_.strategy_name = to_string(cfg_.strategy);
    cfg_.strategy_source = "deepspeed";
  }

  /// The key of zero_optimization that is given among `key` and its other spellings `aliases`,
  /// or nullptr; two spellings of the same setting are an error.
  const char* stage3_key(const json& z, const char* key,
                         std::initializer_list<const char*> aliases) const {
    const char* given = has(z, key) ? key : nullptr;
    for (const char* alias : aliases) {
      if (!has(z, alias)) continue;
      if (given != nullptr) {
        fail(fmt::format(
            "\"zero_optimization.{}\" and \"zero_optimization.{}\" are both given: they are "
            "the same setting (DeepSpeed accepts either spelling); keep only \"{}\"",
            given, alias, key));
      }
      given = alias;
    }
    return given;
  }

  void read_stage3(const json& z) {
    const std::string prefix = "zero_optimization";
    ZeroConfig& zc = cfg_.zero;
    for (const Stage3Size& s : kStage3Sizes) {
      if (const char* key = stage3_key(z, s.key, {s.alias})) {
        if (auto v = get_int(z, key, prefix, s.min, s.expected)) zc.*s.field = *v;
      }
    }
    if (auto v = get_int(z, "zero_hpz_partition_size", prefix, 1,
                         "an integer >= 1 (ranks that share one copy of the sharded model "
                         "states, e.g. the GPUs of a node; 1 = shard over every rank)"))
      zc.hpz_partition_size = *v;
    if (auto v = get_bool(z, "zero_quantized_gradients", prefix)) zc.quantized_gradients = *v;
    if (const char* key =
            stage3_key(z, "stage3_gather_16bit_weights_on_model_save",
                       {"gather_16bit_weights_on_model_save",
                        "stage3_gather_fp16_weights_on_model_save"})) {  // the last: deprecated
      if (auto v = get_bool(z, key, prefix)) zc.stage3_gather_16bit_weights_on_model_save = *v;
    }
  }

  /// An integer in [min, INT_MAX] of `obj`, if given.
  std::optional<int> get_small_int(const json& obj, const char* key, const std::string& prefix,
                                   int min, std::string_view expected) const {
    auto v = get_int(obj, key, prefix, min, expected);
    if (v && *v > std::numeric_limits<int>::max())
      bad_value(path_of(prefix, key), obj.at(key), expected);
    if (!v) return std::nullopt;
    return static_cast<int>(*v);
  }

  void read_pipeline(const json& root) {
    const std::string prefix = "pipeline";
    const json* section = find(root, "pipeline");
    if (section == nullptr) return;
    const json& p = *section;
    if (!p.is_object()) bad_value(prefix, p, "an object {\"stages\": 4, ...}");
    const std::size_t ignored_before = ignored_.size();
    check_keys(p, prefix, kPipelineHonoured, kPipelineIgnored);

    if (has(p, "stages") && is_auto(p.at("stages"))) {
      fail(
          "\"pipeline.stages\": \"auto\" is not supported: shardtrain does not choose the "
          "number of pipeline stages; give a number, e.g. \"stages\": 4 (ranks per pipeline; "
          "the world size must be a multiple of it)");
    }
    const auto stages =
        get_small_int(p, "stages", prefix, 1, "an integer >= 1 (ranks per pipeline), e.g. 4");
    std::optional<PipelineSchedule> schedule;
    if (auto name = get_string(p, "schedule", prefix,
                               "a schedule name: gpipe, 1f1b, interleaved-1f1b, zb-h1 or 2bw")) {
      try {
        schedule = parse_pipeline_schedule(*name);
      } catch (const ConfigError& e) {
        fail(fmt::format("\"pipeline.schedule\": {}", e.what()));
      }
    }
    const auto virtual_stages =
        get_small_int(p, "virtual_stages", prefix, 1,
                      "an integer >= 1 (model chunks per rank; > 1 only with interleaved-1f1b)");
    if (has(p, "partition_method") && has(p, "partition")) {
      fail(
          "\"pipeline.partition_method\" and \"pipeline.partition\" are both given: they are "
          "the same setting; keep only \"partition_method\"");
    }
    const char* partition_key = has(p, "partition") ? "partition" : "partition_method";
    const std::string partition_path = path_of(prefix, partition_key);
    std::optional<std::string> partition;
    if (auto m = get_string(p, partition_key, prefix, "\"parameters\", \"uniform\" or \"time\"")) {
      partition = lowercase(*m);
      if (partition->rfind("type:", 0) == 0) {
        fail(
            fmt::format("\"{}\": \"{}\" (DeepSpeed's partition by layer class) is not available in "
                        "shardtrain: use \"parameters\" (balance parameter counts, the default), "
                        "\"uniform\" (equal block counts) or \"time\" (balance measured time)",
                        partition_path, *m));
      }
      try {
        check_partition_method(*partition);
      } catch (const ConfigError& e) {
        fail(fmt::format("\"{}\": {}", partition_path, e.what()));
      }
    }
    const auto interval =
        get_small_int(p, "activation_checkpoint_interval", prefix, 0,
                      "an integer >= 0 (blocks per activation checkpoint; 0 = off)");

    // A pipeline section with stages > 1 selects the pipeline, as DeepSpeed's PipelineEngine
    // runs whenever the model is a PipelineModule.
    const bool selects = stages && *stages > 1;
    if (selects && cfg_.strategy != StrategyKind::kPipeline) {
      if (cfg_.strategy_source == "--strategy") {
        fail(fmt::format(
            "\"pipeline.stages\": {} asks for pipeline parallelism, but --strategy {} asks for "
            "strategy '{}': use --strategy pipeline (or drop --strategy), or remove the "
            "\"pipeline\" section",
            *stages, cfg_.strategy_name, to_string(cfg_.strategy)));
      }
      cfg_.strategy = StrategyKind::kPipeline;
      cfg_.strategy_name = to_string(cfg_.strategy);
      cfg_.strategy_source = "deepspeed";
    }
    if (cfg_.strategy != StrategyKind::kPipeline) {
      // DeepSpeed, too, reads the section only when it runs a pipeline: all of it is ignored.
      ignored_.resize(ignored_before);
      if (is_on(p)) ignored_.push_back(prefix);
      return;
    }
    PipelineConfig& pc = cfg_.pipeline;
    if (stages) assign("pipeline_stages", "pipeline.stages", true, pc.stages, *stages);
    if (schedule) assign("pipeline_schedule", "pipeline.schedule", true, pc.schedule, *schedule);
    if (virtual_stages) {
      assign("virtual_stages", "pipeline.virtual_stages", true, pc.virtual_stages, *virtual_stages);
    }
    if (partition) {
      assign("partition_method", partition_path, true, pc.partition_method, *partition);
    }
    if (interval) {
      assign("activation_checkpoint_interval", "pipeline.activation_checkpoint_interval", true,
             pc.activation_checkpoint_interval, *interval);
    }
  }

  void read_activation_checkpointing(const json& ac) {
    const std::string prefix = "activation_checkpointing";
    if (!ac.is_object()) bad_value(prefix, ac, "an object {\"partition_activations\": false, ...}");
    check_keys(ac, prefix, {}, kActivationCheckpointingKeys);
    bool on = false;
    for (const auto& key : kActivationCheckpointingKeys) {
      const json* v = find(ac, key.c_str());
      if (v == nullptr) continue;
      if (key == "number_checkpoints") {
        get_int(ac, "number_checkpoints", prefix, 0, "an integer >= 0 or null");
      } else {
        get_bool(ac, key.c_str(), prefix);
      }
      on = on || is_on(*v);
    }
    if (on) assign("activation_checkpointing", prefix, true, cfg_.activation_checkpointing, true);
  }

  void read_aio(const json& a) {
    const std::string prefix = "aio";
    if (!a.is_object()) bad_value(prefix, a, "an object {\"block_size\": 1048576, ...}");
    check_keys(a, prefix, kAioHonoured, kAioIgnored);
    AioConfig& aio = cfg_.aio;
    constexpr std::string_view kBlock =
        "a multiple of 4096 (O_DIRECT alignment), at least 4096: bytes per read/write request, "
        "e.g. 1048576";
    if (auto v = get_int(a, "block_size", prefix, 4096, kBlock)) {
      if (*v % 4096 != 0) bad_value("aio.block_size", a.at("block_size"), kBlock);
      aio.block_size = *v;
    }
    constexpr std::string_view kDepth =
        "an integer >= 1 (most read/write requests in flight per file), e.g. 8";
    if (auto v = get_int(a, "queue_depth", prefix, 1, kDepth)) {
      if (*v > std::numeric_limits<int>::max())
        bad_value("aio.queue_depth", a.at("queue_depth"), kDepth);
      aio.queue_depth = static_cast<int>(*v);
    }
    if (has(a, "thread_count") && has(a, "intra_op_parallelism")) {
      fail(
          "\"aio.thread_count\" and \"aio.intra_op_parallelism\" are both given: they are the "
          "same setting (DeepSpeed accepts either name); keep only \"thread_count\"");
    }
    const char* threads = has(a, "intra_op_parallelism") ? "intra_op_parallelism" : "thread_count";
    constexpr std::string_view kThreads = "an integer in [1, 256] (I/O threads per file), e.g. 1";
    if (auto v = get_int(a, threads, prefix, 1, kThreads)) {
      if (*v > 256) bad_value(path_of(prefix, threads), a.at(threads), kThreads);
      aio.thread_count = static_cast<int>(*v);
    }
    if (auto v = get_bool(a, "single_submit", prefix)) aio.single_submit = *v;
    if (auto v = get_bool(a, "overlap_events", prefix)) aio.overlap_events = *v;
  }

  /// A monitor section {"enabled", "output_path", "job_name"}: when enabled, `dir` is
  /// output_path/job_name, as DeepSpeed's monitors make it (defaults "" and "DeepSpeedJobName",
  /// relative to the working directory), unless `flag` (--tensorboard, --csv-monitor) was given.
  void read_monitor(const json& m, const std::string& prefix, std::string_view flag,
                    std::string& dir) {
    if (!m.is_object())
      bad_value(prefix, m,
                "an object {\"enabled\": true, \"output_path\": ..., \"job_name\": ...}");
    check_keys(m, prefix, kMonitorHonoured, {});
    const bool enabled = get_bool(m, "enabled", prefix).value_or(false);
    const std::string output_path =
        get_string(m, "output_path", prefix, "a directory path (string)").value_or("");
    const std::string job_name =
        get_string(m, "job_name", prefix, "a name (string)").value_or("DeepSpeedJobName");
    if (job_name.empty())
      bad_value(path_of(prefix, "job_name"), m.at("job_name"), "a non-empty name");
    if (!enabled) return;
    const std::string path = (std::filesystem::path(output_path) / job_name).string();
    assign(flag, prefix, true, dir, path);
  }

  /// DeepSpeed's flops_profiler: {"enabled", "profile_step" (1-based, DeepSpeed's default 1),
  /// "module_depth" (-1 = all), "top_modules", "detailed", "output_file" (null: the log)}.
  /// --profile-step N wins over enabled/profile_step.
  void read_flops_profiler(const json& f) {
    const std::string prefix = "flops_profiler";
    if (!f.is_object())
      bad_value(prefix, f, "an object {\"enabled\": true, \"profile_step\": 1, ...}");
    check_keys(f, prefix, kFlopsProfilerHonoured, {});
    FlopsProfilerConfig& p = cfg_.flops_profiler;
    const bool enabled = get_bool(f, "enabled", prefix).value_or(false);
    const auto step =
        get_int(f, "profile_step", prefix, 1, "an integer >= 1 (the optimizer step to profile)");
    if (enabled) {
      if (!is_explicit("profile_step")) p.enabled = true;
      assign("profile_step", path_of(prefix, "profile_step"), step.has_value(), p.profile_step,
             step.value_or(1));
    }
    if (auto v = get_int(f, "module_depth", prefix, -1, "an integer >= -1 (-1: every level)"))
      p.module_depth = *v;
    if (auto v = get_int(f, "top_modules", prefix, 0, "an integer >= 0")) p.top_modules = *v;
    if (auto v = get_bool(f, "detailed", prefix)) p.detailed = *v;
    if (f.contains("output_file") && !f.at("output_file").is_null()) {
      if (auto v = get_string(f, "output_file", prefix, "a file path (string) or null"))
        p.output_file = *v;
    }
  }

  std::string file_;
  TrainConfig& cfg_;
  const ExplicitFlags& explicit_flags_;
  std::vector<std::string>& ignored_;
  std::vector<std::string>& overridden_;
};

/// Parses the file, accepting comments (DeepSpeed reads configs with hjson) and rejecting
/// duplicate keys (as DeepSpeed does).
json parse_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ConfigError(fmt::format("cannot open DeepSpeed config '{}' (--deepspeed-config): {}",
                                  path, std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();

  struct Frame {
    std::string name;
    std::set<std::string> keys;
  };
  std::vector<Frame> frames;
  std::string last_key;
  std::string duplicate;
  json::parser_callback_t cb = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        frames.push_back({frames.empty() ? std::string() : last_key, {}});
        break;
      case json::parse_event_t::object_end:
        if (!frames.empty()) frames.pop_back();
        break;
      case json::parse_event_t::key: {
        last_key = parsed.get<std::string>();
        if (!frames.empty() && !frames.back().keys.insert(last_key).second && duplicate.empty()) {
          std::vector<std::string> names;
          for (std::size_t i = 1; i < frames.size(); ++i) names.push_back(frames[i].name);
          names.push_back(last_key);
          duplicate = join(names, ".");
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  json root;
  try {
    root = json::parse(text.str(), cb, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix.
    if (auto pos = what.find("] ");
        what.rfind("[json.exception", 0) == 0 && pos != std::string::npos) {
      what = what.substr(pos + 2);
    }
    throw ConfigError(fmt::format(
        "cannot parse DeepSpeed config '{}' (--deepspeed-config): {} (byte {}): fix the JSON "
        "syntax there (comments are allowed, trailing commas are not)",
        path, what, e.byte));
  }
  if (!duplicate.empty()) {
    throw ConfigError(
        fmt::format("DeepSpeed config '{}': key \"{}\" appears twice in the same "
                    "object: DeepSpeed rejects duplicate keys; keep only one",
                    path, duplicate));
  }
  return root;
}

// ---- validation helpers ---------------------------------------------------------------------

/// "--pipeline-stages 4, --trace 'dir'": the pipeline settings of `c` that differ from the
/// defaults.
std::vector<std::string> pipeline_settings_given(const TrainConfig& c) {
  const PipelineConfig defaults;
  const PipelineConfig& p = c.pipeline;
  std::vector<std::string> out;
  if (p.stages != defaults.stages) out.push_back(fmt::format("--pipeline-stages {}", p.stages));
  if (p.schedule != defaults.schedule) {
    out.push_back(fmt::format("--pipeline-schedule {}", to_string(p.schedule)));
  }
  if (p.virtual_stages != defaults.virtual_stages) {
    out.push_back(fmt::format("--virtual-stages {}", p.virtual_stages));
  }
  if (p.partition_method != defaults.partition_method) {
    out.push_back(fmt::format("--partition-method {}", p.partition_method));
  }
  if (p.activation_checkpoint_interval != defaults.activation_checkpoint_interval) {
    out.push_back(
        fmt::format("--activation-checkpoint-interval {}", p.activation_checkpoint_interval));
  }
  if (!c.trace_dir.empty()) out.push_back(fmt::format("--trace '{}'", c.trace_dir));
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

void check_strategy(const TrainConfig& c) {
  const std::string file = c.deepspeed_config.empty() ? std::string("the DeepSpeed config")
                                                      : fmt::format("'{}'", c.deepspeed_config);
  check_pipeline_settings(c, file);
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
  if (c.zero.offload_ratio < 0 || c.zero.offload_ratio > 1) {
    throw ConfigError(fmt::format(
        "offload ratio {} (--offload-ratio / offload_optimizer.ratio) is not valid: use a "
        "fraction in [0, 1] of the optimizer state to offload (1 = all of it, the default)",
        c.zero.offload_ratio));
  }
  const ParallelPlan plan = plan_of(c);
  if (plan.optimizer_offload == OffloadDevice::kNone &&
      (c.zero.offload_delayed_update || c.zero.offload_ratio != 1.0)) {
    throw ConfigError(
        "--offload-delayed-update / --offload-ratio (offload_optimizer.delayed_update / ratio) "
        "need the optimizer offloaded: use --strategy offload (or infinity), or set "
        "zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\"");
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

/// The stage-3 sizes (set by the DeepSpeed reader, or in code) must be usable.
void check_stage3(const ZeroConfig& z) {
  for (const Stage3Size& s : kStage3Sizes) {
    const int64_t v = z.*s.field;
    if (v < s.min) {
      throw ConfigError(
          fmt::format("zero_optimization.{} {} is not valid: use {}", s.key, v, s.expected));
    }
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
  const int64_t tb = c.train_batch_size;
  if (tb < 0) {
    throw ConfigError(fmt::format(
        "train_batch_size (--train-batch-size) {} is not valid: use a global batch >= 1, or 0 "
        "to derive it from the micro-batch, accumulation steps and world size",
        tb));
  }
  if ((c.micro_batch_set || tb == 0) && c.micro_batch_size < 1) {
    throw ConfigError(fmt::format(
        "train_micro_batch_size_per_gpu (--batch-size) {} is not valid: it must be >= 1",
        c.micro_batch_size));
  }
  if ((c.accumulation_set || tb == 0) && c.gradient_accumulation_steps < 1) {
    throw ConfigError(fmt::format(
        "gradient_accumulation_steps (--gradient-accumulation-steps) {} is not valid: it must "
        "be >= 1",
        c.gradient_accumulation_steps));
  }
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

// ---- names ----------------------------------------------------------------------------------

std::string to_string(StrategyKind s) {
  switch (s) {
    case StrategyKind::kDataParallel:
      return "dp";
    case StrategyKind::kZero1:
      return "zero1";
    case StrategyKind::kZero2:
      return "zero2";
    case StrategyKind::kZero3:
      return "zero3";
    case StrategyKind::kOffload:
      return "offload";
    case StrategyKind::kInfinity:
      return "infinity";
    case StrategyKind::kPipeline:
      return "pipeline";
  }
  return "unknown";
}

std::string to_string(LrSchedule s) {
  switch (s) {
    case LrSchedule::kConstant:
      return "constant";
    case LrSchedule::kLinear:
      return "linear";
    case LrSchedule::kCosine:
      return "cosine";
  }
  return "unknown";
}

std::string to_string(Precision p) {
  switch (p) {
    case Precision::kAuto:
      return "auto";
    case Precision::kFp32:
      return "fp32";
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
  }
  return "unknown";
}

StrategyKind parse_strategy(const std::string& name) {
  std::string key = lowercase(name);
  std::replace(key.begin(), key.end(), '-', '_');
  for (const auto& s : kStrategyNames) {
    if (key == s.name) return s.kind;
  }
  std::vector<std::string> names;
  for (const auto& s : kStrategyNames) names.emplace_back(s.name);
  std::string hint;
  if (auto best = closest_match(key, names)) hint = fmt::format(": did you mean '{}'?", *best);
  throw ConfigError(fmt::format("unknown strategy '{}'{} Valid strategies: {}", name,
                                hint.empty() ? "." : hint, kValidStrategies));
}

Precision parse_precision(const std::string& name) {
  for (Precision p : {Precision::kAuto, Precision::kFp32, Precision::kBf16, Precision::kFp16}) {
    if (lowercase(name) == to_string(p)) return p;
  }
  throw ConfigError(fmt::format("unknown precision '{}': use auto, fp32, bf16 or fp16", name));
}

std::string to_string(OptimizerKind k) { return k == OptimizerKind::kSGD ? "sgd" : "adamw"; }

OptimizerKind parse_optimizer(const std::string& name) {
  for (OptimizerKind k : {OptimizerKind::kAdamW, OptimizerKind::kSGD}) {
    if (lowercase(name) == to_string(k)) return k;
  }
  throw ConfigError(fmt::format("unknown optimizer '{}': use adamw or sgd", name));
}

LrSchedule parse_lr_schedule(const std::string& name) {
  for (LrSchedule s : {LrSchedule::kConstant, LrSchedule::kLinear, LrSchedule::kCosine}) {
    if (lowercase(name) == to_string(s)) return s;
  }
  throw ConfigError(
      fmt::format("unknown learning-rate schedule '{}': use constant, linear or cosine", name));
}

std::string to_string(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "unknown";
}

ParallelPlan plan_of(const TrainConfig& cfg) {
  const auto device = [](const std::string& d) {
    return d == "cpu"    ? OffloadDevice::kCpu
           : d == "nvme" ? OffloadDevice::kNvme
                         : OffloadDevice::kNone;
  };
  ParallelPlan plan;
  plan.zero_stage = zero_stage_of(cfg.strategy);
  // DeepSpeed runs offload at stage 1 too (zero_optimization.stage 1 + offload_optimizer).
  if (cfg.strategy == StrategyKind::kOffload && cfg.zero.stage == 1) plan.zero_stage = 1;
  plan.optimizer_offload = device(cfg.zero.offload_optimizer_device);
  plan.param_offload = device(cfg.zero.offload_param_device);
  // The presets: offload = the optimizer on the CPU; infinity = the optimizer on NVMe and the
  // parameters on the CPU, unless the config places them.
  const bool placed =
      plan.optimizer_offload != OffloadDevice::kNone || plan.param_offload != OffloadDevice::kNone;
  if (cfg.strategy == StrategyKind::kOffload && plan.optimizer_offload == OffloadDevice::kNone)
    plan.optimizer_offload = OffloadDevice::kCpu;
  if (cfg.strategy == StrategyKind::kInfinity && !placed) {
    plan.optimizer_offload = OffloadDevice::kNvme;
    plan.param_offload = OffloadDevice::kCpu;
  }
  plan.optimizer_offload_ratio =
      plan.optimizer_offload == OffloadDevice::kNone ? 1.0 : cfg.zero.offload_ratio;
  if (cfg.strategy == StrategyKind::kPipeline) {
    plan.zero_stage = cfg.zero.stage;  // across the data-parallel replicas
    plan.pipeline_stages = cfg.pipeline.stages;
  }
  return plan;
}

int zero_stage_of(StrategyKind s) {
  switch (s) {
    case StrategyKind::kDataParallel:
    case StrategyKind::kPipeline:
      return 0;
    case StrategyKind::kZero1:
      return 1;
    case StrategyKind::kZero2:
    case StrategyKind::kOffload:
      return 2;
    case StrategyKind::kZero3:
    case StrategyKind::kInfinity:
      return 3;
  }
  return 0;
}

StrategyKind strategy_for_zero(int stage, const std::string& offload_optimizer_device,
                               const std::string& offload_param_device) {
  ST_ASSERT(stage >= 0 && stage <= 3);
  const bool offload = offload_optimizer_device != "none" || offload_param_device != "none";
  switch (stage) {
    case 0:
      return StrategyKind::kDataParallel;
    case 1:
      return offload ? StrategyKind::kOffload : StrategyKind::kZero1;
    case 2:
      return offload ? StrategyKind::kOffload : StrategyKind::kZero2;
    default:
      return offload ? StrategyKind::kInfinity : StrategyKind::kZero3;
  }
}

// ---- DeepSpeed JSON -------------------------------------------------------------------------

void apply_deepspeed_config(const std::string& path, TrainConfig& cfg,
                            const ExplicitFlags& explicit_flags,
                            std::vector<std::string>& ignored_keys,
                            std::vector<std::string>& overridden) {
  const json root = parse_json_file(path);
  DeepSpeedReader(path, cfg, explicit_flags, ignored_keys, overridden).apply(root);
}

void apply_deepspeed_config(const std::string& path, TrainConfig& cfg,
                            const ExplicitFlags& explicit_flags,
                            std::vector<std::string>& ignored_keys) {
  std::vector<std::string> overridden;
  apply_deepspeed_config(path, cfg, explicit_flags, ignored_keys, overridden);
}

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

void validate(TrainConfig& cfg, int64_t model_context) {
  check_strategy(cfg);
  check_stage3(cfg.zero);
  cfg.plan = plan_of(cfg);

  if (cfg.device != "auto" && cfg.device != "cpu" && cfg.device != "cuda") {
    throw ConfigError(fmt::format("--device '{}' is not valid: use auto, cpu or cuda", cfg.device));
  }
  if (cfg.device == "cpu" && cfg.precision != Precision::kAuto &&
      cfg.precision != Precision::kFp32) {
    throw ConfigError(fmt::format(
        "--precision {} needs --device cuda; the CPU path computes in fp32 (use --precision fp32 "
        "or leave it unset)",
        to_string(cfg.precision)));
  }
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
  if (image_model) {
    if (cfg.strategy == StrategyKind::kPipeline) {
      throw ConfigError(fmt::format(
          "--strategy pipeline trains GPT-2 models only; image model '{}' trains with dp, zero1, "
          "zero2, zero3 or offload",
          cfg.model));
    }
    if (!cfg.dataset.empty() && cfg.dataset != "fashion-mnist" && cfg.dataset != "synthetic") {
      throw ConfigError(fmt::format(
          "--dataset '{}' is not an image data set: image model '{}' trains on --dataset "
          "fashion-mnist, --dataset synthetic (random images, for speed measurements) or an "
          "ImageFolder directory (--data-dir DIR)",
          cfg.dataset, cfg.model));
    }
    if (!cfg.train_file.empty() || !cfg.valid_file.empty()) {
      throw ConfigError(fmt::format(
          "--train-file / --valid-file are text for GPT-2; image model '{}' trains on --dataset "
          "fashion-mnist or an ImageFolder directory (--data-dir DIR)",
          cfg.model));
    }
    if (cfg.dataset.empty() && cfg.data_dir.empty()) {
      throw ConfigError(fmt::format(
          "no training data for image model '{}': give --dataset fashion-mnist, or --data-dir DIR "
          "(an ImageFolder root: one subfolder of images per class)",
          cfg.model));
    }
  } else {
    if (cfg.dataset == "fashion-mnist" || cfg.dataset == "synthetic") {
      throw ConfigError(
          fmt::format("--dataset {} holds images, but model '{}' is a language model: train an "
                      "image model on it ({})",
                      cfg.dataset, cfg.model.empty() ? "of the checkpoint" : cfg.model,
                      join(image_model_names(), ", ")));
    }
    if (cfg.image_size != 0 || cfg.label_smoothing != 0 || cfg.sync_batchnorm) {
      throw ConfigError(fmt::format(
          "--image-size, --label-smoothing and --sync-batchnorm are for image models ({}); model "
          "'{}' is a "
          "language model",
          join(image_model_names(), ", "), cfg.model.empty() ? "of the checkpoint" : cfg.model));
    }
  }
  if (cfg.max_length < 1) {
    throw ConfigError(
        fmt::format("--max-length {} is not valid: the sequence length must be at least 1 token",
                    cfg.max_length));
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

  if (cfg.epochs < 1) {
    throw ConfigError(
        fmt::format("--epochs {} is not valid: train for at least 1 epoch", cfg.epochs));
  }
  if (cfg.max_steps != -1 && cfg.max_steps < 1) {
    throw ConfigError(fmt::format(
        "--max-steps {} is not valid: use -1 (as many steps as --epochs allows) or a number of "
        "optimizer steps >= 1",
        cfg.max_steps));
  }
  if (cfg.num_samples != -1 && cfg.num_samples < 1) {
    throw ConfigError(fmt::format(
        "--num-samples {} is not valid: use -1 (all samples) or a count >= 1", cfg.num_samples));
  }
  if (cfg.eval_samples != -1 && cfg.eval_samples < 1) {
    throw ConfigError(fmt::format(
        "--eval-samples {} is not valid: use -1 (the whole validation split) or a count >= 1",
        cfg.eval_samples));
  }

  if (!std::isfinite(cfg.lr) || cfg.lr <= 0.0) {
    throw ConfigError(fmt::format(
        "--lr {} is not valid: the learning rate must be a finite number > 0 (e.g. 6e-4)", cfg.lr));
  }
  if (!(cfg.beta1 >= 0.0 && cfg.beta1 < 1.0)) {
    throw ConfigError(fmt::format(
        "--adam-beta1 {} is not valid: it must be in [0, 1) (typically 0.9)", cfg.beta1));
  }
  if (!(cfg.beta2 >= 0.0 && cfg.beta2 < 1.0)) {
    throw ConfigError(fmt::format(
        "--adam-beta2 {} is not valid: it must be in [0, 1) (typically 0.999 or 0.95)", cfg.beta2));
  }
  if (!std::isfinite(cfg.adam_eps) || cfg.adam_eps <= 0.0) {
    throw ConfigError(
        fmt::format("--adam-eps {} is not valid: it must be a finite number > 0 (typically 1e-8)",
                    cfg.adam_eps));
  }
  if (!std::isfinite(cfg.weight_decay) || cfg.weight_decay < 0.0) {
    throw ConfigError(fmt::format(
        "--weight-decay {} is not valid: it must be a finite number >= 0 (0 turns it off)",
        cfg.weight_decay));
  }
  if (!(cfg.momentum >= 0.0 && cfg.momentum < 1.0)) {
    throw ConfigError(fmt::format(
        "--momentum {} is not valid: it must be in [0, 1) (typically 0.9; 0 = plain SGD)",
        cfg.momentum));
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
  if (cfg.dropout != -1 && !(cfg.dropout >= 0.0 && cfg.dropout < 1.0)) {
    throw ConfigError(fmt::format(
        "--dropout {} is not valid: it must be a probability in [0, 1) (e.g. 0.1, GPT-2's), 0 to "
        "turn dropout off, or left unset to keep the model's own",
        cfg.dropout));
  }
  if (!std::isfinite(cfg.gradient_clipping) || cfg.gradient_clipping < 0.0) {
    throw ConfigError(fmt::format(
        "--grad-clip {} is not valid: it must be a finite number >= 0 (0 turns clipping off)",
        cfg.gradient_clipping));
  }
  if (cfg.warmup_steps < -1) {
    throw ConfigError(fmt::format(
        "--warmup-steps {} is not valid: use -1 (10% of the steps, at most 1000) or a number of "
        "steps >= 0",
        cfg.warmup_steps));
  }
  if (!(cfg.min_lr_ratio >= 0.0 && cfg.min_lr_ratio <= 1.0)) {
    throw ConfigError(fmt::format(
        "--min-lr-ratio {} is not valid: it must be in [0, 1] (final lr as a fraction of --lr)",
        cfg.min_lr_ratio));
  }
  if (!(cfg.warmup_min_ratio >= 0.0 && cfg.warmup_min_ratio <= 1.0)) {
    throw ConfigError(fmt::format(
        "warmup_min_ratio {} is not valid: it must be in [0, 1] (lr at the start of warmup as a "
        "fraction of --lr)",
        cfg.warmup_min_ratio));
  }

  const LossScaleConfig& ls = cfg.loss_scale;
  if (!std::isfinite(ls.loss_scale) || ls.loss_scale < 0.0) {
    throw ConfigError(fmt::format(
        "fp16.loss_scale {} is not valid: use 0 (dynamic) or a static scale > 0", ls.loss_scale));
  }
  if (ls.initial_scale_power < 0 || ls.initial_scale_power > 63) {
    throw ConfigError(fmt::format("fp16.initial_scale_power {} is not valid: it must be in [0, 63]",
                                  ls.initial_scale_power));
  }
  if (ls.loss_scale_window < 1 || ls.hysteresis < 1) {
    throw ConfigError(fmt::format(
        "fp16.loss_scale_window {} / fp16.hysteresis {} is not valid: both must be >= 1",
        ls.loss_scale_window, ls.hysteresis));
  }
  if (!std::isfinite(ls.min_loss_scale) || ls.min_loss_scale <= 0.0) {
    throw ConfigError(
        fmt::format("fp16.min_loss_scale {} is not valid: it must be > 0", ls.min_loss_scale));
  }

  if (!cfg.dataset.empty() && !cfg.train_file.empty()) {
    throw ConfigError(fmt::format(
        "--dataset '{}' and --train-file '{}' are both given: use one of them (a named data set, "
        "or your own text files)",
        cfg.dataset, cfg.train_file));
  }
  if (cfg.dataset.empty() && cfg.train_file.empty() && !image_model) {
    throw ConfigError(
        "no training data: give --dataset wikitext-2, or --train-file PATH (and optionally "
        "--valid-file PATH)");
  }
  if (!cfg.valid_file.empty() && cfg.train_file.empty()) {
    throw ConfigError(fmt::format(
        "--valid-file '{}' needs --train-file: the named data set '{}' has its own validation "
        "split; drop --valid-file, or use --train-file instead of --dataset",
        cfg.valid_file, cfg.dataset));
  }

  if (cfg.log_interval < 1) {
    throw ConfigError(fmt::format(
        "--log-interval {} is not valid: log every N >= 1 steps (DeepSpeed steps_per_print)",
        cfg.log_interval));
  }
  if (cfg.eval_interval < 0) {
    throw ConfigError(fmt::format(
        "--eval-interval {} is not valid: use 0 (at the end of each epoch) or N >= 1 steps",
        cfg.eval_interval));
  }
  if (cfg.save_interval < 0) {
    throw ConfigError(
        fmt::format("--save-interval {} is not valid: use 0 (only at the end) or N >= 1 steps",
                    cfg.save_interval));
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
  if (plan_of(cfg).zero_stage == 3 && largest_layer_numel > 0 && threshold > largest_layer_numel) {
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
