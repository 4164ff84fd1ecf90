// LayerNorm on the GPU (Ba, Kiros & Hinton, arXiv 1607.06450), Backend::layernorm_forward /
// layernorm_backward: one warp per row for the forward and for the input gradient, and a
// deterministic two-stage reduction (fixed groups of rows, then the groups in order) for the
// weight and bias gradients. fp32 statistics and accumulation in every compute dtype.
// llm.c (Karpathy, llmc/layernorm.cuh) served as a model; the code here is written anew.
#include <algorithm>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_common.h"

namespace shardtrain::cuda {
namespace {

constexpr float kLayerNormEps = 1e-5f;

/// layernorm_forward (Ba, Kiros & Hinton, arXiv 1607.06450, eq. 4), one warp per row:
///   μ = Σ_c x_c / C,  σ² = Σ_c (x_c − μ)² / C,  rstd = 1 / sqrt(σ² + 1e-5),
///   y_c = (x_c − μ) · rstd · w_c + b_c.
/// inp/out [N, C], weight/bias [C] in T; mean/rstd [N] fp32 (saved for backward). Two passes
/// for the variance (as the CPU reference), fp32 throughout. C % K == 0.
template <int K, typename T>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp,
                                         const T* weight, const T* bias, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const T* x = inp + row * C;
  float s = 0.0f;
  for (int64_t c = lane * K; c < C; c += 32 * K) {
    float v[K];
    load_chunk<K>(v, x + c, K);
#pragma unroll
    for (int k = 0; k < K; ++k) s += v[k];
  }
  const float m = warp_sum(s) / static_cast<float>(C);
  float q = 0.0f;
  for (int64_t c = lane * K; c < C; c += 32 * K) {
    float v[K];
    load_chunk<K>(v, x + c, K);
#pragma unroll
    for (int k = 0; k < K; ++k) q += (v[k] - m) * (v[k] - m);
  }
  const float var = warp_sum(q) / static_cast<float>(C);
  const float rs = 1.0f / sqrtf(var + kLayerNormEps);
  T* y = out + row * C;
  for (int64_t c = lane * K; c < C; c += 32 * K) {
    float v[K], w[K], b[K];
    load_chunk<K>(v, x + c, K);
    load_chunk<K>(w, weight + c, K);
    load_chunk<K>(b, bias + c, K);
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = (v[k] - m) * rs * w[k] + b[k];
    store_chunk<K>(y + c, v, K);
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

/// layernorm_backward, input part, one warp per row. With n̂_c = (x_c − μ)·rstd and
/// g_c = w_c·dy_c:  dx_c = (g_c − mean_c(g) − n̂_c · mean_c(g·n̂)) · rstd, and dinp += dx
/// (accumulates: dinp is the residual stream's gradient). All [N, C] in T, w [C], μ/rstd fp32.
template <int K, typename T>
__global__ void layernorm_backward_dinp_kernel(T* dinp, const T* dout, const T* inp,
                                               const T* weight, const float* mean,
                                               const float* rstd, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const T* x = inp + row * C;
  const T* dy = dout + row * C;
  const float mu = mean[row], rs = rstd[row];
  float g_sum = 0.0f, gn_sum = 0.0f;
  for (int64_t c = lane * K; c < C; c += 32 * K) {
    float xv[K], dv[K], w[K];
    load_chunk<K>(xv, x + c, K);
    load_chunk<K>(dv, dy + c, K);
    load_chunk<K>(w, weight + c, K);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float g = w[k] * dv[k];
      g_sum += g;
      gn_sum += g * ((xv[k] - mu) * rs);
    }
  }
  const float g_mean = warp_sum(g_sum) / static_cast<float>(C);
  const float gn_mean = warp_sum(gn_sum) / static_cast<float>(C);
  T* dx = dinp + row * C;
  for (int64_t c = lane * K; c < C; c += 32 * K) {
    float xv[K], dv[K], w[K], acc[K];
    load_chunk<K>(xv, x + c, K);
    load_chunk<K>(dv, dy + c, K);
    load_chunk<K>(w, weight + c, K);
    load_chunk<K>(acc, dx + c, K);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float norm = (xv[k] - mu) * rs;
      acc[k] += (w[k] * dv[k] - g_mean - norm * gn_mean) * rs;
    }
    store_chunk<K>(dx + c, acc, K);
  }
}

/// layernorm_backward, parameter part, stage 1 of a deterministic two-stage reduction:
///   part_dw[g, c] = Σ_{rows r of group g} (x_rc − μ_r)·rstd_r·dy_rc,  part_db[g, c] = Σ dy_rc
/// over the rows [g·R, min(N, (g+1)·R)) in increasing order. Grid (G, ⌈C/256⌉); one thread per
/// (group, channel). part_* [G, C] fp32 scratch.
template <typename T>
__global__ void layernorm_backward_partials_kernel(float* part_dw, float* part_db, const T* dout,
                                                   const T* inp, const float* mean,
                                                   const float* rstd, int64_t N, int64_t C,
                                                   int64_t R) {
  const int64_t g = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = g * R, r1 = r0 + R < N ? r0 + R : N;
  float dw = 0.0f, db = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float dy = to_float(dout[r * C + c]);
    db += dy;
    dw += (to_float(inp[r * C + c]) - mean[r]) * rstd[r] * dy;
  }
  part_dw[g * C + c] = dw;
  part_db[g * C + c] = db;
}

/// Stage 2: dweight[c] += Σ_g part_dw[g, c], dbias[c] += Σ_g part_db[g, c], in a fixed order.
/// Block (32 channels, kReduceSlices slices): thread (x, y) sums groups y, y + kReduceSlices, ...
/// of channel blockIdx.x·32 + x in order (a warp reads 32 adjacent channels of a group), then
/// thread y = 0 adds the slices in order. (One thread per channel over all G groups left most of
/// the GPU idle: 28 µs a call for gpt2-medium's 1024 channels and 256 groups.)
constexpr int kReduceSlices = 32;

template <typename T>
__global__ void __launch_bounds__(32 * kReduceSlices)
    layernorm_backward_reduce_kernel(T* dweight, T* dbias, const float* part_dw,
                                     const float* part_db, int64_t G, int64_t C) {
  __shared__ float sm_dw[kReduceSlices][33], sm_db[kReduceSlices][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float dw = 0.0f, db = 0.0f;
  if (c < C) {
    for (int64_t g = threadIdx.y; g < G; g += kReduceSlices) {
      dw += part_dw[g * C + c];
      db += part_db[g * C + c];
    }
  }
  sm_dw[threadIdx.y][threadIdx.x] = dw;
  sm_db[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  dw = 0.0f;
  db = 0.0f;
  for (int y = 0; y < kReduceSlices; ++y) {
    dw += sm_dw[y][threadIdx.x];
    db += sm_db[y][threadIdx.x];
  }
  dweight[c] = from_float<T>(to_float(dweight[c]) + dw);
  dbias[c] = from_float<T>(to_float(dbias[c]) + db);
}

}  // namespace

void layernorm_forward(const CudaContext& ctx, Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                       Tensor weight, Tensor bias) {
  const int64_t C = inp.dim(-1), N = inp.numel() / C;
  const unsigned rows_per_block = kBlock / 32;
  dispatch_float(inp.dtype, [&]<typename T>() {
    const bool vec = C % kVec == 0 && all_aligned(out.data, inp.data, weight.data, bias.data);
    dispatch_vec(vec, [&]<int K>() {
      layernorm_forward_kernel<K, T>
          <<<ceil_div(static_cast<size_t>(N), rows_per_block), kBlock, 0, ctx.stream>>>(
              out.as<T>(), mean.as<float>(), rstd.as<float>(), inp.as<T>(), weight.as<T>(),
              bias.as<T>(), N, C);
      ST_CUDA_LAUNCH_CHECK();
    });
  });
}

void layernorm_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias,
                        Tensor dout, Tensor inp, Tensor weight, Tensor mean, Tensor rstd) {
  const int64_t C = inp.dim(-1), N = inp.numel() / C;
  // Parameter gradients: G groups of R consecutive rows (G ≤ 1024), partials in scratch.
  const int64_t R = std::max<int64_t>(32, (N + 1023) / 1024);
  const int64_t G = (N + R - 1) / R;
  auto* part = static_cast<float*>(ctx.get_scratch(2 * static_cast<size_t>(G * C) * 4));
  float* part_dw = part;
  float* part_db = part + G * C;
  const unsigned rows_per_block = kBlock / 32;
  dispatch_float(inp.dtype, [&]<typename T>() {
    const bool vec = C % kVec == 0 && all_aligned(dinp.data, dout.data, inp.data, weight.data);
    dispatch_vec(vec, [&]<int K>() {
      layernorm_backward_dinp_kernel<K, T>
          <<<ceil_div(static_cast<size_t>(N), rows_per_block), kBlock, 0, ctx.stream>>>(
              dinp.as<T>(), dout.as<T>(), inp.as<T>(), weight.as<T>(), mean.as<float>(),
              rstd.as<float>(), N, C);
      ST_CUDA_LAUNCH_CHECK();
    });
    const dim3 grid(static_cast<unsigned>(G), ceil_div(static_cast<size_t>(C), kBlock));
    layernorm_backward_partials_kernel<T><<<grid, kBlock, 0, ctx.stream>>>(
        part_dw, part_db, dout.as<T>(), inp.as<T>(), mean.as<float>(), rstd.as<float>(), N, C, R);
    ST_CUDA_LAUNCH_CHECK();
    layernorm_backward_reduce_kernel<T>
        <<<ceil_div(static_cast<size_t>(C), 32), dim3(32, kReduceSlices), 0, ctx.stream>>>(
            dweight.as<T>(), dbias.as<T>(), part_dw, part_db, G, C);
    ST_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace shardtrain::cuda
