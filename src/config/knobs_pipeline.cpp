// The knobs of pipeline parallelism (PipelineConfig; DeepSpeed's pipeline section, whose stages,
// partition and activation_checkpoint_interval are DeepSpeed's and schedule and virtual_stages
// shardtrain's) and of activation checkpointing (DeepSpeed's activation_checkpointing section,
// runtime/activation_checkpointing/config.py), one row per key.
#include "config/knob.h"
#include "config/pipeline_schedule.h"

namespace shardtrain {

namespace {

template <typename T>
Knob pipe(T PipelineConfig::*m) {
  return knob_at(&TrainConfig::pipeline, m);
}

/// An activation_checkpointing option: any of them "on" turns activation checkpointing on; the
/// option itself (partitioning, CPU checkpoints, ...) is not implemented.
Knob turns_checkpointing_on(const std::string& key) {
  return Knob{}
      .json_key("activation_checkpointing." + key)
      .by_hand()  // read_activation_checkpointing
      .shows_default("false")
      .docs(
          "on: turns `--activation-checkpointing` on; the option itself is ignored (listed "
          "in the warning)");
}

}  // namespace

const KnobTable& pipeline_knobs() {
  static const KnobTable rows = {
      pipe(&PipelineConfig::stages)
          .json_key("pipeline.stages")
          .by_hand()  // > 1 selects the pipeline; "auto" is an error (read_pipeline)
          .train_flag("--pipeline-stages", "P")
          .at_least(1)
          .expects("an integer >= 1 (ranks per pipeline), e.g. 4")
          .docs("pipeline: ranks per pipeline P; the world size must be a multiple of P, world "
                "size / P being the data-parallel replicas; in the JSON > 1 selects the "
                "pipeline (DeepSpeed pipeline.stages; default: {})"),
      knob_enum(&TrainConfig::pipeline, &PipelineConfig::schedule, &parse_pipeline_schedule,
                {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "2bw"})
          .json_key("pipeline.schedule")
          .by_hand()  // any case, '_' for '-' (parse_pipeline_schedule)
          .train_flag("--pipeline-schedule", "SCHEDULE")
          .expects("a schedule name: gpipe, 1f1b, interleaved-1f1b, zb-h1 or 2bw")
          .shows_default("`\"1f1b\"`")
          .docs("pipeline: gpipe|1f1b|interleaved-1f1b|zb-h1|2bw; the micro-batches of a step "
                "are its --gradient-accumulation-steps (shardtrain's key; default: {})"),
      pipe(&PipelineConfig::virtual_stages)
          .json_key("pipeline.virtual_stages")
          .train_flag("--virtual-stages", "V")
          .at_least(1)
          .expects("an integer >= 1 (model chunks per rank; > 1 only with interleaved-1f1b)")
          .docs("pipeline: model chunks per rank V, 2 or more with interleaved-1f1b, 1 "
                "otherwise (shardtrain's key; default: {})"),
      pipe(&PipelineConfig::partition_method)
          .json_key("pipeline.partition_method", {"partition"})
          .by_hand()  // any case; DeepSpeed's "type:..." is an error (read_pipeline)
          .train_flag("--partition-method", "METHOD")
          .one_of({"parameters", "uniform", "time"})
          .flag_parsed_by(&check_partition_method)  // names the nearest method
          .expects("\"parameters\", \"uniform\" or \"time\"")
          .shows_default("`\"parameters\"`")
          .docs("pipeline: how blocks are cut into stages: uniform (equal block counts), "
                "parameters (balance parameter counts), time (balance measured per-layer time) "
                "(DeepSpeed partition_method; default: {})"),
      pipe(&PipelineConfig::activation_checkpoint_interval)
          .json_key("pipeline.activation_checkpoint_interval")
          .train_flag("--activation-checkpoint-interval", "K")
          .at_least(0)
          .expects("an integer >= 0 (blocks per activation checkpoint; 0 = off)")
          .docs("pipeline: K > 0 recomputes every transformer block of a stage from its input "
                "in backward (any K > 0 acts as 1); 0 = off, 1 with --activation-checkpointing "
                "(DeepSpeed activation_checkpoint_interval; default: {})"),
      ignored_key("pipeline.seed_layers"),
      ignored_key("pipeline.pipe_partitioned"),
      ignored_key("pipeline.grad_partitioned"),
  };
  return rows;
}

const KnobTable& activation_checkpointing_knobs() {
  static const KnobTable rows = {
      knob_at(&TrainConfig::activation_checkpointing)
          .train_flag("--activation-checkpointing")
          .on_estimate()
          .docs("recompute activations in the backward pass to save memory (default: off)"),
      turns_checkpointing_on("partition_activations"),
      turns_checkpointing_on("contiguous_memory_optimization"),
      turns_checkpointing_on("cpu_checkpointing"),
      turns_checkpointing_on("number_checkpoints")
          .expects("an integer >= 0 or null")
          .shows_default("null"),
      turns_checkpointing_on("synchronize_checkpoint_boundary"),
      turns_checkpointing_on("profile"),
  };
  return rows;
}

}  // namespace shardtrain
