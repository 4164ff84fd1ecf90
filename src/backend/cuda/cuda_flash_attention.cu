// Causal multi-head self-attention on the GPU, fused ("flash") design: the T×T scores and
// probabilities never leave the chip; only the per-row log-sum-exp is saved for backward.
//
// ---- source -------------------------------------------------------------------------------------
// Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
// arXiv 2307.08691: Algorithm 1 (forward) and Algorithm 2 (backward), with the causal tile skipping
// of §3.1.1 and the one-CTA-per-(row tile, head, batch) parallelism of §3.2. Departure from
// Algorithm 2: dQ is not accumulated with atomics across key tiles; a second kernel over query
// tiles computes it (recomputing S and dP), so every output element is the result of one fixed
// summation order: bit-identical from run to run.
//
// ---- math -----------------------------------------------------------------------------------
// Per batch b and head h, with q, k, v ∈ R^{T×hs} the head's slices of qkv and scale = 1/sqrt(hs):
//   S = scale · q kᵀ (causal: S[i,j] = −∞ for j > i),  P = softmax_row(S),  O = P v,
//   lse[i] = log Σ_j exp(S[i,j])                      (natural log, fp32)
// Forward (Algorithm 1), per query tile, over key tiles j: S_j = q k_jᵀ; running row max m and sum
//   l (online softmax): m' = max(m, rowmax S_j), P̃ = exp(S_j − m'), l' = e^{m−m'} l + rowsum P̃,
//   O' = e^{m−m'} O + P̃ v_j;  at the end O /= l, lse = m + log l.
// Backward (Algorithm 2, recomputing P = exp(S − lse) instead of reading it):
//   D[i] = rowsum(dO ⊙ O)[i]                                      (kernel 1: flash_dot)
//   dP = dO vᵀ, dS = P ⊙ (dP − D), dV = Pᵀ dO, dK = scale·dSᵀ q  (kernel 2: over key tiles)
//   dQ = scale · dS k                                             (kernel 3: over query tiles)
// Same formulas as backend/cpu/cpu_attention.cpp and cuda_attention.cu (dS = P ⊙ (dP − rowsum(P ⊙
// dP)), with rowsum(P ⊙ dP) = rowsum(dO ⊙ O)).
// Attention dropout (kDrop instantiations; p = 0 launches the kernels without it): with f =
// M/(1−p_eff), M the mask of element ((b·NH+h)·T+i)·T+j (AttnDropout8 in core/philox.h, the CPU
// reference's: FlashAttention-2's 8-bit decisions, one Philox call per 16 elements, p_eff = p
// rounded to a multiple of 1/256), the forward multiplies P̃ by f after the row sums (O = (P∘f) v,
// lse unchanged); the backward regenerates f: dV = (P∘f)ᵀ dO, dS = P ⊙ (dP∘f − D) with dP = dO vᵀ
// and D = rowsum(dO ⊙ O) (still Σ_j P∘f∘dP). With T a multiple of 16, groups of 16 adjacent keys
// from a multiple of 16 are aligned Philox calls: each lane draws one or two groups and the lanes
// share the keep bits with shuffles (one call per 16 elements; forward and dQ per quad of lanes,
// dK/dV per warp); otherwise forward and dQ draw one call per two adjacent keys and dK/dV one per
// element.
//
// ---- layouts and dtypes -----------------------------------------------------------------------
//   qkv  [B, T, 3C] = [B, T, 3, NH, hs] (q | k | v), bf16 or fp16, read in place: a tile of a head
//        is `rows` rows of hs contiguous elements with row stride 3C — no permute copies.
//   out  [B, T, C] = [B, T, NH, hs], written in place; dout likewise.
//   dqkv [B, T, 3C], OVERWRITTEN.
//   lse  [B, NH, T] fp32 (natural log): the only thing saved for backward.
// Tensor cores: mma.sync.aligned.m16n8k16 (bf16/fp16 in, fp32 accumulate) fed by ldmatrix from
// shared memory; fragment layouts per the PTX ISA ("Matrix Fragments for mma.m16n8k16 with
// floating point type", "ldmatrix"). The accumulator layout of S equals the A-operand layout of
// the next GEMM, so P and dS go from registers to the tensor cores without shared memory (FA2).
// Softmax statistics, exponentials (exp2 with log2(e) folded into the scale) and all sums are fp32;
// P and dS are rounded to the input dtype only as GEMM operands; outputs are rounded once.
//
// ---- tiling (128 threads = 4 warps per CTA; each warp owns 16 rows of the CTA's 64-row tile) ----
//   forward : CTA = (64 query rows, head, batch); streams key/value tiles of 64 rows from the
//             diagonal down to 0 (only the diagonal tile needs the causal mask).
//   dK, dV  : CTA = (64 key rows, head, batch); streams query tiles (with dO, lse, D) of 64 rows
//             (32 for hs = 128) from the diagonal to the end; warp w owns keys 16w..16w+15 and
//             computes Sᵀ = k qᵀ, dPᵀ = v dOᵀ so that Pᵀ and dSᵀ are its A operands.
//   dQ      : CTA = (64 query rows, head, batch); streams key/value tiles of 64 rows (32 for hs =
//             128) from the diagonal down to 0.
//   Streamed tiles are double-buffered with cp.async (the next tile loads while this one is
//   computed). Rows ≥ T are zero-filled and masked (T need not be a multiple of the tile). CTAs
//   are ordered heaviest first (most tiles to stream) for load balance under causality.
//   Head sizes 32, 64, 128 (template parameter; GPT-2 uses 64 for every size).
//
// ---- memory -----------------------------------------------------------------------------------
//   saved: lse [B, NH, T] fp32 (held by the model per layer; vs [B, NH, T, T] probabilities).
//   backward scratch: D [B, NH, T] fp32 (one get_scratch). Forward needs no scratch.
//   Shared memory per CTA (rows padded to hs + 8 elements: ldmatrix reads are bank-conflict free),
//   in bytes for hs = 32 / 64 / 128:
//     forward  5·64·(hs+8)·2                      25600 / 46080 / 87040
//     dQ       2·64·(hs+8)·2 + 4·R·(hs+8)·2        30720 / 55296 / 69632   (R = streamed rows)
//     dK, dV   dQ's + 16·R (lse and D per row)     31744 / 56320 / 70144
//   Above 48 KiB the kernels opt in with cudaFuncSetAttribute(MaxDynamicSharedMemorySize); all stay
//   within 100 KB.
//
// ---- requirements (checked with require()) -----------------------------------------------------
//   dtype bf16 or fp16 (fp32 tensors use cuda_attention.cu); hs ∈ {32, 64, 128}; qkv, out, dout,
//   dqkv 16-byte aligned (cp.async / vector stores; row strides are multiples of 16 bytes because
//   C is a multiple of 32); lse fp32 with B·NH·T elements; dqkv not overlapping qkv, dout, out.
//
// The device code below (from "device code" to "end of device code") uses only the wrappers of the
// "PTX wrappers" section for CUDA-specific operations, so it can be exercised off-GPU by a host
// emulation of those wrappers (warp-synchronous mma/ldmatrix/shuffle semantics of the PTX ISA).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_ops.h"

namespace shardtrain::cuda {
namespace {

// ==== device code ================================================================================

// ---- PTX wrappers -------------------------------------------------------------------------------

__device__ __forceinline__ unsigned char* dyn_smem() {
  extern __shared__ __align__(16) unsigned char flash_smem[];
  return flash_smem;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// Four 8×8 b16 matrices; lane l gives the address of row l%8 of matrix l/8 and receives, in r[i],
/// elements (l/4, 2·(l%4) + {0,1}) of matrix i.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
/// As ldsm_x4, each matrix transposed: r[i] holds elements (2·(l%4) + {0,1}, l/4) of matrix i.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

/// d[16×8] += a[16×16] · b[16×8], fp32 accumulate (warp-wide).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __half>, "mma_16816: bf16 or fp16 operands");
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

/// Asynchronous 16-byte global → shared copy; when !valid nothing is read and 16 zero bytes land.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16u : 0u));
}
/// Asynchronous 4-byte copy; zero-fills when !valid.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 4u : 0u));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/// Two floats rounded (RNE) to T and packed: `lo` in the low 16 bits (the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&r, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&r, &v, 4);
  }
  return r;
}

__device__ __forceinline__ float shfl_xor(float v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
/// v of lane `src` (warp-wide).
__device__ __forceinline__ uint32_t shfl_idx(uint32_t v, int src) {
  return __shfl_sync(0xffffffffu, v, src);
}

// ---- end of PTX wrappers ------------------------------------------------------------------------

constexpr int kThreads = 128;  // 4 warps
constexpr int kTile = 64;      // rows a CTA owns: 16 per warp
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/// Shared-memory row stride in elements: hs + 8 (16 bytes of padding) shifts consecutive rows by
/// 16 bytes modulo 128, so the 8 row addresses of an ldmatrix hit 8 different bank groups.
template <int D>
constexpr int kLd = D + 8;
/// Rows of the tiles the backward kernels stream (fits shared memory and registers at hs = 128).
template <int D>
constexpr int kStream = D <= 64 ? 64 : 32;

/// Minimum resident CTAs per SM requested from ptxas (__launch_bounds__), i.e. a register cap of
/// 65536 / (128 · n): the largest n whose cap compiles without spills (ptxas -v, sm_90a).
template <int D>
constexpr int kFwdMinBlocks = D <= 64 ? 4 : 2;  // ≤ 128 registers: 16 warps per SM
constexpr int kDkdvMinBlocks = 2;
template <int D>
constexpr int kDqMinBlocks = D <= 64 ? 3 : 2;

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

struct FwdParams {
  const void* qkv;
  void* out;
  float* lse;
  int T, NH, BH, n_tiles;
  float scale_log2;  // scale · log2(e)
  Dropout drop;      // attention dropout (used by the kDrop instantiation only)
  uint32_t drop_thresh;
  float drop_scale;
};

struct BwdParams {
  const void* qkv;
  const void* dout;
  const float* lse;
  const float* dvec;  // D = rowsum(dO ⊙ O), [B, NH, T]
  void* dqkv;
  int T, NH, BH, n_tiles;
  float scale, scale_log2;
  Dropout drop;  // attention dropout (used by the kDrop instantiations only)
  uint32_t drop_thresh;
  float drop_scale;
};

/// Dropout multipliers (0 or keep_scale) of elements idx and idx + 1 of P — two adjacent keys of
/// one query row, idx = (bh·T + query)·T + key — from one Philox call unless idx is the last of
/// its group of 16 (AttnDropout8 in core/philox.h: the mask is that of the CPU reference).
__device__ __forceinline__ void dropout_pair(float& f0, float& f1, const Dropout& d,
                                             uint32_t thresh, float keep_scale, uint64_t idx) {
  const uint32_t m0 = AttnDropout8::keep_mask16(d, idx & ~uint64_t{15}, thresh);
  const uint32_t m1 = (idx & 15) == 15 ? AttnDropout8::keep_mask16(d, idx + 1, thresh) : m0;
  f0 = (m0 >> (idx & 15)) & 1u ? keep_scale : 0.f;
  f1 = (m1 >> ((idx + 1) & 15)) & 1u ? keep_scale : 0.f;
}

/// T a multiple of 16 (then 16 adjacent keys from a multiple of 16 are one aligned Philox group):
/// the keep bits of the two query rows (row0, row1) a thread holds in the accumulator layout
/// (lane = 4·gi + t4) over the key tile [k0, k0 + kBc), k0 a multiple of 16, into w[i][h]: bit b
/// for key k0 + h·kBc/2 + b of row i. The quad of lanes with this gi draws the 2 rows × kBc/16
/// groups, kBc/32 Philox calls per lane, and shares them with 4 shuffles.
template <int kBc>
__device__ __forceinline__ void dropout_tile_bits(uint32_t (&w)[2][2], const Dropout& d,
                                                  uint32_t thresh, uint64_t bh, int Tn, int row0,
                                                  int row1, int k0, int lane) {
  static_assert(kBc == 32 || kBc == 64, "one or two groups of 16 keys per lane");
  constexpr int kHalf = kBc / 2;
  const int t4 = lane & 3;
  const int row = (t4 >> 1) ? row1 : row0;
  const uint64_t idx =
      (bh * static_cast<uint64_t>(Tn) + static_cast<uint64_t>(row)) * static_cast<uint64_t>(Tn) +
      static_cast<uint64_t>(k0 + (t4 & 1) * kHalf);
  uint32_t mine = 0;
#pragma unroll
  for (int g = 0; g < kHalf / 16; ++g)
    mine |= AttnDropout8::keep_mask16(d, idx + 16 * g, thresh) << (16 * g);
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) w[i][h] = shfl_idx(mine, (lane & ~3) + 2 * i + h);
}

/// The dropout multipliers of keys k and k + 1 (k = k0 + 8·nt + 2·t4, k0 a multiple of kBc) of
/// the two query rows (row0, row1) a thread holds in the accumulator layout of an n8 tile, into
/// f[i][0..1]: from the bits w of dropout_tile_bits when T is a multiple of 16, otherwise
/// dropout_pair per row. nt must be a compile-time constant after unrolling (w stays in registers).
template <int kBc>
__device__ __forceinline__ void dropout_rows2(float (&f)[2][2], const uint32_t (&w)[2][2],
                                              const Dropout& d, uint32_t thresh, float keep_scale,
                                              uint64_t bh, int Tn, int row0, int row1, int k0,
                                              int nt, int lane) {
  constexpr int kHalf = kBc / 2;
  const int t4 = lane & 3;
  if ((Tn & 15) == 0) {  // uniform over the kernel
    const int h = nt * 8 / kHalf;
    const int sh = nt * 8 % kHalf + 2 * t4;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t bits = w[i][h] >> sh;
      f[i][0] = (bits & 1u) ? keep_scale : 0.f;
      f[i][1] = (bits & 2u) ? keep_scale : 0.f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i)
      dropout_pair(f[i][0], f[i][1], d, thresh, keep_scale,
                   (bh * static_cast<uint64_t>(Tn) + static_cast<uint64_t>(i == 0 ? row0 : row1)) *
                           static_cast<uint64_t>(Tn) +
                       static_cast<uint64_t>(k0 + nt * 8 + 2 * t4));
  }
}

/// The dropout multiplier of element idx of P.
__device__ __forceinline__ float dropout_one(const Dropout& d, uint32_t thresh, float keep_scale,
                                             uint64_t idx) {
  return AttnDropout8::keep(d, idx, thresh) ? keep_scale : 0.f;
}

/// Copies rows [0, kRows) of a slab of rows of D elements (row stride `ld` elements) into shared
/// memory (row stride kLd<D>), 16 bytes per cp.async by all threads; rows ≥ `valid` are zero-filled
/// without reading global memory. Not committed.
template <int kRows, int D, typename T>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t ld, int valid) {
  constexpr int kChunksPerRow = D / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile does not split evenly over the threads");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * kThreads;
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const bool ok = r < valid;
    cp_async_16(s + r * kLd<D> + col, g + (ok ? r : 0) * ld + col, ok);
  }
}

/// A operand (16×16, row-major in shared memory): rows [r0, r0+16), columns [c0, c0+16).
template <int D, typename T>
__device__ __forceinline__ void ldsm_a(uint32_t (&f)[4], const T* s, int r0, int c0, int lane) {
  ldsm_x4(f, s + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kLd<D> + c0 + (lane >> 4) * 8);
}
/// B operands of two n8 tiles (n in [n0, n0+8) → f[0], f[1]; [n0+8, n0+16) → f[2], f[3]), k in
/// [k0, k0+16), from a matrix stored n-major (row n holds its k elements contiguously: K for qkᵀ).
template <int D, typename T>
__device__ __forceinline__ void ldsm_b_nmajor(uint32_t (&f)[4], const T* s, int n0, int k0,
                                              int lane) {
  ldsm_x4(f, s + (n0 + (lane & 7) + (lane >> 4) * 8) * kLd<D> + k0 + ((lane >> 3) & 1) * 8);
}
/// The same from a matrix stored k-major (row k holds its n elements contiguously: V for P·v).
template <int D, typename T>
__device__ __forceinline__ void ldsm_b_kmajor(uint32_t (&f)[4], const T* s, int n0, int k0,
                                              int lane) {
  ldsm_x4_trans(f, s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kLd<D> + n0 + (lane >> 4) * 8);
}

/// acc[16 × 8·kN] += a[16 × D] · (rows n0.. of an n-major [·][D] tile)ᵀ, a from registers.
template <typename T, int D, int kN>
__device__ __forceinline__ void gemm_abt(float (&acc)[kN][4], const uint32_t (&a)[D / 16][4],
                                         const T* s, int lane) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < kN / 2; ++np) {
      uint32_t b[4];
      ldsm_b_nmajor<D>(b, s, np * 16, kk * 16, lane);
      mma_16816<T>(acc[2 * np], a[kk], b[0], b[1]);
      mma_16816<T>(acc[2 * np + 1], a[kk], b[2], b[3]);
    }
  }
}

/// acc[16 × D] += p[16 × 8·kN] · (a k-major [8·kN][D] tile), p given as fp32 accumulator-layout
/// values (rounded to T here: the accumulator layout of a 16×16 block is the A-operand layout).
template <typename T, int D, int kN>
__device__ __forceinline__ void gemm_pv(float (&acc)[D / 8][4], const float (&p)[kN][4], const T* s,
                                        int lane) {
#pragma unroll
  for (int kk = 0; kk < kN / 2; ++kk) {
    uint32_t a[4];
    a[0] = pack2<T>(p[2 * kk][0], p[2 * kk][1]);          // row g,     k 2t..2t+1
    a[1] = pack2<T>(p[2 * kk][2], p[2 * kk][3]);          // row g + 8, k 2t..2t+1
    a[2] = pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]);  // row g,     k 8+2t..
    a[3] = pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3]);  // row g + 8, k 8+2t..
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldsm_b_kmajor<D>(b, s, dp * 16, kk * 16, lane);
      mma_16816<T>(acc[2 * dp], a, b[0], b[1]);
      mma_16816<T>(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

/// Stores this warp's 16 rows (r0..r0+15 of a shared tile) of accumulators acc · mul into shared
/// memory, then (after __syncwarp) copies the rows with index < valid to global memory, 16 bytes
/// at a time; global row r is at g + r·ld.
template <typename T, int D>
__device__ __forceinline__ void store_rows(T* s, const float (&acc)[D / 8][4], float mul0,
                                           float mul1, int r0, int lane, T* g, int64_t ld,
                                           int valid) {
  const int gi = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    *reinterpret_cast<uint32_t*>(s + (r0 + gi) * kLd<D> + dt * 8 + 2 * t4) =
        pack2<T>(acc[dt][0] * mul0, acc[dt][1] * mul0);
    *reinterpret_cast<uint32_t*>(s + (r0 + gi + 8) * kLd<D> + dt * 8 + 2 * t4) =
        pack2<T>(acc[dt][2] * mul1, acc[dt][3] * mul1);
  }
  __syncwarp();
  constexpr int kChunksPerRow = D / 8;
#pragma unroll
  for (int c = lane; c < 16 * kChunksPerRow; c += 32) {
    const int r = r0 + c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    if (r < valid)
      *reinterpret_cast<uint4*>(g + r * ld + col) =
          *reinterpret_cast<const uint4*>(s + r * kLd<D> + col);
  }
}

// ---- forward (Algorithm 1)
// ------------------------------------------------------------------------

template <typename T, int D>
constexpr size_t fwd_smem_bytes() {
  return static_cast<size_t>(5 * kTile * kLd<D>) * sizeof(T);  // q, 2 × k, 2 × v
}

/// kDrop: attention dropout on P before ·V (the row sums l and lse stay those of the undropped
/// softmax, so O = (P ∘ M / (1 − p)) v).
template <typename T, int D, bool kDrop>
__global__ void __launch_bounds__(kThreads, kFwdMinBlocks<D>)
    flash_forward_kernel(const FwdParams p) {
  constexpr int kBr = kTile, kBc = kTile;
  constexpr int kNS = kBc / 8;  // n8 tiles of a warp's S block (16 × kBc)
  T* sQ = reinterpret_cast<T*>(dyn_smem());
  T* sK = sQ + kBr * kLd<D>;      // [2][kBc][kLd]
  T* sV = sK + 2 * kBc * kLd<D>;  // [2][kBc][kLd]

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int gi = lane >> 2, t4 = lane & 3;
  const int tile = p.n_tiles - 1 - static_cast<int>(blockIdx.x) / p.BH;  // heaviest first
  const int bh = static_cast<int>(blockIdx.x) % p.BH;
  const int b = bh / p.NH, h = bh % p.NH;
  const int Tn = p.T, C = p.NH * D;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const T* base = static_cast<const T*>(p.qkv) + static_cast<int64_t>(b) * Tn * ld + h * D;
  const T* gk = base + C;
  const T* gv = base + 2 * C;
  const int q0 = tile * kBr;
  const int n_kv = (imin(q0 + kBr, Tn) + kBc - 1) / kBc;  // key tiles 0 .. n_kv-1 (causal)

  load_tile<kBr, D>(sQ, base + q0 * ld, ld, Tn - q0);
  {
    const int k0 = (n_kv - 1) * kBc;
    load_tile<kBc, D>(sK, gk + k0 * ld, ld, Tn - k0);
    load_tile<kBc, D>(sV, gv + k0 * ld, ld, Tn - k0);
  }
  cp_async_commit();

  const int r0 = warp * 16;                     // this warp's rows in the tile
  const int qi0 = q0 + r0 + gi, qi1 = qi0 + 8;  // this thread's two query rows
  uint32_t qf[D / 16][4];
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY};  // running max of S·scale·log2(e)
  float l[2] = {0.f, 0.f};              // running sum (this thread's columns only)

  for (int it = 0; it < n_kv; ++it) {
    const int buf = it & 1;
    const int k0 = (n_kv - 1 - it) * kBc;
    if (it + 1 < n_kv) {  // prefetch the next (lower) key tile into the other buffer
      const int k1 = k0 - kBc;
      load_tile<kBc, D>(sK + (buf ^ 1) * kBc * kLd<D>, gk + k1 * ld, ld, Tn - k1);
      load_tile<kBc, D>(sV + (buf ^ 1) * kBc * kLd<D>, gv + k1 * ld, ld, Tn - k1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) ldsm_a<D>(qf[kk], sQ, r0, kk * 16, lane);
    }
    const T* cK = sK + buf * kBc * kLd<D>;
    const T* cV = sV + buf * kBc * kLd<D>;

    // S = q kᵀ (unscaled) for this warp's 16 rows.
    float s[kNS][4] = {};
    gemm_abt<T, D, kNS>(s, qf, cK, lane);
    if (k0 + kBc - 1 > q0) {  // the diagonal tile: keys after the query are masked
#pragma unroll
      for (int nt = 0; nt < kNS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kj = k0 + nt * 8 + 2 * t4 + (e & 1);
          if (kj > (e < 2 ? qi0 : qi1)) s[nt][e] = -INFINITY;
        }
    }

    // Online softmax (rows gi and gi + 8; a row's 4 threads hold 2 columns of each n8 tile).
    float rmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kNS; ++nt) {
      rmax[0] = fmaxf(rmax[0], fmaxf(s[nt][0], s[nt][1]));
      rmax[1] = fmaxf(rmax[1], fmaxf(s[nt][2], s[nt][3]));
    }
    float mref[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      rmax[i] = fmaxf(rmax[i], shfl_xor(rmax[i], 1));
      rmax[i] = fmaxf(rmax[i], shfl_xor(rmax[i], 2));
      const float m_new = fmaxf(m[i], rmax[i] * p.scale_log2);
      mref[i] = m_new == -INFINITY ? 0.f : m_new;  // a fully masked row so far: exp2(−∞) = 0
      const float alpha = exp2f(m[i] - mref[i]);
      m[i] = m_new;
      l[i] *= alpha;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * i] *= alpha;
        o[dt][2 * i + 1] *= alpha;
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNS; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = exp2f(fmaf(s[nt][e], p.scale_log2, -mref[e >> 1]));
      l[0] += s[nt][0] + s[nt][1];
      l[1] += s[nt][2] + s[nt][3];
    }
    if constexpr (kDrop) {  // P ∘ M / (1 − p_effective), after the row sums
      uint32_t w[2][2] = {};
      if ((Tn & 15) == 0)
        dropout_tile_bits<kBc>(w, p.drop, p.drop_thresh, static_cast<uint64_t>(bh), Tn, qi0, qi1,
                               k0, lane);
#pragma unroll
      for (int nt = 0; nt < kNS; ++nt) {
        float f[2][2];
        dropout_rows2<kBc>(f, w, p.drop, p.drop_thresh, p.drop_scale, static_cast<uint64_t>(bh), Tn,
                           qi0, qi1, k0, nt, lane);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= f[e >> 1][e & 1];
      }
    }

    // O += P v.
    gemm_pv<T, D, kNS>(o, s, cV, lane);
    __syncthreads();  // everyone is done with `buf` before the next prefetch overwrites it
  }

  // O /= l; lse = (m + log2 l) · ln 2.
  float inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += shfl_xor(l[i], 1);
    l[i] += shfl_xor(l[i], 2);
    inv[i] = l[i] > 0.f ? 1.f / l[i] : 0.f;
    const int qi = i == 0 ? qi0 : qi1;
    if (t4 == 0 && qi < Tn) p.lse[static_cast<int64_t>(bh) * Tn + qi] = (m[i] + log2f(l[i])) * kLn2;
  }
  T* gout = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * Tn + q0) * C + h * D;
  store_rows<T, D>(sQ, o, inv[0], inv[1], r0, lane, gout, C, Tn - q0);
}

// ---- backward: D = rowsum(dO ⊙ O)
// -----------------------------------------------------------------

constexpr int kDotThreads = 256;

/// dvec[b, h, t] = Σ_d dout[b, t, h, d] · out[b, t, h, d] (fp32). D/8 lanes per (b, t, h) row,
/// 16 bytes each.
template <typename T, int D>
__global__ void __launch_bounds__(kDotThreads)
    flash_dot_kernel(const T* dout, const T* out, float* dvec, int64_t rows, int seq, int NH) {
  constexpr int kLanes = D / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kDotThreads + threadIdx.x;
  const int64_t row = idx / kLanes;  // (b·T + t)·NH + h
  const int part = static_cast<int>(idx % kLanes);
  float acc = 0.f;
  if (row < rows) {
    const uint4 ra = *reinterpret_cast<const uint4*>(dout + row * D + part * 8);
    const uint4 rb = *reinterpret_cast<const uint4*>(out + row * D + part * 8);
    T a[8], c[8];
    memcpy(a, &ra, 16);
    memcpy(c, &rb, 16);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(to_float(a[e]), to_float(c[e]), acc);
  }
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) acc += shfl_xor(acc, o);
  if (part == 0 && row < rows) {
    const int64_t h = row % NH, bt = row / NH, t = bt % seq, b = bt / seq;
    dvec[(b * NH + h) * seq + t] = acc;
  }
}

// ---- backward: dK, dV (Algorithm 2 over key tiles, without dQ)
// --------------------------------------

template <typename T, int D>
constexpr size_t dkdv_smem_bytes() {
  // k, v; 2 × q, 2 × dO (kStream rows); 2 × (lse, D) floats
  return static_cast<size_t>(2 * kTile * kLd<D> + 4 * kStream<D> * kLd<D>) * sizeof(T) +
         4 * kStream<D> * sizeof(float);
}

/// kDrop: with the forward's mask M (f = M / (1 − p)), dV += (P∘f)ᵀ dO and
/// dSᵀ = Pᵀ ⊙ (dPᵀ∘f − D), dPᵀ = v dOᵀ being the gradient of the dropped probabilities.
template <typename T, int D, bool kDrop>
__global__ void __launch_bounds__(kThreads, kDkdvMinBlocks)
    flash_backward_dkdv_kernel(const BwdParams p) {
  constexpr int kBc = kTile;           // keys of this CTA
  constexpr int kBr = kStream<D>;      // queries per streamed tile
  constexpr int kNS = kBr / 8;         // n8 tiles of a warp's Sᵀ block (16 keys × kBr queries)
  constexpr bool kKVInRegs = D <= 64;  // k, v A-fragments kept in registers (else re-read)
  T* sK = reinterpret_cast<T*>(dyn_smem());
  T* sV = sK + kBc * kLd<D>;
  T* sQ = sV + kBc * kLd<D>;                                     // [2][kBr][kLd]
  T* sdO = sQ + 2 * kBr * kLd<D>;                                // [2][kBr][kLd]
  float* sL = reinterpret_cast<float*>(sdO + 2 * kBr * kLd<D>);  // [2][kBr] lse
  float* sD = sL + 2 * kBr;                                      // [2][kBr] D

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int gi = lane >> 2, t4 = lane & 3;
  const int jt = static_cast<int>(blockIdx.x) / p.BH;  // key tile 0 has the most work: first
  const int bh = static_cast<int>(blockIdx.x) % p.BH;
  const int b = bh / p.NH, h = bh % p.NH;
  const int Tn = p.T, C = p.NH * D;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const T* base = static_cast<const T*>(p.qkv) + static_cast<int64_t>(b) * Tn * ld + h * D;
  const T* gdo = static_cast<const T*>(p.dout) + static_cast<int64_t>(b) * Tn * C + h * D;
  const float* glse = p.lse + static_cast<int64_t>(bh) * Tn;
  const float* gdv = p.dvec + static_cast<int64_t>(bh) * Tn;
  const int k0 = jt * kBc;
  const int i_begin = k0 / kBr, n_q = (Tn + kBr - 1) / kBr;  // query tiles from the diagonal on

  auto load_queries = [&](int i, int buf) {
    const int q0 = i * kBr;
    load_tile<kBr, D>(sQ + buf * kBr * kLd<D>, base + q0 * ld, ld, Tn - q0);
    load_tile<kBr, D>(sdO + buf * kBr * kLd<D>, gdo + q0 * static_cast<int64_t>(C), C, Tn - q0);
    if (tid < kBr) {
      const int q = q0 + tid;
      cp_async_4(sL + buf * kBr + tid, glse + imin(q, Tn - 1), q < Tn);
    } else if (tid < 2 * kBr) {
      const int q = q0 + tid - kBr;
      cp_async_4(sD + buf * kBr + tid - kBr, gdv + imin(q, Tn - 1), q < Tn);
    }
  };
  load_tile<kBc, D>(sK, base + C + k0 * ld, ld, Tn - k0);
  load_tile<kBc, D>(sV, base + 2 * C + k0 * ld, ld, Tn - k0);
  load_queries(i_begin, 0);
  cp_async_commit();

  const int r0 = warp * 16;                     // this warp's keys in the tile
  const int kj0 = k0 + r0 + gi, kj1 = kj0 + 8;  // this thread's two key rows
  uint32_t kf[kKVInRegs ? D / 16 : 1][4], vf[kKVInRegs ? D / 16 : 1][4];
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};

  for (int it = 0; i_begin + it < n_q; ++it) {
    const int i = i_begin + it, buf = it & 1, q0 = i * kBr;
    if (i + 1 < n_q) {
      load_queries(i + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (kKVInRegs) {
      if (it == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          ldsm_a<D>(kf[kk], sK, r0, kk * 16, lane);
          ldsm_a<D>(vf[kk], sV, r0, kk * 16, lane);
        }
      }
    }
    const T* cQ = sQ + buf * kBr * kLd<D>;
    const T* cdO = sdO + buf * kBr * kLd<D>;
    const float* cL = sL + buf * kBr;
    const float* cD = sD + buf * kBr;

    // Sᵀ = k qᵀ and dPᵀ = v dOᵀ (16 keys × kBr queries per warp).
    float st[kNS][4] = {}, dpt[kNS][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4], va[4];
      if constexpr (kKVInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ka[e] = kf[kk][e];
          va[e] = vf[kk][e];
        }
      } else {
        ldsm_a<D>(ka, sK, r0, kk * 16, lane);
        ldsm_a<D>(va, sV, r0, kk * 16, lane);
      }
#pragma unroll
      for (int np = 0; np < kNS / 2; ++np) {
        uint32_t bq[4], bd[4];
        ldsm_b_nmajor<D>(bq, cQ, np * 16, kk * 16, lane);
        mma_16816<T>(st[2 * np], ka, bq[0], bq[1]);
        mma_16816<T>(st[2 * np + 1], ka, bq[2], bq[3]);
        ldsm_b_nmajor<D>(bd, cdO, np * 16, kk * 16, lane);
        mma_16816<T>(dpt[2 * np], va, bd[0], bd[1]);
        mma_16816<T>(dpt[2 * np + 1], va, bd[2], bd[3]);
      }
    }

    // Pᵀ = exp(Sᵀ·scale − lse[query]), 0 where key > query or query ≥ T;
    // dSᵀ = Pᵀ ⊙ (dPᵀ − D[query]).
    const bool need_mask = q0 < k0 + kBc - 1 || q0 + kBr > Tn;
    // Dropout with T a multiple of 16: this warp's 16 keys from k0 + r0 (a multiple of 16) are one
    // aligned Philox group per query; lane L draws the groups of queries q0 + L + 32·j (j <
    // kBr/32, bits 16·j ..) and the lanes share them with shuffles.
    uint32_t mine = 0;
    if constexpr (kDrop) {
      if ((Tn & 15) == 0) {
#pragma unroll
        for (int j = 0; j < kBr / 32; ++j)
          mine |= AttnDropout8::keep_mask16(
                      p.drop,
                      (static_cast<uint64_t>(bh) * Tn + static_cast<uint64_t>(q0 + lane + 32 * j)) *
                              static_cast<uint64_t>(Tn) +
                          static_cast<uint64_t>(k0 + r0),
                      p.drop_thresh)
                  << (16 * j);
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNS; ++nt) {
      uint32_t qbits[2] = {0, 0};  // keep bits of queries nt·8 + 2·t4 + c over the warp's 16 keys
      if constexpr (kDrop) {
        if ((Tn & 15) == 0) {
#pragma unroll
          for (int c = 0; c < 2; ++c)
            qbits[c] = shfl_idx(mine, (nt & 3) * 8 + 2 * t4 + c) >> (16 * (nt >> 2));
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t4 + (e & 1), qi = q0 + qc;
        float pv = exp2f(fmaf(st[nt][e], p.scale_log2, -cL[qc] * kLog2e));
        if (need_mask && ((e < 2 ? kj0 : kj1) > qi || qi >= Tn)) pv = 0.f;
        if constexpr (kDrop) {
          // Element (query qi, key kj) of P: adjacent e are adjacent queries, T apart.
          float f;
          if ((Tn & 15) == 0) {
            f = (qbits[e & 1] >> (gi + 8 * (e >> 1))) & 1u ? p.drop_scale : 0.f;
          } else {
            f = dropout_one(p.drop, p.drop_thresh, p.drop_scale,
                            (static_cast<uint64_t>(bh) * Tn + qi) * Tn +
                                static_cast<uint64_t>(e < 2 ? kj0 : kj1));
          }
          st[nt][e] = pv * f;
          dpt[nt][e] = pv * (dpt[nt][e] * f - cD[qc]);
        } else {
          st[nt][e] = pv;
          dpt[nt][e] = pv * (dpt[nt][e] - cD[qc]);
        }
      }
    }

    // dV += Pᵀ dO, dK += dSᵀ q (queries are the reduction dimension).
    gemm_pv<T, D, kNS>(dv, st, cdO, lane);
    gemm_pv<T, D, kNS>(dk, dpt, cQ, lane);
    __syncthreads();  // everyone is done with `buf` (and, at the end, with sK / sV)
  }

  // dK ·= scale; write dK, dV (keys < T) into dqkv slots 1, 2.
  T* gdk = static_cast<T*>(p.dqkv) + (static_cast<int64_t>(b) * Tn + k0) * ld + C + h * D;
  store_rows<T, D>(sK, dk, p.scale, p.scale, r0, lane, gdk, ld, Tn - k0);
  store_rows<T, D>(sV, dv, 1.f, 1.f, r0, lane, gdk + C, ld, Tn - k0);
}

// ---- backward: dQ (over query tiles; no atomics)
// --------------------------------------------------

template <typename T, int D>
constexpr size_t dq_smem_bytes() {
  // q, dO; 2 × k, 2 × v (kStream rows)
  return static_cast<size_t>(2 * kTile * kLd<D> + 4 * kStream<D> * kLd<D>) * sizeof(T);
}

/// kDrop: dS = P ⊙ (dP∘f − D) with the forward's mask (f = M / (1 − p)).
template <typename T, int D, bool kDrop>
__global__ void __launch_bounds__(kThreads, kDqMinBlocks<D>)
    flash_backward_dq_kernel(const BwdParams p) {
  constexpr int kBr = kTile;       // queries of this CTA
  constexpr int kBc = kStream<D>;  // keys per streamed tile
  constexpr int kNS = kBc / 8;
  T* sQ = reinterpret_cast<T*>(dyn_smem());
  T* sdO = sQ + kBr * kLd<D>;
  T* sK = sdO + kBr * kLd<D>;     // [2][kBc][kLd]
  T* sV = sK + 2 * kBc * kLd<D>;  // [2][kBc][kLd]

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int gi = lane >> 2, t4 = lane & 3;
  const int tile = p.n_tiles - 1 - static_cast<int>(blockIdx.x) / p.BH;  // heaviest first
  const int bh = static_cast<int>(blockIdx.x) % p.BH;
  const int b = bh / p.NH, h = bh % p.NH;
  const int Tn = p.T, C = p.NH * D;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const T* base = static_cast<const T*>(p.qkv) + static_cast<int64_t>(b) * Tn * ld + h * D;
  const T* gk = base + C;
  const T* gv = base + 2 * C;
  const T* gdo = static_cast<const T*>(p.dout) + static_cast<int64_t>(b) * Tn * C + h * D;
  const int q0 = tile * kBr;
  const int n_kv = (imin(q0 + kBr, Tn) + kBc - 1) / kBc;

  load_tile<kBr, D>(sQ, base + q0 * ld, ld, Tn - q0);
  load_tile<kBr, D>(sdO, gdo + q0 * static_cast<int64_t>(C), C, Tn - q0);
  {
    const int k0 = (n_kv - 1) * kBc;
    load_tile<kBc, D>(sK, gk + k0 * ld, ld, Tn - k0);
    load_tile<kBc, D>(sV, gv + k0 * ld, ld, Tn - k0);
  }
  cp_async_commit();

  const int r0 = warp * 16;
  const int qi0 = q0 + r0 + gi, qi1 = qi0 + 8;
  // Row statistics of this thread's two rows (rows ≥ T: 0; they are computed but not stored).
  float lse2[2], drow[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int qi = i == 0 ? qi0 : qi1;
    lse2[i] = qi < Tn ? p.lse[static_cast<int64_t>(bh) * Tn + qi] * kLog2e : 0.f;
    drow[i] = qi < Tn ? p.dvec[static_cast<int64_t>(bh) * Tn + qi] : 0.f;
  }
  uint32_t qf[D / 16][4], dof[D / 16][4];
  float dq[D / 8][4] = {};

  for (int it = 0; it < n_kv; ++it) {
    const int buf = it & 1;
    const int k0 = (n_kv - 1 - it) * kBc;
    if (it + 1 < n_kv) {
      const int k1 = k0 - kBc;
      load_tile<kBc, D>(sK + (buf ^ 1) * kBc * kLd<D>, gk + k1 * ld, ld, Tn - k1);
      load_tile<kBc, D>(sV + (buf ^ 1) * kBc * kLd<D>, gv + k1 * ld, ld, Tn - k1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        ldsm_a<D>(qf[kk], sQ, r0, kk * 16, lane);
        ldsm_a<D>(dof[kk], sdO, r0, kk * 16, lane);
      }
    }
    const T* cK = sK + buf * kBc * kLd<D>;
    const T* cV = sV + buf * kBc * kLd<D>;

    // S = q kᵀ, dP = dO vᵀ (16 queries × kBc keys per warp).
    float s[kNS][4] = {}, dp[kNS][4] = {};
    gemm_abt<T, D, kNS>(s, qf, cK, lane);
    gemm_abt<T, D, kNS>(dp, dof, cV, lane);

    // P = exp(S·scale − lse) (0 where key > query), dS = P ⊙ (dP − D).
    const bool need_mask = k0 + kBc - 1 > q0;
    if constexpr (kDrop) {
      uint32_t w[2][2] = {};
      if ((Tn & 15) == 0)
        dropout_tile_bits<kBc>(w, p.drop, p.drop_thresh, static_cast<uint64_t>(bh), Tn, qi0, qi1,
                               k0, lane);
#pragma unroll
      for (int nt = 0; nt < kNS; ++nt) {
        float f[2][2];
        dropout_rows2<kBc>(f, w, p.drop, p.drop_thresh, p.drop_scale, static_cast<uint64_t>(bh), Tn,
                           qi0, qi1, k0, nt, lane);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e >> 1;
          float pv = exp2f(fmaf(s[nt][e], p.scale_log2, -lse2[i]));
          if (need_mask && k0 + nt * 8 + 2 * t4 + (e & 1) > (i == 0 ? qi0 : qi1)) pv = 0.f;
          s[nt][e] = pv * (dp[nt][e] * f[i][e & 1] - drow[i]);
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kNS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e >> 1;
          float pv = exp2f(fmaf(s[nt][e], p.scale_log2, -lse2[i]));
          if (need_mask && k0 + nt * 8 + 2 * t4 + (e & 1) > (i == 0 ? qi0 : qi1)) pv = 0.f;
          s[nt][e] = pv * (dp[nt][e] - drow[i]);
        }
    }

    // dQ += dS k.
    gemm_pv<T, D, kNS>(dq, s, cK, lane);
    __syncthreads();
  }

  T* gdq = static_cast<T*>(p.dqkv) + (static_cast<int64_t>(b) * Tn + q0) * ld + h * D;
  store_rows<T, D>(sQ, dq, p.scale, p.scale, r0, lane, gdq, ld, Tn - q0);
}

// ==== end of device code =========================================================================

// ---- host side
// --------------------------------------------------------------------------------------

struct FlashShape {
  int64_t B = 0, T = 0, C = 0, NH = 0, hs = 0, BH = 0;
  float scale = 1.f;
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

FlashShape flash_shape(const Tensor& qkv, int num_heads, const char* op) {
  FlashShape s;
  require(qkv.ndim == 3 && qkv.dim(2) % 3 == 0, "cuda ", op, ": qkv must be [B, T, 3C], got ",
          qkv.shape_str());
  s.B = qkv.dim(0);
  s.T = qkv.dim(1);
  s.C = qkv.dim(2) / 3;
  s.NH = num_heads;
  require(num_heads > 0 && s.C % num_heads == 0, "cuda ", op, ": ", s.C,
          " channels do not split into ", num_heads, " heads");
  s.hs = s.C / s.NH;
  s.BH = s.B * s.NH;
  s.scale = 1.0f / std::sqrt(static_cast<float>(s.hs));
  require(flash_attention_supported(qkv.dtype, static_cast<int>(s.hs)), "cuda ", op,
          ": flash attention supports bf16/fp16 tensors with head size 32, 64 or 128; got ",
          dtype_name(qkv.dtype), " with head size ", s.hs,
          " (set SHARDTRAIN_ATTENTION=materialized to use the materialized kernels)");
  require(s.T < (int64_t{1} << 30) && s.BH < (int64_t{1} << 30), "cuda ", op, ": T = ", s.T,
          ", batch·heads = ", s.BH, " are too large");
  require(s.BH * ((s.T + kTile - 1) / kTile) <= INT32_MAX, "cuda ", op,
          ": too many tiles (batch·heads·ceil(T/64) > 2^31 − 1)");
  return s;
}

void check_tensor(const Tensor& t, DType dt, int64_t numel, bool needs_align, const char* name,
                  const char* op) {
  require(t.dtype == dt, "cuda ", op, ": ", name, " is ", dtype_name(t.dtype), ", expected ",
          dtype_name(dt));
  require(t.numel() == numel, "cuda ", op, ": ", name, " has ", t.numel(), " elements, expected ",
          numel);
  require(!needs_align || aligned16(t.data), "cuda ", op, ": ", name,
          " must be 16-byte aligned for flash attention");
}

bool overlaps(const Tensor& a, const Tensor& b) {
  const auto* pa = static_cast<const char*>(a.data);
  const auto* pb = static_cast<const char*>(b.data);
  return pa < pb + b.bytes() && pb < pa + a.bytes();
}

/// Calls f.template operator()<E, D>() for the element type E of `dt` and head size D.
template <typename F>
void dispatch_flash(DType dt, int64_t hs, F&& f) {
  auto by_head = [&]<typename E>() {
    switch (hs) {
      case 32:
        f.template operator()<E, 32>();
        return;
      case 64:
        f.template operator()<E, 64>();
        return;
      case 128:
        f.template operator()<E, 128>();
        return;
      default:
        require(false, "cuda flash attention: unsupported head size ", hs);
    }
  };
  if (dt == DType::kBF16)
    by_head.template operator()<__nv_bfloat16>();
  else if (dt == DType::kF16)
    by_head.template operator()<__half>();
  else
    require(false, "cuda flash attention: unsupported dtype ", dtype_name(dt));
}

template <typename Kernel, typename Params>
void launch(Kernel kernel, int64_t grid, size_t smem, cudaStream_t stream, const Params& prm) {
  if (smem > 48 * 1024)
    ST_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(prm);
  ST_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool flash_attention_supported(DType dt, int head_size) {
  return (dt == DType::kBF16 || dt == DType::kF16) &&
         (head_size == 32 || head_size == 64 || head_size == 128);
}

void flash_attention_forward(const CudaContext& ctx, Tensor out, Tensor lse, Tensor qkv,
                             int num_heads, const Dropout& dropout) {
  const char* op = "flash_attention_forward";
  const FlashShape s = flash_shape(qkv, num_heads, op);
  require(!lse.empty(), "cuda ", op, ": needs a saved lse buffer [B, NH, T] (fp32)");
  check_tensor(qkv, qkv.dtype, s.B * s.T * 3 * s.C, true, "qkv", op);
  check_tensor(out, qkv.dtype, s.B * s.T * s.C, true, "out", op);
  check_tensor(lse, DType::kF32, s.BH * s.T, false, "lse", op);
  if (s.B == 0 || s.T == 0) return;

  FwdParams prm{};
  prm.qkv = qkv.data;
  prm.out = out.data;
  prm.lse = lse.as<float>();
  prm.T = static_cast<int>(s.T);
  prm.NH = static_cast<int>(s.NH);
  prm.BH = static_cast<int>(s.BH);
  prm.n_tiles = static_cast<int>((s.T + kTile - 1) / kTile);
  prm.scale_log2 = s.scale * kLog2e;
  prm.drop = dropout;
  prm.drop_thresh = AttnDropout8::threshold(dropout);
  prm.drop_scale = AttnDropout8::scale(dropout);
  const int64_t grid = prm.n_tiles * s.BH;
  dispatch_flash(qkv.dtype, s.hs, [&]<typename E, int D>() {
    dispatch_dropout(dropout, [&]<bool kDrop>() {
      launch(flash_forward_kernel<E, D, kDrop>, grid, fwd_smem_bytes<E, D>(), ctx.stream, prm);
    });
  });
}

void flash_attention_backward(const CudaContext& ctx, Tensor dqkv, Tensor dout, Tensor qkv,
                              Tensor out, Tensor lse, int num_heads, const Dropout& dropout) {
  const char* op = "flash_attention_backward";
  const FlashShape s = flash_shape(qkv, num_heads, op);
  require(!lse.empty(), "cuda ", op, ": needs the lse [B, NH, T] saved by the forward");
  check_tensor(qkv, qkv.dtype, s.B * s.T * 3 * s.C, true, "qkv", op);
  check_tensor(dqkv, qkv.dtype, s.B * s.T * 3 * s.C, true, "dqkv", op);
  check_tensor(dout, qkv.dtype, s.B * s.T * s.C, true, "dout", op);
  check_tensor(out, qkv.dtype, s.B * s.T * s.C, true, "out", op);
  check_tensor(lse, DType::kF32, s.BH * s.T, false, "lse", op);
  // dK/dV and dQ are written by other CTAs than those reading q, k, v, dO and O.
  require(!overlaps(dqkv, qkv) && !overlaps(dqkv, dout) && !overlaps(dqkv, out), "cuda ", op,
          ": dqkv must not overlap qkv, dout or out");
  if (s.B == 0 || s.T == 0) return;

  auto* dvec =
      static_cast<float*>(ctx.get_scratch(static_cast<size_t>(s.BH * s.T) * sizeof(float)));
  BwdParams prm{};
  prm.qkv = qkv.data;
  prm.dout = dout.data;
  prm.lse = lse.as<float>();
  prm.dvec = dvec;
  prm.dqkv = dqkv.data;
  prm.T = static_cast<int>(s.T);
  prm.NH = static_cast<int>(s.NH);
  prm.BH = static_cast<int>(s.BH);
  prm.n_tiles = static_cast<int>((s.T + kTile - 1) / kTile);
  prm.scale = s.scale;
  prm.scale_log2 = s.scale * kLog2e;
  prm.drop = dropout;
  prm.drop_thresh = AttnDropout8::threshold(dropout);
  prm.drop_scale = AttnDropout8::scale(dropout);
  const int64_t grid = prm.n_tiles * s.BH;
  const int64_t rows = s.B * s.T * s.NH;
  dispatch_flash(qkv.dtype, s.hs, [&]<typename E, int D>() {
    const int64_t dot_threads = rows * (D / 8);
    flash_dot_kernel<E, D>
        <<<ceil_div(static_cast<size_t>(dot_threads), kDotThreads), kDotThreads, 0, ctx.stream>>>(
            dout.as<E>(), out.as<E>(), dvec, rows, prm.T, prm.NH);
    ST_CUDA_LAUNCH_CHECK();
    dispatch_dropout(dropout, [&]<bool kDrop>() {
      launch(flash_backward_dkdv_kernel<E, D, kDrop>, grid, dkdv_smem_bytes<E, D>(), ctx.stream,
             prm);
      launch(flash_backward_dq_kernel<E, D, kDrop>, grid, dq_smem_bytes<E, D>(), ctx.stream, prm);
    });
  });
}

}  // namespace shardtrain::cuda
