#include "train/automatic_placement.h"

#include <algorithm>
#include <vector>

#include "backend/host_transfer.h"
#include "comm/scalar_all_reduce.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

/// "--offload auto", as messages name the automatic placement.
std::string offload_auto() {
  return knob_for(&TrainConfig::placement, &PlacementConfig::automatic).name() + " auto";
}

}  // namespace

PlacementBudget rank_budget(const TrainConfig& cfg, const Backend& backend) {
  const double gpu = cfg.placement.gpu_memory_gib > 0
                         ? cfg.placement.gpu_memory_gib * kGiB
                         : static_cast<double>(backend.device_memory_bytes());
  const double host = cfg.placement.max_host_memory_gib > 0
                          ? cfg.placement.max_host_memory_gib * kGiB
                          : static_cast<double>(std::max<int64_t>(0, available_host_bytes()));
  return rank_budget(gpu, host, cfg.zero.nvme_path, cfg.ranks_per_node);
}

TrainConfig with_placement(const TrainConfig& cfg, const Placement& chosen, int64_t model_context) {
  TrainConfig c = cfg;
  const ParallelPlan& p = chosen.plan;
  c.zero.stage = p.zero_stage;
  c.zero.offload_optimizer_device = to_string(p.optimizer_offload);
  c.zero.offload_param_device = to_string(p.param_offload);
  c.zero.offload_ratio =
      p.optimizer_offload == OffloadDevice::kNone ? 1.0 : p.optimizer_offload_ratio;
  c.zero.offload_optimizer_max_in_cpu = chosen.optimizer_max_in_cpu;
  // Stage 3 gathers per micro-step: no forward group there.
  c.zero.offload_forward_group = p.zero_stage < 3 ? chosen.forward_group : 1;
  c.strategy = p.zero_stage == 0                             ? StrategyKind::kDataParallel
               : p.zero_stage == 1                           ? StrategyKind::kZero1
               : p.zero_stage == 3                           ? StrategyKind::kZero3
               : p.optimizer_offload != OffloadDevice::kNone ? StrategyKind::kOffload
                                                             : StrategyKind::kZero2;
  c.strategy_name = to_string(c.strategy);
  c.strategy_source = offload_auto();
  c.placement.automatic = false;  // placed: validate() checks it as any placed run
  c.placement.gpu_memory_gib = 0;
  c.placement.max_host_memory_gib = 0;
  validate(c, model_context);
  c.placement = cfg.placement;  // recorded with the run
  return c;
}

MemoryEstimateOptions placement_options(const TrainConfig& cfg, const GPT2Config& model) {
  MemoryEstimateOptions o;
  o.model = model;
  o.gpus = cfg.world_size;
  o.micro_batch = cfg.micro_batch_size;
  o.max_length = cfg.max_length;
  o.activation_checkpointing = cfg.activation_checkpointing;
  // The forward group of the offload rows: as given, else each plan chooses its own (0).
  o.forward_group = cfg.activation_checkpointing ? cfg.zero.offload_forward_group : 1;
  o.optimizer = cfg.optimizer;
  o.bf16_moments = cfg.zero.offload_moments_dtype == "bf16";
  o.speculative_update = cfg.zero.offload_speculative_update;
  if (cfg.zero.reduce_bucket_size_set) o.reduce_bucket_size = cfg.zero.reduce_bucket_size;
  o.zero3 = Zero3Limits{cfg.zero.stage3_prefetch_bucket_size, cfg.zero.stage3_max_live_parameters,
                        cfg.zero.stage3_max_reuse_distance};
  o.persistence_threshold = cfg.zero.stage3_param_persistence_threshold;
  return o;
}

TrainConfig with_automatic_placement(const TrainConfig& cfg, const GPT2Config& model,
                                     Backend& backend, Communicator& comm, Console& out) {
  const PlacementBudget mine = rank_budget(cfg, backend);
  // The smallest budgets of all ranks: every rank then plans the same.
  ScalarAllReduce reduce(backend, comm, 3);
  const double values[3] = {mine.gpu_bytes, mine.host_bytes, mine.nvme_bytes};
  const std::vector<double> all = reduce.gather(values);
  PlacementBudget budget = mine;
  for (size_t r = 0; r < all.size() / 3; ++r) {
    budget.gpu_bytes = std::min(budget.gpu_bytes, all[r * 3]);
    budget.host_bytes = std::min(budget.host_bytes, all[r * 3 + 1]);
    budget.nvme_bytes = std::min(budget.nvme_bytes, all[r * 3 + 2]);
  }
  MemoryEstimateOptions o = placement_options(cfg, model);
  const MachineRates rates;
  // Only the global batch given (DeepSpeed's train_batch_size without the micro-batch or the
  // accumulation): choose the split as well, the fastest predicted (plan_batch).
  TrainConfig placed = cfg;
  if (cfg.train_batch_size > 0 && !cfg.micro_batch_set && !cfg.accumulation_set &&
      cfg.strategy != StrategyKind::kPipeline) {
    const BatchPlan batch = plan_batch(o, budget, rates, cfg.train_batch_size);
    if (batch.chosen) {
      const BatchSplit& split = batch.splits[*batch.chosen];
      placed.micro_batch_size = o.micro_batch = split.micro_batch;
      placed.gradient_accumulation_steps = split.accumulation;
      placed.micro_batch_set = placed.accumulation_set = true;
      std::string tried;
      for (const BatchSplit& b : batch.splits)
        tried +=
            fmt::format("{}{} × {}: {}", tried.empty() ? "" : ", ", b.micro_batch, b.accumulation,
                        b.plan.chosen ? fmt::format("{:.0f} tokens/s", b.tokens_per_s)
                                      : std::string("does not fit"));
      out.line(
          "placement ({}): global batch {} sequences: micro-batch {} × accumulation {} per rank, "
          "the fastest predicted of {} ({})",
          offload_auto(), cfg.train_batch_size, split.micro_batch, split.accumulation,
          batch.splits.size(), tried);
    }  // none fits: plan the split validate() derived, for its message
  }
  const double tokens =  // per rank and step
      static_cast<double>(placed.micro_batch_size * placed.max_length *
                          placed.gradient_accumulation_steps);
  const PlacementPlan plan = plan_placement(o, budget, rates, tokens);
  if (!plan.chosen) {
    // The candidate that lacks the least memory, for the message.
    const Placement* closest = nullptr;
    double least = 0;
    for (const Placement& p : plan.candidates) {
      const double lack = std::max(0.0, p.gpu_bytes - budget.gpu_bytes) +
                          std::max(0.0, p.host_bytes - budget.host_bytes) +
                          std::max(0.0, p.nvme_bytes - budget.nvme_bytes);
      if (!closest || lack < least) {
        closest = &p;
        least = lack;
      }
    }
    ConfigError e(fmt::format(
        "{0}: no placement of {1} fits {2} of GPU memory, {3} of host memory and {4} of NVMe per "
        "rank (what is left after the margins `shardtrain estimate {10}` prints); the closest, "
        "{5}, does not fit: {6}. Use more GPUs, raise {10} / {11}, give {7} a disk with room, or "
        "add {8} or a smaller {9} (`shardtrain estimate {10}` lists every plan)",
        offload_auto(), model.name, human_bytes(budget.gpu_bytes), human_bytes(budget.host_bytes),
        human_bytes(budget.nvme_bytes), closest ? closest->name : "none",
        closest ? closest->over : "no candidates", zero_knob(&ZeroConfig::nvme_path).name(),
        knob_for(&TrainConfig::activation_checkpointing).name(),
        knob_for(&TrainConfig::micro_batch_size).name(),
        knob_for(&TrainConfig::placement, &PlacementConfig::gpu_memory_gib).name(),
        knob_for(&TrainConfig::placement, &PlacementConfig::max_host_memory_gib).name()));
    e.mark_same_on_every_rank();
    throw e;
  }
  const Placement& c = plan.candidates[*plan.chosen];
  out.line(
      "placement ({}): margins per rank of {} (GPU allocator slack), {} (host: the process's own "
      "memory and the OS) and {} (NVMe) set aside",
      offload_auto(), human_bytes(budget.gpu_margin), human_bytes(budget.host_margin),
      human_bytes(budget.nvme_margin));
  out.line(
      "placement ({}): {} of {} plans fit GPU {}, host {}, NVMe {} per rank; chose "
      "{}: GPU {}, host {}, NVMe {}, {} over PCIe and {} of disk per step, predicted step {:.3f} "
      "s (bound by {}): {:.0f} tokens/s per rank, MFU {:.1f}% (the step lines print the "
      "measured ones)",
      offload_auto(),
      std::count_if(plan.candidates.begin(), plan.candidates.end(),
                    [](const Placement& p) { return p.fits; }),
      plan.candidates.size(), human_bytes(budget.gpu_bytes), human_bytes(budget.host_bytes),
      human_bytes(budget.nvme_bytes), c.name, human_bytes(c.gpu_bytes), human_bytes(c.host_bytes),
      human_bytes(c.nvme_bytes), human_bytes(c.pcie_bytes), human_bytes(c.disk_bytes), c.step_s,
      c.bound, tokens / c.step_s,
      100.0 * model.flops_per_token(cfg.max_length) * tokens / c.step_s / (cfg.peak_tflops * 1e12));
  return with_placement(placed, c, model.n_positions);
}

}  // namespace shardtrain
