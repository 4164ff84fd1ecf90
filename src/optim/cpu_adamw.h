// The CPU AdamW of ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
// Training", arXiv 2101.06840, §4.1 "CPU-Adam"): the optimizer step over host memory, vectorized
// (AVX-512 or AVX2 + FMA chosen at run time, a scalar path everywhere), split over OpenMP threads
// in blocks of 64 Ki elements handed out dynamically, and fused with the conversions around it —
// gradients read as bf16, fp16 or fp32, updated weights written as bf16, fp16 or fp32 in the same
// pass — so each element is read and written once: 4 (master) + 4 (m) + 4 (v) + 2 (grad) bytes read
// and 4 + 4 + 4 + 2 bytes written for bf16 gradients and parameters.
//
// The update is AdamW as the GPU and CPU backends compute it (Loshchilov & Hutter, arXiv
// 1711.05101, Algorithm 2, with Adam's bias correction): g = grad·grad_scale; m = β1·m + (1−β1)·g;
// v = β2·v + (1−β2)·g²; p −= lr·((m/bc1)/(√(v/bc2) + eps) + wd·p). The vector paths use fused
// multiply-adds, so results differ from the scalar path by fp32 rounding only.
#pragma once

#include <cstdint>
#include <string>

#include "backend/backend.h"
#include "core/tensor.h"

namespace shardtrain {

enum class CpuSimd { kScalar, kAvx2, kAvx512 };

/// The widest path this CPU runs (AVX-512F+BW, else AVX2+FMA+F16C, else scalar).
CpuSimd best_cpu_simd();
std::string to_string(CpuSimd simd);

/// One AdamW step over `n` elements in host memory: master, m, v fp32 [n] (updated in place);
/// grad [n] of `grad_dtype` (kF32, kBF16 or kF16); params_out [n] of `out_dtype` (kF32, kBF16,
/// kF16) receives the updated weights rounded to nearest even, or is null. `simd` must not be
/// wider than best_cpu_simd(). Threads: OpenMP's, on 64 Ki-element blocks (dynamic schedule).
void cpu_adamw(float* master, const void* grad, DType grad_dtype, float* m, float* v,
               void* params_out, DType out_dtype, int64_t n, const Backend::AdamWArgs& args,
               CpuSimd simd);

/// One SGD step (torch.optim.SGD, dampening 0; the formula of Backend::sgd) over `n` elements in
/// host memory, for the offloaded optimizer: g = grad·grad_scale + wd·p; buf = first_step ? g :
/// μ·buf + g; d = nesterov ? g + μ·buf : buf (d = g when μ = 0); p −= lr·d. master fp32 [n] and
/// buf fp32 [n] (null when args.momentum == 0) updated in place; grad [n] of `grad_dtype` (kF32,
/// kBF16 or kF16); params_out [n] of `out_dtype` receives the updated weights rounded to nearest
/// even, or is null. Plain C++ left to the compiler's vectorizer (SGD reads/writes 3 streams and
/// is bound by memory bandwidth); the same fp32 operations in the same order as the CPU backend,
/// so results equal it up to fp32 rounding (the compiler may fuse multiply-adds). Threads:
/// OpenMP's, on 64 Ki-element blocks (dynamic).
void cpu_sgd(float* master, const void* grad, DType grad_dtype, float* buf, void* params_out,
             DType out_dtype, int64_t n, const Backend::SgdArgs& args);

}  // namespace shardtrain
