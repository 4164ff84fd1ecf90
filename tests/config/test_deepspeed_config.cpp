// Tests of the DeepSpeed JSON config (config/deepspeed_config.cpp): zero_optimization and its
// stage-3 keys, offload, optimizer and scheduler sections, precision, monitors, the FLOPs
// profiler, aio, and the errors for typos, wrong types and malformed files.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "config/config.h"
#include "config_test_support.h"
#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

// ---- zero_optimization stage-3 keys -----------------------------------------------------------

TEST_F(ConfigTest, Stage3KeysAreRead) {
  TrainConfig c = apply_json(R"({"zero_optimization": {"stage": 3,
      "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 1e4,
      "stage3_max_live_parameters": 3e8, "stage3_max_reuse_distance": 0,
      "stage3_gather_16bit_weights_on_model_save": true}})");
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 0);  // allowed: no prefetch
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 10'000);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 300'000'000);
  EXPECT_EQ(c.zero.stage3_max_reuse_distance, 0);
  EXPECT_TRUE(c.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(c.strategy, StrategyKind::kZero3);
  EXPECT_TRUE(ignored_.empty()) << ignored_.front();

  // DeepSpeed's unprefixed names and the deprecated fp16 spelling mean the same.
  c = apply_json(R"({"zero_optimization": {"prefetch_bucket_size": 7,
      "param_persistence_threshold": 8, "max_live_parameters": 9, "max_reuse_distance": 10,
      "stage3_gather_fp16_weights_on_model_save": true}})");
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 7);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 8);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 9);
  EXPECT_EQ(c.zero.stage3_max_reuse_distance, 10);
  EXPECT_TRUE(c.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_TRUE(apply_json(R"({"zero_optimization": {"gather_16bit_weights_on_model_save": true}})")
                  .zero.stage3_gather_16bit_weights_on_model_save);

  // Defaults (DeepSpeed's) when absent.
  c = apply_json(R"({"zero_optimization": {"stage": 3}})");
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 100'000);
  EXPECT_FALSE(c.zero.stage3_gather_16bit_weights_on_model_save);
}

TEST_F(ConfigTest, Stage3BadValuesNameKeyValueAndFix) {
  const struct {
    const char* json;
    std::vector<std::string> expected;
  } cases[] = {
      {R"({"zero_optimization": {"stage3_prefetch_bucket_size": -1}})",
       {"\"zero_optimization.stage3_prefetch_bucket_size\": -1 is not valid", ">= 0",
        "0 = no prefetch"}},
      {R"({"zero_optimization": {"stage3_max_live_parameters": 0}})",
       {"\"zero_optimization.stage3_max_live_parameters\": 0 is not valid", "an integer >= 1"}},
      {R"({"zero_optimization": {"max_live_parameters": -5}})",
       {"\"zero_optimization.max_live_parameters\": -5 is not valid", ">= 1"}},
      {R"({"zero_optimization": {"stage3_max_reuse_distance": -1}})",
       {"\"zero_optimization.stage3_max_reuse_distance\": -1 is not valid", ">= 0"}},
      {R"({"zero_optimization": {"stage3_param_persistence_threshold": -2}})",
       {"\"zero_optimization.stage3_param_persistence_threshold\": -2 is not valid", ">= 0"}},
      {R"({"zero_optimization": {"stage3_param_persistence_threshold": 1.5}})",
       {"stage3_param_persistence_threshold\": 1.5 is not valid"}},
      {R"({"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": 1}})",
       {"stage3_gather_16bit_weights_on_model_save\": 1 is not valid", "true or false"}},
      {R"({"zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}})",
       {"\"zero_optimization.stage3_prefetch_bucket_size\" and "
        "\"zero_optimization.prefetch_bucket_size\" are both given",
        "keep only \"stage3_prefetch_bucket_size\""}},
      {R"({"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true,
          "stage3_gather_fp16_weights_on_model_save": true}})",
       {"are both given"}},
  };
  for (const auto& c : cases) {
    const std::string msg = config_error([&] { apply_json(c.json); });
    for (const auto& e : c.expected) EXPECT_CONTAINS(msg, e);
  }
}

TEST_F(ConfigTest, PersistenceThresholdAboveEveryLayerWarns) {
  TrainConfig cfg = valid_config();
  cfg.strategy = StrategyKind::kZero3;
  cfg.zero.stage = 3;
  cfg.zero.stage3_param_persistence_threshold = 2'000'000;
  validate(cfg, 1024);
  const auto w = model_config_warnings(cfg, 1'500'000);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_CONTAINS(w[0], "zero_optimization.stage3_param_persistence_threshold 2000000");
  EXPECT_CONTAINS(w[0], "every layer stays replicated: zero3 then saves no parameter memory");
  EXPECT_CONTAINS(w[0], "1500000 parameters");
  EXPECT_EQ(model_config_warnings(cfg, 1'500'000).size(), 1u);
  EXPECT_TRUE(model_config_warnings(cfg, 3'000'000).empty());  // the largest layer is sharded
  EXPECT_TRUE(model_config_warnings(cfg, 2'000'000).empty());  // not fewer than the threshold
  cfg.zero.stage3_param_persistence_threshold = 100'000;       // DeepSpeed's default
  EXPECT_TRUE(model_config_warnings(cfg, 1'500'000).empty());
  cfg = valid_config();  // not stage 3: the threshold means nothing
  cfg.zero.stage3_param_persistence_threshold = 2'000'000;
  EXPECT_TRUE(model_config_warnings(cfg, 1'500'000).empty());
}

TEST_F(ConfigTest, Bf16ConfigRunsInFp32OnCpuWithOneWarning) {
  const std::string path = write("gpu.json", R"({"bf16": {"enabled": true},
      "zero_optimization": {"stage": 2}})");
  TrainConfig cfg = finalize({"--deepspeed-config", path, "--device", "cpu"});
  EXPECT_EQ(cfg.precision, Precision::kFp32);
  ASSERT_EQ(warnings_.size(), 1u);
  EXPECT_CONTAINS(warnings_[0], "enables bf16");
  EXPECT_CONTAINS(warnings_[0], "training in fp32");
  EXPECT_EQ(warnings_[0].find('\n'), std::string::npos);
  warnings_.clear();
  const std::string fp16 = write("fp16.json", R"({"fp16": {"enabled": true}})");
  EXPECT_EQ(finalize({"--deepspeed-config", fp16, "--device", "cpu"}).precision, Precision::kFp32);
  EXPECT_EQ(warnings_.size(), 1u);
  warnings_.clear();
  // On GPUs (or auto) the file's precision stands.
  EXPECT_EQ(finalize({"--deepspeed-config", path, "--device", "cuda"}).precision, Precision::kBf16);
  EXPECT_TRUE(warnings_.empty());
}

TEST_F(ConfigTest, ExplicitHalfPrecisionOnCpuIsAnError) {
  for (const char* p : {"bf16", "fp16"}) {
    const std::string msg = config_error([&] { finalize({"--precision", p, "--device", "cpu"}); });
    EXPECT_CONTAINS(msg, fmt::format("--precision {} needs --device cuda", p));
    EXPECT_CONTAINS(msg, "--precision fp32");
  }
  // Also when a DeepSpeed config agrees with the flag.
  const std::string path = write("gpu.json", R"({"bf16": {"enabled": true}})");
  const std::string msg = config_error([&] {
    finalize({"--deepspeed-config", path, "--precision", "bf16", "--device", "cpu"});
  });
  EXPECT_CONTAINS(msg, "--precision bf16 needs --device cuda");
}

TEST_F(ConfigTest, JsonOffloadErrors) {
  // offload_param needs stage 3.
  const std::string stage2 = write(
      "off2.json", R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})");
  std::string msg = config_error([&] { finalize({"--deepspeed-config", stage2}); });
  EXPECT_CONTAINS(msg, "offload_param.device \"cpu\"");
  EXPECT_CONTAINS(msg, "needs ZeRO stage 3");

  // NVMe without a path.
  const std::string nvme = write(
      "off3.json", R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})");
  msg = config_error([&] { finalize({"--deepspeed-config", nvme}); });
  EXPECT_CONTAINS(msg, "--nvme-path DIR");

  const std::string ratio = write(
      "offr.json",
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 2}}})");
  msg = config_error([&] { finalize({"--deepspeed-config", ratio}); });
  EXPECT_CONTAINS(msg, "offload_optimizer.ratio");

  const std::string bad_device =
      write("offbad.json", R"({"zero_optimization": {"offload_param": {"device": "gpu"}}})");
  msg = config_error([&] { finalize({"--deepspeed-config", bad_device}); });
  EXPECT_CONTAINS(msg, "zero_optimization.offload_param.device");
  EXPECT_CONTAINS(msg, "\"gpu\"");
}

// max_in_cpu of both halves and offload_param.buffer_count are read (DeepSpeed spells them so);
// buffer_size and pin_memory are ignored with a warning; bad values name the key.
TEST_F(ConfigTest, JsonOffloadMaxInCpuAndBufferCount) {
  const std::string path = write("offcpu.json", R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "max_in_cpu": 5e8},
      "offload_param": {"device": "nvme", "nvme_path": "/tmp", "max_in_cpu": 1000000,
                        "buffer_count": 3, "buffer_size": 100000000}}})");
  const TrainConfig cfg = finalize({"--deepspeed-config", path});
  EXPECT_EQ(cfg.zero.offload_optimizer_max_in_cpu, 500'000'000);
  EXPECT_EQ(cfg.zero.offload_param_max_in_cpu, 1'000'000);
  EXPECT_EQ(cfg.zero.offload_param_buffer_count, 3);
  ASSERT_FALSE(warnings_.empty());
  EXPECT_CONTAINS(warnings_[0], "zero_optimization.offload_param.buffer_size");
  EXPECT_EQ(warnings_[0].find("max_in_cpu"), std::string::npos) << warnings_[0];
  const TrainConfig plain = finalize(
      {"--deepspeed-config",
       write("off0.json",
             R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})")});
  EXPECT_EQ(plain.zero.offload_param_max_in_cpu, -1);  // all in host memory
  const std::string bad = write("offb.json", R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 1}}})");
  EXPECT_CONTAINS(config_error([&] {
                    finalize({"--deepspeed-config", bad});
                  }),
                  "zero_optimization.offload_param.buffer_count");
}

TEST_F(ConfigTest, JsonStageDecidesOverStrategyFlagWithWarning) {
  const std::string path = write("ds.json", R"({"zero_optimization": {"stage": 0}})");
  const TrainConfig cfg = finalize({"--strategy", "zero2", "--deepspeed-config", path});
  EXPECT_EQ(cfg.strategy, StrategyKind::kDataParallel);
  EXPECT_EQ(cfg.zero.stage, 0);
  ASSERT_EQ(warnings_.size(), 1u);
  EXPECT_CONTAINS(warnings_[0], "--strategy zero2 contradicts zero_optimization.stage 0");
  EXPECT_CONTAINS(warnings_[0], "strategy is 'dp'");
}

TEST_F(ConfigTest, LegacyBooleanZeroOptimization) {
  TrainConfig cfg = apply_json(R"({"zero_optimization": true})");
  EXPECT_EQ(cfg.zero.stage, 1);
  EXPECT_EQ(cfg.strategy, StrategyKind::kZero1);
  cfg = apply_json(R"({"zero_optimization": {"stage": 2, "cpu_offload": true}})");
  EXPECT_EQ(cfg.strategy, StrategyKind::kOffload);
  EXPECT_EQ(cfg.zero.offload_optimizer_device, "cpu");
}

// ---- DeepSpeed JSON: errors ------------------------------------------------------------------

TEST_F(ConfigTest, TypoKeysSuggestTheClosestValidKey) {
  struct Case {
    const char* json;
    const char* key;
    const char* suggestion;
  };
  const Case cases[] = {
      {R"({"train_micro_batch_size_per_gpus": 4})", "train_micro_batch_size_per_gpus",
       "did you mean 'train_micro_batch_size_per_gpu'?"},
      {R"({"zero_optimisation": {"stage": 0}})", "zero_optimisation",
       "did you mean 'zero_optimization'?"},
      {R"({"gradient_cliping": 1.0})", "gradient_cliping", "did you mean 'gradient_clipping'?"},
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decya": 0.1}}})",
       "optimizer.params.weight_decya", "did you mean 'optimizer.params.weight_decay'?"},
      {R"({"zero_optimization": {"stage": 0, "overlap_com": true}})",
       "zero_optimization.overlap_com", "did you mean 'zero_optimization.overlap_comm'?"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})",
       "scheduler.params.warmup_num_step", "did you mean 'scheduler.params.warmup_num_steps'?"},
      {R"({"fp16": {"enabled": true, "loss_scale_windows": 100}})", "fp16.loss_scale_windows",
       "did you mean 'fp16.loss_scale_window'?"},
      {R"({"Train_Batch_Size": 16})", "Train_Batch_Size", "case-sensitive"},
  };
  for (const Case& c : cases) {
    const std::string msg = config_error([&] { apply_json(c.json); });
    EXPECT_CONTAINS(msg, c.key);
    EXPECT_CONTAINS(msg, c.suggestion);
    EXPECT_CONTAINS(msg, "ds.json");
  }
}

TEST_F(ConfigTest, UnknownKeyFarFromAnyListsValidKeys) {
  std::string msg = config_error([&] { apply_json(R"({"fp16": {"banana": 1}})"); });
  EXPECT_CONTAINS(msg, "fp16.banana");
  EXPECT_CONTAINS(msg, "valid keys in \"fp16\"");
  EXPECT_CONTAINS(msg, "initial_scale_power");
  // A valid key in the wrong section says where it belongs.
  msg = config_error([&] { apply_json(R"({"stage": 2})"); });
  EXPECT_CONTAINS(msg, "\"stage\" belongs in \"zero_optimization\"");
}

TEST_F(ConfigTest, TutorialConfigKeysPointToFlags) {
  std::string msg = config_error([&] { apply_json(R"({"seed": 1234})"); });
  EXPECT_CONTAINS(msg, "\"seed\" is not a DeepSpeed config key");
  EXPECT_CONTAINS(msg, "--seed");
  msg = config_error([&] { apply_json(R"({"batch_size": 8})"); });
  EXPECT_CONTAINS(msg, "--batch-size");
}

TEST_F(ConfigTest, MalformedJsonNamesFileAndPosition) {
  const std::string path = write("broken.json", "{\n  \"train_batch_size\": 8,\n}\n");
  TrainConfig cfg;
  const std::string msg = config_error([&] { apply_deepspeed_config(path, cfg, {}, ignored_); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "line 3, column 1");
  EXPECT_CONTAINS(msg, "fix the JSON");
}

TEST_F(ConfigTest, CommentsAreAcceptedDuplicatesAreNot) {
  TrainConfig cfg = apply_json("{\n  // micro-batch\n  \"train_micro_batch_size_per_gpu\": 4\n}");
  EXPECT_EQ(cfg.micro_batch_size, 4);
  const std::string msg = config_error([&] {
    apply_json(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "lr": 2e-4}}})");
  });
  EXPECT_CONTAINS(msg, "\"optimizer.params.lr\" appears twice");
}

TEST_F(ConfigTest, MissingFileIsAConfigError) {
  TrainConfig cfg;
  const std::string path = (dir_ / "nope.json").string();
  const std::string msg = config_error([&] { apply_deepspeed_config(path, cfg, {}, ignored_); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "cannot open");
}

TEST_F(ConfigTest, WrongTypesNameKeyValueAndExpectation) {
  std::string msg =
      config_error([&] { apply_json(R"({"train_micro_batch_size_per_gpu": "eight"})"); });
  EXPECT_CONTAINS(msg, "train_micro_batch_size_per_gpu");
  EXPECT_CONTAINS(msg, "\"eight\"");
  EXPECT_CONTAINS(msg, "expected an integer >= 1");

  msg = config_error([&] { apply_json(R"({"train_micro_batch_size_per_gpu": -4})"); });
  EXPECT_CONTAINS(msg, "-4");
  EXPECT_CONTAINS(msg, "expected an integer >= 1");

  msg = config_error([&] { apply_json(R"({"gradient_accumulation_steps": 2.5})"); });
  EXPECT_CONTAINS(msg, "gradient_accumulation_steps");
  EXPECT_CONTAINS(msg, "2.5");

  msg = config_error([&] { apply_json(R"({"fp16": {"enabled": "yes"}})"); });
  EXPECT_CONTAINS(msg, "fp16.enabled");
  EXPECT_CONTAINS(msg, "true or false");

  msg = config_error(
      [&] { apply_json(R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})"); });
  EXPECT_CONTAINS(msg, "optimizer.params.betas");
  EXPECT_CONTAINS(msg, "[0.9]");

  msg = config_error([&] { apply_json(R"({"zero_optimization": {"stage": 4}})"); });
  EXPECT_CONTAINS(msg, "zero_optimization.stage");
  EXPECT_CONTAINS(msg, "0, 1, 2 or 3");

  msg = config_error([&] { apply_json(R"([1, 2])"); });
  EXPECT_CONTAINS(msg, "top level");
}

TEST_F(ConfigTest, SizesWrittenAsFloatsAreIntegers) {
  const TrainConfig cfg = apply_json(R"({"zero_optimization": {"reduce_bucket_size": 5e8,
      "allgather_bucket_size": 2e8, "overlap_comm": false}})");
  EXPECT_EQ(cfg.zero.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(cfg.zero.allgather_bucket_size, 200'000'000);
  EXPECT_FALSE(cfg.zero.overlap_comm);
}

// contiguous_gradients and reduce_scatter are valid but not implemented as options (ZeRO always
// keeps contiguous gradient buckets and reduce-scatters): warned about only when turned off.
TEST_F(ConfigTest, ContiguousGradientsAndReduceScatterWarnOnlyWhenOff) {
  apply_json(R"({"zero_optimization": {"contiguous_gradients": true, "reduce_scatter": true}})");
  EXPECT_TRUE(ignored_.empty()) << ignored_.front();
  apply_json(R"({"zero_optimization": {"contiguous_gradients": false, "reduce_scatter": false}})");
  EXPECT_EQ(ignored_, (std::vector<std::string>{"zero_optimization.contiguous_gradients: false",
                                                "zero_optimization.reduce_scatter: false"}));
  const std::string msg =
      config_error([&] { apply_json(R"({"zero_optimization": {"reduce_scatter": "no"}})"); });
  EXPECT_CONTAINS(msg, "zero_optimization.reduce_scatter");
}

TEST_F(ConfigTest, UnsupportedOptimizersAndSchedulers) {
  std::string msg = config_error([&] { apply_json(R"({"optimizer": {"type": "Lamb"}})"); });
  EXPECT_CONTAINS(msg, "\"Lamb\" is not available");
  EXPECT_CONTAINS(msg, "\"type\": \"AdamW\"");
  msg = config_error([&] { apply_json(R"({"scheduler": {"type": "OneCycle"}})"); });
  EXPECT_CONTAINS(msg, "\"OneCycle\" is not available");
  msg = config_error([&] { apply_json(R"({"scheduler": {"type": "WarmupCosine"}})"); });
  EXPECT_CONTAINS(msg, "did you mean 'WarmupCosineLR'?");
  msg = config_error([&] {
    apply_json(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false,
        "weight_decay": 0.1}}})");
  });
  EXPECT_CONTAINS(msg, "adam_w_mode");
  EXPECT_CONTAINS(msg, "set weight_decay to 0");
}

TEST_F(ConfigTest, Bf16AndFp16BothEnabledIsAnError) {
  const std::string msg = config_error(
      [&] { apply_json(R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})"); });
  EXPECT_CONTAINS(msg, "\"bf16.enabled\" and \"fp16.enabled\" are both true");
  EXPECT_CONTAINS(msg, "at most one");
}

// ---- DeepSpeed JSON: values ------------------------------------------------------------------

TEST_F(ConfigTest, OptimizerAndWarmupCosineLr) {
  const TrainConfig cfg = apply_json(R"({
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                             "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR",
                  "params": {"total_num_steps": 5000, "warmup_num_steps": 200,
                             "cos_min_ratio": 0.05, "warmup_min_ratio": 0.01,
                             "warmup_type": "linear"}},
    "gradient_clipping": 0.5,
    "steps_per_print": 25
  })");
  EXPECT_DOUBLE_EQ(cfg.lr, 3e-4);
  EXPECT_DOUBLE_EQ(cfg.beta1, 0.9);
  EXPECT_DOUBLE_EQ(cfg.beta2, 0.95);
  EXPECT_DOUBLE_EQ(cfg.adam_eps, 1e-6);
  EXPECT_DOUBLE_EQ(cfg.weight_decay, 0.1);
  EXPECT_EQ(cfg.lr_schedule, LrSchedule::kCosine);
  EXPECT_EQ(cfg.max_steps, 5000);
  EXPECT_EQ(cfg.warmup_steps, 200);
  EXPECT_DOUBLE_EQ(cfg.min_lr_ratio, 0.05);
  EXPECT_DOUBLE_EQ(cfg.warmup_min_ratio, 0.01);
  EXPECT_DOUBLE_EQ(cfg.gradient_clipping, 0.5);
  EXPECT_EQ(cfg.log_interval, 25);
  EXPECT_TRUE(ignored_.empty());
}

TEST_F(ConfigTest, WarmupLrAndWarmupDecayLr) {
  TrainConfig cfg = apply_json(R"({"optimizer": {"type": "Adam", "params": {"lr": 1e-4,
      "weight_decay": 0.01}}, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
      "warmup_max_lr": 5e-4, "warmup_num_steps": 100}}})");
  EXPECT_EQ(cfg.lr_schedule, LrSchedule::kConstant);
  EXPECT_DOUBLE_EQ(cfg.lr, 5e-4);  // warmup_max_lr overrides the optimizer's lr, as in DeepSpeed
  EXPECT_EQ(cfg.warmup_steps, 100);
  EXPECT_DOUBLE_EQ(cfg.weight_decay, 0.01);  // Adam with weight decay runs as AdamW
  EXPECT_EQ(cfg.max_steps, -1);

  cfg = apply_json(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5,
      "warmup_max_lr": 1e-4, "warmup_num_steps": 10, "total_num_steps": 800}}})");
  EXPECT_EQ(cfg.lr_schedule, LrSchedule::kLinear);
  EXPECT_DOUBLE_EQ(cfg.lr, 1e-4);
  EXPECT_EQ(cfg.max_steps, 800);
  EXPECT_NEAR(cfg.min_lr_ratio, 0.1, 1e-12);
  EXPECT_NEAR(cfg.warmup_min_ratio, 0.1, 1e-12);
}

TEST_F(ConfigTest, SgdSectionIsRead) {
  TrainConfig cfg = apply_json(R"({"optimizer": {"type": "SGD", "params": {"lr": 0.05,
      "momentum": 0.9, "nesterov": true, "weight_decay": 4e-5}}})");
  EXPECT_EQ(cfg.optimizer, OptimizerKind::kSGD);
  EXPECT_DOUBLE_EQ(cfg.lr, 0.05);
  EXPECT_DOUBLE_EQ(cfg.momentum, 0.9);
  EXPECT_TRUE(cfg.nesterov);
  EXPECT_DOUBLE_EQ(cfg.weight_decay, 4e-5);
  EXPECT_TRUE(ignored_.empty());
  // Omitted parameters take torch.optim.SGD's defaults (lr DeepSpeed's 1e-3).
  cfg = apply_json(R"({"optimizer": {"type": "sgd"}})");
  EXPECT_EQ(cfg.optimizer, OptimizerKind::kSGD);
  EXPECT_DOUBLE_EQ(cfg.lr, 1e-3);
  EXPECT_DOUBLE_EQ(cfg.momentum, 0.0);
  EXPECT_FALSE(cfg.nesterov);
  EXPECT_DOUBLE_EQ(cfg.weight_decay, 0.0);
  // AdamW stays AdamW; an Adam key in an SGD section is named.
  EXPECT_EQ(apply_json(R"({"optimizer": {"type": "AdamW"}})").optimizer, OptimizerKind::kAdamW);
  std::string msg = config_error(
      [&] { apply_json(R"({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}})"); });
  EXPECT_CONTAINS(msg, "optimizer.params.betas");
  msg = config_error(
      [&] { apply_json(R"({"optimizer": {"type": "SGD", "params": {"dampening": 0.1}}})"); });
  EXPECT_CONTAINS(msg, "dampening");
  msg = config_error([&] { apply_json(R"({"optimizer": {"type": "Lion"}})"); });
  EXPECT_CONTAINS(msg, "Adam/AdamW and SGD");
}

TEST_F(ConfigTest, SgdFlagsAndTheirErrors) {
  TrainConfig cfg =
      finalize({"--optimizer", "sgd", "--momentum", "0.9", "--nesterov", "--weight-decay", "0"});
  EXPECT_EQ(cfg.optimizer, OptimizerKind::kSGD);
  EXPECT_DOUBLE_EQ(cfg.momentum, 0.9);
  EXPECT_TRUE(cfg.nesterov);
  EXPECT_EQ(finalize({}).optimizer, OptimizerKind::kAdamW);
  EXPECT_DOUBLE_EQ(finalize({"--optimizer", "sgd"}).momentum, 0.0);  // PyTorch's default
  // Nesterov without momentum is an error, as in PyTorch.
  std::string msg = config_error([&] { finalize({"--optimizer", "sgd", "--nesterov"}); });
  EXPECT_CONTAINS(msg, "--nesterov needs a momentum > 0");
  msg = config_error([&] {
    TrainConfig c = valid_config();
    c.deepspeed_config = write("ds2.json", R"({"optimizer": {"type": "SGD", "params":
        {"nesterov": true}}})");
    apply_deepspeed_config(c.deepspeed_config, c, {}, ignored_);
    validate(c, 1024);
  });
  EXPECT_CONTAINS(msg, "--nesterov needs a momentum > 0");
  // SGD's flags with AdamW are a mistake, not silently ignored.
  msg = config_error([&] { finalize({"--momentum", "0.9"}); });
  EXPECT_CONTAINS(msg, "--optimizer sgd");
  // The flag beats the JSON, as every flag.
  const std::string path = write("sgd.json", R"({"optimizer": {"type": "SGD", "params":
      {"lr": 0.1, "momentum": 0.9}}})");
  cfg = finalize({"--deepspeed_config", path, "--momentum", "0.5"});
  EXPECT_EQ(cfg.optimizer, OptimizerKind::kSGD);
  EXPECT_DOUBLE_EQ(cfg.momentum, 0.5);
  EXPECT_DOUBLE_EQ(cfg.lr, 0.1);
  // NVMe-offloaded optimizer state pages AdamW's m and v: SGD is refused with the fix.
  msg = config_error([&] {
    finalize({"--optimizer", "sgd", "--strategy", "infinity", "--nvme-path", dir_.string()});
  });
  EXPECT_CONTAINS(msg, "NVMe");
  EXPECT_CONTAINS(msg, "--strategy offload");
  EXPECT_THROW(finalize({"--optimizer", "lamb"}), std::exception);
}

TEST_F(ConfigTest, OmittedOptimizerParamsTakeDeepSpeedDefaults) {
  const TrainConfig cfg = apply_json(R"({"optimizer": {"type": "AdamW", "params": {"lr": 2e-4}}})");
  EXPECT_DOUBLE_EQ(cfg.lr, 2e-4);
  EXPECT_DOUBLE_EQ(cfg.weight_decay, 0.0);  // DeepSpeed's default, not shardtrain's 0.01
  EXPECT_DOUBLE_EQ(cfg.beta2, 0.999);
}

TEST_F(ConfigTest, PrecisionAndLossScale) {
  TrainConfig cfg = apply_json(R"({"bf16": {"enabled": true}})");
  EXPECT_EQ(cfg.precision, Precision::kBf16);
  cfg = apply_json(R"({"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12,
      "loss_scale_window": 500, "hysteresis": 4, "min_loss_scale": 0.5}})");
  EXPECT_EQ(cfg.precision, Precision::kFp16);
  EXPECT_EQ(cfg.loss_scale.initial_scale_power, 12);
  EXPECT_EQ(cfg.loss_scale.loss_scale_window, 500);
  EXPECT_EQ(cfg.loss_scale.hysteresis, 4);
  EXPECT_DOUBLE_EQ(cfg.loss_scale.min_loss_scale, 0.5);
  cfg = apply_json(R"({"fp16": {"enabled": false}})");
  EXPECT_EQ(cfg.precision, Precision::kFp32);
}

TEST_F(ConfigTest, AutoValuesAreUnset) {
  const TrainConfig cfg = apply_json(R"({
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                             "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto",
                  "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                  "total_num_steps": "auto"}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"}
  })");
  const TrainConfig defaults;
  EXPECT_EQ(cfg.train_batch_size, defaults.train_batch_size);
  EXPECT_EQ(cfg.micro_batch_size, defaults.micro_batch_size);
  EXPECT_FALSE(cfg.micro_batch_set);
  EXPECT_FALSE(cfg.accumulation_set);
  EXPECT_DOUBLE_EQ(cfg.gradient_clipping, defaults.gradient_clipping);
  EXPECT_DOUBLE_EQ(cfg.lr, defaults.lr);
  EXPECT_DOUBLE_EQ(cfg.beta1, defaults.beta1);
  EXPECT_DOUBLE_EQ(cfg.weight_decay, defaults.weight_decay);
  EXPECT_EQ(cfg.warmup_steps, defaults.warmup_steps);
  EXPECT_EQ(cfg.max_steps, defaults.max_steps);
  EXPECT_EQ(cfg.precision, Precision::kAuto);
  EXPECT_EQ(cfg.zero.stage, 0);
  EXPECT_EQ(cfg.strategy, StrategyKind::kDataParallel);
  EXPECT_EQ(cfg.lr_schedule, LrSchedule::kLinear);
}

TEST_F(ConfigTest, WallClockBreakdownFromJsonOrFlag) {
  EXPECT_FALSE(finalize({}).wall_clock_breakdown);
  EXPECT_TRUE(finalize({"--wall-clock-breakdown"}).wall_clock_breakdown);
  const std::string path = write("ds.json", R"({"wall_clock_breakdown": true})");
  EXPECT_TRUE(finalize({"--deepspeed-config", path}).wall_clock_breakdown);
  EXPECT_TRUE(warnings_.empty() || warnings_[0].find("wall_clock") == std::string::npos);
  const std::string bad = write("bad.json", R"({"wall_clock_breakdown": "yes"})");
  EXPECT_CONTAINS(config_error([&] {
                    finalize({"--deepspeed-config", bad});
                  }),
                  "wall_clock_breakdown");
}

TEST_F(ConfigTest, MonitorFlagsAndDeepSpeedSections) {
  // Off by default.
  TrainConfig cfg = finalize({});
  EXPECT_EQ(cfg.monitor.tensorboard_dir, "");
  EXPECT_EQ(cfg.monitor.csv_dir, "");
  EXPECT_FALSE(cfg.monitor.tensorboard_all_ranks);
  cfg = finalize({"--tensorboard", "tb", "--tensorboard-all-ranks", "--csv-monitor", "csv"});
  EXPECT_EQ(cfg.monitor.tensorboard_dir, "tb");
  EXPECT_TRUE(cfg.monitor.tensorboard_all_ranks);
  EXPECT_EQ(cfg.monitor.csv_dir, "csv");
  EXPECT_CONTAINS(config_error([&] { finalize({"--tensorboard-all-ranks"}); }), "--tensorboard");

  // DeepSpeed: output_path/job_name when enabled; DeepSpeed's defaults "" and DeepSpeedJobName.
  cfg = apply_json(R"({"tensorboard": {"enabled": true, "output_path": "logs/", "job_name": "j"},
                       "csv_monitor": {"enabled": true}})");
  EXPECT_EQ(cfg.monitor.tensorboard_dir, "logs/j");
  EXPECT_EQ(cfg.monitor.csv_dir, "DeepSpeedJobName");
  EXPECT_TRUE(ignored_.empty());
  cfg = apply_json(R"({"tensorboard": {"enabled": false, "output_path": "logs/"}})");
  EXPECT_EQ(cfg.monitor.tensorboard_dir, "");

  // The flag wins over the file.
  const std::string path = write(
      "tb.json", R"({"tensorboard": {"enabled": true, "output_path": "a", "job_name": "b"}})");
  EXPECT_EQ(finalize({"--deepspeed-config", path}).monitor.tensorboard_dir, "a/b");
  EXPECT_EQ(finalize({"--deepspeed-config", path, "--tensorboard", "mine"}).monitor.tensorboard_dir,
            "mine");

  // Unknown keys and wrong types are errors.
  EXPECT_CONTAINS(config_error([&] { apply_json(R"({"tensorboard": {"enable": true}})"); }),
                  "did you mean 'tensorboard.enabled'");
  EXPECT_CONTAINS(config_error([&] { apply_json(R"({"csv_monitor": {"enabled": "yes"}})"); }),
                  "csv_monitor.enabled");
  EXPECT_CONTAINS(
      config_error([&] { apply_json(R"({"csv_monitor": {"enabled": true, "job_name": 3}})"); }),
      "csv_monitor.job_name");

  // wandb: a warning that it is not supported offline (off: nothing).
  warnings_.clear();
  const std::string wandb =
      write("wandb.json", R"({"wandb": {"enabled": true, "project": "gpt2"}})");
  finalize({"--deepspeed-config", wandb});
  ASSERT_EQ(warnings_.size(), 1u);
  EXPECT_CONTAINS(warnings_[0], "wandb");
  EXPECT_CONTAINS(warnings_[0], "not supported offline");
  warnings_.clear();
  finalize({"--deepspeed-config", write("w.json", R"({"wandb": {"enabled": false}})")});
  EXPECT_TRUE(warnings_.empty());
}

TEST_F(ConfigTest, FlopsProfilerFlagAndDeepSpeedSection) {
  // Off by default; --profile-step N turns it on at step N.
  TrainConfig cfg = finalize({});
  EXPECT_FALSE(cfg.flops_profiler.enabled);
  cfg = finalize({"--profile-step", "3"});
  EXPECT_TRUE(cfg.flops_profiler.enabled);
  EXPECT_EQ(cfg.flops_profiler.profile_step, 3);
  EXPECT_ANY_THROW(finalize({"--profile-step", "0"}));

  // DeepSpeed's section: every key read, nothing ignored.
  cfg = apply_json(R"({"flops_profiler": {"enabled": true, "profile_step": 5, "module_depth": 0,
                       "top_modules": 3, "detailed": false, "output_file": "prof.txt"}})");
  EXPECT_TRUE(cfg.flops_profiler.enabled);
  EXPECT_EQ(cfg.flops_profiler.profile_step, 5);
  EXPECT_EQ(cfg.flops_profiler.module_depth, 0);
  EXPECT_EQ(cfg.flops_profiler.top_modules, 3);
  EXPECT_FALSE(cfg.flops_profiler.detailed);
  EXPECT_EQ(cfg.flops_profiler.output_file, "prof.txt");
  EXPECT_TRUE(ignored_.empty());
  // DeepSpeed's defaults: profile_step 1, output_file null = the log; disabled: off.
  cfg = apply_json(R"({"flops_profiler": {"enabled": true, "output_file": null}})");
  EXPECT_TRUE(cfg.flops_profiler.enabled);
  EXPECT_EQ(cfg.flops_profiler.profile_step, 1);
  EXPECT_EQ(cfg.flops_profiler.output_file, "");
  cfg = apply_json(R"({"flops_profiler": {"enabled": false, "profile_step": 4}})");
  EXPECT_FALSE(cfg.flops_profiler.enabled);

  // The flag wins over the file (and turns it on even when the file says disabled).
  const std::string path =
      write("fp.json", R"({"flops_profiler": {"enabled": true, "profile_step": 7}})");
  EXPECT_EQ(finalize({"--deepspeed-config", path}).flops_profiler.profile_step, 7);
  cfg = finalize({"--deepspeed-config", path, "--profile-step", "2"});
  EXPECT_EQ(cfg.flops_profiler.profile_step, 2);
  EXPECT_TRUE(cfg.flops_profiler.enabled);
  const std::string off =
      write("fp_off.json", R"({"flops_profiler": {"enabled": false, "profile_step": 7}})");
  EXPECT_TRUE(finalize({"--deepspeed-config", off, "--profile-step", "2"}).flops_profiler.enabled);

  // Unknown keys and wrong values are errors.
  EXPECT_CONTAINS(config_error([&] { apply_json(R"({"flops_profiler": {"profile_stp": 1}})"); }),
                  "did you mean 'flops_profiler.profile_step'");
  EXPECT_CONTAINS(config_error([&] {
                    apply_json(R"({"flops_profiler": {"enabled": true, "profile_step": 0}})");
                  }),
                  "flops_profiler.profile_step");
  EXPECT_CONTAINS(config_error([&] { apply_json(R"({"flops_profiler": {"module_depth": -2}})"); }),
                  "flops_profiler.module_depth");
  EXPECT_CONTAINS(config_error([&] { apply_json(R"({"flops_profiler": {"detailed": 1}})"); }),
                  "flops_profiler.detailed");
}

TEST_F(ConfigTest, IgnoredKeysAreListedInOneWarning) {
  const std::string path = write("ds.json", R"({
    "train_micro_batch_size_per_gpu": 4,
    "comms_logger": {"enabled": true},
    "wall_clock_breakdown": false,
    "tensorboard": {"enabled": false, "output_path": "tb/"},
    "zero_allow_untested_optimizer": true,
    "zero_optimization": {"stage": 0, "sub_group_size": 1e9, "round_robin_gradients": false},
    "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": false}
  })");
  const TrainConfig cfg = finalize({"--deepspeed-config", path});
  EXPECT_EQ(cfg.micro_batch_size, 4);
  EXPECT_TRUE(cfg.activation_checkpointing);
  ASSERT_EQ(warnings_.size(), 1u);
  const std::string& w = warnings_[0];
  EXPECT_CONTAINS(w, "comms_logger");
  EXPECT_CONTAINS(w, "zero_allow_untested_optimizer");
  EXPECT_CONTAINS(w, "zero_optimization.sub_group_size");
  EXPECT_CONTAINS(w, "activation_checkpointing.partition_activations");
  // Features written as off are not "ignored".
  EXPECT_EQ(w.find("wall_clock_breakdown"), std::string::npos) << w;
  EXPECT_EQ(w.find("tensorboard"), std::string::npos) << w;
  EXPECT_EQ(w.find("round_robin_gradients"), std::string::npos) << w;
  EXPECT_EQ(w.find("cpu_checkpointing"), std::string::npos) << w;

  ignored_.clear();
  apply_json(R"({"memory_breakdown": true, "zero_optimization": {"sub_group_size": 100}})");
  EXPECT_EQ(ignored_,
            (std::vector<std::string>{"memory_breakdown", "zero_optimization.sub_group_size"}));
}

// ---- aio (the NVMe swap's I/O) -----------------------------------------------------------------

TEST_F(ConfigTest, AioSectionIsRead) {
  const TrainConfig defaults = apply_json("{}");
  EXPECT_EQ(defaults.aio.block_size, 1048576);
  EXPECT_EQ(defaults.aio.queue_depth, 8);
  EXPECT_EQ(defaults.aio.thread_count, 1);
  EXPECT_FALSE(defaults.aio.single_submit);
  EXPECT_TRUE(defaults.aio.overlap_events);

  const TrainConfig cfg = apply_json(R"({"aio": {"block_size": 262144, "queue_depth": 32,
      "thread_count": 4, "single_submit": true, "overlap_events": false, "use_gds": false}})");
  EXPECT_EQ(cfg.aio.block_size, 262144);
  EXPECT_EQ(cfg.aio.queue_depth, 32);
  EXPECT_EQ(cfg.aio.thread_count, 4);
  EXPECT_TRUE(cfg.aio.single_submit);
  EXPECT_FALSE(cfg.aio.overlap_events);
  EXPECT_TRUE(ignored_.empty());

  // DeepSpeed's other name of thread_count; sizes as floats; use_gds is accepted and ignored.
  const TrainConfig alias = apply_json(
      R"({"aio": {"intra_op_parallelism": 8, "block_size": 2.097152e6, "use_gds": true}})");
  EXPECT_EQ(alias.aio.thread_count, 8);
  EXPECT_EQ(alias.aio.block_size, 2097152);
  EXPECT_EQ(ignored_, (std::vector<std::string>{"aio.use_gds"}));
}

TEST_F(ConfigTest, AioBadValuesNameKeyValueAndFix) {
  const auto error = [&](const std::string& aio) {
    return config_error([&] { apply_json(R"({"aio": )" + aio + "}"); });
  };
  std::string msg = error(R"({"block_size": 1000})");
  EXPECT_CONTAINS(msg, "\"aio.block_size\": 1000 is not valid");
  EXPECT_CONTAINS(msg, "a multiple of 4096");
  EXPECT_CONTAINS(msg, "e.g. 1048576");
  EXPECT_CONTAINS(error(R"({"block_size": 6000})"), "\"aio.block_size\": 6000 is not valid");
  EXPECT_CONTAINS(error(R"({"block_size": 0})"), "\"aio.block_size\": 0 is not valid");
  msg = error(R"({"queue_depth": 0})");
  EXPECT_CONTAINS(msg, "\"aio.queue_depth\": 0 is not valid");
  EXPECT_CONTAINS(msg, "an integer >= 1");
  msg = error(R"({"thread_count": 0})");
  EXPECT_CONTAINS(msg, "\"aio.thread_count\": 0 is not valid");
  EXPECT_CONTAINS(msg, "[1, 256]");
  EXPECT_CONTAINS(error(R"({"thread_count": 257})"), "\"aio.thread_count\": 257 is not valid");
  EXPECT_CONTAINS(error(R"({"intra_op_parallelism": 300})"),
                  "\"aio.intra_op_parallelism\": 300 is not valid");
  EXPECT_CONTAINS(error(R"({"thread_count": 2, "intra_op_parallelism": 2})"),
                  "keep only \"thread_count\"");
  EXPECT_CONTAINS(error(R"({"single_submit": "yes"})"), "\"aio.single_submit\": \"yes\"");
  EXPECT_CONTAINS(error(R"({"queue_dept": 8})"), "did you mean 'aio.queue_depth'?");
  EXPECT_CONTAINS(error("4096"), "\"aio\": 4096 is not valid");
}

TEST_F(ConfigTest, AioInsideZeroOptimizationSaysToMoveIt) {
  const std::string msg = config_error([&] {
    apply_json(R"({"zero_optimization": {"stage": 3, "aio": {"block_size": 1048576}}})");
  });
  EXPECT_CONTAINS(msg, "\"zero_optimization.aio\"");
  EXPECT_CONTAINS(msg, "move the \"aio\" section to the top level");
  // Inside an offload section too.
  EXPECT_CONTAINS(config_error([&] {
                    apply_json(
                        R"({"zero_optimization": {"offload_optimizer": {"device": "nvme",
                            "aio": {"queue_depth": 8}}}})");
                  }),
                  "move the \"aio\" section to the top level");
}

}  // namespace
}  // namespace shardtrain
