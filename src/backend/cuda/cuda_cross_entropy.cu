// Fused softmax + cross-entropy on the GPU (Backend::softmax_cross_entropy /
// cross_entropy_forward), one block per row of logits: an online softmax normalizer (Milakov &
// Gimelshein, arXiv 1805.02867) over the row, the row's loss, and with the gradient the logits
// overwritten in place by (softmax − one-hot) · grad_scale, so the [N, V] probabilities are never
// stored. llm.c (Karpathy, llmc/fused_classifier.cuh) served as a model; the code here is written
// anew.
#include <cmath>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_common.h"

namespace shardtrain::cuda {
namespace {

/// Running (max, Σ exp(x − max)) of a softmax denominator (Milakov & Gimelshein, "Online
/// normalizer calculation for softmax", arXiv 1805.02867, Algorithm 3).
struct OnlineSoftmax {
  float m = -INFINITY;
  float s = 0.0f;

  /// Adds K values: one rescale to the new running max, then K exponentials. A NaN value makes
  /// s NaN (fmaxf ignores it for the max, expf(NaN − m) does not); values of −∞ add nothing.
  template <int K>
  __device__ __forceinline__ void add(const float (&x)[K]) {
    float vm = x[0];
#pragma unroll
    for (int k = 1; k < K; ++k) vm = fmaxf(vm, x[k]);
    if (vm > m) {
      s *= expf(m - vm);  // 0 · e^(−∞) = 0 on the first values
      m = vm;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) s += (x[k] == -INFINITY && m == -INFINITY) ? 0.0f : expf(x[k] - m);
  }
  __device__ __forceinline__ static OnlineSoftmax combine(OnlineSoftmax a, OnlineSoftmax b) {
    OnlineSoftmax r;
    r.m = fmaxf(a.m, b.m);
    const float sa = a.s == 0.0f ? 0.0f : a.s * expf(a.m - r.m);
    const float sb = b.s == 0.0f ? 0.0f : b.s * expf(b.m - r.m);
    r.s = sa + sb;
    return r;
  }
};

/// softmax_cross_entropy / cross_entropy_forward, one block per row i of logits [N, ld], whose
/// first V columns are the scores (any V ≤ ld; columns [V, ld) are neither read nor written):
///   m = max_j x_j, s = Σ_j exp(x_j − m), loss_i = log s + m − x_{target_i},
///   and with kWriteGrad: x_j ← (exp(x_j − m)/s − [j = target_i]) · grad_scale, in place in T.
/// target < 0: loss 0 (and a zero gradient row). target ≥ V (invalid input): loss NaN, no
/// one-hot term, so the bad data shows in the loss instead of corrupting memory.
/// losses [N] fp32, targets [N] int32.
/// Rows start anywhere (V is odd for GPT-2), so each row is read as an unaligned scalar head, a
/// body of 16-byte vectors, and a scalar tail.
template <typename T, bool kWriteGrad>
__global__ void cross_entropy_kernel(float* losses, T* logits, const int32_t* targets, int64_t V,
                                     int64_t ld, float grad_scale) {
  constexpr int K = static_cast<int>(16 / sizeof(T));
  const int64_t row = blockIdx.x;
  T* x = logits + row * ld;
  const int32_t target = targets[row];
  if (target < 0) {
    if (threadIdx.x == 0) losses[row] = 0.0f;
    if (kWriteGrad)
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) x[j] = from_float<T>(0.0f);
    return;
  }
  __shared__ float target_logit;
  __shared__ OnlineSoftmax warp_state[32];
  if (threadIdx.x == 0) target_logit = target < V ? to_float(x[target]) : NAN;

  const auto mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(x) % 16) / sizeof(T));
  const int64_t head = mis == 0 ? 0 : (K - mis < V ? K - mis : V);
  const int64_t nvec = (V - head) / K;
  const int64_t tail = head + nvec * K;  // first element after the vectors

  OnlineSoftmax st;
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) st.add<1>({to_float(x[j])});
  for (int64_t j = tail + threadIdx.x; j < V; j += blockDim.x) st.add<1>({to_float(x[j])});
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    float v[K];
    load_chunk<K>(v, x + head + i * K, K);
    st.add<K>(v);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    OnlineSoftmax other;
    other.m = __shfl_xor_sync(0xffffffffu, st.m, o);
    other.s = __shfl_xor_sync(0xffffffffu, st.s, o);
    st = OnlineSoftmax::combine(st, other);
  }
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  if (lane == 0) warp_state[warp] = st;
  __syncthreads();  // also publishes target_logit, read before anything below overwrites x
  st = lane < nwarps ? warp_state[lane] : OnlineSoftmax();
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    OnlineSoftmax other;
    other.m = __shfl_xor_sync(0xffffffffu, st.m, o);
    other.s = __shfl_xor_sync(0xffffffffu, st.s, o);
    st = OnlineSoftmax::combine(st, other);
  }
  if (threadIdx.x == 0) losses[row] = logf(st.s) + st.m - target_logit;
  if (kWriteGrad) {
    const float inv = grad_scale / st.s;
    const auto grad = [&](float v, int64_t j) {
      const float g = expf(v - st.m) * inv;
      return j == target ? g - grad_scale : g;
    };
    for (int64_t j = threadIdx.x; j < head; j += blockDim.x)
      x[j] = from_float<T>(grad(to_float(x[j]), j));
    for (int64_t j = tail + threadIdx.x; j < V; j += blockDim.x)
      x[j] = from_float<T>(grad(to_float(x[j]), j));
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const int64_t j0 = head + i * K;
      float v[K];
      load_chunk<K>(v, x + j0, K);
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = grad(v[k], j0 + k);
      store_chunk<K>(x + j0, v, K);
    }
  }
}

}  // namespace

void cross_entropy(const CudaContext& ctx, Tensor losses, Tensor logits, Tensor targets, int64_t V,
                   float grad_scale, bool write_grad) {
  const int64_t ld = logits.dim(-1), N = logits.numel() / ld;
  constexpr unsigned kThreads = 512;
  dispatch_float(logits.dtype, [&]<typename T>() {
    if (write_grad)
      cross_entropy_kernel<T, true><<<static_cast<unsigned>(N), kThreads, 0, ctx.stream>>>(
          losses.as<float>(), logits.as<T>(), targets.as<int32_t>(), V, ld, grad_scale);
    else
      cross_entropy_kernel<T, false><<<static_cast<unsigned>(N), kThreads, 0, ctx.stream>>>(
          losses.as<float>(), logits.as<T>(), targets.as<int32_t>(), V, ld, grad_scale);
    ST_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace shardtrain::cuda
