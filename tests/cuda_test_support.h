// The fixtures and host helpers of the CUDA backend tests (tests/backend/test_cuda_backend.cpp,
// tests/backend/test_cuda_model.cpp): random inputs, uploads and downloads, comparisons, a CUDA backend
// per test in fp32 or bf16 beside the CPU reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "memory/flat_buffer.h"
#include "model/gpt2.h"
#include "stage_parts.h"

using namespace shardtrain;

namespace cuda_test {

// ---- host helpers ------------------------------------------------------------------------------

/// Uniform in [offset - scale, offset + scale).
inline std::vector<float> randu(size_t n, uint64_t seed, float scale = 1.0f, float offset = 0.0f) {
  SplitMix64 g{seed};
  std::vector<float> v(n);
  for (auto& x : v) x = offset + static_cast<float>((g.uniform() * 2.0 - 1.0) * scale);
  return v;
}

inline std::vector<int32_t> randi(size_t n, uint64_t seed, int32_t bound) {
  SplitMix64 g{seed};
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(g.below(static_cast<uint64_t>(bound)));
  return v;
}

/// fp32 -> bf16 -> fp32 with round-to-nearest-even (NaN kept NaN): the reference for convert().
inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

inline Tensor host(std::vector<float>& v, std::initializer_list<int64_t> dims) {
  return Tensor(v.data(), DType::kF32, DeviceKind::kCPU, dims);
}
inline Tensor host_i32(std::vector<int32_t>& v, std::initializer_list<int64_t> dims) {
  return Tensor(v.data(), DType::kI32, DeviceKind::kCPU, dims);
}
inline Tensor dev(const FlatBuffer& f, std::initializer_list<int64_t> dims) {
  return Tensor(f.data(), f.dtype(), DeviceKind::kCUDA, dims);
}

/// Host fp32 values into a new device buffer of dtype `dt` (converted on the device).
inline FlatBuffer upload(Backend& g, const std::vector<float>& h, DType dt) {
  const auto n = static_cast<int64_t>(h.size());
  FlatBuffer f32(g, DType::kF32, n);
  g.copy_from_host(f32.data(), h.data(), h.size() * sizeof(float));
  if (dt == DType::kF32) return f32;
  FlatBuffer out(g, dt, n);
  g.convert(out.view(), f32.view());
  return out;
}

inline FlatBuffer upload_i32(Backend& g, const std::vector<int32_t>& h) {
  FlatBuffer f(g, DType::kI32, static_cast<int64_t>(h.size()));
  g.copy_from_host(f.data(), h.data(), h.size() * sizeof(int32_t));
  return f;
}

/// Device tensor (any float dtype) -> host fp32.
inline std::vector<float> download(Backend& g, const Tensor& t) {
  std::vector<float> h(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::kF32) {
    g.copy_to_host(h.data(), t.data, t.bytes());
  } else {
    FlatBuffer tmp(g, DType::kF32, t.numel());
    g.convert(tmp.view(), t.reshape({t.numel()}));
    g.copy_to_host(h.data(), tmp.data(), tmp.bytes());
  }
  return h;
}
inline std::vector<float> download(Backend& g, const FlatBuffer& f) {
  return download(g, f.view());
}

/// Every element within atol + rtol·|want|, where atol = atol_frac · max|want| (the absolute
/// part covers elements that are small through cancellation, whose relative error is
/// meaningless). NaN must match NaN.
inline void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rtol,
                         double atol_frac, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double maxw = 0;
  for (float w : want)
    if (std::isfinite(w)) maxw = std::max(maxw, static_cast<double>(std::fabs(w)));
  const double atol = atol_frac * maxw;
  size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    bool ok;
    double excess = 0;
    if (std::isnan(w) || std::isnan(g)) {
      ok = std::isnan(w) && std::isnan(g);
      excess = ok ? 0 : std::numeric_limits<double>::infinity();
    } else {
      const double d = std::fabs(g - w), lim = atol + rtol * std::fabs(w);
      ok = d <= lim;
      excess = d - lim;
    }
    if (!ok) {
      ++bad;
      if (excess > worst_excess) {
        worst_excess = excess;
        worst = i;
      }
    }
  }
  if (bad)
    ADD_FAILURE() << what << ": " << bad << " of " << got.size()
                  << " elements out of tolerance (rtol " << rtol << ", atol " << atol
                  << "); worst at [" << worst << "]: got " << got[worst] << ", want "
                  << want[worst];
}

inline double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return aa == 0 && bb == 0 ? 1.0 : ab / std::sqrt(aa * bb);
}

inline bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) {
  return dtype_name(info.param);
}

// ---- fixtures ----------------------------------------------------------------------------------

/// Sets an environment variable for the object's lifetime, then restores the previous value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      had_ = true;
      old_ = old;
    }
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_)
      ::setenv(name_.c_str(), old_.c_str(), 1);
    else
      ::unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

/// One CUDA backend per test in the compute dtype of the parameter, plus the CPU reference.
class CudaOpTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU visible (or built without CUDA)";
    cpu = make_cpu_backend();
    ScopedEnv env("SHARDTRAIN_ATTENTION", "materialized");  // the flash tests cover the default
    gpu = make_cuda_backend(0, GetParam());
  }

  DType dt() const { return GetParam(); }
  bool fp32() const { return GetParam() == DType::kF32; }
  /// Relative tolerance: `tight` in fp32 mode; 2e-2 in bf16 mode (results rounded to 8 bits).
  double rtol(double tight) const { return fp32() ? tight : 2e-2; }
  /// Absolute tolerance as a fraction of max|want|: `tight` in fp32 mode, 2e-3 in bf16 mode.
  double atol(double tight) const { return fp32() ? tight : 2e-3; }

  /// Device buffer in the compute dtype holding `h` (rounded to it).
  FlatBuffer up(const std::vector<float>& h) { return upload(*gpu, h, dt()); }
  /// `h` as the compute dtype represents it: what the CPU reference must be fed.
  std::vector<float> rounded(const std::vector<float>& h) {
    if (fp32()) return h;
    return download(*gpu, up(h));
  }
  std::vector<float> down(const FlatBuffer& f) { return download(*gpu, f); }
  std::vector<float> down(const Tensor& t) { return download(*gpu, t); }

  std::unique_ptr<Backend> cpu, gpu;
};

/// A CUDA backend in fp32 mode only (allocator, conversion, error paths).
class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU visible (or built without CUDA)";
    cpu = make_cpu_backend();
    gpu = make_cuda_backend(0, DType::kF32);
  }
  std::unique_ptr<Backend> cpu, gpu;
};

}  // namespace cuda_test

using namespace cuda_test;
