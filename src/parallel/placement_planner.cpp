#include "parallel/placement_planner.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "config/knob.h"
#include "core/error.h"
#include "core/file_input.h"
#include "core/json_input.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

/// The number at `path` (keys) in `j`, or nullopt.
std::optional<double> number_at(const nlohmann::json& j, std::initializer_list<const char*> path) {
  const nlohmann::json* at = &j;
  for (const char* key : path) {
    if (!at->is_object() || !at->contains(key)) return std::nullopt;
    at = &(*at)[key];
  }
  if (!at->is_number()) return std::nullopt;
  const double v = at->get<double>();
  return std::isfinite(v) && v > 0 ? std::optional<double>(v) : std::nullopt;
}

std::string ratio_name(const char* base, double r) { return fmt::format("{} r={:g}", base, r); }

}  // namespace

PlacementMargins placement_margins(double gpu_bytes, double host_bytes, double nvme_bytes) {
  constexpr double kMiB = 1024.0 * 1024, kGiB = 1024 * kMiB;
  PlacementMargins m;
  // Small budgets (a CPU rank planning for --gpu-memory 0.62) keep most of theirs.
  m.gpu = std::min(0.10 * gpu_bytes, 512 * kMiB + 0.02 * gpu_bytes);
  m.host = std::min(0.25 * host_bytes, 4 * kGiB + 0.06 * host_bytes);
  m.nvme = std::min(0.10 * nvme_bytes, 1 * kGiB + 0.02 * nvme_bytes);
  return m;
}

PlacementBudget rank_budget(double gpu_bytes, double node_host_bytes, const std::string& nvme_path,
                            int ranks_per_node) {
  const double per_node = std::max(1, ranks_per_node);
  double node_nvme = 0;
  if (!nvme_path.empty()) {
    std::error_code ec;
    const auto space = std::filesystem::space(nvme_path, ec);
    check<ConfigError>(!ec,
                       "{} {}: {} (its free space is the NVMe budget: give an existing "
                       "directory on the disk for the swap files)",
                       zero_knob(&ZeroConfig::nvme_path).name(), nvme_path, ec.message());
    node_nvme = static_cast<double>(space.available);
  }
  const PlacementMargins m = placement_margins(gpu_bytes, node_host_bytes, node_nvme);
  PlacementBudget b;
  b.gpu_bytes = gpu_bytes - m.gpu;
  b.host_bytes = (node_host_bytes - m.host) / per_node;
  b.nvme_bytes = (node_nvme - m.nvme) / per_node;
  b.gpu_margin = m.gpu;
  b.host_margin = m.host / per_node;
  b.nvme_margin = m.nvme / per_node;
  return b;
}

MachineRates MachineRates::from_limits_file(const std::string& path) {
  const std::string text = read_input_file_or_throw<ConfigError>(
      path, "the limits file (the limits.json `bash bench/run.sh limits` writes)",
      kMaxConfigFileBytes);
  JsonInputResult parsed = parse_json_input(text);
  if (!parsed.error.empty())
    throw ConfigError(fmt::format("the limits file {} is not valid JSON: {}", path, parsed.error));
  const nlohmann::json j = std::move(parsed.value);
  MachineRates r;
  const auto h2d = number_at(j, {"pcie", "h2d_bytes_per_s"});
  const auto d2h = number_at(j, {"pcie", "d2h_bytes_per_s"});
  if (h2d && d2h) r.pcie_bytes_per_s = std::min(*h2d, *d2h);
  if (const auto a = number_at(j, {"cpu_adamw", "bf16_grads_bf16_params", "bytes_per_s"}))
    r.host_bytes_per_s = *a;
  const auto rd = number_at(j, {"disk", "read_GBps"});
  const auto wr = number_at(j, {"disk", "write_GBps"});
  // Every swapped byte is read once and written once: 2 bytes moved in 1/read + 1/write.
  if (rd && wr) r.disk_bytes_per_s = 2e9 / (1 / *rd + 1 / *wr);
  return r;
}

PlacementPlan plan_placement(const MemoryEstimateOptions& options, const PlacementBudget& budget,
                             const MachineRates& rates, double tokens_per_step) {
  PlacementPlan out;
  const int K = host_state_bytes_per_parameter(options);  // what the CPU optimizer reads and writes
  const double compute_s =
      options.model.flops_per_token(options.max_length) * tokens_per_step / rates.gpu_flops;
  const double micro_batches = std::max(
      1.0,
      std::floor(tokens_per_step / static_cast<double>(options.micro_batch * options.max_length)));
  // One micro-batch's forward: 1/4 of its compute under activation checkpointing (backward 2,
  // its recompute 1), 1/3 without.
  const double forward_s =
      compute_s * (options.activation_checkpointing ? 0.25 : 1.0 / 3) / micro_batches;
  // Bytes the CPU optimizer moves to update a fraction r of psi_per_rank elements.
  const auto host_bytes = [&](double r, double psi_per_rank) {
    return (2.0 * K + 4) * r * psi_per_rank;
  };
  const auto cost = [&](Placement& p, double psi_per_rank, double r) {
    const bool optimizer_out = p.plan.optimizer_offload != OffloadDevice::kNone;
    const bool params_out = p.plan.param_offload != OffloadDevice::kNone;
    // Parameters on the host are gathered (copied up) for every micro-batch's forward and its
    // backward: 2,318 GiB per step for 19.5B at 32 micro-batches on one H200 (BENCHMARKS.md).
    p.pcie_bytes = (optimizer_out ? 2 * 2 * r * psi_per_rank : 0) +
                   (params_out ? 2 * 2 * psi_per_rank * micro_batches : 0);
    p.host_traffic = optimizer_out ? host_bytes(r, psi_per_rank) : 0;
    p.disk_bytes = 2 * p.nvme_bytes;  // every byte on NVMe is read and written each step
    p.compute_s = compute_s;
    // The host's update overlaps the next forward: that of the forward group (stages 1-2,
    // Model::forward_layer_major) or of one micro-batch. Speculated (stages 1-2, state in host
    // memory), it starts during backward instead, as each part's gradient is final: over the
    // whole backward when the group is the step (the backward is layer-major too), over the last
    // micro-batch's otherwise; the next forward then waits for the first layers, updated last.
    // The disk's part (NVMe state, not speculated) overlaps the forward only. What is left of
    // either adds to the compute.
    const bool stage12 = p.plan.zero_stage < 3 && options.activation_checkpointing;
    const double group =
        stage12 ? std::min(micro_batches, static_cast<double>(p.forward_group)) : 1.0;
    const double window = forward_s * group;
    const double backward_s = compute_s - forward_s * micro_batches;
    const double host_window =
        stage12 && options.speculative_update && !options.delayed_update
            ? std::max(window, group >= micro_batches ? backward_s : backward_s / micro_batches)
            : window;
    // The update pages its state from NVMe as it goes: the slower of the CPU and the disk.
    const double host_s = p.host_traffic / rates.host_bytes_per_s;
    const double disk_s = p.disk_bytes / rates.disk_bytes_per_s;
    const double left = std::max(host_s - host_window, disk_s - window);
    const std::tuple<double, const char*> terms[] = {
        {compute_s + std::max(0.0, left), left <= 0                                ? "compute"
                                          : disk_s - window > host_s - host_window ? "disk"
                                                                                   : "host"},
        {p.pcie_bytes / rates.pcie_bytes_per_s, "PCIe"}};
    const auto& slowest =
        *std::max_element(std::begin(terms), std::end(terms),
                          [](auto& a, auto& b) { return std::get<0>(a) < std::get<0>(b); });
    p.step_s = std::get<0>(slowest);
    p.bound = std::get<1>(slowest);
    std::string over;
    const auto check_budget = [&](const char* what, double used, double have) {
      if (used > have)
        over += fmt::format("{}{} {} > {}", over.empty() ? "" : "; ", what, human_bytes(used),
                            human_bytes(have));
    };
    check_budget("GPU", p.gpu_bytes, budget.gpu_bytes);
    check_budget("host", p.host_bytes, budget.host_bytes);
    check_budget("NVMe", p.nvme_bytes, budget.nvme_bytes);
    p.fits = over.empty();
    p.over = over;
  };

  // The forward group of the offload rows: explicit (options.forward_group ≥ 1), or chosen per
  // plan (0): the fewest micro-batches whose forward covers the host's update (all of them when the
  // update is speculated: the backward then overlaps it too), as many as the GPU budget holds
  // (each costs one more set of the residual stream).
  const bool choose_group = options.forward_group == 0 && options.activation_checkpointing;
  MemoryEstimateOptions base = options;
  base.forward_group = std::max<int64_t>(1, options.forward_group);
  // Ratios tried: quarters, and for each offloaded plan the smallest ratio (in steps of 0.05)
  // whose GPU share of the optimizer state fits the GPU budget (its GPU bytes fall linearly in r).
  std::vector<double> ratios = {0.25, 0.5, 0.75, 1.0};
  {
    MemoryEstimateOptions o0 = base, o1 = base;
    o0.offload_ratio = 0.0;
    o1.offload_ratio = 1.0;
    const MemoryEstimate e0 = estimate_memory(o0), e1 = estimate_memory(o1);
    for (size_t k = 0; k < e0.strategies.size() && k < e1.strategies.size(); ++k) {
      const double g0 = e0.strategies[k].total(), g1 = e1.strategies[k].total();
      if (!e1.strategies[k].offloaded || g0 <= g1 || g1 > budget.gpu_bytes) continue;
      const double r = std::ceil((g0 - budget.gpu_bytes) / (g0 - g1) * 20.0 - 1e-9) / 20.0;
      if (r > 0 && r < 1 && std::find(ratios.begin(), ratios.end(), r) == ratios.end())
        ratios.push_back(r);
    }
    std::sort(ratios.begin(), ratios.end());
  }
  bool on_gpu_done = false;
  for (const double r : ratios) {
    MemoryEstimateOptions o = base;
    o.offload_ratio = r;
    const MemoryEstimate e = estimate_memory(o);
    const double psi_per_rank = static_cast<double>(e.parameters) / options.gpus;
    for (const StrategyEstimate& s : e.strategies) {
      if (!s.available || s.name == "zero3-hybrid") continue;
      Placement p;
      p.gpu_bytes = s.total();
      p.host_bytes = s.host_pinned + s.host_pageable;
      p.nvme_bytes = s.nvme;
      if (!s.offloaded) {
        if (on_gpu_done) continue;  // the same for every r
        p.name = to_string(s.strategy);
        p.plan.zero_stage = s.strategy == StrategyKind::kDataParallel ? 0
                            : s.strategy == StrategyKind::kZero1      ? 1
                            : s.strategy == StrategyKind::kZero2      ? 2
                                                                      : 3;
      } else if (s.name == "offload") {
        p.name = ratio_name("offload", r);
        p.plan.zero_stage = 2;
        p.plan.optimizer_offload = OffloadDevice::kCpu;
        p.forward_group =
            std::min<int64_t>(base.forward_group, static_cast<int64_t>(micro_batches));
        if (choose_group) {
          const double update_s = host_bytes(r, psi_per_rank) / rates.host_bytes_per_s;
          const double per_group = e.activations.residual + e.activations.io;
          // Speculated, a group of the whole step also runs the backward layer-major, which the
          // update then overlaps too.
          const double needed = update_s <= forward_s ? 1.0
                                : options.speculative_update && !options.delayed_update
                                    ? micro_batches
                                    : std::ceil(update_s / std::max(forward_s, 1e-12));
          const double room = std::floor((budget.gpu_bytes - p.gpu_bytes) / per_group) + 1;
          p.forward_group =
              static_cast<int64_t>(std::clamp(std::min(needed, room), 1.0, micro_batches));
          p.gpu_bytes += static_cast<double>(p.forward_group - 1) * per_group;
        }
      } else if (s.name == "zero3-offload") {
        p.name = ratio_name("zero3-offload", r);
        p.plan.zero_stage = 3;
        p.plan.optimizer_offload = OffloadDevice::kCpu;
        p.plan.param_offload = OffloadDevice::kCpu;
      } else if (s.name == "infinity") {
        p.name = ratio_name("infinity", r);
        p.plan.zero_stage = 3;
        p.plan.optimizer_offload = OffloadDevice::kNvme;
        p.plan.param_offload = OffloadDevice::kCpu;
      } else {
        continue;
      }
      if (p.plan.optimizer_offload != OffloadDevice::kNone) p.plan.optimizer_offload_ratio = r;
      if (p.plan.optimizer_offload == OffloadDevice::kNvme) {
        // The optimizer state the host budget still holds stays there (max_in_cpu); only the
        // rest is paged from NVMe.
        const double room = std::max(0.0, budget.host_bytes - p.host_bytes);
        const double elements = std::round(p.nvme_bytes / K);
        const double in_cpu = std::min(std::floor(room / K), elements);
        if (in_cpu >= elements) continue;  // all in memory: the zero3-offload row
        p.optimizer_max_in_cpu = static_cast<int64_t>(in_cpu);
        p.host_bytes += K * in_cpu;
        p.nvme_bytes = K * (elements - in_cpu);
      }
      cost(p, psi_per_rank, r);
      out.candidates.push_back(std::move(p));
    }
    on_gpu_done = true;
  }
  // The shortest predicted step; within 2% of it, the fewest bytes over PCIe and the disk, then
  // the lowest stage.
  for (size_t i = 0; i < out.candidates.size(); ++i) {
    const Placement& p = out.candidates[i];
    if (!p.fits) continue;
    if (!out.chosen) {
      out.chosen = i;
      continue;
    }
    const Placement& b = out.candidates[*out.chosen];
    const double tolerance = 0.02 * std::min(p.step_s, b.step_s);
    const auto bytes = [](const Placement& x) {
      return std::make_tuple(x.pcie_bytes + x.disk_bytes, x.plan.zero_stage);
    };
    if (p.step_s < b.step_s - tolerance ||
        (std::abs(p.step_s - b.step_s) <= tolerance && bytes(p) < bytes(b)))
      out.chosen = i;
  }
  return out;
}

std::string format_placement_plan(const PlacementPlan& plan, const PlacementBudget& budget,
                                  const MachineRates& rates) {
  std::string s = fmt::format(
      "Placement within GPU {}, host {}, NVMe {} per rank — what is left after margins of {}, {} "
      "and {} for the allocator's slack, the process's own memory and the OS, and the file "
      "system (rates: PCIe {:.1f} GB/s, CPU optimizer "
      "{:.1f} GB/s, disk {:.2f} GB/s, GPU {:.0f} TFLOP/s effective):\n\n",
      human_bytes(budget.gpu_bytes), human_bytes(budget.host_bytes), human_bytes(budget.nvme_bytes),
      human_bytes(budget.gpu_margin), human_bytes(budget.host_margin),
      human_bytes(budget.nvme_margin), rates.pcie_bytes_per_s / 1e9, rates.host_bytes_per_s / 1e9,
      rates.disk_bytes_per_s / 1e9, rates.gpu_flops / 1e12);
  s += fmt::format("  {:<21} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}  {}\n", "plan", "GPU",
                   "host", "NVMe", "PCIe/step", "disk/step", "step (s)", "bound / fits");
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    const Placement& p = plan.candidates[i];
    s += fmt::format("{} {:<21} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10.3f}  {}\n",
                     plan.chosen && *plan.chosen == i ? "*" : " ", p.name, human_bytes(p.gpu_bytes),
                     human_bytes(p.host_bytes), human_bytes(p.nvme_bytes),
                     human_bytes(p.pcie_bytes), human_bytes(p.disk_bytes), p.step_s,
                     p.fits ? p.bound : "does not fit: " + p.over);
  }
  for (const Placement& p : plan.candidates)
    if (p.forward_group > 1)
      s += fmt::format(
          "  {}: forward group {} (micro-batches whose forward overlaps the host's update: {})\n",
          p.name, p.forward_group, zero_knob(&ZeroConfig::offload_forward_group).path);
  for (const Placement& p : plan.candidates)
    if (p.optimizer_max_in_cpu > 0)
      s += fmt::format("  {}: {} {} (elements whose optimizer state stays in host memory)\n",
                       p.name, zero_knob(&ZeroConfig::offload_optimizer_max_in_cpu).path,
                       with_commas(p.optimizer_max_in_cpu));
  if (plan.chosen) {
    const Placement& c = plan.candidates[*plan.chosen];
    s += fmt::format(
        "\nchosen (*): {} — the shortest predicted step (within 2%: the fewest bytes over PCIe and "
        "the disk) among the plans that "
        "fit; predicted step {:.3f} s, bound by {}\n",
        c.name, c.step_s, c.bound);
  } else {
    s += "\nnothing fits: try more GPUs, an NVMe path with room, activation checkpointing or a "
         "smaller micro-batch\n";
  }
  s += "predicted step: the compute plus what the CPU optimizer and its disk traffic do not hide "
       "behind the next forward (of the forward group), or the PCIe traffic when slower\n";
  return s;
}

BatchPlan plan_batch(const MemoryEstimateOptions& options, const PlacementBudget& budget,
                     const MachineRates& rates, int64_t global_batch) {
  BatchPlan out;
  const int64_t N = options.gpus, T = options.max_length;
  for (int64_t m = 1; m <= 64; m *= 2) {
    if (global_batch % (m * N) != 0) continue;
    BatchSplit split;
    split.micro_batch = m;
    split.accumulation = global_batch / (m * N);
    MemoryEstimateOptions o = options;
    o.micro_batch = m;
    split.plan = plan_placement(o, budget, rates, static_cast<double>(m * T * split.accumulation));
    if (split.plan.chosen) {
      split.tokens_per_s =
          static_cast<double>(global_batch * T) / split.plan.candidates[*split.plan.chosen].step_s;
      if (!out.chosen || split.tokens_per_s >= 0.98 * out.splits[*out.chosen].tokens_per_s)
        out.chosen = out.splits.size();
    }
    out.splits.push_back(std::move(split));
  }
  return out;
}

}  // namespace shardtrain
