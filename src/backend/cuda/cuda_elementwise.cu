// Element-wise ops of the CUDA backend, one vectorized kernel each (kVec elements per thread with
// 128-bit loads and stores where the pointers allow): dtype conversion, GELU forward/backward
// (tanh approximation), the residual add with fused dropout, dropout's backward, and scaling.
// Every kernel computes in fp32 and rounds once to nearest-even when it stores.
#include <cmath>

#include "backend/cuda/cuda_gelu.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_common.h"

namespace shardtrain::cuda {
namespace {

/// convert: dst[i] = (TD) src[i], i < n; via fp32, round-to-nearest-even into bf16/fp16.
/// (fp32 holds every bf16 and fp16 value exactly, so the detour through fp32 changes nothing.)
template <int K, typename TD, typename TS>
__global__ void convert_kernel(TD* dst, const TS* src, int64_t n) {
  const int64_t base = global_index() * K;
  if (base >= n) return;
  const int cnt = chunk_count<K>(n, base);
  float x[K];
  load_chunk<K>(x, src + base, cnt);
  store_chunk<K>(dst + base, x, cnt);
}

/// gelu_forward, tanh approximation (Hendrycks & Gimpel, arXiv 1606.08415, §2):
///   y = ½ x (1 + tanh(√(2/π) (x + 0.044715 x³))).  out, inp [n] in T (may alias).
template <int K, typename T>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
  const int64_t base = global_index() * K;
  if (base >= n) return;
  const int cnt = chunk_count<K>(n, base);
  float x[K];
  load_chunk<K>(x, inp + base, cnt);
#pragma unroll
  for (int k = 0; k < K; ++k) x[k] = gelu(x[k]);
  store_chunk<K>(out + base, x, cnt);
}

/// gelu_backward: dinp = dout · gelu'(inp) with, for u = √(2/π)(x + 0.044715 x³),
///   gelu'(x) = ½(1 + tanh u) + ½ x (1 − tanh² u) √(2/π) (1 + 3·0.044715 x²).
/// dinp may alias dout. All [n] in T.
template <int K, typename T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t n) {
  const int64_t base = global_index() * K;
  if (base >= n) return;
  const int cnt = chunk_count<K>(n, base);
  float x[K], dy[K];
  load_chunk<K>(x, inp + base, cnt);
  load_chunk<K>(dy, dout + base, cnt);
#pragma unroll
  for (int k = 0; k < K; ++k) x[k] = gelu_grad(x[k]) * dy[k];
  store_chunk<K>(dinp + base, x, cnt);
}

/// add: out = a + b, [n] in T; out may alias a or b. kDrop: out = a + dropout(b) (element i's
/// mask from `drop`, see core/philox.h).
template <int K, typename T, bool kDrop>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n, Dropout mask, uint32_t thresh,
                           float keep_scale) {
  const int64_t base = global_index() * K;
  if (base >= n) return;
  const Dropout drop = mask.with_device_seed();
  const int cnt = chunk_count<K>(n, base);
  float x[K], y[K];
  load_chunk<K>(x, a + base, cnt);
  load_chunk<K>(y, b + base, cnt);
  if constexpr (kDrop) dropout_chunk<K>(y, drop, thresh, keep_scale, static_cast<uint64_t>(base));
#pragma unroll
  for (int k = 0; k < K; ++k) x[k] += y[k];
  store_chunk<K>(out + base, x, cnt);
}

/// dropout_backward: dst = src ∘ mask · keep_scale, [n] in T; dst may alias src.
template <int K, typename T>
__global__ void dropout_backward_kernel(T* dst, const T* src, int64_t n, Dropout mask,
                                        uint32_t thresh, float keep_scale) {
  const int64_t base = global_index() * K;
  if (base >= n) return;
  const Dropout drop = mask.with_device_seed();
  const int cnt = chunk_count<K>(n, base);
  float x[K];
  load_chunk<K>(x, src + base, cnt);
  dropout_chunk<K>(x, drop, thresh, keep_scale, static_cast<uint64_t>(base));
  store_chunk<K>(dst + base, x, cnt);
}

/// scale: x *= s, [n] in T.
template <int K, typename T>
__global__ void scale_kernel(T* x, float s, int64_t n) {
  const int64_t base = global_index() * K;
  if (base >= n) return;
  const int cnt = chunk_count<K>(n, base);
  float v[K];
  load_chunk<K>(v, x + base, cnt);
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] *= s;
  store_chunk<K>(x + base, v, cnt);
}

}  // namespace

void convert(const CudaContext& ctx, Tensor dst, Tensor src) {
  const int64_t n = src.numel();
  dispatch_float(dst.dtype, [&]<typename TD>() {
    dispatch_float(src.dtype, [&]<typename TS>() {
      dispatch_vec(all_aligned(dst.data, src.data), [&]<int K>() {
        convert_kernel<K, TD, TS>
            <<<blocks_for((n + K - 1) / K), kBlock, 0, ctx.stream>>>(dst.as<TD>(), src.as<TS>(), n);
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  });
}

void gelu_forward(const CudaContext& ctx, Tensor out, Tensor inp) {
  const int64_t n = inp.numel();
  dispatch_float(inp.dtype, [&]<typename T>() {
    dispatch_vec(all_aligned(out.data, inp.data), [&]<int K>() {
      gelu_forward_kernel<K, T>
          <<<blocks_for((n + K - 1) / K), kBlock, 0, ctx.stream>>>(out.as<T>(), inp.as<T>(), n);
      ST_CUDA_LAUNCH_CHECK();
    });
  });
}

void gelu_backward(const CudaContext& ctx, Tensor dinp, Tensor inp, Tensor dout) {
  const int64_t n = inp.numel();
  dispatch_float(inp.dtype, [&]<typename T>() {
    dispatch_vec(all_aligned(dinp.data, inp.data, dout.data), [&]<int K>() {
      gelu_backward_kernel<K, T><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx.stream>>>(
          dinp.as<T>(), inp.as<T>(), dout.as<T>(), n);
      ST_CUDA_LAUNCH_CHECK();
    });
  });
}

void add(const CudaContext& ctx, Tensor out, Tensor a, Tensor b, const Dropout& dropout_b) {
  const int64_t n = out.numel();
  dispatch_float(out.dtype, [&]<typename T>() {
    dispatch_vec(all_aligned(out.data, a.data, b.data), [&]<int K>() {
      dispatch_dropout(dropout_b, [&]<bool kDrop>() {
        add_kernel<K, T, kDrop><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx.stream>>>(
            out.as<T>(), a.as<T>(), b.as<T>(), n, dropout_b, dropout_b.threshold(),
            dropout_b.scale());
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  });
}

void dropout_backward(const CudaContext& ctx, Tensor dst, Tensor src, const Dropout& dropout) {
  const int64_t n = src.numel();
  if (!dropout.active()) {
    if (dst.data != src.data)
      ST_CUDA_CHECK(
          cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, ctx.stream));
    return;
  }
  dispatch_float(src.dtype, [&]<typename T>() {
    dispatch_vec(all_aligned(dst.data, src.data), [&]<int K>() {
      dropout_backward_kernel<K, T><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx.stream>>>(
          dst.as<T>(), src.as<T>(), n, dropout, dropout.threshold(), dropout.scale());
      ST_CUDA_LAUNCH_CHECK();
    });
  });
}

void scale(const CudaContext& ctx, Tensor x, float s) {
  const int64_t n = x.numel();
  dispatch_float(x.dtype, [&]<typename T>() {
    dispatch_vec(aligned16(x.data), [&]<int K>() {
      scale_kernel<K, T><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx.stream>>>(x.as<T>(), s, n);
      ST_CUDA_LAUNCH_CHECK();
    });
  });
}

}  // namespace shardtrain::cuda
