// Tests of examples/: the DeepSpeed configs load through the real config parser and give the
// strategy, offload, precision and batch they are documented to give (examples/README.md), and
// the launch scripts train as a user runs them (CPU ranks; Fashion-MNIST, skipped when it is not
// installed; two ranks need mpirun).
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "app/train_flags.h"
#include "comm/launch.h"
#include "config/config.h"
#include "core/process.h"
#include "core/strings.h"
#include "data/image_dataset.h"
#include "data/image_decode.h"
#include "test_support.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;
using Result = test_support::CommandResult;

const fs::path kExamples = fs::path(SHARDTRAIN_SOURCE_DIR) / "examples";

/// `shardtrain train ARGS` parsed and finalized as the train command does it.
TrainConfig finalize(std::vector<std::string> args, std::vector<std::string>& warnings) {
  TrainConfig cfg;
  CLI::App app{"shardtrain train"};
  add_train_flags(app, cfg);
  std::reverse(args.begin(), args.end());  // CLI11 parses a reversed vector
  app.parse(args);
  return finalize_train_config(app, cfg, 0, warnings);
}

std::string config_path(const std::string& strategy) {
  return (kExamples / ("ds_config_" + strategy + ".json")).string();
}

bool have_fashion_mnist() {
  try {
    find_fashion_mnist_dir();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool have_mpirun() { return !find_on_path("mpirun").empty(); }

/// Runs `command` in the source directory with stderr joined to stdout.
Result run_in_source(const std::string& command) {
  return test_support::run_command("cd '" + std::string(SHARDTRAIN_SOURCE_DIR) + "' && " + command +
                                   " 2>&1");
}

/// The records of metrics.jsonl that log a training step (loss and images/s).
std::vector<nlohmann::json> step_records(const fs::path& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss") && j.contains("images_per_s")) out.push_back(std::move(j));
  }
  return out;
}

struct Expected {
  std::string file;
  StrategyKind strategy;
  int stage;
  OffloadDevice optimizer, params;
};

// Each file gives its documented plan; every key is one the parser reads (an unknown key would
// throw), and the only one it ignores is pin_memory (shardtrain decides what it pins).
TEST(ExampleConfigs, LoadThroughTheParser) {
  const std::vector<Expected> cases = {
      {"ddp", StrategyKind::kDataParallel, 0, OffloadDevice::kNone, OffloadDevice::kNone},
      {"fsdp_stage2", StrategyKind::kOffload, 2, OffloadDevice::kCpu, OffloadDevice::kNone},
      {"fsdp_stage3", StrategyKind::kInfinity, 3, OffloadDevice::kCpu, OffloadDevice::kCpu},
  };
  for (const Expected& e : cases) {
    SCOPED_TRACE(e.file);
    std::vector<std::string> warnings;
    const TrainConfig cfg = finalize(
        {"--model", "cnn", "--dataset", "fashion-mnist", "--deepspeed-config", config_path(e.file)},
        warnings);
    EXPECT_EQ(cfg.strategy, e.strategy);
    EXPECT_EQ(cfg.strategy_source, "deepspeed");
    EXPECT_EQ(cfg.zero.stage, e.stage);
    EXPECT_EQ(cfg.plan.zero_stage, e.stage);
    EXPECT_EQ(cfg.plan.optimizer_offload, e.optimizer);
    EXPECT_EQ(cfg.plan.param_offload, e.params);
    EXPECT_EQ(cfg.precision, Precision::kBf16);
    EXPECT_EQ(cfg.micro_batch_size, 32);
    EXPECT_EQ(cfg.gradient_accumulation_steps, 1);
    EXPECT_DOUBLE_EQ(cfg.lr, 1e-3);
    EXPECT_DOUBLE_EQ(cfg.weight_decay, 0.01);
    EXPECT_DOUBLE_EQ(cfg.gradient_clipping, 1.0);
    EXPECT_EQ(cfg.warmup_steps, 100);
    EXPECT_EQ(cfg.log_interval, 50);
    EXPECT_EQ(cfg.max_steps, -1) << "no total_num_steps: --epochs decides the length";
    if (e.optimizer == OffloadDevice::kNone) {
      EXPECT_TRUE(warnings.empty()) << join(warnings, "\n");
    } else {
      ASSERT_EQ(warnings.size(), 1u) << join(warnings, "\n");
      EXPECT_NE(warnings[0].find("offload_optimizer.pin_memory"), std::string::npos) << warnings[0];
      EXPECT_EQ(warnings[0].find("batch"), std::string::npos) << warnings[0];
    }
  }
}

// What the scripts pass: --batch-size (the per-GPU micro-batch) over the file's
// train_micro_batch_size_per_gpu, said in a warning; on CPUs bf16 falls back to fp32.
TEST(ExampleConfigs, ScriptFlagsTakePrecedence) {
  std::vector<std::string> warnings;
  const TrainConfig cfg =
      finalize({"--model", "cnn", "--dataset", "fashion-mnist", "--batch-size", "8", "--epochs",
                "2", "--device", "cpu", "--deepspeed-config", config_path("fsdp_stage2")},
               warnings);
  EXPECT_EQ(cfg.micro_batch_size, 8);
  EXPECT_EQ(cfg.strategy, StrategyKind::kOffload);
  EXPECT_EQ(cfg.precision, Precision::kFp32);
  const std::string all = join(warnings, "\n");
  EXPECT_NE(all.find("--batch-size over train_micro_batch_size_per_gpu"), std::string::npos) << all;
  EXPECT_NE(all.find("which --device cpu cannot run"), std::string::npos) << all;
}

TEST(ExampleScripts, UsageOnWrongArgumentCount) {
  for (const std::string script :
       {"launch_distributed.sh cnn ddp 1 32", "launch_multi_node.sh cnn ddp 1 1 32",
        "launch_distributed.sh"}) {
    const Result r = run_in_source("bash examples/" + script);
    EXPECT_EQ(r.status, 2) << script << "\n" << r.output;
    EXPECT_NE(r.output.find("usage: "), std::string::npos) << r.output;
  }
}

// launch_distributed.sh cnn ddp 1 32 1 on the CPU, three steps of 256 images.
TEST(ExampleScripts, LaunchDistributedDdpOneRank) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  const fs::path out = test_support::make_temp_dir("examples_ddp");
  const Result r = run_in_source(
      std::string("env DEVICE=cpu OMP_NUM_THREADS=1 SHARDTRAIN=") + SHARDTRAIN_BINARY +
      " OUTPUT_DIR=" + out.string() +
      " bash examples/launch_distributed.sh cnn ddp 1 32 1 --max-steps 3 --num-samples 256 "
      "--eval-samples 64 --log-interval 1 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  // The command it ran (set -x), with the ddp config.
  EXPECT_NE(r.output.find("launch --nproc-per-node 1 -- train --model cnn --batch-size 32"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("examples/ds_config_ddp.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("strategy dp | cpu"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("micro-batch 32 × accumulation 1 × 1 rank = global batch 32"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("done | 3 steps"), std::string::npos) << r.output;
  const auto steps = step_records(out / "metrics.jsonl");
  ASSERT_EQ(steps.size(), 3u) << r.output;
  EXPECT_EQ(steps.back()["step"], 3);
  EXPECT_EQ(steps.back()["images_seen"], 96);
  fs::remove_all(out);
}

// launch_distributed.sh cnn fsdp_stage2 2 16 1: two CPU ranks under mpirun, ZeRO-2 with the
// optimizer offloaded (the config's strategy).
TEST(ExampleScripts, LaunchDistributedFsdpStage2TwoRanks) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  if (!have_mpirun()) GTEST_SKIP() << "mpirun is not installed (CPU ranks need it)";
  const fs::path out = test_support::make_temp_dir("examples_fsdp2");
  const Result r =
      run_in_source(std::string("env DEVICE=cpu SHARDTRAIN=") + SHARDTRAIN_BINARY +
                    " OUTPUT_DIR=" + out.string() +
                    " bash examples/launch_distributed.sh cnn fsdp_stage2 2 16 1 --max-steps 3 "
                    "--num-samples 256 --eval-samples 64 --log-interval 1 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("examples/ds_config_fsdp_stage2.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("strategy offload | cpu"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("× 2 ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("micro-batch 16 × accumulation 1 × 2 ranks = global batch 32"),
            std::string::npos)
      << r.output;
  const auto steps = step_records(out / "metrics.jsonl");
  ASSERT_EQ(steps.size(), 3u) << r.output;
  EXPECT_EQ(steps.back()["images_seen"], 96);
  fs::remove_all(out);
}

// launch_distributed.sh cnn fsdp_stage3 1 32 1: ZeRO-3 with the parameters and the optimizer
// offloaded to the host (the config's strategy, infinity).
TEST(ExampleScripts, LaunchDistributedFsdpStage3OneRank) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  const fs::path out = test_support::make_temp_dir("examples_fsdp3");
  const Result r =
      run_in_source(std::string("env DEVICE=cpu OMP_NUM_THREADS=1 SHARDTRAIN=") +
                    SHARDTRAIN_BINARY + " OUTPUT_DIR=" + out.string() +
                    " bash examples/launch_distributed.sh cnn fsdp_stage3 1 32 1 --max-steps 3 "
                    "--num-samples 256 --eval-samples 64 --log-interval 1 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("examples/ds_config_fsdp_stage3.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("strategy infinity | cpu"), std::string::npos) << r.output;
  EXPECT_EQ(step_records(out / "metrics.jsonl").size(), 3u) << r.output;
  fs::remove_all(out);
}

// DATA_DIR: an ImageFolder (two classes of 16×16 PNGs) instead of Fashion-MNIST.
TEST(ExampleScripts, LaunchDistributedOnAnImageFolder) {
  const fs::path dir = test_support::make_temp_dir("examples_folder");
  for (int c = 0; c < 2; ++c) {
    const fs::path cls = dir / "data" / (c == 0 ? "circle" : "square");
    fs::create_directories(cls);
    for (int i = 0; i < 10; ++i) {
      DecodedImage img{16, 16, 3, std::vector<uint8_t>(16 * 16 * 3)};
      for (size_t p = 0; p < img.pixels.size(); ++p)
        img.pixels[p] = static_cast<uint8_t>((p * (c + 1) + static_cast<size_t>(i) * 7) % 251);
      write_png(cls / (std::to_string(i) + ".png"), img);
    }
  }
  const Result r = run_in_source(
      std::string("env DEVICE=cpu OMP_NUM_THREADS=1 SHARDTRAIN=") + SHARDTRAIN_BINARY +
      " DATA_DIR=" + (dir / "data").string() + " OUTPUT_DIR=" + (dir / "out").string() +
      " bash examples/launch_distributed.sh cnn zero2 1 4 1 --max-steps 2 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--data-dir " + (dir / "data").string()), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--strategy zero2"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("--deepspeed-config"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("18 training images 3×16×16, 2 classes, 2 held-out images"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("done | 2 steps"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// launch_multi_node.sh checks the hostfile against its arguments, and runs a one-host hostfile
// (this machine, two CPU ranks through mpirun).
TEST(ExampleScripts, LaunchMultiNodeHostfile) {
  const fs::path dir = test_support::make_temp_dir("examples_multi");
  std::ofstream(dir / "hostfile") << "# one node\nlocalhost slots=2\n";
  const std::string env = std::string("env DEVICE=cpu SHARDTRAIN=") + SHARDTRAIN_BINARY +
                          " HOSTFILE=" + (dir / "hostfile").string() +
                          " OUTPUT_DIR=" + (dir / "out").string() + " ";
  Result r = run_in_source(env + "bash examples/launch_multi_node.sh cnn ddp 2 2 16 1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("lists 1 host(s) but NUM_NODES is 2"), std::string::npos) << r.output;
  r = run_in_source(env + "bash examples/launch_multi_node.sh cnn ddp 1 8 16 1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("write 'localhost slots=8'"), std::string::npos) << r.output;
  r = run_in_source(env + "HOSTFILE=" + (dir / "none").string() +
                    " bash examples/launch_multi_node.sh cnn ddp 1 2 16 1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("no hostfile"), std::string::npos) << r.output;
  r = run_in_source(env + "NODE_RANK=1 bash examples/launch_multi_node.sh cnn ddp 2 8 16 1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("needs MASTER_ADDR"), std::string::npos) << r.output;

  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  if (!have_mpirun()) GTEST_SKIP() << "mpirun is not installed (CPU ranks need it)";
  r = run_in_source(env +
                    "bash examples/launch_multi_node.sh cnn ddp 1 2 16 1 --max-steps 2 "
                    "--num-samples 128 --eval-samples 32 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--hostfile " + (dir / "hostfile").string()), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("× 2 ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("done | 2 steps"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// The SLURM script's srun line, through a stand-in srun that records its arguments.
TEST(ExampleScripts, SlurmImageScriptRunsSrun) {
  const fs::path dir = test_support::make_temp_dir("examples_slurm");
  {
    std::ofstream srun(dir / "srun");
    srun << "#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$(dirname \"$0\")/args\"\n";
  }
  fs::permissions(dir / "srun", fs::perms::owner_all);
  const Result r =
      run_in_source("env PATH=" + dir.string() +
                    ":$PATH SLURM_JOB_ID=7 SLURM_SUBMIT_DIR=$PWD MODEL=efficientnet_b0 "
                    "STRATEGY=fsdp_stage3 IMAGE_SIZE=64 bash "
                    "examples/slurm/train_image.sbatch");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream in(dir / "args");
  std::vector<std::string> args;
  for (std::string a; std::getline(in, a);) args.push_back(a);
  const std::string joined = join(args, " ");
  EXPECT_NE(joined.find("--kill-on-bad-exit=1 --cpu-bind=none shardtrain train --device cuda "
                        "--model efficientnet_b0 --batch-size 64 --epochs 10 --output-dir "
                        "runs/efficientnet_b0-fsdp_stage3-7 --dataset fashion-mnist "
                        "--image-size 64 --deepspeed-config"),
            std::string::npos)
      << joined;
  ASSERT_FALSE(args.empty());
  EXPECT_TRUE(fs::exists(args.back())) << args.back();
  EXPECT_EQ(fs::path(args.back()).filename(), "ds_config_fsdp_stage3.json");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace shardtrain
