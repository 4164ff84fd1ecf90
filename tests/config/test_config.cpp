// Tests of the run configuration: strategy names, the parallel plan, pipeline settings, validation
// and the `shardtrain train` flags (the DeepSpeed JSON sections: tests/config/test_deepspeed_config.cpp).
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "config/train_flags.h"
#include "config/config.h"
#include "config_test_support.h"
#include "core/error.h"
#include "core/strings.h"
#include "test_support.h"

namespace shardtrain {
namespace {

// ---- names ------------------------------------------------------------------------------------

TEST(StrategyNames, AliasesParse) {
  EXPECT_EQ(parse_strategy("dp"), StrategyKind::kDataParallel);
  EXPECT_EQ(parse_strategy("ddp"), StrategyKind::kDataParallel);
  EXPECT_EQ(parse_strategy("zero1"), StrategyKind::kZero1);
  EXPECT_EQ(parse_strategy("zero2"), StrategyKind::kZero2);
  EXPECT_EQ(parse_strategy("fsdp_stage2"), StrategyKind::kZero2);
  EXPECT_EQ(parse_strategy("zero3"), StrategyKind::kZero3);
  EXPECT_EQ(parse_strategy("fsdp_stage3"), StrategyKind::kZero3);
  EXPECT_EQ(parse_strategy("FSDP-Stage3"), StrategyKind::kZero3);
  EXPECT_EQ(parse_strategy("offload"), StrategyKind::kOffload);
  EXPECT_EQ(parse_strategy("infinity"), StrategyKind::kInfinity);
  EXPECT_EQ(parse_strategy("pipeline"), StrategyKind::kPipeline);
}

TEST(StrategyNames, RoundTripThroughToString) {
  for (StrategyKind s : {StrategyKind::kDataParallel, StrategyKind::kZero1, StrategyKind::kZero2,
                         StrategyKind::kZero3, StrategyKind::kOffload, StrategyKind::kInfinity,
                         StrategyKind::kPipeline}) {
    EXPECT_EQ(parse_strategy(to_string(s)), s);
  }
  EXPECT_EQ(to_string(LrSchedule::kCosine), "cosine");
  EXPECT_EQ(to_string(Precision::kBf16), "bf16");
  EXPECT_EQ(parse_precision("fp16"), Precision::kFp16);
  EXPECT_EQ(parse_lr_schedule("linear"), LrSchedule::kLinear);
}

TEST(StrategyNames, UnknownSuggestsClosestAndListsValid) {
  const std::string msg = config_error([] { parse_strategy("zer2"); });
  EXPECT_CONTAINS(msg, "'zer2'");
  EXPECT_CONTAINS(msg, "did you mean 'zero2'?");
  EXPECT_CONTAINS(msg, "fsdp_stage3");
  EXPECT_CONTAINS(msg, "pipeline");
  const std::string far = config_error([] { parse_strategy("megatron"); });
  EXPECT_EQ(far.find("did you mean"), std::string::npos) << far;
  EXPECT_CONTAINS(far, "dp (alias ddp)");
}

TEST(EditDistance, CountsEditsAndTranspositions) {
  EXPECT_EQ(edit_distance("", ""), 0u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("weight_decya", "weight_decay"), 1u);
  EXPECT_EQ(closest_match("gradient_cliping", {"gradient_clipping", "gradient_accumulation_steps"}),
            "gradient_clipping");
  EXPECT_EQ(closest_match("foo", {"gradient_clipping"}), std::nullopt);
}

TEST(ZeroStages, StrategyForZero) {
  EXPECT_EQ(strategy_for_zero(0), StrategyKind::kDataParallel);
  EXPECT_EQ(strategy_for_zero(2), StrategyKind::kZero2);
  EXPECT_EQ(strategy_for_zero(2, "cpu"), StrategyKind::kOffload);
  EXPECT_EQ(strategy_for_zero(3, "none", "nvme"), StrategyKind::kInfinity);
  EXPECT_EQ(zero_stage_of(StrategyKind::kOffload), 2);
  EXPECT_EQ(zero_stage_of(StrategyKind::kZero3), 3);
}

// ---- strategies and the parallel plan ----------------------------------------------------------

TEST_F(ConfigTest, StrategyFlagAliasesResolve) {
  EXPECT_EQ(finalize({"--strategy", "ddp"}).strategy, StrategyKind::kDataParallel);
  EXPECT_EQ(finalize({"--strategy", "fsdp_stage2"}).strategy, StrategyKind::kZero2);
  const TrainConfig cfg = finalize({"--strategy", "fsdp_stage3"});
  EXPECT_EQ(cfg.strategy, StrategyKind::kZero3);
  EXPECT_EQ(cfg.plan.zero_stage, 3);
}

TEST_F(ConfigTest, ZeroStagesOneTwoAndThreeAreAvailable) {
  TrainConfig cfg = finalize({"--strategy", "zero1"});
  EXPECT_EQ(cfg.strategy, StrategyKind::kZero1);
  EXPECT_EQ(cfg.zero.stage, 1);
  EXPECT_EQ(cfg.plan.zero_stage, 1);
  cfg = finalize({"--strategy", "zero2"});
  EXPECT_EQ(cfg.strategy, StrategyKind::kZero2);
  EXPECT_EQ(cfg.zero.stage, 2);
  EXPECT_EQ(cfg.plan.zero_stage, 2);
  EXPECT_EQ(finalize({"--zero-stage", "1"}).strategy, StrategyKind::kZero1);
  EXPECT_EQ(finalize({"--zero-stage", "2"}).strategy, StrategyKind::kZero2);
  const std::string path = write("zero2.json", R"({"zero_optimization": {"stage": 2}})");
  cfg = finalize({"--deepspeed-config", path});
  EXPECT_EQ(cfg.strategy, StrategyKind::kZero2);
  EXPECT_EQ(cfg.zero.stage, 2);
  // Stage 3: the zero3 preset of the plan, from --strategy, --zero-stage or the JSON.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--strategy", "zero3"},
        {"--zero-stage", "3"},
        {"--deepspeed-config", write("zero3.json", R"({"zero_optimization": {"stage": 3}})")}}) {
    cfg = finalize(args);
    EXPECT_EQ(cfg.strategy, StrategyKind::kZero3) << args[0];
    EXPECT_EQ(cfg.zero.stage, 3) << args[0];
    EXPECT_EQ(cfg.plan, (ParallelPlan{3, OffloadDevice::kNone, 1.0, OffloadDevice::kNone, 1}))
        << args[0];
  }
}

TEST_F(ConfigTest, OffloadPresetsAndFlags) {
  TrainConfig c = finalize({"--strategy", "offload"});
  EXPECT_EQ(c.plan, (ParallelPlan{2, OffloadDevice::kCpu, 1.0, OffloadDevice::kNone, 1}));
  c = finalize({"--strategy", "offload", "--offload-ratio", "0.25", "--offload-delayed-update"});
  EXPECT_EQ(c.plan.optimizer_offload_ratio, 0.25);
  EXPECT_TRUE(c.zero.offload_delayed_update);
  c = finalize({"--strategy", "infinity", "--nvme-path", "/tmp"});
  EXPECT_EQ(c.plan, (ParallelPlan{3, OffloadDevice::kNvme, 1.0, OffloadDevice::kCpu, 1}));
  EXPECT_CONTAINS(config_error([&] { finalize({"--strategy", "infinity"}); }), "--nvme-path DIR");
  EXPECT_CONTAINS(config_error([&] {
                    finalize({"--strategy", "zero2", "--offload-ratio", "0.5"});
                  }),
                  "need the optimizer offloaded");
  EXPECT_CONTAINS(config_error([&] {
                    finalize({"--strategy", "offload", "--offload-ratio", "1.5"});
                  }),
                  "offload ratio 1.5");
}

TEST_F(ConfigTest, ZeroStageFlagZeroIsDataParallel) {
  EXPECT_EQ(finalize({"--zero-stage", "0"}).strategy, StrategyKind::kDataParallel);
}

TEST_F(ConfigTest, StrategyAndZeroStageFlagsMustAgree) {
  const std::string msg = config_error([&] {
    finalize({"--strategy", "zero2", "--zero-stage", "1"});
  });
  EXPECT_CONTAINS(msg, "--strategy zero2 and --zero-stage 1 contradict");
}

TEST_F(ConfigTest, HierarchicalAllReduceIsForDataParallelismAndZero) {
  for (const char* s : {"dp", "zero1", "zero2", "zero3"})
    EXPECT_TRUE(finalize({"--strategy", s, "--hierarchical-all-reduce"}).hierarchical_all_reduce)
        << s;
  std::string msg = config_error([&] {
    finalize({"--strategy", "pipeline", "--hierarchical-all-reduce"});
  });
  EXPECT_CONTAINS(msg, "--hierarchical-all-reduce applies to the gradient reductions of");
  msg = config_error([&] {
    finalize(
        {"--strategy", "zero3", "--hierarchical-all-reduce", "--zero-hpz-partition-size", "2"});
  });
  EXPECT_CONTAINS(msg, "--hierarchical-all-reduce and zero_hpz_partition_size 2 both arrange");
}

// Without either flag the reduction is hierarchical exactly where it moves fewer bytes across
// nodes: several nodes of several ranks each, a strategy that reduces gradients over all ranks.
TEST_F(ConfigTest, HierarchicalReductionIsChosenForSeveralNodesOfSeveralRanks) {
  TrainConfig c = finalize({"--strategy", "dp"});
  const auto layout = [&](int world, int per_node) {
    c.world_size = world;
    c.ranks_per_node = per_node;
    return hierarchical_reduction(c);
  };
  EXPECT_TRUE(layout(4, 2));   // 2 nodes × 2
  EXPECT_TRUE(layout(16, 8));  // 2 nodes × 8
  EXPECT_FALSE(layout(4, 4));  // one node
  EXPECT_FALSE(layout(4, 1));  // one rank per node: the same bytes either way
  EXPECT_FALSE(layout(1, 1));
  for (StrategyKind k : {StrategyKind::kZero1, StrategyKind::kZero2, StrategyKind::kZero3}) {
    c.strategy = k;
    EXPECT_TRUE(layout(4, 2)) << to_string(k);
  }
  c.zero.hpz_partition_size = 2;  // hybrid sharding reduces around nodes its own way
  EXPECT_FALSE(layout(4, 2));
  c.zero.hpz_partition_size = 1;
  c.strategy = StrategyKind::kPipeline;
  EXPECT_FALSE(layout(4, 2));
  c.strategy = StrategyKind::kDataParallel;
  c.no_hierarchical_all_reduce = true;
  EXPECT_FALSE(layout(4, 2));
  c.no_hierarchical_all_reduce = false;
  c.hierarchical_all_reduce = true;
  EXPECT_TRUE(layout(4, 4));  // asked for: on, even where it changes nothing
  const std::string msg = config_error([&] {
    finalize({"--hierarchical-all-reduce", "--no-hierarchical-all-reduce"});
  });
  EXPECT_CONTAINS(msg, "--hierarchical-all-reduce and --no-hierarchical-all-reduce contradict");
}

TEST_F(ConfigTest, HybridShardingIsForZeroThree) {
  EXPECT_EQ(
      finalize({"--strategy", "zero3", "--zero-hpz-partition-size", "2"}).zero.hpz_partition_size,
      2);
  EXPECT_EQ(apply_json(R"({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})")
                .zero.hpz_partition_size,
            8);
  const std::string msg = config_error([&] {
    finalize({"--strategy", "zero2", "--zero-hpz-partition-size", "2"});
  });
  EXPECT_CONTAINS(msg, "it needs --strategy zero3");
}

TEST_F(ConfigTest, UnknownStrategyFlagFailsWhileParsing) {
  try {
    finalize({"--strategy", "zero4"});
    ADD_FAILURE() << "expected CLI::ValidationError";
  } catch (const CLI::ValidationError& e) {
    EXPECT_CONTAINS(e.what(), "--strategy");
    EXPECT_CONTAINS(e.what(), "did you mean");
  }
}

TEST_F(ConfigTest, JsonZeroStageWithOffloadSelectsThePlan) {
  const std::string path =
      write("zero3.json", R"({"zero_optimization": {"stage": 3, "cpu_offload": true}})");
  TrainConfig c = finalize({"--deepspeed-config", path});
  EXPECT_EQ(c.strategy, StrategyKind::kInfinity);
  EXPECT_EQ(c.plan, (ParallelPlan{3, OffloadDevice::kCpu, 1.0, OffloadDevice::kNone, 1}));
  // DeepSpeed offloads at stage 1 too; the ratio and the delayed update are read.
  const std::string s1 = write(
      "zero1.json",
      R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5,
          "delayed_update": true}}})");
  c = finalize({"--deepspeed-config", s1});
  EXPECT_EQ(c.plan, (ParallelPlan{1, OffloadDevice::kCpu, 0.5, OffloadDevice::kNone, 1}));
  EXPECT_TRUE(c.zero.offload_delayed_update);
}

// ---- pipeline parallelism ----------------------------------------------------------------------

TEST_F(ConfigTest, PipelineFlagsFillTheConfigAndThePlan) {
  TrainConfig c =
      finalize({"--strategy", "pipeline", "--pipeline-stages", "4", "--pipeline-schedule",
                "interleaved-1f1b", "--virtual-stages", "2", "--partition-method", "uniform",
                "--activation-checkpoint-interval", "2", "--trace", "tdir",
                "--gradient-accumulation-steps", "4", "--batch-size", "2"},
               1024, 8);
  EXPECT_EQ(c.strategy, StrategyKind::kPipeline);
  EXPECT_EQ(c.pipeline.stages, 4);
  EXPECT_EQ(c.pipeline.schedule, PipelineSchedule::kInterleaved);
  EXPECT_EQ(c.pipeline.virtual_stages, 2);
  EXPECT_EQ(c.pipeline.partition_method, "uniform");
  EXPECT_EQ(c.pipeline.activation_checkpoint_interval, 2);
  EXPECT_EQ(c.trace_dir, "tdir");
  EXPECT_EQ(c.plan, (ParallelPlan{0, OffloadDevice::kNone, 1.0, OffloadDevice::kNone, 4}));
  EXPECT_EQ(data_parallel_size(c), 2);
  EXPECT_EQ(c.train_batch_size, 2 * 4 * 2);  // micro × M × D, not × world size

  // Defaults: one stage, 1f1b, partition by parameters; the plan's stages follow the config.
  c = finalize({"--strategy", "pipeline"});
  EXPECT_EQ(c.pipeline, PipelineConfig{});
  EXPECT_EQ(c.pipeline.schedule, PipelineSchedule::k1F1B);
  EXPECT_EQ(c.pipeline.partition_method, "parameters");
  EXPECT_EQ(c.plan, (ParallelPlan{0, OffloadDevice::kNone, 1.0, OffloadDevice::kNone, 1}));
  // --activation-checkpointing checkpoints every block of a stage.
  c = finalize({"--strategy", "pipeline", "--activation-checkpointing"});
  EXPECT_EQ(c.pipeline.activation_checkpoint_interval, 1);
  c = finalize({"--strategy", "pipeline", "--activation-checkpointing",
                "--activation-checkpoint-interval", "3"});
  EXPECT_EQ(c.pipeline.activation_checkpoint_interval, 3);
  // Other strategies keep one stage in the plan.
  EXPECT_EQ(finalize({"--strategy", "zero2"}).plan.pipeline_stages, 1);
}

TEST_F(ConfigTest, PipelineFlagsNeedThePipelineStrategy) {
  std::string msg = config_error([&] { finalize({"--pipeline-stages", "2"}, 1024, 2); });
  EXPECT_CONTAINS(msg, "--pipeline-stages is a flag for pipeline parallelism");
  EXPECT_CONTAINS(msg, "the strategy is 'dp'");
  EXPECT_CONTAINS(msg, "add --strategy pipeline");
  msg = config_error([&] {
    finalize({"--strategy", "zero2", "--pipeline-schedule", "1f1b", "--trace", "t"});
  });
  EXPECT_CONTAINS(msg, "--pipeline-schedule, --trace are flags for pipeline parallelism");
  EXPECT_CONTAINS(msg, "the strategy is 'zero2': add --strategy pipeline");
  // --zero-stage selects a ZeRO strategy, not a pipeline.
  msg = config_error([&] { finalize({"--zero-stage", "1", "--virtual-stages", "2"}); });
  EXPECT_CONTAINS(msg, "--virtual-stages is a flag");
  EXPECT_CONTAINS(msg, "'zero1'");
  // Set in code: validate() names the values.
  TrainConfig cfg = valid_config();
  cfg.pipeline.stages = 2;
  cfg.pipeline.partition_method = "time";
  msg = config_error([&] { validate(cfg, 1024); });
  EXPECT_CONTAINS(msg, "--pipeline-stages 2, --partition-method time are settings of pipeline");
  EXPECT_CONTAINS(msg, "add --strategy pipeline");
}

TEST_F(ConfigTest, PipelineFlagValuesAreCheckedWhileParsing) {
  const auto parse_error = [&](const std::vector<std::string>& args) -> std::string {
    try {
      finalize(args);
    } catch (const CLI::ValidationError& e) {
      return e.what();
    }
    ADD_FAILURE() << "expected CLI::ValidationError for " << args[0];
    return "";
  };
  std::string msg = parse_error({"--strategy", "pipeline", "--pipeline-schedule", "1f1c"});
  EXPECT_CONTAINS(msg, "--pipeline-schedule");
  EXPECT_CONTAINS(msg, "did you mean '1f1b'?");
  EXPECT_CONTAINS(msg, "gpipe, 1f1b, interleaved-1f1b, zb-h1 or 2bw");
  msg = parse_error({"--strategy", "pipeline", "--partition-method", "parameter"});
  EXPECT_CONTAINS(msg, "unknown partition method 'parameter'");
  EXPECT_CONTAINS(msg, "did you mean 'parameters'?");
  EXPECT_CONTAINS(msg, "uniform");
  EXPECT_CONTAINS(msg, "time");
  EXPECT_CONTAINS(parse_error({"--strategy", "pipeline", "--pipeline-stages", "0"}),
                  "--pipeline-stages");
  EXPECT_CONTAINS(parse_error({"--strategy", "pipeline", "--virtual-stages", "0"}),
                  "--virtual-stages");
  EXPECT_CONTAINS(parse_error({"--strategy", "pipeline", "--activation-checkpoint-interval", "-1"}),
                  "--activation-checkpoint-interval");
}

TEST_F(ConfigTest, PipelineBatchIdentityCountsDataParallelReplicas) {
  // 8 ranks in pipelines of 4 stages: D = 2 replicas; M = 32 / (4 × 2) = 4 micro-batches.
  TrainConfig c = finalize({"--strategy", "pipeline", "--pipeline-stages", "4",
                            "--train-batch-size", "32", "--batch-size", "4"},
                           1024, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_EQ(data_parallel_size(c), 2);
  // Only train_batch_size: split over the replicas, not over the ranks.
  TrainConfig cfg = pipeline_config(8, 2);
  cfg.accumulation_set = false;
  cfg.gradient_accumulation_steps = 1;
  cfg.train_batch_size = 64;
  validate(cfg, 1024);
  EXPECT_EQ(cfg.micro_batch_size, 16);
  // A mismatch names D and how it comes about.
  const std::string msg = config_error([&] {
    finalize({"--strategy", "pipeline", "--pipeline-stages", "2", "--train-batch-size", "64",
              "--batch-size", "4", "--gradient-accumulation-steps", "2"},
             1024, 8);
  });
  EXPECT_CONTAINS(msg,
                  "train_batch_size 64 != train_micro_batch_size_per_gpu 4 × "
                  "gradient_accumulation_steps 2 × data-parallel degree 4 (world size 8 / 2 "
                  "pipeline stages) = 32");
  EXPECT_CONTAINS(msg, "gradient_accumulation_steps to 4");
}

TEST_F(ConfigTest, PipelineWorldSizeMustBeAMultipleOfTheStages) {
  const std::string msg = config_error([&] {
    finalize({"--strategy", "pipeline", "--pipeline-stages", "4"}, 1024, 6);
  });
  EXPECT_CONTAINS(msg,
                  "world size 6 is not divisible by --pipeline-stages 4: launch a multiple of 4 "
                  "ranks (stages × data-parallel replicas) or change the stages");
  EXPECT_NO_THROW(finalize({"--strategy", "pipeline", "--pipeline-stages", "3"}, 1024, 6));
}

TEST_F(ConfigTest, PipelineScheduleAndSettingErrors) {
  struct Case {
    std::function<void(TrainConfig&)> mutate;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {[](TrainConfig& c) { c.pipeline.stages = 0; },
       {"--pipeline-stages 0 is not valid", "1 or more"}},
      {[](TrainConfig& c) { c.pipeline.virtual_stages = 0; },
       {"--virtual-stages 0 is not valid", "1 or more"}},
      {[](TrainConfig& c) { c.pipeline.activation_checkpoint_interval = -1; },
       {"--activation-checkpoint-interval -1 is not valid", "0 (off)"}},
      {[](TrainConfig& c) { c.pipeline.partition_method = "tiem"; },
       {"unknown partition method 'tiem'", "did you mean 'time'?", "uniform", "parameters"}},
      {[](TrainConfig& c) { c.pipeline.virtual_stages = 2; },
       {"--virtual-stages 2 needs --pipeline-schedule interleaved-1f1b", "1f1b"}},
      {[](TrainConfig& c) { c.pipeline.schedule = PipelineSchedule::kInterleaved; },
       {"interleaved-1f1b needs --virtual-stages 2 or more (got 1)"}},
      {[](TrainConfig& c) {
         c.pipeline.schedule = PipelineSchedule::kInterleaved;
         c.pipeline.virtual_stages = 2;
         c.gradient_accumulation_steps = 6;
       },
       {"micro-batches per step (6) to be a multiple of the pipeline stages (4)",
        "use 4 or 8 micro-batches"}},
      {[](TrainConfig& c) {
         c.pipeline.schedule = PipelineSchedule::k2BW;
         c.gradient_accumulation_steps = 2;
       },
       {"2bw needs at least as many micro-batches per step (--gradient-accumulation-steps, now 2) "
        "as pipeline stages (4)",
        "arXiv 2006.09503", "--gradient-accumulation-steps 4 or more"}},
      {[](TrainConfig& c) {
         c.pipeline.schedule = PipelineSchedule::k2BW;
         c.precision = Precision::kFp16;
       },
       {"2bw does not run with fp16", "dynamic loss scaling skips", "--precision bf16 or fp32"}},
      {[](TrainConfig& c) {
         c.pipeline.schedule = PipelineSchedule::k2BW;
         c.zero.offload_delayed_update = true;
       },
       {"2bw and --offload-delayed-update", "drop --offload-delayed-update"}},
      {[](TrainConfig& c) { c.zero.offload_delayed_update = true; },
       {"--offload-delayed-update", "--strategy pipeline does not do"}},
      {[](TrainConfig& c) { c.world_size = 6; },
       {"world size 6 is not divisible by --pipeline-stages 4"}},
  };
  for (const Case& c : cases) {
    TrainConfig cfg = pipeline_config(8, 4);
    c.mutate(cfg);
    const std::string msg = config_error([&] { validate(cfg, 1024); });
    for (const auto& e : c.expected) EXPECT_CONTAINS(msg, e);
  }
  // The shapes that are fine.
  for (PipelineSchedule s : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                             PipelineSchedule::kZBH1, PipelineSchedule::k2BW}) {
    TrainConfig cfg = pipeline_config(8, 4);
    cfg.pipeline.schedule = s;
    EXPECT_NO_THROW(validate(cfg, 1024)) << to_string(s);
  }
  TrainConfig cfg = pipeline_config(8, 4, 8);
  cfg.pipeline.schedule = PipelineSchedule::kInterleaved;
  cfg.pipeline.virtual_stages = 3;
  EXPECT_NO_THROW(validate(cfg, 1024));
}

TEST_F(ConfigTest, PipelineRunsZeroStagesOneAndTwoAcrossReplicas) {
  for (const char* stage : {"0", "1", "2"}) {
    const TrainConfig c = finalize(
        {"--strategy", "pipeline", "--pipeline-stages", "2", "--zero-stage", stage}, 1024, 4);
    EXPECT_EQ(c.strategy, StrategyKind::kPipeline) << stage;
    EXPECT_EQ(c.plan.zero_stage, std::stoi(stage));
    EXPECT_EQ(c.plan.pipeline_stages, 2);
  }
  // zero_optimization.stage keeps the pipeline, whether --strategy or the JSON asks for it.
  TrainConfig c = finalize({"--strategy", "pipeline", "--deepspeed-config",
                            write("z2.json", R"({"zero_optimization": {"stage": 2}})")});
  EXPECT_EQ(c.strategy, StrategyKind::kPipeline);
  EXPECT_EQ(c.plan.zero_stage, 2);
  c = finalize(
      {"--deepspeed-config",
       write("pz1.json", R"({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}})")},
      1024, 4);
  EXPECT_EQ(c.strategy, StrategyKind::kPipeline);
  EXPECT_EQ(c.plan, (ParallelPlan{1, OffloadDevice::kNone, 1.0, OffloadDevice::kNone, 2}));
  EXPECT_TRUE(warnings_.empty()) << warnings_[0];
}

TEST_F(ConfigTest, PipelineRefusesZeroStageThreeAndOffload) {
  std::string msg = config_error([&] {
    finalize({"--strategy", "pipeline", "--zero-stage", "3"});
  });
  EXPECT_CONTAINS(msg, "ZeRO stage 3");
  EXPECT_CONTAINS(msg, "does not run with --strategy pipeline");
  EXPECT_CONTAINS(msg, "use ZeRO stage 0, 1 or 2 with the pipeline");
  msg = config_error([&] {
    finalize(
        {"--deepspeed-config",
         write("z3.json", R"({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}})")},
        1024, 2);
  });
  EXPECT_CONTAINS(msg, "ZeRO stage 3");
  EXPECT_CONTAINS(msg, "z3.json");
  msg = config_error([&] {
    finalize({"--strategy", "pipeline", "--deepspeed-config",
              write("off.json", R"({"zero_optimization": {"stage": 1,
                  "offload_optimizer": {"device": "cpu"}}})")});
  });
  EXPECT_CONTAINS(msg, "zero_optimization.offload_optimizer.device \"cpu\"");
  EXPECT_CONTAINS(msg, "does not run with --strategy pipeline");
  EXPECT_CONTAINS(msg, "set the device to \"none\"");
  msg = config_error([&] {
    finalize({"--strategy", "pipeline", "--deepspeed-config",
              write("offp.json", R"({"zero_optimization": {"offload_param": {"device": "nvme"}}})"),
              "--nvme-path", "/tmp"});
  });
  EXPECT_CONTAINS(msg, "zero_optimization.offload_param.device \"nvme\"");
  EXPECT_CONTAINS(config_error([&] {
                    finalize({"--strategy", "pipeline", "--offload-ratio", "0.5"});
                  }),
                  "which --strategy pipeline does not do");
}

TEST_F(ConfigTest, JsonPipelineSectionIsRead) {
  TrainConfig c = apply_json(R"({"pipeline": {"stages": 4, "partition": "Uniform",
      "activation_checkpoint_interval": 1, "schedule": "zb-h1", "virtual_stages": 1,
      "seed_layers": false}})");
  EXPECT_EQ(c.strategy, StrategyKind::kPipeline);
  EXPECT_EQ(c.strategy_name, "pipeline");
  EXPECT_EQ(c.strategy_source, "deepspeed");
  EXPECT_EQ(c.pipeline.stages, 4);
  EXPECT_EQ(c.pipeline.partition_method, "uniform");
  EXPECT_EQ(c.pipeline.activation_checkpoint_interval, 1);
  EXPECT_EQ(c.pipeline.schedule, PipelineSchedule::kZBH1);
  EXPECT_TRUE(ignored_.empty());
  c = apply_json(R"({"pipeline": {"stages": 2, "partition_method": "time",
      "schedule": "interleaved-1f1b", "virtual_stages": 2, "seed_layers": true}})");
  EXPECT_EQ(c.pipeline.partition_method, "time");
  EXPECT_EQ(c.pipeline.virtual_stages, 2);
  EXPECT_EQ(c.pipeline.schedule, PipelineSchedule::kInterleaved);
  EXPECT_EQ(ignored_, std::vector<std::string>{"pipeline.seed_layers"});

  // One stage and no --strategy pipeline: no pipeline; DeepSpeed, too, reads the section only
  // for a pipeline model. The section is listed as ignored.
  ignored_.clear();
  c = apply_json(R"({"pipeline": {"stages": 1, "partition": "uniform", "seed_layers": true}})");
  EXPECT_EQ(c.strategy, StrategyKind::kDataParallel);
  EXPECT_EQ(c.pipeline, PipelineConfig{});
  EXPECT_EQ(ignored_, std::vector<std::string>{"pipeline"});
  // With --strategy pipeline the same section applies.
  c = finalize({"--strategy", "pipeline", "--deepspeed-config",
                write("p1.json", R"({"pipeline": {"stages": 1, "partition": "uniform"}})")});
  EXPECT_EQ(c.pipeline.partition_method, "uniform");
}

TEST_F(ConfigTest, JsonPipelineSectionErrors) {
  const auto json_error = [&](const std::string& text) {
    return config_error([&] { apply_json(text); });
  };
  std::string msg = json_error(R"({"pipeline": {"stages": "auto"}})");
  EXPECT_CONTAINS(msg, "\"pipeline.stages\": \"auto\" is not supported");
  EXPECT_CONTAINS(msg, "give a number, e.g. \"stages\": 4");
  msg = json_error(R"({"pipeline": {"stages": 2, "partition_method": "type:transformer"}})");
  EXPECT_CONTAINS(msg, "\"pipeline.partition_method\": \"type:transformer\"");
  EXPECT_CONTAINS(msg, "not available in shardtrain");
  EXPECT_CONTAINS(msg, "\"parameters\"");
  EXPECT_CONTAINS(msg, "\"uniform\"");
  EXPECT_CONTAINS(msg, "\"time\"");
  msg = json_error(R"({"pipeline": {"stages": 2, "partition": "best"}})");
  EXPECT_CONTAINS(msg, "\"pipeline.partition\": unknown partition method 'best'");
  msg = json_error(R"({"pipeline": {"stages": 2, "schedule": "1f1c"}})");
  EXPECT_CONTAINS(msg, "\"pipeline.schedule\": unknown pipeline schedule '1f1c'");
  EXPECT_CONTAINS(msg, "did you mean '1f1b'?");
  msg = json_error(R"({"pipeline": {"stage": 2}})");
  EXPECT_CONTAINS(msg, "unknown key \"pipeline.stage\": did you mean 'pipeline.stages'?");
  msg = json_error(R"({"pipeline": {"stages": 2, "micro_batches": 4}})");
  EXPECT_CONTAINS(msg, "unknown key \"pipeline.micro_batches\"");
  EXPECT_CONTAINS(msg, "valid keys in \"pipeline\"");
  msg = json_error(R"({"stages": 2})");
  EXPECT_CONTAINS(msg, "\"stages\" belongs in \"pipeline\"");
  msg = json_error(R"({"pipeline": {"partition": "uniform", "partition_method": "uniform"}})");
  EXPECT_CONTAINS(msg, "are both given");
  EXPECT_CONTAINS(json_error(R"({"pipeline": {"stages": 0}})"), "\"pipeline.stages\": 0");
  EXPECT_CONTAINS(json_error(R"({"pipeline": {"virtual_stages": 0}})"),
                  "\"pipeline.virtual_stages\": 0");
  EXPECT_CONTAINS(json_error(R"({"pipeline": {"activation_checkpoint_interval": -1}})"),
                  "\"pipeline.activation_checkpoint_interval\": -1");
  EXPECT_CONTAINS(json_error(R"({"pipeline": 4})"), "\"pipeline\": 4 is not valid");
}

TEST_F(ConfigTest, JsonPipelineAgainstStrategyFlag) {
  const std::string path = write("p.json", R"({"pipeline": {"stages": 2}})");
  const std::string msg = config_error([&] {
    finalize({"--strategy", "zero2", "--deepspeed-config", path}, 1024, 2);
  });
  EXPECT_CONTAINS(msg,
                  "\"pipeline.stages\": 2 asks for pipeline parallelism, but --strategy zero2 asks "
                  "for strategy 'zero2'");
  EXPECT_CONTAINS(msg, "use --strategy pipeline");
  const TrainConfig c = finalize({"--strategy", "pipeline", "--deepspeed-config", path}, 1024, 2);
  EXPECT_EQ(c.plan.pipeline_stages, 2);
}

TEST_F(ConfigTest, PipelineFlagsBeatTheJson) {
  const std::string path = write("p.json", R"({"pipeline": {"stages": 4, "schedule": "gpipe",
      "partition_method": "uniform", "virtual_stages": 1, "activation_checkpoint_interval": 2}})");
  const TrainConfig c =
      finalize({"--deepspeed-config", path, "--pipeline-stages", "2", "--pipeline-schedule", "1f1b",
                "--activation-checkpoint-interval", "0"},
               1024, 4);
  EXPECT_EQ(c.strategy, StrategyKind::kPipeline);
  EXPECT_EQ(c.pipeline.stages, 2);
  EXPECT_EQ(c.pipeline.schedule, PipelineSchedule::k1F1B);
  EXPECT_EQ(c.pipeline.activation_checkpoint_interval, 0);
  EXPECT_EQ(c.pipeline.partition_method, "uniform");  // from the JSON
  EXPECT_EQ(c.plan.pipeline_stages, 2);
  ASSERT_EQ(warnings_.size(), 1u);
  EXPECT_CONTAINS(warnings_[0], "--pipeline-stages over pipeline.stages");
  EXPECT_CONTAINS(warnings_[0], "--pipeline-schedule over pipeline.schedule");
  EXPECT_CONTAINS(warnings_[0],
                  "--activation-checkpoint-interval over pipeline.activation_checkpoint_interval");
}

TEST_F(ConfigTest, PipelineModelChecks) {
  TrainConfig cfg = pipeline_config(4, 4);
  validate(cfg, 1024);
  EXPECT_NO_THROW(check_pipeline_model(cfg, 4));
  std::string msg = config_error([&] { check_pipeline_model(cfg, 2); });
  EXPECT_CONTAINS(msg,
                  "more stages than layers: --pipeline-stages 4 for model 'gpt2-tiny' with 2 "
                  "transformer blocks");
  EXPECT_CONTAINS(msg, "use at most 2 stages");

  cfg = pipeline_config(2, 2);
  cfg.pipeline.schedule = PipelineSchedule::kInterleaved;
  cfg.pipeline.virtual_stages = 2;
  validate(cfg, 1024);
  EXPECT_NO_THROW(check_pipeline_model(cfg, 8));
  // Chunks of unequal block counts (the partition method balances their cost).
  EXPECT_NO_THROW(check_pipeline_model(cfg, 6));
  msg = config_error([&] { check_pipeline_model(cfg, 3); });
  EXPECT_CONTAINS(msg,
                  "more stages than layers: --pipeline-stages 2 × --virtual-stages 2 = 4 "
                  "model chunks");
  EXPECT_CONTAINS(msg, "use at most 3 chunks");

  // Other strategies: nothing to check.
  TrainConfig dp = valid_config();
  validate(dp, 1024);
  EXPECT_NO_THROW(check_pipeline_model(dp, 1));
}

// ---- flags and precedence ------------------------------------------------------------------

TEST_F(ConfigTest, ExplicitFlagsBeatTheJson) {
  const std::string path = write("ds.json", R"({
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.2}},
    "gradient_clipping": 2.0,
    "steps_per_print": 50,
    "bf16": {"enabled": true}
  })");
  const TrainConfig cfg = finalize({"--deepspeed_config", path, "--lr", "0.01", "--batch-size", "4",
                                    "--precision", "fp32", "--log-interval", "5"});
  EXPECT_DOUBLE_EQ(cfg.lr, 0.01);
  EXPECT_DOUBLE_EQ(cfg.weight_decay, 0.2);  // not given on the command line: JSON
  EXPECT_EQ(cfg.micro_batch_size, 4);
  EXPECT_EQ(cfg.gradient_accumulation_steps, 2);
  EXPECT_EQ(cfg.train_batch_size, 8);
  EXPECT_DOUBLE_EQ(cfg.gradient_clipping, 2.0);
  EXPECT_EQ(cfg.log_interval, 5);
  EXPECT_EQ(cfg.precision, Precision::kFp32);
  ASSERT_EQ(warnings_.size(), 1u);
  EXPECT_CONTAINS(warnings_[0], "--lr over optimizer.params.lr");
  EXPECT_CONTAINS(warnings_[0], "--batch-size over train_micro_batch_size_per_gpu");
  EXPECT_CONTAINS(warnings_[0], "--precision over bf16.enabled");
}

TEST_F(ConfigTest, FlagsBindToFields) {
  const TrainConfig cfg = finalize({"--model",
                                    "gpt2-small",
                                    "--device",
                                    "cuda",
                                    "--precision",
                                    "bf16",
                                    "--epochs",
                                    "3",
                                    "--max-steps",
                                    "100",
                                    "--max-length",
                                    "256",
                                    "--num-samples",
                                    "1000",
                                    "--seed",
                                    "7",
                                    "--adam-beta1",
                                    "0.8",
                                    "--adam-beta2",
                                    "0.95",
                                    "--adam-eps",
                                    "1e-6",
                                    "--grad-clip",
                                    "0",
                                    "--warmup-steps",
                                    "10",
                                    "--lr-schedule",
                                    "linear",
                                    "--min-lr-ratio",
                                    "0",
                                    "--output-dir",
                                    "runs/a",
                                    "--eval-interval",
                                    "50",
                                    "--save-interval",
                                    "200",
                                    "--eval-samples",
                                    "64",
                                    "--activation-checkpointing",
                                    "--train-file",
                                    "a.txt",
                                    "--valid-file",
                                    "b.txt",
                                    "--data-dir",
                                    "/d",
                                    "--cache-dir",
                                    "/c",
                                    "--init-from",
                                    "w.safetensors"});
  EXPECT_EQ(cfg.model, "gpt2-small");
  EXPECT_EQ(cfg.device, "cuda");  // bf16 with --device cpu is an error
  EXPECT_EQ(cfg.precision, Precision::kBf16);
  EXPECT_EQ(cfg.epochs, 3);
  EXPECT_EQ(cfg.max_steps, 100);
  EXPECT_EQ(cfg.max_length, 256);
  EXPECT_EQ(cfg.num_samples, 1000);
  EXPECT_EQ(cfg.seed, 7u);
  EXPECT_DOUBLE_EQ(cfg.beta1, 0.8);
  EXPECT_DOUBLE_EQ(cfg.beta2, 0.95);
  EXPECT_DOUBLE_EQ(cfg.adam_eps, 1e-6);
  EXPECT_DOUBLE_EQ(cfg.gradient_clipping, 0.0);
  EXPECT_EQ(cfg.warmup_steps, 10);
  EXPECT_EQ(cfg.lr_schedule, LrSchedule::kLinear);
  EXPECT_DOUBLE_EQ(cfg.min_lr_ratio, 0.0);
  EXPECT_EQ(cfg.output_dir, "runs/a");
  EXPECT_EQ(cfg.eval_interval, 50);
  EXPECT_EQ(cfg.save_interval, 200);
  EXPECT_EQ(cfg.eval_samples, 64);
  EXPECT_TRUE(cfg.activation_checkpointing);
  EXPECT_EQ(cfg.train_file, "a.txt");
  EXPECT_EQ(cfg.valid_file, "b.txt");
  EXPECT_EQ(cfg.data_dir, "/d");
  EXPECT_EQ(cfg.cache_dir, "/c");
  EXPECT_EQ(cfg.init_from, "w.safetensors");
  EXPECT_EQ(cfg.train_batch_size, 8);  // derived: 8 × 1 × 1
  EXPECT_TRUE(warnings_.empty());
}

TEST_F(ConfigTest, OutOfRangeFlagsFailWhileParsing) {
  const std::vector<std::vector<std::string>> bad = {
      {"--batch-size", "0"},     {"--lr", "-1"},
      {"--lr", "abc"},           {"--adam-beta2", "1"},
      {"--min-lr-ratio", "1.5"}, {"--max-steps", "0"},
      {"--device", "gpu"},       {"--precision", "fp64"},
      {"--zero-stage", "4"},     {"--warmup-steps", "-2"},
      {"--log-interval", "0"},   {"--lr-schedule", "step"},
  };
  for (const auto& args : bad) {
    try {
      finalize(args);
      ADD_FAILURE() << "expected CLI::ValidationError for " << args[0] << " " << args[1];
    } catch (const CLI::ValidationError& e) {
      EXPECT_CONTAINS(e.what(), args[0]);
      EXPECT_CONTAINS(e.what(), args[1]);
    }
  }
}

TEST_F(ConfigTest, ExplicitFlagNames) {
  TrainConfig cfg;
  CLI::App app{"t"};
  add_train_flags(app, cfg);
  app.parse(std::vector<std::string>{"0.1", "--lr", "4", "--batch-size"});
  const ExplicitFlags flags = explicit_train_flags(app);
  EXPECT_EQ(flags.size(), 2u);
  EXPECT_NE(std::find(flags.begin(), flags.end(), "lr"), flags.end());
  EXPECT_NE(std::find(flags.begin(), flags.end(), "batch_size"), flags.end());
}

// ---- batch identity --------------------------------------------------------------------------

TEST_F(ConfigTest, BatchIdentityMismatchStatesTheNumbers) {
  const std::string path = write("ds.json", R"({"train_batch_size": 32,
      "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2})");
  const std::string msg = config_error([&] { finalize({"--deepspeed-config", path}); });
  EXPECT_CONTAINS(msg,
                  "train_batch_size 32 != train_micro_batch_size_per_gpu 8 × "
                  "gradient_accumulation_steps 2 × world size 1 = 16");
  EXPECT_CONTAINS(msg, "set train_batch_size to 16, or gradient_accumulation_steps to 4");
}

TEST_F(ConfigTest, BatchIdentityDerivesTheMissingSize) {
  // train_batch_size and micro-batch: accumulation derived.
  TrainConfig cfg = finalize({"--train-batch-size", "32", "--batch-size", "8"});
  EXPECT_EQ(cfg.gradient_accumulation_steps, 4);
  EXPECT_EQ(cfg.micro_batch_size, 8);

  // train_batch_size and accumulation: micro-batch derived (world size 2).
  cfg = valid_config();
  cfg.world_size = 2;
  cfg.train_batch_size = 32;
  cfg.gradient_accumulation_steps = 2;
  cfg.accumulation_set = true;
  validate(cfg, 1024);
  EXPECT_EQ(cfg.micro_batch_size, 8);

  // Only train_batch_size: no accumulation, split over the ranks (as DeepSpeed).
  cfg = valid_config();
  cfg.world_size = 4;
  cfg.train_batch_size = 64;
  validate(cfg, 1024);
  EXPECT_EQ(cfg.gradient_accumulation_steps, 1);
  EXPECT_EQ(cfg.micro_batch_size, 16);

  // Nothing: derived from the defaults.
  cfg = valid_config();
  cfg.world_size = 2;
  validate(cfg, 1024);
  EXPECT_EQ(cfg.train_batch_size, 16);

  // From the JSON: train_batch_size and gradient_accumulation_steps.
  const std::string path =
      write("ds.json", R"({"train_batch_size": 24, "gradient_accumulation_steps": 3})");
  cfg = finalize({"--deepspeed-config", path});
  EXPECT_EQ(cfg.micro_batch_size, 8);
  EXPECT_EQ(cfg.train_batch_size, 24);
}

TEST_F(ConfigTest, BatchIdentityIndivisible) {
  std::string msg = config_error([&] {
    finalize({"--train-batch-size", "30", "--batch-size", "8"});
  });
  EXPECT_CONTAINS(msg, "train_batch_size 30 is not a multiple of train_micro_batch_size_per_gpu 8");
  EXPECT_CONTAINS(msg, "e.g. 24");
  msg = config_error([&] {
    finalize({"--train-batch-size", "10", "--gradient-accumulation-steps", "4"});
  });
  EXPECT_CONTAINS(msg, "gradient_accumulation_steps 4 × world size 1 = 4");
}

// ---- validate() ------------------------------------------------------------------------------

TEST_F(ConfigTest, ValidateChecksEveryField) {
  struct Case {
    std::function<void(TrainConfig&)> mutate;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {[](TrainConfig& c) { c.max_length = 2048; },
       {"--max-length 2048", "model 'gpt2-tiny'", "n_positions = 1024", "--max-length 1024"}},
      {[](TrainConfig& c) { c.max_length = 0; }, {"--max-length 0"}},
      {[](TrainConfig& c) { c.micro_batch_size = 0; }, {"--batch-size", "0", ">= 1"}},
      {[](TrainConfig& c) { c.epochs = 0; }, {"--epochs 0"}},
      {[](TrainConfig& c) { c.max_steps = 0; }, {"--max-steps 0", "-1"}},
      {[](TrainConfig& c) { c.lr = 0.0; }, {"--lr 0", "> 0"}},
      {[](TrainConfig& c) { c.lr = std::nan(""); }, {"--lr nan"}},
      {[](TrainConfig& c) { c.beta1 = 1.0; }, {"--adam-beta1 1", "[0, 1)"}},
      {[](TrainConfig& c) { c.beta2 = -0.1; }, {"--adam-beta2 -0.1"}},
      {[](TrainConfig& c) { c.adam_eps = 0.0; }, {"--adam-eps 0"}},
      {[](TrainConfig& c) { c.weight_decay = -1.0; }, {"--weight-decay -1"}},
      {[](TrainConfig& c) { c.gradient_clipping = -1.0; }, {"--grad-clip -1"}},
      {[](TrainConfig& c) { c.dropout = 1.0; }, {"--dropout 1", "[0, 1)"}},
      {[](TrainConfig& c) { c.dropout = -0.5; }, {"--dropout -0.5", "[0, 1)"}},
      {[](TrainConfig& c) { c.warmup_steps = -2; }, {"--warmup-steps -2"}},
      {[](TrainConfig& c) { c.min_lr_ratio = 1.5; }, {"--min-lr-ratio 1.5", "[0, 1]"}},
      {[](TrainConfig& c) { c.num_samples = 0; }, {"--num-samples 0"}},
      {[](TrainConfig& c) { c.device = "tpu"; }, {"--device 'tpu'", "auto, cpu or cuda"}},
      {[](TrainConfig& c) { c.train_file = "a.txt"; },
       {"--dataset 'wikitext-2' and --train-file 'a.txt' are both given"}},
      {[](TrainConfig& c) { c.dataset.clear(); }, {"no training data", "--dataset wikitext-2"}},
      {[](TrainConfig& c) { c.valid_file = "v.txt"; }, {"--valid-file 'v.txt' needs --train-file"}},
      {[](TrainConfig& c) { c.log_interval = 0; }, {"--log-interval 0"}},
      {[](TrainConfig& c) { c.world_size = 0; }, {"world size 0"}},
      {[](TrainConfig& c) {
         c.strategy = StrategyKind::kPipeline;
         c.strategy_name = "pipeline";
         c.pipeline.stages = 4;
       },
       {"world size 1 is not divisible by --pipeline-stages 4"}},
      {[](TrainConfig& c) { c.zero.stage = 3; },
       {"ZeRO stage 3", "contradicts strategy 'dp'", "pick strategy 'zero3'"}},
      {[](TrainConfig& c) { c.zero.stage = 4; }, {"ZeRO stage 4", "does not exist"}},
      {[](TrainConfig& c) { c.zero.stage3_max_live_parameters = 0; },
       {"zero_optimization.stage3_max_live_parameters 0 is not valid", ">= 1"}},
      {[](TrainConfig& c) { c.zero.stage3_prefetch_bucket_size = -1; },
       {"zero_optimization.stage3_prefetch_bucket_size -1 is not valid", ">= 0"}},
      {[](TrainConfig& c) { c.zero.stage3_max_reuse_distance = -1; },
       {"zero_optimization.stage3_max_reuse_distance -1"}},
      {[](TrainConfig& c) { c.zero.stage3_param_persistence_threshold = -1; },
       {"zero_optimization.stage3_param_persistence_threshold -1"}},
      {[](TrainConfig& c) {
         c.device = "cpu";
         c.precision = Precision::kBf16;
       },
       {"--precision bf16 needs --device cuda"}},
      {[](TrainConfig& c) { c.zero.stage = 1; },
       {"ZeRO stage 1", "contradicts strategy 'dp'", "pick strategy 'zero1'"}},
      {[](TrainConfig& c) { c.zero.offload_param_device = "cpu"; },
       {"offload_param.device \"cpu\"", "needs ZeRO stage 3"}},
      {[](TrainConfig& c) { c.loss_scale.hysteresis = 0; }, {"fp16.hysteresis 0"}},
  };
  for (const Case& c : cases) {
    TrainConfig cfg = valid_config();
    c.mutate(cfg);
    const std::string msg = config_error([&] { validate(cfg, 1024); });
    for (const auto& e : c.expected) EXPECT_CONTAINS(msg, e);
  }
}

TEST_F(ConfigTest, ValidateKeepsWarmupDefault) {
  TrainConfig cfg = valid_config();
  validate(cfg, 1024);
  EXPECT_EQ(cfg.warmup_steps, -1);  // resolved by the trainer
  EXPECT_EQ(cfg.train_batch_size, 8);
  cfg = valid_config();
  cfg.max_length = 1024;  // exactly the context is fine
  validate(cfg, 1024);
}

TEST_F(ConfigTest, ReduceBucketSizeFromJsonIsMarkedExplicit) {
  // dp falls back to DDP-sized buckets unless the bucket size was given (parallel/data_parallel).
  EXPECT_FALSE(apply_json(R"({"train_micro_batch_size_per_gpu": 4})").zero.reduce_bucket_size_set);
  const TrainConfig c = apply_json(R"({"zero_optimization": {"reduce_bucket_size": 1000}})");
  EXPECT_TRUE(c.zero.reduce_bucket_size_set);
  EXPECT_EQ(c.zero.reduce_bucket_size, 1000);
}

}  // namespace
}  // namespace shardtrain
