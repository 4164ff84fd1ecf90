#include "parallel/memory_estimator.h"

#include <fmt/core.h>

#include <algorithm>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/strings.h"
#include "model/gpt2.h"
#include "parallel/buckets.h"
#include "parallel/device_arena.h"
#include "parallel/zero3.h"

namespace shardtrain {
namespace {

constexpr double kBf16 = 2, kF32 = 4, kI32 = 4;

/// The model's flat layout (GPT2Model allocates nothing until it runs, so a CPU backend serves).
ParamLayout layout_of(const GPT2Config& c) {
  auto backend = make_cpu_backend();
  GPT2Model model(c, *backend);
  return model.layout();
}

std::string describe_unavailable(StrategyKind s) {
  switch (s) {
    case StrategyKind::kOffload:
      return "ZeRO-Offload: optimizer state in CPU memory";
    case StrategyKind::kInfinity:
      return "ZeRO-Infinity: stage 3 with CPU/NVMe offload";
    default:
      return to_string(s);
  }
}

}  // namespace

int optimizer_state_bytes_per_parameter(OptimizerKind k) {
  return k == OptimizerKind::kSGD ? 8 : 12;
}

int host_state_bytes_per_parameter(const MemoryEstimateOptions& o) {
  return o.optimizer == OptimizerKind::kAdamW && o.bf16_moments
             ? 8
             : optimizer_state_bytes_per_parameter(o.optimizer);
}

double zero_model_state_bytes(StrategyKind s, int64_t psi, int gpus, int k_bytes) {
  check<ConfigError>(gpus >= 1, "--gpus {} is not valid: use 1 or more", gpus);
  const double P = static_cast<double>(psi), N = gpus, K = k_bytes;
  switch (s) {
    case StrategyKind::kDataParallel:
      return (4 + K) * P;  // 2Ψ bf16 params + 2Ψ bf16 grads + KΨ fp32 master/m/v
    case StrategyKind::kZero1:
      return 4 * P + K * P / N;  // P_os
    case StrategyKind::kZero2:
      return 2 * P + (2 + K) * P / N;  // P_os+g
    case StrategyKind::kZero3:
      return (4 + K) * P / N;  // P_os+g+p
    default:
      throw ConfigError(
          fmt::format("no memory model for strategy '{}' in this release", to_string(s)));
  }
}

ActivationEstimate estimate_activations(const GPT2Config& c, int64_t micro_batch,
                                        int64_t max_length, bool activation_checkpointing,
                                        const ActivationLayout& layout) {
  const double dt = layout.compute_bytes;  // the compute dtype (bf16 on the CUDA backend)
  const int64_t m = layout.logits_column_multiple;
  const double Vp = static_cast<double>((c.vocab_size + m - 1) / m * m);
  const double B = static_cast<double>(micro_batch), T = static_cast<double>(max_length);
  const double N = B * T, C = c.n_embd, NH = c.n_head, L = c.n_layer;
  ActivationEstimate a;
  // BlockActivations (model/gpt2.cpp): ln1, atty, x2, ln2 [N,C]; qkv [N,3C]; fch, fch_gelu [N,4C]
  // in bf16; attention probabilities [B,NH,T,T] in bf16 or log-sum-exp [B,NH,T] in fp32;
  // ln1/ln2 mean and rstd [N] in fp32.
  const double attention = layout.attention_saves_probs ? dt * B * NH * T * T : kF32 * B * NH * T;
  const double per_block = dt * 15 * N * C + attention + kF32 * 4 * N;
  a.blocks = (activation_checkpointing ? 1 : L) * per_block;
  // residual_[1..L+1] (the inputs of layers 1..L+1) and dresid.
  a.residual = dt * (L + 2) * N * C;
  // BlockScratch tmp [N,C], d4c [N,4C], dc [N,C], dqkv [N,3C]; the head's dlnf [N,C].
  a.scratch = dt * 10 * N * C;
  // HeadLayer: lnf [N,C], logits [N,Vp] (bf16, rows padded), mean/rstd [N] (fp32). With
  // checkpointing the one recomputed block set and the BlockScratch buffers live in the logits'
  // memory (HeadLayer::reserve): only what the logits need beyond them is counted here.
  const double logits = dt * N * Vp;
  a.head = dt * N * C + kF32 * 2 * N +
           (activation_checkpointing ? std::max(0.0, logits - per_block - dt * 9 * N * C) : logits);
  a.io = 2 * kI32 * N + kF32 * N;
  return a;
}

double gradient_bucket_bytes(StrategyKind s, const GPT2Config& model, int gpus,
                             int64_t reduce_bucket_size) {
  if (s != StrategyKind::kZero2) return 0;
  const ParamLayout layout = layout_of(model);
  // As zero2 builds them (zero_base.h): tied sources alone, each with a persistent buffer.
  const auto buckets = build_grad_buckets(layout, reduce_bucket_size, layout.tied_sources());
  int64_t tied = 0, max_regular = 0;
  int regular = 0;
  for (const GradBucket& b : buckets) {
    const int64_t padded = zero_padded_numel(b.numel, gpus);
    if (b.num_layers() == 1 && layout.is_tied_source(b.first_layer)) {
      tied += padded;
    } else {
      max_regular = std::max(max_regular, padded);
      ++regular;
    }
  }
  return kBf16 * static_cast<double>(tied + std::min(2, regular) * max_regular);
}

double zero3_transient_bytes(const GPT2Config& model, int gpus, const Zero3Limits& limits,
                             int64_t persistence_threshold, bool params_offloaded) {
  const ParamLayout layout = layout_of(model);
  std::vector<int64_t> padded;
  std::vector<bool> resident;
  for (const LayerRange& l : layout.layers()) {
    int64_t params = 0;
    for (const ParamTensor& t : l.tensors) params += t.numel;
    padded.push_back(zero_padded_numel(l.numel, gpus));
    resident.push_back((gpus == 1 && !params_offloaded) || params < persistence_threshold);
  }
  const Zero3Schedule schedule(layout, padded, resident, limits);
  // One rank gathers only offloaded parameters, into buffers of their own; several ranks carve
  // everything from one arena (zero3.cpp, parallel/device_arena.h).
  if (gpus == 1)
    return kBf16 * static_cast<double>(
                       simulate_zero3_pass(layout, schedule, gpus, kZero3ReductionsInFlight).total);
  return kBf16 * static_cast<double>(DeviceArena::rounded(
                     zero3_arena_elements(layout, schedule, gpus, kZero3ReductionsInFlight)));
}

/// The reduce_bucket_size the ZeRO strategies use: the given one, else kOverlapBucketElements on
/// several GPUs (assumed on one node) and the DeepSpeed default on one.
static int64_t bucket_elements(const MemoryEstimateOptions& o) {
  if (o.reduce_bucket_size) return *o.reduce_bucket_size;
  return o.gpus > 1 ? kOverlapBucketElements : ZeroConfig{}.reduce_bucket_size;
}

MemoryEstimate estimate_memory(const MemoryEstimateOptions& o) {
  check<ConfigError>(o.gpus >= 1, "--gpus {} is not valid: use 1 or more", o.gpus);
  check<ConfigError>(o.micro_batch >= 1, "--micro-batch {} is not valid: use 1 or more",
                     o.micro_batch);
  check<ConfigError>(o.max_length >= 1 && o.max_length <= o.model.n_positions,
                     "{} {} is not valid for model '{}': use 1 to {} (its context)",
                     knob_for(&TrainConfig::max_length).name(), o.max_length, o.model.name,
                     o.model.n_positions);
  check<ConfigError>(o.reduce_bucket_size.value_or(1) >= 1,
                     "--reduce-bucket-size {} is not valid: use 1 or more elements",
                     o.reduce_bucket_size.value_or(1));
  MemoryEstimate e;
  e.parameters = o.model.num_parameters();
  e.activations =
      estimate_activations(o.model, o.micro_batch, o.max_length, o.activation_checkpointing);
  const int K = optimizer_state_bytes_per_parameter(o.optimizer);
  const std::pair<StrategyKind, std::string> available[] = {
      {StrategyKind::kDataParallel, fmt::format("{}Ψ", 4 + K)},
      {StrategyKind::kZero1, fmt::format("4Ψ + {}Ψ/N", K)},
      {StrategyKind::kZero2, fmt::format("2Ψ + {}Ψ/N", 2 + K)},
      {StrategyKind::kZero3, fmt::format("{}Ψ/N", 4 + K)}};
  for (const auto& [kind, formula] : available) {
    StrategyEstimate s;
    s.strategy = kind;
    s.formula = formula;
    s.model_states = zero_model_state_bytes(kind, e.parameters, o.gpus, K);
    s.activations = e.activations.total();
    // Several GPUs of one node: the communicator's copy-engine staging (comm/communicator.h).
    s.buffers = gradient_bucket_bytes(kind, o.model, o.gpus, bucket_elements(o)) +
                (kind == StrategyKind::kZero3
                     ? zero3_transient_bytes(o.model, o.gpus, o.zero3, o.persistence_threshold)
                     : 0.0) +
                kCublasWorkspaceBytes + kCudaContextBytes +
                (o.gpus > 1 ? static_cast<double>(kPeerStagingBytes) : 0.0);
    e.strategies.push_back(s);
  }
  // Hybrid sharding: zero3 over groups of g GPUs (NCCL within them: no copy-engine staging).
  if (const int g = o.hpz_partition_size; g > 1 && g < o.gpus) {
    check<ConfigError>(o.gpus % g == 0,
                       "{} {} does not divide the {} GPUs: use a divisor (the GPUs of a node)",
                       zero_knob(&ZeroConfig::hpz_partition_size).key(), g, o.gpus);
    StrategyEstimate s;
    s.strategy = StrategyKind::kZero3;
    s.name = "zero3-hybrid";
    s.formula = fmt::format("{}Ψ/G", 4 + K);
    s.model_states = zero_model_state_bytes(StrategyKind::kZero3, e.parameters, g, K);
    s.activations = e.activations.total();
    s.buffers = zero3_transient_bytes(o.model, g, o.zero3, o.persistence_threshold) +
                kCublasWorkspaceBytes + kCudaContextBytes;
    e.strategies.push_back(s);
  }
  // Offloaded plans: r of the fp32 state (K bytes per element) and its step on the host; the
  // gradients of those elements staged in pinned memory (bf16, twice with the delayed update),
  // except where stage 3's offloaded parameters take them in place (host_optimizer.h, "Gradients
  // in the parameters' place": without the delayed update).
  const double psi = static_cast<double>(e.parameters), n = o.gpus, r = o.offload_ratio;
  const double shard = psi / n, staging = (o.delayed_update ? 2.0 : 1.0) * kBf16 * r * shard;
  const double stage3_staging = o.delayed_update ? staging : 0.0;
  const double fixed = kCublasWorkspaceBytes + kCudaContextBytes +
                       (o.gpus > 1 ? static_cast<double>(kPeerStagingBytes) : 0.0);
  // NVMe staging: three slots of the largest stage-3 unit's [master | m | v] (the embedding).
  const double largest_unit =
      static_cast<double>(o.model.vocab_size + o.model.n_positions) * o.model.n_embd / n;
  struct Offloaded {
    const char* name;
    StrategyKind kind;
    std::string formula;
    bool stage3, nvme;
  };
  std::vector<Offloaded> offloaded = {
      {"offload", StrategyKind::kOffload, fmt::format("2Ψ + 2Ψ/N + (1-r)·{}Ψ/N", K), false, false},
      {"zero3-offload", StrategyKind::kInfinity, fmt::format("2Ψ/N + (1-r)·{}Ψ/N", K), true,
       false}};
  // The NVMe swap file pages AdamW's master, m and v: SGD is refused there (no row).
  if (o.optimizer == OptimizerKind::kAdamW)
    offloaded.push_back(
        {"infinity", StrategyKind::kInfinity, fmt::format("2Ψ/N + (1-r)·{}Ψ/N", K), true, true});
  for (const Offloaded& p : offloaded) {
    StrategyEstimate s;
    s.strategy = p.kind;
    s.name = p.name;
    s.offloaded = true;
    s.formula = p.formula;
    s.model_states = (p.stage3 ? 0.0 : kBf16 * psi) + kBf16 * shard + (1 - r) * K * shard;
    s.activations = e.activations.total();
    if (!p.stage3 && o.activation_checkpointing && o.forward_group > 1)  // forward_layer_major
      s.activations +=
          static_cast<double>(o.forward_group - 1) * (e.activations.residual + e.activations.io);
    s.buffers =
        fixed +
        (p.stage3
             ? zero3_transient_bytes(o.model, o.gpus, o.zero3, o.persistence_threshold, true)
             : gradient_bucket_bytes(StrategyKind::kZero2, o.model, o.gpus, bucket_elements(o)));
    s.host_pinned = p.stage3 ? stage3_staging + kBf16 * shard : staging;
    const double Kh = host_state_bytes_per_parameter(o);
    s.host_pageable = Kh * r * shard;
    if (p.nvme) {
      // offload_optimizer.max_in_cpu elements keep their state in memory; the rest is paged
      // through three slots of the largest unit's [master | m | v] (the embedding).
      const double in_cpu = std::min(static_cast<double>(o.optimizer_max_in_cpu), r * shard);
      s.nvme = Kh * (r * shard - in_cpu);
      s.host_pageable = Kh * in_cpu + (s.nvme > 0 ? 3.0 * Kh * r * largest_unit : 0.0);
    }
    e.strategies.push_back(s);
  }
  return e;
}

std::string format_memory_estimate(const MemoryEstimate& e, const MemoryEstimateOptions& o) {
  const auto gib = [](double bytes) { return human_bytes(bytes); };
  std::string out = fmt::format(
      "Estimated GPU memory per rank: {} ({} parameters = Ψ) on {} GPU{} (N), micro-batch {} × "
      "{} tokens, activation checkpointing {}\n\n",
      o.model.name, with_commas(e.parameters), o.gpus, o.gpus == 1 ? "" : "s", o.micro_batch,
      o.max_length, o.activation_checkpointing ? "on" : "off");
  out += fmt::format("{:<13} {:>12} {:>12} {:>12} {:>12}   {}\n", "strategy", "model states",
                     "activations", "buffers", "total", "model states formula");
  for (const StrategyEstimate& s : e.strategies) {
    const std::string name = s.name.empty() ? to_string(s.strategy) : s.name;
    if (!s.available) {
      out += fmt::format("{:<13} not available yet in this release ({})\n", name,
                         describe_unavailable(s.strategy));
      continue;
    }
    out += fmt::format("{:<13} {:>12} {:>12} {:>12} {:>12}   {}\n", name, gib(s.model_states),
                       gib(s.activations), gib(s.buffers), gib(s.total()), s.formula);
  }
  out += fmt::format(
      "\nHost and NVMe bytes per rank of the offloaded plans ({} r = {:g}{}):"
      "\n{:<13} {:>12} {:>12} {:>12}\n",
      zero_knob(&ZeroConfig::offload_ratio).path, o.offload_ratio,
      o.delayed_update ? ", delayed update" : "", "strategy", "host pinned", "host pageable",
      "NVMe");
  for (const StrategyEstimate& s : e.strategies)
    if (s.offloaded)
      out += fmt::format("{:<13} {:>12} {:>12} {:>12}\n", s.name, gib(s.host_pinned),
                         gib(s.host_pageable), gib(s.nvme));
  const ActivationEstimate& a = e.activations;
  out += fmt::format(
      "\nmodel states: ZeRO paper (arXiv 1910.02054) §5 for mixed-precision {}: bf16 "
      "parameters and\n  gradients (2 + 2 bytes per parameter), {} (K = {} bytes); zero1 "
      "partitions\n  the optimizer state over the N GPUs, zero2 the gradients too,\n  zero3 the "
      "parameters too\n",
      o.optimizer == OptimizerKind::kSGD ? "SGD" : "AdamW",
      o.optimizer == OptimizerKind::kSGD ? "fp32 master weights and momentum buffer"
                                         : "fp32 master weights, m and v",
      optimizer_state_bytes_per_parameter(o.optimizer));
  if (o.hpz_partition_size > 1 && o.hpz_partition_size < o.gpus)
    out += fmt::format(
        "zero3-hybrid ({} G = {}): zero3 partitioned within groups of G "
        "GPUs and\n  replicated over the {} groups; each step every GPU all-reduces its gradient "
        "shard, 2Ψ/G = {},\n  with the other groups — the only traffic between them\n",
        zero_knob(&ZeroConfig::hpz_partition_size).key(), o.hpz_partition_size,
        o.gpus / o.hpz_partition_size,
        gib(kBf16 * static_cast<double>(e.parameters) / o.hpz_partition_size));
  out += fmt::format(
      "activations (as GPT2Model allocates them on the CUDA backend, bf16): blocks {} ({}),\n  "
      "residual stream {}, head {} (logits [B·T, V padded to 64]), backward scratch {}, "
      "tokens/losses {}\n",
      gib(a.blocks),
      o.activation_checkpointing
          ? "one recomputed set, sharing the logits' memory: activation checkpointing"
          : fmt::format("{} × {}", o.model.n_layer, gib(a.blocks / o.model.n_layer)),
      gib(a.residual), gib(a.head), gib(a.scratch), gib(a.io));
  out += fmt::format(
      "buffers: CUDA context ~{} (an assumption: it varies with the driver and GPU), cuBLASLt "
      "workspace {},\n  and for zero2 the gradient bucket buffers (reduce_bucket_size {} "
      "elements): the embedding's\n  bucket plus one or two transient buckets; for zero3 the "
      "layers gathered at the peak and their\n  gradient buffers, replaying its schedule "
      "(prefetch {} elements, max live {}, reuse distance {},\n  persistence threshold {}), in "
      "one arena that holds that peak plus the largest layer; "
      "on several GPUs the copy-engine collectives' staging {}\n",
      gib(kCudaContextBytes), gib(kCublasWorkspaceBytes), with_commas(bucket_elements(o)),
      with_commas(o.zero3.prefetch_bucket_size), with_commas(o.zero3.max_live_parameters),
      with_commas(o.zero3.max_reuse_distance), with_commas(o.persistence_threshold),
      gib(static_cast<double>(kPeerStagingBytes)));
  out += "not counted: NCCL buffers, allocator rounding and fragmentation, checkpoint copies\n";
  return out;
}

}  // namespace shardtrain
