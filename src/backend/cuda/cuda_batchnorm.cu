// Batch normalization on the GPU (Ioffe & Szegedy, arXiv 1502.03167, Algorithms 1 and 2), NCHW
// or channels-last images, split at its two reductions as ImageOps specifies so --sync-batchnorm
// can all-reduce the per-channel sums in between. The activation that follows (ReLU, ReLU6, SiLU)
// is fused into the normalizing pass, and its derivative into the backward passes (recomputed from
// the input, so nothing but mean and invstd is saved).
//
// Reductions: NCHW, grid (C channels × G groups of images), each block summing its channel's values
// over its images; channels-last, grid (⌈C/32⌉ channel tiles × G groups of rows), each thread
// summing one channel over a strided share of its group's rows (coalesced across the tile), then
// the block over its rows. Either way in fp64 into a partial per group, which a second kernel
// adds in a fixed order.
// Deterministic, no atomics; fp64 because the variance is taken as E[x²] − E[x]² (see
// backend/image_ops.h).

#include "backend/cuda/cuda_image.h"

namespace shardtrain::cuda {
namespace {

/// Partial sums of channel blockIdx.x over images [n0, n1) of group blockIdx.y: part [G, 2, C]
/// fp64 = (Σx, Σx²).
template <typename T>
__global__ void statistics_partial_kernel(double* part, const T* x, int64_t N, int64_t C,
                                          int64_t HW) {
  __shared__ double shared[32];
  const int64_t c = blockIdx.x, G = gridDim.y, g = blockIdx.y;
  const int64_t n0 = N * g / G, n1 = N * (g + 1) / G, m = (n1 - n0) * HW;
  double s1 = 0.0, s2 = 0.0;
  for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
    const double v = to_float(x[((n0 + j / HW) * C + c) * HW + j % HW]);
    s1 += v;
    s2 += v * v;
  }
  s1 = block_sum(s1, shared);
  s2 = block_sum(s2, shared);
  if (threadIdx.x == 0) {
    part[(g * 2 + 0) * C + c] = s1;
    part[(g * 2 + 1) * C + c] = s2;
  }
}

/// Reduces the kColRows partial pairs of each channel of the block (threadIdx.y) and writes them to
/// part [G, 2, C] for group blockIdx.y.
__device__ __forceinline__ void column_pair_store(double* part, double s1, double s2, int64_t c,
                                                  int64_t C) {
  __shared__ double t1[kColRows][kColTile], t2[kColRows][kColTile];
  t1[threadIdx.y][threadIdx.x] = s1;
  t2[threadIdx.y][threadIdx.x] = s2;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  for (unsigned r = 1; r < kColRows; ++r) {
    s1 += t1[r][threadIdx.x];
    s2 += t2[r][threadIdx.x];
  }
  part[(blockIdx.y * 2 + 0) * C + c] = s1;
  part[(blockIdx.y * 2 + 1) * C + c] = s2;
}

/// Channels-last statistics: rows [N·HW, C]; part [G, 2, C] = (Σx, Σx²) of group blockIdx.y.
template <typename T>
__global__ void statistics_columns_kernel(double* part, const T* x, int64_t rows, int64_t C) {
  const int64_t c = blockIdx.x * int64_t{kColTile} + threadIdx.x, G = gridDim.y;
  const int64_t r0 = rows * blockIdx.y / G, r1 = rows * (blockIdx.y + 1) / G;
  double s1 = 0.0, s2 = 0.0;
  if (c < C)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) {
      const double v = to_float(x[r * C + c]);
      s1 += v;
      s2 += v * v;
    }
  column_pair_store(part, s1, s2, c, C);
}

/// out [2, C] = Σ_g part [G, 2, C], in group order.
__global__ void sum_partials_kernel(double* out, const double* part, int64_t G, int64_t C) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= 2 * C) return;
  double acc = 0.0;
  for (int64_t g = 0; g < G; ++g) acc += part[g * 2 * C + i];
  out[i] = acc;
}

/// Per channel: mean, invstd and the running statistics (PyTorch's update, unbiased variance).
__global__ void batch_moments_kernel(float* mean, float* invstd, float* running_mean,
                                     float* running_var, const double* sums, int64_t C,
                                     double count, float eps, float momentum) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  const double m = sums[c] / count;
  const double var = fmax(sums[C + c] / count - m * m, 0.0);
  mean[c] = static_cast<float>(m);
  invstd[c] = static_cast<float>(1.0 / sqrt(var + eps));
  if (running_mean)
    running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + momentum * m);
  if (running_var)
    running_var[c] = static_cast<float>((1.0 - momentum) * running_var[c] +
                                        momentum * var * count / (count - 1.0));
}

/// out = act((x − mean)·invstd·γ + β); mean/invstd from the batch (fp32 [C]) or, with
/// kEval, computed from the running statistics.
template <typename T, Activation A, bool kEval>
__global__ void normalize_kernel(T* out, const T* x, const T* gamma, const T* beta,
                                 const float* mean, const float* var_or_invstd, float eps,
                                 int64_t n, int64_t C, int64_t HW, bool nhwc) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = nhwc ? imod(i, C) : imod(idiv(i, HW), C);
    const float is = kEval ? rsqrtf(var_or_invstd[c] + eps) : var_or_invstd[c];
    const float pre = (to_float(x[i]) - mean[c]) * is * to_float(gamma[c]) + to_float(beta[c]);
    out[i] = from_float<T>(act_forward<A>(pre));
  }
}

/// Eight consecutive fp32 values from 32-byte aligned `p` (two 16-byte loads).
__device__ __forceinline__ void load_f32x8(const float* p, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// The channels-last 8-channel kernels read per-channel coefficients that a one-thread-per-channel
// kernel prepared in fp32 arrays [k, C] (scratch), two vector loads per array and thread,
// instead of every statistic, γ and β per element (which held them to ~45% of bandwidth).

/// coef [3, C] = (mean, invstd·γ, β); with kEval from the running statistics.
template <typename T, bool kEval>
__global__ void normalize_coefficients_kernel(float* coef, const float* mean,
                                              const float* var_or_invstd, const T* gamma,
                                              const T* beta, float eps, int64_t C) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  const float is = kEval ? rsqrtf(var_or_invstd[c] + eps) : var_or_invstd[c];
  coef[c] = mean[c];
  coef[C + c] = is * to_float(gamma[c]);
  coef[2 * C + c] = to_float(beta[c]);
}

/// normalize_kernel on channels-last images, 8 channels per thread (C % 8 == 0), from coef [3, C].
template <typename T, Activation A>
__global__ void normalize_vec8_kernel(T* out, const T* x, const float* coef, int64_t n8,
                                      int64_t C) {
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < n8;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = v * 8, c0 = imod(i, C);
    float xv[8], mu[8], scale[8], shift[8], o[8];
    load8(x + i, xv);
    load_f32x8(coef + c0, mu);
    load_f32x8(coef + C + c0, scale);
    load_f32x8(coef + 2 * C + c0, shift);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = act_forward<A>((xv[k] - mu[k]) * scale[k] + shift[k]);
    store8(out + i, o);
  }
}

/// Partial (Σdy, Σdy·x̂) of channel blockIdx.x over image group blockIdx.y, dy = dout·act'(pre).
template <typename T, Activation A>
__global__ void backward_partial_kernel(double* part, const T* dout, const T* x, const T* gamma,
                                        const T* beta, const float* mean, const float* invstd,
                                        int64_t N, int64_t C, int64_t HW) {
  __shared__ double shared[32];
  const int64_t c = blockIdx.x, G = gridDim.y, g = blockIdx.y;
  const int64_t n0 = N * g / G, n1 = N * (g + 1) / G, m = (n1 - n0) * HW;
  const float mu = mean[c], is = invstd[c], ga = to_float(gamma[c]), be = to_float(beta[c]);
  double s1 = 0.0, s2 = 0.0;
  for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
    const int64_t i = ((n0 + j / HW) * C + c) * HW + j % HW;
    const float xhat = (to_float(x[i]) - mu) * is;
    const float d = to_float(dout[i]) * act_derivative<A>(xhat * ga + be);
    s1 += d;
    s2 += static_cast<double>(d) * xhat;
  }
  s1 = block_sum(s1, shared);
  s2 = block_sum(s2, shared);
  if (threadIdx.x == 0) {
    part[(g * 2 + 0) * C + c] = s1;
    part[(g * 2 + 1) * C + c] = s2;
  }
}

/// Channels-last backward_partial_kernel: rows [N·HW, C], group blockIdx.y.
template <typename T, Activation A>
__global__ void backward_columns_kernel(double* part, const T* dout, const T* x, const T* gamma,
                                        const T* beta, const float* mean, const float* invstd,
                                        int64_t rows, int64_t C) {
  const int64_t c = blockIdx.x * int64_t{kColTile} + threadIdx.x, G = gridDim.y;
  const int64_t r0 = rows * blockIdx.y / G, r1 = rows * (blockIdx.y + 1) / G;
  double s1 = 0.0, s2 = 0.0;
  if (c < C) {
    const float mu = mean[c], is = invstd[c], ga = to_float(gamma[c]), be = to_float(beta[c]);
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) {
      const int64_t i = r * C + c;
      const float xhat = (to_float(x[i]) - mu) * is;
      const float d = to_float(dout[i]) * act_derivative<A>(xhat * ga + be);
      s1 += d;
      s2 += static_cast<double>(d) * xhat;
    }
  }
  column_pair_store(part, s1, s2, c, C);
}

/// dsums [2, C] = Σ_g part; dweight[c] += Σdy·x̂, dbias[c] += Σdy.
template <typename T>
__global__ void backward_finish_kernel(double* dsums, T* dweight, T* dbias, const double* part,
                                       int64_t G, int64_t C) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  double s1 = 0.0, s2 = 0.0;
  for (int64_t g = 0; g < G; ++g) {
    s1 += part[g * 2 * C + c];
    s2 += part[g * 2 * C + C + c];
  }
  dsums[c] = s1;
  dsums[C + c] = s2;
  dweight[c] = from_float<T>(to_float(dweight[c]) + static_cast<float>(s2));
  dbias[c] = from_float<T>(to_float(dbias[c]) + static_cast<float>(s1));
}

/// dinp = γ·invstd·(dy − Σdy/count − x̂·Σdy·x̂/count) (dinp may alias dout).
template <typename T, Activation A>
__global__ void backward_input_kernel(T* dinp, const T* dout, const T* x, const T* gamma,
                                      const T* beta, const float* mean, const float* invstd,
                                      const double* dsums, double inv_count, int64_t n, int64_t C,
                                      int64_t HW, bool nhwc) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = nhwc ? imod(i, C) : imod(idiv(i, HW), C);
    const float is = invstd[c], ga = to_float(gamma[c]);
    const float xhat = (to_float(x[i]) - mean[c]) * is;
    const float d = to_float(dout[i]) * act_derivative<A>(xhat * ga + to_float(beta[c]));
    const auto mean_dy = static_cast<float>(dsums[c] * inv_count);
    const auto mean_dy_xhat = static_cast<float>(dsums[C + c] * inv_count);
    dinp[i] = from_float<T>(ga * is * (d - mean_dy - xhat * mean_dy_xhat));
  }
}

/// backward_input_kernel on channels-last images, 8 channels per thread (C % 8 == 0).
/// coef [7, C] = (mean, invstd, γ, β, k = γ·invstd, k·mean(dy), k·mean(dy·x̂)) for
/// backward_input_vec8_kernel.
template <typename T>
__global__ void backward_coefficients_kernel(float* coef, const float* mean, const float* invstd,
                                             const T* gamma, const T* beta, const double* dsums,
                                             double inv_count, int64_t C) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  const float is = invstd[c], ga = to_float(gamma[c]), k = ga * is;
  coef[c] = mean[c];
  coef[C + c] = is;
  coef[2 * C + c] = ga;
  coef[3 * C + c] = to_float(beta[c]);
  coef[4 * C + c] = k;
  coef[5 * C + c] = k * static_cast<float>(dsums[c] * inv_count);
  coef[6 * C + c] = k * static_cast<float>(dsums[C + c] * inv_count);
}

/// backward_input_kernel on channels-last images, 8 channels per thread (C % 8 == 0), from
/// backward_coefficients_kernel's coef [7, C]: dinp = k·dy − k·mean(dy) − k·mean(dy·x̂)·x̂.
template <typename T, Activation A>
__global__ void backward_input_vec8_kernel(T* dinp, const T* dout, const T* x, const float* coef,
                                           int64_t n8, int64_t C) {
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < n8;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = v * 8, c0 = imod(i, C);
    float xv[8], dv[8], mu[8], is[8], k[8], kmdy[8], kmdx[8], o[8];
    load8(x + i, xv);
    load8(dout + i, dv);
    load_f32x8(coef + c0, mu);
    load_f32x8(coef + C + c0, is);
    load_f32x8(coef + 4 * C + c0, k);
    load_f32x8(coef + 5 * C + c0, kmdy);
    load_f32x8(coef + 6 * C + c0, kmdx);
    if constexpr (A != Activation::kNone) {
      float ga[8], be[8];
      load_f32x8(coef + 2 * C + c0, ga);
      load_f32x8(coef + 3 * C + c0, be);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        dv[j] *= act_derivative<A>((xv[j] - mu[j]) * is[j] * ga[j] + be[j]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float xhat = (xv[j] - mu[j]) * is[j];
      o[j] = k[j] * dv[j] - kmdy[j] - kmdx[j] * xhat;
    }
    store8(dinp + i, o);
  }
}

struct Dims {
  int64_t N, C, HW;
};

Dims check_common(const char* op, const Tensor& inp, const Tensor& weight, const Tensor& bias) {
  expect_nchw(op, "inp", inp, inp.dtype);
  const Dims d{inp.dim(0), inp.dim(1), inp.dim(2) * inp.dim(3)};
  expect_tensor(op, "weight", weight, inp.dtype, {d.C});
  expect_tensor(op, "bias", bias, inp.dtype, {d.C});
  return d;
}

/// out = act(BN(inp)) with the batch's mean and invstd (`stat_a`, `stat_b`), or with kEval the
/// running mean and variance: normalize_kernel, or its 8-channel version where vec8_ok().
template <bool kEval>
void normalize(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight, Tensor bias,
               Tensor stat_a, Tensor stat_b, float eps, Activation act, const Dims& d, bool nhwc) {
  const int64_t n = inp.numel();
  const bool vec = vec8_ok(nhwc, d.C, {out.data, inp.data});
  dispatch_float(inp.dtype, [&]<typename T>() {
    float* coef = nullptr;
    if (vec) {
      coef = static_cast<float*>(ctx.get_scratch(static_cast<size_t>(3 * d.C) * sizeof(float)));
      normalize_coefficients_kernel<T, kEval>
          <<<ceil_div(d.C, kImageBlock), kImageBlock, 0, ctx.stream>>>(
              coef, stat_a.as<float>(), stat_b.as<float>(), weight.as<T>(), bias.as<T>(), eps, d.C);
      ST_CUDA_LAUNCH_CHECK();
    }
    dispatch_activation(act, [&]<Activation A>() {
      if (vec)
        normalize_vec8_kernel<T, A><<<grid_for(ctx, n / 8), kImageBlock, 0, ctx.stream>>>(
            out.as<T>(), inp.as<T>(), coef, n / 8, d.C);
      else
        normalize_kernel<T, A, kEval><<<grid_for(ctx, n), kImageBlock, 0, ctx.stream>>>(
            out.as<T>(), inp.as<T>(), weight.as<T>(), bias.as<T>(), stat_a.as<float>(),
            stat_b.as<float>(), eps, n, d.C, d.HW, nhwc);
    });
  });
  ST_CUDA_LAUNCH_CHECK();
}

}  // namespace

void batchnorm_statistics(const CudaContext& ctx, Tensor sums, Tensor inp, bool nhwc) {
  const char* op = "cuda batchnorm_statistics";
  expect_nchw(op, "inp", inp, inp.dtype);
  const int64_t N = inp.dim(0), C = inp.dim(1), HW = inp.dim(2) * inp.dim(3);
  expect_tensor(op, "sums", sums, DType::kF64, {2, C});
  const int64_t G = nhwc ? column_groups(ctx, N * HW, C) : image_groups(ctx, N, C, HW);
  auto* part = static_cast<double*>(ctx.get_scratch(static_cast<size_t>(G * 2 * C) * 8));
  dispatch_float(inp.dtype, [&]<typename T>() {
    if (nhwc)
      statistics_columns_kernel<T>
          <<<dim3(ceil_div(static_cast<size_t>(C), kColTile), static_cast<unsigned>(G)),
             dim3(kColTile, kColRows), 0, ctx.stream>>>(part, inp.as<T>(), N * HW, C);
    else
      statistics_partial_kernel<T><<<dim3(static_cast<unsigned>(C), static_cast<unsigned>(G)),
                                     kImageBlock, 0, ctx.stream>>>(part, inp.as<T>(), N, C, HW);
  });
  ST_CUDA_LAUNCH_CHECK();
  sum_partials_kernel<<<ceil_div(2 * C, kImageBlock), kImageBlock, 0, ctx.stream>>>(
      sums.as<double>(), part, G, C);
  ST_CUDA_LAUNCH_CHECK();
}

void batchnorm_forward_train(const CudaContext& ctx, Tensor out, Tensor mean, Tensor invstd,
                             Tensor running_mean, Tensor running_var, Tensor inp, Tensor weight,
                             Tensor bias, Tensor sums, int64_t count, float eps, float momentum,
                             Activation act, bool nhwc) {
  const char* op = "cuda batchnorm_forward_train";
  const Dims d = check_common(op, inp, weight, bias);
  expect_tensor(op, "out", out, inp.dtype, {d.N, d.C, inp.dim(2), inp.dim(3)});
  expect_tensor(op, "mean", mean, DType::kF32, {d.C});
  expect_tensor(op, "invstd", invstd, DType::kF32, {d.C});
  expect_tensor_or_empty(op, "running_mean", running_mean, DType::kF32, {d.C});
  expect_tensor_or_empty(op, "running_var", running_var, DType::kF32, {d.C});
  expect_tensor(op, "sums", sums, DType::kF64, {2, d.C});
  require(count > 1, op, ": count=", count,
          " values per channel; training batch norm needs more than one");
  batch_moments_kernel<<<ceil_div(d.C, kImageBlock), kImageBlock, 0, ctx.stream>>>(
      mean.as<float>(), invstd.as<float>(),
      running_mean.empty() ? nullptr : running_mean.as<float>(),
      running_var.empty() ? nullptr : running_var.as<float>(), sums.as<double>(), d.C,
      static_cast<double>(count), eps, momentum);
  ST_CUDA_LAUNCH_CHECK();
  normalize<false>(ctx, out, inp, weight, bias, mean, invstd, eps, act, d, nhwc);
}

void batchnorm_forward_eval(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight,
                            Tensor bias, Tensor running_mean, Tensor running_var, float eps,
                            Activation act, bool nhwc) {
  const char* op = "cuda batchnorm_forward_eval";
  const Dims d = check_common(op, inp, weight, bias);
  expect_tensor(op, "out", out, inp.dtype, {d.N, d.C, inp.dim(2), inp.dim(3)});
  expect_tensor(op, "running_mean", running_mean, DType::kF32, {d.C});
  expect_tensor(op, "running_var", running_var, DType::kF32, {d.C});
  normalize<true>(ctx, out, inp, weight, bias, running_mean, running_var, eps, act, d, nhwc);
}

void batchnorm_backward_reduce(const CudaContext& ctx, Tensor dsums, Tensor dweight, Tensor dbias,
                               Tensor dout, Tensor inp, Tensor weight, Tensor bias, Tensor mean,
                               Tensor invstd, Activation act, bool nhwc) {
  const char* op = "cuda batchnorm_backward_reduce";
  const Dims d = check_common(op, inp, weight, bias);
  expect_tensor(op, "dout", dout, inp.dtype, {d.N, d.C, inp.dim(2), inp.dim(3)});
  expect_tensor(op, "dsums", dsums, DType::kF64, {2, d.C});
  expect_tensor(op, "dweight", dweight, inp.dtype, {d.C});
  expect_tensor(op, "dbias", dbias, inp.dtype, {d.C});
  expect_tensor(op, "mean", mean, DType::kF32, {d.C});
  expect_tensor(op, "invstd", invstd, DType::kF32, {d.C});
  const int64_t G = nhwc ? column_groups(ctx, d.N * d.HW, d.C) : image_groups(ctx, d.N, d.C, d.HW);
  auto* part = static_cast<double*>(ctx.get_scratch(static_cast<size_t>(G * 2 * d.C) * 8));
  dispatch_float(inp.dtype, [&]<typename T>() {
    dispatch_activation(act, [&]<Activation A>() {
      if (nhwc) {
        backward_columns_kernel<T, A>
            <<<dim3(ceil_div(static_cast<size_t>(d.C), kColTile), static_cast<unsigned>(G)),
               dim3(kColTile, kColRows), 0, ctx.stream>>>(
                part, dout.as<T>(), inp.as<T>(), weight.as<T>(), bias.as<T>(), mean.as<float>(),
                invstd.as<float>(), d.N * d.HW, d.C);
        return;
      }
      backward_partial_kernel<T, A>
          <<<dim3(static_cast<unsigned>(d.C), static_cast<unsigned>(G)), kImageBlock, 0,
             ctx.stream>>>(part, dout.as<T>(), inp.as<T>(), weight.as<T>(), bias.as<T>(),
                           mean.as<float>(), invstd.as<float>(), d.N, d.C, d.HW);
    });
    ST_CUDA_LAUNCH_CHECK();
    backward_finish_kernel<T><<<ceil_div(d.C, kImageBlock), kImageBlock, 0, ctx.stream>>>(
        dsums.as<double>(), dweight.as<T>(), dbias.as<T>(), part, G, d.C);
  });
  ST_CUDA_LAUNCH_CHECK();
}

void batchnorm_backward_input(const CudaContext& ctx, Tensor dinp, Tensor dout, Tensor inp,
                              Tensor weight, Tensor bias, Tensor mean, Tensor invstd, Tensor dsums,
                              int64_t count, Activation act, bool nhwc) {
  const char* op = "cuda batchnorm_backward_input";
  const Dims d = check_common(op, inp, weight, bias);
  expect_tensor(op, "dinp", dinp, inp.dtype, {d.N, d.C, inp.dim(2), inp.dim(3)});
  expect_tensor(op, "dout", dout, inp.dtype, {d.N, d.C, inp.dim(2), inp.dim(3)});
  expect_tensor(op, "mean", mean, DType::kF32, {d.C});
  expect_tensor(op, "invstd", invstd, DType::kF32, {d.C});
  expect_tensor(op, "dsums", dsums, DType::kF64, {2, d.C});
  require(count > 0, op, ": count=", count, " values per channel");
  const int64_t n = inp.numel();
  const bool vec = vec8_ok(nhwc, d.C, {dinp.data, dout.data, inp.data});
  dispatch_float(inp.dtype, [&]<typename T>() {
    float* coef = nullptr;
    if (vec) {
      coef = static_cast<float*>(ctx.get_scratch(static_cast<size_t>(7 * d.C) * sizeof(float)));
      backward_coefficients_kernel<T><<<ceil_div(d.C, kImageBlock), kImageBlock, 0, ctx.stream>>>(
          coef, mean.as<float>(), invstd.as<float>(), weight.as<T>(), bias.as<T>(),
          dsums.as<double>(), 1.0 / static_cast<double>(count), d.C);
      ST_CUDA_LAUNCH_CHECK();
    }
    dispatch_activation(act, [&]<Activation A>() {
      if (vec) {
        backward_input_vec8_kernel<T, A><<<grid_for(ctx, n / 8), kImageBlock, 0, ctx.stream>>>(
            dinp.as<T>(), dout.as<T>(), inp.as<T>(), coef, n / 8, d.C);
        return;
      }
      backward_input_kernel<T, A><<<grid_for(ctx, n), kImageBlock, 0, ctx.stream>>>(
          dinp.as<T>(), dout.as<T>(), inp.as<T>(), weight.as<T>(), bias.as<T>(), mean.as<float>(),
          invstd.as<float>(), dsums.as<double>(), 1.0 / static_cast<double>(count), n, d.C, d.HW,
          nhwc);
    });
  });
  ST_CUDA_LAUNCH_CHECK();
}

}  // namespace shardtrain::cuda
