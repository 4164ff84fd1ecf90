// SGD (torch.optim.SGD with dampening 0: momentum, Nesterov, coupled L2 weight decay) against a
// double-precision loop of PyTorch's formula over several steps, the first step's buffer, the
// weight-decay mask of the layout, the host version (cpu_sgd, offload) against the backend op,
// and the state SGD keeps (no exp_avg_sq).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "optim/adamw.h"
#include "optim/cpu_adamw.h"
#include "parallel/strategy.h"

using namespace shardtrain;

namespace {

Tensor view(std::vector<float>& v) {
  return Tensor(v.data(), DType::kF32, DeviceKind::kCPU, {static_cast<int64_t>(v.size())});
}
Tensor view16(std::vector<uint16_t>& v, DType dt) {
  return Tensor(v.data(), dt, DeviceKind::kCPU, {static_cast<int64_t>(v.size())});
}

/// w [3, 5] (decayed) and b [7] (not decayed): padding between them (the layout aligns tensors).
ParamLayout small_layout() {
  ParamLayout layout;
  layout.add_layer("l", {ParamTensor{.name = "w", .shape = {3, 5}, .weight_decay = true},
                         ParamTensor{.name = "b", .shape = {7}}});
  return layout;
}

OptimizerHyper sgd_hyper(double momentum, bool nesterov, double wd) {
  OptimizerHyper h;
  h.kind = OptimizerKind::kSGD;
  h.momentum = momentum;
  h.nesterov = nesterov;
  h.weight_decay = wd;
  return h;
}

/// torch.optim.SGD's step (PyTorch docs, dampening 0, maximize false) in double, for one element.
struct RefSgd {
  double momentum, wd;
  bool nesterov;
  double buf = 0;
  int t = 0;
  double step(double p, double grad, double lr) {
    double g = grad + wd * p;
    if (momentum != 0) {
      buf = t == 0 ? g : momentum * buf + g;
      g = nesterov ? g + momentum * buf : buf;
    }
    ++t;
    return p - lr * g;
  }
};

}  // namespace

// (a) Several steps with changing learning rates and gradient scales, with and without Nesterov
// and with plain SGD, against the double-precision reference; weight decay only on w.
TEST(Sgd, MatchesPyTorchFormulaOverSeveralSteps) {
  auto be = make_cpu_backend();
  const ParamLayout layout = small_layout();
  const int64_t n = layout.numel();
  const ParamTensor* w = layout.find("w");
  const ParamTensor* b = layout.find("b");
  ASSERT_GT(b->offset, w->offset + w->numel) << "the test wants padding between w and b";
  for (const auto& [momentum, nesterov] :
       std::vector<std::pair<double, bool>>{{0.9, false}, {0.9, true}, {0.0, false}}) {
    SCOPED_TRACE(testing::Message() << "momentum " << momentum << " nesterov " << nesterov);
    const double wd = 0.05;
    Optimizer opt(*be, layout, 0, n, sgd_hyper(momentum, nesterov, wd));
    EXPECT_EQ(opt.exp_avg().numel(), n);
    EXPECT_EQ(opt.exp_avg_sq().numel(), 0);  // SGD keeps no second moment
    SplitMix64 rng{42};
    std::vector<float> p(static_cast<size_t>(n), 0.0f), g(static_cast<size_t>(n), 0.0f);
    std::vector<RefSgd> ref;
    std::vector<double> rp(static_cast<size_t>(n), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const bool real = (i >= w->offset && i < w->offset + w->numel) ||
                        (i >= b->offset && i < b->offset + b->numel);
      const bool decay = i >= w->offset && i < w->offset + w->numel;
      if (real) p[static_cast<size_t>(i)] = static_cast<float>(rng.uniform() - 0.5);
      rp[static_cast<size_t>(i)] = p[static_cast<size_t>(i)];
      ref.push_back(RefSgd{momentum, decay ? wd : 0.0, nesterov});
    }
    const double lrs[] = {0.1, 0.05, 0.2, 0.01, 0.07};
    const double scales[] = {1.0, 0.5, 2.0, 0.25, 1.0};
    for (int s = 0; s < 5; ++s) {
      for (int64_t i = 0; i < n; ++i) {
        const bool real = (i >= w->offset && i < w->offset + w->numel) ||
                          (i >= b->offset && i < b->offset + b->numel);
        g[static_cast<size_t>(i)] = real ? static_cast<float>(rng.uniform() - 0.5) : 0.0f;
      }
      opt.step(view(p), view(g), Tensor(), lrs[s], scales[s]);
      for (int64_t i = 0; i < n; ++i) {
        const auto k = static_cast<size_t>(i);
        rp[k] = ref[k].step(rp[k], static_cast<double>(g[k]) * scales[s], lrs[s]);
      }
    }
    EXPECT_EQ(opt.step_count(), 5);
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<size_t>(i);
      worst = std::max(worst, std::abs(p[k] - rp[k]));
      if (momentum != 0) {
        EXPECT_NEAR(opt.exp_avg().f32()[i], ref[k].buf, 1e-5) << i;
      }
    }
    EXPECT_LT(worst, 1e-5);
    // Padding stays zero (zero gradient, zero weight, no decay).
    EXPECT_EQ(p[static_cast<size_t>(w->offset + w->numel)], 0.0f);
  }
}

// Weight decay is masked by the layout: with zero gradients a decayed weight shrinks by exactly
// PyTorch's factor, a bias does not move.
TEST(Sgd, WeightDecayOnlyOnDecayedTensors) {
  auto be = make_cpu_backend();
  const ParamLayout layout = small_layout();
  const int64_t n = layout.numel();
  std::vector<float> p(static_cast<size_t>(n), 1.0f), g(static_cast<size_t>(n), 0.0f);
  Optimizer opt(*be, layout, 0, n, sgd_hyper(0.9, true, 0.1));
  opt.step(view(p), view(g), Tensor(), 0.5, 1.0);
  // g = wd·p = 0.1, buf = 0.1, d = g + μ·buf = 0.19: p = 1 − 0.5·0.19.
  EXPECT_FLOAT_EQ(p[static_cast<size_t>(layout.find("w")->offset)], 1.0f - 0.5f * 0.19f);
  EXPECT_EQ(p[static_cast<size_t>(layout.find("b")->offset)], 1.0f);
}

// (b) The first step initializes the buffer to the gradient (not μ·0 + g scaled by anything
// else, and not (1 − dampening)·g with a dampening): buf = g·scale + wd·p, and the step is lr·buf.
TEST(Sgd, FirstStepBufferIsTheGradient) {
  auto be = make_cpu_backend();
  ParamLayout layout;
  layout.add_layer("l", {ParamTensor{.name = "w", .shape = {4}, .weight_decay = true}});
  const int64_t n = layout.numel();
  std::vector<float> p(static_cast<size_t>(n), 0.0f), g(static_cast<size_t>(n), 0.0f);
  ASSERT_GE(n, 4);  // padded to the layout's alignment
  const float pv[] = {2.0f, -1.0f, 0.5f, 4.0f}, gv[] = {0.4f, 0.2f, -0.6f, 0.0f};
  std::copy(std::begin(pv), std::end(pv), p.begin());
  std::copy(std::begin(gv), std::end(gv), g.begin());
  const std::vector<float> p0 = p;
  Optimizer opt(*be, layout, 0, n, sgd_hyper(0.8, false, 0.01));
  // A stale buffer (as a previous run would leave) must be overwritten on step 1, not decayed.
  for (int64_t i = 0; i < n; ++i) opt.exp_avg().f32()[i] = 100.0f;
  opt.step(view(p), view(g), Tensor(), 0.1, 0.5);
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(i);
    const float want_buf = g[k] * 0.5f + 0.01f * p0[k];
    EXPECT_FLOAT_EQ(opt.exp_avg().f32()[i], want_buf) << i;
    EXPECT_FLOAT_EQ(p[k], p0[k] - 0.1f * want_buf) << i;
  }
  // Step 2 uses the buffer: buf = μ·buf + g.
  const std::vector<float> p1 = p;
  std::vector<float> buf1(opt.exp_avg().f32(), opt.exp_avg().f32() + n);
  opt.step(view(p), view(g), Tensor(), 0.1, 0.5);
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(i);
    const float gk = g[k] * 0.5f + 0.01f * p1[k];
    EXPECT_NEAR(opt.exp_avg().f32()[i], 0.8f * buf1[k] + gk, 1e-6) << i;
  }
  // A restored step count (resume) continues with the buffer instead of resetting it.
  Optimizer resumed(*be, layout, 0, n, sgd_hyper(0.8, false, 0.0));
  resumed.set_step_count(3);
  for (int64_t i = 0; i < n; ++i) resumed.exp_avg().f32()[i] = 1.0f;
  std::vector<float> q(static_cast<size_t>(n), 0.0f), one(static_cast<size_t>(n), 1.0f);
  resumed.step(view(q), view(one), Tensor(), 1.0, 1.0);
  EXPECT_FLOAT_EQ(resumed.exp_avg().f32()[0], 0.8f * 1.0f + 1.0f);
  EXPECT_FLOAT_EQ(q[0], -1.8f);
}

// (c) The host version (offload's CPU step, optim/cpu_adamw.h) equals the backend op, for fp32
// and bf16/fp16 gradients and parameter copies.
TEST(Sgd, HostStepEqualsTheBackendOp) {
  auto be = make_cpu_backend();
  const ParamLayout layout = small_layout();
  const int64_t n = layout.numel();
  for (bool nesterov : {false, true}) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(testing::Message() << "nesterov " << nesterov << " dtype " << dtype_name(dt));
      const OptimizerHyper h = sgd_hyper(0.9, nesterov, 0.02);
      Optimizer dev(*be, layout, 0, n, h), host(*be, layout, 0, n, h);
      SplitMix64 rng{7};
      std::vector<float> pd(static_cast<size_t>(n)), ph, g32(static_cast<size_t>(n));
      for (float& x : pd) x = static_cast<float>(rng.uniform() - 0.5);
      ph = pd;
      std::vector<uint16_t> g16(static_cast<size_t>(n)), out16(static_cast<size_t>(n));
      std::vector<float> out32(static_cast<size_t>(n));
      for (int s = 0; s < 4; ++s) {
        for (int64_t i = 0; i < n; ++i) {
          const auto k = static_cast<size_t>(i);
          float x = static_cast<float>(rng.uniform() - 0.5);
          if (dt == DType::kBF16) {
            g16[k] = float_to_bf16(x);
            x = bf16_to_float(g16[k]);
          } else if (dt == DType::kF16) {
            g16[k] = float_to_fp16(x);
            x = fp16_to_float(g16[k]);
          }
          g32[k] = x;  // the same values as the 16-bit gradients, exactly
        }
        dev.step(view(pd), view(g32), Tensor(), 0.05, 0.5);
        if (dt == DType::kF32)
          host.step_on_host(view(ph), view(g32), view(out32), 0.05, 0.5);
        else
          host.step_on_host(view(ph), view16(g16, dt), view16(out16, dt), 0.05, 0.5);
      }
      for (int64_t i = 0; i < n; ++i) {
        const auto k = static_cast<size_t>(i);
        EXPECT_NEAR(ph[k], pd[k], 1e-6f * (1.0f + std::abs(pd[k]))) << i;
        EXPECT_NEAR(host.exp_avg().f32()[i], dev.exp_avg().f32()[i], 1e-6f) << i;
        const float out = dt == DType::kF32    ? out32[k]
                          : dt == DType::kBF16 ? bf16_to_float(out16[k])
                                               : fp16_to_float(out16[k]);
        const float want = dt == DType::kF32    ? ph[k]
                           : dt == DType::kBF16 ? bf16_to_float(float_to_bf16(ph[k]))
                                                : fp16_to_float(float_to_fp16(ph[k]));
        EXPECT_EQ(out, want) << i;  // params_out is the master rounded to nearest even
      }
    }
  }
}

TEST(Sgd, BackendOpWritesParamsOutAndLeavesTheBufferAloneWithoutMomentum) {
  auto be = make_cpu_backend();
  std::vector<float> p = {1.0f, 2.0f}, g = {0.5f, -0.5f}, buf = {7.0f, 7.0f}, out = {0.0f, 0.0f};
  Backend::SgdArgs a{};
  a.lr = 0.1f;
  a.momentum = 0.0f;
  a.weight_decay = 0.2f;
  a.grad_scale = 2.0f;
  a.first_step = true;
  be->sgd(view(p), view(g), view(buf), view(out), a);
  EXPECT_FLOAT_EQ(p[0], 1.0f - 0.1f * (1.0f + 0.2f * 1.0f));
  EXPECT_FLOAT_EQ(p[1], 2.0f - 0.1f * (-1.0f + 0.2f * 2.0f));
  EXPECT_EQ(out, p);
  EXPECT_EQ(buf[0], 7.0f);  // momentum 0: plain SGD, no buffer
}

TEST(Sgd, AdamWStateIsNotResumedIntoSgd) {
  EXPECT_NO_THROW(check_state_kind(OptimizerKind::kSGD, OptimizerKind::kSGD));
  try {
    check_state_kind(OptimizerKind::kAdamW, OptimizerKind::kSGD);
    FAIL() << "AdamW state accepted by SGD";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("--optimizer adamw"), std::string::npos) << e.what();
  }
  EXPECT_THROW(check_state_kind(OptimizerKind::kSGD, OptimizerKind::kAdamW), CheckpointError);
}
