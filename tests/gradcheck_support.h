// Helpers shared by the finite-difference gradient checks (test_gradcheck, test_image_ops,
// test_image_blocks): uniform random inputs, CPU fp32 tensor views and the central-difference
// comparison.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"

namespace shardtrain::test_support {

/// n values uniform in [-scale, scale), from SplitMix64 seeded with `seed`.
inline std::vector<float> random_uniform(size_t n, uint64_t seed, float scale = 1.0f) {
  SplitMix64 g{seed};
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>((g.uniform() * 2.0 - 1.0) * scale);
  return v;
}

/// A CPU fp32 tensor over `v`.
inline Tensor cpu_tensor(std::vector<float>& v, std::initializer_list<int64_t> dims) {
  return Tensor(v.data(), DType::kF32, DeviceKind::kCPU, dims);
}

/// Σ a·b in double.
inline double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

/// Compares the analytic d(objective)/d(x) with central differences of `objective` (step h) at
/// up to `entries` evenly spaced entries of x: |analytic − numeric| ≤ atol + rtol·|numeric|.
/// Prints the largest error. x is restored.
inline void expect_grad_close(std::vector<float>& x, const std::vector<float>& analytic,
                              const std::function<double()>& objective, const std::string& what,
                              float h, double rtol, double atol, size_t entries = 40) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  const size_t step = std::max<size_t>(1, x.size() / entries);
  double max_err = 0, max_num = 0;
  int checked = 0;
  for (size_t i = 0; i < x.size(); i += step) {
    const float orig = x[i];
    x[i] = orig + h;
    const double lp = objective();
    x[i] = orig - h;
    const double lm = objective();
    x[i] = orig;
    const double numeric = (lp - lm) / (2.0 * static_cast<double>(h));
    EXPECT_NEAR(analytic[i], numeric, atol + rtol * std::abs(numeric)) << what << " element " << i;
    max_err = std::max(max_err, std::abs(analytic[i] - numeric));
    max_num = std::max(max_num, std::abs(numeric));
    ++checked;
  }
  EXPECT_GT(checked, 0);
  std::printf("  gradcheck %-40s %3d entries, max |analytic - numeric| = %.2e (max |grad| %.2e)\n",
              what.c_str(), checked, max_err, max_num);
}

}  // namespace shardtrain::test_support
