// Finite-difference gradient checks: every CPU op's backward against central differences of its
// forward, then the whole GPT-2 model (every parameter tensor) on a tiny configuration.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "backend/backend.h"
#include "core/rng.h"
#include "gradcheck_support.h"
#include "model/gpt2.h"

using namespace shardtrain;

namespace {

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  return test_support::random_uniform(n, seed, scale);
}

Tensor T(std::vector<float>& v, std::initializer_list<int64_t> dims) {
  return test_support::cpu_tensor(v, dims);
}

using test_support::dot;

/// Compares analytic d(objective)/d(x) with central differences of `objective` at a sample of
/// the entries of x.
void expect_grad_close(std::vector<float>& x, const std::vector<float>& analytic,
                       const std::function<double()>& objective, const char* what, float h = 1e-2f,
                       double rtol = 2e-2, double atol = 2e-3) {
  test_support::expect_grad_close(x, analytic, objective, what, h, rtol, atol);
}

/// A GPT-2 small enough for finite differences: 2 heads of 8 channels, 8 positions.
GPT2Config tiny_config(const char* name, int n_layer, int64_t vocab) {
  GPT2Config c;
  c.name = name;
  c.n_layer = n_layer;
  c.n_head = 2;
  c.n_embd = 16;
  c.vocab_size = vocab;
  c.n_positions = 8;
  return c;
}

class OpGradTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
};

}  // namespace

TEST_F(OpGradTest, LayerNorm) {
  const int64_t N = 6, C = 10;
  auto x = randn(N * C, 1), w = randn(C, 2), b = randn(C, 3), r = randn(N * C, 4);
  std::vector<float> y(N * C), mean(N), rstd(N);
  auto f = [&] {
    be->layernorm_forward(T(y, {N, C}), T(mean, {N}), T(rstd, {N}), T(x, {N, C}), T(w, {C}),
                          T(b, {C}));
    return dot(y, r);
  };
  f();
  std::vector<float> dx(N * C, 0.f), dw(C, 0.f), db(C, 0.f);
  be->layernorm_backward(T(dx, {N, C}), T(dw, {C}), T(db, {C}), T(r, {N, C}), T(x, {N, C}),
                         T(w, {C}), T(mean, {N}), T(rstd, {N}));
  expect_grad_close(x, dx, f, "layernorm dinp");
  expect_grad_close(w, dw, f, "layernorm dweight");
  expect_grad_close(b, db, f, "layernorm dbias");
}

TEST_F(OpGradTest, LayerNormBackwardAccumulatesIntoDinp) {
  const int64_t N = 3, C = 8;
  auto x = randn(N * C, 5), w = randn(C, 6), b = randn(C, 7), r = randn(N * C, 8);
  std::vector<float> y(N * C), mean(N), rstd(N);
  be->layernorm_forward(T(y, {N, C}), T(mean, {N}), T(rstd, {N}), T(x, {N, C}), T(w, {C}),
                        T(b, {C}));
  std::vector<float> dx0(N * C, 0.f), dx1(N * C, 1.5f), dw(C), db(C);
  be->layernorm_backward(T(dx0, {N, C}), T(dw, {C}), T(db, {C}), T(r, {N, C}), T(x, {N, C}),
                         T(w, {C}), T(mean, {N}), T(rstd, {N}));
  be->layernorm_backward(T(dx1, {N, C}), T(dw, {C}), T(db, {C}), T(r, {N, C}), T(x, {N, C}),
                         T(w, {C}), T(mean, {N}), T(rstd, {N}));
  for (size_t i = 0; i < dx0.size(); ++i) EXPECT_FLOAT_EQ(dx1[i], dx0[i] + 1.5f);
}

TEST_F(OpGradTest, MatmulWithBiasAndGelu) {
  const int64_t N = 5, IC = 7, OC = 9;
  auto x = randn(N * IC, 11), w = randn(OC * IC, 12, 0.5f), b = randn(OC, 13),
       r = randn(N * OC, 14);
  std::vector<float> y(N * OC), pre(N * OC);
  for (bool gelu : {false, true}) {
    auto f = [&] {
      be->matmul_forward(T(y, {N, OC}), T(x, {N, IC}), T(w, {OC, IC}), T(b, {OC}),
                         gelu ? Epilogue::kGelu : Epilogue::kNone, T(pre, {N, OC}));
      return dot(y, r);
    };
    f();
    std::vector<float> dy = r;
    if (gelu) be->gelu_backward(T(dy, {N, OC}), T(pre, {N, OC}), T(dy, {N, OC}));
    std::vector<float> dx(N * IC, 0.f), dw(OC * IC, 0.f), db(OC, 0.f);
    be->matmul_backward(T(dx, {N, IC}), T(dw, {OC, IC}), T(db, {OC}), T(dy, {N, OC}), T(x, {N, IC}),
                        T(w, {OC, IC}));
    expect_grad_close(x, dx, f, gelu ? "matmul+gelu dinp" : "matmul dinp");
    expect_grad_close(w, dw, f, gelu ? "matmul+gelu dweight" : "matmul dweight");
    expect_grad_close(b, db, f, gelu ? "matmul+gelu dbias" : "matmul dbias");
  }
}

TEST_F(OpGradTest, CausalAttention) {
  const int64_t B = 2, Tn = 5, NH = 2, C = 8;
  auto qkv = randn(B * Tn * 3 * C, 21), r = randn(B * Tn * C, 22);
  std::vector<float> y(B * Tn * C), probs(B * NH * Tn * Tn);
  auto f = [&] {
    AttentionSaved s{T(probs, {B, NH, Tn, Tn}), {}};
    be->attention_forward(T(y, {B, Tn, C}), s, T(qkv, {B, Tn, 3 * C}), NH);
    return dot(y, r);
  };
  f();
  // Causality: the first position's output depends only on the first position's value.
  std::vector<float> dqkv(qkv.size(), 0.f);
  AttentionSaved s{T(probs, {B, NH, Tn, Tn}), {}};
  be->attention_backward(T(dqkv, {B, Tn, 3 * C}), T(r, {B, Tn, C}), T(qkv, {B, Tn, 3 * C}),
                         T(y, {B, Tn, C}), s, NH);
  expect_grad_close(qkv, dqkv, f, "attention dqkv", 1e-2f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < Tn; ++t)
        for (int64_t t2 = t + 1; t2 < Tn; ++t2)
          EXPECT_EQ(probs[((b * NH + h) * Tn + t) * Tn + t2], 0.f);
}

TEST_F(OpGradTest, Embedding) {
  const int64_t B = 2, Tn = 3, V = 7, C = 4, maxT = 5;
  auto wte = randn(V * C, 31), wpe = randn(maxT * C, 32), r = randn(B * Tn * C, 33);
  std::vector<int32_t> tok = {1, 3, 1, 6, 0, 3};
  Tensor tokens(tok.data(), DType::kI32, DeviceKind::kCPU, {B, Tn});
  std::vector<float> y(B * Tn * C);
  auto f = [&] {
    be->embedding_forward(T(y, {B, Tn, C}), tokens, T(wte, {V, C}), T(wpe, {maxT, C}));
    return dot(y, r);
  };
  f();
  std::vector<float> dwte(V * C, 0.f), dwpe(maxT * C, 0.f);
  be->embedding_backward(T(dwte, {V, C}), T(dwpe, {maxT, C}), T(r, {B, Tn, C}), tokens);
  expect_grad_close(wte, dwte, f, "embedding dwte");
  expect_grad_close(wpe, dwpe, f, "embedding dwpe");
}

TEST_F(OpGradTest, SoftmaxCrossEntropy) {
  const int64_t N = 4, V = 11;
  auto logits = randn(N * V, 41, 3.0f);
  std::vector<int32_t> tg = {3, 0, 10, -1};  // the last row is ignored
  Tensor targets(tg.data(), DType::kI32, DeviceKind::kCPU, {N});
  std::vector<float> losses(N);
  auto f = [&] {
    be->cross_entropy_forward(T(losses, {N}), T(logits, {N, V}), targets, V);
    double s = 0;
    for (float l : losses) s += l;
    return s * 0.5;
  };
  const double l0 = f();
  std::vector<float> g = logits, losses2(N);
  be->softmax_cross_entropy(T(losses2, {N}), T(g, {N, V}), targets, 0.5f, V);
  double s2 = 0;
  for (float l : losses2) s2 += l;
  EXPECT_NEAR(s2 * 0.5, l0, 1e-5);
  EXPECT_EQ(losses2[3], 0.f);
  expect_grad_close(logits, g, f, "cross-entropy dlogits", 1e-2f);
}

// Padded logit rows (Backend::padded_columns; the CUDA backend pads, the CPU backend may be given
// them too): the same values as unpadded rows in the first V columns, zeros in the pads, and the
// same cross-entropy and backward.
TEST_F(OpGradTest, PaddedRowsEqualUnpadded) {
  const int64_t N = 5, C = 6, V = 11, Vp = 16;
  auto x = randn(N * C, 51), w = randn(V * C, 52), b = randn(V, 53);
  std::vector<int32_t> tg = {3, 0, 10, -1, 7};
  Tensor targets(tg.data(), DType::kI32, DeviceKind::kCPU, {N});
  std::vector<float> y(N * V), yp(N * Vp, 9.f), loss(N), lossp(N), dx(N * C), dxp(N * C),
      dw(V * C, 0.f), dwp(V * C, 0.f);
  be->matmul_forward(T(y, {N, V}), T(x, {N, C}), T(w, {V, C}), T(b, {V}));
  be->matmul_forward(T(yp, {N, Vp}), T(x, {N, C}), T(w, {V, C}), T(b, {V}));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < Vp; ++j)
      EXPECT_EQ(yp[i * Vp + j], j < V ? y[i * V + j] : 0.f) << i << "," << j;
  be->softmax_cross_entropy(T(loss, {N}), T(y, {N, V}), targets, 0.5f, V);
  be->softmax_cross_entropy(T(lossp, {N}), T(yp, {N, Vp}), targets, 0.5f, V);
  EXPECT_EQ(loss, lossp);
  be->matmul_backward(T(dx, {N, C}), T(dw, {V, C}), Tensor(), T(y, {N, V}), T(x, {N, C}),
                      T(w, {V, C}));
  be->matmul_backward(T(dxp, {N, C}), T(dwp, {V, C}), Tensor(), T(yp, {N, Vp}), T(x, {N, C}),
                      T(w, {V, C}));
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dxp[i], dx[i], 1e-6f) << i;
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dwp[i], dw[i], 1e-6f) << i;
}

/// Parameters for a whole-model gradient check, bound by the caller: GPT-2's init at twice its
/// scale, and the constant tensors (biases, LayerNorm) offset by 0.1·(i mod 3), so that every
/// path carries a visible gradient.
std::vector<float> gradcheck_parameters(const GPT2Model& model) {
  std::vector<float> params(static_cast<size_t>(model.layout().numel()));
  model.init_parameters(params.data(), 7);
  for (auto& p : params) p *= 2.0f;
  for (const ParamTensor* t : model.layout().tensors())
    if (t->init_std == 0.f)
      for (int64_t i = 0; i < t->numel; ++i)
        params[static_cast<size_t>(t->offset + i)] += 0.1f * static_cast<float>(i % 3);
  return params;
}

TEST(ModelGradTest, WholeModelEveryParameterTensor) {
  auto be = make_cpu_backend();
  const GPT2Config c = tiny_config("gradcheck", 2, 29);
  GPT2Model model(c, *be);
  const int64_t n = model.layout().numel();
  std::vector<float> params = gradcheck_parameters(model), grads(static_cast<size_t>(n), 0.f);
  model.bind(T(params, {n}), T(grads, {n}));
  const int64_t B = 2, Tn = 6;
  std::vector<int32_t> tokens = {1, 5, 9, 2, 28, 3, 4, 4, 0, 17, 11, 6};
  std::vector<int32_t> targets = {5, 9, 2, 28, 3, 7, 4, 0, 17, 11, 6, 1};
  const float scale = 1.0f / static_cast<float>(B * Tn);
  model.forward(tokens.data(), targets.data(), B, Tn, scale, true);
  model.backward();
  auto objective = [&] {
    return model.forward(tokens.data(), targets.data(), B, Tn, scale, false);
  };
  for (const ParamTensor* t : model.layout().tensors()) {
    std::vector<float> x(params.begin() + t->offset, params.begin() + t->offset + t->numel);
    std::vector<float> g(grads.begin() + t->offset, grads.begin() + t->offset + t->numel);
    double gnorm = 0;
    for (float v : g) gnorm += v * v;
    EXPECT_GT(gnorm, 0.0) << t->name << " has an all-zero gradient";
    // Perturb through the flat buffer the model reads.
    auto obj = [&] {
      std::copy(x.begin(), x.end(), params.begin() + t->offset);
      return objective();
    };
    expect_grad_close(x, g, obj, t->name.c_str(), 1e-2f, 3e-2, 3e-3);
    std::copy(x.begin(), x.end(), params.begin() + t->offset);
  }
}

// Checkpointing recomputes each block in backward, its one activation set sharing memory with
// the logits (larger than the set with vocabulary 4000, smaller with 31): identical loss and
// gradients, bit for bit, also for a later, smaller micro-batch reusing the memory.
TEST(ModelGradTest, ActivationCheckpointingGivesIdenticalGradients) {
  for (int64_t vocab : {int64_t{31}, int64_t{4000}}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    auto be = make_cpu_backend();
    const GPT2Config c = tiny_config("ckpt", 3, vocab);
    GPT2Model plain(c, *be, false), ckpt(c, *be, true);
    const int64_t n = plain.layout().numel();
    std::vector<float> params(static_cast<size_t>(n));
    plain.init_parameters(params.data(), 3);
    std::vector<float> g1(static_cast<size_t>(n), 0.f), g2(static_cast<size_t>(n), 0.f);
    auto view = [n](std::vector<float>& v) {
      return Tensor(v.data(), DType::kF32, DeviceKind::kCPU, {n});
    };
    plain.bind(view(params), view(g1));
    ckpt.bind(view(params), view(g2));
    std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    std::vector<int32_t> targets = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
    for (int64_t B : {2, 1}) {
      const double l1 = plain.forward(tokens.data(), targets.data(), B, 8, 1.0f / 16, true);
      plain.backward();
      const double l2 = ckpt.forward(tokens.data(), targets.data(), B, 8, 1.0f / 16, true);
      ckpt.backward();
      EXPECT_EQ(l1, l2) << "B = " << B;
    }
    for (size_t i = 0; i < g1.size(); ++i) ASSERT_EQ(g1[i], g2[i]) << "element " << i;
  }
}

// ---- dropout: gradient checks with a fixed mask (the same Dropout in every evaluation) --------

namespace {

Dropout fixed_dropout(float p, uint32_t site) {
  Dropout d;
  d.p = p;
  d.seed = 0x5EEDull;
  d.site = site;
  return d;
}

}  // namespace

TEST_F(OpGradTest, EmbeddingWithDropout) {
  const int64_t B = 2, Tn = 3, V = 7, C = 8, maxT = 5;
  auto wte = randn(V * C, 41), wpe = randn(maxT * C, 42), r = randn(B * Tn * C, 43);
  std::vector<int32_t> tok = {1, 3, 1, 6, 0, 3};
  Tensor tokens(tok.data(), DType::kI32, DeviceKind::kCPU, {B, Tn});
  const Dropout d = fixed_dropout(0.3f, 0);
  std::vector<float> y(B * Tn * C);
  auto f = [&] {
    be->embedding_forward(T(y, {B, Tn, C}), tokens, T(wte, {V, C}), T(wpe, {maxT, C}), d);
    return dot(y, r);
  };
  f();
  int zeros = 0;
  for (float v : y) zeros += v == 0.f;
  EXPECT_GT(zeros, 0) << "p = 0.3 over 48 elements dropped nothing";
  std::vector<float> dwte(V * C, 0.f), dwpe(maxT * C, 0.f);
  be->embedding_backward(T(dwte, {V, C}), T(dwpe, {maxT, C}), T(r, {B, Tn, C}), tokens, d);
  expect_grad_close(wte, dwte, f, "embedding+dropout dwte");
  expect_grad_close(wpe, dwpe, f, "embedding+dropout dwpe");
}

TEST_F(OpGradTest, ResidualAddWithDropout) {
  const int64_t N = 6, C = 10;
  auto a = randn(N * C, 51), b = randn(N * C, 52), r = randn(N * C, 53);
  const Dropout d = fixed_dropout(0.25f, 7);
  std::vector<float> y(N * C);
  auto f = [&] {
    be->add(T(y, {N, C}), T(a, {N, C}), T(b, {N, C}), d);
    return dot(y, r);
  };
  f();
  // ∂/∂a = r, ∂/∂b = r ∘ mask / (1 − p) (dropout_backward).
  std::vector<float> db(N * C);
  be->dropout_backward(T(db, {N, C}), T(r, {N, C}), d);
  expect_grad_close(a, r, f, "add+dropout da");
  expect_grad_close(b, db, f, "add+dropout db");
}

TEST_F(OpGradTest, CausalAttentionWithDropout) {
  const int64_t B = 2, Tn = 5, NH = 2, C = 8;
  auto qkv = randn(B * Tn * 3 * C, 61), r = randn(B * Tn * C, 62);
  std::vector<float> y(B * Tn * C), probs(B * NH * Tn * Tn);
  const Dropout d = fixed_dropout(0.3f, 5);
  auto f = [&] {
    AttentionSaved s{T(probs, {B, NH, Tn, Tn}), {}};
    be->attention_forward(T(y, {B, Tn, C}), s, T(qkv, {B, Tn, 3 * C}), NH, d);
    return dot(y, r);
  };
  f();
  // The saved probabilities are those before dropout: rows sum to 1.
  for (int64_t row = 0; row < B * NH * Tn; ++row) {
    double sum = 0;
    for (int64_t t2 = 0; t2 < Tn; ++t2) sum += probs[static_cast<size_t>(row * Tn + t2)];
    EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << row;
  }
  std::vector<float> dqkv(qkv.size(), 0.f);
  AttentionSaved s{T(probs, {B, NH, Tn, Tn}), {}};
  be->attention_backward(T(dqkv, {B, Tn, 3 * C}), T(r, {B, Tn, C}), T(qkv, {B, Tn, 3 * C}),
                         T(y, {B, Tn, C}), s, NH, d);
  expect_grad_close(qkv, dqkv, f, "attention+dropout dqkv", 1e-2f);
}

// The whole model with all three dropouts on (p = 0.1): every evaluation of the objective uses
// the same dropout seed, hence the same masks, so the loss is a smooth function of the weights.
TEST(ModelGradTest, WholeModelWithDropoutFixedMask) {
  auto be = make_cpu_backend();
  GPT2Config c = tiny_config("gradcheck-dropout", 2, 29);
  c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = 0.1f;
  GPT2Model model(c, *be);
  const int64_t n = model.layout().numel();
  std::vector<float> params = gradcheck_parameters(model), grads(static_cast<size_t>(n), 0.f);
  model.bind(T(params, {n}), T(grads, {n}));
  const int64_t B = 2, Tn = 6;
  std::vector<int32_t> tokens = {1, 5, 9, 2, 28, 3, 4, 4, 0, 17, 11, 6};
  std::vector<int32_t> targets = {5, 9, 2, 28, 3, 7, 4, 0, 17, 11, 6, 1};
  const float scale = 1.0f / static_cast<float>(B * Tn);
  const uint64_t seed = micro_batch_dropout_seed(42, 0, 3, 1);
  const double with_dropout =
      model.forward(tokens.data(), targets.data(), B, Tn, scale, true, seed);
  model.backward();
  const double without = model.forward(tokens.data(), targets.data(), B, Tn, scale, false);
  EXPECT_NE(with_dropout, without) << "dropout changed nothing";
  // The objective keeps dropout on (for_backward) with the same seed: the masks are fixed.
  auto objective = [&] {
    return model.forward(tokens.data(), targets.data(), B, Tn, scale, true, seed);
  };
  for (const ParamTensor* t : model.layout().tensors()) {
    std::vector<float> x(params.begin() + t->offset, params.begin() + t->offset + t->numel);
    std::vector<float> g(grads.begin() + t->offset, grads.begin() + t->offset + t->numel);
    auto obj = [&] {
      std::copy(x.begin(), x.end(), params.begin() + t->offset);
      return objective();
    };
    expect_grad_close(x, g, obj, t->name.c_str(), 1e-2f, 3e-2, 3e-3);
    std::copy(x.begin(), x.end(), params.begin() + t->offset);
  }
}

// Under dropout the recompute of activation checkpointing draws the forward's masks again:
// identical loss and gradients, bit for bit.
TEST(ModelGradTest, ActivationCheckpointingWithDropoutGivesIdenticalGradients) {
  auto be = make_cpu_backend();
  GPT2Config c = tiny_config("ckpt-dropout", 3, 31);
  c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = 0.2f;
  GPT2Model plain(c, *be, false), ckpt(c, *be, true);
  const int64_t n = plain.layout().numel();
  std::vector<float> params(static_cast<size_t>(n));
  plain.init_parameters(params.data(), 3);
  std::vector<float> g1(static_cast<size_t>(n), 0.f), g2(static_cast<size_t>(n), 0.f);
  auto view = [n](std::vector<float>& v) {
    return Tensor(v.data(), DType::kF32, DeviceKind::kCPU, {n});
  };
  plain.bind(view(params), view(g1));
  ckpt.bind(view(params), view(g2));
  std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  std::vector<int32_t> targets = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
  const double l1 = plain.forward(tokens.data(), targets.data(), 2, 8, 1.0f / 16, true, 99);
  plain.backward();
  const double l2 = ckpt.forward(tokens.data(), targets.data(), 2, 8, 1.0f / 16, true, 99);
  ckpt.backward();
  EXPECT_EQ(l1, l2);
  for (size_t i = 0; i < g1.size(); ++i) ASSERT_EQ(g1[i], g2[i]) << "element " << i;
}
