// Placement planner: where each part of the training state lives — GPU, pinned host memory or
// NVMe — so that a model fits a machine's budgets with the shortest predicted step (the question
// ZeRO-Offload and ZeRO-Infinity answer by hand: Ren et al., arXiv 2101.06840 §4, and
// Rajbhandari et al., arXiv 2104.07857 §5).
//
// The candidates are the plans the engine runs, each from the memory estimator
// (parallel/memory_estimator.h): dp, zero1, zero2, zero3 on the GPUs; offload (zero2 with a
// fraction r of the optimizer state and its step on the host); zero3-offload (zero3, optimizer
// fraction r and the parameters on the host); infinity (zero3, optimizer fraction r on NVMe,
// parameters on the host), for r in {0.25, 0.5, 0.75, 1}. A candidate fits when its GPU, host
// and NVMe bytes per rank are within the budgets (less placement_margins). Of those that fit, the
// planner takes the one with the shortest predicted step; among those within 2% of it, the one
// with the fewest bytes per step over PCIe and the disk, then the lowest ZeRO stage (DeepSpeed's
// advice: the least sharding that fits). An offload plan (stages 1-2) also chooses its forward
// group: the fewest micro-batches whose forward covers the host's update, as many as fit.
//
// Bytes per rank per step (Ψ parameters over N ranks, K bytes of optimizer state per parameter):
//  * PCIe: an offloaded optimizer fraction r sends its bf16 gradients down and gets its bf16
//    parameters back, 2·2rΨ/N; parameters on the host cross twice more per micro-batch, once
//    for its forward's gathers and once for its backward's, 2·2Ψ/N × micro-batches;
//  * host memory, by the CPU optimizer: (2K + 4)·rΨ/N (AdamW: read master, m, v and the bf16
//    gradient, write master, m, v and the bf16 parameter: 28 bytes per element; SGD 20);
//  * disk: NVMe optimizer state read and written once, 2·12rΨ/N (2·8rΨ/N with bf16 moments).
// The predicted step time: compute (6Ψ-style model FLOPs per token × tokens per rank ÷ the GPU's
// effective FLOP/s) plus what the host's update — host bytes ÷ the CPU optimizer's bandwidth, or
// disk bytes ÷ the disk bandwidth when slower — does not hide behind the next forward (a quarter
// of the compute under activation checkpointing, × forward group ÷ micro-batches: the update
// needs the whole clipped gradient, so it cannot overlap backward), or PCIe bytes ÷ the pinned
// copy bandwidth when slower (docs/BENCHMARKS.md measures how close).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "parallel/memory_estimator.h"

namespace shardtrain {

/// What one rank may use (bytes); a budget of 0 is "none of it" (e.g. no NVMe path).
struct PlacementBudget {
  double gpu_bytes = 0;
  double host_bytes = 0;
  double nvme_bytes = 0;
  /// What was set aside before these figures (placement_margins), for the messages.
  double gpu_margin = 0, host_margin = 0, nvme_margin = 0;
};

/// Bytes a plan may not count on, of a GPU of `gpu_bytes`, a node's `host_bytes` of free host
/// memory and `nvme_bytes` of free disk. The estimate counts what shardtrain allocates (model
/// states, activations, buffers, CUDA context and cuBLAS workspace); the margins cover what it
/// does not:
///   GPU   the caching allocator's slack (blocks rounded up, fragmentation): 512 MiB + 2%;
///   host  the process's own memory besides the plan (the CUDA, cuBLAS and NCCL host state, the
///         data set, the tokenizer, malloc's arenas, the transient pieces of the set-up) and what
///         the OS keeps for itself (page tables of the pinned memory, the kernel's free reserve):
///         4 GiB + 6%. A plan at 125.12 of a 125 GiB machine was ended by the OOM killer; the
///         measured RSS of the offloaded runs in docs/BENCHMARKS.md exceeds the estimate by less;
///   NVMe  the file system's own use: 1 GiB + 2%.
/// Each at most 10% (GPU, NVMe) or 25% (host) of what there is, so that small budgets keep most.
struct PlacementMargins {
  double gpu = 0, host = 0, nvme = 0;
};
PlacementMargins placement_margins(double gpu_bytes, double host_bytes, double nvme_bytes);

/// One rank's budget: `gpu_bytes` of its GPU, and its share of a node of `ranks_per_node` ranks
/// that hold `node_host_bytes` of host memory and the disk of `nvme_path` (its free space; none
/// when `nvme_path` is empty), each less its placement_margins. Throws ConfigError when
/// `nvme_path` cannot be read.
PlacementBudget rank_budget(double gpu_bytes, double node_host_bytes, const std::string& nvme_path,
                            int ranks_per_node);

/// The machine's measured rates. The defaults are one H100 machine's (docs/BENCHMARKS.md,
/// "Machine limits"): pinned copies 55 GB/s each way, shardtrain's CPU AdamW 137.5 GB/s
/// (4.91 G parameters/s), the disk 1.86 GB/s reading and writing at once; the GPU at 40% of the
/// H100's 989 TFLOP/s bf16 peak (gpt2-medium trains at 41–43% MFU there).
struct MachineRates {
  double pcie_bytes_per_s = 55e9;
  double host_bytes_per_s = 137.5e9;
  double disk_bytes_per_s = 1.86e9;
  double gpu_flops = 0.4 * 989e12;
  /// Reads `path`, the JSON that bench/host_limits.cu writes (`bash bench/run.sh limits`):
  /// pcie.h2d_bytes_per_s / d2h_bytes_per_s (the slower), cpu_adamw.bf16_grads_bf16_params.
  /// bytes_per_s, disk.read_GBps / write_GBps (their harmonic combination: one read and one write
  /// of each byte); missing parts keep these defaults. Throws ConfigError for a file that cannot
  /// be read or parsed.
  static MachineRates from_limits_file(const std::string& path);
};

/// One candidate placement and what it costs.
struct Placement {
  std::string name;   ///< e.g. "zero2", "offload r=0.5", "infinity r=1"
  ParallelPlan plan;  ///< the ZeRO stage and where the optimizer state and parameters live
  /// infinity: elements per rank whose optimizer state stays in host memory (the host budget
  /// left after the pinned parameters and the swap slots, 12 bytes each): what
  /// offload_optimizer.max_in_cpu is set to. The rest goes to NVMe.
  int64_t optimizer_max_in_cpu = 0;
  /// offload (stages 1-2): the forward group it runs with (offload_optimizer.forward_group); 1
  /// for the other plans. Chosen when the options leave it to the plan (forward_group 0).
  int64_t forward_group = 1;
  double gpu_bytes = 0, host_bytes = 0, nvme_bytes = 0;  ///< per rank
  double pcie_bytes = 0;                                 ///< per rank per step, both directions
  double host_traffic = 0;  ///< bytes the CPU optimizer moves per rank per step
  double disk_bytes = 0;    ///< per rank per step, read + written
  double compute_s = 0;     ///< the GPU's part of a step (seconds)
  /// The predicted step (seconds): the compute plus what the host's update (the slower of the CPU
  /// optimizer and its disk traffic) does not hide behind the next forward (of the forward
  /// group), or the PCIe traffic when slower.
  double step_s = 0;
  std::string bound;  ///< which term: "compute", "PCIe", "host", "disk"
  bool fits = false;
  std::string over;  ///< what does not fit, with the bytes (empty when it fits)
};

struct PlacementPlan {
  std::vector<Placement> candidates;  ///< every candidate, in the order listed above
  std::optional<size_t> chosen;       ///< index into candidates; none when nothing fits
};

/// Plans a placement for `options` (model, N ranks, micro-batch, length; its offload_ratio is
/// ignored: every ratio is tried) within `budget` at `rates`, `tokens_per_step` tokens per rank
/// per optimizer step. Throws ConfigError as estimate_memory does.
PlacementPlan plan_placement(const MemoryEstimateOptions& options, const PlacementBudget& budget,
                             const MachineRates& rates, double tokens_per_step);

/// One way to split a global batch: `micro_batch` sequences per rank per micro-step times
/// `accumulation` micro-steps, and the placement planned for it.
struct BatchSplit {
  int64_t micro_batch = 0;
  int64_t accumulation = 0;
  PlacementPlan plan;       ///< plan_placement for this micro-batch and the step's tokens
  double tokens_per_s = 0;  ///< all ranks, at the chosen plan's predicted step; 0: none fits
};

struct BatchPlan {
  std::vector<BatchSplit> splits;  ///< micro-batch 1, 2, 4, ... 64, those that divide the batch
  std::optional<size_t> chosen;    ///< index into splits; none when no split fits
};

/// For a global batch of `global_batch` sequences (DeepSpeed's train_batch_size) over
/// options.gpus ranks: every micro-batch of 1, 2, 4, ... 64 that divides it, with the
/// accumulation that makes it up, each planned as plan_placement plans one. Chooses the fastest
/// predicted; within 2% of it, the largest micro-batch (the GPU is counted at one rate, which
/// longer GEMMs come closer to). Throws ConfigError as estimate_memory does.
BatchPlan plan_batch(const MemoryEstimateOptions& options, const PlacementBudget& budget,
                     const MachineRates& rates, int64_t global_batch);

/// The table `shardtrain estimate --gpu-memory ...` prints: every candidate's bytes, traffic and
/// predicted step, the chosen one marked, or why nothing fits.
std::string format_placement_plan(const PlacementPlan& plan, const PlacementBudget& budget,
                                  const MachineRates& rates);

}  // namespace shardtrain
