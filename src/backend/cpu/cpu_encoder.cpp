// Token and position embedding on the CPU (Backend::embedding_forward / embedding_backward), the
// fp32 reference: the forward a gather-and-add per row (dropout applied per row), the backward a
// scatter-add in which each OpenMP thread owns a slice of channels, so rows sharing a token never
// race and every sum is taken in row order.
#include <cstdint>
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/cpu_ops.h"

namespace shardtrain::cpu {

void embedding_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe, const Dropout& dropout) {
  const int64_t B = out.dim(0), T = out.dim(1), C = out.dim(2);
  const int32_t* tok = tokens.i32();
  const float* te = wte.f32();
  const float* pe = wpe.f32();
  float* o = out.f32();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float* e = te + static_cast<int64_t>(tok[b * T + t]) * C;
      const float* p = pe + t * C;
      float* y = o + (b * T + t) * C;
      for (int64_t c = 0; c < C; ++c) y[c] = e[c] + p[c];
      if (dropout.active()) apply_dropout(y, y, dropout, static_cast<uint64_t>((b * T + t) * C), C);
    }
  }
}

void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                        const Dropout& dropout) {
  const int64_t B = dout.dim(0), T = dout.dim(1), C = dout.dim(2);
  const int32_t* tok = tokens.i32();
  const float* d = dout.f32();
  std::vector<float> masked;
  if (dropout.active()) {  // the reference: mask dout first (the GPU fuses it into the scatter)
    masked.resize(static_cast<size_t>(dout.numel()));
    apply_dropout_parallel(masked.data(), d, dropout, dout.numel());
    d = masked.data();
  }
  float* dte = dwte.empty() ? nullptr : dwte.f32();  // either part may be skipped
  float* dpe = dwpe.empty() ? nullptr : dwpe.f32();
  // Each thread owns a slice of channels, so rows sharing a token never race and the order of
  // summation is fixed.
  for_channel_slices(C, [&](int64_t c0, int64_t c1) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const float* g = d + (b * T + t) * C;
        if (dte) {
          float* e = dte + static_cast<int64_t>(tok[b * T + t]) * C;
          for (int64_t c = c0; c < c1; ++c) e[c] += g[c];
        }
        if (dpe) {
          float* p = dpe + t * C;
          for (int64_t c = c0; c < c1; ++c) p[c] += g[c];
        }
      }
    }
  });
}

}  // namespace shardtrain::cpu
