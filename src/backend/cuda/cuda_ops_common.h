// What the CUDA backend's op-family files share (cuda_encoder.cu, cuda_layernorm.cu,
// cuda_elementwise.cu, cuda_cross_entropy.cu, cuda_reduce.cu, cuda_optimizer.cu, and the
// CudaBackend class in cuda_backend.cu and the caching allocator): vectorized loads and stores of
// any floating dtype, warp and block sums in a fixed order, the 1-D launch shape, and the host's
// messages.
//
// Messages are built with printf-style strf() below, not fmt: nvcc 13 cannot compile fmt 9 in
// C++20 mode, so core/error.h hides fmt from code nvcc compiles.
#pragma once

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "backend/cuda/cuda_common.h"

namespace shardtrain::cuda {

inline constexpr unsigned kBlock = 256;  // threads per block of the simple kernels
inline constexpr int kVec = 8;           // elements per thread in vectorized kernels

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

// ==== host helpers =============================================================================

/// printf-style formatting into a std::string.
__attribute__((format(printf, 1, 2))) inline std::string strf(const char* f, ...) {
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

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename... P>
bool all_aligned(const P*... p) {
  return (aligned16(p) && ...);
}

/// Blocks for `chunks` work items at kBlock threads each.
inline unsigned blocks_for(int64_t chunks) { return ceil_div(static_cast<size_t>(chunks), kBlock); }

/// Calls f.template operator()<K>() with K = kVec when `vectorize`, else 1.
template <typename F>
void dispatch_vec(bool vectorize, F&& f) {
  if (vectorize)
    f.template operator()<kVec>();
  else
    f.template operator()<1>();
}

}  // namespace shardtrain::cuda
