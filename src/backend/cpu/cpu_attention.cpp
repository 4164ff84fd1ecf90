// Causal self-attention on the CPU (Backend::attention_forward / attention_backward), the fp32
// reference: the softmax probabilities materialized [B, NH, T, T] and saved for the backward,
// (batch, head) pairs in parallel; attention dropout from the 8-bit Philox decisions the GPU
// kernels use (AttnDropout8, core/philox.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/cpu_ops.h"

namespace shardtrain::cpu {
namespace {

/// f[j] = the attention dropout multiplier (0 or 1/(1-p_effective)) of element base + j, j < n:
/// the 8-bit decisions of AttnDropout8 (core/philox.h), one Philox call per 16 elements.
void attention_dropout_factors(float* f, const Dropout& d, uint64_t base, int64_t n) {
  const uint32_t thresh = AttnDropout8::threshold(d);
  const float keep_scale = AttnDropout8::scale(d);
  uint32_t mask = 0;
  uint64_t group = ~uint64_t{0};
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t idx = base + static_cast<uint64_t>(j);
    if ((idx >> 4) != group) {
      group = idx >> 4;
      mask = AttnDropout8::keep_mask16(d, idx & ~uint64_t{15}, thresh);
    }
    f[j] = (mask >> (idx & 15)) & 1u ? keep_scale : 0.0f;
  }
}

}  // namespace

void attention_forward(Tensor out, AttentionSaved saved, Tensor qkv, int num_heads,
                       const Dropout& dropout) {
  const int64_t B = qkv.dim(0), T = qkv.dim(1), C3 = qkv.dim(2), C = C3 / 3;
  const int64_t NH = num_heads, hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float* x = qkv.f32();
  float* att = saved.probs.f32();
  float* y = out.f32();
  const bool drop = dropout.active();
#pragma omp parallel
  {
    std::vector<float> fac(drop ? static_cast<size_t>(T) : 0);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < NH; ++h) {
        for (int64_t t = 0; t < T; ++t) {
          if (drop)
            attention_dropout_factors(fac.data(), dropout,
                                      static_cast<uint64_t>(((b * NH + h) * T + t) * T), t + 1);
          const float* q = x + (b * T + t) * C3 + h * hs;
          float* p = att + ((b * NH + h) * T + t) * T;
          float maxv = -INFINITY;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            const float* k = x + (b * T + t2) * C3 + C + h * hs;
            float s = 0.f;
            for (int64_t i = 0; i < hs; ++i) s += q[i] * k[i];
            s *= scale;
            p[t2] = s;
            maxv = std::max(maxv, s);
          }
          const float sum = exp_sum(p, p, t + 1, maxv);
          const float inv = 1.0f / sum;
          for (int64_t t2 = 0; t2 <= t; ++t2) p[t2] *= inv;
          for (int64_t t2 = t + 1; t2 < T; ++t2) p[t2] = 0.f;
          float* yt = y + (b * T + t) * C + h * hs;
          for (int64_t i = 0; i < hs; ++i) yt[i] = 0.f;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            const float* v = x + (b * T + t2) * C3 + 2 * C + h * hs;
            const float a = drop ? p[t2] * fac[static_cast<size_t>(t2)] : p[t2];
            for (int64_t i = 0; i < hs; ++i) yt[i] += a * v[i];
          }
        }
      }
    }
  }
}

void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor /*out*/, AttentionSaved saved,
                        int num_heads, const Dropout& dropout) {
  const int64_t B = qkv.dim(0), T = qkv.dim(1), C3 = qkv.dim(2), C = C3 / 3;
  const int64_t NH = num_heads, hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float* x = qkv.f32();
  const float* att = saved.probs.f32();
  const float* dy = dout.f32();
  float* dx = dqkv.f32();
  // Each (b, h) touches only its own columns of dqkv, so (b, h) pairs run in parallel.
#pragma omp parallel
  {
    std::vector<float> datt(static_cast<size_t>(T));
    const bool drop = dropout.active();
    std::vector<float> fac(drop ? static_cast<size_t>(T) : 0);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < NH; ++h) {
        for (int64_t t = 0; t < T; ++t) {
          float* dq = dx + (b * T + t) * C3 + h * hs;
          for (int64_t i = 0; i < hs; ++i) dq[i] = 0.f;
          float* dk = dx + (b * T + t) * C3 + C + h * hs;
          for (int64_t i = 0; i < hs; ++i) dk[i] = 0.f;
          float* dv = dx + (b * T + t) * C3 + 2 * C + h * hs;
          for (int64_t i = 0; i < hs; ++i) dv[i] = 0.f;
        }
        for (int64_t t = 0; t < T; ++t) {
          const float* p = att + ((b * NH + h) * T + t) * T;
          const float* dyt = dy + (b * T + t) * C + h * hs;
          // datt = dy · v ; dv += p * dy (with dropout: pd = p∘f, datt = (dy · v)∘f)
          if (drop)
            attention_dropout_factors(fac.data(), dropout,
                                      static_cast<uint64_t>(((b * NH + h) * T + t) * T), t + 1);
          float dot = 0.f;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            const float* v = x + (b * T + t2) * C3 + 2 * C + h * hs;
            float* dv = dx + (b * T + t2) * C3 + 2 * C + h * hs;
            const float f = drop ? fac[static_cast<size_t>(t2)] : 1.0f;
            const float pd = drop ? p[t2] * f : p[t2];
            float s = 0.f;
            for (int64_t i = 0; i < hs; ++i) {
              s += dyt[i] * v[i];
              dv[i] += pd * dyt[i];
            }
            if (drop) s *= f;
            datt[static_cast<size_t>(t2)] = s;
            dot += s * p[t2];
          }
          // softmax backward: dpre = p * (datt - Σ p·datt), then through q·kᵀ·scale.
          const float* q = x + (b * T + t) * C3 + h * hs;
          float* dq = dx + (b * T + t) * C3 + h * hs;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            const float dpre = p[t2] * (datt[static_cast<size_t>(t2)] - dot) * scale;
            const float* k = x + (b * T + t2) * C3 + C + h * hs;
            float* dk = dx + (b * T + t2) * C3 + C + h * hs;
            for (int64_t i = 0; i < hs; ++i) {
              dq[i] += dpre * k[i];
              dk[i] += dpre * q[i];
            }
          }
        }
      }
    }
  }
}

}  // namespace shardtrain::cpu
