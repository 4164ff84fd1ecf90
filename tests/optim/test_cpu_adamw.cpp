// The CPU AdamW of offload (optim/cpu_adamw.h): every SIMD path this machine has, and the scalar
// path, equal a double-precision reference of the update (≤ 1e-6 relative, the bar) for
// every gradient and output dtype, and write the updated weights rounded to nearest even.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

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

TEST(CpuAdamW, EveryPathMatchesTheReference) {
  constexpr int64_t n = 4099;  // not a multiple of any vector width: the tails run too
  std::vector<CpuSimd> paths{CpuSimd::kScalar};
  if (best_cpu_simd() >= CpuSimd::kAvx2) paths.push_back(CpuSimd::kAvx2);
  if (best_cpu_simd() >= CpuSimd::kAvx512) paths.push_back(CpuSimd::kAvx512);
  std::printf("  SIMD paths tested: scalar%s%s\n", paths.size() > 1 ? ", avx2" : "",
              paths.size() > 2 ? ", avx512" : "");
  for (CpuSimd simd : paths) {
    for (DType gdt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (DType odt : {DType::kF32, DType::kBF16, DType::kF16}) {
        SplitMix64 rng{0xada + static_cast<uint64_t>(simd) * 97 + static_cast<uint64_t>(gdt) * 7 +
                       static_cast<uint64_t>(odt)};
        const auto normal = [&] {
          return static_cast<float>(std::sqrt(-2 * std::log(1 - rng.uniform())) *
                                    std::cos(6.283185307179586 * rng.uniform()));
        };
        std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
        for (auto& x : p) x = 0.02f * normal();
        std::vector<double> rp(p.begin(), p.end()), rm(n, 0.0), rv(n, 0.0);
        std::vector<uint16_t> g16(n), out16(n);
        std::vector<float> g32(n), out32(n);
        Backend::AdamWArgs a{};
        a.lr = 1e-3f;
        a.beta1 = 0.9f;
        a.beta2 = 0.999f;
        a.eps = 1e-8f;
        a.weight_decay = 0.1f;
        a.grad_scale = 0.5f;
        for (int step = 1; step <= 3; ++step) {
          a.bias_correction1 = 1.0f - std::pow(0.9f, static_cast<float>(step));
          a.bias_correction2 = 1.0f - std::pow(0.999f, static_cast<float>(step));
          std::vector<double> g(n);
          for (int64_t i = 0; i < n; ++i) {
            const float x = normal();
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

}  // namespace
}  // namespace shardtrain

// Asking for more host memory than there is fails with the numbers and the fix, not a crash.
TEST(HostMemory, TooLargeAPinnedRequestNamesTheNumbersAndTheFix) {
  auto backend = shardtrain::make_cpu_backend();
  try {
    backend->allocate_pinned(size_t{1} << 60);
    ADD_FAILURE() << "expected RuntimeFailure";
  } catch (const shardtrain::RuntimeFailure& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("1073741824.00 GiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("available"), std::string::npos) << msg;
    EXPECT_NE(msg.find("offload_optimizer.ratio"), std::string::npos) << msg;
  }
  EXPECT_EQ(backend->pinned_bytes(), 0u);
  EXPECT_GT(shardtrain::available_host_bytes(), 0);
}
