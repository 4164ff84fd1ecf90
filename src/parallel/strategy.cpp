// The strategy factory: --strategy presets and DeepSpeed's zero_optimization resolved into a
// ParallelPlan, and the plan into the strategy that runs it.
#include "parallel/strategy.h"

#include "config/knob.h"
#include "core/error.h"
#include "parallel/data_parallel.h"
#include "parallel/zero.h"
#include "parallel/zero3.h"

namespace shardtrain {

std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options, Backend& backend,
                                        Communicator& comm) {
  const ParallelPlan& plan = options.plan;
  check<ConfigError>(plan.optimizer_offload == OffloadDevice::kNone || plan.zero_stage >= 1,
                     "{} needs ZeRO stage 1, 2 or 3 (got stage {}): use --strategy offload "
                     "(stage 2) or set {}",
                     zero_knob(&ZeroConfig::offload_optimizer_device).path, plan.zero_stage,
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
  check<ConfigError>(
      options.optimizer.kind != OptimizerKind::kSGD ||
          plan.optimizer_offload != OffloadDevice::kNvme,
      "{0} sgd with the optimizer offloaded to NVMe (infinity) is not available: the swap file "
      "pages AdamW's master, m and v together; use --strategy offload (CPU) or zero3 with SGD, or "
      "{0} adamw with NVMe",
      knob_for(&TrainConfig::optimizer).name());
  check<ConfigError>(plan.pipeline_stages == 1,
                     "a plan of {} pipeline stages goes to make_pipeline_strategy "
                     "(parallel/pipeline/pipeline_parallel.h), not make_strategy",
                     plan.pipeline_stages);
  switch (plan.zero_stage) {
    case 0:
      return make_data_parallel_strategy(options, backend, comm);
    case 1:
    case 2:
      return make_zero_strategy(options, backend, comm);
    case 3:
      return make_zero3_strategy(options, backend, comm);
    default:
      throw ConfigError(
          fmt::format("ZeRO stage {} does not exist: use 0, 1, 2 or 3", plan.zero_stage));
  }
}

void Strategy::setup_from(Model& model, const ParameterSource& source) {
  std::vector<float> init(static_cast<size_t>(model.layout().numel()));
  source(0, model.layout().numel(), init.data());
  setup(model, init);
}

void check_state_kind(OptimizerKind saved, OptimizerKind configured) {
  check<CheckpointError>(
      saved == configured,
      "the checkpoint holds {0} optimizer state but this run uses {1} {2}: its state cannot be "
      "resumed into another optimizer; resume with {1} {0}, or start from its weights only "
      "(--init-from, without the optimizer state)",
      to_string(saved), knob_for(&TrainConfig::optimizer).name(), to_string(configured));
}

std::vector<FlatRange> even_split(int64_t numel, int world, int rank) {
  const int64_t base = numel / world, extra = numel % world;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  const int64_t count = base + (rank < extra ? 1 : 0);
  if (count == 0) return {};
  return {FlatRange{begin, count}};
}

}  // namespace shardtrain
