// Element-wise ops on the CPU, the fp32 reference: GELU forward/backward (tanh approximation,
// Hendrycks & Gimpel, arXiv 1606.08415), the residual add with dropout, dropout's backward and
// scaling; OpenMP over elements with static schedules.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/cpu_ops.h"

namespace shardtrain::cpu {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

}  // namespace

void gelu_forward(Tensor out, Tensor inp) {
  const int64_t n = inp.numel();
  const float* x = inp.f32();
  float* y = out.f32();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float cube = 0.044715f * v * v * v;
    y[i] = 0.5f * v * (1.0f + std::tanh(kGeluScale * (v + cube)));
  }
}

void gelu_backward(Tensor dinp, Tensor inp, Tensor dout) {
  const int64_t n = inp.numel();
  const float* x = inp.f32();
  const float* dy = dout.f32();
  float* dx = dinp.f32();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float cube = 0.044715f * v * v * v;
    const float arg = kGeluScale * (v + cube);
    const float th = std::tanh(arg);
    const float sech2 = 1.0f - th * th;
    const float grad =
        0.5f * (1.0f + th) + 0.5f * v * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * v * v);
    dx[i] = grad * dy[i];
  }
}

void add(Tensor out, Tensor a, Tensor b, const Dropout& dropout_b) {
  const int64_t n = out.numel();
  const float* x = a.f32();
  const float* y = b.f32();
  float* o = out.f32();
  if (dropout_b.active()) {
    const uint32_t thresh = dropout_b.threshold();
    const float keep_scale = dropout_b.scale();
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < (n + 3) / 4; ++g) {
      const Philox4x32 r = dropout_b.bits4(static_cast<uint64_t>(g) * 4);
      for (int64_t i = g * 4; i < std::min(n, g * 4 + 4); ++i)
        o[i] = x[i] + (r.v[i & 3] >= thresh ? y[i] * keep_scale : 0.0f);
    }
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

void dropout_backward(Tensor dst, Tensor src, const Dropout& dropout) {
  if (!dropout.active()) {
    if (dst.data != src.data) std::memmove(dst.data, src.data, src.bytes());
    return;
  }
  apply_dropout_parallel(dst.f32(), src.f32(), dropout, src.numel());
}

void scale(Tensor x, float s) {
  float* p = x.f32();
  const int64_t n = x.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] *= s;
}

}  // namespace shardtrain::cpu
