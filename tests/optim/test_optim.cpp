// AdamW against values computed by hand from the update rule, weight-decay masking by the
// layout, and the learning-rate schedule.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/backend.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"

using namespace shardtrain;

namespace {
Tensor view(std::vector<float>& v) {
  return Tensor(v.data(), DType::kF32, DeviceKind::kCPU, {static_cast<int64_t>(v.size())});
}
}  // namespace

TEST(AdamW, TwoStepsMatchHandComputedValues) {
  auto be = make_cpu_backend();
  ParamLayout layout;
  layout.add_layer("l", {ParamTensor{.name = "w", .shape = {2}, .weight_decay = true},
                         ParamTensor{.name = "b", .shape = {1}}});
  // w at [0,2), padding, b at [16,17).
  ASSERT_EQ(layout.find("b")->offset, 16);
  const int64_t n = layout.numel();
  std::vector<float> p(static_cast<size_t>(n), 0.f), g(static_cast<size_t>(n), 0.f);
  p[0] = 1.0f, p[1] = -2.0f, p[16] = 0.5f;
  AdamWHyper h{0.9, 0.999, 1e-8, 0.1};
  AdamW opt(*be, layout, 0, n, h);

  // Step 1: g = (0.2, -0.4, 1.0) scaled by 0.5 → (0.1, -0.2, 0.5).
  g[0] = 0.2f, g[1] = -0.4f, g[16] = 1.0f;
  opt.step(view(p), view(g), Tensor(), 0.01, 0.5);
  // m = 0.1 g, v = 0.001 g²; m̂ = g, v̂ = g² → update = lr·(sign(g) + wd·p) for decayed tensors.
  EXPECT_NEAR(p[0], 1.0 - 0.01 * (0.1 / (0.1 + 1e-8) + 0.1 * 1.0), 1e-6);
  EXPECT_NEAR(p[1], -2.0 - 0.01 * (-0.2 / (0.2 + 1e-8) + 0.1 * -2.0), 1e-6);
  EXPECT_NEAR(p[16], 0.5 - 0.01 * (0.5 / (0.5 + 1e-8)), 1e-6);  // bias: no decay
  EXPECT_EQ(p[5], 0.f);                                         // padding stays zero

  // Step 2 with g = (0.3, ...) scale 1: hand-computed m, v with bias correction at t = 2.
  const double w0 = p[0];
  g[0] = 0.3f;
  opt.step(view(p), view(g), Tensor(), 0.02, 1.0);
  const double m = 0.9 * (0.1 * 0.1) + 0.1 * 0.3;
  const double v = 0.999 * (0.001 * 0.01) + 0.001 * 0.09;
  const double mhat = m / (1 - 0.81), vhat = v / (1 - 0.999 * 0.999);
  EXPECT_NEAR(p[0], w0 - 0.02 * (mhat / (std::sqrt(vhat) + 1e-8) + 0.1 * w0), 1e-6);
  EXPECT_EQ(opt.step_count(), 2);
}

TEST(AdamW, ShardOfTheLayoutDecaysTheSameElements) {
  auto be = make_cpu_backend();
  ParamLayout layout;
  layout.add_layer("a", {ParamTensor{.name = "w", .shape = {20}, .weight_decay = true},
                         ParamTensor{.name = "b", .shape = {20}}});
  const int64_t n = layout.numel();
  std::vector<float> full(static_cast<size_t>(n), 1.0f), grads(static_cast<size_t>(n), 0.f);
  AdamWHyper h{0.9, 0.999, 1e-8, 0.5};
  AdamW whole(*be, layout, 0, n, h);
  whole.step(view(full), view(grads), Tensor(), 0.1, 1.0);
  // The same update computed in two shards that split tensors mid-way.
  std::vector<float> a(10, 1.0f), b(static_cast<size_t>(n - 10), 1.0f);
  std::vector<float> ga(10, 0.f), gb(static_cast<size_t>(n - 10), 0.f);
  AdamW s0(*be, layout, 0, 10, h), s1(*be, layout, 10, n - 10, h);
  s0.step(view(a), view(ga), Tensor(), 0.1, 1.0);
  s1.step(view(b), view(gb), Tensor(), 0.1, 1.0);
  for (int64_t i = 0; i < n; ++i)
    EXPECT_EQ(full[static_cast<size_t>(i)],
              i < 10 ? a[static_cast<size_t>(i)] : b[static_cast<size_t>(i - 10)])
        << i;
  EXPECT_FLOAT_EQ(full[0], 1.0f - 0.1f * 0.5f);                          // decayed weight
  EXPECT_EQ(full[static_cast<size_t>(layout.find("b")->offset)], 1.0f);  // bias untouched
}

TEST(LearningRate, WarmupThenCosineAndLinear) {
  const double lr = 1e-3;
  EXPECT_DOUBLE_EQ(learning_rate(0, lr, 10, 110, LrSchedule::kCosine, 0.1), lr * 1 / 10);
  EXPECT_DOUBLE_EQ(learning_rate(9, lr, 10, 110, LrSchedule::kCosine, 0.1), lr);
  EXPECT_DOUBLE_EQ(learning_rate(10, lr, 10, 110, LrSchedule::kCosine, 0.1), lr);
  EXPECT_NEAR(learning_rate(60, lr, 10, 110, LrSchedule::kCosine, 0.1), 0.55e-3, 1e-12);
  EXPECT_NEAR(learning_rate(110, lr, 10, 110, LrSchedule::kCosine, 0.1), 1e-4, 1e-12);
  EXPECT_NEAR(learning_rate(60, lr, 10, 110, LrSchedule::kLinear, 0.0), 0.5e-3, 1e-12);
  EXPECT_DOUBLE_EQ(learning_rate(100, lr, 10, 110, LrSchedule::kConstant, 0.0), lr);
  EXPECT_DOUBLE_EQ(learning_rate(0, lr, 0, 110, LrSchedule::kConstant, 0.0), lr);
  // DeepSpeed's warmup_min_lr: warmup starts from a fraction of lr.
  EXPECT_NEAR(learning_rate(0, lr, 10, 110, LrSchedule::kCosine, 0.1, 0.5), lr * 0.55, 1e-15);
}

// A scaler restored from another's state continues exactly as the original would.
TEST(LossScaler, RestoredStateContinuesTheSameSchedule) {
  LossScaleConfig c;
  c.loss_scale_window = 3;
  c.hysteresis = 2;
  LossScaler a(c, true), b(c, true);
  const bool outcomes[] = {true, false, false, true, true, false, false, false, true, false};
  for (int i = 0; i < 5; ++i) a.update(outcomes[i]);
  b.restore(a.state());
  for (int i = 5; i < 10; ++i) {
    EXPECT_EQ(a.update(outcomes[i]), b.update(outcomes[i]));
    EXPECT_EQ(a.scale(), b.scale()) << "step " << i;
    EXPECT_EQ(a.skipped_steps(), b.skipped_steps());
  }
  LossScaler off(c, false);
  off.restore(a.state());  // disabled scalers ignore it
  EXPECT_EQ(off.scale(), 1.0);
}

TEST(LossScaler, DeepSpeedDynamicScaling) {
  LossScaleConfig c;
  c.initial_scale_power = 4;  // 16
  c.loss_scale_window = 3;
  c.hysteresis = 2;
  c.min_loss_scale = 2;
  LossScaler s(c, true);
  EXPECT_EQ(s.scale(), 16.0);
  EXPECT_TRUE(s.update(true));  // first overflow: hysteresis budget 2 -> 1, scale kept
  EXPECT_EQ(s.scale(), 16.0);
  EXPECT_TRUE(s.update(true));  // budget exhausted: halve
  EXPECT_EQ(s.scale(), 8.0);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 4.0);
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 2.0);  // clamped at min_loss_scale
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 2.0);
  EXPECT_FALSE(s.update(false));  // third clean step in a row: double
  EXPECT_EQ(s.scale(), 4.0);
  EXPECT_EQ(s.skipped_steps(), 5);
  LossScaler off(c, false);
  EXPECT_EQ(off.scale(), 1.0);
  EXPECT_FALSE(off.update(true));
}
