// The CPU AdamW of offload (optim/cpu_adamw.h): every SIMD path this machine has, and the scalar
// path, equal a double-precision reference of the update (≤ 1e-6 relative, the bar) for
// every gradient and output dtype, and write the updated weights rounded to nearest even.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "app/error_report.h"
#include "backend/backend.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "optim/cpu_adamw.h"

namespace shardtrain {
namespace {

double rel_norm(const std::vector<float>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

std::vector<CpuSimd> simd_paths() {
  std::vector<CpuSimd> paths{CpuSimd::kScalar};
  if (best_cpu_simd() >= CpuSimd::kAvx2) paths.push_back(CpuSimd::kAvx2);
  if (best_cpu_simd() >= CpuSimd::kAvx512) paths.push_back(CpuSimd::kAvx512);
  return paths;
}

/// A standard normal draw (Box-Muller) from `rng`.
float normal(SplitMix64& rng) {
  return static_cast<float>(std::sqrt(-2 * std::log(1 - rng.uniform())) *
                            std::cos(6.283185307179586 * rng.uniform()));
}

/// The test's AdamW at step `step` (1-based).
Backend::AdamWArgs adamw_args(int step) {
  Backend::AdamWArgs a{};
  a.lr = 1e-3f;
  a.beta1 = 0.9f;
  a.beta2 = 0.999f;
  a.eps = 1e-8f;
  a.weight_decay = 0.1f;
  a.grad_scale = 0.5f;
  a.bias_correction1 = 1.0f - std::pow(0.9f, static_cast<float>(step));
  a.bias_correction2 = 1.0f - std::pow(0.999f, static_cast<float>(step));
  return a;
}

TEST(CpuAdamW, EveryPathMatchesTheReference) {
  constexpr int64_t n = 4099;  // not a multiple of any vector width: the tails run too
  const std::vector<CpuSimd> paths = simd_paths();
  std::printf("  SIMD paths tested: scalar%s%s\n", paths.size() > 1 ? ", avx2" : "",
              paths.size() > 2 ? ", avx512" : "");
  for (CpuSimd simd : paths) {
    for (DType gdt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (DType odt : {DType::kF32, DType::kBF16, DType::kF16}) {
        SplitMix64 rng{0xada + static_cast<uint64_t>(simd) * 97 + static_cast<uint64_t>(gdt) * 7 +
                       static_cast<uint64_t>(odt)};
        std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
        for (auto& x : p) x = 0.02f * normal(rng);
        std::vector<double> rp(p.begin(), p.end()), rm(n, 0.0), rv(n, 0.0);
        std::vector<uint16_t> g16(n), out16(n);
        std::vector<float> g32(n), out32(n);
        for (int step = 1; step <= 3; ++step) {
          const Backend::AdamWArgs a = adamw_args(step);
          std::vector<double> g(n);
          for (int64_t i = 0; i < n; ++i) {
            const float x = normal(rng);
            if (gdt == DType::kF32) g32[i] = x, g[i] = x;
            if (gdt == DType::kBF16) g16[i] = float_to_bf16(x), g[i] = bf16_to_float(g16[i]);
            if (gdt == DType::kF16) g16[i] = float_to_fp16(x), g[i] = fp16_to_float(g16[i]);
          }
          const void* grad = gdt == DType::kF32 ? static_cast<const void*>(g32.data()) : g16.data();
          void* out = odt == DType::kF32 ? static_cast<void*>(out32.data()) : out16.data();
          cpu_adamw(p.data(), grad, gdt, m.data(), v.data(), out, odt, n, a, simd);
          for (int64_t i = 0; i < n; ++i) {
            const double gi = g[i] * a.grad_scale;
            // The hyper-parameters as the fp32 update sees them (1 − 0.999f is not 0.001).
            rm[i] = double(a.beta1) * rm[i] + double(1.0f - a.beta1) * gi;
            rv[i] = double(a.beta2) * rv[i] + double(1.0f - a.beta2) * gi * gi;
            const double mhat = rm[i] / a.bias_correction1, vhat = rv[i] / a.bias_correction2;
            rp[i] -= a.lr * (mhat / (std::sqrt(vhat) + a.eps) + a.weight_decay * rp[i]);
          }
          const std::string what = to_string(simd) + " grad " + dtype_name(gdt) + " out " +
                                   dtype_name(odt) + " step " + std::to_string(step);
          EXPECT_LE(rel_norm(p, rp), 1e-6) << what;
          EXPECT_LE(rel_norm(m, rm), 1e-6) << what;
          EXPECT_LE(rel_norm(v, rv), 1e-6) << what;
          for (int64_t i = 0; i < n; ++i) {
            if (odt == DType::kF32) {
              ASSERT_EQ(out32[i], p[i]) << what << " at " << i;
            } else if (odt == DType::kBF16) {
              ASSERT_EQ(out16[i], float_to_bf16(p[i])) << what << " at " << i;
            } else {
              ASSERT_EQ(out16[i], float_to_fp16(p[i])) << what << " at " << i;
            }
          }
        }
      }
    }
  }
}

TEST(CpuAdamW, ConversionsRoundToNearestEvenAndKeepNaN) {
  // 1 + 2^-8 lies halfway between two bf16 values: it rounds to the even one (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + 1.0f / 256), float_to_bf16(1.0f));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(fp16_to_float(float_to_fp16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(fp16_to_float(float_to_fp16(1e6f))));
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f + 1.0f / 2048)), 1.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(5.96046448e-08f)), 5.96046448e-08f);  // smallest subnormal
}

// bf16 moments (cpu_adamw_bf16_moments): every path follows the double-precision update within
// what bf16 moments allow, the rounding is unbiased, and how the elements are split into calls
// changes no bit.
TEST(CpuAdamWBf16Moments, EveryPathFollowsTheReference) {
  constexpr int64_t n = 4099;
  for (CpuSimd simd : simd_paths()) {
    SplitMix64 rng{0xb16 + static_cast<uint64_t>(simd)};
    std::vector<float> p(n), g(n), out(n);
    std::vector<uint16_t> m(n, 0), v(n, 0);
    for (auto& x : p) x = 0.02f * normal(rng);
    const std::vector<double> p0(p.begin(), p.end());
    std::vector<double> rp = p0, rm(n, 0.0), rv(n, 0.0);
    for (int step = 1; step <= 20; ++step) {
      const Backend::AdamWArgs a = adamw_args(step);
      for (auto& x : g) x = normal(rng);
      cpu_adamw_bf16_moments(p.data(), g.data(), DType::kF32, m.data(), v.data(), out.data(),
                             DType::kF32, n, a,
                             StochasticRounding{1000, static_cast<uint32_t>(step)}, simd);
      for (int64_t i = 0; i < n; ++i) {
        const double gi = g[i] * a.grad_scale;
        rm[i] = double(a.beta1) * rm[i] + double(1.0f - a.beta1) * gi;
        rv[i] = double(a.beta2) * rv[i] + double(1.0f - a.beta2) * gi * gi;
        rp[i] -=
            a.lr * (rm[i] / a.bias_correction1 / (std::sqrt(rv[i] / a.bias_correction2) + a.eps) +
                    a.weight_decay * rp[i]);
      }
    }
    std::vector<float> mf(n), vf(n);
    for (int64_t i = 0; i < n; ++i) mf[i] = bf16_to_float(m[i]), vf[i] = bf16_to_float(v[i]);
    // bf16 keeps 8 bits: each stored moment is within 2^-7 of its value; over 20 steps the
    // parameters stay within 1% of the distance the fp32-moment trajectory moved them.
    EXPECT_LE(rel_norm(mf, rm), 1e-2) << to_string(simd);
    EXPECT_LE(rel_norm(vf, rv), 1e-2) << to_string(simd);
    double off = 0, moved = 0;
    for (int64_t i = 0; i < n; ++i) {
      off += (p[i] - rp[i]) * (p[i] - rp[i]);
      moved += (rp[i] - p0[i]) * (rp[i] - p0[i]);
    }
    std::printf("  %s: parameters %.2e of the distance moved off the fp32-moment run\n",
                to_string(simd).c_str(), std::sqrt(off / moved));
    EXPECT_LE(std::sqrt(off / moved), 1e-2) << to_string(simd);
    EXPECT_EQ(out, p) << to_string(simd);
  }
}

TEST(CpuAdamWBf16Moments, RoundingIsUnbiased) {
  // Over all 2^16 random values a number rounds up exactly as often as its dropped fraction says:
  // the mean of what is stored is the number itself.
  for (float x : {1.0f + 1.0f / 1024, 3.0e-7f, -2.5f + 1.0f / 4096, 1.0f}) {
    double sum = 0;
    for (uint32_t r = 0; r < 65536; ++r) sum += bf16_to_float(bf16_stochastic(x, r));
    EXPECT_EQ(sum / 65536, static_cast<double>(x)) << x;
  }
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_stochastic(std::nanf(""), 0xffff))));
  EXPECT_TRUE(std::isinf(bf16_to_float(bf16_stochastic(INFINITY, 0xffff))));
  EXPECT_EQ(bf16_to_float(bf16_stochastic(0.0f, 0xffff)), 0.0f);
  // Neighbouring elements and steps draw different bits.
  EXPECT_NE(stochastic_rounding_bits(7, 1), stochastic_rounding_bits(8, 1));
  EXPECT_NE(stochastic_rounding_bits(7, 1), stochastic_rounding_bits(7, 2));
  EXPECT_NE(stochastic_rounding_bits(7, 1), stochastic_rounding_bits(7 + (uint64_t{1} << 32), 1));
}

TEST(CpuAdamWBf16Moments, SplittingTheElementsChangesNoBit) {
  // One call over n elements against two calls over its halves (their flat index given), across
  // a 2^32 boundary of the index: the same bits, whatever the path.
  constexpr int64_t n = 3001, half = 1234;
  const uint64_t base = (uint64_t{1} << 32) - 700;
  for (CpuSimd simd : simd_paths()) {
    SplitMix64 rng{0x5b1 + static_cast<uint64_t>(simd)};
    std::vector<float> p1(n), g(n);
    for (auto& x : p1) x = static_cast<float>(rng.uniform() - 0.5);
    for (auto& x : g) x = static_cast<float>(rng.uniform() - 0.5);
    std::vector<float> p2 = p1;
    std::vector<uint16_t> m1(n, 0), v1(n, 0), m2(n, 0), v2(n, 0);
    for (int step = 1; step <= 3; ++step) {
      const Backend::AdamWArgs a = adamw_args(step);
      const auto t = static_cast<uint32_t>(step);
      cpu_adamw_bf16_moments(p1.data(), g.data(), DType::kF32, m1.data(), v1.data(), nullptr,
                             DType::kF32, n, a, {base, t}, simd);
      cpu_adamw_bf16_moments(p2.data(), g.data(), DType::kF32, m2.data(), v2.data(), nullptr,
                             DType::kF32, half, a, {base, t}, simd);
      cpu_adamw_bf16_moments(p2.data() + half, g.data() + half, DType::kF32, m2.data() + half,
                             v2.data() + half, nullptr, DType::kF32, n - half, a, {base + half, t},
                             simd);
    }
    EXPECT_EQ(p1, p2) << to_string(simd);
    EXPECT_EQ(m1, m2) << to_string(simd);
    EXPECT_EQ(v1, v2) << to_string(simd);
  }
}

}  // namespace
}  // namespace shardtrain

// Asking for more host memory than there is fails with the numbers and the fix, not a crash.
TEST(HostMemory, TooLargeAPinnedRequestNamesTheNumbersAndTheFix) {
  auto backend = shardtrain::make_cpu_backend();
  try {
    backend->allocate_pinned(size_t{1} << 60);
    ADD_FAILURE() << "expected RuntimeFailure";
  } catch (const shardtrain::OutOfMemory& e) {
    // What the user reads: the allocator's numbers, and the fix the command line adds.
    EXPECT_EQ(e.memory(), shardtrain::Memory::kPinnedHost);
    const std::string msg = shardtrain::classify_exception(std::current_exception()).message;
    EXPECT_NE(msg.find("1073741824.00 GiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("available"), std::string::npos) << msg;
    EXPECT_NE(msg.find("offload_optimizer.ratio"), std::string::npos) << msg;
  }
  EXPECT_EQ(backend->pinned_bytes(), 0u);
  EXPECT_GT(shardtrain::available_host_bytes(), 0);
}
