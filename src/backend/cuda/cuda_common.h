// Shared pieces of the CUDA backend: error checking, the per-backend context (stream, cuBLASLt
// handle and workspace), and bf16/fp16 load/store helpers usable from every kernel file.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "core/philox.h"
#include "core/tensor.h"

namespace shardtrain::cuda {

/// Throws RuntimeFailure naming the failed call, the CUDA error and the source location.
void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line);

#define ST_CUDA_CHECK(expr)                                                     \
  do {                                                                          \
    cudaError_t st_err_ = (expr);                                               \
    if (st_err_ != cudaSuccess)                                                 \
      ::shardtrain::cuda::throw_cuda_error(st_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define ST_CUBLAS_CHECK(expr)                                                        \
  do {                                                                               \
    cublasStatus_t st_status_ = (expr);                                              \
    if (st_status_ != CUBLAS_STATUS_SUCCESS)                                         \
      ::shardtrain::cuda::throw_cublas_error(st_status_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Checks the last kernel launch.
#define ST_CUDA_LAUNCH_CHECK() ST_CUDA_CHECK(cudaGetLastError())

/// Everything a kernel-launching function needs. Owned by the CudaBackend.
struct CudaContext {
  int device = 0;
  cudaStream_t stream = nullptr;  ///< compute stream: every op is enqueued here
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;  ///< for strided-batched GEMMs (attention)
  void* workspace = nullptr;      ///< cuBLASLt workspace
  size_t workspace_bytes = 0;
  int sm_count = 0;
  /// Scratch device memory that grows on demand (kernels' partial sums etc.). Returns a pointer
  /// valid until the next call; allocated through the backend's caching allocator.
  void* (*scratch)(void* backend, size_t bytes) = nullptr;
  void* backend = nullptr;
  void* get_scratch(size_t bytes) const { return scratch(backend, bytes); }
};

// Messages are built with std::string: code nvcc compiles never sees fmt (core/error.h).
inline void append(std::string& s, const char* x) { s += x; }
inline void append(std::string& s, const std::string& x) { s += x; }
template <typename I>
requires std::is_integral_v<I>
void append(std::string& s, I x) { s += std::to_string(x); }
/// Throws RuntimeFailure with the concatenated parts (C strings, strings, integers) when `cond`
/// is false.
template <typename... Parts>
void require(bool cond, const Parts&... parts) {
  if (cond) return;
  std::string msg;
  (append(msg, parts), ...);
  throw RuntimeFailure(msg);
}

/// cudaDataType_t of a dtype (CUDA_R_32F, CUDA_R_16BF, CUDA_R_16F); throws for int dtypes.
cudaDataType_t cuda_dtype(DType t);

// ---- element access in any floating dtype (fp32 accumulate) -------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

/// Calls f.template operator()<T>() with T the CUDA element type of `dt` (float, __nv_bfloat16,
/// __half). Used by host launchers to instantiate one kernel per floating dtype.
template <typename F>
void dispatch_float(DType dt, F&& f) {
  switch (dt) {
    case DType::kF32:
      f.template operator()<float>();
      return;
    case DType::kBF16:
      f.template operator()<__nv_bfloat16>();
      return;
    case DType::kF16:
      f.template operator()<__half>();
      return;
    // (no fmt::format in code nvcc compiles: nvcc cannot evaluate fmt 9's consteval checks)
    default:
      throw RuntimeFailure(std::string("cuda: dtype ") + dtype_name(dt) +
                           " is not a floating dtype");
  }
}

inline unsigned ceil_div(size_t a, size_t b) { return static_cast<unsigned>((a + b - 1) / b); }

/// dst [n] += Σ_g part [G, n] (fp32 partial sums, one row per group), in group order: the second
/// pass of the deterministic two-pass reductions (bias and weight gradients; no atomics).
template <typename T>
__global__ void add_partial_sums_kernel(T* dst, const float* part, int64_t G, int64_t n) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  float acc = 0.0f;
  for (int64_t g = 0; g < G; ++g) acc += part[g * n + i];
  dst[i] = from_float<T>(to_float(dst[i]) + acc);
}
/// Enqueues add_partial_sums_kernel on `stream` (launch errors are the caller's to check).
template <typename T>
void add_partial_sums(cudaStream_t stream, T* dst, const float* part, int64_t G, int64_t n) {
  constexpr unsigned kThreads = 256;
  add_partial_sums_kernel<T>
      <<<ceil_div(static_cast<size_t>(n), kThreads), kThreads, 0, stream>>>(dst, part, G, n);
}

/// Calls f.template operator()<kDrop>() with kDrop = d.active(): kernels take dropout as a
/// template flag, so the p = 0 instantiation is the kernel without dropout.
template <typename F>
void dispatch_dropout(const Dropout& d, F&& f) {
  if (d.active())
    f.template operator()<true>();
  else
    f.template operator()<false>();
}

}  // namespace shardtrain::cuda
