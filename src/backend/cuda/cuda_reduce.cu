// Sums of the CUDA backend (Backend::sum / sum_squares): Σ x or Σ x² in fp64, as a fixed grid of
// per-block partial sums and then one block over the partials, so the decomposition and the
// summation order depend only on n (bit-identical from run to run). Blocking: the result is read
// back through a pinned host word.
#include <algorithm>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_common.h"

namespace shardtrain::cuda {
namespace {

/// sum / sum_squares, stage 1: part[blk] = Σ_i f(x_i) in fp64 over this block's grid-stride
/// share of the chunks, f(x) = x² (kSquare) or x. The grid size depends only on n, so the
/// decomposition and order are fixed.
template <int K, typename T, bool kSquare>
__global__ void sum_partials_kernel(double* part, const T* x, int64_t n) {
  const int64_t chunks = (n + K - 1) / K;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  double acc = 0.0;
  for (int64_t ch = global_index(); ch < chunks; ch += stride) {
    const int64_t base = ch * K;
    const int cnt = chunk_count<K>(n, base);
    float v[K];
    load_chunk<K>(v, x + base, cnt);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const double d = v[k];  // 0 beyond cnt
      acc += kSquare ? d * d : d;
    }
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

/// sum / sum_squares, stage 2 (one block): out[0] = Σ_g part[g], fixed order.
__global__ void sum_final_kernel(double* out, const double* part, int64_t G) {
  double acc = 0.0;
  for (int64_t g = threadIdx.x; g < G; g += blockDim.x) acc += part[g];
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[0] = acc;
}

}  // namespace

double reduce_sum(const CudaContext& ctx, Tensor x, bool square, double* host_result) {
  const int64_t n = x.numel();
  constexpr int64_t kMaxBlocks = 1024;
  double* part = static_cast<double*>(ctx.get_scratch((kMaxBlocks + 1) * sizeof(double)));
  double* result = part + kMaxBlocks;
  int64_t G = 0;
  dispatch_float(x.dtype, [&]<typename T>() {
    dispatch_vec(aligned16(x.data), [&]<int K>() {
      G = std::min<int64_t>(kMaxBlocks, blocks_for((n + K - 1) / K));
      if (square)
        sum_partials_kernel<K, T, true>
            <<<static_cast<unsigned>(G), kBlock, 0, ctx.stream>>>(part, x.as<T>(), n);
      else
        sum_partials_kernel<K, T, false>
            <<<static_cast<unsigned>(G), kBlock, 0, ctx.stream>>>(part, x.as<T>(), n);
      ST_CUDA_LAUNCH_CHECK();
    });
  });
  sum_final_kernel<<<1, kBlock, 0, ctx.stream>>>(result, part, G);
  ST_CUDA_LAUNCH_CHECK();
  ST_CUDA_CHECK(
      cudaMemcpyAsync(host_result, result, sizeof(double), cudaMemcpyDeviceToHost, ctx.stream));
  ST_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  return *host_result;
}

}  // namespace shardtrain::cuda
