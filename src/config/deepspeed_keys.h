// The DeepSpeed JSON schema shardtrain reads (https://www.deepspeed.ai/docs/config-json/;
// DeepSpeed's deepspeed/runtime/config.py, zero/config.py, precision_config.py,
// lr_schedules.py): the keys each section honours and those it accepts and ignores, for the
// sections not yet in knob tables (config/knob.h). Used by config/deepspeed_config.cpp.
#pragma once

#include <fmt/core.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "config/knob.h"

namespace shardtrain::deepspeed {

using KeyList = std::vector<std::string>;

// Top-level keys shardtrain reads: these and the rows of top_level_knobs().
inline const KeyList kTopHonoured = [] {
  KeyList keys = {
      "optimizer",
      "scheduler",
      "fp16",
      "bf16",
      "bfloat16",
      "zero_optimization",
      "activation_checkpointing",
      "aio",
      "pipeline",
      "tensorboard",
      "csv_monitor",
      "flops_profiler",
  };
  for (const std::string& k : honoured_keys(top_level_knobs(), "")) keys.push_back(k);
  return keys;
}();

// Top-level DeepSpeed keys shardtrain accepts and ignores.
inline const KeyList kTopIgnored = {
    "memory_breakdown",
    "dump_state",
    "prescale_gradients",
    "gradient_predivide_factor",
    "gradient_allreduce_op",
    "sparse_gradients",
    "amp",
    "torch_autocast",
    "communication_data_type",
    "seq_parallel_comm_data_type",
    "disable_allgather",
    "wandb",
    "comet",
    "comms_logger",
    "autotuning",
    "elasticity",
    "data_efficiency",
    "curriculum_learning",
    "sparse_attention",
    "compression_training",
    "quantize_training",
    "eigenvalue",
    "progressive_layer_drop",
    "checkpoint",
    "data_types",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "graph_harvesting",
    "dataloader_drop_last",
    "vocabulary_size",
    "hybrid_engine",
    "use_data_before_expert_parallelism",
    "nebula",
    "compile",
    "timers",
    "tensor_parallel",
    "expert_parallel",
    "sequence_parallel_size",
    "weight_quantization",
    "log_level",
    "managed_gradient_accumulation",
    "allgather_size",
};

// zero_optimization's keys, from its rows (config/knobs_zero.cpp).
inline const KeyList kZeroHonoured = honoured_keys(zero_knobs(), "zero_optimization");

// The aio and fp16 sections' keys, from their rows (config/knobs_sections.cpp).
inline const KeyList kAioHonoured = honoured_keys(aio_knobs(), "aio");
inline const KeyList kFp16Honoured = honoured_keys(fp16_knobs(), "fp16");

// The monitor sections and flops_profiler, from their rows (config/knobs_monitors.cpp).
inline const KeyList kTensorboardHonoured = honoured_keys(monitor_knobs(), "tensorboard");
inline const KeyList kCsvMonitorHonoured = honoured_keys(monitor_knobs(), "csv_monitor");
inline const KeyList kFlopsProfilerHonoured = honoured_keys(monitor_knobs(), "flops_profiler");

// The pipeline and activation_checkpointing sections' keys, from their rows
// (config/knobs_pipeline.cpp).
inline const KeyList kPipelineHonoured = honoured_keys(pipeline_knobs(), "pipeline");
inline const KeyList kActivationCheckpointingKeys =
    honoured_keys(activation_checkpointing_knobs(), "activation_checkpointing");

// The optimizer's and the scheduler's params, from their rows (config/knobs_optimizer.cpp), for
// kSections.
inline const KeyList kAdamHonoured = honoured_keys(optimizer_knobs(), "optimizer.params", "AdamW");
inline const KeyList kWarmupDecayLrHonoured =
    honoured_keys(scheduler_knobs(), "scheduler.params", "WarmupDecayLR");
inline const KeyList kWarmupCosineLrHonoured =
    honoured_keys(scheduler_knobs(), "scheduler.params", "WarmupCosineLR");

// Keys of the honoured sections, to say where a misplaced key belongs.
inline const std::vector<std::pair<std::string, const KeyList*>> kSections = {
    {"", &kTopHonoured},
    {"zero_optimization", &kZeroHonoured},
    {"optimizer.params", &kAdamHonoured},
    {"scheduler.params", &kWarmupDecayLrHonoured},
    {"scheduler.params", &kWarmupCosineLrHonoured},
    {"fp16", &kFp16Honoured},
    {"activation_checkpointing", &kActivationCheckpointingKeys},
    {"aio", &kAioHonoured},
    {"pipeline", &kPipelineHonoured},
    {"tensorboard", &kTensorboardHonoured},
    {"csv_monitor", &kCsvMonitorHonoured},
    {"flops_profiler", &kFlopsProfilerHonoured},
};

// Keys of the CONFIG dict of the DeepSpeed GPT-2 tutorials, which are flags here, not JSON keys:
// each with what to use instead (built on first use: it names rows of the knob tables).
inline const std::vector<std::pair<std::string, std::string>>& tutorial_keys() {
  static const std::vector<std::pair<std::string, std::string>> keys = [] {
    // "--flag (or json.key)", or the flag alone.
    const auto use = [](const Knob& k) {
      return k.path.empty() ? k.name() : fmt::format("{} (or {})", k.name(), k.path);
    };
    const auto flag = [](auto TrainConfig::*m) { return knob_for(m).name(); };
    const std::string batch = use(knob_for(&TrainConfig::micro_batch_size));
    const std::string epochs = flag(&TrainConfig::epochs);
    const std::string lr = use(knob_for(&TrainConfig::lr));
    return std::vector<std::pair<std::string, std::string>>{
        {"model", flag(&TrainConfig::model)},
        {"strategy", fmt::format("{} (or {})", flag(&TrainConfig::strategy_name),
                                 zero_knob(&ZeroConfig::stage).path)},
        {"batch_size", batch},
        {"micro_batch_size", batch},
        {"epochs", epochs},
        {"num_epochs", epochs},
        {"max_length", flag(&TrainConfig::max_length)},
        {"num_samples", flag(&TrainConfig::num_samples)},
        {"seed", flag(&TrainConfig::seed)},
        {"lr", lr},
        {"learning_rate", lr},
        {"weight_decay", use(knob_for(&TrainConfig::weight_decay))},
        {"max_steps", flag(&TrainConfig::max_steps)},
        {"warmup_steps", use(knob_for(&TrainConfig::warmup_steps))},
        {"dataset", flag(&TrainConfig::dataset)},
        {"output_dir", flag(&TrainConfig::output_dir)},
        {"local_rank", "the launcher's environment (LOCAL_RANK)"},
    };
  }();
  return keys;
}

}  // namespace shardtrain::deepspeed
