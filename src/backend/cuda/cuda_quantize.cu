// Blockwise symmetric int8 quantization (Backend::quantize_int8 / dequantize_add_int8): ZeRO++'s
// qgZ (arXiv 2306.10209 §3.3) sends gradients across nodes as int8 with one fp32 scale per block.
// One thread block of kQuantBlock threads per quantization block: each thread holds one element,
// the block's max |x| comes from a warp-shuffle reduction, thread 0 writes the scale.
#include <cmath>

#include "backend/cuda/cuda_ops.h"

namespace shardtrain::cuda {
namespace {

static_assert(kQuantBlock == 256, "one thread per element of a 256-element block");

template <typename T>
__global__ void quantize_int8_kernel(int8_t* q, float* scales, const T* x, int64_t n) {
  __shared__ float warp_max[kQuantBlock / 32];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kQuantBlock + threadIdx.x;
  const float v = i < n ? to_float(x[i]) : 0.0f;
  float m = fabsf(v);
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kQuantBlock / 32 ? warp_max[threadIdx.x] : 0.0f;
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (threadIdx.x == 0) warp_max[0] = m;
  }
  __syncthreads();
  const float s = warp_max[0] / 127.0f;
  if (threadIdx.x == 0) scales[blockIdx.x] = s;
  if (i < n) {
    const float r = s > 0 ? nearbyintf(v / s) : 0.0f;
    q[i] = static_cast<int8_t>(fminf(fmaxf(r, -127.0f), 127.0f));
  }
}

template <typename T>
__global__ void dequantize_add_int8_kernel(T* out, const int8_t* q, const float* scales,
                                           int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = from_float<T>(to_float(out[i]) + static_cast<float>(q[i]) * scales[i / kQuantBlock]);
}

}  // namespace

void quantize_int8(const CudaContext& ctx, Tensor q, Tensor scales, Tensor x) {
  const int64_t n = x.numel(), blocks = (n + kQuantBlock - 1) / kQuantBlock;
  if (q.numel() != n || scales.numel() != blocks)
    throw RuntimeFailure("cuda quantize_int8: q must have x's elements and scales one per block");
  if (n == 0) return;
  dispatch_float(x.dtype, [&]<typename T>() {
    quantize_int8_kernel<T><<<static_cast<unsigned>(blocks), kQuantBlock, 0, ctx.stream>>>(
        static_cast<int8_t*>(q.data), scales.as<float>(), x.as<T>(), n);
    ST_CUDA_LAUNCH_CHECK();
  });
}

void dequantize_add_int8(const CudaContext& ctx, Tensor out, Tensor q, Tensor scales) {
  const int64_t n = out.numel();
  if (q.numel() != n || scales.numel() != (n + kQuantBlock - 1) / kQuantBlock)
    throw RuntimeFailure(
        "cuda dequantize_add_int8: q must have out's elements and scales one per block");
  if (n == 0) return;
  dispatch_float(out.dtype, [&]<typename T>() {
    dequantize_add_int8_kernel<T><<<ceil_div(static_cast<size_t>(n), 256), 256, 0, ctx.stream>>>(
        out.as<T>(), static_cast<const int8_t*>(q.data), scales.as<float>(), n);
    ST_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace shardtrain::cuda
