// The DeepSpeed JSON schema shardtrain reads (https://www.deepspeed.ai/docs/config-json/;
// DeepSpeed's deepspeed/runtime/config.py, zero/config.py, precision_config.py,
// lr_schedules.py): the keys each section honours and those it accepts and ignores, and the
// stage-3 sizes. Used by config/deepspeed_config.cpp and config/validate.cpp (the stage-3
// sizes).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"

namespace shardtrain::deepspeed {

using KeyList = std::vector<std::string>;

// Top-level keys shardtrain reads.
inline const KeyList kTopHonoured = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
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

inline const KeyList kZeroHonoured = {
    "stage",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "cpu_offload_param",
    "stage3_prefetch_bucket_size",
    "prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "param_persistence_threshold",
    "stage3_max_live_parameters",
    "max_live_parameters",
    "stage3_max_reuse_distance",
    "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "zero_hpz_partition_size",
    "zero_quantized_gradients",
};

// zero_optimization booleans that are on by default and cannot be turned off here: ZeRO keeps
// its gradients in contiguous flat buffers and reduce-scatters them. Listed as ignored (warned
// about) only when a config sets them to false.
inline const KeyList kZeroOnByDefaultIgnored = {"contiguous_gradients", "reduce_scatter"};

/// A stage-3 size of zero_optimization: DeepSpeed's stage3_* key, its unprefixed alias (DeepSpeed's
/// config model accepts both), the field it sets, the smallest valid value and what it means.
struct Stage3Size {
  const char* key;
  const char* alias;
  int64_t ZeroConfig::*field;
  int64_t min;
  const char* expected;
};

inline const Stage3Size kStage3Sizes[] = {
    {"stage3_prefetch_bucket_size", "prefetch_bucket_size",
     &ZeroConfig::stage3_prefetch_bucket_size, 0,
     "an integer >= 0 (parameter elements gathered ahead of use; 0 = no prefetch), e.g. 5e7"},
    {"stage3_param_persistence_threshold", "param_persistence_threshold",
     &ZeroConfig::stage3_param_persistence_threshold, 0,
     "an integer >= 0 (layers with fewer parameters stay replicated; 0 = partition every layer), "
     "e.g. 1e5"},
    {"stage3_max_live_parameters", "max_live_parameters", &ZeroConfig::stage3_max_live_parameters,
     1, "an integer >= 1 (most gathered parameter elements alive at once on a rank), e.g. 1e9"},
    {"stage3_max_reuse_distance", "max_reuse_distance", &ZeroConfig::stage3_max_reuse_distance, 0,
     "an integer >= 0 (a gathered layer needed again within this many parameter elements is "
     "kept; 0 = never kept), e.g. 1e9"},
};

inline const KeyList kZeroIgnored = {
    "cpu_offload_use_pin_memory",
    "sub_group_size",
    "round_robin_gradients",
    "elastic_checkpoint",
    "ignore_unused_parameters",
    "load_from_fp32_weights",
    "legacy_stage1",
    "allgather_partitions",
    "use_multi_rank_bucket_allreduce",
    "zenflow",
    "leaf_module",
    "zeropp_loco_param",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "stage3_model_persistence_threshold",
    "model_persistence_threshold",
    "stage3_module_granularity_threshold",
    "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "allgather_sequential",
    "stage3_partition_stream_chunk_size",
    "partition_stream_chunk_size",
};

inline const KeyList kOffloadHonoured = {
    "device",        "nvme_path",         "ratio", "delayed_update", "forward_group",
    "moments_dtype", "speculative_update"};
inline const KeyList kOffloadOptimizerIgnored = {
    "buffer_count",  "pin_memory",          "pipeline_read",      "pipeline_write", "fast_init",
    "super_offload", "convert_grad_on_cpu", "cpuadam_cores_perc", "pipeline",
};
inline const KeyList kOffloadParamIgnored = {"buffer_size", "pin_memory"};

// The top-level aio section (the NVMe swap's I/O; AioConfig). intra_op_parallelism is
// DeepSpeed's other name of thread_count; use_gds (GPUDirect Storage) is not implemented.
inline const KeyList kAioHonoured = {"block_size",    "queue_depth",    "thread_count",
                                     "single_submit", "overlap_events", "intra_op_parallelism"};
inline const KeyList kAioIgnored = {"use_gds"};

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

inline const KeyList kOptimizerHonoured = {"type", "params"};
inline const KeyList kOptimizerIgnored = {"legacy_fusion"};
inline const KeyList kAdamHonoured = {
    "lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad", "bias_correction"};
// torch.optim.SGD's arguments (dampening must be 0, maximize false: the update shardtrain runs).
inline const KeyList kSgdHonoured = {"lr",           "momentum",  "nesterov",
                                     "weight_decay", "dampening", "maximize"};
inline const KeyList kSgdIgnored = {"foreach", "differentiable", "fused"};
inline const KeyList kAdamIgnored = {"torch_adam",    "set_grad_none", "fp32_optimizer_states",
                                     "max_grad_norm", "fused",         "foreach",
                                     "capturable",    "differentiable"};

inline const KeyList kSchedulerHonoured = {"type", "params"};
inline const KeyList kWarmupLrHonoured = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                          "warmup_type"};
inline const KeyList kWarmupDecayLrHonoured = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                               "warmup_type", "total_num_steps"};
inline const KeyList kWarmupCosineLrHonoured = {"total_num_steps", "warmup_min_ratio",
                                                "warmup_num_steps", "cos_min_ratio", "warmup_type"};
inline const KeyList kSchedulerParamsIgnored = {"last_batch_iteration"};

inline const KeyList kFp16Honoured = {"enabled",           "loss_scale", "initial_scale_power",
                                      "loss_scale_window", "hysteresis", "min_loss_scale"};
inline const KeyList kFp16Ignored = {"auto_cast", "consecutive_hysteresis",
                                     "fp16_master_weights_and_grads", "fused_mode"};
inline const KeyList kBf16Honoured = {"enabled"};
inline const KeyList kBf16Ignored = {"immediate_grad_update", "check_grad_overflow",
                                     "bf16_master_weights_and_grads", "bf16_optimizer_states"};

// activation_checkpointing: any of these "on" turns activation checkpointing on; the options
// themselves (partitioning, CPU checkpointing, ...) are not implemented and are listed as ignored.
inline const KeyList kActivationCheckpointingKeys = {
    "partition_activations", "contiguous_memory_optimization",  "cpu_checkpointing",
    "number_checkpoints",    "synchronize_checkpoint_boundary", "profile"};

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
