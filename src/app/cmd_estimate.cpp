// `shardtrain estimate`: GPU memory per rank of a model under dp, zero1, zero2 and zero3, from the
// ZeRO paper's model-state formulas and the activations GPT2Model allocates
// (parallel/memory_estimator.h).
#include <fmt/core.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "app/commands.h"
#include "core/strings.h"
#include "model/gpt2_config.h"
#include "parallel/memory_estimator.h"
#include "parallel/placement_planner.h"

namespace shardtrain {
namespace {

struct EstimateFlags {
  std::string model = "gpt2";
  MemoryEstimateOptions options;  ///< everything but the model
  // The placement plan (parallel/placement_planner.h), printed when --gpu-memory is given.
  double gpu_memory_gib = 0;   ///< per GPU
  double host_memory_gib = 0;  ///< per node
  std::string nvme_path;       ///< its free space is the NVMe budget of a node
  int gpus_per_node = 0;       ///< 0: every GPU on one node
  int64_t accumulation = 1;    ///< micro-batches per optimizer step (the plan's step time)
  /// train_batch_size: sequences per optimizer step over all GPUs; > 0: also choose the
  /// micro-batch and accumulation (choose_batch).
  int64_t train_batch_size = 0;
  double peak_tflops = 989.0;  ///< for the predicted MFU
  std::string limits_file;     ///< bench/host_limits.cu's JSON
  double gpu_tflops = 0;       ///< effective; 0: MachineRates' default
};

/// For a global batch of f.train_batch_size sequences: prints plan_batch's splits (micro-batch ×
/// accumulation), each one's chosen plan, its predicted step, tokens/s and MFU, and marks the
/// chosen split.
void choose_batch(const EstimateFlags& f, const MemoryEstimateOptions& base,
                  const PlacementBudget& budget, const MachineRates& rates) {
  const int64_t S = f.train_batch_size, T = base.max_length;
  fmt::print(
      "\nGlobal batch {} sequences × {} tokens over {} GPU{}: micro-batch × accumulation and "
      "the plan for each (predicted, at the rates above; MFU against {:g} TFLOP/s):\n\n",
      with_commas(S), T, base.gpus, base.gpus > 1 ? "s" : "", f.peak_tflops);
  fmt::print("  {:>22}  {:<22} {:>10} {:>10} {:>12} {:>6}  {}\n", "micro-batch × accum.", "plan",
             "GPU", "step (s)", "tokens/s", "MFU", "bound");
  const BatchPlan batch = plan_batch(base, budget, rates, S);
  for (size_t i = 0; i < batch.splits.size(); ++i) {
    const BatchSplit& s = batch.splits[i];
    const std::string shape = fmt::format("{} × {}", s.micro_batch, s.accumulation);
    const char mark = batch.chosen && *batch.chosen == i ? '*' : ' ';
    if (!s.plan.chosen) {
      fmt::print("{}{:>22}  nothing fits\n", mark, shape);
      continue;
    }
    const Placement& c = s.plan.candidates[*s.plan.chosen];
    const double mfu = base.model.flops_per_token(T) * s.tokens_per_s /
                       (f.peak_tflops * 1e12 * static_cast<double>(base.gpus));
    const std::string name =
        c.forward_group > 1 ? fmt::format("{} g={}", c.name, c.forward_group) : c.name;
    fmt::print("{}{:>22}  {:<22} {:>10} {:>10.3f} {:>12.0f} {:>5.1f}%  {}\n", mark, shape, name,
               human_bytes(c.gpu_bytes), c.step_s, s.tokens_per_s, 100.0 * mfu, c.bound);
  }
  if (batch.chosen)
    fmt::print(
        "\nchosen (*): the fastest predicted (within 2%, the largest micro-batch: the GPU is "
        "counted at one rate, which longer GEMMs come closer to); train with --batch-size M "
        "--gradient-accumulation-steps A and --offload auto (or the plan's flags), or give "
        "--offload auto only the global batch (--train-batch-size) and it chooses the same\n");
  else
    fmt::print("\nno micro-batch fits: more GPUs, more memory, or activation checkpointing\n");
}

void run_estimate(const EstimateFlags& f) {
  MemoryEstimateOptions o = f.options;
  o.model = resolve_model(f.model);
  fmt::print("{}", format_memory_estimate(estimate_memory(o), o));
  if (f.gpu_memory_gib <= 0) return;
  const int per_node = f.gpus_per_node > 0 ? std::min(f.gpus_per_node, o.gpus) : o.gpus;
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  const PlacementBudget budget =
      rank_budget(f.gpu_memory_gib * kGiB, f.host_memory_gib * kGiB, f.nvme_path, per_node);
  MachineRates rates =
      f.limits_file.empty() ? MachineRates{} : MachineRates::from_limits_file(f.limits_file);
  if (f.gpu_tflops > 0) rates.gpu_flops = f.gpu_tflops * 1e12;
  const double tokens = static_cast<double>(o.micro_batch * o.max_length * f.accumulation);
  fmt::print("\n{}",
             format_placement_plan(plan_placement(o, budget, rates, tokens), budget, rates));
  if (f.train_batch_size > 0) choose_batch(f, o, budget, rates);
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
  cmd->add_option("--gradient-accumulation-steps", f->accumulation,
                  "placement plan: micro-batches per optimizer step, for the predicted step "
                  "(default 1)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--train-batch-size", f->train_batch_size,
                  "placement plan: a global batch in sequences (DeepSpeed train_batch_size): also "
                  "try every micro-batch of 1..64 that divides it, with the accumulation that "
                  "makes it up, and mark the fastest predicted")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--peak-tflops", f->peak_tflops,
                  "the GPU's dense bf16 peak, for the predicted MFU (default 989)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--offload-ratio", o.offload_ratio,
                  "offloaded plans: fraction r of the optimizer state on the host (default 1)");
  cmd->add_flag("--offload-delayed-update", o.delayed_update,
                "offloaded plans: the delayed update's second pinned gradient buffer");
  cmd->add_option_function<std::string>(
         "--offload-moments-dtype", [&o](const std::string& s) { o.bf16_moments = s == "bf16"; },
         "offloaded plans: dtype of AdamW's m and v on the host and NVMe: fp32 (default) or bf16 "
         "(8 bytes of state per parameter instead of 12)")
      ->type_name("DTYPE")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--offload-forward-group", o.forward_group,
                  "offload with activation checkpointing: micro-batches whose forward runs layer "
                  "by layer (train's --offload-forward-group), their layer inputs live at once; "
                  "0 (default): each plan chooses the fewest that hide the host's update and fit")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--zero-hpz-partition-size", o.hpz_partition_size,
                  "zero3 hybrid sharding: add the row zero3-hybrid, sharded within groups of G "
                  "GPUs (e.g. a node's) and replicated across them (default 1: no such row)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--stage3-param-persistence-threshold", o.persistence_threshold,
                  "zero3: layers with fewer parameters stay replicated (default 100,000)");
  cmd->add_option("--gpu-memory", f->gpu_memory_gib,
                  "GiB of memory per GPU: also plan where the state lives (GPU, host, NVMe) so "
                  "the model fits with the fewest bytes over PCIe and the disk per step")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-host-memory", f->host_memory_gib,
                  "placement plan: GiB of host memory of a node the ranks may use (default 0)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--nvme-path", f->nvme_path,
                  "placement plan: the directory for NVMe swap files; its free space is a node's "
                  "NVMe budget (default: none)");
  cmd->add_option("--gpus-per-node", f->gpus_per_node,
                  "placement plan: GPUs (ranks) per node sharing its host memory and disk "
                  "(default: all --gpus)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--limits", f->limits_file,
                  "placement plan: the machine's measured rates, the limits.json of `bash "
                  "bench/run.sh limits` (default: one H100 machine's, docs/BENCHMARKS.md)");
  cmd->add_option("--gpu-tflops", f->gpu_tflops,
                  "placement plan: effective GPU TFLOP/s for the compute part of a step (default "
                  "396: 40% of an H100's bf16 peak)")
      ->check(CLI::PositiveNumber);
  cmd->callback([f]() { run_estimate(*f); });
}

}  // namespace shardtrain
