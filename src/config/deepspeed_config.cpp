// The DeepSpeed JSON config: its reader into TrainConfig (DeepSpeed's key names, aliases,
// "auto" values and precedence rules, after deepspeed/runtime/config.py), with every key either
// honoured, ignored with a warning, or rejected with the fix. The reader's class and helpers:
// config/deepspeed_reader.h; its optimizer and scheduler sections: config/deepspeed_optimizer.cpp.
#include <fmt/core.h>

#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/config.h"
#include "config/deepspeed_reader.h"
#include "core/error.h"
#include "core/file_input.h"
#include "core/json_input.h"
#include "core/strings.h"

namespace shardtrain {
namespace deepspeed_reader {

void DeepSpeedReader::apply(const json& root) {
  if (!root.is_object()) {
    fail(fmt::format("the top level is {}, expected a JSON object {{...}} of DeepSpeed keys",
                     json_type_name(root)));
  }
  check_keys(root, "", kTopHonoured, kTopIgnored);
  read_rows(root, "", top_level_knobs());  // the batch sizes and the single values
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
void DeepSpeedReader::read_precision(const json& root) {
  if (find(root, "bf16") != nullptr && find(root, "bfloat16") != nullptr) {
    fail("both \"bf16\" and \"bfloat16\" (its old name) are given: keep only \"bf16\"");
  }
  std::optional<bool> bf16, fp16;
  std::string bf16_key = find(root, "bf16") != nullptr ? "bf16" : "bfloat16";
  if (const json* bf = find_object(root, bf16_key.c_str(), "", "an object {\"enabled\": true}")) {
    check_keys(*bf, bf16_key, honoured_keys(fp16_knobs(), "bf16"),
               ignored_keys(fp16_knobs(), "bf16"));
    bf16 = get_bool(*bf, "enabled", bf16_key);
  }
  if (const json* fp = find_object(root, "fp16", "", "an object {\"enabled\": true, ...}")) {
    const std::string prefix = "fp16";
    check_rows(*fp, prefix, fp16_knobs());
    fp16 = get_bool(*fp, "enabled", prefix);
    read_rows(*fp, prefix, fp16_knobs());
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
void DeepSpeedReader::read_offload(const json& z, const std::string& key) {
  const std::string prefix = "zero_optimization." + key;
  const json* off = find_object(z, key.c_str(), "zero_optimization",
                                "an object {\"device\": \"none\" | \"cpu\" | \"nvme\", ...}");
  if (off == nullptr) return;
  // Keys of offload_optimizer alone: elsewhere an error naming where they belong.
  const KeyList own = honoured_keys(zero_knobs(), prefix);
  for (const std::string& k : honoured_keys(zero_knobs(), "zero_optimization.offload_optimizer")) {
    if (off->contains(k) && std::find(own.begin(), own.end(), k) == own.end()) {
      throw ConfigError(
          fmt::format("{}.{} in '{}': {} belongs to offload_optimizer, not {}; move it there",
                      prefix, k, file_, k, key));
    }
  }
  check_rows(*off, prefix, zero_knobs());
  read_rows(*off, prefix, zero_knobs());
}
void DeepSpeedReader::read_zero(const json& z) {
  ZeroConfig& zc = cfg_.zero;
  std::optional<int64_t> stage;
  if (z.is_boolean()) {
    stage = z.get<bool>() ? 1 : 0;  // deprecated form: true = stage 1
  } else if (!z.is_object()) {
    bad_value("zero_optimization", z, "an object {\"stage\": 0, ...}");
  } else {
    const std::string prefix = "zero_optimization";
    check_rows(z, prefix, zero_knobs());
    stage = get_int(z, "stage", prefix, 0, "a ZeRO stage 0, 1, 2 or 3");
    if (stage && *stage > 3)
      bad_value("zero_optimization.stage", z.at("stage"), "a ZeRO stage 0, 1, 2 or 3");
    read_rows(z, prefix, zero_knobs());
    // Deprecated spellings of offload_optimizer / offload_param {"device": "cpu"}.
    if (auto v = get_bool(z, "cpu_offload", prefix); v && *v) zc.offload_optimizer_device = "cpu";
    if (auto v = get_bool(z, "cpu_offload_param", prefix); v && *v) {
      zc.offload_param_device = "cpu";
    }
    read_offload(z, "offload_optimizer");
    read_offload(z, "offload_param");
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
void DeepSpeedReader::read_pipeline(const json& root) {
  const std::string prefix = "pipeline";
  const json* section = find(root, "pipeline");
  if (section == nullptr) return;
  const json& p = *section;
  const KnobTable& rows = pipeline_knobs();
  if (!p.is_object()) bad_value(prefix, p, "an object {\"stages\": 4, ...}");
  const std::size_t ignored_before = ignored_.size();
  check_rows(p, prefix, rows);
  check_values(p, prefix, rows);  // also when the section is ignored

  if (has(p, "stages") && is_auto(p.at("stages"))) {
    fail(
        "\"pipeline.stages\": \"auto\" is not supported: shardtrain does not choose the "
        "number of pipeline stages; give a number, e.g. \"stages\": 4 (ranks per pipeline; "
        "the world size must be a multiple of it)");
  }
  const auto stages =
      get_small_int(p, "stages", prefix, 1, knob_row(rows, "pipeline.stages").expected);
  std::optional<PipelineSchedule> schedule;
  if (auto name = get_string(p, "schedule", prefix, knob_row(rows, "pipeline.schedule").expected)) {
    try {
      schedule = parse_pipeline_schedule(*name);
    } catch (const ConfigError& e) {
      fail(fmt::format("\"pipeline.schedule\": {}", e.what()));
    }
  }
  const Knob& partition_row = knob_row(rows, "pipeline.partition_method");
  const std::optional<std::string> partition_key = given_spelling(p, partition_row);
  std::optional<std::string> partition;
  const std::string partition_path = path_of(prefix, partition_key.value_or(partition_row.key()));
  if (partition_key) {
    if (auto m = get_string(p, partition_key->c_str(), prefix, partition_row.expected)) {
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
  }

  // A pipeline section with stages > 1 selects the pipeline, as DeepSpeed's PipelineEngine
  // runs whenever the model is a PipelineModule.
  const bool selects = stages && *stages > 1;
  if (selects && cfg_.strategy != StrategyKind::kPipeline) {
    const std::string flag = knob_for(&TrainConfig::strategy_name).name();
    if (cfg_.strategy_source == flag) {
      fail(fmt::format(
          "\"pipeline.stages\": {0} asks for pipeline parallelism, but {1} {2} asks for strategy "
          "'{3}': use {1} pipeline (or drop {1}), or remove the \"pipeline\" section",
          *stages, flag, cfg_.strategy_name, to_string(cfg_.strategy)));
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
  if (partition) assign("partition_method", partition_path, true, pc.partition_method, *partition);
  read_rows(p, prefix, rows);  // virtual_stages, activation_checkpoint_interval
}
void DeepSpeedReader::read_activation_checkpointing(const json& ac) {
  const std::string prefix = "activation_checkpointing";
  if (!ac.is_object()) bad_value(prefix, ac, "an object {\"partition_activations\": false, ...}");
  const KnobTable& rows = activation_checkpointing_knobs();
  // Each option is listed as ignored (the warning names the ones on); any on turns it on.
  const KeyList options = honoured_keys(rows, prefix);
  check_keys(ac, prefix, {}, options);
  bool on = false;
  for (const std::string& key : options) {
    const json* v = find(ac, key.c_str());
    if (v == nullptr) continue;
    if (key == "number_checkpoints") {
      get_int(ac, "number_checkpoints", prefix, 0, knob_row(rows, path_of(prefix, key)).expected);
    } else {
      get_bool(ac, key.c_str(), prefix);
    }
    on = on || is_on(*v);
  }
  if (on) assign("activation_checkpointing", prefix, true, cfg_.activation_checkpointing, true);
}
void DeepSpeedReader::read_aio(const json& a) {
  const std::string prefix = "aio";
  if (!a.is_object()) bad_value(prefix, a, "an object {\"block_size\": 1048576, ...}");
  check_rows(a, prefix, aio_knobs());
  read_rows(a, prefix, aio_knobs());
}
/// A monitor section {"enabled", "output_path", "job_name"}: when enabled, `dir` is
/// output_path/job_name, as DeepSpeed's monitors make it (defaults "" and "DeepSpeedJobName",
/// relative to the working directory), unless `flag` (--tensorboard, --csv-monitor) was given.
void DeepSpeedReader::read_monitor(const json& m, const std::string& prefix, std::string_view flag,
                                   std::string& dir) {
  if (!m.is_object())
    bad_value(prefix, m, "an object {\"enabled\": true, \"output_path\": ..., \"job_name\": ...}");
  check_rows(m, prefix, monitor_knobs());
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
void DeepSpeedReader::read_flops_profiler(const json& f) {
  const std::string prefix = "flops_profiler";
  if (!f.is_object())
    bad_value(prefix, f, "an object {\"enabled\": true, \"profile_step\": 1, ...}");
  check_rows(f, prefix, monitor_knobs());
  FlopsProfilerConfig& p = cfg_.flops_profiler;
  const bool enabled = get_bool(f, "enabled", prefix).value_or(false);
  const auto step = get_int(f, "profile_step", prefix, 1,
                            knob_row(monitor_knobs(), "flops_profiler.profile_step").expected);
  if (enabled) {
    if (!is_explicit("profile_step")) p.enabled = true;
    assign("profile_step", path_of(prefix, "profile_step"), step.has_value(), p.profile_step,
           step.value_or(1));
  }
  read_rows(f, prefix, monitor_knobs());  // module_depth, top_modules, detailed, output_file
}

}  // namespace deepspeed_reader

namespace {

using nlohmann::json;

/// Parses the file, accepting comments (DeepSpeed reads configs with hjson) and rejecting
/// duplicate keys (as DeepSpeed does), nesting beyond 64 levels and numbers beyond a double.
json parse_json_file(const std::string& path) {
  const std::string what = fmt::format("DeepSpeed config '{}' (--deepspeed-config)", path);
  const std::string text = read_input_file_or_throw<ConfigError>(
      path, "DeepSpeed config (--deepspeed-config)", kMaxConfigFileBytes);
  JsonInputOptions options;
  options.allow_comments = true;
  options.reject_duplicate_keys = true;
  JsonInputResult r = parse_json_input(text, options);
  if (!r.error.empty()) {
    throw ConfigError(
        fmt::format("cannot parse {}: {}: fix the JSON there (comments are allowed, "
                    "trailing commas are not; DeepSpeed rejects duplicate keys)",
                    what, r.error));
  }
  return std::move(r.value);
}

}  // namespace

// ---- DeepSpeed JSON -------------------------------------------------------------------------

void apply_deepspeed_config(const std::string& path, TrainConfig& cfg,
                            const ExplicitFlags& explicit_flags,
                            std::vector<std::string>& ignored_keys,
                            std::vector<std::string>& overridden) {
  const json root = parse_json_file(path);
  deepspeed_reader::DeepSpeedReader(path, cfg, explicit_flags, ignored_keys, overridden)
      .apply(root);
}

void apply_deepspeed_config(const std::string& path, TrainConfig& cfg,
                            const ExplicitFlags& explicit_flags,
                            std::vector<std::string>& ignored_keys) {
  std::vector<std::string> overridden;
  apply_deepspeed_config(path, cfg, explicit_flags, ignored_keys, overridden);
}

}  // namespace shardtrain
