// --offload auto (train/automatic_placement.h): the flags and what validation refuses with them,
// the config each planned placement becomes (its plan is the planner's), a CPU rank choosing a
// plan that fits its budget and refusing, before allocating, a budget nothing fits; and a
// `shardtrain train --offload auto` run on CPU that trains with the plan it printed.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "config_test_support.h"
#include "core/error.h"
#include "model/gpt2_config.h"
#include "parallel/placement_planner.h"
#include "test_support.h"
#include "train/automatic_placement.h"

namespace shardtrain {
namespace {

constexpr double kMiB = 1024.0 * 1024;

class AutomaticPlacement : public ConfigTest {
 protected:
  /// --offload auto for gpt2-tiny on CPU with `gpu_gib` of GPU budget.
  TrainConfig auto_config(const std::string& gpu_gib) {
    return finalize({"--model", "gpt2-tiny", "--device", "cpu", "--batch-size", "4", "--max-length",
                     "64", "--offload", "auto", "--gpu-memory", gpu_gib, "--max-host-memory", "4"});
  }
};

TEST_F(AutomaticPlacement, FlagsFillTheConfigAndValidationRefusesWhatFixesThePlacement) {
  const TrainConfig c = auto_config("0.62");
  EXPECT_TRUE(c.placement.automatic);
  EXPECT_DOUBLE_EQ(c.placement.gpu_memory_gib, 0.62);
  EXPECT_DOUBLE_EQ(c.placement.max_host_memory_gib, 4);
  const auto refused = [&](std::vector<std::string> extra, const std::string& says) {
    std::vector<std::string> args = {"--model",   "gpt2-tiny", "--device",     "cpu",
                                     "--offload", "auto",      "--gpu-memory", "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    try {
      finalize(args);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  EXPECT_NE(config_error([&] {
              finalize({"--model", "gpt2-tiny", "--offload", "auto", "--strategy", "offload"});
            }).find("drop --offload auto, or the other setting"),
            std::string::npos);
  refused({"--strategy", "infinity"}, "drop --offload auto, or the other setting");
  refused({"--offload-ratio", "0.5"}, "chooses the offload ratio");
  EXPECT_THROW(finalize({"--model", "gpt2-tiny", "--device", "cpu", "--offload", "auto"}),
               ConfigError);  // CPU ranks need --gpu-memory
  EXPECT_THROW(finalize({"--model", "gpt2-tiny", "--gpu-memory", "40"}), ConfigError);
  EXPECT_ANY_THROW(finalize({"--model", "gpt2-tiny", "--offload", "cpu"}));  // only "auto"
}

TEST_F(AutomaticPlacement, EveryPlannedPlacementBecomesAConfigThatRunsItsPlan) {
  TrainConfig c = auto_config("80");
  c.zero.nvme_path = dir_.string();
  MemoryEstimateOptions o;
  o.model = gpt2_preset("gpt2-tiny");
  o.micro_batch = 4;
  o.max_length = 64;
  const PlacementPlan plan = plan_placement(o, {1e12, 1e12, 1e12}, MachineRates{}, 256);
  ASSERT_FALSE(plan.candidates.empty());
  for (const Placement& p : plan.candidates) {
    const TrainConfig placed = with_placement(c, p, 1024);
    EXPECT_EQ(placed.plan, p.plan) << p.name;
    EXPECT_EQ(placed.strategy_source, "--offload auto") << p.name;
  }
}

TEST_F(AutomaticPlacement, ACpuRankChoosesAPlanThatFitsOrRefusesNamingTheBytes) {
  auto backend = make_cpu_backend();
  auto comm = make_local_communicator();
  Console out(false);
  const GPT2Config model = gpt2_preset("gpt2-tiny");
  // 0.7 GiB less its 10% margin: too little for dp (~674 MiB with the CUDA context the estimate
  // assumes), enough with part of the optimizer offloaded.
  const TrainConfig placed =
      with_automatic_placement(auto_config("0.7"), model, *backend, *comm, out);
  EXPECT_NE(placed.plan.optimizer_offload, OffloadDevice::kNone);
  EXPECT_EQ(placed.plan, plan_of(placed));
  const PlacementBudget budget = rank_budget(auto_config("0.7"), *backend);
  // The budgets less their margins (placement_margins): 10% of 0.7 GiB, 25% of 4 GiB.
  EXPECT_DOUBLE_EQ(budget.gpu_bytes + budget.gpu_margin, 0.7 * 1024 * kMiB);
  EXPECT_DOUBLE_EQ(budget.gpu_margin, 0.07 * 1024 * kMiB);
  EXPECT_DOUBLE_EQ(budget.host_bytes, 3 * 1024 * kMiB);
  EXPECT_EQ(budget.nvme_bytes, 0);
  try {
    with_automatic_placement(auto_config("0.3"), model, *backend, *comm, out);
    ADD_FAILURE() << "0.3 GiB accepted";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("no placement of gpt2-tiny fits 276.5 MiB of GPU memory"), std::string::npos)
        << m;
    EXPECT_NE(m.find("does not fit: GPU"), std::string::npos) << m;
  }
}

TEST_F(AutomaticPlacement, OnlyTheGlobalBatchGivenChoosesTheFastestPredictedSplit) {
  auto backend = make_cpu_backend();
  auto comm = make_local_communicator();
  Console out(false);
  const GPT2Config model = gpt2_preset("gpt2-tiny");
  const auto config = [&](std::vector<std::string> batch) {
    std::vector<std::string> args = {"--model",
                                     "gpt2-tiny",
                                     "--device",
                                     "cpu",
                                     "--max-length",
                                     "64",
                                     "--offload",
                                     "auto",
                                     "--gpu-memory",
                                     "0.7",
                                     "--max-host-memory",
                                     "4",
                                     "--activation-checkpointing"};
    args.insert(args.end(), batch.begin(), batch.end());
    return finalize(args);
  };
  const TrainConfig given = config({"--train-batch-size", "64"});
  const TrainConfig placed = with_automatic_placement(given, model, *backend, *comm, out);
  // The planner's choice over micro-batches 1..64 with the same budget and rates.
  const BatchPlan batch = plan_batch(placement_options(given, model), rank_budget(given, *backend),
                                     MachineRates{}, given.train_batch_size);
  ASSERT_TRUE(batch.chosen);
  ASSERT_EQ(batch.splits.size(), 7u);  // 1, 2, 4, ... 64 all divide 64
  const BatchSplit& split = batch.splits[*batch.chosen];
  EXPECT_EQ(placed.micro_batch_size, split.micro_batch);
  EXPECT_EQ(placed.gradient_accumulation_steps, split.accumulation);
  EXPECT_EQ(placed.train_batch_size, 64);
  EXPECT_EQ(placed.plan, split.plan.candidates[*split.plan.chosen].plan);
  for (const BatchSplit& s : batch.splits)  // the chosen one is within 2% of the fastest
    EXPECT_GE(split.tokens_per_s, 0.98 * s.tokens_per_s) << s.micro_batch;
  // A micro-batch the user gave is kept: only the accumulation follows from the global batch.
  const TrainConfig kept = with_automatic_placement(
      config({"--train-batch-size", "64", "--batch-size", "2"}), model, *backend, *comm, out);
  EXPECT_EQ(kept.micro_batch_size, 2);
  EXPECT_EQ(kept.gradient_accumulation_steps, 32);
}

TEST_F(AutomaticPlacement, TrainOnCpuRunsThePlanItPrints) {
  const std::filesystem::path out = dir_ / "run";
  const auto r = test_support::run_command(
      std::string(SHARDTRAIN_BINARY) +
      " train --model gpt2-tiny --device cpu --batch-size 4 --max-length 64 --max-steps 2 "
      "--eval-samples 4 --no-save --offload auto --gpu-memory 0.7 --max-host-memory 4 "
      "--train-file " SHARDTRAIN_TEST_DATA_DIR
      "/wikitext-2/wiki.valid.tokens --valid-file " SHARDTRAIN_TEST_DATA_DIR
      "/wikitext-2/wiki.valid.tokens --output-dir " +
      out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("placement (--offload auto):"), std::string::npos) << r.output;
  // The banner runs the plan printed: an offloaded one (zero2 or zero3 with the optimizer on the
  // host).
  EXPECT_TRUE(r.output.find("| strategy offload |") != std::string::npos ||
              r.output.find("| strategy zero3 |") != std::string::npos)
      << r.output;
  std::ifstream in(out / "run.json");
  const nlohmann::json run = nlohmann::json::parse(in);
  EXPECT_TRUE(run["placement"]["automatic"].get<bool>());
  EXPECT_EQ(run["plan"]["optimizer_offload"], "cpu");
}

}  // namespace
}  // namespace shardtrain
