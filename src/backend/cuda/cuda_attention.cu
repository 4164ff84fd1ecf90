// Causal multi-head self-attention on the GPU, materialized-probabilities design (the shape of
// llm.c's first CUDA attention), with the causal structure exploited by chunking.
//
// ---- math (Vaswani et al., arXiv 1706.03762, eq. 1, with a causal mask) ----------------------
// Per batch b and head h, with q, k, v ∈ R^{T×hs} the head's slices of qkv and scale = 1/sqrt(hs):
//   S = scale · q kᵀ                       S[t,t2] defined for t2 ≤ t (causal)
//   P = softmax_row(S)                     P[t,t2] = exp(S[t,t2] - m_t) / Σ_{t2'≤t} exp(S[t,t2'] - m_t),
//                                          m_t = max_{t2≤t} S[t,t2];  P[t,t2] = 0 for t2 > t
//   y = P v                                out[b,t,h·hs:(h+1)·hs] = y[t]
// Backward (softmax Jacobian: ∂P_j/∂S_i = P_j (δ_ij − P_i), so dS = P ⊙ (dP − rowsum(dP ⊙ P))):
//   dP = dy vᵀ,  dv = Pᵀ dy,  dS = scale · P ⊙ (dP − rowsum(dP ⊙ P)),  dq = dS k,  dk = dSᵀ q.
// Same formulas as backend/cpu/cpu_attention.cpp (the reference).
//
// ---- layouts and dtypes -----------------------------------------------------------------------
//   qkv  [B, T, 3C] = [B, T, 3, NH, hs]  (q | k | v, heads concatenated), compute dtype
//   out  [B, T, C]  = [B, T, NH, hs];  dout likewise;  dqkv [B, T, 3C] (OVERWRITTEN)
//   saved.probs [B, NH, T, T] in the compute dtype: the causal part t2 ≤ t (what backend.h
//            specifies), zeros for t < t2 < t1 (the row's chunk end); columns ≥ t1 are not written
// The GEMMs need one uniform stride per batch entry (b, h), which [B,T,3,NH,hs] lacks, so q, k, v
// (and dy) are first permuted to head-major [B, NH, T, hs] scratch copies ("split"), and results
// are permuted back ("merge"). Scores S and score gradients dP come out of the GEMMs in fp32
// (bf16 inputs, fp32 output), so the softmax and its backward read unrounded values; P and dS are
// stored in the compute dtype because they are GEMM inputs next to v, q, k. Every GEMM
// accumulates in fp32 (cublasGemmStridedBatchedEx, batch B·NH, CUBLAS_COMPUTE_32F; _PEDANTIC for
// fp32 tensors, so fp32 mode never uses TF32 whatever the handle's math mode) and each output
// element is written once (no accumulation across calls), then rounded once.
//
// ---- exploiting causality: chunks of Tc rows ------------------------------------------------------
// Forward, per query chunk [t0, t1): S[t0:t1, 0:t1] (GEMM), softmax of those rows (reading only
// t2 ≤ t), y[t0:t1] = P[t0:t1, 0:t1]·v[0:t1]. Keys beyond t1 are never touched: with n chunks the
// GEMMs do (n+1)/(2n) of the full T×T work (n = 4 at T = 1024: 62.5%).
// Backward, per query chunk: dP[t0:t1, 0:t1] = dy·vᵀ (fp32 chunk), dS rows (into a full [T, T]
// buffer per head, written only at t2 < t1), dq[t0:t1] = dS[t0:t1, 0:t1]·k[0:t1]; then per key chunk
// [k0, k1): dk[k0:k1] = dS[k0:T, k0:k1]ᵀ·q[k0:T] and dv[k0:k1] = P[k0:T, k0:k1]ᵀ·dy[k0:T] (only query
// rows t ≥ k0 see these keys). Key chunks avoid accumulating dk, dv over query chunks, which was
// 25% slower (each chunk re-read and re-wrote all of dk, dv).
// Tc = min(T, 256) (measured on an H200, GPT-2 medium/xl shapes: 256 and 512 tie; 128 is 10%
// slower, 64 30%, unchunked 10%). Everything is deterministic: a fixed sequence of GEMMs, one warp
// per softmax row with a fixed shuffle-reduction tree.
//
// ---- memory (es = bytes per element of the compute dtype; N = B·T; C = NH·hs;
//      Tc = min(T, 256); T8 = T rounded up to a multiple of 8; each piece padded to 256 bytes) -----
//   saved (held by the model per layer):  B·NH·T·T·es
//   forward scratch  (one get_scratch):   4·N·C·es (q, k, v, y)  + B·NH·Tc·T8·4 (S chunk, fp32)
//   backward scratch (one get_scratch):   7·N·C·es (q, k, v, dy, dq, dk, dv)
//                                         + B·NH·Tc·T8·4 (dP chunk, fp32) + B·NH·T·T·es (dS)
//   E.g. GPT-2 medium, B=16, T=1024, NH=16, hs=64, bf16: probs 512 MiB per layer; forward
//   scratch 128 + 256 MiB; backward 224 + 256 + 512 MiB (measured peaks 384 / 992 MiB).
// Speed (H200, bf16, B=16, T=1024, NH=16, hs=64): forward 0.82 ms, backward 1.22 ms per layer;
// PyTorch 2.11 SDPA on the same GPU: cuDNN 0.11 + 0.38 ms, flash 0.17 + 0.59 ms, math 5.1 + 5.1 ms.
// The next step is a flash-attention kernel (no T×T traffic, saves lse only).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <string>
#include <type_traits>
#include <utility>

#include "backend/cuda/cuda_ops.h"

namespace shardtrain::cuda {
namespace {


// ---- warp reductions (fixed xor tree: deterministic) ---------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- head permutes --------------------------------------------------------------------------------
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T>
struct Ptrs3 {
  T* p[3];
};

constexpr int kPermuteThreads = 128;

/// Split: dst[s] [B, NH, T, hs] ← src [B, T, NS, NH, hs] slot s, for s < NS. One block per token
/// (b, t); V elements per thread and step (vector loads/stores when aligned).
template <typename Tin, typename Tout, int V>
__global__ void __launch_bounds__(kPermuteThreads)
    split_heads_kernel(Ptrs3<Tout> dst, const Tin* src, int64_t T, int NS, int NH, int hs) {
  const int64_t bt = blockIdx.x;
  const int64_t b = bt / T, t = bt % T;
  const int hv = hs / V;
  const int per_slot = NH * hv;
  const int total = NS * per_slot;
  const Tin* row = src + bt * static_cast<int64_t>(NS) * NH * hs;
  for (int j = threadIdx.x; j < total; j += kPermuteThreads) {
    const int s = j / per_slot;
    const int rem = j - s * per_slot;
    const int h = rem / hv;
    const int i = rem - h * hv;
    const Pack<Tin, V> x =
        *reinterpret_cast<const Pack<Tin, V>*>(row + (static_cast<int64_t>(s) * NH + h) * hs + i * V);
    Pack<Tout, V> y;
#pragma unroll
    for (int e = 0; e < V; ++e) y.v[e] = from_float<Tout>(to_float(x.v[e]));
    Tout* to = dst.p[s] + ((b * NH + h) * T + t) * hs + i * V;
    *reinterpret_cast<Pack<Tout, V>*>(to) = y;
  }
}

/// Merge: dst [B, T, NS, NH, hs] ← src[s] [B, NH, T, hs], for s < NS (with dtype conversion).
template <typename Tin, typename Tout, int V>
__global__ void __launch_bounds__(kPermuteThreads)
    merge_heads_kernel(Tout* dst, Ptrs3<const Tin> src, int64_t T, int NS, int NH, int hs) {
  const int64_t bt = blockIdx.x;
  const int64_t b = bt / T, t = bt % T;
  const int hv = hs / V;
  const int per_slot = NH * hv;
  const int total = NS * per_slot;
  Tout* row = dst + bt * static_cast<int64_t>(NS) * NH * hs;
  for (int j = threadIdx.x; j < total; j += kPermuteThreads) {
    const int s = j / per_slot;
    const int rem = j - s * per_slot;
    const int h = rem / hv;
    const int i = rem - h * hv;
    const Pack<Tin, V> x = *reinterpret_cast<const Pack<Tin, V>*>(
        src.p[s] + ((b * NH + h) * T + t) * hs + i * V);
    Pack<Tout, V> y;
#pragma unroll
    for (int e = 0; e < V; ++e) y.v[e] = from_float<Tout>(to_float(x.v[e]));
    *reinterpret_cast<Pack<Tout, V>*>(row + (static_cast<int64_t>(s) * NH + h) * hs + i * V) = y;
  }
}

bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

/// The widest vector (16 bytes on the wider side) usable for these pointers and hs, else 1.
template <typename Tin, typename Tout>
constexpr int kMaxVec = 16 / (sizeof(Tin) > sizeof(Tout) ? sizeof(Tin) : sizeof(Tout));

template <typename Tin, typename Tout>
bool can_vectorize(int hs, const void* in0, const void* in1, const void* in2, const void* out0,
                   const void* out1, const void* out2) {
  constexpr int V = kMaxVec<Tin, Tout>;
  if (hs % V != 0) return false;
  for (const void* p : {in0, in1, in2})
    if (p && !aligned_to(p, V * sizeof(Tin))) return false;
  for (const void* p : {out0, out1, out2})
    if (p && !aligned_to(p, V * sizeof(Tout))) return false;
  return true;
}

template <typename Tin, typename Tout>
void split_heads(const CudaContext& ctx, Ptrs3<Tout> dst, const Tin* src, int64_t B, int64_t T,
                 int NS, int NH, int hs) {
  const unsigned grid = static_cast<unsigned>(B * T);
  if (grid == 0) return;
  constexpr int V = kMaxVec<Tin, Tout>;
  if (can_vectorize<Tin, Tout>(hs, src, nullptr, nullptr, dst.p[0], NS > 1 ? dst.p[1] : nullptr,
                               NS > 2 ? dst.p[2] : nullptr)) {
    split_heads_kernel<Tin, Tout, V><<<grid, kPermuteThreads, 0, ctx.stream>>>(dst, src, T, NS, NH, hs);
  } else {
    split_heads_kernel<Tin, Tout, 1><<<grid, kPermuteThreads, 0, ctx.stream>>>(dst, src, T, NS, NH, hs);
  }
  ST_CUDA_LAUNCH_CHECK();
}

template <typename Tin, typename Tout>
void merge_heads(const CudaContext& ctx, Tout* dst, Ptrs3<const Tin> src, int64_t B, int64_t T,
                 int NS, int NH, int hs) {
  const unsigned grid = static_cast<unsigned>(B * T);
  if (grid == 0) return;
  constexpr int V = kMaxVec<Tin, Tout>;
  if (can_vectorize<Tin, Tout>(hs, src.p[0], NS > 1 ? src.p[1] : nullptr,
                               NS > 2 ? src.p[2] : nullptr, dst, nullptr, nullptr)) {
    merge_heads_kernel<Tin, Tout, V><<<grid, kPermuteThreads, 0, ctx.stream>>>(dst, src, T, NS, NH, hs);
  } else {
    merge_heads_kernel<Tin, Tout, 1><<<grid, kPermuteThreads, 0, ctx.stream>>>(dst, src, T, NS, NH, hs);
  }
  ST_CUDA_LAUNCH_CHECK();
}

// ---- causal softmax, forward and backward (one warp per row) --------------------------------------
constexpr int kSoftmaxThreads = 256;
constexpr int kWarpsPerBlock = kSoftmaxThreads / 32;

/// Rows of one query chunk: S chunk [BH, R, ldS] fp32 (already scaled), row w = bh·R + r is query
/// t = t0 + r. Writes probs[bh, t, 0:t1]: the softmax for t2 ≤ t, zeros for t < t2 < t1 (read by
/// the chunk's P·v GEMM and the backward's key-chunk GEMMs). Columns ≥ t1 are never read and are
/// left as they are (only the causal part of saved.probs is specified).
/// kDrop (attention dropout): also writes Pd = P ∘ M · keep_scale into the chunk buffer pd
/// [BH, R, Tlen] (row w at pd + w·Tlen; zeros for t < t2 < t1), M the mask of element
/// (bh·Tlen + t)·Tlen + t2 (AttnDropout8 in core/philox.h: 8-bit decisions, keep_scale =
/// 1/(1 − p_effective)) — the P·v GEMM then reads Pd, and probs keep P for the backward.
template <typename T, bool kDrop>
__global__ void __launch_bounds__(kSoftmaxThreads)
    causal_softmax_forward_kernel(T* probs, const float* S, int64_t rows, int64_t R, int64_t Tlen,
                                  int64_t t0, int64_t t1, int64_t ldS, T* pd, Dropout drop,
                                  uint32_t thresh, float keep_scale) {
  const int64_t w = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  if (w >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t bh = w / R, r = w % R, t = t0 + r;
  const float* s = S + w * ldS;
  T* p = probs + (bh * Tlen + t) * Tlen;
  float m = -INFINITY;
  for (int64_t j = lane; j <= t; j += 32) m = fmaxf(m, s[j]);
  m = warp_max(m);
  float sum = 0.f;
  for (int64_t j = lane; j <= t; j += 32) sum += expf(s[j] - m);
  sum = warp_sum(sum);
  const float inv = 1.0f / sum;
  for (int64_t j = lane; j <= t; j += 32) p[j] = from_float<T>(expf(s[j] - m) * inv);
  for (int64_t j = t + 1 + lane; j < t1; j += 32) p[j] = from_float<T>(0.f);
  if constexpr (kDrop) {
    T* q = pd + w * Tlen;
    const auto row = static_cast<uint64_t>((bh * Tlen + t) * Tlen);
    for (int64_t j = lane; j <= t; j += 32) {
      const float x = expf(s[j] - m) * inv;
      q[j] = from_float<T>(
          AttnDropout8::keep(drop, row + static_cast<uint64_t>(j), thresh) ? x * keep_scale : 0.f);
    }
    for (int64_t j = t + 1 + lane; j < t1; j += 32) q[j] = from_float<T>(0.f);
  }
}

/// Attention dropout's backward helper: pd [BH, Tlen, Tlen] = P ∘ M · keep_scale for t2 ≤ t and 0
/// for t2 > t (the full rows the key-chunk dv GEMMs read), one warp per row of probs.
template <typename T>
__global__ void __launch_bounds__(kSoftmaxThreads)
    dropped_probs_kernel(T* pd, const T* probs, int64_t rows, int64_t Tlen, Dropout drop,
                         uint32_t thresh, float keep_scale) {
  const int64_t w = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  if (w >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t t = w % Tlen;
  const T* p = probs + w * Tlen;
  T* q = pd + w * Tlen;
  const auto row = static_cast<uint64_t>(w * Tlen);
  for (int64_t j = lane; j <= t; j += 32)
    q[j] = from_float<T>(AttnDropout8::keep(drop, row + static_cast<uint64_t>(j), thresh)
                             ? to_float(p[j]) * keep_scale
                             : 0.f);
  for (int64_t j = t + 1 + lane; j < Tlen; j += 32) q[j] = from_float<T>(0.f);
}

/// dS rows t = t0 + r of the full [BH, T, T] buffer (compute dtype) from the dP chunk
/// [BH, R, ldS] fp32 and probs rows t: dS[t2] = scale · P[t2] · (dP[t2] − Σ_{t2'≤t} P[t2'] dP[t2'])
/// for t2 ≤ t, and 0 for t < t2 < t1 (the diagonal block's upper part, which the key-chunk GEMMs
/// read). dS may alias probs (each element is read by the thread that overwrites it).
/// kDrop: dP holds ∂L/∂Pd (the dropped probabilities); dP[t2] becomes dPd[t2] · M · keep_scale
/// (M regenerated as in the forward) before the softmax backward.
template <typename T, bool kDrop>
__global__ void __launch_bounds__(kSoftmaxThreads)
    causal_softmax_backward_kernel(T* dS, const float* dP, const T* probs, int64_t rows, int64_t R,
                                   int64_t Tlen, int64_t t0, int64_t t1, int64_t ldS, float scale,
                                   Dropout drop, uint32_t thresh, float keep_scale) {
  const int64_t w = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  if (w >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t bh = w / R, r = w % R, t = t0 + r;
  const T* p = probs + (bh * Tlen + t) * Tlen;
  const float* dp = dP + w * ldS;
  T* ds = dS + (bh * Tlen + t) * Tlen;
  const auto row = static_cast<uint64_t>((bh * Tlen + t) * Tlen);
  const auto grad = [&](int64_t j) {
    if constexpr (kDrop)
      return AttnDropout8::keep(drop, row + static_cast<uint64_t>(j), thresh) ? dp[j] * keep_scale
                                                                              : 0.f;
    else
      return dp[j];
  };
  float d = 0.f;
  for (int64_t j = lane; j <= t; j += 32) d += to_float(p[j]) * grad(j);
  d = warp_sum(d);
  for (int64_t j = lane; j <= t; j += 32)
    ds[j] = from_float<T>(to_float(p[j]) * (grad(j) - d) * scale);
  for (int64_t j = t + 1 + lane; j < t1; j += 32) ds[j] = from_float<T>(0.f);
}

// ---- strided-batched GEMM in row-major terms -----------------------------------------------------
/// Row-major C[M,N] = alpha · op(A)[M,K] · op(B)[K,N] + beta · C, batched with strides. A row-major
/// matrix is the column-major view of its transpose, so cuBLAS computes Cᵀ = op(B)ᵀ · op(A)ᵀ:
/// first operand B (transposed iff tb), second A (transposed iff ta), m = N, n = M.
struct RowMajorGemm {
  bool ta = false, tb = false;
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;
  int64_t lda = 0, sA = 0;
  const void* B = nullptr;
  int64_t ldb = 0, sB = 0;
  void* C = nullptr;
  int64_t ldc = 0, sC = 0;
  cudaDataType_t c_type = CUDA_R_32F;
  float alpha = 1.f, beta = 0.f;
};

struct GemmEnv {
  cublasHandle_t blas;
  cudaDataType_t ab_type;
  cublasComputeType_t compute;
  int batch;
};

void gemm(const GemmEnv& env, const RowMajorGemm& g) {
  ST_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      env.blas, g.tb ? CUBLAS_OP_T : CUBLAS_OP_N, g.ta ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(g.N), static_cast<int>(g.M), static_cast<int>(g.K), &g.alpha, g.B,
      env.ab_type, static_cast<int>(g.ldb), g.sB, g.A, env.ab_type, static_cast<int>(g.lda), g.sA,
      &g.beta, g.C, g.c_type, static_cast<int>(g.ldc), g.sC, env.batch, env.compute,
      CUBLAS_GEMM_DEFAULT));
}

// ---- shapes, chunks, scratch ---------------------------------------------------------------------
struct AttnShape {
  int64_t B = 0, T = 0, C = 0, NH = 0, hs = 0, BH = 0;
  float scale = 1.f;
};

AttnShape attn_shape(const Tensor& qkv, int num_heads, const char* op) {
  AttnShape s;
  ST_ASSERT(qkv.ndim == 3);
  s.B = qkv.dim(0);
  s.T = qkv.dim(1);
  ST_ASSERT(qkv.dim(2) % 3 == 0);
  s.C = qkv.dim(2) / 3;
  s.NH = num_heads;
  require(num_heads > 0 && s.C % num_heads == 0, "cuda ", op, ": ", s.C,
          " channels do not split into ", num_heads, " heads");
  s.hs = s.C / s.NH;
  s.BH = s.B * s.NH;
  s.scale = 1.0f / std::sqrt(static_cast<float>(s.hs));
  return s;
}

/// Query rows per chunk: the whole sequence when short, else 128 (see the header comment).
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
/// Query rows (and key columns) per chunk. Measured on an H200 at GPT-2 medium/xl shapes
/// (B·NH = 256 / 200, T = 1024, hs = 64): 256 and 512 tie, 128 is 10% slower, 64 30% slower
/// (small GEMM tiles), the whole sequence 10% slower (no causal saving). 256 keeps scratch small.
int64_t chunk_rows(int64_t T) { return std::min<int64_t>(T, 256); }

/// Carves 256-byte-aligned pieces out of one scratch allocation.
struct Carver {
  char* base = nullptr;
  size_t used = 0;
  static size_t padded(size_t bytes) { return (bytes + 255) / 256 * 256; }
  void* take(size_t bytes) {
    void* p = base + used;
    used += padded(bytes);
    return p;
  }
};

GemmEnv gemm_env(const CudaContext& ctx, DType dt, int64_t BH) {
  // Keep the handle on our stream; cublasSetStream also resets the handle's workspace to the
  // default pool, so only call it when the stream differs.
  cudaStream_t cur = nullptr;
  ST_CUBLAS_CHECK(cublasGetStream(ctx.blas, &cur));
  if (cur != ctx.stream) ST_CUBLAS_CHECK(cublasSetStream(ctx.blas, ctx.stream));
  GemmEnv env;
  env.blas = ctx.blas;
  env.ab_type = cuda_dtype(dt);
  env.compute = dt == DType::kF32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  require(BH <= INT32_MAX, "cuda attention: batch·heads = ", BH, " is too large");
  env.batch = static_cast<int>(BH);
  return env;
}

void check_dtypes(DType dt, std::initializer_list<std::pair<const Tensor*, const char*>> ts,
                  const char* op) {
  require(dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16, "cuda ", op, ": dtype ",
          dtype_name(dt), " is not floating");
  for (const auto& [t, name] : ts) {
    require(t->dtype == dt, "cuda ", op, ": ", name, " is ", dtype_name(t->dtype), " but qkv is ",
            dtype_name(dt));
  }
}

}  // namespace

// ---- forward --------------------------------------------------------------------------------------

void attention_forward(const CudaContext& ctx, Tensor out, AttentionSaved saved, Tensor qkv,
                       int num_heads, const Dropout& dropout) {
  const AttnShape s = attn_shape(qkv, num_heads, "attention_forward");
  const DType dt = qkv.dtype;
  require(!saved.probs.empty(), "cuda attention_forward: this backend saves probabilities, none given");
  check_dtypes(dt, {{&out, "out"}, {&saved.probs, "saved.probs"}}, "attention_forward");
  ST_ASSERT(out.numel() == s.B * s.T * s.C);
  ST_ASSERT(saved.probs.numel() == s.BH * s.T * s.T);
  if (s.B == 0 || s.T == 0) return;

  const int64_t T = s.T, hs = s.hs, BH = s.BH;
  const size_t es = dtype_size(dt);
  const int64_t Tc = chunk_rows(T), T8 = round_up(T, 8);
  const size_t head_bytes = static_cast<size_t>(BH * T * hs) * es;
  const size_t s_bytes = static_cast<size_t>(BH * Tc * T8) * sizeof(float);
  // Under dropout: the dropped probabilities of one query chunk, [BH, Tc, T].
  const size_t pd_bytes = dropout.active() ? static_cast<size_t>(BH * Tc * T) * es : 0;
  Carver cv;
  cv.base = static_cast<char*>(ctx.get_scratch(4 * Carver::padded(head_bytes) + Carver::padded(s_bytes) +
                                               Carver::padded(pd_bytes)));
  void* q = cv.take(head_bytes);
  void* k = cv.take(head_bytes);
  void* v = cv.take(head_bytes);
  void* y = cv.take(head_bytes);
  float* S = static_cast<float*>(cv.take(s_bytes));
  void* pd = dropout.active() ? cv.take(pd_bytes) : nullptr;
  const GemmEnv env = gemm_env(ctx, dt, BH);

  dispatch_float(dt, [&]<typename E>() {
    split_heads<E, E>(ctx, Ptrs3<E>{{static_cast<E*>(q), static_cast<E*>(k), static_cast<E*>(v)}},
                      qkv.as<E>(), s.B, T, 3, static_cast<int>(s.NH), static_cast<int>(hs));
    E* P = saved.probs.as<E>();
    for (int64_t t0 = 0; t0 < T; t0 += Tc) {
      const int64_t t1 = std::min(T, t0 + Tc), R = t1 - t0, ldS = round_up(t1, 8);
      // S [R, t1] = scale · q[t0:t1] · k[0:t1]ᵀ   (fp32 out)
      RowMajorGemm g1;
      g1.ta = false;
      g1.tb = true;
      g1.M = R;
      g1.N = t1;
      g1.K = hs;
      g1.A = static_cast<E*>(q) + t0 * hs;
      g1.lda = hs;
      g1.sA = T * hs;
      g1.B = k;
      g1.ldb = hs;
      g1.sB = T * hs;
      g1.C = S;
      g1.ldc = ldS;
      g1.sC = R * ldS;
      g1.c_type = CUDA_R_32F;
      g1.alpha = s.scale;
      gemm(env, g1);
      // P rows [t0, t1), columns [0, t1) (zeros above the diagonal)
      const int64_t rows = BH * R;
      dispatch_dropout(dropout, [&]<bool kDrop>() {
        causal_softmax_forward_kernel<E, kDrop>
            <<<ceil_div(static_cast<size_t>(rows), kWarpsPerBlock), kSoftmaxThreads, 0,
               ctx.stream>>>(P, S, rows, R, T, t0, t1, ldS, static_cast<E*>(pd), dropout,
                             AttnDropout8::threshold(dropout), AttnDropout8::scale(dropout));
        ST_CUDA_LAUNCH_CHECK();
      });
      // y[t0:t1] = P[t0:t1, 0:t1] · v[0:t1]   (under dropout Pd, chunk rows of stride T)
      RowMajorGemm g2;
      g2.M = R;
      g2.N = hs;
      g2.K = t1;
      g2.A = P + t0 * T;
      g2.lda = T;
      g2.sA = T * T;
      if (dropout.active()) {
        g2.A = pd;
        g2.sA = R * T;
      }
      g2.B = v;
      g2.ldb = hs;
      g2.sB = T * hs;
      g2.C = static_cast<E*>(y) + t0 * hs;
      g2.ldc = hs;
      g2.sC = T * hs;
      g2.c_type = env.ab_type;
      gemm(env, g2);
    }
    merge_heads<E, E>(ctx, out.as<E>(), Ptrs3<const E>{{static_cast<const E*>(y), nullptr, nullptr}},
                      s.B, T, 1, static_cast<int>(s.NH), static_cast<int>(hs));
  });
}

// ---- backward -------------------------------------------------------------------------------------

void attention_backward(const CudaContext& ctx, Tensor dqkv, Tensor dout, Tensor qkv, Tensor /*out*/,
                        AttentionSaved saved, int num_heads, const Dropout& dropout) {
  const AttnShape s = attn_shape(qkv, num_heads, "attention_backward");
  const DType dt = qkv.dtype;
  require(!saved.probs.empty(), "cuda attention_backward: this backend needs saved probabilities");
  check_dtypes(dt, {{&dqkv, "dqkv"}, {&dout, "dout"}, {&saved.probs, "saved.probs"}},
               "attention_backward");
  ST_ASSERT(dqkv.numel() == qkv.numel());
  ST_ASSERT(dout.numel() == s.B * s.T * s.C);
  ST_ASSERT(saved.probs.numel() == s.BH * s.T * s.T);
  if (s.B == 0 || s.T == 0) return;

  const int64_t T = s.T, hs = s.hs, BH = s.BH;
  const size_t es = dtype_size(dt);
  const int64_t Tc = chunk_rows(T), T8 = round_up(T, 8);
  const size_t head_bytes = static_cast<size_t>(BH * T * hs) * es;
  const size_t dp_bytes = static_cast<size_t>(BH * Tc * T8) * sizeof(float);
  const size_t ds_bytes = static_cast<size_t>(BH * T * T) * es;
  Carver cv;
  cv.base = static_cast<char*>(ctx.get_scratch(7 * Carver::padded(head_bytes) +
                                               Carver::padded(dp_bytes) + Carver::padded(ds_bytes)));
  void* q = cv.take(head_bytes);
  void* k = cv.take(head_bytes);
  void* v = cv.take(head_bytes);
  void* dy = cv.take(head_bytes);
  void* dq = cv.take(head_bytes);
  void* dk = cv.take(head_bytes);
  void* dv = cv.take(head_bytes);
  float* dP = static_cast<float*>(cv.take(dp_bytes));
  void* dS = cv.take(ds_bytes);
  const GemmEnv env = gemm_env(ctx, dt, BH);

  dispatch_float(dt, [&]<typename E>() {
    const int NH = static_cast<int>(s.NH), ihs = static_cast<int>(hs);
    split_heads<E, E>(ctx, Ptrs3<E>{{static_cast<E*>(q), static_cast<E*>(k), static_cast<E*>(v)}},
                      qkv.as<E>(), s.B, T, 3, NH, ihs);
    split_heads<E, E>(ctx, Ptrs3<E>{{static_cast<E*>(dy), nullptr, nullptr}}, dout.as<E>(), s.B, T,
                      1, NH, ihs);
    const E* P = saved.probs.as<E>();
    E* dSe = static_cast<E*>(dS);
    const bool drop = dropout.active();
    // Key chunks [k0, k1) of dk (from dS) or dv (from P, or Pd under dropout): only query rows
    // t ≥ k0 see these keys.
    const auto key_chunks = [&](bool do_dk, bool do_dv, const E* probs_for_dv) {
      for (int64_t k0 = 0; k0 < T; k0 += Tc) {
        const int64_t k1 = std::min(T, k0 + Tc), Rk = k1 - k0, Kq = T - k0;
        // dk[k0:k1] = dS[k0:T, k0:k1]ᵀ · q[k0:T]
        RowMajorGemm g;
        g.ta = true;
        g.M = Rk;
        g.N = hs;
        g.K = Kq;
        g.A = dSe + k0 * T + k0;
        g.lda = T;
        g.sA = T * T;
        g.B = static_cast<const E*>(q) + k0 * hs;
        g.ldb = hs;
        g.sB = T * hs;
        g.C = static_cast<E*>(dk) + k0 * hs;
        g.ldc = hs;
        g.sC = T * hs;
        g.c_type = env.ab_type;
        if (do_dk) gemm(env, g);
        // dv[k0:k1] = P[k0:T, k0:k1]ᵀ · dy[k0:T]
        g.A = probs_for_dv + k0 * T + k0;
        g.B = static_cast<const E*>(dy) + k0 * hs;
        g.C = static_cast<E*>(dv) + k0 * hs;
        if (do_dv) gemm(env, g);
      }
    };
    if (drop) {
      // dv = Pdᵀ·dy first, with Pd materialized in the dS buffer (dS overwrites it below).
      const int64_t rows = BH * T;
      dropped_probs_kernel<E>
          <<<ceil_div(static_cast<size_t>(rows), kWarpsPerBlock), kSoftmaxThreads, 0, ctx.stream>>>(
              dSe, P, rows, T, dropout, AttnDropout8::threshold(dropout),
              AttnDropout8::scale(dropout));
      ST_CUDA_LAUNCH_CHECK();
      key_chunks(false, true, dSe);
    }
    // Query chunks [t0, t1): dP = dy·vᵀ (fp32), dS rows, dq = dS·k.
    for (int64_t t0 = 0; t0 < T; t0 += Tc) {
      const int64_t t1 = std::min(T, t0 + Tc), R = t1 - t0, ldS = round_up(t1, 8);
      // dP [R, t1] = dy[t0:t1] · v[0:t1]ᵀ
      RowMajorGemm g;
      g.ta = false;
      g.tb = true;
      g.M = R;
      g.N = t1;
      g.K = hs;
      g.A = static_cast<const E*>(dy) + t0 * hs;
      g.lda = hs;
      g.sA = T * hs;
      g.B = v;
      g.ldb = hs;
      g.sB = T * hs;
      g.C = dP;
      g.ldc = ldS;
      g.sC = R * ldS;
      g.c_type = CUDA_R_32F;
      gemm(env, g);
      // dS[t0:t1, 0:t1] = scale · P ⊙ (dP − rowsum(P ⊙ dP)), causal
      const int64_t rows = BH * R;
      dispatch_dropout(dropout, [&]<bool kDrop>() {
        causal_softmax_backward_kernel<E, kDrop>
            <<<ceil_div(static_cast<size_t>(rows), kWarpsPerBlock), kSoftmaxThreads, 0,
               ctx.stream>>>(dSe, dP, P, rows, R, T, t0, t1, ldS, s.scale, dropout,
                             AttnDropout8::threshold(dropout), AttnDropout8::scale(dropout));
        ST_CUDA_LAUNCH_CHECK();
      });
      // dq[t0:t1] = dS[t0:t1, 0:t1] · k[0:t1]
      g = RowMajorGemm{};
      g.M = R;
      g.N = hs;
      g.K = t1;
      g.A = dSe + t0 * T;
      g.lda = T;
      g.sA = T * T;
      g.B = k;
      g.ldb = hs;
      g.sB = T * hs;
      g.C = static_cast<E*>(dq) + t0 * hs;
      g.ldc = hs;
      g.sC = T * hs;
      g.c_type = env.ab_type;
      gemm(env, g);
    }
    key_chunks(true, !drop, P);
    merge_heads<E, E>(ctx, dqkv.as<E>(),
                      Ptrs3<const E>{{static_cast<const E*>(dq), static_cast<const E*>(dk),
                                      static_cast<const E*>(dv)}},
                      s.B, T, 3, NH, ihs);
  });
}

}  // namespace shardtrain::cuda
