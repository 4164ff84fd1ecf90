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
  o.zero = cfg.zero;
  o.aio = cfg.aio;
  if (hierarchical_reduction(cfg)) o.hierarchical_ranks_per_node = cfg.ranks_per_node;
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
