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
#include "config/knob.h"
#include "core/strings.h"
#include "model/gpt2_config.h"
#include "parallel/memory_estimator.h"
#include "parallel/placement_planner.h"

namespace shardtrain {
namespace {

struct EstimateFlags {
  MemoryEstimateOptions options;  ///< everything but the model and the knobs
  /// The knobs estimate shares with train: --model, --max-length, zero_optimization's
  /// (config/knobs_zero.cpp), --activation-checkpointing, and the placement plan's
  /// --gpu-memory (per GPU; the plan is printed when it is given), --max-host-memory (per
  /// node), --peak-tflops (for the predicted MFU), --gradient-accumulation-steps (micro-batches
  /// per optimizer step, for the predicted step) and --train-batch-size (sequences per
  /// optimizer step over all GPUs; > 0: also choose the micro-batch and accumulation,
  /// choose_batch).
  TrainConfig knobs;
  bool reduce_bucket_size_given = false;
  // The placement plan (parallel/placement_planner.h).
  int gpus_per_node = 0;    ///< 0: every GPU on one node
  std::string limits_file;  ///< bench/host_limits.cu's JSON
  double gpu_tflops = 0;    ///< effective; 0: MachineRates' default
};

/// The tables whose rows estimate takes as flags.
std::vector<const KnobTable*> estimate_tables() {
  return {&run_knobs(), &data_knobs(), &zero_knobs(), &activation_checkpointing_knobs(),
          &top_level_knobs()};
}

/// For a global batch of f.knobs.train_batch_size sequences: prints plan_batch's splits
/// (micro-batch × accumulation), each one's chosen plan, its predicted step, tokens/s and MFU, and
/// marks the chosen split.
void choose_batch(const EstimateFlags& f, const MemoryEstimateOptions& base,
                  const PlacementBudget& budget, const MachineRates& rates) {
  const int64_t S = f.knobs.train_batch_size, T = base.max_length;
  fmt::print(
      "\nGlobal batch {} sequences × {} tokens over {} GPU{}: micro-batch × accumulation and "
      "the plan for each (predicted, at the rates above; MFU against {:g} TFLOP/s):\n\n",
      with_commas(S), T, base.gpus, base.gpus > 1 ? "s" : "", f.knobs.peak_tflops);
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
                       (f.knobs.peak_tflops * 1e12 * static_cast<double>(base.gpus));
    const std::string name =
        c.forward_group > 1 ? fmt::format("{} g={}", c.name, c.forward_group) : c.name;
    fmt::print("{}{:>22}  {:<22} {:>10} {:>10.3f} {:>12.0f} {:>5.1f}%  {}\n", mark, shape, name,
               human_bytes(c.gpu_bytes), c.step_s, s.tokens_per_s, 100.0 * mfu, c.bound);
  }
  if (batch.chosen)
    fmt::print(
        "\nchosen (*): the fastest predicted (within 2%, the largest micro-batch: the GPU is "
        "counted at one rate, which longer GEMMs come closer to); train with {0} M {1} A and "
        "{3} auto (or the plan's flags), or give {3} auto only the global batch ({2}) and it "
        "chooses the same\n",
        knob_for(&TrainConfig::micro_batch_size).name(),
        knob_for(&TrainConfig::gradient_accumulation_steps).name(),
        knob_for(&TrainConfig::train_batch_size).name(),
        knob_for(&TrainConfig::placement, &PlacementConfig::automatic).name());
  else
    fmt::print("\nno micro-batch fits: more GPUs, more memory, or activation checkpointing\n");
}

void run_estimate(const EstimateFlags& f) {
  for (const KnobTable* table : estimate_tables()) check_knob_ranges(f.knobs, *table);
  MemoryEstimateOptions o = f.options;
  o.activation_checkpointing = f.knobs.activation_checkpointing;
  o.model = resolve_model(f.knobs.model);
  o.max_length = f.knobs.max_length;
  const ZeroConfig& z = f.knobs.zero;
  if (f.reduce_bucket_size_given) o.reduce_bucket_size = z.reduce_bucket_size;
  o.zero3 = Zero3Limits{z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters,
                        z.stage3_max_reuse_distance};
  o.persistence_threshold = z.stage3_param_persistence_threshold;
  o.offload_ratio = z.offload_ratio;
  o.delayed_update = z.offload_delayed_update;
  o.bf16_moments = z.offload_moments_dtype == "bf16";
  o.forward_group = z.offload_forward_group;
  o.hpz_partition_size = static_cast<int>(std::min<int64_t>(z.hpz_partition_size, 1 << 30));
  fmt::print("{}", format_memory_estimate(estimate_memory(o), o));
  const PlacementConfig& p = f.knobs.placement;
  if (p.gpu_memory_gib <= 0) return;
  const int per_node = f.gpus_per_node > 0 ? std::min(f.gpus_per_node, o.gpus) : o.gpus;
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  const PlacementBudget budget =
      rank_budget(p.gpu_memory_gib * kGiB, p.max_host_memory_gib * kGiB, z.nvme_path, per_node);
  MachineRates rates =
      f.limits_file.empty() ? MachineRates{} : MachineRates::from_limits_file(f.limits_file);
  if (f.gpu_tflops > 0) rates.gpu_flops = f.gpu_tflops * 1e12;
  const double tokens =
      static_cast<double>(o.micro_batch * o.max_length * f.knobs.gradient_accumulation_steps);
  fmt::print("\n{}",
             format_placement_plan(plan_placement(o, budget, rates, tokens), budget, rates));
  if (f.knobs.train_batch_size > 0) choose_batch(f, o, budget, rates);
}

}  // namespace

void register_estimate_command(CLI::App& app) {
  auto f = std::make_shared<EstimateFlags>();
  CLI::App* cmd = app.add_subcommand(
      "estimate",
      "estimate GPU memory per rank for dp, zero1, zero2 and zero3 (ZeRO paper formulas)");
  MemoryEstimateOptions& o = f->options;
  cmd->add_option("--gpus", o.gpus, "data-parallel GPUs N (default 1)");
  cmd->add_option_function<std::string>(
         "--optimizer", [&o](const std::string& s) { o.optimizer = parse_optimizer(s); },
         "adamw (K = 12 bytes of optimizer state per parameter) or sgd (K = 8) (default adamw)")
      ->type_name("NAME");
  cmd->add_option("--micro-batch", o.micro_batch,
                  fmt::format("sequences per GPU per micro-step (default {})", o.micro_batch));
  // --model, --max-length, --reduce-bucket-size, --stage3-*, --offload-*,
  // --zero-hpz-partition-size, --nvme-path, --activation-checkpointing, the placement plan's
  // budgets, --peak-tflops, --gradient-accumulation-steps and --train-batch-size: train's rows,
  // with estimate's defaults and what they mean here.
  TrainConfig& k = f->knobs;
  k.model = "gpt2";
  k.max_length = o.max_length;
  for (const KnobTable* table : estimate_tables()) add_knob_flags(*cmd, k, *table, kEstimateFlag);
  const auto describe = [cmd](const Knob& row, const std::string& text) {
    cmd->get_option(row.name())->description(text);
  };
  describe(knob_for(&TrainConfig::model),
           fmt::format("model preset, or the path of a Hugging Face style config.json (default "
                       "{})",
                       k.model));
  describe(knob_for(&TrainConfig::max_length),
           fmt::format("tokens per sequence (default {})", k.max_length));
  describe(knob_for(&TrainConfig::gradient_accumulation_steps),
           "placement plan: micro-batches per optimizer step, for the predicted step (default 1)");
  describe(knob_for(&TrainConfig::train_batch_size),
           "placement plan: a global batch in sequences (DeepSpeed train_batch_size): also try "
           "every micro-batch of 1..64 that divides it, with the accumulation that makes it up, "
           "and mark the fastest predicted");
  describe(knob_for(&TrainConfig::peak_tflops),
           fmt::format("the GPU's dense bf16 peak, for the predicted MFU (default {:g})",
                       k.peak_tflops));
  describe(knob_for(&TrainConfig::placement, &PlacementConfig::gpu_memory_gib),
           "GiB of memory per GPU: also plan where the state lives (GPU, host, NVMe) so the "
           "model fits with the fewest bytes over PCIe and the disk per step");
  describe(knob_for(&TrainConfig::placement, &PlacementConfig::max_host_memory_gib),
           "placement plan: GiB of host memory of a node the ranks may use (default: none)");
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
  cmd->callback([f, cmd]() {
    f->reduce_bucket_size_given =
        cmd->get_option(zero_knob(&ZeroConfig::reduce_bucket_size).name())->count() > 0;
    run_estimate(*f);
  });
}

}  // namespace shardtrain
