// The placement planner (parallel/placement_planner.h): each candidate's memory is the estimator's
// row, its traffic the stated formulas; the chosen plan fits and crosses PCIe and the disk least
// among those that fit; nothing is chosen when nothing fits, and the table says why; the
// machine's rates come from bench/host_limits.cu's JSON.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "model/gpt2_config.h"
#include "parallel/memory_estimator.h"
#include "parallel/placement_planner.h"
#include "test_support.h"

namespace shardtrain {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

MemoryEstimateOptions xl_options() {
  MemoryEstimateOptions o;
  o.model = gpt2_preset("gpt2-xl");
  o.gpus = 1;
  o.micro_batch = 4;
  o.max_length = 512;
  return o;
}

const Placement& named(const PlacementPlan& p, const std::string& name) {
  for (const Placement& c : p.candidates)
    if (c.name == name) return c;
  throw std::runtime_error("no candidate " + name);
}

TEST(PlacementPlanner, EnoughGpuMemoryKeepsEverythingOnTheGpuWithDp) {
  const PlacementPlan p =
      plan_placement(xl_options(), {80 * kGiB, 0, 0}, MachineRates{}, 4.0 * 512);
  ASSERT_TRUE(p.chosen.has_value());
  const Placement& c = p.candidates[*p.chosen];
  EXPECT_EQ(c.name, "dp");  // no traffic and the lowest stage
  EXPECT_EQ(c.plan.zero_stage, 0);
  EXPECT_EQ(c.pcie_bytes + c.disk_bytes, 0.0);
  EXPECT_EQ(c.bound, "compute");
  // Every offloaded candidate needs host memory: none fits a host budget of 0.
  for (const Placement& x : p.candidates) {
    if (x.plan.optimizer_offload != OffloadDevice::kNone) {
      EXPECT_FALSE(x.fits) << x.name;
    }
  }
}

TEST(PlacementPlanner, ChosenPlanFitsAndHasTheShortestPredictedStep) {
  // gpt2-xl does not fit 20 GiB on the GPU; 64 GiB of host memory and 100 GiB of NVMe do.
  const PlacementBudget budget{20 * kGiB, 64 * kGiB, 100 * kGiB};
  const PlacementPlan p = plan_placement(xl_options(), budget, MachineRates{}, 4.0 * 512);
  EXPECT_FALSE(named(p, "dp").fits);
  ASSERT_TRUE(p.chosen.has_value());
  const Placement& c = p.candidates[*p.chosen];
  EXPECT_TRUE(c.fits);
  EXPECT_LE(c.gpu_bytes, budget.gpu_bytes);
  EXPECT_LE(c.host_bytes, budget.host_bytes);
  EXPECT_NE(c.plan.optimizer_offload, OffloadDevice::kNone);
  // The shortest predicted step; of the plans within 2% of it, the fewest bytes over PCIe and the
  // disk.
  for (const Placement& x : p.candidates) {
    if (!x.fits) continue;
    EXPECT_LE(c.step_s, x.step_s * 1.02) << x.name;
    if (std::abs(x.step_s - c.step_s) <= 0.02 * std::min(x.step_s, c.step_s)) {
      EXPECT_LE(c.pcie_bytes + c.disk_bytes, x.pcie_bytes + x.disk_bytes) << x.name;
    }
  }
  const std::string table = format_placement_plan(p, budget, MachineRates{});
  EXPECT_NE(table.find("* " + c.name), std::string::npos) << table;
  EXPECT_NE(table.find("does not fit: GPU"), std::string::npos) << table;
}

TEST(PlacementPlanner, CandidatesCarryTheEstimatorsBytesAndTheTrafficFormulas) {
  MemoryEstimateOptions o = xl_options();
  o.gpus = 4;
  const PlacementPlan p = plan_placement(o, {80 * kGiB, 512 * kGiB, 1e15}, MachineRates{}, 2048);
  MemoryEstimateOptions full = o;
  full.offload_ratio = 1.0;
  const MemoryEstimate e = estimate_memory(full);
  const double shard = static_cast<double>(e.parameters) / o.gpus;
  for (const StrategyEstimate& s : e.strategies) {
    if (!s.offloaded || s.name == "infinity") continue;
    const Placement& x = named(p, s.name + " r=1");
    EXPECT_DOUBLE_EQ(x.gpu_bytes, s.total()) << s.name;
    EXPECT_DOUBLE_EQ(x.host_bytes, s.host_pinned + s.host_pageable) << s.name;
    EXPECT_DOUBLE_EQ(x.nvme_bytes, s.nvme) << s.name;
  }
  // With 512 GiB of host memory the optimizer state of infinity fits there: no infinity row (it
  // would be zero3-offload's).
  for (const Placement& x : p.candidates) EXPECT_EQ(x.name.find("infinity"), std::string::npos);
  // offload: bf16 gradients down and parameters up, 2·2Ψ/N; AdamW moves 28 bytes per element.
  EXPECT_DOUBLE_EQ(named(p, "offload r=1").pcie_bytes, 4 * shard);
  EXPECT_DOUBLE_EQ(named(p, "offload r=1").host_traffic, 28 * shard);
  EXPECT_DOUBLE_EQ(named(p, "offload r=0.5").pcie_bytes, 2 * shard);
  // Parameters on the host cross for the forward's and the backward's gathers: 2·2Ψ/N more per
  // micro-batch (one here; eight below).
  EXPECT_DOUBLE_EQ(named(p, "zero3-offload r=1").pcie_bytes, 8 * shard);
  const PlacementPlan p8 =
      plan_placement(o, {80 * kGiB, 512 * kGiB, 1e15}, MachineRates{}, 8 * 2048);
  EXPECT_DOUBLE_EQ(named(p8, "zero3-offload r=1").pcie_bytes, 4 * shard + 8 * 4 * shard);
  EXPECT_DOUBLE_EQ(named(p8, "offload r=1").pcie_bytes, 4 * shard);
  // A host budget that holds the pinned parameters, the swap slots and a third of the state:
  // that third stays in memory (max_in_cpu), the rest is on NVMe, read and written every step.
  const StrategyEstimate& inf = *std::find_if(e.strategies.begin(), e.strategies.end(),
                                              [](const auto& s) { return s.name == "infinity"; });
  const double elements = std::round(inf.nvme / 12);
  const double host = inf.host_pinned + inf.host_pageable + 12 * std::floor(elements / 3);
  const PlacementPlan q = plan_placement(o, {80 * kGiB, host, 1e15}, MachineRates{}, 2048);
  const Placement& x = named(q, "infinity r=1");
  EXPECT_EQ(x.optimizer_max_in_cpu, static_cast<int64_t>(std::floor(elements / 3)));
  EXPECT_DOUBLE_EQ(x.host_bytes, host);
  EXPECT_DOUBLE_EQ(x.nvme_bytes, 12 * (elements - std::floor(elements / 3)));
  EXPECT_DOUBLE_EQ(x.disk_bytes, 2 * x.nvme_bytes);
  EXPECT_EQ(x.plan.optimizer_offload, OffloadDevice::kNvme);
  EXPECT_EQ(x.plan.param_offload, OffloadDevice::kCpu);
  EXPECT_EQ(x.bound, "disk");
  // SGD's state is 8 bytes per parameter: 20 bytes moved per element.
  o.optimizer = OptimizerKind::kSGD;
  const PlacementPlan sgd = plan_placement(o, {80 * kGiB, 512 * kGiB, 0}, MachineRates{}, 2048);
  EXPECT_DOUBLE_EQ(named(sgd, "offload r=1").host_traffic, 20 * shard);
}

// Besides the quarters, each offloaded plan is tried at the smallest ratio (a multiple of 0.05)
// whose GPU share of the optimizer state fits the GPU: the GPU is filled before the host.
TEST(PlacementPlanner, TriesTheRatioThatFillsTheGpu) {
  const MemoryEstimateOptions o = xl_options();
  MemoryEstimateOptions zero = o, one = o;
  zero.offload_ratio = 0;
  one.offload_ratio = 1;
  const auto gpu = [&](const MemoryEstimateOptions& x) {
    for (const StrategyEstimate& s : estimate_memory(x).strategies)
      if (s.name == "zero3-offload") return s.total();
    return 0.0;
  };
  const double g0 = gpu(zero), g1 = gpu(one);
  const double budget = g1 + 0.37 * (g0 - g1);  // r = 0.63 fills it exactly: 0.65 is tried
  const PlacementPlan p = plan_placement(o, {budget, 512 * kGiB, 0}, MachineRates{}, 2048);
  const Placement& x = named(p, "zero3-offload r=0.65");
  EXPECT_TRUE(x.fits) << x.over;
  EXPECT_LE(x.gpu_bytes, budget);
  EXPECT_GT(x.gpu_bytes, budget - 0.05 * (g0 - g1));
  EXPECT_THROW(named(p, "zero3-offload r=0.6"), std::runtime_error);
}

TEST(PlacementPlanner, NothingFitsSaysWhy) {
  const PlacementBudget budget{4 * kGiB, 4 * kGiB, 0};
  const PlacementPlan p = plan_placement(xl_options(), budget, MachineRates{}, 2048);
  EXPECT_FALSE(p.chosen.has_value());
  const std::string table = format_placement_plan(p, budget, MachineRates{});
  EXPECT_NE(table.find("nothing fits"), std::string::npos) << table;
  EXPECT_NE(table.find("does not fit: GPU"), std::string::npos) << table;
  EXPECT_NE(table.find("host"), std::string::npos) << table;
}

TEST(PlacementPlanner, RatesComeFromTheLimitsFile) {
  const auto dir = test_support::make_temp_dir("shardtrain_limits");
  const auto path = (dir / "limits.json").string();
  std::ofstream(path) << R"({"pcie": {"h2d_bytes_per_s": 2.0e10, "d2h_bytes_per_s": 1.0e10},
    "cpu_adamw": {"bf16_grads_bf16_params": {"bytes_per_s": 5.0e10}},
    "disk": {"read_GBps": 1.0, "write_GBps": 3.0}})";
  const MachineRates r = MachineRates::from_limits_file(path);
  EXPECT_DOUBLE_EQ(r.pcie_bytes_per_s, 1.0e10);  // the slower direction
  EXPECT_DOUBLE_EQ(r.host_bytes_per_s, 5.0e10);
  EXPECT_DOUBLE_EQ(r.disk_bytes_per_s, 1.5e9);  // 2 / (1/1 + 1/3) GB/s
  EXPECT_DOUBLE_EQ(r.gpu_flops, MachineRates{}.gpu_flops);
  std::ofstream(path) << R"({"pcie": {"available": false}})";  // no GPU: the defaults stay
  EXPECT_DOUBLE_EQ(MachineRates::from_limits_file(path).pcie_bytes_per_s,
                   MachineRates{}.pcie_bytes_per_s);
  std::ofstream(path) << "{not json";
  EXPECT_THROW(MachineRates::from_limits_file(path), ConfigError);
  EXPECT_THROW(MachineRates::from_limits_file((dir / "missing.json").string()), ConfigError);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace shardtrain
