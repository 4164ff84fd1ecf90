// LayerNorm on the CPU (Ba, Kiros & Hinton, arXiv 1607.06450, eq. 4), Backend::layernorm_forward
// / layernorm_backward, the fp32 reference: rows in parallel, two passes for the variance, and the
// weight and bias gradients summed by channel slices in row order.
#include <cmath>
#include <cstdint>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/cpu_ops.h"

namespace shardtrain::cpu {
namespace {

constexpr float kLayerNormEps = 1e-5f;

}  // namespace

void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                       Tensor bias) {
  const int64_t C = inp.dim(-1), N = inp.numel() / C;
  const float* x = inp.f32();
  const float* w = weight.f32();
  const float* bb = bias.f32();
  float* y = out.f32();
  float* mu = mean.f32();
  float* rs = rstd.f32();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* xi = x + i * C;
    float m = 0.f;
    for (int64_t c = 0; c < C; ++c) m += xi[c];
    m /= static_cast<float>(C);
    float var = 0.f;
    for (int64_t c = 0; c < C; ++c) {
      const float dx = xi[c] - m;
      var += dx * dx;
    }
    var /= static_cast<float>(C);
    const float s = 1.0f / std::sqrt(var + kLayerNormEps);
    float* yi = y + i * C;
    for (int64_t c = 0; c < C; ++c) yi[c] = (xi[c] - m) * s * w[c] + bb[c];
    mu[i] = m;
    rs[i] = s;
  }
}

void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                        Tensor weight, Tensor mean, Tensor rstd) {
  const int64_t C = inp.dim(-1), N = inp.numel() / C;
  const float* x = inp.f32();
  const float* w = weight.f32();
  const float* dy = dout.f32();
  const float* mu = mean.f32();
  const float* rs = rstd.f32();
  float* dx = dinp.f32();
  float* dw = dweight.f32();
  float* db = dbias.f32();
  // dinp: rows are independent.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* xi = x + i * C;
    const float* dyi = dy + i * C;
    float dnorm_mean = 0.f, dnorm_norm_mean = 0.f;
    for (int64_t c = 0; c < C; ++c) {
      const float norm = (xi[c] - mu[i]) * rs[i];
      const float dnorm = w[c] * dyi[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= static_cast<float>(C);
    dnorm_norm_mean /= static_cast<float>(C);
    float* dxi = dx + i * C;
    for (int64_t c = 0; c < C; ++c) {
      const float norm = (xi[c] - mu[i]) * rs[i];
      const float dnorm = w[c] * dyi[c];
      dxi[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rs[i];
    }
  }
  // dweight, dbias: each thread owns a slice of channels and sums rows in order.
  for_channel_slices(C, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < N; ++i) {
      const float* xi = x + i * C;
      const float* dyi = dy + i * C;
      for (int64_t c = c0; c < c1; ++c) {
        db[c] += dyi[c];
        dw[c] += (xi[c] - mu[i]) * rs[i] * dyi[c];
      }
    }
  });
}

}  // namespace shardtrain::cpu
