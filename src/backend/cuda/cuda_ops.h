// Launchers of the CUDA backend's ops, one op family per file (forward and backward side by side):
//   cuda_encoder.cu       — token + position embedding forward/backward (sorted, deterministic)
//   cuda_layernorm.cu     — LayerNorm forward/backward (warp per row, two-stage parameter sums)
//   cuda_elementwise.cu   — convert, GELU forward/backward, residual add with dropout, dropout
//                           backward, scale
//   cuda_cross_entropy.cu — fused softmax + cross-entropy (loss and in-place logit gradient)
//   cuda_reduce.cu        — sum and sum of squares in fp64
//   cuda_optimizer.cu     — fused AdamW and SGD steps on fp32 master weights
//   cuda_quantize.cu      — blockwise int8 quantization (ZeRO++ qgZ)
// and the heavy ops, in their own files so each can be tuned apart:
//   cuda_matmul.cu    — cuBLASLt GEMMs with fused bias / GELU / dGELU / bias-gradient epilogues
//   cuda_attention.cu — causal self-attention forward/backward, materialized probabilities
//   cuda_flash_attention.cu — causal self-attention forward/backward, fused (FlashAttention-2)
// Semantics are exactly those of the same-named Backend methods (backend/backend.h); every
// launcher enqueues on ctx.stream and never synchronizes (except reduce_sum, which returns its
// result to the host). Tensors are device memory in fp32, bf16 or fp16 (all floating operands of
// one call share a dtype unless stated), fp32 accumulation throughout. The launchers of the op
// families above take arguments the CudaBackend has checked (cuda_backend.cu: dtypes, shapes, at
// least one element; int8 quantization checks its sizes itself) on the calling thread's current
// device; the matmul and attention launchers check their own.
#pragma once

#include "backend/backend.h"
#include "backend/cuda/cuda_common.h"

namespace shardtrain::cuda {

// ---- op families (arguments checked by the caller, see above) ------------------------------

/// Backend::embedding_forward / embedding_backward (cuda_encoder.cu). embedding_backward takes
/// fewer than 2^31 rows (the token sort is int32) and uses ctx's scratch.
void embedding_forward(const CudaContext& ctx, Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                       const Dropout& dropout);
void embedding_backward(const CudaContext& ctx, Tensor dwte, Tensor dwpe, Tensor dout,
                        Tensor tokens, const Dropout& dropout);

/// Backend::layernorm_forward / layernorm_backward (cuda_layernorm.cu); the backward uses ctx's
/// scratch for the parameter gradients' partial sums.
void layernorm_forward(const CudaContext& ctx, Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                       Tensor weight, Tensor bias);
void layernorm_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias,
                        Tensor dout, Tensor inp, Tensor weight, Tensor mean, Tensor rstd);

/// Backend::convert between two different floating dtypes, gelu_forward / gelu_backward, add,
/// dropout_backward and scale (cuda_elementwise.cu).
void convert(const CudaContext& ctx, Tensor dst, Tensor src);
void gelu_forward(const CudaContext& ctx, Tensor out, Tensor inp);
void gelu_backward(const CudaContext& ctx, Tensor dinp, Tensor inp, Tensor dout);
void add(const CudaContext& ctx, Tensor out, Tensor a, Tensor b, const Dropout& dropout_b);
void dropout_backward(const CudaContext& ctx, Tensor dst, Tensor src, const Dropout& dropout);
void scale(const CudaContext& ctx, Tensor x, float s);

/// Backend::softmax_cross_entropy (write_grad) and cross_entropy_forward (cuda_cross_entropy.cu)
/// over the first V columns of logits [N, ld]; fewer than 2^31 rows.
void cross_entropy(const CudaContext& ctx, Tensor losses, Tensor logits, Tensor targets, int64_t V,
                   float grad_scale, bool write_grad);

/// Backend::sum_squares (square) and sum (cuda_reduce.cu): Σ x² or Σ x in fp64, through ctx's
/// scratch and `host_result` (pinned host memory, one double). Blocking.
double reduce_sum(const CudaContext& ctx, Tensor x, bool square, double* host_result);

/// Backend::adamw / sgd (cuda_optimizer.cu): fp32 master and state, grad and params_out in any
/// floating dtype (params_out empty or aliasing master: not written).
void adamw(const CudaContext& ctx, Tensor master, Tensor grad, Tensor m, Tensor v,
           Tensor params_out, const Backend::AdamWArgs& args);
/// Backend::adamw_runs: one kernel per kAdamWRunsPerLaunch consecutive runs (their ends and
/// decay flags travel as kernel parameters: 9 KB, within CUDA 12.1's 32 KB), the arithmetic of
/// adamw() per element. GPT-2 has 8 runs per layer (12.2B: 680 in all).
inline constexpr int kAdamWRunsPerLaunch = 1024;
void adamw_runs(const CudaContext& ctx, Tensor master, Tensor grad, Tensor m, Tensor v,
                Tensor params_out, const std::vector<Backend::AdamWRun>& runs,
                const Backend::AdamWArgs& args);
void sgd(const CudaContext& ctx, Tensor master, Tensor grad, Tensor momentum_buf, Tensor params_out,
         const Backend::SgdArgs& args);

/// Backend::quantize_int8 / dequantize_add_int8 (cuda_quantize.cu): one thread block per
/// kQuantBlock elements. The caller checks the dtypes, the launchers the sizes.
void quantize_int8(const CudaContext& ctx, Tensor q, Tensor scales, Tensor x);
void dequantize_add_int8(const CudaContext& ctx, Tensor out, Tensor q, Tensor scales);

// ---- matmuls and attention (check their own arguments) ---------------------------------------

void matmul_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                    Epilogue epilogue, Tensor pre_gelu);

void matmul_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                     Tensor inp, Tensor weight, Tensor dinp_gelu_input);

/// saved.probs [B,NH,T,T] in the compute dtype (this implementation materializes the causal
/// softmax probabilities; a flash-attention kernel would save saved.lse instead).
/// An active `dropout` drops the probabilities before ·V (saved.probs stay undropped; backward
/// regenerates the mask).
void attention_forward(const CudaContext& ctx, Tensor out, AttentionSaved saved, Tensor qkv,
                       int num_heads, const Dropout& dropout);

void attention_backward(const CudaContext& ctx, Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                        AttentionSaved saved, int num_heads, const Dropout& dropout);

/// Whether the fused kernels handle tensors of dtype `dt` with heads of `head_size` elements
/// (bf16/fp16; head size 32, 64 or 128). fp32 tensors use attention_forward/backward above.
bool flash_attention_supported(DType dt, int head_size);

/// Fused causal attention forward: out [B,T,C] from qkv [B,T,3C]; saves lse [B,NH,T] (fp32,
/// natural log of each row's softmax denominator). Throws for unsupported dtypes/head sizes.
/// An active `dropout` masks P inside the kernel (lse stays that of the undropped softmax).
void flash_attention_forward(const CudaContext& ctx, Tensor out, Tensor lse, Tensor qkv,
                             int num_heads, const Dropout& dropout);

/// Fused causal attention backward: dqkv [B,T,3C] (OVERWRITTEN) from dout [B,T,C], the forward's
/// qkv, out and lse; dqkv must not overlap qkv, dout or out. Deterministic (no atomics).
void flash_attention_backward(const CudaContext& ctx, Tensor dqkv, Tensor dout, Tensor qkv,
                              Tensor out, Tensor lse, int num_heads, const Dropout& dropout);

}  // namespace shardtrain::cuda
