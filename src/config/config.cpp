// Run configuration: the names of strategies, schedules, precisions and offload devices, and the
// parallel plan they make (the DeepSpeed JSON reader: config/deepspeed_config.cpp; validation:
// config/validate.cpp).
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

namespace shardtrain {

namespace {

using nlohmann::json;

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

}  // namespace shardtrain
