// The flags of `shardtrain train` and the merge with the DeepSpeed JSON config.
#include "config/train_flags.h"

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <utility>

#include "config/knob.h"
#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {

namespace {

bool contains(const ExplicitFlags& flags, std::string_view name) {
  return std::find(flags.begin(), flags.end(), name) != flags.end();
}

/// The flags of pipeline parallelism: its rows' and --trace.
std::vector<const Knob*> pipeline_flags() {
  std::vector<const Knob*> out;
  for (const Knob& k : pipeline_knobs())
    if (k.surfaces & kTrainFlag) out.push_back(&k);
  out.push_back(&knob_for(&TrainConfig::trace_dir));
  return out;
}

}  // namespace

void add_train_flags(CLI::App& cmd, TrainConfig& cfg) {
  // In --help's order: the model and where it runs; the batch and the DeepSpeed sections' flags
  // (--zero-stage, --offload-*, --grad-clip, --log-interval, ...); the length of training and
  // the data; the optimizer and its schedule; the output and checkpoints.
  for (const KnobTable* table :
       {&run_knobs(), &top_level_knobs(), &fp16_knobs(), &zero_knobs(), &aio_knobs(),
        &activation_checkpointing_knobs(), &pipeline_knobs(), &monitor_knobs(), &data_knobs(),
        &optimizer_knobs(), &scheduler_knobs(), &output_knobs()})
    add_knob_flags(cmd, cfg, *table, kTrainFlag);
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
  if (contains(flags, knob_for(&TrainConfig::micro_batch_size).explicit_name()))
    cfg.micro_batch_set = true;
  if (contains(flags, knob_for(&TrainConfig::gradient_accumulation_steps).explicit_name()))
    cfg.accumulation_set = true;
  if (contains(flags, knob_for(&TrainConfig::flops_profiler, &FlopsProfilerConfig::profile_step)
                          .explicit_name()))
    cfg.flops_profiler.enabled = true;

  // ---- strategy: --strategy and --zero-stage must agree ----
  const Knob& strategy = knob_for(&TrainConfig::strategy_name);
  const Knob& zero_stage = zero_knob(&ZeroConfig::stage);
  try {
    cfg.strategy = parse_strategy(cfg.strategy_name);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}: {}", strategy.name(), e.what()));
  }
  const bool strategy_flag = contains(flags, strategy.explicit_name());
  const bool stage_flag = contains(flags, zero_stage.explicit_name());
  if (strategy_flag) cfg.strategy_source = strategy.name();
  if (stage_flag) {
    const int stage = cfg.zero.stage;
    if (stage < 0 || stage > 3) {
      throw ConfigError(
          fmt::format("{} {} is not valid: use 0, 1, 2 or 3", zero_stage.name(), stage));
    }
    // A pipeline runs ZeRO across its replicas (validate() refuses stage 3 with a reason).
    const bool compatible =
        zero_stage_of(cfg.strategy) == stage || cfg.strategy == StrategyKind::kPipeline;
    if (strategy_flag && !compatible) {
      throw ConfigError(fmt::format(
          "{} {} and {} {} contradict each other: strategy '{}' runs at ZeRO stage {}; give only "
          "one of them",
          strategy.name(), cfg.strategy_name, zero_stage.name(), stage, to_string(cfg.strategy),
          zero_stage_of(cfg.strategy)));
    }
    if (!strategy_flag) {
      cfg.strategy = strategy_for_zero(stage);
      cfg.strategy_name = to_string(cfg.strategy);
      cfg.strategy_source = zero_stage.name();
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
          "{} {} contradicts {} {} in '{}': as in DeepSpeed, the config file decides, so the "
          "strategy is '{}' (drop {}, or change the stage in the file)",
          strategy.name(), before_name, zero_stage.path, cfg.zero.stage, cfg.deepspeed_config,
          to_string(cfg.strategy), strategy.name()));
    }
    if (!overridden.empty()) {
      warnings.push_back(fmt::format("command-line flags take precedence over '{}': {}",
                                     cfg.deepspeed_config, join(overridden, ", ")));
    }
    // One config file serves a CPU smoke test and the GPU run: its bf16/fp16 section applies on
    // GPUs; the CPU path computes in fp32. (An explicit --precision bf16 on CPU stays an error.)
    const bool half = cfg.precision == Precision::kBf16 || cfg.precision == Precision::kFp16;
    if (half && cfg.device == "cpu" &&
        !contains(flags, knob_for(&TrainConfig::precision).explicit_name())) {
      warnings.push_back(fmt::format(
          "'{}' enables {} ({}.enabled), which {} cpu cannot run: training in fp32 (the same file "
          "runs {} on GPUs)",
          cfg.deepspeed_config, to_string(cfg.precision), to_string(cfg.precision),
          knob_for(&TrainConfig::device).name(), to_string(cfg.precision)));
      cfg.precision = Precision::kFp32;
    }
  }

  if (cfg.strategy != StrategyKind::kPipeline) {
    const Knob& trace = knob_for(&TrainConfig::trace_dir);
    const Knob& offload = knob_for(&TrainConfig::placement, &PlacementConfig::automatic);
    std::vector<std::string> given;
    bool trace_given = false;
    for (const Knob* k : pipeline_flags()) {
      // --trace also draws an offloaded run's timeline.
      if (k == &trace && offload_asked(cfg)) continue;
      if (!contains(flags, k->explicit_name())) continue;
      given.push_back(k->name());
      trace_given = trace_given || k == &trace;
    }
    if (!given.empty()) {
      throw ConfigError(fmt::format(
          "{} {} for pipeline parallelism, but the strategy is '{}': add {} pipeline (or drop "
          "{}){}",
          join(given, ", "), given.size() == 1 ? "is a flag" : "are flags", to_string(cfg.strategy),
          strategy.name(), given.size() == 1 ? "it" : "them",
          trace_given
              ? fmt::format("; {} also draws the timeline of an offloaded run ({} offload "
                            "or infinity, {}, {} auto)",
                            trace.name(), strategy.name(),
                            zero_knob(&ZeroConfig::offload_optimizer_device).path, offload.name())
              : std::string()));
    }
  }

  validate(cfg, model_context);
  return cfg;
}

}  // namespace shardtrain
