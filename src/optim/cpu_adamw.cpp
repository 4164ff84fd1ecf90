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

void adamw_scalar(float* p, const void* g, DType gdt, float* m, float* v, void* out, DType odt,
                  int64_t begin, int64_t end, const Backend::AdamWArgs& a) {
  for (int64_t i = begin; i < end; ++i) {
    const float gi = load_scalar(g, gdt, i) * a.grad_scale;
    const float mi = a.beta1 * m[i] + (1.0f - a.beta1) * gi;
    const float vi = a.beta2 * v[i] + (1.0f - a.beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
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

__attribute__((target("avx2,fma,f16c"))) void adamw_avx2(float* p, const void* g, DType gdt,
                                                         float* m, float* v, void* out, DType odt,
                                                         int64_t begin, int64_t end,
                                                         const Backend::AdamWArgs& a) {
  const __m256 scale = _mm256_set1_ps(a.grad_scale), b1 = _mm256_set1_ps(a.beta1),
               b2 = _mm256_set1_ps(a.beta2), c1 = _mm256_set1_ps(1.0f - a.beta1),
               c2 = _mm256_set1_ps(1.0f - a.beta2), bc1 = _mm256_set1_ps(a.bias_correction1),
               bc2 = _mm256_set1_ps(a.bias_correction2), eps = _mm256_set1_ps(a.eps),
               lr = _mm256_set1_ps(a.lr), wd = _mm256_set1_ps(a.weight_decay);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 gi = _mm256_mul_ps(load8(g, gdt, i), scale);
    const __m256 mi = _mm256_fmadd_ps(b1, _mm256_loadu_ps(m + i), _mm256_mul_ps(c1, gi));
    const __m256 vi =
        _mm256_fmadd_ps(b2, _mm256_loadu_ps(v + i), _mm256_mul_ps(c2, _mm256_mul_ps(gi, gi)));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_div_ps(vi, bc2)), eps);
    const __m256 pi = _mm256_loadu_ps(p + i);
    const __m256 update = _mm256_fmadd_ps(wd, pi, _mm256_div_ps(_mm256_div_ps(mi, bc1), denom));
    const __m256 np = _mm256_fnmadd_ps(lr, update, pi);
    _mm256_storeu_ps(p + i, np);
    if (out) store8(out, odt, i, np);
  }
  adamw_scalar(p, g, gdt, m, v, out, odt, i, end, a);
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

__attribute__((target("avx512f,avx512bw"))) void adamw_avx512(float* p, const void* g, DType gdt,
                                                              float* m, float* v, void* out,
                                                              DType odt, int64_t begin, int64_t end,
                                                              const Backend::AdamWArgs& a) {
  const __m512 scale = _mm512_set1_ps(a.grad_scale), b1 = _mm512_set1_ps(a.beta1),
               b2 = _mm512_set1_ps(a.beta2), c1 = _mm512_set1_ps(1.0f - a.beta1),
               c2 = _mm512_set1_ps(1.0f - a.beta2), bc1 = _mm512_set1_ps(a.bias_correction1),
               bc2 = _mm512_set1_ps(a.bias_correction2), eps = _mm512_set1_ps(a.eps),
               lr = _mm512_set1_ps(a.lr), wd = _mm512_set1_ps(a.weight_decay);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 gi = _mm512_mul_ps(load16(g, gdt, i), scale);
    const __m512 mi = _mm512_fmadd_ps(b1, _mm512_loadu_ps(m + i), _mm512_mul_ps(c1, gi));
    const __m512 vi =
        _mm512_fmadd_ps(b2, _mm512_loadu_ps(v + i), _mm512_mul_ps(c2, _mm512_mul_ps(gi, gi)));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(_mm512_div_ps(vi, bc2)), eps);
    const __m512 pi = _mm512_loadu_ps(p + i);
    const __m512 update = _mm512_fmadd_ps(wd, pi, _mm512_div_ps(_mm512_div_ps(mi, bc1), denom));
    const __m512 np = _mm512_fnmadd_ps(lr, update, pi);
    _mm512_storeu_ps(p + i, np);
    if (out) store16(out, odt, i, np);
  }
  adamw_scalar(p, g, gdt, m, v, out, odt, i, end, a);
}

}  // namespace

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
  const auto ok = [](DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; };
  ST_ASSERT(ok(grad_dtype) && ok(out_dtype));
  ST_ASSERT(static_cast<int>(simd) <= static_cast<int>(best_cpu_simd()));
  // Blocks of 64 Ki elements (a multiple of 16), handed out dynamically: the step shares the
  // cores with the thread feeding the GPU (and on one rank per GPU, with other ranks), so equal
  // static parts would make the whole team wait for the one that lost its core.
  constexpr int64_t kBlock = int64_t{1} << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    switch (simd) {
      case CpuSimd::kAvx512:
        adamw_avx512(master, grad, grad_dtype, m, v, params_out, out_dtype, begin, end, args);
        break;
      case CpuSimd::kAvx2:
        adamw_avx2(master, grad, grad_dtype, m, v, params_out, out_dtype, begin, end, args);
        break;
      case CpuSimd::kScalar:
        adamw_scalar(master, grad, grad_dtype, m, v, params_out, out_dtype, begin, end, args);
        break;
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
