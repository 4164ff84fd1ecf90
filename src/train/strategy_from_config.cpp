#include "train/strategy_from_config.h"

#include "parallel/pipeline/partition.h"

namespace shardtrain {

StrategyOptions strategy_options(const TrainConfig& cfg) {
  StrategyOptions o;
  o.plan = cfg.plan;  // derived once, by validate()
  o.optimizer = OptimizerHyper{cfg.beta1, cfg.beta2, cfg.adam_eps, cfg.weight_decay};
  o.optimizer.kind = cfg.optimizer;
  o.optimizer.momentum = cfg.momentum;
  o.optimizer.nesterov = cfg.nesterov;
  o.reduce_bucket_size = cfg.zero.reduce_bucket_size;
  o.reduce_bucket_size_set = cfg.zero.reduce_bucket_size_set;
  o.allgather_bucket_size = cfg.zero.allgather_bucket_size;
  o.overlap_comm = cfg.zero.overlap_comm;
  o.prefetch_bucket_size = cfg.zero.stage3_prefetch_bucket_size;
  o.param_persistence_threshold = cfg.zero.stage3_param_persistence_threshold;
  o.max_live_parameters = cfg.zero.stage3_max_live_parameters;
  o.max_reuse_distance = cfg.zero.stage3_max_reuse_distance;
  o.delayed_update = cfg.zero.offload_delayed_update;
  o.speculative_update = cfg.zero.offload_speculative_update;
  o.nvme_path = cfg.zero.nvme_path;
  o.aio = cfg.aio;
  o.optimizer_max_in_cpu = cfg.zero.offload_optimizer_max_in_cpu;
  o.optimizer_moment_dtype = cfg.zero.offload_moments_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  o.param_max_in_cpu = cfg.zero.offload_param_max_in_cpu;
  o.param_buffer_count = cfg.zero.offload_param_buffer_count;
  if (hierarchical_reduction(cfg)) o.hierarchical_ranks_per_node = cfg.ranks_per_node;
  o.hpz_partition_size = cfg.zero.hpz_partition_size;
  o.quantized_gradients = cfg.zero.quantized_gradients;
  return o;
}

std::unique_ptr<Strategy> make_strategy(const TrainConfig& cfg, Backend& backend,
                                        Communicator& comm) {
  return make_strategy(strategy_options(cfg), backend, comm);
}

std::unique_ptr<PipelineParallel> make_pipeline_strategy(const TrainConfig& cfg, Backend& backend,
                                                         Communicator& world) {
  PipelineOptions o;
  o.stages = cfg.pipeline.stages;
  o.schedule = cfg.pipeline.schedule;
  o.virtual_stages = cfg.pipeline.virtual_stages;
  o.partition = parse_partition_method(cfg.pipeline.partition_method);
  o.activation_checkpointing =
      cfg.activation_checkpointing || cfg.pipeline.activation_checkpoint_interval > 0;
  o.trace_dir = cfg.trace_dir;
  o.micro_batch = cfg.micro_batch_size;
  o.seq_len = cfg.max_length;
  return std::make_unique<PipelineParallel>(o, strategy_options(cfg), backend, world);
}

}  // namespace shardtrain
