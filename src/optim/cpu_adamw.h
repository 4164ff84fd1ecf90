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

/// Where the random bits of stochastic rounding come from: element `index_base + i` of step
/// `step` draws hash(index, step) (a 32-bit integer hash), so that the rounding of an element
/// does not depend on how the elements are split into calls, threads or ranks.
struct StochasticRounding {
  uint64_t index_base = 0;  ///< flat-layout index of element 0 of the call
  uint32_t step = 0;        ///< optimizer step (1-based)
};

/// cpu_adamw with the moments m and v stored as bf16 [n] (2 bytes each instead of 4: 8 bytes of
/// state per element with the fp32 master, as llmq keeps its host optimizer state). Each step
/// reads m and v, updates them in fp32 exactly as cpu_adamw does, uses the fp32 values for this
/// step's update, and stores them rounded stochastically to bf16 (round up with probability
/// equal to the dropped fraction, so that E[stored] = value: rounding to nearest would freeze v,
/// whose relative change per step, 1 − β2 = 0.1%, is below bf16's 0.4% resolution; Gupta et al.,
/// "Deep Learning with Limited Numerical Precision", arXiv 1502.02551, §3). The random bits
/// come from `rounding` (see StochasticRounding). Reads 4 + 2 + 2 + 2 and writes 4 + 2 + 2 + 2
/// bytes per element for bf16 gradients and parameters (20 instead of 28).
void cpu_adamw_bf16_moments(float* master, const void* grad, DType grad_dtype, uint16_t* m,
                            uint16_t* v, void* params_out, DType out_dtype, int64_t n,
                            const Backend::AdamWArgs& args, StochasticRounding rounding,
                            CpuSimd simd);

/// fp32 → bf16 rounded stochastically with the 16 random bits `random` (the low 16 bits are
/// used): ⌊(bits(x) + random) / 2^16⌋; NaN stays NaN, ±inf stays ±inf. What the vector paths of
/// cpu_adamw_bf16_moments compute lane by lane.
uint16_t bf16_stochastic(float x, uint32_t random);

/// The 32 random bits element `index` of step `step` rounds with (StochasticRounding).
uint32_t stochastic_rounding_bits(uint64_t index, uint32_t step);

/// Undoes one cpu_adamw (moment_dtype kF32) or cpu_adamw_bf16_moments (kBF16) step over `n`
/// elements: master fp32 [n] and m, v [n] (moment_dtype) hold the state after the step, `grad`
/// and `args` are the step's own (the same grad_scale, lr and bias corrections); on return they
/// hold the state before it, solved from the update's formula: p = (p' + lr·u)/(1 − lr·wd) with
/// u = (m'/bc1)/(√(v'/bc2) + eps), m = (m' − (1−β1)·g)/β1, v = max(0, (v' − (1−β2)·g²)/β2). Exact
/// in real arithmetic, so the restored state equals the old one to fp32 rounding (and bf16
/// moments to bf16 rounding); what a speculative update that turned out wrong is rolled back
/// with (DeepSpeed's adam_rollback for SuperOffload, arXiv 2509.21271 §4.3). Scalar, OpenMP.
void cpu_adamw_undo(float* master, const void* grad, DType grad_dtype, void* m, void* v,
                    DType moment_dtype, int64_t n, const Backend::AdamWArgs& args);

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
