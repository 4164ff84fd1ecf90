#include "optim/cpu_adamw.h"

// GCC 12 warns inside its own AVX-512 intrinsics (their masked forms start from an undefined
// vector) when they are compiled through a target attribute: a false positive, reported at the
// header's lines, so the header is included with the warning off.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <type_traits>

#include "core/error.h"
#include "core/half.h"

namespace shardtrain {
namespace {

// ---- scalar ----------------------------------------------------------------------------------

float load_scalar(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16:
      return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

void store_scalar(void* p, DType dt, int64_t i, float x) {
  switch (dt) {
    case DType::kBF16:
      static_cast<uint16_t*>(p)[i] = float_to_bf16(x);
      break;
    case DType::kF16:
      static_cast<uint16_t*>(p)[i] = float_to_fp16(x);
      break;
    default:
      static_cast<float*>(p)[i] = x;
  }
}

// ---- bf16 moments: stochastic rounding --------------------------------------------------------

/// A 32-bit integer hash (lowbias32: Wellons, "Hash function prospector", 2018).
inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

/// The key of the high 32 bits of the indices of one step.
inline uint32_t high_key(uint64_t index, uint32_t step) {
  return hash32(static_cast<uint32_t>(index >> 32) ^ hash32(step * 0x85ebca77u + 0x165667b1u));
}

inline uint32_t random_bits(uint64_t index, uint32_t step) {
  return hash32(static_cast<uint32_t>(index) * 0x9e3779b1u + high_key(index, step));
}

inline uint16_t sr_bf16(float x, uint32_t random) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if ((bits & 0x7f800000u) == 0x7f800000u)  // inf stays inf, NaN stays (quiet) NaN
    return static_cast<uint16_t>((bits >> 16) | ((bits & 0x7fffffu) ? 0x40u : 0u));
  return static_cast<uint16_t>((bits + (random & 0xffffu)) >> 16);
}

inline float from_bf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

/// The AdamW update of elements [begin, end). `M` is how m and v are stored: float, or uint16_t
/// for bf16 moments, read as fp32 and stored rounded stochastically with the bits of
/// (sr.index_base + i, sr.step); the update itself is the same fp32 arithmetic either way.
template <class M>
void adamw_scalar(float* p, const void* g, DType gdt, M* m, M* v, void* out, DType odt,
                  int64_t begin, int64_t end, const Backend::AdamWArgs& a,
                  StochasticRounding sr = {}) {
  constexpr bool kBf16 = std::is_same_v<M, uint16_t>;
  for (int64_t i = begin; i < end; ++i) {
    const float gi = load_scalar(g, gdt, i) * a.grad_scale;
    float m0, v0;
    if constexpr (kBf16) {
      m0 = from_bf16(m[i]);
      v0 = from_bf16(v[i]);
    } else {
      m0 = m[i];
      v0 = v[i];
    }
    const float mi = a.beta1 * m0 + (1.0f - a.beta1) * gi;
    const float vi = a.beta2 * v0 + (1.0f - a.beta2) * gi * gi;
    if constexpr (kBf16) {
      const uint32_t r = random_bits(sr.index_base + static_cast<uint64_t>(i), sr.step);
      m[i] = sr_bf16(mi, r);
      v[i] = sr_bf16(vi, r >> 16);
    } else {
      m[i] = mi;
      v[i] = vi;
    }
    const float mhat = mi / a.bias_correction1, vhat = vi / a.bias_correction2;
    p[i] -= a.lr * (mhat / (std::sqrt(vhat) + a.eps) + a.weight_decay * p[i]);
    if (out) store_scalar(out, odt, i, p[i]);
  }
}

// ---- AVX2 + FMA + F16C: 8 lanes
// ------------------------------------------------------------------

__attribute__((target("avx2,fma,f16c"))) __m256 load8(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kBF16: {
      const __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case DType::kF16:
      return _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
    default:
      return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  }
}

/// fp32 → bf16 with round-to-nearest-even; NaN stays NaN (quiet).
__attribute__((target("avx2,fma,f16c"))) __m128i to_bf16_8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40)),
                         nan);
  // Pack the 8 low halves: 32-bit lanes → 16-bit (values < 65536, unsigned saturation is exact).
  const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  return _mm_packus_epi32(lo, hi);
}

__attribute__((target("avx2,fma,f16c"))) void store8(void* p, DType dt, int64_t i, __m256 x) {
  switch (dt) {
    case DType::kBF16:
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), to_bf16_8(x));
      break;
    case DType::kF16:
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i),
                       _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
      break;
    default:
      _mm256_storeu_ps(static_cast<float*>(p) + i, x);
  }
}

__attribute__((target("avx2,fma,f16c"))) __m256i hash8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/// 8 lanes of sr_bf16 (the random bits in the low 16 bits of each lane of r), as 32-bit lanes.
__attribute__((target("avx2,fma,f16c"))) __m256i sr8(__m256 x, __m256i r) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i out =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_and_si256(r, _mm256_set1_epi32(0xffff))), 16);
  const __m256i expo = _mm256_set1_epi32(0x7f800000);
  const __m256i special = _mm256_cmpeq_epi32(_mm256_and_si256(bits, expo), expo);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i kept =
      _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_and_si256(nan, _mm256_set1_epi32(0x40)));
  return _mm256_blendv_epi8(out, kept, special);
}

__attribute__((target("avx2,fma,f16c"))) __m256 load8_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma,f16c"))) void store8_u16(uint16_t* p, __m256i lanes) {
  const __m128i lo = _mm256_castsi256_si128(lanes), hi = _mm256_extracti128_si256(lanes, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
}

/// adamw_scalar<M> on 8 lanes.
template <class M>
__attribute__((target("avx2,fma,f16c"))) void adamw_avx2(float* p, const void* g, DType gdt, M* m,
                                                         M* v, void* out, DType odt, int64_t begin,
                                                         int64_t end, const Backend::AdamWArgs& a,
                                                         StochasticRounding sr = {}) {
  constexpr bool kBf16 = std::is_same_v<M, uint16_t>;
  const __m256 scale = _mm256_set1_ps(a.grad_scale), b1 = _mm256_set1_ps(a.beta1),
               b2 = _mm256_set1_ps(a.beta2), c1 = _mm256_set1_ps(1.0f - a.beta1),
               c2 = _mm256_set1_ps(1.0f - a.beta2), bc1 = _mm256_set1_ps(a.bias_correction1),
               bc2 = _mm256_set1_ps(a.bias_correction2), eps = _mm256_set1_ps(a.eps),
               lr = _mm256_set1_ps(a.lr), wd = _mm256_set1_ps(a.weight_decay);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256i r{};  // bf16 moments: the lanes' random bits
    if constexpr (kBf16) {
      const uint64_t first = sr.index_base + static_cast<uint64_t>(i);
      const uint32_t key = high_key(first, sr.step);
      if (key != high_key(first + 7, sr.step)) {  // the lanes straddle 2^32: one at a time
        adamw_scalar(p, g, gdt, m, v, out, odt, i, i + 8, a, sr);
        continue;
      }
      const __m256i idx =
          _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first))),
                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      r = hash8(_mm256_add_epi32(
          _mm256_mullo_epi32(idx, _mm256_set1_epi32(static_cast<int>(0x9e3779b1u))),
          _mm256_set1_epi32(static_cast<int>(key))));
    }
    const __m256 gi = _mm256_mul_ps(load8(g, gdt, i), scale);
    __m256 m0, v0;
    if constexpr (kBf16) {
      m0 = load8_bf16(m + i);
      v0 = load8_bf16(v + i);
    } else {
      m0 = _mm256_loadu_ps(m + i);
      v0 = _mm256_loadu_ps(v + i);
    }
    const __m256 mi = _mm256_fmadd_ps(b1, m0, _mm256_mul_ps(c1, gi));
    const __m256 vi = _mm256_fmadd_ps(b2, v0, _mm256_mul_ps(c2, _mm256_mul_ps(gi, gi)));
    if constexpr (kBf16) {
      store8_u16(m + i, sr8(mi, r));
      store8_u16(v + i, sr8(vi, _mm256_srli_epi32(r, 16)));
    } else {
      _mm256_storeu_ps(m + i, mi);
      _mm256_storeu_ps(v + i, vi);
    }
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_div_ps(vi, bc2)), eps);
    const __m256 pi = _mm256_loadu_ps(p + i);
    const __m256 update = _mm256_fmadd_ps(wd, pi, _mm256_div_ps(_mm256_div_ps(mi, bc1), denom));
    const __m256 np = _mm256_fnmadd_ps(lr, update, pi);
    _mm256_storeu_ps(p + i, np);
    if (out) store8(out, odt, i, np);
  }
  adamw_scalar(p, g, gdt, m, v, out, odt, i, end, a, sr);
}

// ---- AVX-512F + BW: 16 lanes
// ---------------------------------------------------------------------

__attribute__((target("avx512f,avx512bw"))) __m512 load16(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kBF16: {
      const __m256i h =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case DType::kF16:
      return _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
    default:
      return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  }
}

__attribute__((target("avx512f,avx512bw"))) void store16(void* p, DType dt, int64_t i, __m512 x) {
  switch (dt) {
    case DType::kBF16: {
      const __m512i bits = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(
          _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      r = _mm512_mask_mov_epi32(
          r, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i),
                          _mm512_cvtepi32_epi16(r));
      break;
    }
    case DType::kF16:
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i),
                          _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
      break;
    default:
      _mm512_storeu_ps(static_cast<float*>(p) + i, x);
  }
}

__attribute__((target("avx512f,avx512bw"))) __m512i hash16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

__attribute__((target("avx512f,avx512bw"))) __m256i sr16(__m512 x, __m512i r) {
  const __m512i bits = _mm512_castps_si512(x);
  __m512i out =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_and_si512(r, _mm512_set1_epi32(0xffff))), 16);
  const __m512i expo = _mm512_set1_epi32(0x7f800000);
  const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, expo), expo);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  out = _mm512_mask_mov_epi32(out, special, _mm512_srli_epi32(bits, 16));
  out = _mm512_mask_or_epi32(out, nan, out, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(out);
}

__attribute__((target("avx512f,avx512bw"))) __m512 load16_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/// adamw_scalar<M> on 16 lanes.
template <class M>
__attribute__((target("avx512f,avx512bw"))) void adamw_avx512(float* p, const void* g, DType gdt,
                                                              M* m, M* v, void* out, DType odt,
                                                              int64_t begin, int64_t end,
                                                              const Backend::AdamWArgs& a,
                                                              StochasticRounding sr = {}) {
  constexpr bool kBf16 = std::is_same_v<M, uint16_t>;
  const __m512 scale = _mm512_set1_ps(a.grad_scale), b1 = _mm512_set1_ps(a.beta1),
               b2 = _mm512_set1_ps(a.beta2), c1 = _mm512_set1_ps(1.0f - a.beta1),
               c2 = _mm512_set1_ps(1.0f - a.beta2), bc1 = _mm512_set1_ps(a.bias_correction1),
               bc2 = _mm512_set1_ps(a.bias_correction2), eps = _mm512_set1_ps(a.eps),
               lr = _mm512_set1_ps(a.lr), wd = _mm512_set1_ps(a.weight_decay);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512i r{};  // bf16 moments: the lanes' random bits
    if constexpr (kBf16) {
      const uint64_t first = sr.index_base + static_cast<uint64_t>(i);
      const uint32_t key = high_key(first, sr.step);
      if (key != high_key(first + 15, sr.step)) {  // the lanes straddle 2^32: one at a time
        adamw_scalar(p, g, gdt, m, v, out, odt, i, i + 16, a, sr);
        continue;
      }
      const __m512i idx =
          _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(first))),
                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      r = hash16(_mm512_add_epi32(
          _mm512_mullo_epi32(idx, _mm512_set1_epi32(static_cast<int>(0x9e3779b1u))),
          _mm512_set1_epi32(static_cast<int>(key))));
    }
    const __m512 gi = _mm512_mul_ps(load16(g, gdt, i), scale);
    __m512 m0, v0;
    if constexpr (kBf16) {
      m0 = load16_bf16(m + i);
      v0 = load16_bf16(v + i);
    } else {
      m0 = _mm512_loadu_ps(m + i);
      v0 = _mm512_loadu_ps(v + i);
    }
    const __m512 mi = _mm512_fmadd_ps(b1, m0, _mm512_mul_ps(c1, gi));
    const __m512 vi = _mm512_fmadd_ps(b2, v0, _mm512_mul_ps(c2, _mm512_mul_ps(gi, gi)));
    if constexpr (kBf16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(m + i), sr16(mi, r));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i), sr16(vi, _mm512_srli_epi32(r, 16)));
    } else {
      _mm512_storeu_ps(m + i, mi);
      _mm512_storeu_ps(v + i, vi);
    }
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(_mm512_div_ps(vi, bc2)), eps);
    const __m512 pi = _mm512_loadu_ps(p + i);
    const __m512 update = _mm512_fmadd_ps(wd, pi, _mm512_div_ps(_mm512_div_ps(mi, bc1), denom));
    const __m512 np = _mm512_fnmadd_ps(lr, update, pi);
    _mm512_storeu_ps(p + i, np);
    if (out) store16(out, odt, i, np);
  }
  adamw_scalar(p, g, gdt, m, v, out, odt, i, end, a, sr);
}

/// The update of n elements on OpenMP's threads, in blocks of 64 Ki elements (a multiple of 16)
/// handed out dynamically: the step shares the cores with the thread feeding the GPU (and on one
/// rank per GPU, with other ranks), so equal static parts would make the whole team wait for
/// the one that lost its core.
template <class M>
void adamw_blocks(float* master, const void* grad, DType grad_dtype, M* m, M* v, void* params_out,
                  DType out_dtype, int64_t n, const Backend::AdamWArgs& args, StochasticRounding sr,
                  CpuSimd simd) {
  const auto ok = [](DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; };
  ST_ASSERT(ok(grad_dtype) && ok(out_dtype));
  ST_ASSERT(static_cast<int>(simd) <= static_cast<int>(best_cpu_simd()));
  constexpr int64_t kBlock = int64_t{1} << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    switch (simd) {
      case CpuSimd::kAvx512:
        adamw_avx512(master, grad, grad_dtype, m, v, params_out, out_dtype, begin, end, args, sr);
        break;
      case CpuSimd::kAvx2:
        adamw_avx2(master, grad, grad_dtype, m, v, params_out, out_dtype, begin, end, args, sr);
        break;
      case CpuSimd::kScalar:
        adamw_scalar(master, grad, grad_dtype, m, v, params_out, out_dtype, begin, end, args, sr);
        break;
    }
  }
}

}  // namespace

uint16_t bf16_stochastic(float x, uint32_t random) { return sr_bf16(x, random); }

uint32_t stochastic_rounding_bits(uint64_t index, uint32_t step) {
  return random_bits(index, step);
}

void cpu_adamw_bf16_moments(float* master, const void* grad, DType grad_dtype, uint16_t* m,
                            uint16_t* v, void* params_out, DType out_dtype, int64_t n,
                            const Backend::AdamWArgs& args, StochasticRounding rounding,
                            CpuSimd simd) {
  adamw_blocks(master, grad, grad_dtype, m, v, params_out, out_dtype, n, args, rounding, simd);
}

CpuSimd best_cpu_simd() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
    return CpuSimd::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return CpuSimd::kAvx2;
  return CpuSimd::kScalar;
}

std::string to_string(CpuSimd simd) {
  switch (simd) {
    case CpuSimd::kAvx512:
      return "avx512";
    case CpuSimd::kAvx2:
      return "avx2";
    case CpuSimd::kScalar:
      break;
  }
  return "scalar";
}

void cpu_adamw(float* master, const void* grad, DType grad_dtype, float* m, float* v,
               void* params_out, DType out_dtype, int64_t n, const Backend::AdamWArgs& args,
               CpuSimd simd) {
  adamw_blocks(master, grad, grad_dtype, m, v, params_out, out_dtype, n, args, {}, simd);
}

void cpu_adamw_undo(float* master, const void* grad, DType grad_dtype, void* m, void* v,
                    DType moment_dtype, int64_t n, const Backend::AdamWArgs& a) {
  ST_ASSERT(moment_dtype == DType::kF32 || moment_dtype == DType::kBF16);
  const bool bf16 = moment_dtype == DType::kBF16;
  const float decay = 1.0f - a.lr * a.weight_decay;
  constexpr int64_t kBlock = int64_t{1} << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    auto* mf = static_cast<float*>(m);
    auto* vf = static_cast<float*>(v);
    auto* mh = static_cast<uint16_t*>(m);
    auto* vh = static_cast<uint16_t*>(v);
    for (int64_t i = begin; i < end; ++i) {
      const float g = load_scalar(grad, grad_dtype, i) * a.grad_scale;
      const float mi = bf16 ? bf16_to_float(mh[i]) : mf[i];
      const float vi = bf16 ? bf16_to_float(vh[i]) : vf[i];
      // p' = p·(1 − lr·wd) − lr·(m'/bc1)/(√(v'/bc2) + eps), m' = β1·m + (1−β1)·g, v' likewise.
      const float step = (mi / a.bias_correction1) / (std::sqrt(vi / a.bias_correction2) + a.eps);
      master[i] = (master[i] + a.lr * step) / decay;
      const float m0 = (mi - (1.0f - a.beta1) * g) / a.beta1;
      const float v0 = std::max(0.0f, (vi - (1.0f - a.beta2) * g * g) / a.beta2);
      if (bf16) {
        mh[i] = float_to_bf16(m0);
        vh[i] = float_to_bf16(v0);
      } else {
        mf[i] = m0;
        vf[i] = v0;
      }
    }
  }
}

void cpu_sgd(float* master, const void* grad, DType grad_dtype, float* buf, void* params_out,
             DType out_dtype, int64_t n, const Backend::SgdArgs& a) {
  const auto ok = [](DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; };
  ST_ASSERT(ok(grad_dtype) && ok(out_dtype));
  const bool use_buf = a.momentum != 0.0f;
  ST_ASSERT(!use_buf || buf != nullptr);
  ST_ASSERT(!a.nesterov || use_buf);
  constexpr int64_t kBlock = int64_t{1} << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    for (int64_t i = begin; i < end; ++i) {
      const float gi = load_scalar(grad, grad_dtype, i) * a.grad_scale + a.weight_decay * master[i];
      float d = gi;
      if (use_buf) {
        const float bi = a.first_step ? gi : a.momentum * buf[i] + gi;
        buf[i] = bi;
        d = a.nesterov ? gi + a.momentum * bi : bi;
      }
      master[i] -= a.lr * d;
      if (params_out) store_scalar(params_out, out_dtype, i, master[i]);
    }
  }
}

}  // namespace shardtrain
