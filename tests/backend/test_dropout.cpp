// Dropout (GPT-2's embd_pdrop, attn_pdrop, resid_pdrop): the Philox4x32-10 generator against its
// published known answers, the masks' statistics and determinism, the per-micro-batch seeds, and
// that evaluation and generation are unaffected. Gradient checks with dropout are in
// test_gradcheck.cpp; the CUDA kernels are compared with these CPU masks in test_cuda_backend.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "core/philox.h"
#include "core/rng.h"
#include "model/gpt2.h"

using namespace shardtrain;

namespace {

Tensor T(std::vector<float>& v, std::initializer_list<int64_t> dims) {
  return Tensor(v.data(), DType::kF32, DeviceKind::kCPU, dims);
}

Dropout make_dropout(float p, uint64_t seed, uint32_t site = 0) {
  Dropout d;
  d.p = p;
  d.seed = seed;
  d.site = site;
  return d;
}

/// The mask dropout_backward applies to a tensor of ones: 0 or 1/(1-p) per element.
std::vector<float> mask_of(Backend& be, const Dropout& d, int64_t n) {
  std::vector<float> ones(static_cast<size_t>(n), 1.0f), out(static_cast<size_t>(n));
  be.dropout_backward(T(out, {n}), T(ones, {n}), d);
  return out;
}

GPT2Config tiny(float p) {
  GPT2Config c;
  c.name = "dropout-tiny";
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.vocab_size = 37;
  c.n_positions = 8;
  c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = p;
  return c;
}

/// A CPU model with bound parameters (seed 5) and gradients.
struct TinyModel {
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::unique_ptr<GPT2Model> model;
  std::vector<float> params, grads;

  explicit TinyModel(const GPT2Config& c) {
    model = std::make_unique<GPT2Model>(c, *be);
    const int64_t n = model->layout().numel();
    params.resize(static_cast<size_t>(n));
    grads.assign(static_cast<size_t>(n), 0.f);
    model->init_parameters(params.data(), 5);
    model->bind(Tensor(params.data(), DType::kF32, DeviceKind::kCPU, {n}),
                Tensor(grads.data(), DType::kF32, DeviceKind::kCPU, {n}));
  }
};

const std::vector<int32_t> kTokens = {1, 5, 9, 2, 28, 3, 4, 4, 0, 17, 11, 6, 30, 8, 7, 36};
const std::vector<int32_t> kTargets = {5, 9, 2, 28, 3, 7, 4, 0, 17, 11, 6, 1, 8, 7, 36, 2};

}  // namespace

// Random123's known-answer vectors (kat_vectors, philox4x32 with 10 rounds).
TEST(Philox, KnownAnswerVectors) {
  struct Kat {
    Philox4x32 ctr;
    uint32_t k0, k1;
    Philox4x32 expect;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}}},
      {{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
       0xffffffffu,
       0xffffffffu,
       {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
       0xa4093822u,
       0x299f31d0u,
       {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}},
  };
  for (const Kat& k : kats) {
    const Philox4x32 r = philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r.v[i], k.expect.v[i]) << "lane " << i;
  }
}

TEST(Dropout, ThresholdAndScale) {
  EXPECT_EQ(make_dropout(0.0f, 1).threshold(), 0u);
  EXPECT_EQ(make_dropout(0.5f, 1).threshold(), 0x80000000u);
  EXPECT_EQ(make_dropout(0.25f, 1).threshold(), 0x40000000u);
  EXPECT_FLOAT_EQ(make_dropout(0.1f, 1).scale(), 1.0f / 0.9f);
  EXPECT_FALSE(make_dropout(0.0f, 1).active());
  EXPECT_TRUE(make_dropout(0.1f, 1).active());
}

// Keep rate within 4σ of 1 − p over 2^18 elements; kept elements are scaled by exactly 1/(1−p).
TEST(Dropout, MaskStatisticsKeepRateAndScale) {
  auto be = make_cpu_backend();
  const int64_t n = int64_t{1} << 18;
  for (float p : {0.1f, 0.5f, 0.9f}) {
    SCOPED_TRACE(p);
    const Dropout d = make_dropout(p, 1234, 3);
    const std::vector<float> m = mask_of(*be, d, n);
    int64_t kept = 0;
    for (float v : m) {
      if (v != 0.f) {
        ASSERT_EQ(v, d.scale());
        ++kept;
      }
    }
    const double q = 1.0 - p, sigma = std::sqrt(static_cast<double>(n) * q * (1.0 - q));
    EXPECT_NEAR(static_cast<double>(kept), static_cast<double>(n) * q, 4.0 * sigma);
    // Mean of the mask ≈ 1: dropout keeps the expectation.
    double mean = 0;
    for (float v : m) mean += v;
    mean /= static_cast<double>(n);
    EXPECT_NEAR(mean, 1.0, 4.0 * sigma / static_cast<double>(n) / q);
    // No long-range structure: each of the four Philox lanes keeps at the same rate.
    for (int lane = 0; lane < 4; ++lane) {
      int64_t k = 0;
      for (int64_t i = lane; i < n; i += 4) k += m[static_cast<size_t>(i)] != 0.f;
      const double nl = static_cast<double>(n / 4);
      EXPECT_NEAR(static_cast<double>(k), nl * q, 4.0 * std::sqrt(nl * q * (1.0 - q)))
          << "lane " << lane;
    }
  }
}

// Attention dropout's 8-bit decisions (AttnDropout8): p rounded to a multiple of 1/256, the scale
// 1/(1 − p_effective), one Philox call per 16 elements (byte index & 3 of lane (index >> 2) & 3 of
// the call of counter index >> 4), keep iff byte ≥ threshold.
TEST(Dropout, AttentionEightBitThresholdScaleAndBytes) {
  EXPECT_EQ(AttnDropout8::threshold(make_dropout(0.1f, 1)), 26u);
  EXPECT_EQ(AttnDropout8::threshold(make_dropout(0.5f, 1)), 128u);
  EXPECT_EQ(AttnDropout8::threshold(make_dropout(0.999f, 1)), 255u);
  EXPECT_FLOAT_EQ(AttnDropout8::p_effective(make_dropout(0.1f, 1)), 26.0f / 256.0f);
  EXPECT_FLOAT_EQ(AttnDropout8::scale(make_dropout(0.1f, 1)), 256.0f / 230.0f);
  EXPECT_FLOAT_EQ(AttnDropout8::scale(make_dropout(0.25f, 1)), 1.0f / 0.75f);
  const Dropout d = make_dropout(0.3f, 0x123456789ull, 5);
  const uint32_t th = AttnDropout8::threshold(d);
  for (uint64_t g : {uint64_t{0}, uint64_t{1}, uint64_t{12345}, uint64_t{1} << 33}) {
    const Philox4x32 r = philox4x32_10(
        Philox4x32{{static_cast<uint32_t>(g), static_cast<uint32_t>(g >> 32), 5u, 0u}}, 0x23456789u,
        0x1u);
    const uint32_t mask = AttnDropout8::keep_mask16(d, 16 * g, th);
    for (uint64_t i = 0; i < 16; ++i) {
      const uint32_t byte = (r.v[i >> 2] >> (8 * (i & 3))) & 0xFFu;
      ASSERT_EQ(AttnDropout8::keep(d, 16 * g + i, th), byte >= th) << g << " " << i;
      ASSERT_EQ(((mask >> i) & 1u) != 0, byte >= th) << g << " " << i;
    }
  }
}

// Keep rate within 4σ of 1 − p_effective over 2^18 elements, and at every byte position of a
// group of 16; the mean multiplier ≈ 1 (the expectation is exact with the effective scale).
TEST(Dropout, AttentionEightBitMaskStatistics) {
  const int64_t n = int64_t{1} << 18;
  for (float p : {0.1f, 0.5f, 0.9f}) {
    SCOPED_TRACE(p);
    const Dropout d = make_dropout(p, 4321, 6);
    const uint32_t th = AttnDropout8::threshold(d);
    const double q = 1.0 - AttnDropout8::p_effective(d);
    int64_t kept = 0;
    std::vector<int64_t> per(16, 0);
    for (int64_t g = 0; g < n / 16; ++g) {
      const uint32_t m = AttnDropout8::keep_mask16(d, static_cast<uint64_t>(16 * g), th);
      for (int i = 0; i < 16; ++i) {
        const bool k = (m >> i) & 1u;
        kept += k;
        per[static_cast<size_t>(i)] += k;
      }
    }
    const double sigma = std::sqrt(static_cast<double>(n) * q * (1.0 - q));
    EXPECT_NEAR(static_cast<double>(kept), static_cast<double>(n) * q, 4.0 * sigma);
    const double mean = static_cast<double>(kept) * AttnDropout8::scale(d) / static_cast<double>(n);
    EXPECT_NEAR(mean, 1.0, 4.0 * sigma / static_cast<double>(n) / q + 1e-6);
    const double nl = static_cast<double>(n / 16);
    for (int i = 0; i < 16; ++i)
      EXPECT_NEAR(static_cast<double>(per[static_cast<size_t>(i)]), nl * q,
                  4.0 * std::sqrt(nl * q * (1.0 - q)))
          << "byte " << i;
  }
}

// Same (seed, site) → the same mask; another seed, site or stream → another mask; the mask of
// an element does not depend on the length of the tensor (counter-based).
TEST(Dropout, MasksAreDeterministicPerSeedAndSite) {
  auto be = make_cpu_backend();
  const int64_t n = 4099;
  const Dropout d = make_dropout(0.3f, 77, 4);
  const auto a = mask_of(*be, d, n), b = mask_of(*be, d, n);
  EXPECT_EQ(a, b);
  const auto prefix = mask_of(*be, d, 1001);
  for (size_t i = 0; i < prefix.size(); ++i) ASSERT_EQ(prefix[i], a[i]) << i;
  Dropout other_seed = d, other_site = d, other_stream = d;
  other_seed.seed = 78;
  other_site.site = 5;
  other_stream.stream = 1;
  for (const Dropout& o : {other_seed, other_site, other_stream}) {
    const auto m = mask_of(*be, o, n);
    int64_t differ = 0;
    for (size_t i = 0; i < m.size(); ++i) differ += (m[i] != 0.f) != (a[i] != 0.f);
    // Independent masks with p = 0.3 differ in 2·0.3·0.7 = 42% of the elements.
    EXPECT_GT(differ, n / 4);
  }
}

// The forward ops and dropout_backward draw the same mask for the same Dropout.
TEST(Dropout, ForwardOpsAndBackwardShareTheMask) {
  auto be = make_cpu_backend();
  const int64_t N = 12, C = 16;
  const Dropout d = make_dropout(0.4f, 9, 2);
  const auto m = mask_of(*be, d, N * C);
  std::vector<float> a(N * C, 0.5f), b(N * C, 2.0f), out(N * C);
  be->add(T(out, {N, C}), T(a, {N, C}), T(b, {N, C}), d);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_FLOAT_EQ(out[i], 0.5f + 2.0f * m[i]) << i;
  // Embedding: wte rows of ones, wpe zeros → out = mask.
  const int64_t B = 3, Tn = 4, V = 5;
  std::vector<float> wte(V * C, 1.0f), wpe(Tn * C, 0.0f), emb(B * Tn * C);
  std::vector<int32_t> tok = {0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1};
  Tensor tokens(tok.data(), DType::kI32, DeviceKind::kCPU, {B, Tn});
  be->embedding_forward(T(emb, {B, Tn, C}), tokens, T(wte, {V, C}), T(wpe, {Tn, C}), d);
  for (size_t i = 0; i < emb.size(); ++i) ASSERT_EQ(emb[i], m[i]) << i;
}

// p = 0 is the identity, bit for bit (the code path of a model without dropout).
TEST(Dropout, ZeroProbabilityIsBitIdentical) {
  auto be = make_cpu_backend();
  const int64_t n = 1000;
  std::vector<float> a(n), b(n), plain(n), dropped(n);
  SplitMix64 g{3};
  for (int64_t i = 0; i < n; ++i) {
    a[static_cast<size_t>(i)] = static_cast<float>(g.uniform() - 0.5);
    b[static_cast<size_t>(i)] = static_cast<float>(g.uniform() - 0.5);
  }
  be->add(T(plain, {n}), T(a, {n}), T(b, {n}));
  be->add(T(dropped, {n}), T(a, {n}), T(b, {n}), make_dropout(0.0f, 123));
  EXPECT_EQ(plain, dropped);
  // A model whose probabilities are 0 gives the same loss and gradients whatever the seed.
  TinyModel m1(tiny(0.0f)), m2(tiny(0.0f));
  const double l1 = m1.model->forward(kTokens.data(), kTargets.data(), 2, 8, 1.0f / 16, true, 1);
  m1.model->backward();
  const double l2 = m2.model->forward(kTokens.data(), kTargets.data(), 2, 8, 1.0f / 16, true, 2);
  m2.model->backward();
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(m1.grads, m2.grads);
}

TEST(DropoutModel, SameSeedSameLossAndGradients) {
  TinyModel m1(tiny(0.1f)), m2(tiny(0.1f));
  const uint64_t seed = micro_batch_dropout_seed(42, 0, 7, 0);
  const double l1 = m1.model->forward(kTokens.data(), kTargets.data(), 2, 8, 1.0f / 16, true, seed);
  m1.model->backward();
  const double l2 = m2.model->forward(kTokens.data(), kTargets.data(), 2, 8, 1.0f / 16, true, seed);
  m2.model->backward();
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(m1.grads, m2.grads);
  // Another micro-batch index (or step, or rank) draws other masks: another loss.
  TinyModel m3(tiny(0.1f));
  const double l3 = m3.model->forward(kTokens.data(), kTargets.data(), 2, 8, 1.0f / 16, true,
                                      micro_batch_dropout_seed(42, 0, 7, 1));
  EXPECT_NE(l1, l3);
}

TEST(DropoutModel, MicroBatchSeedsAreDistinct) {
  std::set<uint64_t> seen;
  for (uint64_t run : {0ull, 42ull})
    for (int64_t rank = 0; rank < 4; ++rank)
      for (int64_t step = 0; step < 8; ++step)
        for (int64_t mb = 0; mb < 8; ++mb)
          EXPECT_TRUE(seen.insert(micro_batch_dropout_seed(run, rank, step, mb)).second)
              << run << " " << rank << " " << step << " " << mb;
  EXPECT_EQ(micro_batch_dropout_seed(42, 1, 2, 3), micro_batch_dropout_seed(42, 1, 2, 3));
}

// Evaluation (for_backward false) and generation (no targets) never drop: the same loss and
// logits as the model without dropout, bit for bit; training forward does differ.
TEST(DropoutModel, EvalAndGenerateUnaffected) {
  TinyModel with(tiny(0.3f)), without(tiny(0.0f));
  ASSERT_EQ(with.params, without.params);
  const double e1 = with.model->forward(kTokens.data(), kTargets.data(), 2, 8, 1.0f, false, 5);
  const double e2 = without.model->forward(kTokens.data(), kTargets.data(), 2, 8, 1.0f, false, 5);
  EXPECT_EQ(e1, e2);
  with.model->forward(kTokens.data(), nullptr, 2, 8, 1.0f, false);
  without.model->forward(kTokens.data(), nullptr, 2, 8, 1.0f, false);
  for (int64_t t = 0; t < 8; ++t)
    EXPECT_EQ(with.model->logits_at(1, t), without.model->logits_at(1, t));
  const double t1 = with.model->forward(kTokens.data(), kTargets.data(), 2, 8, 1.0f, true, 5);
  const double t2 = without.model->forward(kTokens.data(), kTargets.data(), 2, 8, 1.0f, true, 5);
  EXPECT_NE(t1, t2);
  EXPECT_EQ(t2, e2);  // without dropout the training forward's loss is the evaluation's
}

// The zero-bubble split backward (B then W) gives the full backward's gradients under dropout:
// the stashed branch gradients are the masked ones.
TEST(DropoutModel, SplitBackwardMatchesFullBackward) {
  TinyModel full(tiny(0.2f)), split(tiny(0.2f));
  full.model->forward(kTokens.data(), kTargets.data(), 2, 8, 1.0f / 16, true, 11);
  full.model->backward();
  GPT2Model& m = *split.model;
  m.prepare(0, kTokens.data(), kTargets.data(), 2, 8, 1.0f / 16, true, 11);
  m.forward_layers(0, 0, m.num_layers());
  m.backward_layers(0, 0, m.num_layers(), BackwardPass::kInput);
  m.backward_layers(0, 0, m.num_layers(), BackwardPass::kWeight);
  ASSERT_EQ(full.grads.size(), split.grads.size());
  for (size_t i = 0; i < full.grads.size(); ++i)
    ASSERT_EQ(full.grads[i], split.grads[i]) << "element " << i;
}
