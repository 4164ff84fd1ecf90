// make_strategy: the strategy of a plan (ParallelPlan), checked once against the rules a plan and
// its sections must keep (offload needs ZeRO stage ≥ 1, parameters offloaded only at stage 3,
// the rows' ranges of zero_optimization and aio) before anything is allocated.
#include <memory>

#include "config/knob.h"
#include "core/error.h"
#include "parallel/data_parallel.h"
#include "parallel/strategy.h"
#include "parallel/zero.h"
#include "parallel/zero3.h"

namespace shardtrain {

std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options, Backend& backend,
                                        Communicator& comm) {
  const ParallelPlan& plan = options.plan;
  check<ConfigError>(plan.optimizer_offload == OffloadDevice::kNone || plan.zero_stage >= 1,
                     "{} needs ZeRO stage 1, 2 or 3 (got stage {}): use {} offload (stage 2) or "
                     "set {}",
                     zero_knob(&ZeroConfig::offload_optimizer_device).path, plan.zero_stage,
                     knob_for(&TrainConfig::strategy_name).name(),
                     zero_knob(&ZeroConfig::stage).label());
  check<ConfigError>(plan.param_offload == OffloadDevice::kNone || plan.zero_stage == 3,
                     "{} needs ZeRO stage 3 (got stage {}): set {} 3, or offload only the "
                     "optimizer ({})",
                     zero_knob(&ZeroConfig::offload_param_device).path, plan.zero_stage,
                     zero_knob(&ZeroConfig::stage).label(),
                     zero_knob(&ZeroConfig::offload_optimizer_device).path);
  check<ConfigError>(plan.optimizer_offload_ratio >= 0 && plan.optimizer_offload_ratio <= 1,
                     "{} {} is not valid: use a fraction in [0, 1] of the optimizer state to "
                     "offload (1 = all)",
                     zero_knob(&ZeroConfig::offload_ratio).label(), plan.optimizer_offload_ratio);
  // The sections' own ranges, as validate() checks them for a run's config (their rows).
  TrainConfig sections;
  sections.zero = options.zero;
  sections.aio = options.aio;
  check_knob_ranges(sections, zero_knobs());
  check_knob_ranges(sections, aio_knobs());
  check<ConfigError>(
      options.optimizer.kind != OptimizerKind::kSGD ||
          plan.optimizer_offload != OffloadDevice::kNvme,
      "{0} sgd with the optimizer offloaded to NVMe (infinity) is not available: the swap file "
      "pages AdamW's master, m and v together; use {1} offload (CPU) or zero3 with SGD, or {0} "
      "adamw with NVMe",
      knob_for(&TrainConfig::optimizer).name(), knob_for(&TrainConfig::strategy_name).name());
  check<ConfigError>(plan.pipeline_stages == 1,
                     "a plan of {} pipeline stages goes to make_pipeline_strategy "
                     "(parallel/pipeline/pipeline_parallel.h), not make_strategy",
                     plan.pipeline_stages);
  switch (plan.zero_stage) {
    case 0:
      return make_data_parallel_strategy(options, backend, comm);
    case 1:
    case 2:
      return make_zero_strategy(options, offload_policy(options), backend, comm);
    case 3:
      return make_zero3_strategy(options, offload_policy(options), backend, comm);
    default:
      throw ConfigError(
          fmt::format("ZeRO stage {} does not exist: use 0, 1, 2 or 3", plan.zero_stage));
  }
}

}  // namespace shardtrain
