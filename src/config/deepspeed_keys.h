// The DeepSpeed JSON schema shardtrain reads (https://www.deepspeed.ai/docs/config-json/;
// DeepSpeed's deepspeed/runtime/config.py, zero/config.py, precision_config.py,
// lr_schedules.py): the keys each section honours and those it accepts and ignores, for the
// sections not yet in knob tables (config/knob.h). Used by config/deepspeed_config.cpp.
#pragma once

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
      "train_batch_size",
      "train_micro_batch_size_per_gpu",
      "gradient_accumulation_steps",
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

// The monitor sections "tensorboard" and "csv_monitor" (DeepSpeed's monitor/config.py).
inline const KeyList kMonitorHonoured = {"enabled", "output_path", "job_name"};

// The flops_profiler section (DeepSpeed's profiling/config.py; FlopsProfilerConfig).
inline const KeyList kFlopsProfilerHonoured = {"enabled",     "profile_step", "module_depth",
                                               "top_modules", "detailed",     "output_file"};

// The top-level pipeline section (PipelineConfig). DeepSpeed's keys stages, partition (DeepSpeed's
// config name; partition_method is PipelineModule's) and activation_checkpoint_interval, and
// shardtrain's schedule and virtual_stages. seed_layers and the tensor-parallel options
// pipe_partitioned / grad_partitioned are not implemented.
inline const KeyList kPipelineHonoured = {"stages",    "partition_method",
                                          "partition", "activation_checkpoint_interval",
                                          "schedule",  "virtual_stages"};
inline const KeyList kPipelineIgnored = {"seed_layers", "pipe_partitioned", "grad_partitioned"};

inline const KeyList kBf16Honoured = {"enabled"};
inline const KeyList kBf16Ignored = {"immediate_grad_update", "check_grad_overflow",
                                     "bf16_master_weights_and_grads", "bf16_optimizer_states"};

// activation_checkpointing: any of these "on" turns activation checkpointing on; the options
// themselves (partitioning, CPU checkpointing, ...) are not implemented and are listed as ignored.
inline const KeyList kActivationCheckpointingKeys = {
    "partition_activations", "contiguous_memory_optimization",  "cpu_checkpointing",
    "number_checkpoints",    "synchronize_checkpoint_boundary", "profile"};

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
    {"tensorboard", &kMonitorHonoured},
    {"csv_monitor", &kMonitorHonoured},
    {"flops_profiler", &kFlopsProfilerHonoured},
};

// Keys of the CONFIG dict of the DeepSpeed GPT-2 tutorials, which are flags here, not JSON keys.
inline const std::vector<std::pair<std::string, std::string>> kTutorialKeys = {
    {"model", "--model"},
    {"strategy", "--strategy (or zero_optimization.stage)"},
    {"batch_size", "--batch-size (or train_micro_batch_size_per_gpu)"},
    {"micro_batch_size", "--batch-size (or train_micro_batch_size_per_gpu)"},
    {"epochs", "--epochs"},
    {"num_epochs", "--epochs"},
    {"max_length", "--max-length"},
    {"num_samples", "--num-samples"},
    {"seed", "--seed"},
    {"lr", "--lr (or optimizer.params.lr)"},
    {"learning_rate", "--lr (or optimizer.params.lr)"},
    {"weight_decay", "--weight-decay (or optimizer.params.weight_decay)"},
    {"max_steps", "--max-steps"},
    {"warmup_steps", "--warmup-steps (or scheduler.params.warmup_num_steps)"},
    {"dataset", "--dataset"},
    {"output_dir", "--output-dir"},
    {"local_rank", "the launcher's environment (LOCAL_RANK)"},
};

}  // namespace shardtrain::deepspeed
