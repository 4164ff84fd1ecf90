// `shardtrain estimate`: GPU memory per rank of a model under dp, zero1, zero2 and zero3, from the
// ZeRO paper's model-state formulas and the activations GPT2Model allocates
// (parallel/memory_estimator.h).
#include <fmt/core.h>

#include <memory>
#include <string>

#include "app/commands.h"
#include "model/gpt2_config.h"
#include "parallel/memory_estimator.h"

namespace shardtrain {
namespace {

struct EstimateFlags {
  std::string model = "gpt2";
  MemoryEstimateOptions options;  ///< everything but the model
};

void run_estimate(const EstimateFlags& f) {
  MemoryEstimateOptions o = f.options;
  o.model = resolve_model(f.model);
  fmt::print("{}", format_memory_estimate(estimate_memory(o), o));
}

}  // namespace

void register_estimate_command(CLI::App& app) {
  auto f = std::make_shared<EstimateFlags>();
  CLI::App* cmd = app.add_subcommand(
      "estimate",
      "estimate GPU memory per rank for dp, zero1, zero2 and zero3 (ZeRO paper formulas)");
  cmd->add_option("--model", f->model,
                  fmt::format("model preset, or the path of a Hugging Face style config.json "
                              "(default {})",
                              f->model))
      ->type_name("NAME|PATH");
  MemoryEstimateOptions& o = f->options;
  cmd->add_option("--gpus", o.gpus, "data-parallel GPUs N (default 1)");
  cmd->add_option_function<std::string>(
         "--optimizer", [&o](const std::string& s) { o.optimizer = parse_optimizer(s); },
         "adamw (K = 12 bytes of optimizer state per parameter) or sgd (K = 8) (default adamw)")
      ->type_name("NAME");
  cmd->add_option("--micro-batch", o.micro_batch,
                  fmt::format("sequences per GPU per micro-step (default {})", o.micro_batch));
  cmd->add_option("--max-length", o.max_length,
                  fmt::format("tokens per sequence (default {})", o.max_length));
  cmd->add_flag("--activation-checkpointing", o.activation_checkpointing,
                "recompute block activations in backward (keeps one block's set)");
  cmd->add_option("--reduce-bucket-size", o.reduce_bucket_size,
                  "zero_optimization.reduce_bucket_size in elements (default: 12,500,000 on "
                  "several GPUs, 500,000,000 on one, as train chooses)");
  cmd->add_option("--stage3-prefetch-bucket-size", o.zero3.prefetch_bucket_size,
                  "zero3: elements gathered ahead (default 50,000,000)");
  cmd->add_option("--stage3-max-live-parameters", o.zero3.max_live_parameters,
                  "zero3: most gathered elements alive (default 1,000,000,000)");
  cmd->add_option("--stage3-max-reuse-distance", o.zero3.max_reuse_distance,
                  "zero3: keep a layer needed again within this many elements (default "
                  "1,000,000,000)");
  cmd->add_option("--offload-ratio", o.offload_ratio,
                  "offloaded plans: fraction r of the optimizer state on the host (default 1)");
  cmd->add_flag("--offload-delayed-update", o.delayed_update,
                "offloaded plans: the delayed update's second pinned gradient buffer");
  cmd->add_option("--zero-hpz-partition-size", o.hpz_partition_size,
                  "zero3 hybrid sharding: add the row zero3-hybrid, sharded within groups of G "
                  "GPUs (e.g. a node's) and replicated across them (default 1: no such row)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--stage3-param-persistence-threshold", o.persistence_threshold,
                  "zero3: layers with fewer parameters stay replicated (default 100,000)");
  cmd->callback([f]() { run_estimate(*f); });
}

}  // namespace shardtrain
