// Fused optimizer steps of the CUDA backend (Backend::adamw / sgd): one vectorized pass over the
// fp32 master weights and their state that also writes the updated parameters in the compute
// dtype, so the step reads and writes each array once. Exactly the formulas of backend/backend.h
// (and of the CPU reference, backend/cpu/cpu_optimizer.cpp), in fp32.
// llm.c (Karpathy, llmc/adamw.cuh) served as a model; the code here is written anew.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_common.h"

namespace shardtrain::cuda {
namespace {

/// One element's AdamW update, the formula of Backend::adamw with weight decay `wd`, each
/// operation rounded on its own (no contraction into FMAs), so that adamw_kernel and
/// adamw_runs_kernel give the same bits whatever code the compiler makes around them.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float grad, float wd,
                                              const Backend::AdamWArgs& a) {
  const float g = __fmul_rn(grad, a.grad_scale);
  m = __fadd_rn(__fmul_rn(a.beta1, m), __fmul_rn(1.0f - a.beta1, g));
  v = __fadd_rn(__fmul_rn(a.beta2, v), __fmul_rn(__fmul_rn(1.0f - a.beta2, g), g));
  const float mhat = __fdiv_rn(m, a.bias_correction1);
  const float vhat = __fdiv_rn(v, a.bias_correction2);
  const float step =
      __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), a.eps)), __fmul_rn(wd, p));
  p = __fsub_rn(p, __fmul_rn(a.lr, step));
}

/// The runs of one adamw_runs launch: elements [first, end[0]), [end[0], end[1]), ... relative
/// to the launch's pointers, and whether each decays (9 KB of kernel parameters).
struct AdamWRunTable {
  int64_t end[kAdamWRunsPerLaunch];
  unsigned char decay[kAdamWRunsPerLaunch];
  int count;
};

/// adamw_kernel over several runs: the thread's chunk [base, base + cnt) finds its run by binary
/// search over the ends (the threads of a warp nearly always share it) and takes that run's
/// weight decay; a chunk across a run boundary (runs need not be multiples of K) takes each
/// element's own. Per element the arithmetic of adamw_kernel.
template <int K, typename TG, typename TO>
__global__ void adamw_runs_kernel(float* p, const TG* grad, float* m, float* v, TO* out, int64_t n,
                                  Backend::AdamWArgs a, const AdamWRunTable runs) {
  const int64_t base = global_index() * K;
  if (base >= n) return;
  const int cnt = chunk_count<K>(n, base);
  int lo = 0, hi = runs.count - 1;  // the first run whose end > base
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (runs.end[mid] > base)
      hi = mid;
    else
      lo = mid + 1;
  }
  float pv[K], gv[K], mv[K], vv[K];
  load_chunk<K>(pv, p + base, cnt);
  load_chunk<K>(gv, grad + base, cnt);
  load_chunk<K>(mv, m + base, cnt);
  load_chunk<K>(vv, v + base, cnt);
  int r = lo;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    while (r + 1 < runs.count && base + k >= runs.end[r]) ++r;
    adamw_element(pv[k], mv[k], vv[k], gv[k], runs.decay[r] ? a.weight_decay : 0.0f, a);
  }
  store_chunk<K>(m + base, mv, cnt);
  store_chunk<K>(v + base, vv, cnt);
  store_chunk<K>(p + base, pv, cnt);
  if (out != nullptr) store_chunk<K>(out + base, pv, cnt);
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
  for (int k = 0; k < K; ++k) adamw_element(pv[k], mv[k], vv[k], gv[k], a.weight_decay, a);
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

}  // namespace

void adamw(const CudaContext& ctx, Tensor master, Tensor grad, Tensor m, Tensor v,
           Tensor params_out, const Backend::AdamWArgs& args) {
  const int64_t n = master.numel();
  // params_out aliasing the master (fp32 parameters) is the master itself: nothing to write.
  const bool has_out = !params_out.empty() && params_out.data != master.data;
  const DType out_dtype = has_out ? params_out.dtype : DType::kF32;
  const bool vec =
      all_aligned(master.data, grad.data, m.data, v.data, has_out ? params_out.data : nullptr);
  dispatch_float(grad.dtype, [&]<typename TG>() {
    dispatch_float(out_dtype, [&]<typename TO>() {
      dispatch_vec(vec, [&]<int K>() {
        adamw_kernel<K, TG, TO><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx.stream>>>(
            master.as<float>(), grad.as<TG>(), m.as<float>(), v.as<float>(),
            has_out ? params_out.as<TO>() : nullptr, n, args);
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  });
}

void adamw_runs(const CudaContext& ctx, Tensor master, Tensor grad, Tensor m, Tensor v,
                Tensor params_out, const std::vector<Backend::AdamWRun>& runs,
                const Backend::AdamWArgs& args) {
  const bool has_out = !params_out.empty() && params_out.data != master.data;
  const DType out_dtype = has_out ? params_out.dtype : DType::kF32;
  for (size_t first = 0, last = 0; first < runs.size(); first = last) {
    // Up to kAdamWRunsPerLaunch runs; when more follow, the launch ends where a run ends on a
    // multiple of kVec elements if one does, so that the next launch's pointers stay aligned.
    last = std::min(runs.size(), first + kAdamWRunsPerLaunch);
    if (last < runs.size()) {
      for (size_t r = last; r > first + 1; --r) {
        if ((runs[r - 1].begin + runs[r - 1].count) % kVec == 0) {
          last = r;
          break;
        }
      }
    }
    const int64_t begin = runs[first].begin;
    AdamWRunTable table{};
    table.count = static_cast<int>(last - first);
    for (size_t r = first; r < last; ++r) {
      table.end[r - first] = runs[r].begin + runs[r].count - begin;
      table.decay[r - first] = runs[r].decay ? 1 : 0;
    }
    const int64_t n = table.end[table.count - 1];
    if (n == 0) continue;
    const auto part = [&](const Tensor& t) { return t.slice1d(begin, n); };
    const Tensor pm = part(master), g = part(grad), mm = part(m), vv = part(v);
    const Tensor out = has_out ? part(params_out) : Tensor();
    const bool vec = all_aligned(pm.data, g.data, mm.data, vv.data, has_out ? out.data : nullptr);
    dispatch_float(grad.dtype, [&]<typename TG>() {
      dispatch_float(out_dtype, [&]<typename TO>() {
        dispatch_vec(vec, [&]<int K>() {
          adamw_runs_kernel<K, TG, TO><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx.stream>>>(
              pm.as<float>(), g.as<TG>(), mm.as<float>(), vv.as<float>(),
              has_out ? out.as<TO>() : nullptr, n, args, table);
          ST_CUDA_LAUNCH_CHECK();
        });
      });
    });
  }
}

void sgd(const CudaContext& ctx, Tensor master, Tensor grad, Tensor momentum_buf, Tensor params_out,
         const Backend::SgdArgs& args) {
  const int64_t n = master.numel();
  const bool use_buf = args.momentum != 0.0f;
  // params_out aliasing the master (fp32 parameters) is the master itself: nothing to write.
  const bool has_out = !params_out.empty() && params_out.data != master.data;
  const DType out_dtype = has_out ? params_out.dtype : DType::kF32;
  const bool vec = all_aligned(master.data, grad.data, use_buf ? momentum_buf.data : nullptr,
                               has_out ? params_out.data : nullptr);
  dispatch_float(grad.dtype, [&]<typename TG>() {
    dispatch_float(out_dtype, [&]<typename TO>() {
      dispatch_vec(vec, [&]<int K>() {
        sgd_kernel<K, TG, TO><<<blocks_for((n + K - 1) / K), kBlock, 0, ctx.stream>>>(
            master.as<float>(), grad.as<TG>(), use_buf ? momentum_buf.as<float>() : nullptr,
            has_out ? params_out.as<TO>() : nullptr, n, args);
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  });
}

}  // namespace shardtrain::cuda
