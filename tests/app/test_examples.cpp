// Tests of examples/: the DeepSpeed configs load through the real config parser and give the
// strategy, offload, precision and batch they are documented to give (examples/README.md), and
// the launch scripts train as a user runs them (CPU ranks; Fashion-MNIST, skipped when it is not
// installed; two ranks need mpirun).
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/train_flags.h"
#include "comm/launch.h"
#include "config/config.h"
#include "core/process.h"
#include "core/strings.h"
#include "data/image_dataset.h"
#include "data/image_decode.h"
#include "optim/adamw.h"
#include "test_support.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;
using Result = test_support::CommandResult;

const fs::path kExamples = fs::path(SHARDTRAIN_SOURCE_DIR) / "examples";

/// `shardtrain train ARGS` parsed and finalized as the train command does it, on `world_size`
/// ranks.
TrainConfig finalize(std::vector<std::string> args, std::vector<std::string>& warnings,
                     int world_size = 2) {
  TrainConfig cfg;
  cfg.world_size = world_size;
  CLI::App app{"shardtrain train"};
  add_train_flags(app, cfg);
  std::reverse(args.begin(), args.end());  // CLI11 parses a reversed vector
  app.parse(args);
  return finalize_train_config(app, cfg, 0, warnings);
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

/// The records of metrics.jsonl that log a training step (loss and images/s or tokens/s).
std::vector<nlohmann::json> step_records(const fs::path& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss") && (j.contains("images_per_s") || j.contains("tokens_per_s")))
      out.push_back(std::move(j));
  }
  return out;
}

/// The file examples/common.sh maps STRATEGY to (strategy_config), or "" with its error (status
/// 2) in `error`.
std::string script_config(const std::string& strategy, std::string* error = nullptr) {
  const Result r = run_in_source("bash -c 'source examples/common.sh && strategy_config " +
                                 strategy + "'");
  if (r.status != 0) {
    if (error != nullptr) *error = r.output;
    return "";
  }
  std::string out = r.output;
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

/// GPT-3's peak learning rates (Brown et al. 2020, arXiv 2005.14165, Table 2.1), each with the
/// example model nearest to that size: what examples/common.sh's gpt3_lr must give.
struct Gpt3Size {
  std::string model;  // a preset or a config under the source directory
  double lr;
};
const std::vector<Gpt3Size> kGpt3Sizes = {
    {"gpt2", 6.0e-4},         // 125M (gpt2: 124M)
    {"gpt2-medium", 3.0e-4},  // 350M (355M)
    {"gpt2-large", 2.5e-4},   // 760M (774M)
    {"gpt2-xl", 2.0e-4},      // 1.3B (1.56B: nearer 1.3B than 2.7B on a log scale)
    {"examples/gpt2/model_configs/gpt-2.7b.json", 1.6e-4},
    {"examples/gpt2/model_configs/gpt-6.7b.json", 1.2e-4},
    {"examples/gpt2/model_configs/gpt-13b.json", 1.0e-4},
};

/// GPT-3's recipe besides the peak (arXiv 2005.14165 §2.3 and appendix B): AdamW with β = (0.9,
/// 0.95), weight decay 0.1, clipping 1.0, a linear warmup over the first 375M tokens, cosine decay
/// to 10% of the peak. The warmup in steps is those tokens at the config's batch on one node of 8
/// GPUs with GPT-2's 1024 tokens per sample (the scripts' default MAX_LENGTH).
void expect_gpt3_recipe(const TrainConfig& cfg, int pipeline_stages) {
  EXPECT_DOUBLE_EQ(cfg.beta1, 0.9);
  EXPECT_DOUBLE_EQ(cfg.beta2, 0.95);
  EXPECT_DOUBLE_EQ(cfg.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(cfg.gradient_clipping, 1.0);
  EXPECT_EQ(cfg.lr_schedule, LrSchedule::kCosine);
  EXPECT_DOUBLE_EQ(cfg.min_lr_ratio, 0.1);
  EXPECT_DOUBLE_EQ(cfg.warmup_min_ratio, 0.0);
  const double tokens_per_step = static_cast<double>(cfg.micro_batch_size) *
                                 static_cast<double>(cfg.gradient_accumulation_steps) *
                                 (8.0 / pipeline_stages) * 1024.0;
  EXPECT_EQ(cfg.warmup_steps, std::llround(375e6 / tokens_per_step));
  // The schedule rises to the peak, then decays to 10% of it by the run's last step.
  const int64_t warmup = cfg.warmup_steps, total = 10 * cfg.warmup_steps;
  auto lr_at = [&](int64_t step) {
    return learning_rate(step, cfg.lr, warmup, total, cfg.lr_schedule, cfg.min_lr_ratio,
                         cfg.warmup_min_ratio);
  };
  EXPECT_LT(lr_at(0), 0.01 * cfg.lr);
  EXPECT_DOUBLE_EQ(lr_at(warmup - 1), cfg.lr);
  EXPECT_LT(lr_at(warmup + (total - warmup) / 2), 0.6 * cfg.lr);
  EXPECT_NEAR(lr_at(total), 0.1 * cfg.lr, 1e-12);
}

struct Expected {
  std::string file;
  StrategyKind strategy;
  int stage;
  OffloadDevice optimizer, params;
  int accumulation = 1;
  int pipeline_stages = 1;
};

// Each file gives its documented plan (examples/README.md); every key is one the parser reads (an
// unknown key would throw), and the only one it ignores is pin_memory (shardtrain decides what
// it pins). The same files serve the GPT-2 and the image scripts.
TEST(ExampleConfigs, LoadThroughTheParser) {
  using enum OffloadDevice;
  const std::vector<Expected> cases = {
      {"ds_config_dp.json", StrategyKind::kDataParallel, 0, kNone, kNone},
      {"ds_config_zero1.json", StrategyKind::kZero1, 1, kNone, kNone},
      {"ds_config_zero2.json", StrategyKind::kZero2, 2, kNone, kNone},
      {"ds_config_zero3.json", StrategyKind::kZero3, 3, kNone, kNone},
      {"ds_config_zero2_offload.json", StrategyKind::kOffload, 2, kCpu, kNone},
      // shardtrain's strategy name for ZeRO-3 with anything offloaded is infinity; the plan says
      // where each part lives.
      {"ds_config_zero3_offload.json", StrategyKind::kInfinity, 3, kCpu, kCpu},
      {"ds_config_zero3_infinity_nvme.json", StrategyKind::kInfinity, 3, kNvme, kCpu},
      {"ds_config_pipeline_1f1b.json", StrategyKind::kPipeline, 0, kNone, kNone, 8, 2},
  };
  for (const Expected& e : cases) {
    for (const std::string model : {"gpt2-tiny", "cnn"}) {
      if (model == "cnn" && e.strategy == StrategyKind::kPipeline) continue;  // GPT-2 only
      SCOPED_TRACE(e.file + " with " + model);
      std::vector<std::string> warnings;
      const TrainConfig cfg =
          finalize({"--model", model, "--dataset", model == "cnn" ? "fashion-mnist" : "wikitext-2",
                    "--deepspeed-config", (kExamples / e.file).string()},
                   warnings);
      EXPECT_EQ(cfg.strategy, e.strategy);
      EXPECT_EQ(cfg.strategy_source, "deepspeed");
      EXPECT_EQ(cfg.zero.stage, e.stage);
      EXPECT_EQ(cfg.plan.zero_stage, e.stage);
      EXPECT_EQ(cfg.plan.optimizer_offload, e.optimizer);
      EXPECT_EQ(cfg.plan.param_offload, e.params);
      EXPECT_EQ(cfg.plan.pipeline_stages, e.pipeline_stages);
      EXPECT_EQ(cfg.precision, Precision::kBf16);
      EXPECT_EQ(cfg.micro_batch_size, 32);
      EXPECT_EQ(cfg.gradient_accumulation_steps, e.accumulation);
      // The files' own lr is the smallest GPT-3 size's; the GPT-2 scripts pass each size's.
      EXPECT_DOUBLE_EQ(cfg.lr, kGpt3Sizes.front().lr);
      expect_gpt3_recipe(cfg, e.pipeline_stages);
      EXPECT_EQ(cfg.log_interval, 50);
      EXPECT_EQ(cfg.max_steps, -1) << "no total_num_steps: --epochs decides the length";
      if (e.strategy == StrategyKind::kPipeline) {
        EXPECT_EQ(cfg.pipeline.schedule, PipelineSchedule::k1F1B);
      }
      if (e.optimizer == kNvme) {
        EXPECT_EQ(cfg.zero.nvme_path, "/tmp/shardtrain_nvme") << "documented in examples/README.md";
      }
      if (e.optimizer == kNone) {
        EXPECT_TRUE(warnings.empty()) << join(warnings, "\n");
      } else {
        ASSERT_EQ(warnings.size(), 1u) << join(warnings, "\n");
        EXPECT_NE(warnings[0].find("offload_optimizer.pin_memory"), std::string::npos)
            << warnings[0];
        EXPECT_EQ(warnings[0].find("offload_param.pin_memory") != std::string::npos,
                  e.params != kNone)
            << warnings[0];
        EXPECT_EQ(warnings[0].find("batch"), std::string::npos) << warnings[0];
      }
    }
  }
}

// A strategy name means one thing everywhere: each name `--strategy` accepts (aliases included)
// selects, through the scripts' config, the plan `--strategy NAME` gives; the scripts' own names
// map to the documented files.
TEST(ExampleConfigs, ScriptStrategyNamesMeanWhatStrategyFlagMeans) {
  for (const std::string name : {"dp", "ddp", "zero1", "zero2", "fsdp_stage2", "zero3",
                                 "fsdp_stage3", "offload", "infinity", "pipeline", "FSDP-Stage2"}) {
    SCOPED_TRACE(name);
    const std::string file = script_config(name);
    ASSERT_FALSE(file.empty());
    std::vector<std::string> warnings;
    const TrainConfig from_file = finalize({"--model", "gpt2-tiny", "--dataset", "wikitext-2",
                                            "--deepspeed-config", (kExamples / file).string()},
                                           warnings);
    std::vector<std::string> flag_args = {"--model", "gpt2-tiny", "--dataset", "wikitext-2",
                                          "--strategy", name};
    if (name == "infinity") flag_args.insert(flag_args.end(), {"--nvme-path", "/tmp"});
    if (name == "pipeline") flag_args.insert(flag_args.end(), {"--pipeline-stages", "2"});
    const TrainConfig from_flag = finalize(flag_args, warnings);
    EXPECT_EQ(from_file.strategy, from_flag.strategy) << file;
    EXPECT_EQ(from_file.plan, from_flag.plan) << file;
  }
  const std::vector<std::pair<std::string, std::string>> names = {
      {"dp", "ds_config_dp.json"},
      {"zero1", "ds_config_zero1.json"},
      {"zero2", "ds_config_zero2.json"},
      {"zero3", "ds_config_zero3.json"},
      {"zero2_offload", "ds_config_zero2_offload.json"},
      {"zero3_offload", "ds_config_zero3_offload.json"},
      {"infinity", "ds_config_zero3_infinity_nvme.json"},
      {"pipeline", "ds_config_pipeline_1f1b.json"},
  };
  for (const auto& [name, file] : names) {
    EXPECT_EQ(script_config(name), file) << name;
    EXPECT_TRUE(fs::exists(kExamples / file)) << file;
  }
  std::string error;
  EXPECT_EQ(script_config("zero4", &error), "");
  EXPECT_NE(error.find("unknown STRATEGY 'zero4': use one of dp zero1 zero2 zero3"),
            std::string::npos)
      << error;
}

// The GPT-2 scripts pass each model size its GPT-3 peak learning rate (examples/common.sh's
// gpt3_lr), over the config's, keeping the config's schedule; a --lr of the user's, or their own
// DS_CONFIG, stands.
TEST(ExampleConfigs, Gpt2ScriptsPassGpt3LearningRates) {
  for (const Gpt3Size& size : kGpt3Sizes) {
    SCOPED_TRACE(size.model);
    const Result r =
        run_in_source("bash -c 'source examples/common.sh && gpt3_lr " + size.model + "'");
    ASSERT_EQ(r.status, 0) << r.output;
    std::string lr = r.output;
    while (!lr.empty() && (lr.back() == '\n' || lr.back() == ' ')) lr.pop_back();
    ASSERT_FALSE(lr.empty());
    EXPECT_DOUBLE_EQ(std::stod(lr), size.lr);
    const std::string model = size.model.ends_with(".json")
                                  ? (fs::path(SHARDTRAIN_SOURCE_DIR) / size.model).string()
                                  : size.model;
    for (const std::string file : {"ds_config_zero1.json", "ds_config_zero3_offload.json",
                                   "ds_config_pipeline_1f1b.json"}) {
      SCOPED_TRACE(file);
      const int stages = file == "ds_config_pipeline_1f1b.json" ? 2 : 1;
      std::vector<std::string> warnings;
      const TrainConfig cfg = finalize({"--model", model, "--dataset", "wikitext-2",
                                        "--deepspeed-config", (kExamples / file).string(), "--lr",
                                        lr},
                                       warnings);
      EXPECT_DOUBLE_EQ(cfg.lr, size.lr);
      expect_gpt3_recipe(cfg, stages);
    }
  }
  // Presets smaller than GPT-3's smallest take its rate; what cannot be sized gets no --lr.
  const auto flags = [](const std::string& args, const std::string& env = "") {
    Result r = run_in_source(env + "bash -c 'source examples/common.sh && train=() && "
                             "add_gpt3_lr_flag " + args + " && echo \"${train[*]}\"'");
    EXPECT_EQ(r.status, 0) << r.output;
    while (!r.output.empty() && r.output.back() == '\n') r.output.pop_back();
    return r.output;
  };
  EXPECT_EQ(flags("gpt2-tiny --max-steps 5"), "--lr 6e-4");
  EXPECT_EQ(flags("gpt2-xl --max-steps 5 --lr 1e-3"), "");
  EXPECT_EQ(flags("gpt2-xl --lr=1e-3"), "");
  EXPECT_EQ(flags("gpt2-xl", "DS_CONFIG=my.json "), "");  // another config: its lr stands
  EXPECT_EQ(flags("no-such-model"), "");
}

// What the scripts pass: --batch-size (the per-GPU micro-batch) over the file's
// train_micro_batch_size_per_gpu, said in a warning; on CPUs bf16 falls back to fp32.
TEST(ExampleConfigs, ScriptFlagsTakePrecedence) {
  std::vector<std::string> warnings;
  const TrainConfig cfg =
      finalize({"--model", "cnn", "--dataset", "fashion-mnist", "--batch-size", "8", "--epochs",
                "2", "--device", "cpu", "--deepspeed-config",
                (kExamples / "ds_config_zero2_offload.json").string()},
               warnings);
  EXPECT_EQ(cfg.micro_batch_size, 8);
  EXPECT_EQ(cfg.strategy, StrategyKind::kOffload);
  EXPECT_EQ(cfg.precision, Precision::kFp32);
  const std::string all = join(warnings, "\n");
  EXPECT_NE(all.find("--batch-size over train_micro_batch_size_per_gpu"), std::string::npos) << all;
  EXPECT_NE(all.find("which --device cpu cannot run"), std::string::npos) << all;
  // The scripts' NVME_PATH and PIPELINE_STAGES become flags over the file's values.
  warnings.clear();
  const TrainConfig inf = finalize(
      {"--model", "gpt2-tiny", "--dataset", "wikitext-2", "--nvme-path", "/var/tmp",
       "--deepspeed-config", (kExamples / "ds_config_zero3_infinity_nvme.json").string()},
      warnings);
  EXPECT_EQ(inf.zero.nvme_path, "/var/tmp");
  warnings.clear();
  const TrainConfig pipe = finalize(
      {"--model", "gpt2-tiny", "--dataset", "wikitext-2", "--pipeline-stages", "4",
       "--deepspeed-config", (kExamples / "ds_config_pipeline_1f1b.json").string()},
      warnings, 4);
  EXPECT_EQ(pipe.pipeline.stages, 4);
}

TEST(ExampleScripts, UsageOnWrongArgumentCount) {
  for (const std::string script :
       {"launch_distributed.sh cnn dp 1 32", "launch_multi_node.sh cnn dp 1 1 32",
        "launch_distributed.sh", "gpt2/train_single_gpu.sh gpt2-tiny dp",
        "gpt2/launch_distributed.sh gpt2-tiny dp 2", "gpt2/launch_multi_node.sh gpt2 dp 1 2"}) {
    const Result r = run_in_source("bash examples/" + script);
    EXPECT_EQ(r.status, 2) << script << "\n" << r.output;
    EXPECT_NE(r.output.find("usage: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("STRATEGY: dp zero1 zero2 zero3 zero2_offload zero3_offload "
                            "infinity pipeline (aliases: ddp, fsdp_stage2, fsdp_stage3, offload)"),
              std::string::npos)
        << r.output;
  }
  // An unknown STRATEGY stops the script before anything runs.
  const Result r = run_in_source(std::string("env SHARDTRAIN=") + SHARDTRAIN_BINARY +
                                 " bash examples/gpt2/launch_distributed.sh gpt2-tiny zero4 2 2");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("unknown STRATEGY 'zero4'"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("launch --nproc-per-node"), std::string::npos) << r.output;
}

// launch_distributed.sh cnn ddp 1 32 1 on the CPU, three steps of 256 images: ddp is dp, through
// ds_config_dp.json.
TEST(ExampleScripts, LaunchDistributedDdpOneRank) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  const fs::path out = test_support::make_temp_dir("examples_ddp");
  const Result r = run_in_source(
      std::string("env DEVICE=cpu OMP_NUM_THREADS=1 SHARDTRAIN=") + SHARDTRAIN_BINARY +
      " OUTPUT_DIR=" + out.string() +
      " bash examples/launch_distributed.sh cnn ddp 1 32 1 --max-steps 3 --num-samples 256 "
      "--eval-samples 64 --log-interval 1 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  // The command it ran (set -x), with the dp config.
  EXPECT_NE(r.output.find("launch --nproc-per-node 1 -- train --model cnn --batch-size 32"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("examples/ds_config_dp.json"), std::string::npos) << r.output;
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

// launch_distributed.sh cnn fsdp_stage2 2 16 1: two CPU ranks under mpirun; fsdp_stage2 is
// zero2, as for --strategy (no offload).
TEST(ExampleScripts, LaunchDistributedFsdpStage2IsZero2TwoRanks) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  if (!have_mpirun()) GTEST_SKIP() << "mpirun is not installed (CPU ranks need it)";
  const fs::path out = test_support::make_temp_dir("examples_zero2");
  const Result r =
      run_in_source(std::string("env DEVICE=cpu SHARDTRAIN=") + SHARDTRAIN_BINARY +
                    " OUTPUT_DIR=" + out.string() +
                    " bash examples/launch_distributed.sh cnn fsdp_stage2 2 16 1 --max-steps 3 "
                    "--num-samples 256 --eval-samples 64 --log-interval 1 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("examples/ds_config_zero2.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("strategy zero2 | cpu"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("offload:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("micro-batch 16 × accumulation 1 × 2 ranks = global batch 32"),
            std::string::npos)
      << r.output;
  const auto steps = step_records(out / "metrics.jsonl");
  ASSERT_EQ(steps.size(), 3u) << r.output;
  EXPECT_EQ(steps.back()["images_seen"], 96);
  fs::remove_all(out);
}

// launch_distributed.sh cnn zero3_offload 1 32 1: ZeRO-3 with the parameters and the optimizer
// offloaded to the host.
TEST(ExampleScripts, LaunchDistributedZero3OffloadOneRank) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  const fs::path out = test_support::make_temp_dir("examples_zero3_offload");
  const Result r =
      run_in_source(std::string("env DEVICE=cpu OMP_NUM_THREADS=1 SHARDTRAIN=") +
                    SHARDTRAIN_BINARY + " OUTPUT_DIR=" + out.string() +
                    " bash examples/launch_distributed.sh cnn zero3_offload 1 32 1 --max-steps 3 "
                    "--num-samples 256 --eval-samples 64 --log-interval 1 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("examples/ds_config_zero3_offload.json"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("strategy infinity | cpu"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" pinned, "), std::string::npos) << r.output;  // host memory
  EXPECT_NE(r.output.find(" pageable, NVMe 0 B"), std::string::npos) << r.output;
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
  EXPECT_NE(r.output.find("examples/ds_config_zero2.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("strategy zero2 | cpu"), std::string::npos) << r.output;
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

/// Runs an examples/slurm batch script with bash (no SLURM) through a stand-in srun that writes
/// the arguments of its N-th call to DIR/srun.N, one per line; returns the calls' arguments.
std::vector<std::vector<std::string>> run_sbatch_script(const fs::path& dir, const std::string& env,
                                                        const std::string& script, Result& r) {
  {
    std::ofstream srun(dir / "srun");
    srun << "#!/bin/sh\nd=$(dirname \"$0\")\nn=$(ls \"$d\" | grep -c '^srun\\.')\n"
            "printf '%s\\n' \"$@\" > \"$d/srun.$n\"\n";
  }
  fs::permissions(dir / "srun", fs::perms::owner_all);
  r = run_in_source("env PATH=" + dir.string() + ":$PATH SLURM_JOB_ID=7 SLURM_SUBMIT_DIR=$PWD " +
                    env + " bash examples/slurm/" + script);
  std::vector<std::vector<std::string>> calls;
  for (int n = 0; fs::exists(dir / ("srun." + std::to_string(n))); ++n) {
    std::ifstream in(dir / ("srun." + std::to_string(n)));
    calls.emplace_back();
    for (std::string a; std::getline(in, a);) calls.back().push_back(a);
  }
  return calls;
}

// The image SLURM script's srun line; fsdp_stage3 is zero3, as for --strategy.
TEST(ExampleScripts, SlurmImageScriptRunsSrun) {
  const fs::path dir = test_support::make_temp_dir("examples_slurm");
  Result r;
  const auto calls = run_sbatch_script(
      dir, "MODEL=efficientnet_b0 STRATEGY=fsdp_stage3 IMAGE_SIZE=64", "train_image.sbatch", r);
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_EQ(calls.size(), 1u);
  const std::vector<std::string>& args = calls[0];
  const std::string joined = join(args, " ");
  EXPECT_NE(joined.find("--kill-on-bad-exit=1 --cpu-bind=none shardtrain train --device cuda "
                        "--model efficientnet_b0 --batch-size 64 --epochs 10 --output-dir "
                        "runs/efficientnet_b0-fsdp_stage3-7 --dataset fashion-mnist "
                        "--image-size 64 --deepspeed-config"),
            std::string::npos)
      << joined;
  ASSERT_FALSE(args.empty());
  EXPECT_TRUE(fs::exists(args.back())) << args.back();
  EXPECT_EQ(fs::path(args.back()).filename(), "ds_config_zero3.json");
  fs::remove_all(dir);
}

// The GPT-2 SLURM script: its defaults (gpt2, zero1 through ds_config_zero1.json), and infinity,
// which first creates the NVMe directory on every node (one srun task per node).
TEST(ExampleScripts, SlurmGpt2ScriptRunsSrun) {
  fs::path dir = test_support::make_temp_dir("examples_slurm_gpt2");
  Result r;
  auto calls = run_sbatch_script(dir, "", "train_gpt2.sbatch", r);
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_EQ(calls.size(), 1u);
  std::string joined = join(calls[0], " ");
  EXPECT_NE(joined.find("--kill-on-bad-exit=1 --cpu-bind=none shardtrain train --device cuda "
                        "--model gpt2 --dataset wikitext-2 --batch-size 8 --max-length 1024 "
                        "--epochs 1 --output-dir runs/gpt2-zero1-7 --deepspeed-config "),
            std::string::npos)
      << joined;
  // The config, then gpt2's GPT-3 learning rate (125M's).
  ASSERT_GE(calls[0].size(), 3u);
  const std::string config = calls[0][calls[0].size() - 3];
  EXPECT_EQ(fs::path(config).filename(), "ds_config_zero1.json");
  EXPECT_TRUE(fs::exists(config)) << config;
  EXPECT_EQ(calls[0][calls[0].size() - 2], "--lr");
  EXPECT_EQ(calls[0].back(), "6e-4");
  fs::remove_all(dir);

  dir = test_support::make_temp_dir("examples_slurm_gpt2");
  const std::string nvme = (dir / "nvme").string();
  calls = run_sbatch_script(
      dir, "MODEL=gpt2-xl STRATEGY=infinity NVME_PATH=" + nvme + " TRAIN_ARGS=--max-steps\\ 5",
      "train_gpt2.sbatch", r);
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(join(calls[0], " "), "--ntasks-per-node=1 mkdir -p " + nvme);
  joined = join(calls[1], " ");
  EXPECT_NE(joined.find("--output-dir runs/gpt2-xl-infinity-7 --deepspeed-config "),
            std::string::npos)
      << joined;
  EXPECT_NE(joined.find("ds_config_zero3_infinity_nvme.json --nvme-path " + nvme +
                        " --lr 2e-4 --max-steps 5"),
            std::string::npos)
      << joined;
  fs::remove_all(dir);
}

// ---- examples/gpt2 ------------------------------------------------------------------------

// train_single_gpu.sh gpt2-tiny infinity 2: one process, ZeRO-3 with the optimizer on NVMe
// (NVME_PATH) and the parameters on the host; two steps on the CPU.
TEST(ExampleGpt2Scripts, TrainSingleGpuInfinity) {
  const fs::path dir = test_support::make_temp_dir("examples_gpt2_single");
  const fs::path nvme = dir / "nvme";  // the script creates it
  const Result r = run_in_source(
      std::string("env DEVICE=cpu OMP_NUM_THREADS=1 MAX_LENGTH=64 SHARDTRAIN=") +
      SHARDTRAIN_BINARY + " NVME_PATH=" + nvme.string() + " OUTPUT_DIR=" + (dir / "out").string() +
      " bash examples/gpt2/train_single_gpu.sh gpt2-tiny infinity 2 --max-steps 2 "
      "--eval-samples 8 --log-interval 1 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(" train --model gpt2-tiny --dataset wikitext-2 --batch-size 2 "
                          "--max-length 64 --device cpu --output-dir "),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find(" launch "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("examples/ds_config_zero3_infinity_nvme.json --nvme-path " +
                          nvme.string()),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("strategy infinity | cpu"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("offload: optimizer on nvme (ratio 1), parameters on cpu"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("micro-batch 2 × accumulation 1 × 1 rank = global batch 2 samples × "
                          "64 tokens"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("done | 2 steps"), std::string::npos) << r.output;
  EXPECT_EQ(step_records(dir / "out" / "metrics.jsonl").size(), 2u) << r.output;
  fs::remove_all(dir);
}

struct Gpt2Case {
  std::string strategy;      // the script's STRATEGY
  std::string file;          // the config it passes
  std::string banner;        // "strategy NAME | cpu"
  std::string offload;       // the banner's offload line, "" for none
  std::string batch;         // the banner's batch line
};

void PrintTo(const Gpt2Case& c, std::ostream* os) { *os << c.strategy; }  // ctest's test names

class ExampleGpt2Launch : public testing::TestWithParam<Gpt2Case> {};

// launch_distributed.sh gpt2-tiny STRATEGY 2 2: two CPU ranks under mpirun, two steps, for every
// strategy name of the scripts.
TEST_P(ExampleGpt2Launch, TwoCpuRanks) {
  if (!have_mpirun()) GTEST_SKIP() << "mpirun is not installed (CPU ranks need it)";
  const Gpt2Case& c = GetParam();
  const fs::path dir = test_support::make_temp_dir("examples_gpt2_" + c.strategy);
  const Result r = run_in_source(
      std::string("env DEVICE=cpu MAX_LENGTH=32 SHARDTRAIN=") + SHARDTRAIN_BINARY +
      " NVME_PATH=" + (dir / "nvme").string() + " OUTPUT_DIR=" + (dir / "out").string() +
      " bash examples/gpt2/launch_distributed.sh gpt2-tiny " + c.strategy +
      " 2 2 --max-steps 2 --eval-samples 8 --log-interval 1 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("launch --nproc-per-node 2 -- train --model gpt2-tiny --dataset "
                          "wikitext-2 --batch-size 2 --max-length 32 --device cpu"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("examples/" + c.file), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(c.banner), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" × 2 ranks\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(c.batch), std::string::npos) << r.output;
  if (c.offload.empty()) {
    EXPECT_EQ(r.output.find("offload:"), std::string::npos) << r.output;
  } else {
    EXPECT_NE(r.output.find(c.offload), std::string::npos) << r.output;
  }
  EXPECT_NE(r.output.find("done | 2 steps"), std::string::npos) << r.output;
  EXPECT_EQ(step_records(dir / "out" / "metrics.jsonl").size(), 2u) << r.output;
  fs::remove_all(dir);
}

const std::string kDpBatch = "micro-batch 2 × accumulation 1 × 2 ranks = global batch 4 samples";

INSTANTIATE_TEST_SUITE_P(
    Strategies, ExampleGpt2Launch,
    testing::Values(
        Gpt2Case{"dp", "ds_config_dp.json", "strategy dp | cpu", "", kDpBatch},
        Gpt2Case{"zero1", "ds_config_zero1.json", "strategy zero1 | cpu", "", kDpBatch},
        Gpt2Case{"zero2", "ds_config_zero2.json", "strategy zero2 | cpu", "", kDpBatch},
        Gpt2Case{"zero3", "ds_config_zero3.json", "strategy zero3 | cpu", "", kDpBatch},
        Gpt2Case{"zero2_offload", "ds_config_zero2_offload.json", "strategy offload | cpu",
                 "offload: optimizer on cpu (ratio 1), parameters on the device", kDpBatch},
        Gpt2Case{"zero3_offload", "ds_config_zero3_offload.json", "strategy infinity | cpu",
                 "offload: optimizer on cpu (ratio 1), parameters on cpu", kDpBatch},
        Gpt2Case{"infinity", "ds_config_zero3_infinity_nvme.json", "strategy infinity | cpu",
                 "offload: optimizer on nvme (ratio 1), parameters on cpu", kDpBatch},
        Gpt2Case{"pipeline", "ds_config_pipeline_1f1b.json", "strategy pipeline | cpu", "",
                 "micro-batch 2 × micro-batches 8 × 1 data-parallel replica = global batch 16 "
                 "samples"}),
    [](const testing::TestParamInfo<Gpt2Case>& p) { return p.param.strategy; });

// gpt2/launch_multi_node.sh with a one-host hostfile (this machine, two CPU ranks through mpirun).
TEST(ExampleGpt2Scripts, LaunchMultiNodeHostfile) {
  const fs::path dir = test_support::make_temp_dir("examples_gpt2_multi");
  std::ofstream(dir / "hostfile") << "localhost slots=2\n";
  const std::string env = std::string("env DEVICE=cpu MAX_LENGTH=32 SHARDTRAIN=") +
                          SHARDTRAIN_BINARY + " HOSTFILE=" + (dir / "hostfile").string() +
                          " OUTPUT_DIR=" + (dir / "out").string() + " ";
  Result r = run_in_source(env + "bash examples/gpt2/launch_multi_node.sh gpt2-tiny zero2 2 2 2");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("lists 1 host(s) but NUM_NODES is 2"), std::string::npos) << r.output;

  if (!have_mpirun()) GTEST_SKIP() << "mpirun is not installed (CPU ranks need it)";
  r = run_in_source(env +
                    "bash examples/gpt2/launch_multi_node.sh gpt2-tiny zero2 1 2 2 --max-steps 2 "
                    "--eval-samples 8 --no-save");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("launch --master-port 29500 --hostfile " + (dir / "hostfile").string() +
                          " -- train --model gpt2-tiny --dataset wikitext-2"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("examples/ds_config_zero2.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("strategy zero2 | cpu"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" × 2 ranks\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("done | 2 steps"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace shardtrain
