// CUDA backend: device memory (a caching allocator) and every op of backend/backend.h except the
// matmuls and attention (cuda_matmul.cu, cuda_attention.cu, cuda_flash_attention.cu), as fused
// CUDA kernels.
//
// Precision: tensors are fp32, bf16 or fp16 (the "compute dtype" chosen at construction; the
// optimizer state and LayerNorm statistics are always fp32); every kernel loads its operands,
// computes and accumulates in fp32 (reductions that return to the host in fp64), and rounds once
// to nearest-even when it stores. The fp32 mode exists for testing: it matches the CPU reference
// (backend/cpu/cpu_backend.cpp) to within summation-order rounding.
//
// Ordering: every op is enqueued on one non-blocking compute stream; the host only waits in the
// blocking calls (copy_to_host, copy_from_host, sum, sum_squares, synchronize). Memory from the
// caching allocator is stream-ordered on that stream: a freed block may be handed out again at
// once because every later use of it is enqueued on the same stream after the earlier ones. Work
// on any other stream (e.g. a future communication stream) must wait on the compute stream
// (cudaEventRecord / cudaStreamWaitEvent) before touching memory it did not allocate itself.
//
// Determinism: no kernel uses floating-point atomics. Reductions across rows (embedding, LayerNorm
// parameter gradients, sum, sum_squares) use a fixed decomposition and a fixed summation order, so
// results are bit-identical from run to run on the same GPU and launch configuration.
//
// llm.c (Karpathy, llmc/*.cuh) served as a model for the kernel structure (warp-per-row
// LayerNorm, block-per-row fused classifier, fused AdamW); the code here is written anew.

// Messages are built with printf-style strf() below, not fmt: nvcc 13 cannot compile fmt 9 in
// C++20 mode, so core/error.h hides fmt from code nvcc compiles.

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_common.h"
#include "backend/cuda/cuda_host_transfer.h"
#include "backend/cuda/cuda_image.h"
#include "backend/cuda/cuda_ops.h"

namespace shardtrain::cuda {
namespace {

constexpr float kLayerNormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCoef = 0.044715f;
constexpr unsigned kBlock = 256;  // threads per block of the simple kernels
constexpr int kVec = 8;           // elements per thread in vectorized kernels

// ==== device helpers ===========================================================================

/// Loads `cnt` (≤ K) consecutive elements as floats. When cnt == K and K elements of T are a
/// whole number of 16-byte words, uses 128-bit loads: the caller guarantees the address is then
/// 16-byte aligned (host launchers pick K = kVec only for aligned pointers).
template <int K, typename T>
__device__ __forceinline__ void load_chunk(float (&dst)[K], const T* src, int cnt) {
  if constexpr ((K * sizeof(T)) % 16 == 0) {
    if (cnt == K) {
      constexpr int kWords = static_cast<int>(K * sizeof(T) / 16);
      int4 raw[kWords];
#pragma unroll
      for (int w = 0; w < kWords; ++w) raw[w] = reinterpret_cast<const int4*>(src)[w];
      T e[K];
      memcpy(e, raw, sizeof(e));
#pragma unroll
      for (int k = 0; k < K; ++k) dst[k] = to_float(e[k]);
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) dst[k] = k < cnt ? to_float(src[k]) : 0.0f;
}

/// Stores `cnt` (≤ K) floats rounded to T (RNE), 128-bit stores under the same rule as load_chunk.
template <int K, typename T>
__device__ __forceinline__ void store_chunk(T* dst, const float (&src)[K], int cnt) {
  if constexpr ((K * sizeof(T)) % 16 == 0) {
    if (cnt == K) {
      constexpr int kWords = static_cast<int>(K * sizeof(T) / 16);
      T e[K];
#pragma unroll
      for (int k = 0; k < K; ++k) e[k] = from_float<T>(src[k]);
      int4 raw[kWords];
      memcpy(raw, e, sizeof(raw));
#pragma unroll
      for (int w = 0; w < kWords; ++w) reinterpret_cast<int4*>(dst)[w] = raw[w];
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (k < cnt) dst[k] = from_float<T>(src[k]);
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// Sum over the block (blockDim.x a multiple of 32, ≤ 1024) in a fixed order; every thread gets
/// the result. Safe to call repeatedly in one kernel.
template <typename A>
__device__ A block_sum(A v) {
  __shared__ A partial[32];
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // a previous call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  A total = lane < nwarps ? partial[lane] : A(0);
  return warp_sum(total);
}

/// Elements of the chunk starting at `base` (< n): K, or fewer for the last chunk.
template <int K>
__device__ __forceinline__ int chunk_count(int64_t n, int64_t base) {
  return n - base < K ? static_cast<int>(n - base) : K;
}

/// Chunk index of this thread in a 1-D launch of kBlock-thread blocks.
__device__ __forceinline__ int64_t global_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ float gelu(float x) {
  const float cube = kGeluCoef * x * x * x;
  return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
}

__device__ __forceinline__ float gelu_grad(float x) {
  const float cube = kGeluCoef * x * x * x;
  const float th = tanhf(kGeluScale * (x + cube));
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCoef * x * x);
}

// ==== kernels ==================================================================================

/// Sanity kernel: cudaFuncGetAttributes on it fails when this build has no code for the GPU.
__global__ void probe_kernel() {}

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

/// embedding_forward: out[b,t,c] = wte[tok[b,t], c] + wpe[t, c].
/// out [N=B·T, C], tok [N] int32, wte [V, C], wpe [maxT, C]; C % K == 0. A token outside [0, V)
/// yields a NaN row (instead of reading out of bounds) so the bad input cannot go unnoticed.
/// kDrop: out = dropout(wte[tok] + wpe) with `drop` (element index row·C + c).
template <int K, typename T, bool kDrop>
__global__ void embedding_forward_kernel(T* out, const int32_t* tok, const T* wte, const T* wpe,
                                         int64_t N, int64_t Tn, int64_t C, int64_t V, Dropout drop,
                                         uint32_t thresh, float keep_scale) {
  const int64_t chunk = global_index();
  const int64_t per_row = C / K;
  if (chunk >= N * per_row) return;
  const int64_t row = chunk / per_row, c = (chunk % per_row) * K, t = row % Tn;
  const int32_t token = tok[row];
  float y[K];
  if (token < 0 || token >= V) {
#pragma unroll
    for (int k = 0; k < K; ++k) y[k] = NAN;
  } else {
    float p[K];
    load_chunk<K>(y, wte + token * C + c, K);
    load_chunk<K>(p, wpe + t * C + c, K);
#pragma unroll
    for (int k = 0; k < K; ++k) y[k] += p[k];
  }
  if constexpr (kDrop)
    dropout_chunk<K>(y, drop, thresh, keep_scale, static_cast<uint64_t>(row * C + c));
  store_chunk<K>(out + row * C + c, y, K);
}

/// v[i] = i, i < n (the row indices sorted along with the token ids).
__global__ void iota_kernel(int32_t* v, int32_t n) {
  const int64_t i = global_index();
  if (i < n) v[i] = static_cast<int32_t>(i);
}

/// embedding_backward, token part: dwte[v, c] += Σ_{rows r with tok[r] = v} dout[r, c].
/// sorted_tok/sorted_row [N]: (token, row) pairs stably sorted by token, so each run of one token
/// lists its rows in increasing order. Block (x, y) handles sorted position x and channels
/// [256·y, 256·y + 256): only the first position of each run does work, summing the run's rows in
/// order in fp32 — one writer per dwte element, a fixed order, hence deterministic.
/// dwte [V, C], dout [N, C]. Tokens outside [0, V) are skipped (the forward made them NaN).
/// kDrop: dout is read through the forward's dropout mask (element r·C + c), ·keep_scale.
template <typename T, bool kDrop>
__global__ void embedding_dwte_kernel(T* dwte, const T* dout, const int32_t* sorted_tok,
                                      const int32_t* sorted_row, int32_t N, int64_t C, int64_t V,
                                      Dropout drop, uint32_t thresh, float keep_scale) {
  const int32_t i = static_cast<int32_t>(blockIdx.x);
  const int32_t token = sorted_tok[i];
  if (i > 0 && sorted_tok[i - 1] == token) return;  // not the first of its run
  if (token < 0 || token >= V) return;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const auto term = [&](int32_t j) {
    const int64_t e = static_cast<int64_t>(sorted_row[j]) * C + c;
    if constexpr (kDrop) {
      return drop.keep(static_cast<uint64_t>(e), thresh) ? to_float(dout[e]) * keep_scale : 0.0f;
    } else {
      return to_float(dout[e]);
    }
  };
  // A frequent token's run is long (hundreds of rows in a micro-batch of text): load 8 rows at a
  // time so their loads are in flight together, then add them in order (the same sum as one at a
  // time). sorted_tok is sorted, so sorted_tok[j + 7] == token means all 8 are in the run.
  constexpr int32_t kUnroll = 8;
  float acc = 0.0f;
  int32_t j = i;
  for (; j + kUnroll <= N && sorted_tok[j + kUnroll - 1] == token; j += kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int32_t u = 0; u < kUnroll; ++u) v[u] = term(j + u);
#pragma unroll
    for (int32_t u = 0; u < kUnroll; ++u) acc += v[u];
  }
  for (; j < N && sorted_tok[j] == token; ++j) acc += term(j);
  T* dst = dwte + token * C + c;
  *dst = from_float<T>(to_float(*dst) + acc);
}

/// embedding_backward, position part: dwpe[t, c] += Σ_b dout[b, t, c], b in increasing order.
/// dwpe [maxT, C] (rows t < Tn touched), dout [B, Tn, C].
/// kDrop: dout is read through the forward's dropout mask (element b·Tn·C + i), ·keep_scale.
template <typename T, bool kDrop>
__global__ void embedding_dwpe_kernel(T* dwpe, const T* dout, int64_t B, int64_t Tn, int64_t C,
                                      Dropout drop, uint32_t thresh, float keep_scale) {
  const int64_t i = global_index();  // t * C + c
  if (i >= Tn * C) return;
  float acc = 0.0f;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t e = b * Tn * C + i;
    if constexpr (kDrop) {
      if (drop.keep(static_cast<uint64_t>(e), thresh)) acc += to_float(dout[e]) * keep_scale;
    } else {
      acc += to_float(dout[e]);
    }
  }
  dwpe[i] = from_float<T>(to_float(dwpe[i]) + acc);
}

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

/// Stage 2: dweight[c] += Σ_g part_dw[g, c], dbias[c] += Σ_g part_db[g, c], g in order.
template <typename T>
__global__ void layernorm_backward_reduce_kernel(T* dweight, T* dbias, const float* part_dw,
                                                 const float* part_db, int64_t G, int64_t C) {
  const int64_t c = global_index();
  if (c >= C) return;
  float dw = 0.0f, db = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    dw += part_dw[g * C + c];
    db += part_db[g * C + c];
  }
  dweight[c] = from_float<T>(to_float(dweight[c]) + dw);
  dbias[c] = from_float<T>(to_float(dbias[c]) + db);
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

/// Fused AdamW (Loshchilov & Hutter, arXiv 1711.05101, Algorithm 2; bias correction of Kingma &
/// Ba, arXiv 1412.6980, Algorithm 1), exactly the formula of Backend::adamw:
///   g = grad·grad_scale; m ← β1 m + (1−β1) g; v ← β2 v + (1−β2) g²;
///   p ← p − lr·((m/bc1) / (sqrt(v/bc2) + eps) + wd·p);   out = (TO) p when out != nullptr.
/// master p, m, v [n] fp32; grad [n] in TG; out [n] in TO or null. No clamping or masking:
/// a NaN or Inf gradient propagates into m, v and p (the trainer detects it from the norm).
template <int K, typename TG, typename TO>
__global__ void adamw_kernel(float* p, const TG* grad, float* m, float* v, TO* out, int64_t n,
                             Backend::AdamWArgs a) {
  const int64_t base = global_index() * K;
  if (base >= n) return;
  const int cnt = chunk_count<K>(n, base);
  float pv[K], gv[K], mv[K], vv[K];
  load_chunk<K>(pv, p + base, cnt);
  load_chunk<K>(gv, grad + base, cnt);
  load_chunk<K>(mv, m + base, cnt);
  load_chunk<K>(vv, v + base, cnt);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const float g = gv[k] * a.grad_scale;
    mv[k] = a.beta1 * mv[k] + (1.0f - a.beta1) * g;
    vv[k] = a.beta2 * vv[k] + (1.0f - a.beta2) * g * g;
    const float mhat = mv[k] / a.bias_correction1;
    const float vhat = vv[k] / a.bias_correction2;
    pv[k] -= a.lr * (mhat / (sqrtf(vhat) + a.eps) + a.weight_decay * pv[k]);
  }
  store_chunk<K>(m + base, mv, cnt);
  store_chunk<K>(v + base, vv, cnt);
  store_chunk<K>(p + base, pv, cnt);
  if (out != nullptr) store_chunk<K>(out + base, pv, cnt);
}

/// SGD with momentum / Nesterov, torch.optim.SGD with dampening 0, exactly the formula of
/// Backend::sgd:
///   g = grad·grad_scale + wd·p; buf ← first_step ? g : μ·buf + g (when μ != 0);
///   d = nesterov ? g + μ·buf : buf (d = g when μ = 0); p ← p − lr·d; out = (TO) p when
///   out != nullptr.
/// master p [n] fp32; grad [n] in TG; buf [n] fp32, or null when μ = 0; out [n] in TO or null.
template <int K, typename TG, typename TO>
__global__ void sgd_kernel(float* p, const TG* grad, float* buf, TO* out, int64_t n,
                           Backend::SgdArgs a) {
  const int64_t base = global_index() * K;
  if (base >= n) return;
  const int cnt = chunk_count<K>(n, base);
  float pv[K], gv[K], bv[K];
  load_chunk<K>(pv, p + base, cnt);
  load_chunk<K>(gv, grad + base, cnt);
  if (buf != nullptr && !a.first_step) load_chunk<K>(bv, buf + base, cnt);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const float g = gv[k] * a.grad_scale + a.weight_decay * pv[k];
    float d = g;
    if (buf != nullptr) {
      bv[k] = a.first_step ? g : a.momentum * bv[k] + g;
      d = a.nesterov ? g + a.momentum * bv[k] : bv[k];
    }
    pv[k] -= a.lr * d;
  }
  if (buf != nullptr) store_chunk<K>(buf + base, bv, cnt);
  store_chunk<K>(p + base, pv, cnt);
  if (out != nullptr) store_chunk<K>(out + base, pv, cnt);
}

// ==== host helpers =============================================================================

/// printf-style formatting into a std::string.
__attribute__((format(printf, 1, 2))) std::string strf(const char* f, ...) {
  va_list args;
  va_start(args, f);
  va_list copy;
  va_copy(copy, args);
  const int n = std::vsnprintf(nullptr, 0, f, copy);
  va_end(copy);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(out.data(), out.size() + 1, f, args);
  va_end(args);
  return out;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename... P>
bool all_aligned(const P*... p) {
  return (aligned16(p) && ...);
}

/// Blocks for `chunks` work items at kBlock threads each.
unsigned blocks_for(int64_t chunks) { return ceil_div(static_cast<size_t>(chunks), kBlock); }

/// Calls f.template operator()<K>() with K = kVec when `vectorize`, else 1.
template <typename F>
void dispatch_vec(bool vectorize, F&& f) {
  if (vectorize)
    f.template operator()<kVec>();
  else
    f.template operator()<1>();
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 6) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? strf("%.0f B", bytes) : strf("%.2f %s", bytes, units[u]);
}

void require_float(const char* op, const char* name, const Tensor& t) {
  if (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16)
    throw RuntimeFailure(
        strf("cuda %s: %s must be a floating tensor, got %s", op, name, dtype_name(t.dtype)));
}

void require_dtype(const char* op, const char* name, const Tensor& t, DType dt) {
  if (t.dtype != dt)
    throw RuntimeFailure(
        strf("cuda %s: %s must be %s, got %s", op, name, dtype_name(dt), dtype_name(t.dtype)));
}

/// The attention kernels, from SHARDTRAIN_ATTENTION: unset, empty or "flash" selects the fused
/// kernels (cuda_flash_attention.cu) for bf16/fp16 compute; "materialized" selects the
/// materialized-probabilities kernels (cuda_attention.cu), which fp32 always uses (the tight
/// fp32 parity tests run on them), as do head sizes the fused kernels lack. Read once, at
/// construction: attention_saves_probs() must not change under a model that sized its buffers by
/// it. Throws ConfigError for any other value.
bool use_flash_attention(DType compute_dtype) {
  const char* v = std::getenv("SHARDTRAIN_ATTENTION");
  const std::string mode = v ? v : "";
  if (mode == "materialized") return false;
  if (!mode.empty() && mode != "flash")
    throw ConfigError(
        strf("SHARDTRAIN_ATTENTION=%s: expected \"flash\" (the default) or "
             "\"materialized\"",
             v));
  // Head sizes the fused kernels lack fall back to the materialized ones (flash_for()).
  return compute_dtype == DType::kBF16 || compute_dtype == DType::kF16;
}

// ==== caching allocator ========================================================================

/// cudaMalloc-backed caching allocator. Requests are rounded up (512 B granularity below 1 MiB,
/// 2 MiB at and above); freed blocks go to a free list ordered by size, and a request takes the
/// smallest cached block that fits and is at most twice the rounded request. Blocks are never
/// split or merged. When cudaMalloc fails, every cached block is released (after synchronizing
/// the stream) and the request retried once. Memory is handed out zero-filled (stream-ordered)
/// unless the caller asks for it uninitialized.
///
/// Accounting, as PyTorch's (torch.cuda.memory_allocated / memory_reserved): "allocated" counts
/// the bytes of the live requests (rounded to 512 B), "reserved" every block taken from
/// cudaMalloc, so a block larger than its request shows its slack in reserved only. A graph's
/// temporaries (below) are reserved, not allocated, between its replays (as in PyTorch's private
/// graph pools); each replay raises the peak allocated by what they held at the capture's peak.
class CachingAllocator {
 public:
  static constexpr size_t kSmallGranularity = 512;
  static constexpr size_t kLargeThreshold = size_t{1} << 20;
  static constexpr size_t kLargeGranularity = size_t{2} << 20;

  CachingAllocator(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;
  ~CachingAllocator() { release_everything(); }

  void* allocate(size_t bytes, bool zero_fill = true) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t want = round_size(bytes);
    if (want == 0) throw_oom(bytes, cudaErrorMemoryAllocation);  // overflowed: absurd request
    void* p = nullptr;
    size_t got = 0;
    // While a graph is captured, the blocks its work freed come first (they are its own).
    if (capturing_) std::tie(p, got) = take_cached(captured_free_, want);
    if (p == nullptr) std::tie(p, got) = take_cached(free_, want);
    if (p == nullptr) {
      cudaError_t err = cudaMalloc(&p, want);
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();  // clear the non-sticky error before going on
        release_cached_locked();
        err = cudaMalloc(&p, want);
        if (err == cudaErrorMemoryAllocation) {
          (void)cudaGetLastError();
          throw_oom(bytes, err);
        }
      }
      ST_CUDA_CHECK(err);
      got = want;
      reserved_ += got;
      peak_reserved_ = std::max(peak_reserved_, reserved_);
    }
    const size_t used = round_up(bytes, kSmallGranularity);
    live_.emplace(p, Block{got, used, next_id_++});
    allocated_ += used;
    peak_allocated_ = std::max(peak_allocated_, allocated_);
    if (capturing_) capture_peak_ = std::max(capture_peak_, allocated_);
    const cudaError_t err = zero_fill ? cudaMemsetAsync(p, 0, want, stream_) : cudaSuccess;
    if (err != cudaSuccess) {
      live_.erase(p);
      allocated_ -= used;
      free_.emplace(got, p);
      ST_CUDA_CHECK(err);
    }
    return p;
  }

  void deallocate(void* p) noexcept {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) {
      // Not ours (or freed twice): a bug in the caller. Keep going without corrupting the books.
      std::fprintf(stderr, "shardtrain: cuda deallocate of unknown pointer %p ignored\n", p);
      return;
    }
    allocated_ -= it->second.used;
    if (pinned_.erase(it->second.id) > 0) ++invalidations_;
    (capturing_ ? captured_free_ : free_).emplace(it->second.size, p);
    live_.erase(it);
  }

  // ---- CUDA graphs (Backend::capture) ----------------------------------------------------------
  // A replayed graph writes to the addresses it was captured with. So the blocks its work freed
  // during the capture (its temporaries) stay reserved for it until it is destroyed, and the
  // blocks live at the end of the capture (activations, parameters, workspaces) are pinned:
  // freeing one of them afterwards invalidates every graph (invalidations() changes).

  /// What a captured graph holds: its temporaries (size, block), the ids of the blocks it pins,
  /// and the bytes its temporaries' live requests reached (the capture's peak allocated above
  /// what was live at its end).
  struct GraphMemory {
    std::vector<std::pair<size_t, void*>> held;
    std::vector<uint64_t> pinned;
    size_t transient_peak = 0;
  };

  void begin_capture() {
    std::lock_guard<std::mutex> lock(mu_);
    ST_ASSERT(!capturing_);
    capturing_ = true;
    capture_peak_ = allocated_;
  }
  /// Ends the capture; the temporaries become the graph's, the live blocks are pinned.
  GraphMemory end_capture() {
    std::lock_guard<std::mutex> lock(mu_);
    capturing_ = false;
    GraphMemory g;
    g.held.assign(captured_free_.begin(), captured_free_.end());
    captured_free_.clear();
    g.transient_peak = capture_peak_ - allocated_;
    for (const auto& [p, b] : live_) {
      ++pinned_[b.id];
      g.pinned.push_back(b.id);
    }
    return g;
  }
  /// Returns a destroyed (or failed) graph's memory; its temporaries are cached again.
  void release_graph(const GraphMemory& g) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [size, p] : g.held) free_.emplace(size, p);
    for (uint64_t id : g.pinned) {
      auto it = pinned_.find(id);
      if (it != pinned_.end() && --it->second == 0) pinned_.erase(it);
    }
  }
  /// A replay of a graph holding `g` is enqueued: its temporaries are in use while it runs.
  void note_replay(const GraphMemory& g) {
    std::lock_guard<std::mutex> lock(mu_);
    peak_allocated_ = std::max(peak_allocated_, allocated_ + g.transient_peak);
  }
  /// Counts the frees of pinned blocks: a graph captured when it read v is valid while it is v.
  uint64_t invalidations() const {
    std::lock_guard<std::mutex> lock(mu_);
    return invalidations_;
  }

  /// Returns every cached (free) block to CUDA. Blocks in use are untouched.
  void release_cached() {
    std::lock_guard<std::mutex> lock(mu_);
    release_cached_locked();
  }

  size_t allocated() const { return locked(allocated_); }
  size_t peak_allocated() const { return locked(peak_allocated_); }
  size_t reserved() const { return locked(reserved_); }
  size_t peak_reserved() const { return locked(peak_reserved_); }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_allocated_ = allocated_;
    peak_reserved_ = reserved_;
  }

 private:
  static size_t round_up(size_t bytes, size_t g) {
    return (std::max<size_t>(bytes, 1) + g - 1) / g * g;
  }
  /// 0 when the rounded size would overflow.
  static size_t round_size(size_t bytes) {
    bytes = std::max<size_t>(bytes, 1);
    const size_t g = bytes >= kLargeThreshold ? kLargeGranularity : kSmallGranularity;
    if (bytes > SIZE_MAX - g) return 0;
    return (bytes + g - 1) / g * g;
  }

  size_t locked(const size_t& v) const {
    std::lock_guard<std::mutex> lock(mu_);
    return v;
  }

  /// The smallest block of `cache` that fits `want` and is at most twice it, taken out of the
  /// cache; {nullptr, 0} when none.
  static std::pair<void*, size_t> take_cached(std::multimap<size_t, void*>& cache, size_t want) {
    auto it = cache.lower_bound(want);
    if (it == cache.end() || it->first > 2 * want) return {nullptr, 0};
    const std::pair<void*, size_t> got{it->second, it->first};
    cache.erase(it);
    return got;
  }

  void release_cached_locked() {
    // Blocks on the free list may still be in use by enqueued kernels (stream-ordered reuse).
    ST_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (auto& [size, p] : free_) {
      ST_CUDA_CHECK(cudaFree(p));
      reserved_ -= size;
    }
    free_.clear();
  }

  void release_everything() noexcept {
    (void)cudaStreamSynchronize(stream_);
    for (auto& [size, p] : free_) (void)cudaFree(p);
    for (auto& [size, p] : captured_free_) (void)cudaFree(p);
    for (auto& [p, b] : live_) (void)cudaFree(p);
    captured_free_.clear();
    free_.clear();
    live_.clear();
    reserved_ = allocated_ = 0;
    (void)cudaGetLastError();
  }

  [[noreturn]] void throw_oom(size_t bytes, cudaError_t err) {
    size_t free_mem = 0, total_mem = 0;
    if (cudaMemGetInfo(&free_mem, &total_mem) != cudaSuccess) (void)cudaGetLastError();
    throw RuntimeFailure(strf(
        "CUDA out of memory on cuda:%d: could not allocate %s (%zu bytes; %s). shardtrain holds %s "
        "in tensors and %s reserved by its caching allocator; the device has %s free of %s. Lower "
        "--batch-size or --max-length, enable --activation-checkpointing, or use a ZeRO strategy "
        "(--strategy zero2/zero3) or offload",
        device_, format_bytes(static_cast<double>(bytes)).c_str(), bytes, cudaGetErrorString(err),
        format_bytes(static_cast<double>(allocated_)).c_str(),
        format_bytes(static_cast<double>(reserved_)).c_str(),
        format_bytes(static_cast<double>(free_mem)).c_str(),
        format_bytes(static_cast<double>(total_mem)).c_str()));
  }

  int device_;
  cudaStream_t stream_;
  mutable std::mutex mu_;
  struct Block {
    size_t size;  ///< of the block (reserved)
    size_t used;  ///< the request rounded to 512 B (allocated)
    uint64_t id;  ///< unique over the allocator's life (an address may come back)
  };
  std::unordered_map<void*, Block> live_;       ///< blocks in use
  std::multimap<size_t, void*> free_;           ///< size -> block, cached
  std::multimap<size_t, void*> captured_free_;  ///< freed during the capture in progress
  std::unordered_map<uint64_t, int> pinned_;    ///< block id -> graphs pinning it
  bool capturing_ = false;
  uint64_t next_id_ = 0, invalidations_ = 0;
  size_t allocated_ = 0, peak_allocated_ = 0, reserved_ = 0, peak_reserved_ = 0;
  size_t capture_peak_ = 0;  ///< allocated_'s peak during the capture in progress
};

}  // namespace

/// StreamClock of timing CUDA events recorded on the compute stream, reused after each read.
class CudaStreamClock final : public StreamClock {
 public:
  CudaStreamClock(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaStreamClock() override {
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  }
  void mark() override {
    ST_CUDA_CHECK(cudaSetDevice(device_));
    if (used_ == events_.size()) {
      cudaEvent_t e = nullptr;
      ST_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    ST_CUDA_CHECK(cudaEventRecord(events_[used_++], stream_));
  }
  std::vector<double> intervals() override {
    std::vector<double> out;
    if (used_ == 0) return out;
    ST_CUDA_CHECK(cudaEventSynchronize(events_[used_ - 1]));
    for (size_t i = 1; i < used_; ++i) {
      float ms = 0;
      ST_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i - 1], events_[i]));
      out.push_back(1e-3 * ms);
    }
    used_ = 0;
    return out;
  }

 private:
  int device_;
  cudaStream_t stream_;
  std::vector<cudaEvent_t> events_;
  size_t used_ = 0;
};

// ==== the backend ==============================================================================

class CudaBackend final : public Backend {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  CudaBackend(int device_index, DType compute_dtype) : dtype_(compute_dtype) {
    if (compute_dtype != DType::kF32 && compute_dtype != DType::kBF16 &&
        compute_dtype != DType::kF16)
      throw ConfigError(strf("cuda backend: compute dtype must be fp32, bf16 or fp16, got %s",
                             dtype_name(compute_dtype)));
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      throw RuntimeFailure(strf(
          "--device cuda: no CUDA GPU is visible (cudaGetDeviceCount: %s); check nvidia-smi and "
          "CUDA_VISIBLE_DEVICES, or use --device cpu",
          err != cudaSuccess
              ? strf("%s: %s", cudaGetErrorName(err), cudaGetErrorString(err)).c_str()
              : "0 devices"));
    }
    if (device_index < 0 || device_index >= count)
      throw RuntimeFailure(
          strf("--device cuda:%d: there is no such GPU: %d CUDA GPU%s visible (cuda:0%s); check "
               "CUDA_VISIBLE_DEVICES or pick another device",
               device_index, count, count == 1 ? " is" : "s are",
               count > 1 ? strf("..cuda:%d", count - 1).c_str() : ""));
    device_ = device_index;
    flash_ = use_flash_attention(compute_dtype);
    try {
      init();
    } catch (...) {
      release();
      throw;
    }
  }

  ~CudaBackend() override { release(); }

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  DeviceKind kind() const override { return DeviceKind::kCUDA; }
  std::string description() const override { return description_; }
  DType compute_dtype() const override { return dtype_; }
  void* native_stream() const override { return ctx_.stream; }
  std::unique_ptr<StreamClock> make_stream_clock() override {
    return std::make_unique<CudaStreamClock>(device_, ctx_.stream);
  }

  // ---- memory ------------------------------------------------------------------------------
  void* allocate(size_t bytes) override {
    activate();
    return alloc_->allocate(bytes);
  }
  void* allocate_uninitialized(size_t bytes) override {
    activate();
    return alloc_->allocate(bytes, /*zero_fill=*/false);
  }
  void deallocate(void* ptr) noexcept override {
    if (ptr == nullptr) return;
    // Returning a block to the cache makes no CUDA call: no device to make current.
    alloc_->deallocate(ptr);
  }
  void* allocate_pinned(size_t bytes) override {
    void* p = pinned_allocate(device_, bytes, pinned_bytes_);
    pinned_bytes_ += bytes;
    return p;
  }
  void free_pinned(void* ptr, size_t bytes) noexcept override {
    if (ptr == nullptr) return;
    pinned_free(device_, ptr);
    pinned_bytes_ -= bytes;
  }
  std::unique_ptr<CopyStream> make_copy_stream() override {
    return cuda::make_copy_stream(device_, ctx_.stream);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    activate();
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx_.stream));
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    activate();
    // Ordered after the work already on the stream (e.g. the zero-fill of a fresh allocation).
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx_.stream));
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  void copy_from_host_async(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    activate();
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx_.stream));
  }
  std::unique_ptr<Graph> capture(const std::function<void()>& body) override;
  /// Device-to-device, enqueued on the compute stream (ordered with every op; not blocking).
  /// The ranges must not overlap.
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    activate();
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx_.stream));
  }
  void fill_zero(Tensor t) override {
    if (t.empty() || t.bytes() == 0) return;
    activate();
    ST_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.bytes(), ctx_.stream));
  }
  void synchronize() override {
    activate();
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  size_t allocated_bytes() const override { return alloc_->allocated(); }
  size_t peak_allocated_bytes() const override { return alloc_->peak_allocated(); }
  void reset_peak_memory() override { alloc_->reset_peak(); }

  /// Bytes obtained from cudaMalloc (in use + cached), and the peak since start or
  /// reset_peak_memory().
  size_t reserved_bytes() const { return alloc_->reserved(); }
  size_t peak_reserved_bytes() const { return alloc_->peak_reserved(); }
  /// Returns the allocator's cached blocks to CUDA (e.g. before handing memory to NCCL).
  void empty_cache() {
    activate();
    alloc_->release_cached();
  }
  const CudaContext& context() const { return ctx_; }

  // ---- dtype conversion --------------------------------------------------------------------
  void convert(Tensor dst, Tensor src) override {
    ST_ASSERT(dst.numel() == src.numel());
    activate();
    if (dst.dtype == src.dtype) {
      copy(dst.data, src.data, src.bytes());
      return;
    }
    require_float("convert", "dst", dst);
    require_float("convert", "src", src);
    const int64_t n = src.numel();
    if (n == 0) return;
    dispatch_float(dst.dtype, [&]<typename TD>() {
      dispatch_float(src.dtype, [&]<typename TS>() {
        dispatch_vec(all_aligned(dst.data, src.data), [&]<int K>() {
          convert_kernel<K, TD, TS><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx_.stream>>>(
              dst.as<TD>(), src.as<TS>(), n);
          ST_CUDA_LAUNCH_CHECK();
        });
      });
    });
  }

  // ---- embedding ---------------------------------------------------------------------------
  void embedding_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                         const Dropout& dropout) override {
    const char* op = "embedding_forward";
    const int64_t B = out.dim(0), Tn = out.dim(1), C = out.dim(2), N = B * Tn, V = wte.dim(0);
    require_dtype(op, "tokens", tokens, DType::kI32);
    require_float(op, "out", out);
    require_dtype(op, "wte", wte, out.dtype);
    require_dtype(op, "wpe", wpe, out.dtype);
    ST_ASSERT(tokens.numel() == N && wte.dim(1) == C && wpe.dim(1) == C && Tn <= wpe.dim(0));
    if (N == 0) return;
    activate();
    dispatch_float(out.dtype, [&]<typename T>() {
      dispatch_vec(C % kVec == 0 && all_aligned(out.data, wte.data, wpe.data), [&]<int K>() {
        dispatch_dropout(dropout, [&]<bool kDrop>() {
          embedding_forward_kernel<K, T, kDrop>
              <<<blocks_for(N * (C / K)), kBlock, 0, ctx_.stream>>>(
                  out.as<T>(), tokens.as<int32_t>(), wte.as<T>(), wpe.as<T>(), N, Tn, C, V, dropout,
                  dropout.threshold(), dropout.scale());
          ST_CUDA_LAUNCH_CHECK();
        });
      });
    });
  }

  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                          const Dropout& dropout) override {
    const char* op = "embedding_backward";
    const int64_t B = dout.dim(0), Tn = dout.dim(1), C = dout.dim(2), N = B * Tn;
    require_dtype(op, "tokens", tokens, DType::kI32);
    require_float(op, "dout", dout);
    // Either part may be skipped (empty dwte or dwpe).
    if (!dwte.empty()) {
      require_dtype(op, "dwte", dwte, dout.dtype);
      ST_ASSERT(tokens.numel() == N && dwte.dim(1) == C);
    }
    if (!dwpe.empty()) {
      require_dtype(op, "dwpe", dwpe, dout.dtype);
      ST_ASSERT(dwpe.dim(1) == C && Tn <= dwpe.dim(0));
    }
    if (N >= (int64_t{1} << 31))
      throw RuntimeFailure(
          strf("cuda %s: %lld rows exceed the int32 sort", op, static_cast<long long>(N)));
    if (N == 0) return;
    activate();
    const uint32_t thresh = dropout.threshold();
    const float keep_scale = dropout.scale();

    if (!dwte.empty()) {
      const int64_t V = dwte.dim(0);
      const auto n = static_cast<int32_t>(N);
      // Scratch: sorted keys, row indices in and out, then cub's temporary storage.
      size_t temp_bytes = 0;
      ST_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
          nullptr, temp_bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
          static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n, 0, 32,
          ctx_.stream));
      const size_t ints = (static_cast<size_t>(N) * sizeof(int32_t) + 255) / 256 * 256;
      char* scratch = static_cast<char*>(ctx_.get_scratch(3 * ints + temp_bytes));
      auto* keys_out = reinterpret_cast<int32_t*>(scratch);
      auto* rows_in = reinterpret_cast<int32_t*>(scratch + ints);
      auto* rows_out = reinterpret_cast<int32_t*>(scratch + 2 * ints);
      void* temp = scratch + 3 * ints;

      iota_kernel<<<blocks_for(N), kBlock, 0, ctx_.stream>>>(rows_in, n);
      ST_CUDA_LAUNCH_CHECK();
      // LSD radix sort is stable: rows of one token stay in increasing order.
      ST_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, tokens.as<const int32_t>(),
                                                    keys_out, rows_in, rows_out, n, 0, 32,
                                                    ctx_.stream));
      dispatch_float(dout.dtype, [&]<typename T>() {
        const dim3 grid(static_cast<unsigned>(N), ceil_div(static_cast<size_t>(C), kBlock));
        dispatch_dropout(dropout, [&]<bool kDrop>() {
          embedding_dwte_kernel<T, kDrop><<<grid, kBlock, 0, ctx_.stream>>>(
              dwte.as<T>(), dout.as<T>(), keys_out, rows_out, n, C, V, dropout, thresh, keep_scale);
          ST_CUDA_LAUNCH_CHECK();
        });
      });
    }
    if (!dwpe.empty()) {
      dispatch_float(dout.dtype, [&]<typename T>() {
        dispatch_dropout(dropout, [&]<bool kDrop>() {
          embedding_dwpe_kernel<T, kDrop><<<blocks_for(Tn * C), kBlock, 0, ctx_.stream>>>(
              dwpe.as<T>(), dout.as<T>(), B, Tn, C, dropout, thresh, keep_scale);
          ST_CUDA_LAUNCH_CHECK();
        });
      });
    }
  }

  // ---- layernorm ---------------------------------------------------------------------------
  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                         Tensor bias) override {
    const char* op = "layernorm_forward";
    const int64_t C = inp.dim(-1), N = inp.numel() / C;
    require_float(op, "inp", inp);
    require_dtype(op, "out", out, inp.dtype);
    require_dtype(op, "weight", weight, inp.dtype);
    require_dtype(op, "bias", bias, inp.dtype);
    require_dtype(op, "mean", mean, DType::kF32);
    require_dtype(op, "rstd", rstd, DType::kF32);
    ST_ASSERT(out.numel() == N * C && weight.numel() == C && bias.numel() == C &&
              mean.numel() == N && rstd.numel() == N);
    if (N == 0) return;
    activate();
    const unsigned rows_per_block = kBlock / 32;
    dispatch_float(inp.dtype, [&]<typename T>() {
      const bool vec = C % kVec == 0 && all_aligned(out.data, inp.data, weight.data, bias.data);
      dispatch_vec(vec, [&]<int K>() {
        layernorm_forward_kernel<K, T>
            <<<ceil_div(static_cast<size_t>(N), rows_per_block), kBlock, 0, ctx_.stream>>>(
                out.as<T>(), mean.as<float>(), rstd.as<float>(), inp.as<T>(), weight.as<T>(),
                bias.as<T>(), N, C);
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  }

  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                          Tensor weight, Tensor mean, Tensor rstd) override {
    const char* op = "layernorm_backward";
    const int64_t C = inp.dim(-1), N = inp.numel() / C;
    require_float(op, "inp", inp);
    for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"dinp", dinp},
                                  {"dweight", dweight},
                                  {"dbias", dbias},
                                  {"dout", dout},
                                  {"weight", weight}})
      require_dtype(op, name, t, inp.dtype);
    require_dtype(op, "mean", mean, DType::kF32);
    require_dtype(op, "rstd", rstd, DType::kF32);
    ST_ASSERT(dinp.numel() == N * C && dout.numel() == N * C && weight.numel() == C &&
              dweight.numel() == C && dbias.numel() == C && mean.numel() == N && rstd.numel() == N);
    if (N == 0) return;
    activate();
    // Parameter gradients: G groups of R consecutive rows (G ≤ 1024), partials in scratch.
    const int64_t R = std::max<int64_t>(32, (N + 1023) / 1024);
    const int64_t G = (N + R - 1) / R;
    auto* part = static_cast<float*>(ctx_.get_scratch(2 * static_cast<size_t>(G * C) * 4));
    float* part_dw = part;
    float* part_db = part + G * C;
    const unsigned rows_per_block = kBlock / 32;
    dispatch_float(inp.dtype, [&]<typename T>() {
      const bool vec = C % kVec == 0 && all_aligned(dinp.data, dout.data, inp.data, weight.data);
      dispatch_vec(vec, [&]<int K>() {
        layernorm_backward_dinp_kernel<K, T>
            <<<ceil_div(static_cast<size_t>(N), rows_per_block), kBlock, 0, ctx_.stream>>>(
                dinp.as<T>(), dout.as<T>(), inp.as<T>(), weight.as<T>(), mean.as<float>(),
                rstd.as<float>(), N, C);
        ST_CUDA_LAUNCH_CHECK();
      });
      const dim3 grid(static_cast<unsigned>(G), ceil_div(static_cast<size_t>(C), kBlock));
      layernorm_backward_partials_kernel<T><<<grid, kBlock, 0, ctx_.stream>>>(
          part_dw, part_db, dout.as<T>(), inp.as<T>(), mean.as<float>(), rstd.as<float>(), N, C, R);
      ST_CUDA_LAUNCH_CHECK();
      layernorm_backward_reduce_kernel<T><<<blocks_for(C), kBlock, 0, ctx_.stream>>>(
          dweight.as<T>(), dbias.as<T>(), part_dw, part_db, G, C);
      ST_CUDA_LAUNCH_CHECK();
    });
  }

  // ---- linear layers (cuda_matmul.cu) ------------------------------------------------------
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Epilogue epilogue,
                      Tensor pre_gelu) override {
    activate();
    cuda::matmul_forward(ctx_, out, inp, weight, bias, epilogue, pre_gelu);
  }
  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, Tensor dinp_gelu_input) override {
    activate();
    cuda::matmul_backward(ctx_, dinp, dweight, dbias, dout, inp, weight, dinp_gelu_input);
  }

  // ---- GELU --------------------------------------------------------------------------------
  void gelu_forward(Tensor out, Tensor inp) override {
    require_float("gelu_forward", "inp", inp);
    require_dtype("gelu_forward", "out", out, inp.dtype);
    ST_ASSERT(out.numel() == inp.numel());
    const int64_t n = inp.numel();
    if (n == 0) return;
    activate();
    dispatch_float(inp.dtype, [&]<typename T>() {
      dispatch_vec(all_aligned(out.data, inp.data), [&]<int K>() {
        gelu_forward_kernel<K, T>
            <<<blocks_for((n + K - 1) / K), kBlock, 0, ctx_.stream>>>(out.as<T>(), inp.as<T>(), n);
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  }

  void gelu_backward(Tensor dinp, Tensor inp, Tensor dout) override {
    require_float("gelu_backward", "inp", inp);
    require_dtype("gelu_backward", "dinp", dinp, inp.dtype);
    require_dtype("gelu_backward", "dout", dout, inp.dtype);
    ST_ASSERT(dinp.numel() == inp.numel() && dout.numel() == inp.numel());
    const int64_t n = inp.numel();
    if (n == 0) return;
    activate();
    dispatch_float(inp.dtype, [&]<typename T>() {
      dispatch_vec(all_aligned(dinp.data, inp.data, dout.data), [&]<int K>() {
        gelu_backward_kernel<K, T><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx_.stream>>>(
            dinp.as<T>(), inp.as<T>(), dout.as<T>(), n);
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  }

  void add(Tensor out, Tensor a, Tensor b, const Dropout& dropout_b) override {
    require_float("add", "out", out);
    require_dtype("add", "a", a, out.dtype);
    require_dtype("add", "b", b, out.dtype);
    ST_ASSERT(a.numel() == out.numel() && b.numel() == out.numel());
    const int64_t n = out.numel();
    if (n == 0) return;
    activate();
    dispatch_float(out.dtype, [&]<typename T>() {
      dispatch_vec(all_aligned(out.data, a.data, b.data), [&]<int K>() {
        dispatch_dropout(dropout_b, [&]<bool kDrop>() {
          add_kernel<K, T, kDrop><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx_.stream>>>(
              out.as<T>(), a.as<T>(), b.as<T>(), n, dropout_b, dropout_b.threshold(),
              dropout_b.scale());
          ST_CUDA_LAUNCH_CHECK();
        });
      });
    });
  }

  void dropout_backward(Tensor dst, Tensor src, const Dropout& dropout) override {
    require_float("dropout_backward", "src", src);
    require_dtype("dropout_backward", "dst", dst, src.dtype);
    ST_ASSERT(dst.numel() == src.numel());
    const int64_t n = src.numel();
    if (n == 0) return;
    activate();
    if (!dropout.active()) {
      if (dst.data != src.data)
        ST_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice,
                                      ctx_.stream));
      return;
    }
    dispatch_float(src.dtype, [&]<typename T>() {
      dispatch_vec(all_aligned(dst.data, src.data), [&]<int K>() {
        dropout_backward_kernel<K, T><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx_.stream>>>(
            dst.as<T>(), src.as<T>(), n, dropout, dropout.threshold(), dropout.scale());
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  }

  // ---- attention (cuda_attention.cu; cuda_flash_attention.cu when flash_) ------------------
  void attention_forward(Tensor out, AttentionSaved saved, Tensor qkv, int num_heads,
                         const Dropout& dropout) override {
    activate();
    if (flash_for(qkv.dim(2) / 3 / num_heads))
      cuda::flash_attention_forward(ctx_, out, saved.lse, qkv, num_heads, dropout);
    else
      cuda::attention_forward(ctx_, out, saved, qkv, num_heads, dropout);
  }
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, AttentionSaved saved,
                          int num_heads, const Dropout& dropout) override {
    activate();
    if (flash_for(qkv.dim(2) / 3 / num_heads))
      cuda::flash_attention_backward(ctx_, dqkv, dout, qkv, out, saved.lse, num_heads, dropout);
    else
      cuda::attention_backward(ctx_, dqkv, dout, qkv, out, saved, num_heads, dropout);
  }
  bool attention_saves_probs(int head_size) const override { return !flash_for(head_size); }
  DType attention_probs_dtype() const override { return dtype_; }

  // ---- cross-entropy -----------------------------------------------------------------------
  void softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, float grad_scale,
                             int64_t vocab) override {
    cross_entropy(losses, logits, targets, vocab, grad_scale, true);
  }
  void cross_entropy_forward(Tensor losses, Tensor logits, Tensor targets, int64_t vocab) override {
    cross_entropy(losses, logits, targets, vocab, 0.0f, false);
  }
  /// A multiple of 64: cuBLASLt's fast kernels need the GEMM dimension a multiple of 8
  /// (cuda_matmul.cu, "padding an awkward OC"); 64 also keeps every row 128-byte aligned.
  int64_t padded_columns(int64_t oc) const override { return (oc + 63) / 64 * 64; }

  // ---- reductions and optimizer ------------------------------------------------------------
  double sum_squares(Tensor x) override { return reduce(x, true); }
  double sum(Tensor x) override { return reduce(x, false); }

  void quantize_int8(Tensor q, Tensor scales, Tensor x) override {
    require_float("quantize_int8", "x", x);
    require_dtype("quantize_int8", "q", q, DType::kU8);
    require_dtype("quantize_int8", "scales", scales, DType::kF32);
    activate();
    cuda::quantize_int8(ctx_, q, scales, x);
  }

  void dequantize_add_int8(Tensor out, Tensor q, Tensor scales) override {
    require_float("dequantize_add_int8", "out", out);
    require_dtype("dequantize_add_int8", "q", q, DType::kU8);
    require_dtype("dequantize_add_int8", "scales", scales, DType::kF32);
    activate();
    cuda::dequantize_add_int8(ctx_, out, q, scales);
  }

  void scale(Tensor x, float s) override {
    require_float("scale", "x", x);
    const int64_t n = x.numel();
    if (n == 0 || x.empty()) return;
    activate();
    dispatch_float(x.dtype, [&]<typename T>() {
      dispatch_vec(aligned16(x.data), [&]<int K>() {
        scale_kernel<K, T>
            <<<blocks_for((n + K - 1) / K), kBlock, 0, ctx_.stream>>>(x.as<T>(), s, n);
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  }

  void adamw(Tensor master, Tensor grad, Tensor m, Tensor v, Tensor params_out,
             const AdamWArgs& args) override {
    const char* op = "adamw";
    require_dtype(op, "master", master, DType::kF32);
    require_dtype(op, "m", m, DType::kF32);
    require_dtype(op, "v", v, DType::kF32);
    require_float(op, "grad", grad);
    const int64_t n = master.numel();
    ST_ASSERT(grad.numel() == n && m.numel() == n && v.numel() == n);
    // params_out aliasing the master (fp32 parameters) is the master itself: nothing to write.
    const bool has_out = !params_out.empty() && params_out.data != master.data;
    if (has_out) {
      require_float(op, "params_out", params_out);
      ST_ASSERT(params_out.numel() == n);
    }
    if (n == 0) return;
    activate();
    const DType out_dtype = has_out ? params_out.dtype : DType::kF32;
    const bool vec =
        all_aligned(master.data, grad.data, m.data, v.data, has_out ? params_out.data : nullptr);
    dispatch_float(grad.dtype, [&]<typename TG>() {
      dispatch_float(out_dtype, [&]<typename TO>() {
        dispatch_vec(vec, [&]<int K>() {
          adamw_kernel<K, TG, TO><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx_.stream>>>(
              master.as<float>(), grad.as<TG>(), m.as<float>(), v.as<float>(),
              has_out ? params_out.as<TO>() : nullptr, n, args);
          ST_CUDA_LAUNCH_CHECK();
        });
      });
    });
  }

  /// Convolution, batch norm, pooling and LSTM (cuda_image.h); cuDNN is loaded on first use, so
  /// GPT-2 runs never pay for it.
  ImageOps* image_ops() override {
    if (!image_ops_) {
      activate();
      image_ops_ = make_cuda_image_ops(ctx_, *this);
    }
    return image_ops_.get();
  }

  void sgd(Tensor master, Tensor grad, Tensor momentum_buf, Tensor params_out,
           const SgdArgs& args) override {
    const char* op = "sgd";
    require_dtype(op, "master", master, DType::kF32);
    require_float(op, "grad", grad);
    const int64_t n = master.numel();
    const bool use_buf = args.momentum != 0.0f;
    ST_ASSERT(grad.numel() == n && (!args.nesterov || use_buf));
    if (use_buf) {
      require_dtype(op, "momentum_buf", momentum_buf, DType::kF32);
      ST_ASSERT(momentum_buf.numel() == n);
    }
    // params_out aliasing the master (fp32 parameters) is the master itself: nothing to write.
    const bool has_out = !params_out.empty() && params_out.data != master.data;
    if (has_out) {
      require_float(op, "params_out", params_out);
      ST_ASSERT(params_out.numel() == n);
    }
    if (n == 0) return;
    activate();
    const DType out_dtype = has_out ? params_out.dtype : DType::kF32;
    const bool vec = all_aligned(master.data, grad.data, use_buf ? momentum_buf.data : nullptr,
                                 has_out ? params_out.data : nullptr);
    dispatch_float(grad.dtype, [&]<typename TG>() {
      dispatch_float(out_dtype, [&]<typename TO>() {
        dispatch_vec(vec, [&]<int K>() {
          sgd_kernel<K, TG, TO><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx_.stream>>>(
              master.as<float>(), grad.as<TG>(), use_buf ? momentum_buf.as<float>() : nullptr,
              has_out ? params_out.as<TO>() : nullptr, n, args);
          ST_CUDA_LAUNCH_CHECK();
        });
      });
    });
  }

 private:
  void init() {
    ST_CUDA_CHECK(cudaSetDevice(device_));
    cudaDeviceProp prop{};
    ST_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    description_ = strf("%s (cuda:%d, %.1f GiB)", prop.name, device_,
                        static_cast<double>(prop.totalGlobalMem) / 1073741824.0);
    cudaFuncAttributes attr{};
    const cudaError_t probe = cudaFuncGetAttributes(&attr, probe_kernel);
    if (probe != cudaSuccess) {
      (void)cudaGetLastError();
      throw RuntimeFailure(strf(
          "--device cuda:%d: %s (compute capability %d.%d) cannot run this build's kernels (%s); "
          "reconfigure with -DCMAKE_CUDA_ARCHITECTURES=%d%d and rebuild",
          device_, prop.name, prop.major, prop.minor, cudaGetErrorString(probe), prop.major,
          prop.minor));
    }
    ctx_.device = device_;
    ctx_.sm_count = prop.multiProcessorCount;
    ST_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking));
    ST_CUBLAS_CHECK(cublasLtCreate(&ctx_.lt));
    ST_CUBLAS_CHECK(cublasCreate(&ctx_.blas));
    ST_CUBLAS_CHECK(cublasSetStream(ctx_.blas, ctx_.stream));
    alloc_ = std::make_unique<CachingAllocator>(device_, ctx_.stream);
    ctx_.workspace = alloc_->allocate(kWorkspaceBytes);
    ctx_.workspace_bytes = kWorkspaceBytes;
    // cuBLAS shares the workspace: both handles only ever run on the compute stream, in order.
    ST_CUBLAS_CHECK(cublasSetWorkspace(ctx_.blas, ctx_.workspace, kWorkspaceBytes));
    ctx_.scratch = &CudaBackend::scratch_callback;
    ctx_.backend = this;
    ST_CUDA_CHECK(cudaMallocHost(&host_result_, sizeof(double)));
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }

  void release() noexcept {
    (void)cudaSetDevice(device_);
    if (ctx_.stream) (void)cudaStreamSynchronize(ctx_.stream);
    image_ops_.reset();  // its cuDNN handle uses the stream
    alloc_.reset();      // frees every block, the workspace and the scratch included
    ctx_.workspace = nullptr;
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    if (host_result_) (void)cudaFreeHost(host_result_);
    host_result_ = nullptr;
    if (ctx_.blas) (void)cublasDestroy(ctx_.blas);
    if (ctx_.lt) (void)cublasLtDestroy(ctx_.lt);
    if (ctx_.stream) (void)cudaStreamDestroy(ctx_.stream);
    ctx_.blas = nullptr;
    ctx_.lt = nullptr;
    ctx_.stream = nullptr;
    (void)cudaGetLastError();
  }

  /// Makes this backend's GPU current for the calling thread. Only a cudaGetDevice (a
  /// thread-local read) when it already is: cudaSetDevice itself is not free, and the caching
  /// allocator's callers reach this once per activation taken and returned (as PyTorch's
  /// c10::cuda::MaybeSetDevice).
  void activate() const {
    int current = -1;
    ST_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device_) ST_CUDA_CHECK(cudaSetDevice(device_));
  }

  static void* scratch_callback(void* self, size_t bytes) {
    return static_cast<CudaBackend*>(self)->grow_scratch(bytes);
  }

  /// Scratch of at least `bytes`, valid until the next call. Growing waits for the stream first:
  /// kernels already enqueued may still read or write the old buffer.
  void* grow_scratch(size_t bytes) {
    if (bytes <= scratch_bytes_) return scratch_;
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    alloc_->deallocate(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    const size_t want = std::max<size_t>(bytes, size_t{1} << 20);
    scratch_ = alloc_->allocate(want);
    scratch_bytes_ = want;
    return scratch_;
  }

  void cross_entropy(Tensor losses, Tensor logits, Tensor targets, int64_t V, float grad_scale,
                     bool write_grad) {
    const char* op = write_grad ? "softmax_cross_entropy" : "cross_entropy_forward";
    const int64_t ld = logits.dim(-1), N = logits.numel() / ld;
    if (V <= 0 || V > ld)
      throw RuntimeFailure(strf("cuda %s: vocabulary %lld does not fit rows of %lld columns", op,
                                static_cast<long long>(V), static_cast<long long>(ld)));
    require_float(op, "logits", logits);
    require_dtype(op, "losses", losses, DType::kF32);
    require_dtype(op, "targets", targets, DType::kI32);
    ST_ASSERT(losses.numel() == N && targets.numel() == N);
    if (N >= (int64_t{1} << 31))
      throw RuntimeFailure(strf("cuda %s: too many rows (%lld)", op, static_cast<long long>(N)));
    if (N == 0) return;
    activate();
    constexpr unsigned kThreads = 512;
    dispatch_float(logits.dtype, [&]<typename T>() {
      if (write_grad)
        cross_entropy_kernel<T, true><<<static_cast<unsigned>(N), kThreads, 0, ctx_.stream>>>(
            losses.as<float>(), logits.as<T>(), targets.as<int32_t>(), V, ld, grad_scale);
      else
        cross_entropy_kernel<T, false><<<static_cast<unsigned>(N), kThreads, 0, ctx_.stream>>>(
            losses.as<float>(), logits.as<T>(), targets.as<int32_t>(), V, ld, grad_scale);
      ST_CUDA_LAUNCH_CHECK();
    });
  }

  /// Σ x (or Σ x²) in fp64: a fixed grid of partial sums, then one block; blocking.
  double reduce(Tensor x, bool square) {
    require_float(square ? "sum_squares" : "sum", "x", x);
    const int64_t n = x.numel();
    if (n == 0 || x.empty()) return 0.0;
    activate();
    constexpr int64_t kMaxBlocks = 1024;
    double* part = static_cast<double*>(ctx_.get_scratch((kMaxBlocks + 1) * sizeof(double)));
    double* result = part + kMaxBlocks;
    int64_t G = 0;
    dispatch_float(x.dtype, [&]<typename T>() {
      dispatch_vec(aligned16(x.data), [&]<int K>() {
        G = std::min<int64_t>(kMaxBlocks, blocks_for((n + K - 1) / K));
        if (square)
          sum_partials_kernel<K, T, true>
              <<<static_cast<unsigned>(G), kBlock, 0, ctx_.stream>>>(part, x.as<T>(), n);
        else
          sum_partials_kernel<K, T, false>
              <<<static_cast<unsigned>(G), kBlock, 0, ctx_.stream>>>(part, x.as<T>(), n);
        ST_CUDA_LAUNCH_CHECK();
      });
    });
    sum_final_kernel<<<1, kBlock, 0, ctx_.stream>>>(result, part, G);
    ST_CUDA_LAUNCH_CHECK();
    ST_CUDA_CHECK(
        cudaMemcpyAsync(host_result_, result, sizeof(double), cudaMemcpyDeviceToHost, ctx_.stream));
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    return *host_result_;
  }

  int device_ = 0;
  DType dtype_;
  /// Whether attention over heads of `head_size` channels runs the fused kernels: the backend
  /// chose them (flash_) and they support that head size (32, 64, 128); else materialized.
  bool flash_for(int64_t head_size) const {
    return flash_ && cuda::flash_attention_supported(dtype_, static_cast<int>(head_size));
  }
  bool flash_ = false;  ///< fused attention (bf16/fp16 unless SHARDTRAIN_ATTENTION=materialized)
  std::string description_;
  CudaContext ctx_;
  std::unique_ptr<CachingAllocator> alloc_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  double* host_result_ = nullptr;        ///< pinned: the result of sum / sum_squares
  std::unique_ptr<ImageOps> image_ops_;  ///< made on first use
};

// ==== CUDA graphs
// =================================================================================

namespace {

/// An instantiated graph and the memory it holds (CachingAllocator::GraphMemory). Must not
/// outlive the backend that captured it.
class CudaGraph final : public Backend::Graph {
 public:
  CudaGraph(CachingAllocator& alloc, cudaStream_t stream, int device, cudaGraphExec_t exec,
            CachingAllocator::GraphMemory memory)
      : alloc_(alloc),
        stream_(stream),
        device_(device),
        exec_(exec),
        memory_(std::move(memory)),
        captured_at_(alloc.invalidations()) {}
  ~CudaGraph() override {
    (void)cudaSetDevice(device_);
    // Replays in flight still use the held temporaries; later work on the stream may reuse them
    // (stream order), so returning them needs no wait.
    (void)cudaGraphExecDestroy(exec_);
    alloc_.release_graph(memory_);
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  void replay() override {
    if (!valid()) throw RuntimeFailure("replay of an invalidated CUDA graph: capture it again");
    ST_CUDA_CHECK(cudaSetDevice(device_));
    ST_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    alloc_.note_replay(memory_);
  }
  bool valid() const override { return alloc_.invalidations() == captured_at_; }

 private:
  CachingAllocator& alloc_;
  cudaStream_t stream_;
  int device_;
  cudaGraphExec_t exec_;
  CachingAllocator::GraphMemory memory_;
  uint64_t captured_at_;
};

}  // namespace

std::unique_ptr<Backend::Graph> CudaBackend::capture(const std::function<void()>& body) {
  activate();
  // Relaxed: the body's allocations may still reach cudaMalloc (memory outside the graph, kept
  // by the allocator); everything it enqueues is on this stream.
  ST_CUDA_CHECK(cudaStreamBeginCapture(ctx_.stream, cudaStreamCaptureModeRelaxed));
  alloc_->begin_capture();
  cudaGraph_t graph = nullptr;
  const auto abandon = [&](const char* what, cudaError_t err) {
    CachingAllocator::GraphMemory memory = alloc_->end_capture();
    alloc_->release_graph(memory);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    return RuntimeFailure(strf("CUDA graph capture failed: %s (%s); the step runs without graphs",
                               what, cudaGetErrorString(err)));
  };
  try {
    body();
  } catch (...) {
    const cudaError_t err = cudaStreamEndCapture(ctx_.stream, &graph);
    (void)abandon("the captured work raised an error", err);
    throw;
  }
  cudaError_t err = cudaStreamEndCapture(ctx_.stream, &graph);
  if (err != cudaSuccess) throw abandon("ending the capture", err);
  cudaGraphExec_t exec = nullptr;
  err = cudaGraphInstantiate(&exec, graph, 0);
  if (err != cudaSuccess) throw abandon("instantiating the graph", err);
  (void)cudaGraphDestroy(graph);
  return std::make_unique<CudaGraph>(*alloc_, ctx_.stream, device_, exec, alloc_->end_capture());
}

}  // namespace shardtrain::cuda

namespace shardtrain {

std::unique_ptr<Backend> make_cuda_backend(int device_index, DType compute_dtype) {
  return std::make_unique<cuda::CudaBackend>(device_index, compute_dtype);
}

bool cuda_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

}  // namespace shardtrain
