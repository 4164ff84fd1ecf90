// The fixture of the configuration tests (tests/config/test_config.cpp, tests/config/test_deepspeed_config.cpp):
// `shardtrain train` flags parsed and finalized, DeepSpeed JSON files applied, in a temp dir.
#pragma once

#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "config/train_flags.h"
#include "config/config.h"
#include "core/error.h"
#include "test_support.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

/// The message of the ConfigError that `f` throws ("" and a test failure if none).
std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = shardtrain::test_support::make_temp_dir("shardtrain_test_config");
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  /// Writes `text` to a file in the test's temp dir and returns its path.
  std::string write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }

  /// Parses `args` as `shardtrain train` flags (adding --dataset wikitext-2 when no data is
  /// given) and finalizes the config for a model with `context` positions on `world_size` ranks.
  TrainConfig finalize(std::vector<std::string> args, int64_t context = 1024, int world_size = 1) {
    const bool has_data = std::any_of(args.begin(), args.end(), [](const std::string& a) {
      return a == "--dataset" || a == "--train-file";
    });
    if (!has_data) {
      args.push_back("--dataset");
      args.push_back("wikitext-2");
    }
    TrainConfig cfg;
    cfg.world_size = world_size;  // as the launcher sets it
    CLI::App app{"shardtrain train"};
    add_train_flags(app, cfg);
    std::reverse(args.begin(), args.end());  // CLI11 2.1 parses a reversed vector
    app.parse(args);
    return finalize_train_config(app, cfg, context, warnings_);
  }

  /// Applies the JSON `text` to a default config with no explicit flags.
  TrainConfig apply_json(const std::string& text, const ExplicitFlags& flags = {}) {
    TrainConfig cfg;
    cfg.deepspeed_config = write("ds.json", text);
    apply_deepspeed_config(cfg.deepspeed_config, cfg, flags, ignored_);
    return cfg;
  }

  /// A default config that validate() accepts.
  static TrainConfig valid_config() {
    TrainConfig cfg;
    cfg.dataset = "wikitext-2";
    return cfg;
  }

  /// A valid pipeline config: `stages` stages on `world_size` ranks, `micro_batches` per step.
  static TrainConfig pipeline_config(int world_size, int stages, int64_t micro_batches = 4) {
    TrainConfig cfg = valid_config();
    cfg.strategy = StrategyKind::kPipeline;
    cfg.strategy_name = "pipeline";
    cfg.world_size = world_size;
    cfg.pipeline.stages = stages;
    cfg.gradient_accumulation_steps = micro_batches;
    cfg.accumulation_set = true;
    return cfg;
  }

  fs::path dir_;
  std::vector<std::string> warnings_;
  std::vector<std::string> ignored_;
};

}  // namespace
}  // namespace shardtrain
