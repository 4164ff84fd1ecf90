// Token and position embedding on the GPU (Backend::embedding_forward / embedding_backward): the
// forward one vectorized gather-and-add per element chunk (dropout fused), the backward a stable
// radix sort of the tokens (cub::DeviceRadixSort) so each wte row's gradient is summed by one
// thread in row order, and a per-position sum over the batch for wpe. Deterministic, no atomics.
#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_common.h"

namespace shardtrain::cuda {
namespace {

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

}  // namespace

void embedding_forward(const CudaContext& ctx, Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                       const Dropout& dropout) {
  const int64_t B = out.dim(0), Tn = out.dim(1), C = out.dim(2), N = B * Tn, V = wte.dim(0);
  dispatch_float(out.dtype, [&]<typename T>() {
    dispatch_vec(C % kVec == 0 && all_aligned(out.data, wte.data, wpe.data), [&]<int K>() {
      dispatch_dropout(dropout, [&]<bool kDrop>() {
        embedding_forward_kernel<K, T, kDrop><<<blocks_for(N * (C / K)), kBlock, 0, ctx.stream>>>(
            out.as<T>(), tokens.as<int32_t>(), wte.as<T>(), wpe.as<T>(), N, Tn, C, V, dropout,
            dropout.threshold(), dropout.scale());
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  });
}

void embedding_backward(const CudaContext& ctx, Tensor dwte, Tensor dwpe, Tensor dout,
                        Tensor tokens, const Dropout& dropout) {
  const int64_t B = dout.dim(0), Tn = dout.dim(1), C = dout.dim(2), N = B * Tn;
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
        ctx.stream));
    const size_t ints = (static_cast<size_t>(N) * sizeof(int32_t) + 255) / 256 * 256;
    char* scratch = static_cast<char*>(ctx.get_scratch(3 * ints + temp_bytes));
    auto* keys_out = reinterpret_cast<int32_t*>(scratch);
    auto* rows_in = reinterpret_cast<int32_t*>(scratch + ints);
    auto* rows_out = reinterpret_cast<int32_t*>(scratch + 2 * ints);
    void* temp = scratch + 3 * ints;

    iota_kernel<<<blocks_for(N), kBlock, 0, ctx.stream>>>(rows_in, n);
    ST_CUDA_LAUNCH_CHECK();
    // LSD radix sort is stable: rows of one token stay in increasing order.
    ST_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, tokens.as<const int32_t>(),
                                                  keys_out, rows_in, rows_out, n, 0, 32,
                                                  ctx.stream));
    dispatch_float(dout.dtype, [&]<typename T>() {
      const dim3 grid(static_cast<unsigned>(N), ceil_div(static_cast<size_t>(C), kBlock));
      dispatch_dropout(dropout, [&]<bool kDrop>() {
        embedding_dwte_kernel<T, kDrop><<<grid, kBlock, 0, ctx.stream>>>(
            dwte.as<T>(), dout.as<T>(), keys_out, rows_out, n, C, V, dropout, thresh, keep_scale);
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  }
  if (!dwpe.empty()) {
    dispatch_float(dout.dtype, [&]<typename T>() {
      dispatch_dropout(dropout, [&]<bool kDrop>() {
        embedding_dwpe_kernel<T, kDrop><<<blocks_for(Tn * C), kBlock, 0, ctx.stream>>>(
            dwpe.as<T>(), dout.as<T>(), B, Tn, C, dropout, thresh, keep_scale);
        ST_CUDA_LAUNCH_CHECK();
      });
    });
  }
}

}  // namespace shardtrain::cuda
