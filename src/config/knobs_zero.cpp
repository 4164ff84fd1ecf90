// The zero_optimization knobs (ZeroConfig): DeepSpeed's zero_optimization section with its
// offload_optimizer and offload_param subsections (deepspeed/runtime/zero/config.py,
// offload_config.py), one row per key.
#include <algorithm>
#include <limits>

#include "config/knob.h"

namespace shardtrain {

namespace {

template <typename T>
Knob zero(T ZeroConfig::*m) {
  return knob_at(&TrainConfig::zero, m);
}

}  // namespace

const KnobTable& zero_knobs() {
  static const KnobTable rows = [] {
    KnobTable t = {
        // ---- zero_optimization ----
        zero(&ZeroConfig::stage)
            .json_key("zero_optimization.stage")
            .by_hand()  // also decides the strategy (read_zero)
            .train_flag("--zero-stage", "N")
            .one_of({"0", "1", "2", "3"})
            .in_snapshot("zero_optimization.stage")
            .expects("a ZeRO stage 0, 1, 2 or 3")
            .docs("ZeRO stage 0|1|2|3 (DeepSpeed zero_optimization.stage; 3 selects zero3; with "
                  "a pipeline 0, 1 or 2 across the data-parallel replicas) (default: {})"),
        zero(&ZeroConfig::reduce_bucket_size)
            .json_key("zero_optimization.reduce_bucket_size")
            .estimate_flag("--reduce-bucket-size", "N")
            .at_least(1)
            .on_json([](TrainConfig& c) { c.zero.reduce_bucket_size_set = true; })
            .in_snapshot("zero_optimization.reduce_bucket_size")
            .expects("an integer >= 1 (elements)")
            .shows_default("500,000,000 elements; when omitted, strategies that overlap the "
                           "reduction with backward on several ranks use 12,500,000")
            .docs("gradient bucket: elements reduced in one collective"),
        zero(&ZeroConfig::allgather_bucket_size)
            .json_key("zero_optimization.allgather_bucket_size")
            .at_least(1)
            .in_snapshot("zero_optimization.allgather_bucket_size")
            .expects("an integer >= 1 (elements)")
            .shows_default("500,000,000 elements")
            .docs("all-gathers in flight after a step"),
        zero(&ZeroConfig::overlap_comm)
            .json_key("zero_optimization.overlap_comm")
            .in_snapshot("zero_optimization.overlap_comm")
            .docs("false: reduce after backward, no zero3 prefetch"),
        ignored_key("zero_optimization.contiguous_gradients", KnobStatus::kAlwaysOn),
        ignored_key("zero_optimization.reduce_scatter", KnobStatus::kAlwaysOn),
        Knob{}
            .json_key("zero_optimization.offload_optimizer")
            .by_hand()
            .shows_default("`{\"device\": \"none\"}`"),
        Knob{}
            .json_key("zero_optimization.offload_param")
            .by_hand()
            .shows_default("`{\"device\": \"none\"}`"),
        Knob{}
            .json_key("zero_optimization.cpu_offload")
            .by_hand()
            .shows_default("false")
            .docs("old spelling of `offload_optimizer` `{\"device\": \"cpu\"}`"),
        Knob{}
            .json_key("zero_optimization.cpu_offload_param")
            .by_hand()
            .shows_default("false")
            .docs("old spelling of `offload_param` `{\"device\": \"cpu\"}`"),
        // ---- stage 3 (DeepSpeed's stage3_* keys, also without the prefix) ----
        zero(&ZeroConfig::stage3_prefetch_bucket_size)
            .json_key("zero_optimization.stage3_prefetch_bucket_size", {"prefetch_bucket_size"})
            .estimate_flag("--stage3-prefetch-bucket-size", "N")
            .at_least(0)
            .in_snapshot("zero_optimization.stage3_prefetch_bucket_size")
            .expects("an integer >= 0 (parameter elements gathered ahead of use; 0 = no "
                     "prefetch), e.g. 5e7")
            .docs("zero3: elements gathered ahead of the layer that needs them; 0 = no prefetch"),
        zero(&ZeroConfig::stage3_param_persistence_threshold)
            .json_key("zero_optimization.stage3_param_persistence_threshold",
                      {"param_persistence_threshold"})
            .estimate_flag("--stage3-param-persistence-threshold", "N")
            .at_least(0)
            .in_snapshot("zero_optimization.stage3_param_persistence_threshold")
            .expects("an integer >= 0 (layers with fewer parameters stay replicated; 0 = partition "
                     "every layer), e.g. 1e5")
            .docs("zero3: layers with fewer parameters stay replicated; above the largest layer a "
                  "warning says zero3 then saves nothing"),
        zero(&ZeroConfig::stage3_max_live_parameters)
            .json_key("zero_optimization.stage3_max_live_parameters", {"max_live_parameters"})
            .estimate_flag("--stage3-max-live-parameters", "N")
            .at_least(1)
            .in_snapshot("zero_optimization.stage3_max_live_parameters")
            .expects("an integer >= 1 (most gathered parameter elements alive at once on a "
                     "rank), e.g. 1e9")
            .docs("zero3: most gathered parameter elements alive at once on a rank"),
        zero(&ZeroConfig::stage3_max_reuse_distance)
            .json_key("zero_optimization.stage3_max_reuse_distance", {"max_reuse_distance"})
            .estimate_flag("--stage3-max-reuse-distance", "N")
            .at_least(0)
            .in_snapshot("zero_optimization.stage3_max_reuse_distance")
            .expects("an integer >= 0 (a gathered layer needed again within this many parameter "
                     "elements is kept; 0 = never kept), e.g. 1e9")
            .docs("zero3: a gathered layer needed again within this many parameter elements is "
                  "kept"),
        zero(&ZeroConfig::stage3_gather_16bit_weights_on_model_save)
            .json_key("zero_optimization.stage3_gather_16bit_weights_on_model_save",
                      {"gather_16bit_weights_on_model_save",
                       "stage3_gather_fp16_weights_on_model_save"})  // the last: deprecated
            .in_snapshot("zero_optimization.stage3_gather_16bit_weights_on_model_save")
            .docs("checkpoints also hold a consolidated bf16 `model.safetensors` (and a Hugging "
                  "Face `config.json`)"),
        // ---- ZeRO++ ----
        zero(&ZeroConfig::hpz_partition_size)
            .json_key("zero_optimization.zero_hpz_partition_size")
            .train_flag("--zero-hpz-partition-size", "N")
            .estimate_flag("--zero-hpz-partition-size")
            .at_least(1)
            .expects("an integer >= 1 (ranks that share one copy of the sharded model states, "
                     "e.g. the GPUs of a node; 1 = shard over every rank)")
            .docs("zero3 hybrid sharding (DeepSpeed ZeRO++'s zero_hpz_partition_size, FSDP2's "
                  "HSDP): shard parameters, gradients and optimizer state within groups of N "
                  "consecutive ranks (the GPUs of a node) and replicate them across groups, so "
                  "the layers' all-gathers stay in the group; the gradient shards are then "
                  "all-reduced across groups (default 1: shard over every rank)"),
        zero(&ZeroConfig::quantized_gradients)
            .json_key("zero_optimization.zero_quantized_gradients")
            .train_flag("--quantized-gradients")
            .in_snapshot("quantized_gradients")
            .docs("with --hierarchical-all-reduce (dp, zero1, zero2) or --zero-hpz-partition-size "
                  "(zero3): the gradients cross nodes as int8 with one scale per 256 elements "
                  "(DeepSpeed ZeRO++'s zero_quantized_gradients, qgZ), a quarter (fp32) or half "
                  "(bf16) of the bytes (default: off)"),
    };
    for (const char* key : {"cpu_offload_use_pin_memory",
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
                            "zero_quantized_nontrainable_weights"})
      t.push_back(ignored_key(std::string("zero_optimization.") + key));
    for (const char* key :
         {"model_persistence_threshold", "module_granularity_threshold",
          "use_all_reduce_for_fetch_params", "allgather_sequential", "partition_stream_chunk_size"})
      t.push_back(ignored_key(std::string("zero_optimization.stage3_") + key)
                      .json_key(std::string("zero_optimization.stage3_") + key, {key}));

    // ---- zero_optimization.offload_optimizer ----
    const KnobTable optimizer = {
        zero(&ZeroConfig::offload_optimizer_device)
            .json_key("zero_optimization.offload_optimizer.device")
            .one_of({"none", "cpu", "nvme"})
            .expects("\"none\", \"cpu\" or \"nvme\"")
            .docs("`\"none\"`, `\"cpu\"`, `\"nvme\"`; no offload with the pipeline"),
        zero(&ZeroConfig::nvme_path)
            .json_key("zero_optimization.offload_optimizer.nvme_path")
            .a_node_path()
            .train_flag("--nvme-path", "DIR")
            .estimate_flag("--nvme-path")
            .flag_checks(FlagCheck::kNone)
            .expects("a directory path")
            .docs("infinity: directory for the per-rank swap files of state offloaded to NVMe "
                  "(DeepSpeed offload_optimizer.nvme_path)"),
        zero(&ZeroConfig::offload_ratio)
            .json_key("zero_optimization.offload_optimizer.ratio")
            .train_flag("--offload-ratio", "R")
            .estimate_flag("--offload-ratio")
            .flag_checks(FlagCheck::kFinite)  // validate() checks [0, 1], naming the key too
            .at_least(0)
            .at_most(1)
            .called("offload ratio")
            .expects("a number in [0, 1] (the fraction of the optimizer state offloaded; 1 = all "
                     "of it, the default)")
            .docs("offload, infinity: fraction of the optimizer state and step on the host, the "
                  "rest on the GPU (DeepSpeed offload_optimizer.ratio) (default: {})"),
        zero(&ZeroConfig::offload_delayed_update)
            .json_key("zero_optimization.offload_optimizer.delayed_update")
            .train_flag("--offload-delayed-update")
            .estimate_flag("--offload-delayed-update")
            .docs("offload: ZeRO-Offload's one-step delayed parameter update: the CPU step of "
                  "step t runs while the GPU computes step t+1 on the parameters of step t-1 "
                  "(default: off, exact)"),
        zero(&ZeroConfig::offload_speculative_update)
            .json_key("zero_optimization.offload_optimizer.speculative_update")
            .train_flag("--offload-speculative-update", "BOOL")
            .bool_value()
            .docs("offload: start each part's host AdamW during backward, as soon as its "
                  "gradient is final, assuming no clipping; a step whose norm is clipped is "
                  "rolled back and redone (same results bit for bit when not clipped, to fp32 "
                  "rounding when redone). true (default) or false"),
        zero(&ZeroConfig::offload_moments_dtype)
            .json_key("zero_optimization.offload_optimizer.moments_dtype")
            .train_flag("--offload-moments-dtype", "DTYPE")
            .estimate_flag("--offload-moments-dtype")
            .one_of({"fp32", "bf16"})
            .expects("\"fp32\" or \"bf16\" (AdamW's m and v on the host)")
            .docs("offload: dtype of AdamW's m and v on the host and NVMe: fp32 (default) or "
                  "bf16 (rounded stochastically; 8 bytes of state per parameter instead of 12)"),
        zero(&ZeroConfig::offload_forward_group)
            .json_key("zero_optimization.offload_optimizer.forward_group")
            .train_flag("--offload-forward-group", "N")
            .estimate_flag("--offload-forward-group")
            .at_least(0)
            .expects("an integer >= 0 (micro-batches whose forward runs layer by layer; 0: all "
                     "of the step's)")
            .shows_default("0 (every micro-batch of the step when it applies)")
            .docs("offload: micro-batches at the start of each step whose forward runs layer by "
                  "layer, so that the host's update overlaps that many forwards (same results; "
                  "costs their layer inputs in GPU memory; needs activation checkpointing). "
                  "Default 0: every micro-batch of the step with an offloaded optimizer and "
                  "activation checkpointing, else 1"),
        zero(&ZeroConfig::offload_optimizer_max_in_cpu)
            .json_key("zero_optimization.offload_optimizer.max_in_cpu")
            .at_least(0)
            .expects("an integer >= 0 (elements whose optimizer state stays in host memory)")
            .docs("with `\"nvme\"`: elements per rank whose optimizer state (fp32 master, m, v) "
                  "stays in host memory; the rest is paged from the swap file. 0: all on NVMe, "
                  "as DeepSpeed"),
    };
    t.insert(t.end(), optimizer.begin(), optimizer.end());
    for (const char* key :
         {"buffer_count", "pin_memory", "pipeline_read", "pipeline_write", "fast_init",
          "super_offload", "convert_grad_on_cpu", "cpuadam_cores_perc", "pipeline"})
      t.push_back(ignored_key(std::string("zero_optimization.offload_optimizer.") + key));

    // ---- zero_optimization.offload_param ----
    const KnobTable param = {
        zero(&ZeroConfig::offload_param_device)
            .json_key("zero_optimization.offload_param.device")
            .one_of({"none", "cpu", "nvme"})
            .expects("\"none\", \"cpu\" or \"nvme\"")
            .docs("`\"none\"`, `\"cpu\"`, `\"nvme\"`; needs stage 3"),
        zero(&ZeroConfig::nvme_path)
            .json_key("zero_optimization.offload_param.nvme_path")
            .a_node_path()
            .overridden_by("--nvme-path")
            .expects("a directory path")
            .docs("as `offload_optimizer.nvme_path`"),
        zero(&ZeroConfig::offload_param_max_in_cpu)
            .json_key("zero_optimization.offload_param.max_in_cpu")
            .at_least(0)
            .unset_is(-1)
            .expects("an integer >= 0 (parameter elements kept in host memory)")
            .shows_default("none (all in host memory; DeepSpeed's default is 1e9)")
            .docs("with `\"nvme\"`: parameter elements per rank kept in pinned host memory, "
                  "whole layers in order while they fit; the others are paged from a swap file "
                  "under `nvme_path`"),
        zero(&ZeroConfig::offload_param_buffer_count)
            .json_key("zero_optimization.offload_param.buffer_count")
            .at_least(2)
            .expects("an integer >= 2 (pinned buffers the paged parameters are read into)")
            .docs("pinned buffers, each the size of the largest layer's slice, the paged "
                  "parameters are read into (more than 1024 read as 1024)"),
        ignored_key("zero_optimization.offload_param.buffer_size"),
        ignored_key("zero_optimization.offload_param.pin_memory"),
    };
    t.insert(t.end(), param.begin(), param.end());
    // buffer_count: any count >= 2 is accepted and at most 1024 buffers are made.
    Knob& buffers = *std::find_if(t.begin(), t.end(), [](const Knob& k) {
      return k.path == "zero_optimization.offload_param.buffer_count";
    });
    buffers.max = std::numeric_limits<double>::infinity();
    buffers.set = [](TrainConfig& c, const nlohmann::json& v) {
      c.zero.offload_param_buffer_count =
          static_cast<int>(std::min<int64_t>(v.get<int64_t>(), 1024));
    };
    return t;
  }();
  return rows;
}

}  // namespace shardtrain
