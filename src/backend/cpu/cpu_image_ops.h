// The CPU backend's ImageOps (backend/image_ops.h): the fp32 reference of the image-model ops.
//
// Algorithms (sources of the ops themselves are cited in image_ops.h):
//  * Convolution: im2col + sgemm per image and group (Chellapilla, Puri and Simard, "High
//    Performance Convolutional Neural Networks for Document Processing", IWFHR 2006); the input
//    gradient is a transposed sgemm followed by col2im. 1×1 stride-1 convolutions skip im2col;
//    depthwise convolutions (groups = C = K) are direct loops. See cpu_conv.cpp.
//  * Batch normalization: per-channel sums accumulated in double, the variance as
//    E[x²] − E[x]² from the (possibly all-reduced) sums, activations fused into forward and
//    into backward_reduce's recomputed pre-activation.
//  * LSTM: the input projection of all L steps is one sgemm ([N·L, I] · W_ihᵀ), then one
//    recurrent sgemm per step; backpropagation through time keeps the pre-activation gate
//    gradients of every step so that dW_ih, dW_hh and dinp are again a few large sgemms.
//  * Classification loss: log-softmax through the row maximum (log Σ exp(x − max) + max).
// Every op takes fp32 CPU tensors and throws shardtrain::Error naming the op and the shapes
// when a tensor's dtype, device or shape does not match.
#pragma once

#include <memory>

#include "backend/image_ops.h"

namespace shardtrain {

/// The CPU (fp32, OpenMP + OpenBLAS) ImageOps.
std::unique_ptr<ImageOps> make_cpu_image_ops();

}  // namespace shardtrain
