// Optimizer steps on the CPU (Backend::adamw / sgd) on the fp32 master weights, the reference
// the CUDA backend's fused kernels match: AdamW (Loshchilov & Hutter, arXiv 1711.05101) with
// Adam's bias correction, and torch.optim.SGD with momentum / Nesterov (dampening 0).
#include <cmath>
#include <cstdint>

#include "backend/cpu/cpu_ops.h"

namespace shardtrain::cpu {

void adamw(Tensor master, Tensor grad, Tensor m, Tensor v, const Backend::AdamWArgs& a) {
  const int64_t n = master.numel();
  float* p = master.f32();
  const float* g = grad.f32();
  float* mm = m.f32();
  float* vv = v.f32();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * a.grad_scale;
    const float mi = a.beta1 * mm[i] + (1.0f - a.beta1) * gi;
    const float vi = a.beta2 * vv[i] + (1.0f - a.beta2) * gi * gi;
    mm[i] = mi;
    vv[i] = vi;
    const float mhat = mi / a.bias_correction1;
    const float vhat = vi / a.bias_correction2;
    p[i] -= a.lr * (mhat / (std::sqrt(vhat) + a.eps) + a.weight_decay * p[i]);
  }
}

void sgd(Tensor master, Tensor grad, Tensor momentum_buf, const Backend::SgdArgs& a) {
  const int64_t n = master.numel();
  ST_ASSERT(grad.numel() == n && grad.dtype == DType::kF32);
  const bool use_buf = a.momentum != 0.0f;
  ST_ASSERT(!use_buf || momentum_buf.numel() == n);
  ST_ASSERT(!a.nesterov || use_buf);
  float* p = master.f32();
  const float* g = grad.f32();
  float* buf = use_buf ? momentum_buf.f32() : nullptr;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * a.grad_scale + a.weight_decay * p[i];
    float d = gi;
    if (use_buf) {
      const float b = a.first_step ? gi : a.momentum * buf[i] + gi;
      buf[i] = b;
      d = a.nesterov ? gi + a.momentum * b : b;
    }
    p[i] -= a.lr * d;
  }
}

}  // namespace shardtrain::cpu
