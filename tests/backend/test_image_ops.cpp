// The CPU ImageOps (backend/cpu/cpu_image_ops.h): every backward against central differences of
// its forward, forwards against naive double-precision loops written here, the accumulate /
// overwrite conventions, synchronized batch norm's split reductions, and argument errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cpu/cpu_image_ops.h"
#include "core/rng.h"
#include "gradcheck_support.h"
#include "test_support.h"

using namespace shardtrain;

namespace {

std::vector<float> randu(size_t n, uint64_t seed, float scale = 1.0f) {
  return test_support::random_uniform(n, seed, scale);
}

Tensor T(std::vector<float>& v, std::initializer_list<int64_t> dims) {
  return test_support::cpu_tensor(v, dims);
}
Tensor T(std::vector<double>& v, std::initializer_list<int64_t> dims) {
  return Tensor(v.data(), DType::kF64, DeviceKind::kCPU, dims);
}
Tensor I32(std::vector<int32_t>& v, std::initializer_list<int64_t> dims) {
  return Tensor(v.data(), DType::kI32, DeviceKind::kCPU, dims);
}

using test_support::dot;

constexpr float kH = 1e-3f;  // finite-difference step (fp32 values, objective summed in double)

/// Compares analytic d(objective)/d(x) with central differences of `objective` at up to ~40
/// evenly spaced entries of x, and prints the largest error.
void expect_grad_close(std::vector<float>& x, const std::vector<float>& analytic,
                       const std::function<double()>& objective, const std::string& what,
                       double rtol = 2e-2, double atol = 2e-3) {
  test_support::expect_grad_close(x, analytic, objective, what, kH, rtol, atol);
}

void expect_all_near(const std::vector<float>& a, const std::vector<double>& b, double tol,
                     const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_NEAR(a[i], b[i], tol * (1.0 + std::abs(b[i]))) << what << " element " << i;
}

/// Activation in double (the tests' own reference).
double act_ref(double x, Activation a) {
  switch (a) {
    case Activation::kNone:
      return x;
    case Activation::kRelu:
      return std::max(x, 0.0);
    case Activation::kRelu6:
      return std::min(std::max(x, 0.0), 6.0);
    case Activation::kSilu:
      return x / (1.0 + std::exp(-x));
    case Activation::kSigmoid:
      return 1.0 / (1.0 + std::exp(-x));
  }
  return x;
}

/// Direct 7-loop convolution in double: out[n][k][p][q].
std::vector<double> conv_ref(const std::vector<float>& x, const std::vector<float>& w,
                             const std::vector<float>& b, const Conv2dShape& s) {
  const int64_t P = s.P(), Q = s.Q(), Cg = s.C / s.groups, Kg = s.K / s.groups;
  std::vector<double> y(static_cast<size_t>(s.N * s.K * P * Q));
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t k = 0; k < s.K; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q) {
          double acc = b.empty() ? 0.0 : b[static_cast<size_t>(k)];
          const int64_t g = k / Kg;
          for (int64_t c = 0; c < Cg; ++c)
            for (int64_t r = 0; r < s.R; ++r)
              for (int64_t t = 0; t < s.S; ++t) {
                const int64_t ih = p * s.stride_h - s.pad_h + r, iw = q * s.stride_w - s.pad_w + t;
                if (ih < 0 || ih >= s.H || iw < 0 || iw >= s.W) continue;
                acc += static_cast<double>(
                           x[static_cast<size_t>(((n * s.C + g * Cg + c) * s.H + ih) * s.W + iw)]) *
                       w[static_cast<size_t>(((k * Cg + c) * s.R + r) * s.S + t)];
              }
          y[static_cast<size_t>(((n * s.K + k) * P + p) * Q + q)] = acc;
        }
  return y;
}

/// Direct-loop convolution backward in double: dinp, dweight, dbias of out = conv(x, w) + b.
struct ConvGrads {
  std::vector<double> dx, dw, db;
};
ConvGrads conv_backward_ref(const std::vector<float>& x, const std::vector<float>& w,
                            const std::vector<float>& dy, const Conv2dShape& s) {
  const int64_t P = s.P(), Q = s.Q(), Cg = s.C / s.groups, Kg = s.K / s.groups;
  ConvGrads g{std::vector<double>(x.size()), std::vector<double>(w.size()),
              std::vector<double>(static_cast<size_t>(s.K))};
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t k = 0; k < s.K; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q) {
          const double d = dy[static_cast<size_t>(((n * s.K + k) * P + p) * Q + q)];
          g.db[static_cast<size_t>(k)] += d;
          for (int64_t c = 0; c < Cg; ++c)
            for (int64_t r = 0; r < s.R; ++r)
              for (int64_t t = 0; t < s.S; ++t) {
                const int64_t ih = p * s.stride_h - s.pad_h + r, iw = q * s.stride_w - s.pad_w + t;
                if (ih < 0 || ih >= s.H || iw < 0 || iw >= s.W) continue;
                const auto xi =
                    static_cast<size_t>(((n * s.C + k / Kg * Cg + c) * s.H + ih) * s.W + iw);
                const auto wi = static_cast<size_t>(((k * Cg + c) * s.R + r) * s.S + t);
                g.dx[xi] += d * w[wi];
                g.dw[wi] += d * x[xi];
              }
        }
  return g;
}

class ImageOpsTest : public ::testing::Test {
 protected:
  std::unique_ptr<ImageOps> ops = make_cpu_image_ops();
};

// ---- convolution
// ---------------------------------------------------------------------------------

Conv2dShape conv_shape(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, int64_t R, int64_t S,
                       int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                       int64_t groups) {
  Conv2dShape s;
  s.N = N, s.C = C, s.H = H, s.W = W, s.K = K, s.R = R, s.S = S;
  s.stride_h = stride_h, s.stride_w = stride_w, s.pad_h = pad_h, s.pad_w = pad_w;
  s.groups = groups;
  return s;
}

struct ConvCase {
  const char* name;
  Conv2dShape s;
  bool bias;
};

std::vector<ConvCase> conv_cases() {
  return {
      {"3x3 s1 p1 bias", conv_shape(2, 3, 5, 5, 4, 3, 3, 1, 1, 1, 1, 1), true},
      {"3x3 stride 2", conv_shape(2, 3, 7, 6, 4, 3, 3, 2, 2, 1, 1, 1), true},
      {"1x1", conv_shape(2, 4, 4, 4, 3, 1, 1, 1, 1, 0, 0, 1), true},
      {"grouped g=2", conv_shape(2, 4, 5, 5, 6, 3, 3, 1, 1, 1, 1, 2), true},
      {"depthwise", conv_shape(2, 3, 5, 5, 3, 3, 3, 1, 1, 1, 1, 3), true},
      {"depthwise stride 2", conv_shape(2, 3, 6, 5, 3, 3, 3, 2, 2, 1, 1, 3), false},
      {"non-square 5x8 3x2 s(1,2) p(1,0)", conv_shape(2, 2, 5, 8, 3, 3, 2, 1, 2, 1, 0, 1), true},
  };
}

TEST_F(ImageOpsTest, Conv2dGradients) {
  uint64_t seed = 100;
  for (const auto& cc : conv_cases()) {
    SCOPED_TRACE(cc.name);
    const Conv2dShape& s = cc.s;
    const int64_t Cg = s.C / s.groups, P = s.P(), Q = s.Q();
    auto x = randu(static_cast<size_t>(s.N * s.C * s.H * s.W), ++seed);
    auto w = randu(static_cast<size_t>(s.K * Cg * s.R * s.S), ++seed, 0.5f);
    auto b = cc.bias ? randu(static_cast<size_t>(s.K), ++seed) : std::vector<float>();
    auto r = randu(static_cast<size_t>(s.N * s.K * P * Q), ++seed);
    std::vector<float> y(r.size());
    auto f = [&] {
      ops->conv2d_forward(T(y, {s.N, s.K, P, Q}), T(x, {s.N, s.C, s.H, s.W}),
                          T(w, {s.K, Cg, s.R, s.S}), cc.bias ? T(b, {s.K}) : Tensor(), s);
      return dot(y, r);
    };
    f();
    std::vector<float> dx(x.size(), 7.0f), dw(w.size(), 0.0f), db(b.size(), 0.0f);
    ops->conv2d_backward(T(dx, {s.N, s.C, s.H, s.W}), T(dw, {s.K, Cg, s.R, s.S}),
                         cc.bias ? T(db, {s.K}) : Tensor(), T(r, {s.N, s.K, P, Q}),
                         T(x, {s.N, s.C, s.H, s.W}), T(w, {s.K, Cg, s.R, s.S}), s);
    const std::string name = std::string("conv2d ") + cc.name;
    expect_grad_close(x, dx, f, name + " dinp");
    expect_grad_close(w, dw, f, name + " dweight");
    if (cc.bias) expect_grad_close(b, db, f, name + " dbias");
  }
}

TEST_F(ImageOpsTest, Conv2dForwardMatchesDirectLoops) {
  uint64_t seed = 200;
  for (const auto& cc : conv_cases()) {
    SCOPED_TRACE(cc.name);
    const Conv2dShape& s = cc.s;
    const int64_t Cg = s.C / s.groups, P = s.P(), Q = s.Q();
    auto x = randu(static_cast<size_t>(s.N * s.C * s.H * s.W), ++seed);
    auto w = randu(static_cast<size_t>(s.K * Cg * s.R * s.S), ++seed);
    auto b = cc.bias ? randu(static_cast<size_t>(s.K), ++seed) : std::vector<float>();
    const auto ref = conv_ref(x, w, b, s);
    for (Activation act : {Activation::kNone, Activation::kRelu6, Activation::kSilu}) {
      std::vector<float> y(ref.size());
      ops->conv2d_forward(T(y, {s.N, s.K, P, Q}), T(x, {s.N, s.C, s.H, s.W}),
                          T(w, {s.K, Cg, s.R, s.S}), cc.bias ? T(b, {s.K}) : Tensor(), s, act);
      std::vector<double> want(ref.size());
      for (size_t i = 0; i < ref.size(); ++i) want[i] = act_ref(ref[i], act);
      expect_all_near(y, want, 1e-5, std::string(cc.name) + " act " + activation_name(act));
    }
  }
}

TEST_F(ImageOpsTest, Conv2dBackwardAccumulatesParametersAndOverwritesInput) {
  for (const auto& cc : conv_cases()) {
    SCOPED_TRACE(cc.name);
    const Conv2dShape& s = cc.s;
    const int64_t Cg = s.C / s.groups, P = s.P(), Q = s.Q();
    auto x = randu(static_cast<size_t>(s.N * s.C * s.H * s.W), 1);
    auto w = randu(static_cast<size_t>(s.K * Cg * s.R * s.S), 2);
    auto dy = randu(static_cast<size_t>(s.N * s.K * P * Q), 3);
    std::vector<float> dx1(x.size(), -3.0f), dx2(x.size(), 1e6f), dw(w.size(), 0.0f),
        db(static_cast<size_t>(s.K), 0.0f);
    auto run = [&](std::vector<float>& dx) {
      ops->conv2d_backward(T(dx, {s.N, s.C, s.H, s.W}), T(dw, {s.K, Cg, s.R, s.S}), T(db, {s.K}),
                           T(dy, {s.N, s.K, P, Q}), T(x, {s.N, s.C, s.H, s.W}),
                           T(w, {s.K, Cg, s.R, s.S}), s);
    };
    run(dx1);
    const auto dw1 = dw, db1 = db;
    run(dx2);
    for (size_t i = 0; i < dx1.size(); ++i) ASSERT_FLOAT_EQ(dx1[i], dx2[i]);
    for (size_t i = 0; i < dw.size(); ++i) ASSERT_FLOAT_EQ(dw[i], 2 * dw1[i]);
    for (size_t i = 0; i < db.size(); ++i) ASSERT_FLOAT_EQ(db[i], 2 * db1[i]);
    // An empty dinp skips the input gradient and still accumulates the parameters.
    ops->conv2d_backward(Tensor(), T(dw, {s.K, Cg, s.R, s.S}), Tensor(), T(dy, {s.N, s.K, P, Q}),
                         T(x, {s.N, s.C, s.H, s.W}), T(w, {s.K, Cg, s.R, s.S}), s);
    for (size_t i = 0; i < dw.size(); ++i)
      ASSERT_NEAR(dw[i], 3 * dw1[i], 1e-5 + 1e-5 * std::abs(dw[i]));
  }
}

// ---- batch normalization
// ---------------------------------------------------------------------------

/// Batch-norm test data whose pre-activations stay at least `margin` away from ReLU's and
/// ReLU6's kinks (finite differences across a kink are meaningless).
struct BnData {
  int64_t N, C, H, W;
  std::vector<float> x, gamma, beta;
  int64_t count() const { return N * H * W; }
};

BnData bn_data(int64_t N, int64_t C, int64_t H, int64_t W, uint64_t seed, float eps) {
  BnData d{N,
           C,
           H,
           W,
           randu(static_cast<size_t>(N * C * H * W), seed, 2.0f),
           randu(static_cast<size_t>(C), seed + 1, 1.5f),
           randu(static_cast<size_t>(C), seed + 2)};
  for (auto& g : d.gamma) g += g >= 0 ? 0.5f : -0.5f;
  // Spread the pre-activations over [−?, 7] so ReLU6's upper kink is exercised too.
  for (int64_t c = 0; c < C; ++c) d.beta[static_cast<size_t>(c)] += 1.5f * static_cast<float>(c);
  const int64_t HW = H * W;
  for (int iter = 0; iter < 100; ++iter) {
    bool moved = false;
    for (int64_t c = 0; c < C; ++c) {
      double s1 = 0, s2 = 0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < HW; ++i) {
          const double v = d.x[static_cast<size_t>((n * C + c) * HW + i)];
          s1 += v, s2 += v * v;
        }
      const double m = s1 / d.count(), is = 1.0 / std::sqrt(s2 / d.count() - m * m + eps);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < HW; ++i) {
          float& v = d.x[static_cast<size_t>((n * C + c) * HW + i)];
          const double pre =
              (v - m) * is * d.gamma[static_cast<size_t>(c)] + d.beta[static_cast<size_t>(c)];
          if (std::abs(pre) < 0.03 || std::abs(pre - 6.0) < 0.03) {
            v += 0.07f;
            moved = true;
          }
        }
    }
    if (!moved) break;
  }
  return d;
}

constexpr float kBnEps = 1e-5f;

TEST_F(ImageOpsTest, BatchNormTrainingGradients) {
  for (Activation act :
       {Activation::kNone, Activation::kRelu, Activation::kRelu6, Activation::kSilu}) {
    SCOPED_TRACE(activation_name(act));
    BnData d = bn_data(2, 3, 3, 4, 300 + static_cast<uint64_t>(act), kBnEps);
    const int64_t N = d.N, C = d.C, H = d.H, W = d.W;
    auto r = randu(d.x.size(), 400);
    std::vector<float> y(d.x.size()), mean(C), invstd(C);
    std::vector<double> sums(2 * C);
    auto f = [&] {
      ops->batchnorm_statistics(T(sums, {2, C}), T(d.x, {N, C, H, W}));
      ops->batchnorm_forward_train(T(y, {N, C, H, W}), T(mean, {C}), T(invstd, {C}), Tensor(),
                                   Tensor(), T(d.x, {N, C, H, W}), T(d.gamma, {C}), T(d.beta, {C}),
                                   T(sums, {2, C}), d.count(), kBnEps, 0.1f, act);
      return dot(y, r);
    };
    f();
    std::vector<float> dg(C, 0.0f), db(C, 0.0f), dx(d.x.size(), 5.0f);
    std::vector<double> dsums(2 * C);
    ops->batchnorm_backward_reduce(T(dsums, {2, C}), T(dg, {C}), T(db, {C}), T(r, {N, C, H, W}),
                                   T(d.x, {N, C, H, W}), T(d.gamma, {C}), T(d.beta, {C}),
                                   T(mean, {C}), T(invstd, {C}), act);
    ops->batchnorm_backward_input(T(dx, {N, C, H, W}), T(r, {N, C, H, W}), T(d.x, {N, C, H, W}),
                                  T(d.gamma, {C}), T(d.beta, {C}), T(mean, {C}), T(invstd, {C}),
                                  T(dsums, {2, C}), d.count(), act);
    const std::string name = std::string("batchnorm ") + activation_name(act);
    expect_grad_close(d.x, dx, f, name + " dinp");
    expect_grad_close(d.gamma, dg, f, name + " dweight");
    expect_grad_close(d.beta, db, f, name + " dbias");
  }
}

TEST_F(ImageOpsTest, BatchNormRunningStatisticsAndEvalMatchReference) {
  const int64_t N = 3, C = 4, H = 2, W = 5, HW = H * W, count = N * HW;
  auto x = randu(static_cast<size_t>(N * C * HW), 500, 3.0f);
  for (auto& v : x) v += 2.0f;  // a non-zero mean
  auto g = randu(C, 501), b = randu(C, 502);
  std::vector<float> rm = randu(C, 503), rv(C, 0.0f), mean(C), invstd(C), y(x.size());
  std::vector<double> sums(2 * C);
  for (int64_t c = 0; c < C; ++c) rv[static_cast<size_t>(c)] = 0.5f + 0.1f * static_cast<float>(c);
  const auto rm0 = rm, rv0 = rv;
  const float momentum = 0.1f;
  ops->batchnorm_statistics(T(sums, {2, C}), T(x, {N, C, H, W}));
  ops->batchnorm_forward_train(T(y, {N, C, H, W}), T(mean, {C}), T(invstd, {C}), T(rm, {C}),
                               T(rv, {C}), T(x, {N, C, H, W}), T(g, {C}), T(b, {C}),
                               T(sums, {2, C}), count, kBnEps, momentum, Activation::kNone);
  std::vector<double> want_rm(C), want_rv(C), want_mean(C), want_invstd(C), want_y(x.size());
  for (int64_t c = 0; c < C; ++c) {
    double m = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) m += x[static_cast<size_t>((n * C + c) * HW + i)];
    m /= count;
    double ss = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) {
        const double dv = x[static_cast<size_t>((n * C + c) * HW + i)] - m;
        ss += dv * dv;
      }
    const auto cs = static_cast<size_t>(c);
    want_mean[cs] = m;
    want_invstd[cs] = 1.0 / std::sqrt(ss / count + kBnEps);
    want_rm[cs] = (1 - momentum) * rm0[cs] + momentum * m;
    want_rv[cs] = (1 - momentum) * rv0[cs] + momentum * ss / (count - 1);  // unbiased
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) {
        const auto k = static_cast<size_t>((n * C + c) * HW + i);
        want_y[k] = (x[k] - m) * want_invstd[cs] * g[cs] + b[cs];
      }
  }
  expect_all_near(mean, want_mean, 1e-5, "mean");
  expect_all_near(invstd, want_invstd, 1e-4, "invstd");
  expect_all_near(rm, want_rm, 1e-5, "running_mean");
  expect_all_near(rv, want_rv, 1e-4, "running_var");
  expect_all_near(y, want_y, 1e-4, "train output");

  for (Activation act : {Activation::kNone, Activation::kRelu, Activation::kSilu}) {
    ops->batchnorm_forward_eval(T(y, {N, C, H, W}), T(x, {N, C, H, W}), T(g, {C}), T(b, {C}),
                                T(rm, {C}), T(rv, {C}), kBnEps, act);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t i = 0; i < HW; ++i) {
          const auto k = static_cast<size_t>((n * C + c) * HW + i);
          const auto cs = static_cast<size_t>(c);
          want_y[k] = act_ref(
              (x[k] - rm[cs]) / std::sqrt(rv[cs] + static_cast<double>(kBnEps)) * g[cs] + b[cs],
              act);
        }
    expect_all_near(y, want_y, 1e-5, std::string("eval output ") + activation_name(act));
  }
}

/// The training backward against its closed form in double (Ioffe & Szegedy, Algorithm 1's
/// backward): dx = γ·invstd·(dy' − mean(dy') − x̂·mean(dy'·x̂)), dy' = dy·act'(pre-activation).
TEST_F(ImageOpsTest, BatchNormBackwardMatchesClosedForm) {
  const int64_t N = 4, C = 24, H = 2, W = 2, HW = H * W, count = N * HW;
  for (Activation act : {Activation::kNone, Activation::kRelu6}) {
    SCOPED_TRACE(activation_name(act));
    auto x = randu(static_cast<size_t>(N * C * HW), 610, 3.0f);
    auto g = randu(C, 611), b = randu(C, 612), dy = randu(x.size(), 613);
    for (auto& v : g) v += 1.5f;
    std::vector<float> mean(C), invstd(C), y(x.size()), dg(C, 0.0f), db(C, 0.0f),
        dx(x.size(), 7.0f);
    std::vector<double> sums(2 * C), dsums(2 * C);
    ops->batchnorm_statistics(T(sums, {2, C}), T(x, {N, C, H, W}));
    ops->batchnorm_forward_train(T(y, {N, C, H, W}), T(mean, {C}), T(invstd, {C}), Tensor(),
                                 Tensor(), T(x, {N, C, H, W}), T(g, {C}), T(b, {C}),
                                 T(sums, {2, C}), count, kBnEps, 0.1f, act);
    ops->batchnorm_backward_reduce(T(dsums, {2, C}), T(dg, {C}), T(db, {C}), T(dy, {N, C, H, W}),
                                   T(x, {N, C, H, W}), T(g, {C}), T(b, {C}), T(mean, {C}),
                                   T(invstd, {C}), act);
    ops->batchnorm_backward_input(T(dx, {N, C, H, W}), T(dy, {N, C, H, W}), T(x, {N, C, H, W}),
                                  T(g, {C}), T(b, {C}), T(mean, {C}), T(invstd, {C}),
                                  T(dsums, {2, C}), count, act);
    std::vector<double> want_dx(x.size()), want_dg(C), want_db(C);
    for (int64_t c = 0; c < C; ++c) {
      const auto cs = static_cast<size_t>(c);
      const auto at = [&](int64_t n, int64_t i) {
        return static_cast<size_t>((n * C + c) * HW + i);
      };
      double m = 0, ss = 0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < HW; ++i) m += x[at(n, i)];
      m /= count;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < HW; ++i) ss += (x[at(n, i)] - m) * (x[at(n, i)] - m);
      const double is = 1.0 / std::sqrt(ss / count + kBnEps);
      double sdy = 0, sdyx = 0;
      std::vector<double> d(static_cast<size_t>(count)), xh(static_cast<size_t>(count));
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < HW; ++i) {
          const auto j = static_cast<size_t>(n * HW + i);
          xh[j] = (x[at(n, i)] - m) * is;
          const double pre = xh[j] * g[cs] + b[cs];
          const bool pass = act == Activation::kNone || (pre > 0.0 && pre < 6.0);
          d[j] = pass ? dy[at(n, i)] : 0.0;
          sdy += d[j];
          sdyx += d[j] * xh[j];
        }
      want_dg[cs] = sdyx;
      want_db[cs] = sdy;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < HW; ++i) {
          const auto j = static_cast<size_t>(n * HW + i);
          want_dx[at(n, i)] = g[cs] * is * (d[j] - sdy / count - xh[j] * sdyx / count);
        }
    }
    expect_all_near(dx, want_dx, 1e-5, "dinp");
    expect_all_near(dg, want_dg, 1e-5, "dweight");
    expect_all_near(db, want_db, 1e-5, "dbias");
  }
}

TEST_F(ImageOpsTest, BatchNormBackwardAccumulatesParametersAndOverwritesInput) {
  BnData d = bn_data(2, 3, 2, 2, 600, kBnEps);
  const int64_t N = d.N, C = d.C, H = d.H, W = d.W;
  auto dy = randu(d.x.size(), 601);
  std::vector<float> y(d.x.size()), mean(C), invstd(C), dg(C, 0.0f), db(C, 0.0f),
      dx1(d.x.size(), 9.0f), dx2(d.x.size(), -1e5f);
  std::vector<double> sums(2 * C), dsums(2 * C);
  ops->batchnorm_statistics(T(sums, {2, C}), T(d.x, {N, C, H, W}));
  ops->batchnorm_forward_train(T(y, {N, C, H, W}), T(mean, {C}), T(invstd, {C}), Tensor(), Tensor(),
                               T(d.x, {N, C, H, W}), T(d.gamma, {C}), T(d.beta, {C}),
                               T(sums, {2, C}), d.count(), kBnEps, 0.1f, Activation::kSilu);
  auto run = [&](std::vector<float>& dx) {
    ops->batchnorm_backward_reduce(T(dsums, {2, C}), T(dg, {C}), T(db, {C}), T(dy, {N, C, H, W}),
                                   T(d.x, {N, C, H, W}), T(d.gamma, {C}), T(d.beta, {C}),
                                   T(mean, {C}), T(invstd, {C}), Activation::kSilu);
    ops->batchnorm_backward_input(T(dx, {N, C, H, W}), T(dy, {N, C, H, W}), T(d.x, {N, C, H, W}),
                                  T(d.gamma, {C}), T(d.beta, {C}), T(mean, {C}), T(invstd, {C}),
                                  T(dsums, {2, C}), d.count(), Activation::kSilu);
  };
  run(dx1);
  const auto dg1 = dg, db1 = db;
  run(dx2);
  for (size_t i = 0; i < dx1.size(); ++i) ASSERT_FLOAT_EQ(dx1[i], dx2[i]);
  for (int64_t c = 0; c < C; ++c) {
    ASSERT_FLOAT_EQ(dg[static_cast<size_t>(c)], 2 * dg1[static_cast<size_t>(c)]);
    ASSERT_FLOAT_EQ(db[static_cast<size_t>(c)], 2 * db1[static_cast<size_t>(c)]);
  }
}

/// Synchronized batch norm: two halves of a batch with all-reduced (summed) sums and dsums give
/// the whole batch's outputs and gradients.
TEST_F(ImageOpsTest, SynchronizedBatchNormHalvesEqualWholeBatch) {
  const Activation act = Activation::kSilu;
  BnData d = bn_data(4, 3, 3, 3, 700, kBnEps);
  const int64_t N = d.N, C = d.C, H = d.H, W = d.W, half = N / 2, per = C * H * W;
  auto dy = randu(d.x.size(), 701);
  // The whole batch.
  std::vector<float> y(d.x.size()), mean(C), invstd(C), rm(C, 0.0f), rv(C, 1.0f), dg(C, 0.0f),
      db(C, 0.0f), dx(d.x.size());
  std::vector<double> sums(2 * C), dsums(2 * C);
  ops->batchnorm_statistics(T(sums, {2, C}), T(d.x, {N, C, H, W}));
  ops->batchnorm_forward_train(T(y, {N, C, H, W}), T(mean, {C}), T(invstd, {C}), T(rm, {C}),
                               T(rv, {C}), T(d.x, {N, C, H, W}), T(d.gamma, {C}), T(d.beta, {C}),
                               T(sums, {2, C}), d.count(), kBnEps, 0.1f, act);
  ops->batchnorm_backward_reduce(T(dsums, {2, C}), T(dg, {C}), T(db, {C}), T(dy, {N, C, H, W}),
                                 T(d.x, {N, C, H, W}), T(d.gamma, {C}), T(d.beta, {C}),
                                 T(mean, {C}), T(invstd, {C}), act);
  ops->batchnorm_backward_input(T(dx, {N, C, H, W}), T(dy, {N, C, H, W}), T(d.x, {N, C, H, W}),
                                T(d.gamma, {C}), T(d.beta, {C}), T(mean, {C}), T(invstd, {C}),
                                T(dsums, {2, C}), d.count(), act);
  // Two "ranks", each with half the images.
  auto part = [&](const std::vector<float>& v, int64_t h) {
    return std::vector<float>(v.begin() + h * half * per, v.begin() + (h + 1) * half * per);
  };
  std::vector<float> xs[2] = {part(d.x, 0), part(d.x, 1)}, dys[2] = {part(dy, 0), part(dy, 1)};
  std::vector<double> sum_parts[2] = {std::vector<double>(2 * C), std::vector<double>(2 * C)};
  for (int h = 0; h < 2; ++h)
    ops->batchnorm_statistics(T(sum_parts[h], {2, C}), T(xs[h], {half, C, H, W}));
  std::vector<double> all_sums(2 * C);  // the all-reduce
  for (int64_t i = 0; i < 2 * C; ++i)
    all_sums[static_cast<size_t>(i)] =
        sum_parts[0][static_cast<size_t>(i)] + sum_parts[1][static_cast<size_t>(i)];
  std::vector<float> ys[2], means[2], invstds[2], dgs[2], dbs[2];
  std::vector<double> dsum_parts[2];
  for (int h = 0; h < 2; ++h) {
    ys[h].resize(xs[h].size());
    means[h].resize(C), invstds[h].resize(C), dsum_parts[h].resize(2 * C);
    dgs[h].assign(C, 0.0f), dbs[h].assign(C, 0.0f);
    ops->batchnorm_forward_train(T(ys[h], {half, C, H, W}), T(means[h], {C}), T(invstds[h], {C}),
                                 Tensor(), Tensor(), T(xs[h], {half, C, H, W}), T(d.gamma, {C}),
                                 T(d.beta, {C}), T(all_sums, {2, C}), d.count(), kBnEps, 0.1f, act);
    ops->batchnorm_backward_reduce(T(dsum_parts[h], {2, C}), T(dgs[h], {C}), T(dbs[h], {C}),
                                   T(dys[h], {half, C, H, W}), T(xs[h], {half, C, H, W}),
                                   T(d.gamma, {C}), T(d.beta, {C}), T(means[h], {C}),
                                   T(invstds[h], {C}), act);
  }
  std::vector<double> all_dsums(2 * C);
  for (int64_t i = 0; i < 2 * C; ++i)
    all_dsums[static_cast<size_t>(i)] =
        dsum_parts[0][static_cast<size_t>(i)] + dsum_parts[1][static_cast<size_t>(i)];
  for (int h = 0; h < 2; ++h) {
    std::vector<float> dxh(xs[h].size());
    ops->batchnorm_backward_input(T(dxh, {half, C, H, W}), T(dys[h], {half, C, H, W}),
                                  T(xs[h], {half, C, H, W}), T(d.gamma, {C}), T(d.beta, {C}),
                                  T(means[h], {C}), T(invstds[h], {C}), T(all_dsums, {2, C}),
                                  d.count(), act);
    const auto y_whole = part(y, h), dx_whole = part(dx, h);
    for (size_t i = 0; i < dxh.size(); ++i) {
      ASSERT_NEAR(ys[h][i], y_whole[i], 1e-5) << "half " << h << " output " << i;
      ASSERT_NEAR(dxh[i], dx_whole[i], 1e-5) << "half " << h << " dinp " << i;
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    const auto cs = static_cast<size_t>(c);
    EXPECT_NEAR(means[0][cs], mean[cs], 1e-6);
    EXPECT_NEAR(invstds[0][cs], invstd[cs], 1e-5);
    EXPECT_NEAR(dgs[0][cs] + dgs[1][cs], dg[cs], 1e-5);
    EXPECT_NEAR(dbs[0][cs] + dbs[1][cs], db[cs], 1e-5);
  }
}

// ---- activations
// -------------------------------------------------------------------------------------

TEST_F(ImageOpsTest, ActivationGradients) {
  for (Activation act : {Activation::kNone, Activation::kRelu, Activation::kRelu6,
                         Activation::kSilu, Activation::kSigmoid}) {
    SCOPED_TRACE(activation_name(act));
    auto x = randu(60, 800, 8.0f);  // [−8, 8]: both ReLU6 kinks are inside
    for (auto& v : x) {             // away from the kinks at 0 and 6
      if (std::abs(v) < 0.05f) v += 0.1f;
      if (std::abs(v - 6.0f) < 0.05f) v += 0.1f;
    }
    auto r = randu(x.size(), 801);
    std::vector<float> y(x.size());
    auto f = [&] {
      ops->activation_forward(T(y, {3, 4, 5}), T(x, {3, 4, 5}), act);
      return dot(y, r);
    };
    f();
    for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], act_ref(x[i], act), 1e-6);
    std::vector<float> dx(x.size(), 3.0f);
    ops->activation_backward(T(dx, {3, 4, 5}), T(r, {3, 4, 5}), T(x, {3, 4, 5}), act);
    expect_grad_close(x, dx, f, std::string("activation ") + activation_name(act));
    f();  // y at the unperturbed x again
    // In place: dinp aliasing dout, out aliasing inp.
    std::vector<float> d = r;
    ops->activation_backward(T(d, {3, 4, 5}), T(d, {3, 4, 5}), T(x, {3, 4, 5}), act);
    for (size_t i = 0; i < d.size(); ++i) ASSERT_FLOAT_EQ(d[i], dx[i]);
    std::vector<float> z = x;
    ops->activation_forward(T(z, {3, 4, 5}), T(z, {3, 4, 5}), act);
    for (size_t i = 0; i < z.size(); ++i) ASSERT_FLOAT_EQ(z[i], y[i]);
  }
}

// ---- pooling
// ----------------------------------------------------------------------------------------

Pool2dShape pool_shape(int64_t N, int64_t C, int64_t H, int64_t W, int64_t R, int64_t S,
                       int64_t stride, int64_t pad) {
  Pool2dShape s;
  s.N = N, s.C = C, s.H = H, s.W = W, s.R = R, s.S = S;
  s.stride_h = s.stride_w = stride;
  s.pad_h = s.pad_w = pad;
  return s;
}

/// Distinct values 0.05 apart in a random order (no ties for max pooling, even after ±kH).
std::vector<float> distinct_values(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  SplitMix64 g{seed};
  std::vector<size_t> perm(n);
  std::iota(perm.begin(), perm.end(), size_t{0});
  for (size_t i = n; i > 1; --i) std::swap(perm[i - 1], perm[g.next() % i]);
  for (size_t i = 0; i < n; ++i) v[i] = 0.05f * static_cast<float>(perm[i]) - 1.0f;
  return v;
}

TEST_F(ImageOpsTest, PoolingGradients) {
  const Pool2dShape shapes[] = {pool_shape(2, 2, 6, 6, 2, 2, 2, 0),
                                pool_shape(2, 2, 7, 5, 3, 3, 2, 1)};
  for (const auto& s : shapes) {
    const int64_t P = s.P(), Q = s.Q();
    auto x = distinct_values(static_cast<size_t>(s.N * s.C * s.H * s.W), 900);
    auto r = randu(static_cast<size_t>(s.N * s.C * P * Q), 901);
    std::vector<float> y(r.size());
    for (bool max : {true, false}) {
      SCOPED_TRACE(max ? "max" : "avg");
      auto f = [&] {
        if (max)
          ops->maxpool2d_forward(T(y, {s.N, s.C, P, Q}), T(x, {s.N, s.C, s.H, s.W}), s);
        else
          ops->avgpool2d_forward(T(y, {s.N, s.C, P, Q}), T(x, {s.N, s.C, s.H, s.W}), s);
        return dot(y, r);
      };
      f();
      std::vector<float> dx(x.size(), 4.0f);
      if (max)
        ops->maxpool2d_backward(T(dx, {s.N, s.C, s.H, s.W}), T(r, {s.N, s.C, P, Q}),
                                T(x, {s.N, s.C, s.H, s.W}), s);
      else
        ops->avgpool2d_backward(T(dx, {s.N, s.C, s.H, s.W}), T(r, {s.N, s.C, P, Q}), s);
      expect_grad_close(
          x, dx, f,
          fmt::format("{}pool {}x{} s{} p{}", max ? "max" : "avg", s.R, s.S, s.stride_h, s.pad_h));
    }
  }
}

TEST_F(ImageOpsTest, MaxPoolPaddingNeverWinsAndTiesGoToTheFirst) {
  // All-negative input with padding: padding (−∞) never wins; all-equal windows send the
  // gradient to the first element in row-major order.
  const Pool2dShape s = pool_shape(1, 1, 2, 2, 2, 2, 1, 1);  // 3x3 output
  std::vector<float> x(4, -5.0f), y(9), dy(9, 1.0f), dx(4);
  ops->maxpool2d_forward(T(y, {1, 1, 3, 3}), T(x, {1, 1, 2, 2}), s);
  for (float v : y) EXPECT_EQ(v, -5.0f);
  ops->maxpool2d_backward(T(dx, {1, 1, 2, 2}), T(dy, {1, 1, 3, 3}), T(x, {1, 1, 2, 2}), s);
  // Windows (rows, cols) of the padded input; the first valid element of each gets 1.
  EXPECT_EQ(dx[0], 4.0f);  // windows (0,0),(0,1),(1,0),(1,1)
  EXPECT_EQ(dx[1], 2.0f);  // (0,2),(1,2)
  EXPECT_EQ(dx[2], 2.0f);  // (2,0),(2,1)
  EXPECT_EQ(dx[3], 1.0f);  // (2,2)
}

TEST_F(ImageOpsTest, AdaptiveAvgPoolForwardAndGradients) {
  struct Case {
    int64_t H, W, P, Q;
  };
  for (const Case& cs : {Case{5, 7, 2, 3}, Case{4, 6, 1, 1}, Case{6, 4, 3, 2}, Case{3, 3, 5, 4}}) {
    SCOPED_TRACE(fmt::format("{}x{} -> {}x{}", cs.H, cs.W, cs.P, cs.Q));
    const int64_t N = 2, C = 3;
    auto x = randu(static_cast<size_t>(N * C * cs.H * cs.W), 1000);
    auto r = randu(static_cast<size_t>(N * C * cs.P * cs.Q), 1001);
    std::vector<float> y(r.size());
    auto f = [&] {
      ops->adaptive_avgpool2d_forward(T(y, {N, C, cs.P, cs.Q}), T(x, {N, C, cs.H, cs.W}));
      return dot(y, r);
    };
    f();
    // PyTorch's windows: rows ⌊i·H/P⌋ .. ⌈(i+1)·H/P⌉ − 1.
    std::vector<double> want(y.size());
    for (int64_t nc = 0; nc < N * C; ++nc)
      for (int64_t i = 0; i < cs.P; ++i)
        for (int64_t j = 0; j < cs.Q; ++j) {
          const auto h0 = static_cast<int64_t>(std::floor(double(i) * cs.H / cs.P));
          const auto h1 = static_cast<int64_t>(std::ceil(double(i + 1) * cs.H / cs.P));
          const auto w0 = static_cast<int64_t>(std::floor(double(j) * cs.W / cs.Q));
          const auto w1 = static_cast<int64_t>(std::ceil(double(j + 1) * cs.W / cs.Q));
          double acc = 0;
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w)
              acc += x[static_cast<size_t>((nc * cs.H + h) * cs.W + w)];
          want[static_cast<size_t>((nc * cs.P + i) * cs.Q + j)] =
              acc / double((h1 - h0) * (w1 - w0));
        }
    expect_all_near(y, want, 1e-6, "adaptive avgpool forward");
    std::vector<float> dx(x.size(), -2.0f);
    ops->adaptive_avgpool2d_backward(T(dx, {N, C, cs.H, cs.W}), T(r, {N, C, cs.P, cs.Q}));
    expect_grad_close(x, dx, f,
                      fmt::format("adaptive avgpool {}x{}->{}x{}", cs.H, cs.W, cs.P, cs.Q));
  }
}

// ---- channel scaling ----------------------------------------------------------------------------

TEST_F(ImageOpsTest, ChannelScaleGradients) {
  const int64_t N = 2, C = 3, H = 4, W = 3;
  auto x = randu(static_cast<size_t>(N * C * H * W), 1100);
  auto sc = randu(static_cast<size_t>(N * C), 1101);
  auto r = randu(x.size(), 1102);
  std::vector<float> y(x.size());
  auto f = [&] {
    ops->channel_scale_forward(T(y, {N, C, H, W}), T(x, {N, C, H, W}), T(sc, {N, C}));
    return dot(y, r);
  };
  f();
  std::vector<float> dx(x.size(), 8.0f), dsc(sc.size(), 8.0f);
  ops->channel_scale_backward(T(dx, {N, C, H, W}), T(dsc, {N, C}), T(r, {N, C, H, W}),
                              T(x, {N, C, H, W}), T(sc, {N, C}));
  expect_grad_close(x, dx, f, "channel_scale dinp");
  expect_grad_close(sc, dsc, f, "channel_scale dscale");
  // Both gradients are overwritten: a second call gives the same values.
  const auto dx1 = dx, dsc1 = dsc;
  ops->channel_scale_backward(T(dx, {N, C, H, W}), T(dsc, {N, C}), T(r, {N, C, H, W}),
                              T(x, {N, C, H, W}), T(sc, {N, C}));
  EXPECT_EQ(dx, dx1);
  EXPECT_EQ(dsc, dsc1);
}

TEST_F(ImageOpsTest, SwapMiddleAxesMovesEveryElementOnce) {
  const int64_t A = 2, B = 3, C = 4, D = 5;
  std::vector<float> x(static_cast<size_t>(A * B * C * D)), y(x.size(), -1.0f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  ops->swap_middle_axes(T(y, {A, C, B, D}), T(x, {A, B, C, D}));
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t d = 0; d < D; ++d)
          ASSERT_EQ(y[static_cast<size_t>(((a * C + c) * B + b) * D + d)],
                    x[static_cast<size_t>(((a * B + b) * C + c) * D + d)]);
  // And back.
  std::vector<float> z(x.size());
  ops->swap_middle_axes(T(z, {A, B, C, D}), T(y, {A, C, B, D}));
  EXPECT_EQ(z, x);
}

// ---- LSTM
// ----------------------------------------------------------------------------------------------

TEST_F(ImageOpsTest, LstmGradients) {
  const int64_t N = 2, L = 4, I = 3, H = 5, G = 4 * H;
  auto x = randu(static_cast<size_t>(N * L * I), 1200);
  auto wih = randu(static_cast<size_t>(G * I), 1201, 0.6f);
  auto whh = randu(static_cast<size_t>(G * H), 1202, 0.6f);
  auto bih = randu(static_cast<size_t>(G), 1203, 0.5f),
       bhh = randu(static_cast<size_t>(G), 1204, 0.5f);
  auto r = randu(static_cast<size_t>(N * L * H), 1205);
  std::vector<float> y(r.size()), saved(static_cast<size_t>(L * N * 6 * H));
  auto f = [&] {
    ops->lstm_forward(T(y, {N, L, H}), T(saved, {L, N, 6 * H}), T(x, {N, L, I}), T(wih, {G, I}),
                      T(whh, {G, H}), T(bih, {G}), T(bhh, {G}));
    return dot(y, r);
  };
  f();
  // Forward against a plain step-by-step reference in double (PyTorch's gate order i f g o).
  {
    std::vector<double> h(static_cast<size_t>(N * H), 0.0), c(static_cast<size_t>(N * H), 0.0);
    auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
    for (int64_t t = 0; t < L; ++t) {
      std::vector<double> hn(h.size());
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < H; ++j) {
          double gate[4];
          for (int q = 0; q < 4; ++q) {
            const int64_t row = q * H + j;
            double a = bih[static_cast<size_t>(row)] + bhh[static_cast<size_t>(row)];
            for (int64_t k = 0; k < I; ++k)
              a += double(wih[static_cast<size_t>(row * I + k)]) *
                   x[static_cast<size_t>((n * L + t) * I + k)];
            for (int64_t k = 0; k < H; ++k)
              a +=
                  double(whh[static_cast<size_t>(row * H + k)]) * h[static_cast<size_t>(n * H + k)];
            gate[q] = a;
          }
          auto& cc = c[static_cast<size_t>(n * H + j)];
          cc = sig(gate[1]) * cc + sig(gate[0]) * std::tanh(gate[2]);
          hn[static_cast<size_t>(n * H + j)] = sig(gate[3]) * std::tanh(cc);
          ASSERT_NEAR(y[static_cast<size_t>((n * L + t) * H + j)],
                      hn[static_cast<size_t>(n * H + j)], 1e-5);
        }
      h = hn;
    }
  }
  std::vector<float> dx(x.size(), 6.0f), dwih(wih.size(), 0.0f), dwhh(whh.size(), 0.0f),
      dbih(bih.size(), 0.0f), dbhh(bhh.size(), 0.0f);
  auto backward = [&] {
    ops->lstm_backward(T(dx, {N, L, I}), T(dwih, {G, I}), T(dwhh, {G, H}), T(dbih, {G}),
                       T(dbhh, {G}), T(r, {N, L, H}), T(x, {N, L, I}), T(y, {N, L, H}),
                       T(saved, {L, N, 6 * H}), T(wih, {G, I}), T(whh, {G, H}));
  };
  backward();
  expect_grad_close(x, dx, f, "lstm dinp");
  expect_grad_close(wih, dwih, f, "lstm dweight_ih");
  expect_grad_close(whh, dwhh, f, "lstm dweight_hh");
  expect_grad_close(bih, dbih, f, "lstm dbias_ih");
  expect_grad_close(bhh, dbhh, f, "lstm dbias_hh");
  // Accumulation: a second backward doubles the parameter gradients, dinp is overwritten.
  f();
  const auto dx1 = dx, dwih1 = dwih, dwhh1 = dwhh, dbih1 = dbih;
  std::fill(dx.begin(), dx.end(), -1e4f);
  backward();
  for (size_t i = 0; i < dx.size(); ++i) ASSERT_FLOAT_EQ(dx[i], dx1[i]);
  for (size_t i = 0; i < dwih.size(); ++i) ASSERT_FLOAT_EQ(dwih[i], 2 * dwih1[i]);
  for (size_t i = 0; i < dwhh.size(); ++i) ASSERT_FLOAT_EQ(dwhh[i], 2 * dwhh1[i]);
  for (size_t i = 0; i < dbih.size(); ++i) ASSERT_FLOAT_EQ(dbih[i], 2 * dbih1[i]);
}

// ---- classification loss ---------------------------------------------------------------------

TEST_F(ImageOpsTest, ClassificationLossAndGradient) {
  const int64_t N = 4, K = 5;
  std::vector<int32_t> tg = {0, 3, 4, 2};
  for (float eps : {0.0f, 0.1f}) {
    SCOPED_TRACE(eps);
    auto z = randu(static_cast<size_t>(N * K), 1300, 3.0f);
    z[1] = 40.0f;  // a large logit: log-softmax must stay finite
    std::vector<float> losses(N);
    auto f = [&] {
      std::vector<float> zc = z;
      ops->classification_loss(T(losses, {N}), T(zc, {N, K}), I32(tg, {N}), eps, 1.0f);
      double s = 0;
      for (float l : losses) s += l;
      return s;
    };
    f();
    // Hand computation: −Σ_k q_k·log softmax(z)_k with q = (1 − ε)·onehot + ε/K.
    for (int64_t n = 0; n < N; ++n) {
      double m = -1e30, se = 0;
      for (int64_t k = 0; k < K; ++k) m = std::max(m, double(z[static_cast<size_t>(n * K + k)]));
      for (int64_t k = 0; k < K; ++k) se += std::exp(z[static_cast<size_t>(n * K + k)] - m);
      double loss = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double q = (k == tg[static_cast<size_t>(n)] ? 1.0 - eps : 0.0) + eps / K;
        loss -= q * (z[static_cast<size_t>(n * K + k)] - m - std::log(se));
      }
      EXPECT_NEAR(losses[static_cast<size_t>(n)], loss, 1e-5 * (1 + std::abs(loss))) << n;
    }
    std::vector<float> grad = z, losses2(N);
    ops->classification_loss(T(losses2, {N}), T(grad, {N, K}), I32(tg, {N}), eps, 1.0f);
    expect_grad_close(z, grad, f, fmt::format("classification_loss eps={}", eps));
    std::vector<float> half = z;
    ops->classification_loss(T(losses2, {N}), T(half, {N, K}), I32(tg, {N}), eps, 0.5f);
    for (size_t i = 0; i < half.size(); ++i) ASSERT_FLOAT_EQ(half[i], 0.5f * grad[i]);
  }
}

// ---- shapes large enough for the OpenMP paths
// ------------------------------------------------------

TEST_F(ImageOpsTest, LargeConvolutionsMatchDirectLoops) {
  const ConvCase cases[] = {
      {"3x3 p1", conv_shape(4, 8, 16, 16, 16, 3, 3, 1, 1, 1, 1, 1), true},
      {"3x3 s2 g4", conv_shape(4, 8, 17, 16, 16, 3, 3, 2, 2, 1, 1, 4), true},
      {"1x1", conv_shape(4, 16, 16, 16, 16, 1, 1, 1, 1, 0, 0, 1), true},
      {"depthwise 5x5", conv_shape(4, 16, 16, 16, 16, 5, 5, 1, 1, 2, 2, 16), true},
      {"one image (threads inside sgemm)", conv_shape(1, 16, 20, 20, 32, 3, 3, 1, 1, 1, 1, 1),
       true},
      {"1x1 at 2x2 (MobileNetV2's last blocks)", conv_shape(4, 96, 2, 2, 32, 1, 1, 1, 1, 0, 0, 1),
       false},
      {"depthwise 3x3 at 2x2", conv_shape(4, 24, 2, 2, 24, 3, 3, 1, 1, 1, 1, 24), false},
      {"depthwise 3x3 s2 at 4x4", conv_shape(4, 24, 4, 4, 24, 3, 3, 2, 2, 1, 1, 24), false},
  };
  for (const auto& cc : cases) {
    SCOPED_TRACE(cc.name);
    const Conv2dShape& s = cc.s;
    const int64_t Cg = s.C / s.groups, P = s.P(), Q = s.Q();
    auto x = randu(static_cast<size_t>(s.N * s.C * s.H * s.W), 1400);
    auto w = randu(static_cast<size_t>(s.K * Cg * s.R * s.S), 1401);
    auto b = randu(static_cast<size_t>(s.K), 1402);
    auto dy = randu(static_cast<size_t>(s.N * s.K * P * Q), 1403);
    std::vector<float> y(dy.size()), dx(x.size(), 1e3f), dw(w.size(), 0.0f), db(b.size(), 0.0f);
    ops->conv2d_forward(T(y, {s.N, s.K, P, Q}), T(x, {s.N, s.C, s.H, s.W}),
                        T(w, {s.K, Cg, s.R, s.S}), T(b, {s.K}), s);
    expect_all_near(y, conv_ref(x, w, b, s), 1e-5, "forward");
    ops->conv2d_backward(T(dx, {s.N, s.C, s.H, s.W}), T(dw, {s.K, Cg, s.R, s.S}), T(db, {s.K}),
                         T(dy, {s.N, s.K, P, Q}), T(x, {s.N, s.C, s.H, s.W}),
                         T(w, {s.K, Cg, s.R, s.S}), s);
    const ConvGrads ref = conv_backward_ref(x, w, dy, s);
    expect_all_near(dx, ref.dx, 1e-5, "dinp");
    expect_all_near(dw, ref.dw, 1e-5, "dweight");
    expect_all_near(db, ref.db, 1e-5, "dbias");
  }
}

/// Every other op on large tensors gives the same results on one thread as on several (each
/// output element is computed by one thread; catches races and wrong partitions).
TEST_F(ImageOpsTest, LargeShapesAgreeAcrossThreadCounts) {
  const int64_t N = 4, C = 16, H = 24, W = 24, L = 8, I = 64, Hd = 64, K = 1000;
  auto run = [&] {
    std::vector<std::vector<float>> r;
    auto x = randu(static_cast<size_t>(N * C * H * W), 1500, 2.0f);
    auto g = randu(C, 1501), b = randu(C, 1502), dy = randu(x.size(), 1503);
    std::vector<float> y(x.size()), mean(C), invstd(C), rm(C, 0.0f), rv(C, 1.0f), dg(C, 0.0f),
        db(C, 0.0f), dx(x.size());
    std::vector<double> sums(2 * C), dsums(2 * C);
    const Tensor X = T(x, {N, C, H, W}), DY = T(dy, {N, C, H, W});
    ops->batchnorm_statistics(T(sums, {2, C}), X);
    ops->batchnorm_forward_train(T(y, {N, C, H, W}), T(mean, {C}), T(invstd, {C}), T(rm, {C}),
                                 T(rv, {C}), X, T(g, {C}), T(b, {C}), T(sums, {2, C}), N * H * W,
                                 kBnEps, 0.1f, Activation::kRelu6);
    ops->batchnorm_backward_reduce(T(dsums, {2, C}), T(dg, {C}), T(db, {C}), DY, X, T(g, {C}),
                                   T(b, {C}), T(mean, {C}), T(invstd, {C}), Activation::kRelu6);
    ops->batchnorm_backward_input(T(dx, {N, C, H, W}), DY, X, T(g, {C}), T(b, {C}), T(mean, {C}),
                                  T(invstd, {C}), T(dsums, {2, C}), N * H * W, Activation::kRelu6);
    const auto as_float = [](const std::vector<double>& v) {
      return std::vector<float>(v.begin(), v.end());
    };
    r.insert(r.end(), {y, as_float(sums), mean, invstd, rm, rv, as_float(dsums), dg, db, dx});
    ops->batchnorm_forward_eval(T(y, {N, C, H, W}), X, T(g, {C}), T(b, {C}), T(rm, {C}), T(rv, {C}),
                                kBnEps, Activation::kSilu);
    r.push_back(y);
    ops->activation_forward(T(y, {N, C, H, W}), X, Activation::kSilu);
    ops->activation_backward(T(dx, {N, C, H, W}), DY, X, Activation::kSilu);
    r.insert(r.end(), {y, dx});
    const Pool2dShape ps = pool_shape(N, C, H, W, 3, 3, 2, 1);
    std::vector<float> py(static_cast<size_t>(N * C * ps.P() * ps.Q()));
    auto pdy = randu(py.size(), 1504);
    const Tensor PY = T(py, {N, C, ps.P(), ps.Q()}), PDY = T(pdy, {N, C, ps.P(), ps.Q()});
    ops->maxpool2d_forward(PY, X, ps);
    ops->maxpool2d_backward(T(dx, {N, C, H, W}), PDY, X, ps);
    r.insert(r.end(), {py, dx});
    ops->avgpool2d_forward(PY, X, ps);
    ops->avgpool2d_backward(T(dx, {N, C, H, W}), PDY, ps);
    r.insert(r.end(), {py, dx});
    std::vector<float> ay(static_cast<size_t>(N * C * 5 * 7));
    auto ady = randu(ay.size(), 1505);
    ops->adaptive_avgpool2d_forward(T(ay, {N, C, 5, 7}), X);
    ops->adaptive_avgpool2d_backward(T(dx, {N, C, H, W}), T(ady, {N, C, 5, 7}));
    r.insert(r.end(), {ay, dx});
    auto sc = randu(static_cast<size_t>(N * C), 1506);
    std::vector<float> dsc(sc.size());
    ops->channel_scale_forward(T(y, {N, C, H, W}), X, T(sc, {N, C}));
    ops->channel_scale_backward(T(dx, {N, C, H, W}), T(dsc, {N, C}), DY, X, T(sc, {N, C}));
    r.insert(r.end(), {y, dx, dsc});
    const int64_t G = 4 * Hd, NL = 32;  // N·Hd large enough for the threads
    auto li = randu(static_cast<size_t>(NL * L * I), 1507);
    auto wih = randu(static_cast<size_t>(G * I), 1508, 0.2f),
         whh = randu(static_cast<size_t>(G * Hd), 1509, 0.2f);
    auto bih = randu(static_cast<size_t>(G), 1510), bhh = randu(static_cast<size_t>(G), 1511);
    auto ldy = randu(static_cast<size_t>(NL * L * Hd), 1512);
    std::vector<float> ly(ldy.size()), saved(static_cast<size_t>(L * NL * 6 * Hd)), ldx(li.size()),
        dwih(wih.size(), 0.0f), dwhh(whh.size(), 0.0f), dbih(bih.size(), 0.0f),
        dbhh(bhh.size(), 0.0f);
    ops->lstm_forward(T(ly, {NL, L, Hd}), T(saved, {L, NL, 6 * Hd}), T(li, {NL, L, I}),
                      T(wih, {G, I}), T(whh, {G, Hd}), T(bih, {G}), T(bhh, {G}));
    ops->lstm_backward(T(ldx, {NL, L, I}), T(dwih, {G, I}), T(dwhh, {G, Hd}), T(dbih, {G}),
                       T(dbhh, {G}), T(ldy, {NL, L, Hd}), T(li, {NL, L, I}), T(ly, {NL, L, Hd}),
                       T(saved, {L, NL, 6 * Hd}), T(wih, {G, I}), T(whh, {G, Hd}));
    r.insert(r.end(), {ly, saved, ldx, dwih, dwhh, dbih});
    auto logits = randu(static_cast<size_t>(64 * K), 1513, 5.0f);
    std::vector<int32_t> tg(64);
    for (size_t i = 0; i < tg.size(); ++i) tg[i] = static_cast<int32_t>(i * 37 % K);
    std::vector<float> losses(64);
    ops->classification_loss(T(losses, {64}), T(logits, {64, K}), I32(tg, {64}), 0.1f, 0.25f);
    r.insert(r.end(), {losses, logits});
    return r;
  };
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = run();
  omp_set_num_threads(std::max(threads, 2));
  const auto many = run();
  omp_set_num_threads(threads);
  ASSERT_EQ(one.size(), many.size());
  for (size_t k = 0; k < one.size(); ++k) {
    ASSERT_EQ(one[k].size(), many[k].size());
    for (size_t i = 0; i < one[k].size(); ++i)
      ASSERT_NEAR(one[k][i], many[k][i], 1e-5 * (1 + std::abs(one[k][i])))
          << "result " << k << " element " << i;
  }
}

// ---- bad input
// ---------------------------------------------------------------------------------------

TEST_F(ImageOpsTest, BadInputNamesTheOpAndTheShapes) {
  const Conv2dShape s = conv_shape(2, 3, 5, 5, 4, 3, 3, 1, 1, 1, 1, 1);
  std::vector<float> x(2 * 3 * 5 * 5), w(4 * 3 * 3 * 3), y(2 * 4 * 5 * 5), wrong(4 * 3 * 3 * 2);
  EXPECT_THROW_MSG(ops->conv2d_forward(T(y, {2, 4, 5, 5}), T(x, {2, 3, 5, 5}),
                                       T(wrong, {4, 3, 3, 2}), Tensor(), s),
                   Error, "conv2d_forward: weight has shape [4, 3, 3, 2], expected [4, 3, 3, 3]");
  EXPECT_THROW_MSG(
      ops->conv2d_forward(T(y, {2, 4, 4, 5}), T(x, {2, 3, 5, 5}), T(w, {4, 3, 3, 3}), Tensor(), s),
      Error, "out has shape [2, 4, 4, 5], expected [2, 4, 5, 5]");
  Tensor bf16 = T(x, {2, 3, 5, 5});
  bf16.dtype = DType::kBF16;
  EXPECT_THROW_MSG(ops->conv2d_forward(T(y, {2, 4, 5, 5}), bf16, T(w, {4, 3, 3, 3}), Tensor(), s),
                   Error, "conv2d_forward: inp [2, 3, 5, 5] is bf16, expected fp32");
  Conv2dShape bad_groups = s;
  bad_groups.groups = 2;
  EXPECT_THROW_MSG(ops->conv2d_backward(Tensor(), T(w, {4, 3, 3, 3}), Tensor(), T(y, {2, 4, 5, 5}),
                                        T(x, {2, 3, 5, 5}), T(w, {4, 3, 3, 3}), bad_groups),
                   Error, "conv2d_backward: groups=2 must divide the input channels C=3");
  std::vector<float> m(3), is(3), g(3), b(3);
  std::vector<double> sums(6);
  EXPECT_THROW_MSG(ops->batchnorm_statistics(T(sums, {2, 2}), T(x, {2, 3, 5, 5})), Error,
                   "batchnorm_statistics: sums has shape [2, 2], expected [2, 3]");
  EXPECT_THROW_MSG(
      ops->batchnorm_forward_train(T(y, {2, 3, 25, 2}), T(m, {3}), T(is, {3}), Tensor(), Tensor(),
                                   T(x, {2, 3, 5, 5}), T(g, {3}), T(b, {3}), T(sums, {2, 3}), 50,
                                   1e-5f, 0.1f),
      Error,
      "batchnorm_forward_train: out has shape [2, 3, 25, 2], but inp has shape [2, 3, 5, 5]");
  const Pool2dShape ps = pool_shape(2, 3, 5, 5, 2, 2, 2, 0);
  EXPECT_THROW_MSG(ops->maxpool2d_forward(T(y, {2, 3, 3, 3}), T(x, {2, 3, 5, 5}), ps), Error,
                   "maxpool2d_forward: out has shape [2, 3, 3, 3], expected [2, 3, 2, 2]");
  std::vector<float> lg(8), ls(2);
  std::vector<int32_t> tg = {0, 4};
  EXPECT_THROW_MSG(ops->classification_loss(T(ls, {2}), T(lg, {2, 4}), I32(tg, {2}), 0.0f, 1.0f),
                   Error, "classification_loss: target 4 of row 1 is outside [0, 4)");
  EXPECT_THROW_MSG(ops->lstm_forward(T(y, {2, 4, 5}), T(sums, {4, 2, 30}), T(x, {2, 4, 3}),
                                     T(w, {20, 3}), T(w, {20, 4}), T(g, {20}), T(g, {20})),
                   Error, "lstm_forward: weight_hh has shape [20, 4], expected [20, 5]");
}

}  // namespace
