// What the CPU image ops' two translation units share: argument checks, the element-wise
// activations and their derivatives, and the convolution/pooling kernels (cpu_conv.cpp) that
// the CpuImageOps class (cpu_image_ops.cpp) dispatches to.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "backend/image_ops.h"
#include "core/error.h"
#include "core/tensor.h"

namespace shardtrain::cpu_image {

/// Throws an Error naming the op and the tensor unless `t` is an fp32 CPU tensor of exactly
/// `dims`.
inline void expect_f32(const char* op, const char* name, const Tensor& t,
                       std::initializer_list<int64_t> dims) {
  const Tensor want(nullptr, DType::kF32, DeviceKind::kCPU, dims);
  check(!t.empty(), "{}: {} is empty, expected an fp32 tensor of shape {}", op, name,
        want.shape_str());
  check(t.device == DeviceKind::kCPU, "{}: {} is on {}, expected a CPU tensor", op, name,
        device_name(t.device));
  check(t.dtype == DType::kF32, "{}: {} {} is {}, expected fp32 (the CPU image ops are fp32)", op,
        name, t.shape_str(), dtype_name(t.dtype));
  bool same = t.ndim == want.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.dim(i) == want.dim(i);
  check(same, "{}: {} has shape {}, expected {}", op, name, t.shape_str(), want.shape_str());
}

/// expect_f32 unless `t` is empty (optional tensors: bias, dinp).
inline void expect_f32_or_empty(const char* op, const char* name, const Tensor& t,
                                std::initializer_list<int64_t> dims) {
  if (!t.empty()) expect_f32(op, name, t, dims);
}

/// Throws unless `t` is an fp64 CPU tensor of shape `dims` (batch norm's per-channel sums).
inline void expect_f64(const char* op, const char* name, const Tensor& t,
                       std::initializer_list<int64_t> dims) {
  const Tensor want(nullptr, DType::kF64, DeviceKind::kCPU, dims);
  check(!t.empty() && t.device == DeviceKind::kCPU && t.dtype == DType::kF64,
        "{}: {} must be an fp64 CPU tensor of shape {}, got {} {}", op, name, want.shape_str(),
        t.empty() ? std::string("(empty)") : t.shape_str(), dtype_name(t.dtype));
  bool same = t.ndim == want.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.dim(i) == want.dim(i);
  check(same, "{}: {} has shape {}, expected {}", op, name, t.shape_str(), want.shape_str());
}

/// Throws unless `t` is a 4-D fp32 CPU tensor (NCHW); its shape is then read from it.
inline void expect_nchw(const char* op, const char* name, const Tensor& t) {
  check(!t.empty() && t.ndim == 4, "{}: {} has shape {}, expected [N, C, H, W]", op, name,
        t.empty() ? std::string("(empty)") : t.shape_str());
  expect_f32(op, name, t, {t.dim(0), t.dim(1), t.dim(2), t.dim(3)});
}

/// Loops over fewer than this many element-operations run on one thread: an OpenMP parallel
/// region costs microseconds (much more on a loaded machine), more than the work of small
/// tensors.
constexpr int64_t kParallelMinWork = int64_t{1} << 15;
inline bool worth_parallel(int64_t work) { return work >= kParallelMinWork; }

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

/// act(x).
inline float act_forward(float x, Activation a) {
  switch (a) {
    case Activation::kNone:
      return x;
    case Activation::kRelu:
      return std::max(x, 0.0f);
    case Activation::kRelu6:
      return std::min(std::max(x, 0.0f), 6.0f);
    case Activation::kSilu:
      return x * sigmoid(x);
    case Activation::kSigmoid:
      return sigmoid(x);
  }
  return x;
}

/// act'(x) at the pre-activation x (ReLU's and ReLU6's kinks take the derivative 0, as PyTorch).
inline float act_derivative(float x, Activation a) {
  switch (a) {
    case Activation::kNone:
      return 1.0f;
    case Activation::kRelu:
      return x > 0.0f ? 1.0f : 0.0f;
    case Activation::kRelu6:
      return x > 0.0f && x < 6.0f ? 1.0f : 0.0f;
    case Activation::kSilu: {
      const float s = sigmoid(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case Activation::kSigmoid: {
      const float s = sigmoid(x);
      return s * (1.0f - s);
    }
  }
  return 1.0f;
}

// ---- cpu_conv.cpp: convolution (im2col + sgemm; direct loops for depthwise) and pooling -------
// Arguments are checked by the caller (CpuImageOps); these only compute.
void conv2d_forward(float* out, const float* inp, const float* weight, const float* bias,
                    const Conv2dShape& s, Activation act);
void conv2d_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, const Conv2dShape& s);
void maxpool2d_forward(float* out, const float* inp, const Pool2dShape& s);
void maxpool2d_backward(float* dinp, const float* dout, const float* inp, const Pool2dShape& s);
void avgpool2d_forward(float* out, const float* inp, const Pool2dShape& s);
void avgpool2d_backward(float* dinp, const float* dout, const Pool2dShape& s);
/// Adaptive average pooling of N·C planes H×W to P×Q.
void adaptive_avgpool2d_forward(float* out, const float* inp, int64_t NC, int64_t H, int64_t W,
                                int64_t P, int64_t Q);
void adaptive_avgpool2d_backward(float* dinp, const float* dout, int64_t NC, int64_t H, int64_t W,
                                 int64_t P, int64_t Q);

}  // namespace shardtrain::cpu_image
