// A whole GPT-2 model on the CUDA backend against the CPU reference (fp32 and bf16, with and
// without dropout, split backward and stage parts) and the fused flash-attention kernels
// (cuda_flash_attention.cu): selection, forward and backward against the CPU, determinism,
// fallback for unsupported head sizes. Every test skips without a GPU (see
// tests/backend/test_cuda_backend.cpp for the tolerances).
#include "cuda_test_support.h"

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaOpTest, ::testing::Values(DType::kF32, DType::kBF16),
                         dtype_param_name);

namespace {

struct TinyModel {
  GPT2Config config;
  TinyModel() {
    config.name = "cuda-parity";
    config.n_layer = 2;
    config.n_head = 2;
    config.n_embd = 64;
    config.vocab_size = 97;
    config.n_positions = 16;
  }
};

}  // namespace

namespace {

/// The whole-model comparison described above, for `gpu` in compute dtype `dt` against `cpu`:
/// config `c`, micro-batches [B, Tn], parameters and data drawn from `seed`.
void check_whole_model(Backend& cpu, Backend& gpu, DType dt, const GPT2Config& c, int64_t B,
                       int64_t Tn, uint64_t seed) {
  const bool fp32 = dt == DType::kF32;
  const int64_t N = B * Tn;
  GPT2Model cpu_model(c, cpu), gpu_model(c, gpu), gpu_ckpt(c, gpu, true);
  const int64_t n = cpu_model.layout().numel();

  // GPT-2 init with larger weights and non-trivial LayerNorm parameters, so every path carries a
  // visible gradient; rounded to the compute dtype so both sides start from the same values.
  std::vector<float> params(static_cast<size_t>(n));
  cpu_model.init_parameters(params.data(), seed);
  for (auto& p : params) p *= 2.0f;
  for (const ParamTensor* t : cpu_model.layout().tensors())
    if (t->init_std == 0.f)
      for (int64_t i = 0; i < t->numel; ++i)
        params[static_cast<size_t>(t->offset + i)] += 0.1f * static_cast<float>(i % 3);
  params = download(gpu, upload(gpu, params, dt));  // as the compute dtype holds them

  std::vector<float> grads(static_cast<size_t>(n), 0.0f);
  cpu_model.bind(host(params, {n}), host(grads, {n}));
  FlatBuffer gparams = upload(gpu, params, dt), ggrads(gpu, dt, n), ggrads_ckpt(gpu, dt, n);
  gpu_model.bind(gparams.view(), ggrads.view());
  gpu_ckpt.bind(gparams.view(), ggrads_ckpt.view());

  // Two micro-batches (gradients accumulate); one ignored target.
  std::vector<std::vector<int32_t>> tokens, targets;
  for (uint64_t s = 0; s < 2; ++s) {
    tokens.push_back(randi(static_cast<size_t>(N), seed + 100 + s, c.vocab_size));
    targets.push_back(randi(static_cast<size_t>(N), seed + 110 + s, c.vocab_size));
  }
  targets[0][5] = -1;
  targets[1][static_cast<size_t>(N - 3)] = -1;
  const float scale = 1.0f / static_cast<float>(2 * N);

  for (size_t mb = 0; mb < 2; ++mb) {
    SCOPED_TRACE("micro-batch " + std::to_string(mb));
    // Logits (inference forward).
    cpu_model.forward(tokens[mb].data(), nullptr, B, Tn, 1.0f, false);
    gpu_model.forward(tokens[mb].data(), nullptr, B, Tn, 1.0f, false);
    std::vector<float> cl, gl;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tn; ++t) {
        auto rc = cpu_model.logits_at(b, t), rg = gpu_model.logits_at(b, t);
        cl.insert(cl.end(), rc.begin(), rc.end());
        gl.insert(gl.end(), rg.begin(), rg.end());
      }
    if (fp32)
      expect_close(gl, cl, 1e-4, 1e-5, "logits");
    else
      EXPECT_GT(cosine(gl, cl), 0.99) << "logits";

    // Training forward + backward.
    const double cpu_loss =
        cpu_model.forward(tokens[mb].data(), targets[mb].data(), B, Tn, scale, true);
    cpu_model.backward();
    const double gpu_loss =
        gpu_model.forward(tokens[mb].data(), targets[mb].data(), B, Tn, scale, true);
    gpu_model.backward();
    const double ckpt_loss =
        gpu_ckpt.forward(tokens[mb].data(), targets[mb].data(), B, Tn, scale, true);
    gpu_ckpt.backward();
    EXPECT_NEAR(gpu_loss, cpu_loss, (fp32 ? 1e-4 : 2e-2) * std::fabs(cpu_loss));
    EXPECT_EQ(ckpt_loss, gpu_loss) << "activation checkpointing changed the loss";
  }

  const std::vector<float> got = download(gpu, ggrads);
  for (const ParamTensor* t : cpu_model.layout().tensors()) {
    const auto b = static_cast<size_t>(t->offset), e = b + static_cast<size_t>(t->numel);
    std::vector<float> want(grads.begin() + static_cast<std::ptrdiff_t>(b),
                            grads.begin() + static_cast<std::ptrdiff_t>(e));
    std::vector<float> g(got.begin() + static_cast<std::ptrdiff_t>(b),
                         got.begin() + static_cast<std::ptrdiff_t>(e));
    double wn = 0, dn = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      wn += static_cast<double>(want[i]) * want[i];
      dn += (static_cast<double>(g[i]) - want[i]) * (static_cast<double>(g[i]) - want[i]);
    }
    ASSERT_GT(wn, 0.0) << t->name << " has an all-zero CPU gradient";
    if (fp32) {
      expect_close(g, want, 1e-3, 1e-4, t->name);
      EXPECT_LE(std::sqrt(dn / wn), 1e-3) << t->name << " relative L2 error";
    } else {
      EXPECT_GT(cosine(g, want), 0.99) << t->name;
    }
  }
  // Activation checkpointing recomputes the same forward: identical gradients, bit for bit.
  EXPECT_TRUE(bit_equal(download(gpu, ggrads_ckpt), got))
      << "activation checkpointing changed gradients";

  // Determinism: the same two micro-batches again from zero gradients give identical bits.
  gpu.fill_zero(ggrads.view());
  for (size_t mb = 0; mb < 2; ++mb) {
    gpu_model.forward(tokens[mb].data(), targets[mb].data(), B, Tn, scale, true);
    gpu_model.backward();
  }
  EXPECT_TRUE(bit_equal(download(gpu, ggrads), got))
      << "GPU gradients differ between identical runs";
}

}  // namespace

TEST_P(CudaOpTest, WholeModelMatchesCpu) {
  check_whole_model(*cpu, *gpu, dt(), TinyModel().config, 2, 16, 11);
}

// The whole-model comparison with all three dropouts on (p = 0.1; materialized attention): the
// training forward of both backends draws the same masks (seed 0 in every forward), so losses
// and gradients compare as without dropout; checkpointing's recompute draws them again.
TEST_P(CudaOpTest, WholeModelWithDropoutMatchesCpu) {
  GPT2Config c = TinyModel().config;
  c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = 0.1f;
  check_whole_model(*cpu, *gpu, dt(), c, 2, 16, 12);
}

// Pipeline building blocks on the GPU (tests/stage_parts.h): the zero-bubble split backward is
// the fused one bit for bit (the same cuBLASLt GEMMs, dweight skipped in B and dinp in W), and
// two stage parts reproduce the whole model (wte's two gradient parts summed in another order).
TEST_P(CudaOpTest, SplitBackwardAndStagePartsMatchWholeModel) {
  GPT2Config c = TinyModel().config;
  test_support::check_split_backward(*gpu, c, 2, 16);
  test_support::check_stage_parts(*gpu, c, 1, 2, 16, dt() == DType::kF32 ? 1e-5 : 2e-2);
}

// ==== flash attention (cuda_flash_attention.cu) =================================================
// The fused kernels (the default in bf16/fp16; the tests construct their backends with
// SHARDTRAIN_ATTENTION=flash so a user's environment cannot change that), against the CPU
// reference computed in fp32 from the same rounded inputs. Tolerances, per tensor: max |got − want|
// ≤ 2e-2 · max(1, max|want|) and relative L2 error ≤ 1e-2 (P and dS are rounded to the compute
// dtype as tensor-core operands, outputs once when stored; a host emulation of the kernels measured
// ≤ 1.1e-2 max abs and ≤ 3e-3 relative L2 in bf16, 8× less in fp16). lse (fp32 statistics, never
// rounded to bf16) within 1e-3 · max(1, |lse|) of a double log-sum-exp. Forward and backward must
// be bit-identical from run to run (no atomics).

namespace {

/// A CUDA backend constructed with SHARDTRAIN_ATTENTION=flash (the variable is restored after),
/// whatever the user's environment says.
std::unique_ptr<Backend> make_flash_backend(DType dt) {
  ScopedEnv env("SHARDTRAIN_ATTENTION", "flash");
  return make_cuda_backend(0, dt);
}

/// Checks got against want with the flash tolerances above. The relative L2 error's denominator
/// is floored at 1e-2·sqrt(n) (an RMS of 1e-2), for tensors that are zero in exact arithmetic
/// (dq and dk at T = 1).
void expect_flash_close(const std::vector<float>& got, const std::vector<float>& want,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double max_abs = 0, max_want = 0, d2 = 0, w2 = 0;
  size_t worst = 0, nonfinite = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++nonfinite;
      continue;
    }
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (d > max_abs) {
      max_abs = d;
      worst = i;
    }
    max_want = std::max(max_want, std::fabs(static_cast<double>(want[i])));
    d2 += d * d;
    w2 += static_cast<double>(want[i]) * want[i];
  }
  EXPECT_EQ(nonfinite, 0u) << what << ": non-finite values";
  EXPECT_LE(max_abs, 2e-2 * std::max(1.0, max_want))
      << what << ": max abs error at [" << worst << "]: got " << got[worst] << ", want "
      << want[worst] << " (max|want| " << max_want << ")";
  const double floor = 1e-2 * std::sqrt(static_cast<double>(got.size()));
  EXPECT_LE(std::sqrt(d2) / std::max(std::sqrt(w2), floor), 1e-2) << what << ": relative L2 error";
}

/// Elements [slot·C, (slot+1)·C) of every row of a [rows, 3C] tensor: q (0), k (1) or v (2).
std::vector<float> qkv_part(const std::vector<float>& x, int64_t C, int slot) {
  std::vector<float> r;
  const auto rows = static_cast<int64_t>(x.size()) / (3 * C);
  r.reserve(static_cast<size_t>(rows * C));
  for (int64_t i = 0; i < rows; ++i) {
    const auto b = x.begin() + static_cast<std::ptrdiff_t>(i * 3 * C + slot * C);
    r.insert(r.end(), b, b + static_cast<std::ptrdiff_t>(C));
  }
  return r;
}

/// A flash-attention CUDA backend in the dtype of the parameter (bf16, fp16), plus the CPU
/// reference.
class FlashAttentionTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU visible (or built without CUDA)";
    cpu = make_cpu_backend();
    gpu = make_flash_backend(GetParam());
  }
  DType dt() const { return GetParam(); }
  FlatBuffer up(const std::vector<float>& h) { return upload(*gpu, h, dt()); }
  std::vector<float> rounded(const std::vector<float>& h) { return download(*gpu, up(h)); }
  std::vector<float> down(const FlatBuffer& f) { return download(*gpu, f); }

  std::unique_ptr<Backend> cpu, gpu;
};

}  // namespace

INSTANTIATE_TEST_SUITE_P(Dtypes, FlashAttentionTest, ::testing::Values(DType::kBF16, DType::kF16),
                         dtype_param_name);

TEST_P(FlashAttentionTest, SelectedByEnvironmentAtConstruction) {
  EXPECT_FALSE(gpu->attention_saves_probs(64)) << "SHARDTRAIN_ATTENTION=flash should select flash";
  {
    // Fixed at construction: the variable changing afterwards does not flip an existing backend.
    ScopedEnv env("SHARDTRAIN_ATTENTION", "materialized");
    EXPECT_FALSE(gpu->attention_saves_probs(64));
    EXPECT_TRUE(make_cuda_backend(0, dt())->attention_saves_probs(64));
  }
  for (const char* dflt : {"", static_cast<const char*>(nullptr)}) {
    ScopedEnv env("SHARDTRAIN_ATTENTION", dflt ? dflt : "");
    if (!dflt) ::unsetenv("SHARDTRAIN_ATTENTION");
    auto b = make_cuda_backend(0, dt());
    EXPECT_FALSE(b->attention_saves_probs(64))
        << "flash is the default (variable " << (dflt ? "empty" : "unset") << ")";
    EXPECT_FALSE(b->attention_saves_probs(32));
    EXPECT_FALSE(b->attention_saves_probs(128));
    EXPECT_TRUE(b->attention_saves_probs(48)) << "head sizes flash lacks fall back";
  }
  {
    // fp32 tensors keep the materialized kernels.
    ScopedEnv env("SHARDTRAIN_ATTENTION", "flash");
    EXPECT_TRUE(make_cuda_backend(0, DType::kF32)->attention_saves_probs(64));
  }
  {
    ScopedEnv env("SHARDTRAIN_ATTENTION", "fastest");
    try {
      make_cuda_backend(0, dt());
      FAIL() << "expected an error for an unknown SHARDTRAIN_ATTENTION value";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("SHARDTRAIN_ATTENTION"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fastest"), std::string::npos) << msg;
    }
  }
}

TEST_P(FlashAttentionTest, ForwardBackwardMatchCpuAndAreDeterministic) {
  struct Case {
    int64_t B, NH, Tn, hs;
  };
  // T around the 64-row tile (1, 63, 64, 65), several tiles with a ragged end (200, 257), and
  // the other head sizes (hs = 128 streams 32-row tiles in backward).
  for (const Case& cs :
       {Case{2, 3, 1, 64}, Case{2, 3, 63, 64}, Case{2, 3, 64, 64}, Case{2, 3, 65, 64},
        Case{2, 3, 200, 64}, Case{2, 3, 257, 64}, Case{1, 2, 128, 32}, Case{2, 1, 33, 32},
        Case{1, 2, 128, 128}, Case{1, 2, 97, 128}}) {
    const int64_t B = cs.B, NH = cs.NH, Tn = cs.Tn, hs = cs.hs, C = NH * hs;
    SCOPED_TRACE("B=" + std::to_string(B) + " NH=" + std::to_string(NH) +
                 " T=" + std::to_string(Tn) + " hs=" + std::to_string(hs));
    const auto nqkv = static_cast<size_t>(B * Tn * 3 * C), nout = static_cast<size_t>(B * Tn * C),
               nprob = static_cast<size_t>(B * NH * Tn * Tn),
               nlse = static_cast<size_t>(B * NH * Tn);
    const auto seed = static_cast<uint64_t>(1000 + Tn * 7 + hs);
    // |qkv| ≤ 1.5: scores up to ~2.5 standard deviations, a softmax far from uniform.
    auto qkv = rounded(randu(nqkv, seed, 1.5f)), dy = rounded(randu(nout, seed + 1));

    // CPU reference (fp32, materialized probabilities).
    std::vector<float> out(nout), probs(nprob), dqkv(nqkv, 777.0f);
    AttentionSaved cs_saved{host(probs, {B, NH, Tn, Tn}), {}};
    cpu->attention_forward(host(out, {B, Tn, C}), cs_saved, host(qkv, {B, Tn, 3 * C}),
                           static_cast<int>(NH));
    cpu->attention_backward(host(dqkv, {B, Tn, 3 * C}), host(dy, {B, Tn, C}),
                            host(qkv, {B, Tn, 3 * C}), host(out, {B, Tn, C}), cs_saved,
                            static_cast<int>(NH));
    // Log-sum-exp of each causal score row, in double.
    std::vector<float> lse(nlse);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t t = 0; t < Tn; ++t) {
          std::vector<double> s(static_cast<size_t>(t + 1));
          double m = -INFINITY;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            double dot = 0;
            for (int64_t i = 0; i < hs; ++i)
              dot +=
                  static_cast<double>(qkv[static_cast<size_t>((b * Tn + t) * 3 * C + h * hs + i)]) *
                  qkv[static_cast<size_t>((b * Tn + t2) * 3 * C + C + h * hs + i)];
            s[static_cast<size_t>(t2)] = dot * scale;
            m = std::max(m, dot * scale);
          }
          double l = 0;
          for (double x : s) l += std::exp(x - m);
          lse[static_cast<size_t>((b * NH + h) * Tn + t)] = static_cast<float>(m + std::log(l));
        }

    // GPU: forward twice, backward twice (into garbage-filled dqkv: it is overwritten).
    ASSERT_FALSE(gpu->attention_saves_probs(static_cast<int>(hs)));
    FlatBuffer gqkv = up(qkv), gdy = up(dy), gout(*gpu, dt(), static_cast<int64_t>(nout)),
               gout2(*gpu, dt(), static_cast<int64_t>(nout)),
               glse(*gpu, DType::kF32, static_cast<int64_t>(nlse)),
               glse2(*gpu, DType::kF32, static_cast<int64_t>(nlse)),
               gdqkv = up(std::vector<float>(nqkv, 777.0f)),
               gdqkv2 = up(std::vector<float>(nqkv, -777.0f));
    const int nh = static_cast<int>(NH);
    AttentionSaved gs{{}, dev(glse, {B, NH, Tn})}, gs2{{}, dev(glse2, {B, NH, Tn})};
    gpu->attention_forward(dev(gout, {B, Tn, C}), gs, dev(gqkv, {B, Tn, 3 * C}), nh);
    gpu->attention_forward(dev(gout2, {B, Tn, C}), gs2, dev(gqkv, {B, Tn, 3 * C}), nh);
    gpu->attention_backward(dev(gdqkv, {B, Tn, 3 * C}), dev(gdy, {B, Tn, C}),
                            dev(gqkv, {B, Tn, 3 * C}), dev(gout, {B, Tn, C}), gs, nh);
    gpu->attention_backward(dev(gdqkv2, {B, Tn, 3 * C}), dev(gdy, {B, Tn, C}),
                            dev(gqkv, {B, Tn, 3 * C}), dev(gout, {B, Tn, C}), gs, nh);

    const auto got_out = down(gout), got_lse = download(*gpu, glse), got_dqkv = down(gdqkv);
    expect_flash_close(got_out, out, "flash forward out");
    for (size_t i = 0; i < nlse; ++i)
      ASSERT_NEAR(got_lse[i], lse[i], 1e-3 * std::max(1.0, std::fabs(static_cast<double>(lse[i]))))
          << "lse element " << i;
    expect_flash_close(qkv_part(got_dqkv, C, 0), qkv_part(dqkv, C, 0), "flash backward dq");
    expect_flash_close(qkv_part(got_dqkv, C, 1), qkv_part(dqkv, C, 1), "flash backward dk");
    expect_flash_close(qkv_part(got_dqkv, C, 2), qkv_part(dqkv, C, 2), "flash backward dv");
    EXPECT_GT(cosine(got_dqkv, dqkv), 0.999);
    EXPECT_TRUE(bit_equal(down(gout2), got_out)) << "forward differs between identical runs";
    EXPECT_TRUE(bit_equal(download(*gpu, glse2), got_lse)) << "lse differs between identical runs";
    EXPECT_TRUE(bit_equal(down(gdqkv2), got_dqkv)) << "backward differs between identical runs";
  }
}

// A head size the fused kernels lack (48) runs the materialized kernels in the same backend:
// attention_saves_probs(48) says so, and forward + backward match the CPU.
TEST_P(FlashAttentionTest, UnsupportedHeadSizeFallsBackToMaterialized) {
  const int64_t B = 2, Tn = 70, NH = 2, C = 96;  // head size 48
  ASSERT_TRUE(gpu->attention_saves_probs(48));
  const auto nqkv = static_cast<size_t>(B * Tn * 3 * C), nout = static_cast<size_t>(B * Tn * C),
             nprob = static_cast<size_t>(B * NH * Tn * Tn);
  auto qkv = rounded(randu(nqkv, 41, 1.5f)), dy = rounded(randu(nout, 42));
  std::vector<float> out(nout), probs(nprob), dqkv(nqkv);
  AttentionSaved cs{host(probs, {B, NH, Tn, Tn}), {}};
  cpu->attention_forward(host(out, {B, Tn, C}), cs, host(qkv, {B, Tn, 3 * C}), 2);
  cpu->attention_backward(host(dqkv, {B, Tn, 3 * C}), host(dy, {B, Tn, C}),
                          host(qkv, {B, Tn, 3 * C}), host(out, {B, Tn, C}), cs, 2);
  FlatBuffer gqkv = up(qkv), gdy = up(dy), gout(*gpu, dt(), static_cast<int64_t>(nout)),
             gdqkv(*gpu, dt(), static_cast<int64_t>(nqkv)),
             gprobs(*gpu, gpu->attention_probs_dtype(), static_cast<int64_t>(nprob));
  AttentionSaved gs{dev(gprobs, {B, NH, Tn, Tn}), {}};
  gpu->attention_forward(dev(gout, {B, Tn, C}), gs, dev(gqkv, {B, Tn, 3 * C}), 2);
  gpu->attention_backward(dev(gdqkv, {B, Tn, 3 * C}), dev(gdy, {B, Tn, C}),
                          dev(gqkv, {B, Tn, 3 * C}), dev(gout, {B, Tn, C}), gs, 2);
  expect_flash_close(down(gout), out, "fallback forward out");
  expect_flash_close(down(gdqkv), dqkv, "fallback backward dqkv");
}

// Whole model with flash attention: GPT-2 with 2 layers, 2 heads of 64 (n_embd 128), vocabulary
// 97, B = 2, T = 80 (two 64-row tiles, the second ragged), bf16, against the CPU model. As the
// bf16 whole-model test above: loss within 2e-2 relative, logits and every parameter gradient
// with cosine similarity above 0.99; activation checkpointing (which re-runs the forward)
// gives identical gradients, and a second identical run identical bits.
TEST(FlashAttentionModelTest, WholeModelMatchesCpuBf16) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU visible (or built without CUDA)";
  auto cpu = make_cpu_backend();
  auto gpu = make_flash_backend(DType::kBF16);
  ASSERT_FALSE(gpu->attention_saves_probs(64));
  GPT2Config c;
  c.name = "cuda-flash-parity";
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 128;
  c.vocab_size = 97;
  c.n_positions = 80;
  check_whole_model(*cpu, *gpu, DType::kBF16, c, 2, 80, 21);
}

// Attention dropout inside the fused kernels: forward and backward against the CPU reference
// with the same mask (element ((b·NH+h)·T+tq)·T+tk, AttnDropout8), bit-identical from run to run;
// T odd (63, 97) puts pairs of adjacent keys across Philox groups of 16, T = 200 (a multiple of 4,
// not of 16) takes the per-pair/per-element fallback, T = 128, 192, 160 the shuffled groups of 16
// (tiles of 64 and, at hs = 128, 32 keys or queries). The lse is that of the undropped softmax.
TEST_P(FlashAttentionTest, ForwardBackwardWithDropoutMatchCpu) {
  struct Case {
    int64_t B, NH, Tn, hs;
  };
  for (const Case& cs :
       {Case{2, 3, 63, 64}, Case{2, 3, 65, 64}, Case{2, 3, 200, 64}, Case{1, 2, 128, 32},
        Case{1, 2, 97, 128}, Case{2, 2, 192, 64}, Case{1, 2, 160, 128}}) {
    const int64_t B = cs.B, NH = cs.NH, Tn = cs.Tn, hs = cs.hs, C = NH * hs;
    SCOPED_TRACE("B=" + std::to_string(B) + " NH=" + std::to_string(NH) +
                 " T=" + std::to_string(Tn) + " hs=" + std::to_string(hs));
    const auto nqkv = static_cast<size_t>(B * Tn * 3 * C), nout = static_cast<size_t>(B * Tn * C),
               nprob = static_cast<size_t>(B * NH * Tn * Tn),
               nlse = static_cast<size_t>(B * NH * Tn);
    const auto seed = static_cast<uint64_t>(2000 + Tn * 7 + hs);
    Dropout d;
    d.p = 0.1f;
    d.seed = seed * 31;
    d.site = 6;
    auto qkv = rounded(randu(nqkv, seed, 1.5f)), dy = rounded(randu(nout, seed + 1));
    std::vector<float> out(nout), probs(nprob), dqkv(nqkv);
    AttentionSaved cs_saved{host(probs, {B, NH, Tn, Tn}), {}};
    const int nh = static_cast<int>(NH);
    cpu->attention_forward(host(out, {B, Tn, C}), cs_saved, host(qkv, {B, Tn, 3 * C}), nh, d);
    cpu->attention_backward(host(dqkv, {B, Tn, 3 * C}), host(dy, {B, Tn, C}),
                            host(qkv, {B, Tn, 3 * C}), host(out, {B, Tn, C}), cs_saved, nh, d);
    // gout0/glse0: the same forward without dropout (dropout must not change the lse).
    FlatBuffer gqkv = up(qkv), gdy = up(dy), gout(*gpu, dt(), static_cast<int64_t>(nout)),
               gout2(*gpu, dt(), static_cast<int64_t>(nout)),
               gout0(*gpu, dt(), static_cast<int64_t>(nout)),
               glse(*gpu, DType::kF32, static_cast<int64_t>(nlse)),
               glse0(*gpu, DType::kF32, static_cast<int64_t>(nlse)),
               gdqkv(*gpu, dt(), static_cast<int64_t>(nqkv)),
               gdqkv2(*gpu, dt(), static_cast<int64_t>(nqkv));
    ASSERT_FALSE(gpu->attention_saves_probs(static_cast<int>(hs)));
    AttentionSaved gs{{}, dev(glse, {B, NH, Tn})}, gs0{{}, dev(glse0, {B, NH, Tn})};
    gpu->attention_forward(dev(gout, {B, Tn, C}), gs, dev(gqkv, {B, Tn, 3 * C}), nh, d);
    gpu->attention_forward(dev(gout2, {B, Tn, C}), gs, dev(gqkv, {B, Tn, 3 * C}), nh, d);
    gpu->attention_forward(dev(gout0, {B, Tn, C}), gs0, dev(gqkv, {B, Tn, 3 * C}), nh);
    gpu->attention_backward(dev(gdqkv, {B, Tn, 3 * C}), dev(gdy, {B, Tn, C}),
                            dev(gqkv, {B, Tn, 3 * C}), dev(gout, {B, Tn, C}), gs, nh, d);
    gpu->attention_backward(dev(gdqkv2, {B, Tn, 3 * C}), dev(gdy, {B, Tn, C}),
                            dev(gqkv, {B, Tn, 3 * C}), dev(gout, {B, Tn, C}), gs, nh, d);
    const auto got_out = down(gout), got_dqkv = down(gdqkv);
    expect_flash_close(got_out, out, "flash forward out with dropout");
    expect_flash_close(qkv_part(got_dqkv, C, 0), qkv_part(dqkv, C, 0), "flash dq with dropout");
    expect_flash_close(qkv_part(got_dqkv, C, 1), qkv_part(dqkv, C, 1), "flash dk with dropout");
    expect_flash_close(qkv_part(got_dqkv, C, 2), qkv_part(dqkv, C, 2), "flash dv with dropout");
    EXPECT_GT(cosine(got_dqkv, dqkv), 0.999);
    EXPECT_TRUE(bit_equal(download(*gpu, glse), download(*gpu, glse0)))
        << "dropout changed the lse";
    EXPECT_FALSE(bit_equal(down(gout0), got_out)) << "dropout changed nothing";
    EXPECT_TRUE(bit_equal(down(gout2), got_out)) << "forward differs between identical runs";
    EXPECT_TRUE(bit_equal(down(gdqkv2), got_dqkv)) << "backward differs between identical runs";
  }
}

// The flash whole-model comparison (as WholeModelMatchesCpuBf16) with all three dropouts on.
TEST(FlashAttentionModelTest, WholeModelWithDropoutMatchesCpuBf16) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU visible (or built without CUDA)";
  auto cpu = make_cpu_backend();
  auto gpu = make_flash_backend(DType::kBF16);
  ASSERT_FALSE(gpu->attention_saves_probs(64));
  GPT2Config c;
  c.name = "cuda-flash-dropout-parity";
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 128;
  c.vocab_size = 97;
  c.n_positions = 80;
  c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = 0.1f;
  check_whole_model(*cpu, *gpu, DType::kBF16, c, 2, 80, 22);
}
