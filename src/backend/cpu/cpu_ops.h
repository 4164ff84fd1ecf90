// The CPU backend's ops, one op family per file (forward and backward side by side), called by the
// CpuBackend class (cpu_backend.cpp):
//   cpu_encoder.cpp       — token + position embedding forward/backward
//   cpu_layernorm.cpp     — LayerNorm forward/backward
//   cpu_matmul.cpp        — linear layers through OpenBLAS sgemm (bias, GELU epilogue)
//   cpu_elementwise.cpp   — GELU forward/backward, residual add with dropout, dropout backward,
//                           scale
//   cpu_attention.cpp     — causal self-attention forward/backward, materialized probabilities
//   cpu_cross_entropy.cpp — softmax + cross-entropy (loss and in-place logit gradient)
//   cpu_reduce.cpp        — sum and sum of squares in fp64
//   cpu_quantize.cpp      — blockwise int8 quantization
//   cpu_optimizer.cpp     — AdamW and SGD steps on the fp32 master weights
// Semantics are exactly those of the same-named Backend methods (backend/backend.h), on fp32
// tensors in host memory; adamw and sgd update the master weights only (the class converts them
// into params_out).
#pragma once

#include <cstdint>

#include "backend/backend.h"

namespace shardtrain::cpu {

void embedding_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe, const Dropout& dropout);
void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                        const Dropout& dropout);

void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                       Tensor bias);
void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                        Tensor weight, Tensor mean, Tensor rstd);

void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Epilogue epilogue,
                    Tensor pre_gelu);
void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                     Tensor weight, Tensor dinp_gelu_input);

void gelu_forward(Tensor out, Tensor inp);
void gelu_backward(Tensor dinp, Tensor inp, Tensor dout);
void add(Tensor out, Tensor a, Tensor b, const Dropout& dropout_b);
void dropout_backward(Tensor dst, Tensor src, const Dropout& dropout);
void scale(Tensor x, float s);

void attention_forward(Tensor out, AttentionSaved saved, Tensor qkv, int num_heads,
                       const Dropout& dropout);
void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, AttentionSaved saved,
                        int num_heads, const Dropout& dropout);

void softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, float grad_scale,
                           int64_t vocab);
void cross_entropy_forward(Tensor losses, Tensor logits, Tensor targets, int64_t vocab);

double sum_squares(Tensor x);
double sum(Tensor x);

void quantize_int8(Tensor q, Tensor scales, Tensor x);
void dequantize_add_int8(Tensor out, Tensor q, Tensor scales);

void adamw(Tensor master, Tensor grad, Tensor m, Tensor v, const Backend::AdamWArgs& a);
void sgd(Tensor master, Tensor grad, Tensor momentum_buf, const Backend::SgdArgs& a);

}  // namespace shardtrain::cpu
