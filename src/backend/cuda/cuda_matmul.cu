// Linear layers on the GPU: cuBLASLt GEMMs with fused bias / GELU / dGELU epilogues, and a
// deterministic bias-gradient reduction.
//
// Semantics (backend/backend.h, matched by backend/cpu/cpu_matmul.cpp):
//   forward : out [N,OC] = inp [N,IC] · W[OC,IC]ᵀ + b[OC]
//             (kGelu: pre_gelu = that, out = gelu(it))
//   backward: dinp [N,IC] = dout [N,OC] · W       (OVERWRITES; · gelu'(dinp_gelu_input) if given)
//             dW [OC,IC] += doutᵀ · inp           (ACCUMULATES, beta = 1)
//             db [OC]    += Σ_rows dout           (ACCUMULATES, own two-stage kernel)
// GELU is the tanh approximation (Hendrycks & Gimpel, arXiv 1606.08415, §2), as on the CPU.
//
// ---- row-major ↔ column-major ------------------------------------------------------------------
// cuBLASLt is column-major. A row-major matrix X [r, c] (leading dimension c) occupies exactly the
// memory of the column-major matrix Xᵀ [c, r] with the same leading dimension c, so every
// row-major product is computed as its transpose:
//   forward  out[N,OC] = inp·Wᵀ   ⇔  outᵀ [OC,N] = W · inpᵀ
//            W buffer is col-major [IC,OC] (ld IC): op = T gives W [OC,IC];
//            inp buffer is col-major [IC,N] (ld IC): op = N;  D col-major [OC,N], ld OC.
//            m = OC, n = N, k = IC ("TN" GEMM). The bias is indexed by D's row (m = OC), which is
//            exactly the row-major column index, so CUBLASLT_EPILOGUE_BIAS broadcasts it per row of
//            out. The GELU aux matrix (pre_gelu) has D's layout: ld OC.
//   dinp     dinp[N,IC] = dout·W  ⇔  dinpᵀ [IC,N] = Wᵀ · doutᵀ
//            W buffer col-major [IC,OC] (ld IC): op = N;
//            dout buffer col-major [OC,N] (ld OC): op = N.
//            m = IC, n = N, k = OC ("NN"). The dGELU aux (dinp_gelu_input) has D's layout, ld IC.
//   dweight  dW[OC,IC] += doutᵀ·inp ⇔  dWᵀ [IC,OC] += inpᵀ · dout
//            inp buffer col-major [IC,N] (ld IC): op = N;
//            dout buffer col-major [OC,N] (ld OC): op = T.
//            m = IC, n = OC, k = N ("NT"), beta = 1, C = D = dW (ld IC).
//
// ---- epilogues -------------------------------------------------------------------------------
//   forward kNone: BIAS (bias given) or DEFAULT.
//   forward kGelu: GELU_AUX_BIAS (bias given) or GELU_AUX; the aux output is pre_gelu
//            (pre-activation, after the bias). cuBLASLt requires the aux leading dimension to be a
//            multiple of 8 (cublasLt.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD): OC = 4C for GPT-2.
//   dinp with dinp_gelu_input: DGELU, aux = dinp_gelu_input: D = (dout·W) ⊙ gelu'(aux), the product
//            taken in fp32 before rounding to the output dtype ("apply GELU gradient to
//            matmul output").
//   When a fused epilogue's requirements fail (aux ld not a multiple of 8, bias/aux pointer not
//   16-byte aligned, or the heuristic offers no algorithm, e.g. for some dtype), the GEMM runs with
//   DEFAULT and separate bias / GELU / dGELU kernels below finish the job (same math). fp32 tensors
//   always take the separate GELU / dGELU kernels: cuBLASLt's GELU differs from the tanhf-based
//   reference by ~4e-6 relative (measured), too much for fp32's tight-parity role; BIAS stays
//   fused. SHARDTRAIN_CUDA_NO_FUSED_EPILOGUE=1 in the environment forces that path (for testing).
//   cuBLASLt's bias-gradient epilogues (BGRADA/B) OVERWRITE their output and tie the reduction to
//   the GEMM's algorithm; the bias gradient here is our own kernel that ADDS into dbias.
//
// ---- precision and determinism ----------------------------------------------------------------
// Compute type CUBLAS_COMPUTE_32F with fp32 scale for every dtype; for fp32 tensors that is plain
// fp32 FMA (no TF32), so fp32 mode matches the CPU reference tightly. cuBLASLt is bit-reproducible
// for a fixed algorithm, workspace and GPU; the heuristic's choice is cached per problem (shape,
// dtypes, transposes, epilogue, pointer alignments), so one run always uses one algorithm per
// call site. The bias-gradient reduction sums in a fixed order (rows within a thread, the 8 row
// lanes of a block, then chunks in chunk order), with chunk size a function of N only.
//
// Awkward OC: when OC·es is not a multiple of 16 bytes (the LM head, OC = 50257) and the problem is
// large, OC is padded (see needs_oc_padding(); ~5x faster on an H200) — in place when the caller
// gives out/dout with padded rows [N, OCp] (Backend::padded_columns; the model's logits), else
// through scratch copies.
//
// Dtypes: inp, weight, bias, out, pre_gelu, dout, dinp, dinp_gelu_input share the compute dtype
// (fp32, bf16 or fp16); dweight and dbias may be that dtype or fp32 (fp32 gradient accumulation).

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "backend/cuda/cuda_gelu.h"
#include "backend/cuda/cuda_ops.h"

namespace shardtrain::cuda {
namespace {

// ---- fallback epilogue kernels ------------------------------------------------------------------

/// y[i, o] = pre[i, o] + bias[o] (when bias), then with kGelu: pre[i, o] = y, out[i, o] = gelu(y);
/// without kGelu: out[i, o] = y (out may be pre).
template <typename T, bool kGelu>
__global__ void bias_gelu_kernel(T* out, T* pre, const T* bias, int64_t total, int64_t OC) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = to_float(pre[i]);
    if (bias) v += to_float(bias[i % OC]);
    if constexpr (kGelu) {
      pre[i] = from_float<T>(v);
      out[i] = from_float<T>(gelu(v));
    } else {
      out[i] = from_float<T>(v);
    }
  }
}

/// dinp[i] *= gelu'(x[i]) (in place).
template <typename T>
__global__ void gelu_backward_inplace_kernel(T* dinp, const T* x, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dinp[i] = from_float<T>(to_float(dinp[i]) * gelu_grad(to_float(x[i])));
  }
}

unsigned elementwise_blocks(const CudaContext& ctx, int64_t total, int threads) {
  const int64_t want = (total + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(std::max(ctx.sm_count, 1)) * 16;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(want, cap)));
}

// ---- bias gradient: dbias[o] += Σ_i dout[i, o] -------------------------------------------------
// Stage 1: block (32, 8) owns 64 columns (2 adjacent per lane: a warp reads 64 contiguous elements
// of a row) and one chunk of rows; lane row r sums rows r, r+8, ... of the chunk in order; the 8
// row lanes are combined in order through shared memory. With one chunk the block adds straight
// into dbias; otherwise partial [nchunks, OC] fp32 goes to stage 2, which sums chunks in order.
constexpr int kBgCols = 64;
constexpr int kBgRowLanes = 8;

template <typename Tin, typename Tout, bool kDirect>
__global__ void __launch_bounds__(32 * kBgRowLanes)
    bias_grad_partial_kernel(float* partial, Tout* dbias, const Tin* dout, int64_t N, int64_t OC,
                             int64_t rows_per_chunk) {
  __shared__ float sm[kBgRowLanes][kBgCols];
  const int64_t c0 = blockIdx.x * static_cast<int64_t>(kBgCols) + 2 * threadIdx.x;
  const int64_t r_begin = blockIdx.y * rows_per_chunk;
  const int64_t r_end = r_begin + rows_per_chunk < N ? r_begin + rows_per_chunk : N;
  float s0 = 0.f, s1 = 0.f;
  for (int64_t r = r_begin + threadIdx.y; r < r_end; r += kBgRowLanes) {
    const Tin* row = dout + r * OC;
    if (c0 < OC) s0 += to_float(row[c0]);
    if (c0 + 1 < OC) s1 += to_float(row[c0 + 1]);
  }
  sm[threadIdx.y][2 * threadIdx.x] = s0;
  sm[threadIdx.y][2 * threadIdx.x + 1] = s1;
  __syncthreads();
  if (threadIdx.y < 2) {
    // Two warps finish: warp 0 the even columns, warp 1 the odd ones (one column per thread).
    const int local = 2 * static_cast<int>(threadIdx.x) + static_cast<int>(threadIdx.y);
    const int64_t c = blockIdx.x * static_cast<int64_t>(kBgCols) + local;
    if (c < OC) {
      float s = 0.f;
      for (int j = 0; j < kBgRowLanes; ++j) s += sm[j][local];
      if constexpr (kDirect) {
        dbias[c] = from_float<Tout>(to_float(dbias[c]) + s);
      } else {
        partial[blockIdx.y * OC + c] = s;
      }
    }
  }
}

/// Chunking of the bias-gradient rows: a function of N alone (so results do not depend on the GPU).
struct BiasGradPlan {
  int64_t nchunks = 1, rows_per_chunk = 1;
};
BiasGradPlan bias_grad_plan(int64_t N) {
  BiasGradPlan p;
  p.nchunks = std::clamp<int64_t>((N + 127) / 128, 1, 256);
  p.rows_per_chunk = (N + p.nchunks - 1) / p.nchunks;
  p.rows_per_chunk = (p.rows_per_chunk + kBgRowLanes - 1) / kBgRowLanes * kBgRowLanes;
  p.nchunks = std::max<int64_t>(1, (N + p.rows_per_chunk - 1) / p.rows_per_chunk);
  return p;
}

// ---- padding an awkward OC --------------------------------------------------------------------
// When OC·es is not a multiple of 16 bytes (GPT-2's LM head: OC = V = 50257), cuBLASLt drops to
// slow kernels: measured on an H200, N=16384, C=1024, bf16: forward (m = OC) 17.5 ms instead of
// 2.1, dinp (k = OC) 12 ms instead of 1.85, dweight (n = OC) 3.1 ms instead of 1.8. Padding only
// the leading dimension does not help; the GEMM dimension itself must be a multiple of 8. So for
// such a (large) problem OC is padded to OCp = round_up(OC, 16) through scratch copies:
//   forward : W → Wp [OCp, IC] (zero rows), bias → bp [OCp]; GEMM into Yp [N, OCp];
//             Yp[:, :OC] → out
//   backward: dout → Dp [N, OCp] (zero columns), W → Wp (zero rows; for dinp only);
//             dinp = Dp·Wp (k = OCp: the zero pads add nothing);
//             dWp [OCp, IC] fp32 = Dpᵀ·inp (beta 0), then dW[:OC] = dW + dWp[:OC] (one rounding,
//             like beta = 1 inside the GEMM).
// Extra traffic: about one read and one write of the [N, OC] matrix; extra scratch N·OCp·es plus
// OCp·IC·(es + 4) bytes (LM head, N=16384, bf16: 1.6 GB + 0.3 GB).
// With padded rows (out/dout [N, OCp] given by the caller) neither copy of the [N, OC] matrix is
// made: forward writes Y straight into out (m = OCp, its pad columns zero), dinp reads dout with
// k = OCp, and dW (n = OC, ldb = OCp) accumulates straight into dweight; the scratch is Wp alone
// (OCp·IC·es: 103 MB for gpt2-medium, 161 MB for gpt2-xl).
constexpr int64_t kPadMinElements = int64_t{1} << 20;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

bool needs_oc_padding(int64_t N, int64_t OC, DType dt) {
  return (OC * static_cast<int64_t>(dtype_size(dt))) % 16 != 0 && N * OC >= kPadMinElements;
}

/// dst[r, c] (r < rows, c < cols, leading dimension ld_dst) = src[r, c] where r < src_rows and
/// c < src_cols (leading dimension ld_src), else 0. Copies, pads and crops.
template <typename T>
__global__ void copy_pad_kernel(T* dst, int64_t ld_dst, int64_t rows, int64_t cols, const T* src,
                                int64_t ld_src, int64_t src_rows, int64_t src_cols) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* s = src + r * ld_src;
    T* d = dst + r * ld_dst;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      d[c] = r < src_rows && c < src_cols ? s[c] : from_float<T>(0.f);
    }
  }
}

void copy_pad(const CudaContext& ctx, DType dt, void* dst, int64_t ld_dst, int64_t rows,
              int64_t cols, const void* src, int64_t ld_src, int64_t src_rows, int64_t src_cols) {
  constexpr int kThreads = 256;
  const dim3 grid(std::min<unsigned>(ceil_div(static_cast<size_t>(cols), kThreads), 256u),
                  static_cast<unsigned>(std::min<int64_t>(rows, 1024)));
  dispatch_float(dt, [&]<typename T>() {
    copy_pad_kernel<T><<<grid, kThreads, 0, ctx.stream>>>(static_cast<T*>(dst), ld_dst, rows, cols,
                                                          static_cast<const T*>(src), ld_src,
                                                          src_rows, src_cols);
  });
  ST_CUDA_LAUNCH_CHECK();
}

/// acc[i] = acc[i] + add[i] (fp32 add, one rounding to acc's dtype).
template <typename T>
__global__ void accumulate_kernel(T* acc, const float* add, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc[i] = from_float<T>(to_float(acc[i]) + add[i]);
  }
}

/// Carves 256-byte-aligned pieces out of one scratch allocation (sizes first, then take()).
struct Carver {
  char* base = nullptr;
  size_t used = 0;
  static size_t padded(size_t bytes) { return (bytes + 255) / 256 * 256; }
  void* take(size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = base + used;
    used += padded(bytes);
    return p;
  }
};

// ---- cuBLASLt ---------------------------------------------------------------------------------

/// Alignment of a device pointer in bytes (the largest power of two dividing it), capped at 256.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  return static_cast<uint32_t>(std::min<uintptr_t>(a & (~a + 1), 256));
}

/// One column-major cuBLASLt problem: D [m,n] = alpha · op(A) · op(B) + beta · D (C aliases D).
struct LtGemm {
  cublasOperation_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;
  const void* A = nullptr;
  int64_t lda = 0;
  const void* B = nullptr;
  int64_t ldb = 0;
  void* D = nullptr;
  int64_t ldd = 0;
  float alpha = 1.f, beta = 0.f;
  cudaDataType_t ab_type = CUDA_R_32F, d_type = CUDA_R_32F;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  ///< BIAS epilogues: [m] in d_type
  void* aux = nullptr;         ///< GELU_AUX (output) / DGELU (input): [m,n] col-major, ld aux_ld
  int64_t aux_ld = 0;
};

/// What the heuristic's answer depends on; the cached algorithm is reused only for equal keys.
struct LtKey {
  int device;
  int transa, transb;
  int64_t m, n, k, lda, ldb, ldd, aux_ld;
  int ab_type, d_type, epilogue;
  int sm_target;  ///< 0: all SMs
  bool beta_nonzero;
  uint32_t align_a, align_b, align_d, align_bias, align_aux;
  size_t workspace;
  auto operator<=>(const LtKey&) const = default;
};

struct LtCache {
  std::mutex mu;
  std::map<LtKey, std::optional<cublasLtMatmulAlgo_t>> algos;  // nullopt: no algorithm offered
};
LtCache& lt_cache() {
  static LtCache cache;
  return cache;
}

/// SMs every GEMM leaves free (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET = SMs − margin), from
/// SHARDTRAIN_GEMM_SM_MARGIN (default 0: all SMs). For experiments with communication overlap:
/// NCCL's kernels then find free SMs instead of stretching a GEMM sized for the whole GPU (the
/// same knob as TransformerEngine's NVTE_EXT_MARGIN_SM). Measured on 2 H200s (gpt2-medium dp):
/// margins of 8/16/32 SMs made steps 7–14% slower, so it stays off.
int gemm_sm_margin() {
  static const int margin = [] {
    const char* v = std::getenv("SHARDTRAIN_GEMM_SM_MARGIN");
    return v && *v ? std::max(0, std::atoi(v)) : 0;
  }();
  return margin;
}

bool fused_epilogues_disabled() {
  static const bool disabled = [] {
    const char* v = std::getenv("SHARDTRAIN_CUDA_NO_FUSED_EPILOGUE");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  return disabled;
}

struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtDescs() = default;
  LtDescs(const LtDescs&) = delete;
  LtDescs& operator=(const LtDescs&) = delete;
  ~LtDescs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

template <typename V>
void set_desc(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const V& v) {
  ST_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, attr, &v, sizeof(v)));
}
template <typename V>
void set_pref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr, const V& v) {
  ST_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &v, sizeof(v)));
}

/// Runs `g` on ctx.stream. Returns false (enqueuing nothing) when cuBLASLt offers no algorithm for
/// it, so the caller can fall back to a plainer epilogue; throws on any other failure.
bool lt_matmul(const CudaContext& ctx, const LtGemm& g) {
  LtDescs ds;
  ST_CUBLAS_CHECK(cublasLtMatmulDescCreate(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_desc(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(g.transa));
  set_desc(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(g.transb));
  set_desc(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(g.epilogue));
  if (g.bias) set_desc(ds.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux) {
    set_desc(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    set_desc(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
  }
  const int margin = gemm_sm_margin();
  const int32_t sm_target = margin > 0 && ctx.sm_count > margin ? ctx.sm_count - margin : 0;
  if (sm_target > 0) set_desc(ds.op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, sm_target);
  const bool ta = g.transa != CUBLAS_OP_N, tb = g.transb != CUBLAS_OP_N;
  ST_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.a, g.ab_type,
                                             static_cast<uint64_t>(ta ? g.k : g.m),
                                             static_cast<uint64_t>(ta ? g.m : g.k), g.lda));
  ST_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.b, g.ab_type,
                                             static_cast<uint64_t>(tb ? g.n : g.k),
                                             static_cast<uint64_t>(tb ? g.k : g.n), g.ldb));
  ST_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.d, g.d_type, static_cast<uint64_t>(g.m),
                                             static_cast<uint64_t>(g.n), g.ldd));

  const LtKey key{ctx.device,
                  static_cast<int>(g.transa),
                  static_cast<int>(g.transb),
                  g.m,
                  g.n,
                  g.k,
                  g.lda,
                  g.ldb,
                  g.ldd,
                  g.aux_ld,
                  static_cast<int>(g.ab_type),
                  static_cast<int>(g.d_type),
                  static_cast<int>(g.epilogue),
                  sm_target,
                  g.beta != 0.f,
                  alignment_of(g.A),
                  alignment_of(g.B),
                  alignment_of(g.D),
                  g.bias ? alignment_of(g.bias) : 0u,
                  g.aux ? alignment_of(g.aux) : 0u,
                  ctx.workspace_bytes};
  std::optional<cublasLtMatmulAlgo_t> algo;
  {
    LtCache& cache = lt_cache();
    std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.algos.find(key);
    if (it == cache.algos.end()) {
      ST_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&ds.pref));
      set_pref(ds.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
               static_cast<uint64_t>(ctx.workspace ? ctx.workspace_bytes : 0));
      set_pref(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a);
      set_pref(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b);
      set_pref(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_d);
      set_pref(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d);
      cublasLtMatmulHeuristicResult_t result{};
      int count = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx.lt, ds.op, ds.a, ds.b, ds.d,
                                                               ds.d, ds.pref, 1, &result, &count);
      std::optional<cublasLtMatmulAlgo_t> found;
      if (st == CUBLAS_STATUS_SUCCESS && count > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
        found = result.algo;
      } else if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED &&
                 st != CUBLAS_STATUS_INVALID_VALUE) {
        throw_cublas_error(st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
      }
      it = cache.algos.emplace(key, found).first;
    }
    algo = it->second;
  }
  if (!algo) return false;
  ST_CUBLAS_CHECK(cublasLtMatmul(ctx.lt, ds.op, &g.alpha, g.A, ds.a, g.B, ds.b, &g.beta, g.D, ds.d,
                                 g.D, ds.d, &*algo, ctx.workspace,
                                 ctx.workspace ? ctx.workspace_bytes : 0, ctx.stream));
  return true;
}

/// Runs `g`; when no algorithm exists for its epilogue, throws (used for DEFAULT epilogues, which
/// cuBLASLt supports for every dtype combination used here).
void lt_matmul_or_throw(const CudaContext& ctx, const LtGemm& g, const char* what) {
  if (!lt_matmul(ctx, g)) {
    require(false, "cuBLASLt offers no algorithm for ", what, " (m=", g.m, " n=", g.n, " k=", g.k,
            ", lda=", g.lda, " ldb=", g.ldb, " ldd=", g.ldd, ", A/B type ",
            static_cast<int>(g.ab_type), ", D type ", static_cast<int>(g.d_type), ")");
  }
}

bool is_float_dtype(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

void require_dtype(const Tensor& t, DType want, const char* op, const char* name) {
  require(t.dtype == want, "cuda ", op, ": ", name, " is ", dtype_name(t.dtype),
          " but the op computes in ", dtype_name(want));
}

}  // namespace

// ---- forward ----------------------------------------------------------------------------------

void matmul_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                    Epilogue epilogue, Tensor pre_gelu) {
  const int64_t OC = weight.dim(0), IC = weight.dim(1);
  ST_ASSERT(weight.ndim == 2 && IC > 0 && OC > 0);
  ST_ASSERT(inp.numel() % IC == 0);
  const int64_t N = inp.numel() / IC;
  const int64_t ld_out = N > 0 ? out.numel() / N : OC;  // OC, or padded rows (no epilogue)
  ST_ASSERT(out.numel() == N * ld_out && ld_out >= OC);
  const bool padded_out = ld_out > OC;
  const DType dt = inp.dtype;
  require(is_float_dtype(dt), "cuda matmul_forward: dtype ", dtype_name(dt), " is not floating");
  require(!padded_out || (epilogue == Epilogue::kNone && (ld_out * dtype_size(dt)) % 16 == 0),
          "cuda matmul_forward: padded rows (", ld_out, " columns for OC = ", OC,
          ") need no epilogue and 16-byte aligned rows");
  require_dtype(weight, dt, "matmul_forward", "weight");
  require_dtype(out, dt, "matmul_forward", "out");
  if (!bias.empty()) {
    require_dtype(bias, dt, "matmul_forward", "bias");
    ST_ASSERT(bias.numel() == OC);
  }
  const bool gelu = epilogue == Epilogue::kGelu;
  if (gelu) {
    ST_ASSERT(!pre_gelu.empty() && pre_gelu.numel() == N * OC);
    require_dtype(pre_gelu, dt, "matmul_forward", "pre_gelu");
  }
  if (N == 0) return;

  LtGemm g;
  g.transa = CUBLAS_OP_T;  // W: col-major [IC,OC] → [OC,IC]
  g.transb = CUBLAS_OP_N;  // inp: col-major [IC,N]
  g.m = OC;
  g.n = N;
  g.k = IC;
  g.A = weight.data;
  g.lda = IC;
  g.B = inp.data;
  g.ldb = IC;
  g.ab_type = g.d_type = cuda_dtype(dt);
  g.alpha = 1.f;
  g.beta = 0.f;
  g.D = out.data;
  g.ldd = OC;

  // An awkward OC (the LM head's 50257) is padded to a multiple of 16, or to the caller's padded
  // rows: see needs_oc_padding().
  const bool pad = padded_out || (!gelu && needs_oc_padding(N, OC, dt));
  if (pad) {
    const int64_t OCp = padded_out ? ld_out : round_up(OC, 16);
    const size_t es = dtype_size(dt);
    const size_t w_bytes = static_cast<size_t>(OCp * IC) * es;
    const size_t y_bytes = padded_out ? 0 : static_cast<size_t>(N * OCp) * es;
    const size_t b_bytes = bias.empty() ? 0 : static_cast<size_t>(OCp) * es;
    Carver cv;
    cv.base = static_cast<char*>(ctx.get_scratch(Carver::padded(w_bytes) + Carver::padded(y_bytes) +
                                                 Carver::padded(b_bytes)));
    void* Wp = cv.take(w_bytes);
    void* Yp = padded_out ? out.data : cv.take(y_bytes);
    void* bp = cv.take(b_bytes);
    copy_pad(ctx, dt, Wp, IC, OCp, IC, weight.data, IC, OC, IC);
    if (bp) copy_pad(ctx, dt, bp, OCp, 1, OCp, bias.data, OC, 1, OC);
    g.m = OCp;
    g.A = Wp;
    g.D = Yp;
    g.ldd = OCp;
    bool fused = false;
    if (bp && !fused_epilogues_disabled()) {
      LtGemm f = g;
      f.bias = bp;
      f.epilogue = CUBLASLT_EPILOGUE_BIAS;
      fused = lt_matmul(ctx, f);
    }
    if (!fused) lt_matmul_or_throw(ctx, g, "matmul_forward");
    if (bp && !fused) {  // bias over Yp [N, OCp] with the zero-padded bias bp
      const int64_t total = N * OCp;
      constexpr int kThreads = 256;
      const unsigned blocks = elementwise_blocks(ctx, total, kThreads);
      dispatch_float(dt, [&]<typename T>() {
        bias_gelu_kernel<T, false><<<blocks, kThreads, 0, ctx.stream>>>(
            static_cast<T*>(Yp), static_cast<T*>(Yp), static_cast<const T*>(bp), total, OCp);
      });
      ST_CUDA_LAUNCH_CHECK();
    }
    if (!padded_out) copy_pad(ctx, dt, out.data, OC, N, OC, Yp, OCp, N, OC);
    return;
  }

  const bool bias_ok = bias.empty() || alignment_of(bias.data) >= 16;
  // fp32 mode is the tight-parity mode: cuBLASLt's GELU epilogues differ from tanhf-based GELU
  // by a few 1e-6 relative, so fp32 uses the exact kernels below instead.
  const bool fused_gelu_ok =
      dt != DType::kF32 && OC % 8 == 0 && alignment_of(gelu ? pre_gelu.data : nullptr) >= 16;
  bool done = false;  // bias (and GELU) applied
  if (gelu && !fused_epilogues_disabled() && bias_ok && fused_gelu_ok) {
    LtGemm f = g;
    f.aux = pre_gelu.data;
    f.aux_ld = OC;  // a multiple of 8 (cuBLASLt's requirement for the GELU aux matrix)
    f.bias = bias.empty() ? nullptr : bias.data;
    f.epilogue = bias.empty() ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    if (lt_matmul(ctx, f)) return;
  }
  if (!gelu) {
    if (bias.empty()) {
      lt_matmul_or_throw(ctx, g, "matmul_forward");
      done = true;
    } else if (!fused_epilogues_disabled() && bias_ok) {
      LtGemm f = g;
      f.bias = bias.data;
      f.epilogue = CUBLASLT_EPILOGUE_BIAS;
      done = lt_matmul(ctx, f);
    }
  }
  if (!done) {
    // Plain GEMM into pre_gelu (kGelu) or out; bias (+ GELU) come below.
    if (gelu) {
      g.D = pre_gelu.data;
      g.ldd = OC;
    }
    lt_matmul_or_throw(ctx, g, "matmul_forward");
  }
  if (done) return;
  const int64_t total = N * OC;
  constexpr int kThreads = 256;
  const unsigned blocks = elementwise_blocks(ctx, total, kThreads);
  dispatch_float(dt, [&]<typename T>() {
    const T* b = bias.empty() ? nullptr : bias.as<T>();
    if (gelu) {
      bias_gelu_kernel<T, true>
          <<<blocks, kThreads, 0, ctx.stream>>>(out.as<T>(), pre_gelu.as<T>(), b, total, OC);
    } else {
      bias_gelu_kernel<T, false>
          <<<blocks, kThreads, 0, ctx.stream>>>(out.as<T>(), out.as<T>(), b, total, OC);
    }
  });
  ST_CUDA_LAUNCH_CHECK();
}

// ---- backward ---------------------------------------------------------------------------------

void matmul_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                     Tensor inp, Tensor weight, Tensor dinp_gelu_input) {
  const int64_t OC = weight.dim(0), IC = weight.dim(1);
  ST_ASSERT(weight.ndim == 2 && IC > 0 && OC > 0);
  ST_ASSERT(inp.numel() % IC == 0);
  const int64_t N = inp.numel() / IC;
  const int64_t ld_dout = N > 0 ? dout.numel() / N : OC;  // OC, or padded rows
  ST_ASSERT(dout.numel() == N * ld_dout && ld_dout >= OC);
  const bool padded_dout = ld_dout > OC;
  const DType dt = dout.dtype;
  require(is_float_dtype(dt), "cuda matmul_backward: dtype ", dtype_name(dt), " is not floating");
  require_dtype(inp, dt, "matmul_backward", "inp");
  require_dtype(weight, dt, "matmul_backward", "weight");
  if (!dinp.empty()) {
    require_dtype(dinp, dt, "matmul_backward", "dinp");
    ST_ASSERT(dinp.numel() == N * IC);
  }
  if (!dinp_gelu_input.empty()) {
    require_dtype(dinp_gelu_input, dt, "matmul_backward", "dinp_gelu_input");
    ST_ASSERT(dinp_gelu_input.numel() == N * IC);
  }
  if (!dweight.empty()) {
    ST_ASSERT(dweight.numel() == OC * IC);
    require(dweight.dtype == dt || dweight.dtype == DType::kF32,
            "cuda matmul_backward: dweight is ", dtype_name(dweight.dtype), " (want ",
            dtype_name(dt), " or f32)");
  }
  if (!dbias.empty()) {
    ST_ASSERT(dbias.numel() == OC);
    require(dbias.dtype == dt || dbias.dtype == DType::kF32, "cuda matmul_backward: dbias is ",
            dtype_name(dbias.dtype), " (want ", dtype_name(dt), " or f32)");
  }
  if (N == 0) return;
  const cudaDataType_t ct = cuda_dtype(dt);

  // One scratch allocation: the bias-gradient partial sums and, for an awkward OC, the padded
  // copies (see needs_oc_padding()).
  const BiasGradPlan plan = bias_grad_plan(N);
  require(!padded_dout || ((ld_dout * dtype_size(dt)) % 16 == 0 && dbias.empty()),
          "cuda matmul_backward: padded rows (", ld_dout, " columns for OC = ", OC,
          ") need 16-byte aligned rows and no bias gradient");
  // copy: dout is padded through scratch (Dp); padded_dout: the caller padded it already.
  const bool copy = !padded_dout && needs_oc_padding(N, OC, dt);
  const bool pad = copy || padded_dout;
  const int64_t OCp = padded_dout ? ld_dout : copy ? round_up(OC, 16) : OC;
  const size_t es = dtype_size(dt);
  const size_t partial_bytes = !dbias.empty() && plan.nchunks > 1
                                   ? static_cast<size_t>(plan.nchunks * OC) * sizeof(float)
                                   : 0;
  const size_t dp_bytes = copy ? static_cast<size_t>(N * OCp) * es : 0;
  const size_t wp_bytes = pad && !dinp.empty() ? static_cast<size_t>(OCp * IC) * es : 0;
  const size_t dwp_bytes =
      copy && !dweight.empty() ? static_cast<size_t>(OCp * IC) * sizeof(float) : 0;
  const size_t total_bytes = Carver::padded(partial_bytes) + Carver::padded(dp_bytes) +
                             Carver::padded(wp_bytes) + Carver::padded(dwp_bytes);
  Carver cv;
  cv.base = total_bytes ? static_cast<char*>(ctx.get_scratch(total_bytes)) : nullptr;
  float* partial = static_cast<float*>(cv.take(partial_bytes));
  void* Dp = cv.take(dp_bytes);
  void* Wp = cv.take(wp_bytes);
  float* dWp = static_cast<float*>(cv.take(dwp_bytes));
  const void* dout_gemm = dout.data;      // dout as the GEMMs read it: [N, OCp]
  const void* weight_gemm = weight.data;  // W as the dinp GEMM reads it: [OCp, IC]
  if (pad) {
    if (copy) {
      copy_pad(ctx, dt, Dp, OCp, N, OCp, dout.data, OC, N, OC);
      dout_gemm = Dp;
    }
    if (Wp) {
      copy_pad(ctx, dt, Wp, IC, OCp, IC, weight.data, IC, OC, IC);
      weight_gemm = Wp;
    }
  }

  // dbias += Σ_rows dout (own deterministic reduction; first, while dout is hot in L2).
  if (!dbias.empty()) {
    const dim3 block(32, kBgRowLanes);
    const dim3 grid(ceil_div(static_cast<size_t>(OC), kBgCols),
                    static_cast<unsigned>(plan.nchunks));
    dispatch_float(dt, [&]<typename Tin>() {
      dispatch_float(dbias.dtype, [&]<typename Tout>() {
        if (plan.nchunks == 1) {
          bias_grad_partial_kernel<Tin, Tout, true><<<grid, block, 0, ctx.stream>>>(
              nullptr, dbias.as<Tout>(), dout.as<Tin>(), N, OC, plan.rows_per_chunk);
          ST_CUDA_LAUNCH_CHECK();
        } else {
          bias_grad_partial_kernel<Tin, Tout, false><<<grid, block, 0, ctx.stream>>>(
              partial, nullptr, dout.as<Tin>(), N, OC, plan.rows_per_chunk);
          ST_CUDA_LAUNCH_CHECK();
          add_partial_sums(ctx.stream, dbias.as<Tout>(), partial, plan.nchunks, OC);
          ST_CUDA_LAUNCH_CHECK();
        }
      });
    });
  }

  // dWᵀ [IC,OC] += inpᵀ [IC,N] · dout [N,OC]   (col-major view; see the header comment)
  if (!dweight.empty()) {
    LtGemm g;
    g.transa = CUBLAS_OP_N;  // inp: col-major [IC,N]
    g.transb = CUBLAS_OP_T;  // dout: col-major [OC,N] → [N,OC]
    // Caller-padded rows: n = OC straight into dweight (only m and ldb need aligning there).
    g.m = IC;
    g.n = copy ? OCp : OC;
    g.k = N;
    g.A = inp.data;
    g.lda = IC;
    g.B = dout_gemm;
    g.ldb = OCp;
    g.D = copy ? static_cast<void*>(dWp) : dweight.data;
    g.ldd = IC;
    g.alpha = 1.f;
    g.beta = copy ? 0.f : 1.f;
    g.ab_type = ct;
    g.d_type = copy ? CUDA_R_32F : cuda_dtype(dweight.dtype);
    lt_matmul_or_throw(ctx, g, "matmul_backward (dweight)");
    if (copy) {
      const int64_t n = OC * IC;
      constexpr int kThreads = 256;
      const unsigned blocks = elementwise_blocks(ctx, n, kThreads);
      dispatch_float(dweight.dtype, [&]<typename T>() {
        accumulate_kernel<T><<<blocks, kThreads, 0, ctx.stream>>>(dweight.as<T>(), dWp, n);
      });
      ST_CUDA_LAUNCH_CHECK();
    }
  }

  // dinpᵀ [IC,N] = Wᵀ [IC,OC] · doutᵀ [OC,N]   (· gelu'(dinp_gelu_input) through DGELU)
  if (!dinp.empty()) {
    LtGemm g;
    g.transa = CUBLAS_OP_N;  // W: col-major [IC,OC]
    g.transb = CUBLAS_OP_N;  // dout: col-major [OC,N]
    g.m = IC;
    g.n = N;
    g.k = OCp;
    g.A = weight_gemm;
    g.lda = IC;
    g.B = dout_gemm;
    g.ldb = OCp;
    g.D = dinp.data;
    g.ldd = IC;
    g.alpha = 1.f;
    g.beta = 0.f;
    g.ab_type = g.d_type = ct;
    const bool dgelu = !dinp_gelu_input.empty();
    // (fp32: exact kernel below, see matmul_forward)
    if (dgelu && dt != DType::kF32 && !fused_epilogues_disabled() && IC % 8 == 0 &&
        alignment_of(dinp_gelu_input.data) >= 16) {
      LtGemm f = g;
      f.epilogue = CUBLASLT_EPILOGUE_DGELU;
      f.aux = dinp_gelu_input.data;
      f.aux_ld = IC;
      if (lt_matmul(ctx, f)) return;
    }
    lt_matmul_or_throw(ctx, g, "matmul_backward (dinp)");
    if (dgelu) {
      const int64_t total = N * IC;
      constexpr int kThreads = 256;
      const unsigned blocks = elementwise_blocks(ctx, total, kThreads);
      dispatch_float(dt, [&]<typename T>() {
        gelu_backward_inplace_kernel<T>
            <<<blocks, kThreads, 0, ctx.stream>>>(dinp.as<T>(), dinp_gelu_input.as<T>(), total);
      });
      ST_CUDA_LAUNCH_CHECK();
    }
  }
}

}  // namespace shardtrain::cuda
