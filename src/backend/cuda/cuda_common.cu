// Shared pieces of the CUDA backend that are not inline: error reporting and dtype mapping.
#include <string>

#include "backend/cuda/cuda_common.h"

namespace shardtrain::cuda {

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  // Clear the (non-sticky) last-error state so that a caller that catches this exception and
  // carries on does not see the same error again from the next ST_CUDA_LAUNCH_CHECK(). Sticky
  // errors (illegal address, ...) stay: the context is unusable after them anyway.
  (void)cudaGetLastError();
  // (std::string, not fmt: nvcc cannot compile fmt 9 in C++20 mode; see core/error.h)
  throw RuntimeFailure(std::string("CUDA error ") + cudaGetErrorName(err) + " (" +
                       cudaGetErrorString(err) + ") in `" + expr + "` at " + file + ":" +
                       std::to_string(line));
}

void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line) {
  throw RuntimeFailure(std::string("cuBLAS error ") + cublasGetStatusName(status) + " (" +
                       cublasGetStatusString(status) + ") in `" + expr + "` at " + file + ":" +
                       std::to_string(line));
}

cudaDataType_t cuda_dtype(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      throw RuntimeFailure(std::string("cuda: dtype ") + dtype_name(t) +
                           " has no floating CUDA data type");
  }
}

}  // namespace shardtrain::cuda
