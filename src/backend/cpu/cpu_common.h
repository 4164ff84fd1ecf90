// What the CPU backend's op-family files share: a vectorizable exp and the softmax row helpers
// built on it (cpu_attention.cpp, cpu_cross_entropy.cpp), dropout applied through the Philox
// masks of core/philox.h (cpu_encoder.cpp, cpu_elementwise.cpp), and the per-thread channel
// slices that keep every reduction over rows race-free and in a fixed order.
#pragma once

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "core/philox.h"

namespace shardtrain::cpu {

/// exp(x) to ~2 ulp for x in [-87, 88] (exp(-87) ≈ 1.6e-38 stands in for anything smaller):
/// Cody–Waite range reduction x = n·ln2 + r, then Cephes' degree-6 polynomial for e^r, then
/// scaling by 2^n through the exponent bits. Written so that GCC vectorizes loops over it
/// (libm's scalar expf dominated the vocabulary softmax: 51 M calls per GPT-2 step at T=128).
inline float vexp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const auto bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

/// Σ exp(row[j] - maxv) over j < n, writing the exponentials to `out` when non-null.
inline float exp_sum(const float* row, float* out, int64_t n, float maxv) {
  float sum = 0.f;
  if (out) {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      out[j] = vexp(row[j] - maxv);
      sum += out[j];
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) sum += vexp(row[j] - maxv);
  }
  return sum;
}

inline float row_max(const float* row, int64_t n) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
  return m;
}

/// dst[j] = src[j] · multiplier of element base + j (dst may alias src).
inline void apply_dropout(float* dst, const float* src, const Dropout& d, uint64_t base,
                          int64_t n) {
  const uint32_t thresh = d.threshold();
  const float keep_scale = d.scale();
  Philox4x32 r{};
  uint64_t group = ~uint64_t{0};
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t idx = base + static_cast<uint64_t>(j);
    if ((idx >> 2) != group) {
      group = idx >> 2;
      r = d.bits4(idx);
    }
    dst[j] = r.v[idx & 3] >= thresh ? src[j] * keep_scale : 0.0f;
  }
}

/// apply_dropout over elements [0, n), in parallel.
inline void apply_dropout_parallel(float* dst, const float* src, const Dropout& d, int64_t n) {
  constexpr int64_t kChunk = 4096;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c) {
    const int64_t lo = c * kChunk;
    apply_dropout(dst + lo, src + lo, d, static_cast<uint64_t>(lo), std::min(kChunk, n - lo));
  }
}

/// Runs fn(c0, c1) on every OpenMP thread with its own slice [c0, c1) of [0, C): reductions over
/// rows into per-channel sums then never race, and each sum is taken in a fixed row order.
template <typename F>
void for_channel_slices(int64_t C, F&& fn) {
#pragma omp parallel
  {
    const int nth = omp_get_num_threads(), id = omp_get_thread_num();
    fn(C * id / nth, C * (id + 1) / nth);
  }
}

}  // namespace shardtrain::cpu
