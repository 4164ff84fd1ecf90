// Memory estimator: GPU memory per rank for a GPT-2 model under each strategy, before running it
// (`shardtrain estimate`).
//
// Three terms, in bytes per GPU:
//  * model states: parameters, gradients and AdamW state by the formulas of the ZeRO paper
//    (Rajbhandari et al., arXiv 1910.02054, §3.1 and §5, Figure 1) for mixed-precision AdamW
//    (bf16 parameters and gradients, fp32 master weights, m and v: K = 12) with Ψ parameters
//    over N GPUs: dp 16Ψ, zero1 4Ψ + 12Ψ/N, zero2 2Ψ + 14Ψ/N, zero3 16Ψ/N; with SGD
//    (fp32 master weights and the momentum buffer, no second moment) K = 8 in the same formulas;
//  * activations: exactly what GPT2Model allocates on the CUDA backend (bf16, fused attention
//    saving log-sum-exp [B, NH, T] in fp32) for a micro-batch of B sequences of T tokens;
//  * buffers: the strategy's gradient bucket buffers (zero2), zero3's gathered layers and
//    per-layer gradient buffers at their peak (a replay of its schedule), the cuBLASLt
//    workspace (32 MiB)
//    and the CUDA context (~500 MiB, an assumption: it varies with the driver and the GPU).
// Not counted: NCCL's internal buffers, the caching allocator's rounding and fragmentation, and
// the transient copies made while writing a checkpoint.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/gpt2_config.h"
#include "parallel/zero3_schedule.h"

namespace shardtrain {

inline constexpr double kCudaContextBytes = 500.0 * 1024 * 1024;     ///< assumption
inline constexpr double kCublasWorkspaceBytes = 32.0 * 1024 * 1024;  ///< the CUDA backend's

struct MemoryEstimateOptions {
  GPT2Config model;
  int gpus = 1;              ///< data-parallel ranks N (one GPU each)
  int64_t micro_batch = 8;   ///< B, sequences per GPU per micro-step
  int64_t max_length = 128;  ///< T, tokens per sequence
  bool activation_checkpointing = false;
  /// zero_optimization.reduce_bucket_size in elements; unset: the strategies' default, which
  /// on several GPUs (of one node: the copy-engine collectives) is kOverlapBucketElements and
  /// on one GPU DeepSpeed's 5e8.
  std::optional<int64_t> reduce_bucket_size;
  /// zero3's stage3_* settings (DeepSpeed's defaults).
  Zero3Limits zero3;
  int64_t persistence_threshold = 100'000;  ///< stage3_param_persistence_threshold
  double offload_ratio = 1.0;               ///< offload_optimizer.ratio of the offloaded rows
  bool delayed_update = false;              ///< offload: two pinned gradient buffers instead of one
  /// offload_optimizer.speculative_update: the host's update may start during backward (the
  /// placement planner's predicted step; no memory of its own).
  bool speculative_update = true;
  /// offload (stages 1–2) with activation checkpointing: micro-batches whose layer inputs are
  /// live at once (offload_optimizer.forward_group, resolved): (group − 1) more sets of the
  /// residual stream and the micro-batch's tokens, targets and losses. 0: the placement planner
  /// chooses per plan (the estimate counts 1).
  int64_t forward_group = 0;
  /// Offloaded plans: AdamW's host and NVMe moments in bf16 (offload_optimizer.moments_dtype):
  /// 8 bytes of host state per parameter instead of 12.
  bool bf16_moments = false;
  /// infinity: elements per rank whose optimizer state stays in host memory
  /// (offload_optimizer.max_in_cpu); the rest is on NVMe.
  int64_t optimizer_max_in_cpu = 0;
  /// AdamW: K = 12 bytes of optimizer state per parameter (fp32 master, m, v); SGD: K = 8
  /// (fp32 master, momentum buffer).
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  /// zero_hpz_partition_size: > 1 (and < gpus, dividing it) adds the row "zero3-hybrid", zero3
  /// sharded within groups of this many GPUs and replicated across the groups.
  int hpz_partition_size = 1;
};

/// The ZeRO paper's K (bytes of fp32 optimizer state per parameter) of `k`: 12 or 8.
int optimizer_state_bytes_per_parameter(OptimizerKind k);
/// Bytes of optimizer state per host-stepped parameter in host memory or on NVMe: K, or 8 for
/// AdamW with bf16 moments (fp32 master, bf16 m and v).
int host_state_bytes_per_parameter(const MemoryEstimateOptions& o);

/// Activation memory (bytes) of one micro-batch, by part.
struct ActivationEstimate {
  double blocks = 0;    ///< saved block activations: every block, or one set with checkpointing
  double residual = 0;  ///< residual stream: inputs of layers 1..L+1 and its gradient,
                        ///< [B, T, C] bf16 each
  double head = 0;      ///< ln_f output, its mean/rstd, logits [B·T, Vp] bf16 (with checkpointing:
                        ///< only the logits' excess over the block set, which shares their memory)
  double scratch = 0;   ///< buffers shared by the blocks and the head during backward
  double io = 0;        ///< tokens, targets (int32) and per-token losses (fp32)
  double total() const { return blocks + residual + head + scratch + io; }
};

/// One strategy on one GPU.
struct StrategyEstimate {
  StrategyKind strategy = StrategyKind::kDataParallel;
  bool available = true;    ///< false: strategy not in this release (no numbers)
  std::string formula;      ///< model-state formula, e.g. "4Ψ + 12Ψ/N"
  double model_states = 0;  ///< bytes
  double activations = 0;   ///< bytes
  double buffers = 0;       ///< bytes: gradient buckets + cuBLASLt workspace + CUDA context
  double total() const { return model_states + activations + buffers; }
  // Offloaded plans (parallel/offload/host_optimizer.h): the row's name and the host side.
  std::string name;          ///< row label; empty: to_string(strategy)
  bool offloaded = false;    ///< the host columns apply
  double host_pinned = 0;    ///< bytes: gradient staging (and offloaded parameters)
  double host_pageable = 0;  ///< bytes: fp32 master, m, v on the host (NVMe: staging slots)
  double nvme = 0;           ///< bytes of the swap file
};

struct MemoryEstimate {
  int64_t parameters = 0;  ///< Ψ
  ActivationEstimate activations;
  std::vector<StrategyEstimate> strategies;  ///< dp, zero1, zero2, then the unavailable ones
};

/// Model-state bytes per GPU of strategy `s` (dp, zero1, zero2 or zero3) for `psi` parameters
/// over `gpus` GPUs, by the ZeRO paper's formulas (§5, K = 12 for AdamW, `k_bytes` in general).
/// Throws ConfigError for other strategies and gpus < 1.
double zero_model_state_bytes(StrategyKind s, int64_t psi, int gpus, int k_bytes = 12);

/// How a backend lays out the activations estimate_activations() counts. The defaults are the
/// CUDA backend's in bf16; cpu() is the CPU backend's (fp32), which the tests measure against.
struct ActivationLayout {
  int compute_bytes = 2;  ///< size of the compute dtype
  /// Attention keeps probabilities [B, NH, T, T] in the compute dtype (CPU backend,
  /// SHARDTRAIN_ATTENTION=materialized) instead of log-sum-exp [B, NH, T] in fp32 (the fused
  /// kernels); see Backend::attention_saves_probs.
  bool attention_saves_probs = false;
  int64_t logits_column_multiple = 64;  ///< logits rows padded to it (Backend::padded_columns)
  static ActivationLayout cpu() { return {4, true, 1}; }
};

/// Activation bytes of a micro-batch [micro_batch, max_length] as GPT2Model allocates them on a
/// backend with `layout` (see ActivationEstimate).
ActivationEstimate estimate_activations(const GPT2Config& model, int64_t micro_batch,
                                        int64_t max_length, bool activation_checkpointing,
                                        const ActivationLayout& layout = {});

/// Gradient bucket buffers (bytes, bf16) strategy `s` holds besides its model states: zero2's
/// embedding bucket and one or two transient bucket buffers (parallel/zero.cpp); 0 for dp and
/// zero1, which reduce in place.
double gradient_bucket_bytes(StrategyKind s, const GPT2Config& model, int gpus,
                             int64_t reduce_bucket_size);

/// zero3's transient buffers at their peak (bytes, bf16): the layers gathered at once and the
/// per-layer gradient buffers, from a replay of the strategy's schedule (parallel/zero3_schedule.h)
/// over `gpus` ranks; on several ranks the arena that holds them, which adds the largest layer
/// (parallel/device_arena.h). 0 on one GPU (every layer is resident there).
double zero3_transient_bytes(const GPT2Config& model, int gpus, const Zero3Limits& limits,
                             int64_t persistence_threshold, bool params_offloaded = false);

/// Everything above for dp, zero1, zero2 and zero3 (and zero3-hybrid, with hpz_partition_size),
/// then the offloaded plans: offload (zero2 +
/// optimizer on the CPU), zero3-offload (zero3 + optimizer and parameters on the CPU) and infinity
/// (zero3 + optimizer on NVMe, parameters on the CPU), with their host and NVMe bytes. Throws
/// ConfigError for gpus, micro_batch < 1, a max_length outside [1, n_positions] or an
/// hpz_partition_size that does not divide gpus.
MemoryEstimate estimate_memory(const MemoryEstimateOptions& options);

/// The table `shardtrain estimate` prints, with its assumptions.
std::string format_memory_estimate(const MemoryEstimate& estimate,
                                   const MemoryEstimateOptions& options);

}  // namespace shardtrain
