// The memory estimator (parallel/memory_estimator.h): the ZeRO paper's model-state formulas for
// gpt2, the activation term against what GPT2Model really allocates (measured on the CPU backend,
// whose compute dtype is fp32), and the printed table.
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "memory/flat_buffer.h"
#include "model/gpt2.h"
#include "parallel/buckets.h"
#include "parallel/memory_estimator.h"

namespace shardtrain {
namespace {

constexpr int64_t kGpt2Params = 124'439'808;

double states(const MemoryEstimate& e, StrategyKind s) {
  for (const StrategyEstimate& x : e.strategies)
    if (x.strategy == s) return x.model_states;
  ADD_FAILURE() << "no estimate for " << to_string(s);
  return 0;
}

TEST(Estimator, ModelStateFormulasForGpt2) {
  const double psi = static_cast<double>(kGpt2Params);
  ASSERT_EQ(gpt2_preset("gpt2").num_parameters(), kGpt2Params);
  struct Case {
    int gpus;
    double dp, zero1, zero2;  // bytes
  };
  // 16Ψ; 4Ψ + 12Ψ/N; 2Ψ + 14Ψ/N (ZeRO paper §5, K = 12).
  const Case cases[] = {{1, 1'991'036'928.0, 1'991'036'928.0, 1'991'036'928.0},
                        {2, 1'991'036'928.0, 1'244'398'080.0, 1'119'958'272.0},
                        {8, 1'991'036'928.0, 684'418'944.0, 466'649'280.0}};
  for (const Case& c : cases) {
    EXPECT_DOUBLE_EQ(zero_model_state_bytes(StrategyKind::kDataParallel, kGpt2Params, c.gpus),
                     c.dp);
    EXPECT_DOUBLE_EQ(zero_model_state_bytes(StrategyKind::kZero1, kGpt2Params, c.gpus), c.zero1);
    EXPECT_DOUBLE_EQ(zero_model_state_bytes(StrategyKind::kZero2, kGpt2Params, c.gpus), c.zero2);
    EXPECT_DOUBLE_EQ(c.zero1, 4 * psi + 12 * psi / c.gpus);
    EXPECT_DOUBLE_EQ(c.zero2, 2 * psi + 14 * psi / c.gpus);

    MemoryEstimateOptions o;
    o.model = gpt2_preset("gpt2");
    o.gpus = c.gpus;
    const MemoryEstimate e = estimate_memory(o);
    EXPECT_EQ(e.parameters, kGpt2Params);
    EXPECT_DOUBLE_EQ(states(e, StrategyKind::kDataParallel), c.dp);
    EXPECT_DOUBLE_EQ(states(e, StrategyKind::kZero1), c.zero1);
    EXPECT_DOUBLE_EQ(states(e, StrategyKind::kZero2), c.zero2);
    for (const StrategyEstimate& s : e.strategies) {
      if (!s.available) continue;
      EXPECT_DOUBLE_EQ(s.activations, e.activations.total());
      EXPECT_GE(s.buffers, kCudaContextBytes + kCublasWorkspaceBytes);
      EXPECT_DOUBLE_EQ(s.total(), s.model_states + s.activations + s.buffers);
    }
  }
  EXPECT_DOUBLE_EQ(zero_model_state_bytes(StrategyKind::kZero3, kGpt2Params, 8),
                   16.0 * kGpt2Params / 8);
  EXPECT_THROW(zero_model_state_bytes(StrategyKind::kOffload, kGpt2Params, 8), ConfigError);
  EXPECT_THROW(zero_model_state_bytes(StrategyKind::kZero1, kGpt2Params, 0), ConfigError);
}

// SGD keeps the fp32 master and the momentum buffer only: K = 8 in the same formulas, and no
// NVMe (infinity) row, which SGD refuses.
TEST(Estimator, SgdKeepsEightBytesOfOptimizerStatePerParameter) {
  const double psi = static_cast<double>(kGpt2Params);
  MemoryEstimateOptions o;
  o.model = gpt2_preset("gpt2");
  o.gpus = 4;
  o.optimizer = OptimizerKind::kSGD;
  const MemoryEstimate e = estimate_memory(o);
  EXPECT_DOUBLE_EQ(states(e, StrategyKind::kDataParallel), 12 * psi);
  EXPECT_DOUBLE_EQ(states(e, StrategyKind::kZero1), 4 * psi + 8 * psi / 4);
  EXPECT_DOUBLE_EQ(states(e, StrategyKind::kZero2), 2 * psi + 10 * psi / 4);
  EXPECT_DOUBLE_EQ(states(e, StrategyKind::kZero3), 12 * psi / 4);
  for (const StrategyEstimate& s : e.strategies) {
    EXPECT_NE(s.name, "infinity");
    if (s.name == "offload") {
      EXPECT_DOUBLE_EQ(s.host_pageable, 8 * psi / 4);
    }
  }
  EXPECT_NE(format_memory_estimate(e, o).find("K = 8"), std::string::npos);
}

TEST(Estimator, ActivationsGrowLinearlyInMicroBatch) {
  const GPT2Config c = gpt2_preset("gpt2");
  for (bool ckpt : {false, true}) {
    const double one = estimate_activations(c, 1, 1024, ckpt).total();
    EXPECT_GT(one, 0);
    for (int64_t B : {2, 3, 8}) {
      const ActivationEstimate a = estimate_activations(c, B, 1024, ckpt);
      EXPECT_DOUBLE_EQ(a.total(), static_cast<double>(B) * one) << "B = " << B;
    }
  }
  // gpt2, B = 1, T = 1024, bf16: the logits [1024, 50257] alone are 98.2 MiB.
  EXPECT_GT(estimate_activations(c, 1, 1024, false).head, 1024.0 * 50257 * 2);
}

TEST(Estimator, CheckpointingLowersActivations) {
  const GPT2Config c = gpt2_preset("gpt2");
  const ActivationEstimate full = estimate_activations(c, 8, 1024, false);
  const ActivationEstimate ckpt = estimate_activations(c, 8, 1024, true);
  EXPECT_LT(ckpt.total(), full.total());
  EXPECT_DOUBLE_EQ(ckpt.blocks * c.n_layer, full.blocks);  // one block set instead of n_layer
  EXPECT_DOUBLE_EQ(ckpt.residual, full.residual);          // layer inputs are kept either way
  EXPECT_LE(ckpt.head, full.head);  // the recomputed set shares the logits' memory
}

// The activation term counts exactly what GPT2Model allocates for a forward + backward: measured
// with the CPU backend (fp32 compute and probabilities: compute_bytes 4). Sizes are multiples of
// 64 bytes, the CPU allocator's granule; nothing else is allocated (the empty residual_[0] takes
// no memory).
TEST(Estimator, ActivationsMatchWhatTheModelAllocates) {
  GPT2Config c;
  c.name = "estimator-test";
  c.n_layer = 3;
  c.n_head = 2;
  c.n_embd = 64;
  c.vocab_size = 96;
  c.n_positions = 32;
  const int64_t B = 2, T = 16;
  for (bool ckpt : {false, true}) {
    auto be = make_cpu_backend();
    GPT2Model model(c, *be, ckpt);
    const int64_t n = model.layout().numel();
    FlatBuffer params(*be, DType::kF32, n), grads(*be, DType::kF32, n);
    std::vector<float> init(static_cast<size_t>(n));
    model.init_parameters(init.data(), 7);
    be->copy_from_host(params.data(), init.data(), init.size() * sizeof(float));
    model.bind(params.view(), grads.view());
    std::vector<int32_t> tokens(B * T), targets(B * T);
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>((i * 7) % 96);
      targets[i] = static_cast<int32_t>((i * 5 + 1) % 96);
    }
    const size_t before = be->allocated_bytes();
    model.forward(tokens.data(), targets.data(), B, T, 1.0f / (B * T), true);
    model.backward();
    const double used = static_cast<double>(be->allocated_bytes() - before);
    const double estimated = estimate_activations(c, B, T, ckpt, ActivationLayout::cpu()).total();
    EXPECT_DOUBLE_EQ(used, estimated) << "activation checkpointing " << ckpt;
  }
}

TEST(Estimator, Zero2BucketBuffers) {
  const GPT2Config c = gpt2_preset("gpt2");
  EXPECT_EQ(gradient_bucket_bytes(StrategyKind::kDataParallel, c, 8, 500'000'000), 0);
  EXPECT_EQ(gradient_bucket_bytes(StrategyKind::kZero1, c, 8, 500'000'000), 0);
  // One bucket for blocks + head (one transient buffer) and the embedding's own bucket: all of
  // the gradients, in bf16 (padded to a multiple of 8 · 16 per bucket).
  const double one_bucket = gradient_bucket_bytes(StrategyKind::kZero2, c, 8, 500'000'000);
  EXPECT_GE(one_bucket, 2.0 * static_cast<double>(kGpt2Params));
  EXPECT_LT(one_bucket, 2.0 * static_cast<double>(kGpt2Params) + 2 * 2 * 128);
  // Small buckets: the embedding plus two buffers of the largest block bucket.
  const double small = gradient_bucket_bytes(StrategyKind::kZero2, c, 8, 10'000'000);
  EXPECT_LT(small, one_bucket);
  const double embed = 2.0 * (50257.0 * 768 + 1024.0 * 768);
  EXPECT_GT(small, embed);
}

TEST(Estimator, DefaultBucketsFollowWhatTrainChooses) {
  // Unset reduce_bucket_size: 12.5 M-element buckets on several GPUs (copy-engine collectives on
  // one node) plus their staging, DeepSpeed's 5e8 on one GPU; a given size is used as given.
  const auto zero2_buffers = [](int gpus, std::optional<int64_t> bucket) {
    MemoryEstimateOptions o;
    o.model = gpt2_preset("gpt2-medium");
    o.gpus = gpus;
    o.reduce_bucket_size = bucket;
    for (const StrategyEstimate& s : estimate_memory(o).strategies)
      if (s.strategy == StrategyKind::kZero2) return s.buffers;
    ADD_FAILURE() << "no zero2 row";
    return 0.0;
  };
  EXPECT_DOUBLE_EQ(zero2_buffers(2, std::nullopt), zero2_buffers(2, kOverlapBucketElements));
  EXPECT_DOUBLE_EQ(zero2_buffers(1, std::nullopt), zero2_buffers(1, 500'000'000));
  EXPECT_LT(zero2_buffers(2, std::nullopt), zero2_buffers(2, 500'000'000));
  const GPT2Config m = gpt2_preset("gpt2-medium");
  EXPECT_DOUBLE_EQ(zero2_buffers(2, 500'000'000) - zero2_buffers(1, 500'000'000),
                   gradient_bucket_bytes(StrategyKind::kZero2, m, 2, 500'000'000) -
                       gradient_bucket_bytes(StrategyKind::kZero2, m, 1, 500'000'000) +
                       static_cast<double>(kPeerStagingBytes));
}

TEST(Estimator, RejectsBadOptionsAndPrintsTable) {
  MemoryEstimateOptions o;
  o.model = gpt2_preset("gpt2");
  o.gpus = 0;
  EXPECT_THROW(estimate_memory(o), ConfigError);
  o.gpus = 2;
  o.max_length = 2048;
  EXPECT_THROW(estimate_memory(o), ConfigError);
  o.max_length = 1024;
  o.micro_batch = 0;
  EXPECT_THROW(estimate_memory(o), ConfigError);
  o.micro_batch = 4;
  const std::string table = format_memory_estimate(estimate_memory(o), o);
  for (const char* needle :
       {"124,439,808", "dp", "zero1", "zero2", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N", "zero3-offload",
        "host pageable", "CUDA context", "cuBLASLt workspace 32.0 MiB", "arXiv 1910.02054"})
    EXPECT_NE(table.find(needle), std::string::npos) << needle << "\n" << table;
}

// Hybrid sharding (zero_hpz_partition_size G): zero3's row as if on G GPUs — 16Ψ/G of model
// states and G GPUs' gathered layers — named zero3-hybrid; no row when G is 1 or every GPU, and
// an error when G does not divide the GPUs.
TEST(Estimator, HybridShardingRow) {
  MemoryEstimateOptions o;
  o.model = gpt2_preset("gpt2-xl");
  o.gpus = 8;
  const auto row = [](const MemoryEstimate& e, const std::string& name) {
    for (const StrategyEstimate& s : e.strategies)
      if ((s.name.empty() ? to_string(s.strategy) : s.name) == name) return s;
    return StrategyEstimate{};
  };
  EXPECT_TRUE(row(estimate_memory(o), "zero3-hybrid").formula.empty());
  o.hpz_partition_size = 2;
  const MemoryEstimate e = estimate_memory(o);
  const StrategyEstimate h = row(e, "zero3-hybrid");
  EXPECT_EQ(h.formula, "16Ψ/G");
  EXPECT_DOUBLE_EQ(h.model_states, 16.0 * static_cast<double>(e.parameters) / 2);
  MemoryEstimateOptions two = o;
  two.gpus = 2;
  two.hpz_partition_size = 1;
  const double gathered_on_two =
      row(estimate_memory(two), "zero3").buffers - kPeerStagingBytes;  // NCCL within the group
  EXPECT_DOUBLE_EQ(h.buffers, gathered_on_two);
  EXPECT_NE(format_memory_estimate(e, o).find("zero3-hybrid (zero_hpz_partition_size G = 2)"),
            std::string::npos);
  o.hpz_partition_size = 3;
  EXPECT_THROW(estimate_memory(o), ConfigError);
}

// zero3 on one GPU gathers nothing (every layer is its own shard) and holds dp's 16Ψ; on several
// GPUs it holds 16Ψ/N plus the gathered layers, fewer of them the shorter the reuse distance.
TEST(Estimator, Zero3TransientBuffers) {
  const GPT2Config c = gpt2_preset("gpt2-medium");
  EXPECT_EQ(zero3_transient_bytes(c, 1, Zero3Limits{}, 100'000), 0);
  EXPECT_DOUBLE_EQ(zero_model_state_bytes(StrategyKind::kZero3, c.num_parameters(), 1),
                   zero_model_state_bytes(StrategyKind::kDataParallel, c.num_parameters(), 1));
  Zero3Limits keep_all, release_now;
  release_now.max_reuse_distance = 0;
  release_now.prefetch_bucket_size = 0;
  const double kept = zero3_transient_bytes(c, 4, keep_all, 100'000);
  const double released = zero3_transient_bytes(c, 4, release_now, 100'000);
  EXPECT_GT(kept, released);
  // Released at once and not prefetched: at most the head's embedding (tied) and one block are
  // gathered, plus the embedding's gradient buffer (held through backward), the current block's
  // and two reductions in flight; the arena holding them adds the largest layer, the embedding.
  const double wte = 2.0 * static_cast<double>(c.vocab_size + c.n_positions) * c.n_embd;
  const double block = 2.0 * (12.0 * c.n_embd * c.n_embd + 13.0 * c.n_embd);
  EXPECT_LE(released, 3 * wte + 4 * block + 1e6);
  EXPECT_GE(released, 3 * wte + block);
}

}  // namespace
}  // namespace shardtrain
