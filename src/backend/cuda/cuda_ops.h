// Launchers of the CUDA backend's heavy ops, in their own files so each can be tuned apart:
//   cuda_matmul.cu    — cuBLASLt GEMMs with fused bias / GELU / dGELU / bias-gradient epilogues
//   cuda_attention.cu — causal self-attention forward/backward, materialized probabilities
//   cuda_flash_attention.cu — causal self-attention forward/backward, fused (FlashAttention-2)
// Semantics are exactly those of the same-named Backend methods (backend/backend.h); every
// launcher enqueues on ctx.stream and never synchronizes. Tensors are device memory in fp32,
// bf16 or fp16 (all floating operands of one call share a dtype), fp32 accumulation throughout.
#pragma once

#include "backend/backend.h"
#include "backend/cuda/cuda_common.h"

namespace shardtrain::cuda {

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

/// Backend::quantize_int8 / dequantize_add_int8 (cuda_quantize.cu): one thread block per
/// kQuantBlock elements.
void quantize_int8(const CudaContext& ctx, Tensor q, Tensor scales, Tensor x);
void dequantize_add_int8(const CudaContext& ctx, Tensor out, Tensor q, Tensor scales);

}  // namespace shardtrain::cuda
