// Softmax + cross-entropy on the CPU (Backend::softmax_cross_entropy / cross_entropy_forward),
// the fp32 reference: rows in parallel, the logits overwritten in place by the gradient
// (softmax − one-hot) · grad_scale; the exponentials through the vectorizable vexp
// (cpu_common.h).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/cpu_ops.h"

namespace shardtrain::cpu {

void softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, float grad_scale,
                           int64_t vocab) {
  const int64_t ld = logits.dim(-1), N = logits.numel() / ld, V = vocab;
  ST_ASSERT(V > 0 && V <= ld);
  float* lg = logits.f32();
  const int32_t* tg = targets.i32();
  float* ls = losses.f32();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    float* row = lg + i * ld;
    const int32_t target = tg[i];
    if (target < 0) {
      ls[i] = 0.f;
      std::memset(row, 0, static_cast<size_t>(V) * sizeof(float));
      continue;
    }
    const float maxv = row_max(row, V);
    const float target_logit = row[target];
    const float sum = exp_sum(row, row, V, maxv);
    ls[i] = std::log(sum) + maxv - target_logit;
    const float inv = grad_scale / sum;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) row[j] *= inv;
    row[target] -= grad_scale;
  }
}

void cross_entropy_forward(Tensor losses, Tensor logits, Tensor targets, int64_t vocab) {
  const int64_t ld = logits.dim(-1), N = logits.numel() / ld, V = vocab;
  ST_ASSERT(V > 0 && V <= ld);
  const float* lg = logits.f32();
  const int32_t* tg = targets.i32();
  float* ls = losses.f32();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* row = lg + i * ld;
    if (tg[i] < 0) {
      ls[i] = 0.f;
      continue;
    }
    const float maxv = row_max(row, V);
    ls[i] = std::log(exp_sum(row, nullptr, V, maxv)) + maxv - row[tg[i]];
  }
}

}  // namespace shardtrain::cpu
