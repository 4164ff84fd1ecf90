// Blockwise symmetric int8 quantization on the CPU (Backend::quantize_int8 / dequantize_add_int8),
// the reference of cuda_quantize.cu: one fp32 scale (max |x| / 127) per kQuantBlock elements, as
// ZeRO++'s qgZ (arXiv 2306.10209 §3.3) sends gradients across nodes.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cpu/cpu_ops.h"

namespace shardtrain::cpu {

void quantize_int8(Tensor q, Tensor scales, Tensor x) {
  ST_ASSERT(x.dtype == DType::kF32 && q.dtype == DType::kU8 && scales.dtype == DType::kF32);
  const int64_t n = x.numel(), blocks = (n + kQuantBlock - 1) / kQuantBlock;
  ST_ASSERT(q.numel() == n && scales.numel() == blocks);
  const float* in = x.f32();
  auto* out = static_cast<int8_t*>(q.data);
  float* sc = scales.f32();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kQuantBlock, hi = std::min(n, lo + kQuantBlock);
    float amax = 0;
    for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(in[i]));
    const float s = amax / 127.0f;
    sc[b] = s;
    for (int64_t i = lo; i < hi; ++i)
      out[i] = static_cast<int8_t>(s > 0 ? std::clamp(std::nearbyint(in[i] / s), -127.0f, 127.0f)
                                         : 0.0f);
  }
}

void dequantize_add_int8(Tensor out, Tensor q, Tensor scales) {
  ST_ASSERT(out.dtype == DType::kF32 && q.dtype == DType::kU8 && scales.dtype == DType::kF32);
  const int64_t n = out.numel();
  ST_ASSERT(q.numel() == n && scales.numel() == (n + kQuantBlock - 1) / kQuantBlock);
  float* o = out.f32();
  const auto* in = static_cast<const int8_t*>(q.data);
  const float* sc = scales.f32();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) o[i] += static_cast<float>(in[i]) * sc[i / kQuantBlock];
}

}  // namespace shardtrain::cpu
