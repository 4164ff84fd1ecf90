// GELU with the tanh approximation (GPT-2's; Hendrycks and Gimpel, arXiv 1606.08415 §2) and its
// derivative, in fp32, for the kernels that apply it: the element-wise GELU
// (cuda_elementwise.cu) and the matmul epilogues (cuda_matmul.cu). Device code: .cu files only.
#pragma once

namespace shardtrain::cuda {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCoef = 0.044715f;

__device__ __forceinline__ float gelu(float x) {
  const float cube = kGeluCoef * x * x * x;
  return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
}

/// d gelu(x) / dx.
__device__ __forceinline__ float gelu_grad(float x) {
  const float cube = kGeluCoef * x * x * x;
  const float th = tanhf(kGeluScale * (x + cube));
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCoef * x * x);
}

}  // namespace shardtrain::cuda
