// Linear layers on the CPU (Backend::matmul_forward / matmul_backward), the fp32 reference:
// OpenBLAS sgemm for the products, the bias added (and its gradient summed by channel slices in
// row order) around it, and the GELU epilogue through cpu_elementwise.cpp.
#include <cblas.h>

#include <algorithm>
#include <cstdint>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/cpu_ops.h"

namespace shardtrain::cpu {

void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Epilogue epilogue,
                    Tensor pre_gelu) {
  const int64_t OC = weight.dim(0), IC = weight.dim(1), N = inp.numel() / IC;
  const int64_t ld = N > 0 ? out.numel() / N : OC;  // row stride: OC, or padded (no epilogue)
  ST_ASSERT(out.numel() == N * ld && ld >= OC && (ld == OC || epilogue == Epilogue::kNone));
  float* y = epilogue == Epilogue::kGelu ? pre_gelu.f32() : out.f32();
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(N), static_cast<int>(OC),
              static_cast<int>(IC), 1.0f, inp.f32(), static_cast<int>(IC), weight.f32(),
              static_cast<int>(IC), 0.0f, y, static_cast<int>(ld));
  if (!bias.empty() || ld > OC) {
    const float* bb = bias.empty() ? nullptr : bias.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      float* yi = y + i * ld;
      if (bb)
        for (int64_t o = 0; o < OC; ++o) yi[o] += bb[o];
      std::fill(yi + OC, yi + ld, 0.0f);
    }
  }
  if (epilogue == Epilogue::kGelu) gelu_forward(out, pre_gelu);
}

void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                     Tensor weight, Tensor dinp_gelu_input) {
  const int64_t OC = weight.dim(0), IC = weight.dim(1), N = inp.numel() / IC;
  const int64_t ld = N > 0 ? dout.numel() / N : OC;  // row stride of dout: OC or padded
  ST_ASSERT(dout.numel() == N * ld && ld >= OC);
  const float* dy = dout.f32();
  if (!dinp.empty()) {
    // dinp [N,IC] = dout [N,OC] · W [OC,IC]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(N),
                static_cast<int>(IC), static_cast<int>(OC), 1.0f, dy, static_cast<int>(ld),
                weight.f32(), static_cast<int>(IC), 0.0f, dinp.f32(), static_cast<int>(IC));
    if (!dinp_gelu_input.empty()) gelu_backward(dinp, dinp_gelu_input, dinp);
  }
  // dW [OC,IC] += doutᵀ [OC,N] · inp [N,IC]
  if (!dweight.empty())
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(OC), static_cast<int>(IC),
                static_cast<int>(N), 1.0f, dy, static_cast<int>(ld), inp.f32(),
                static_cast<int>(IC), 1.0f, dweight.f32(), static_cast<int>(IC));
  if (!dbias.empty()) {
    float* db = dbias.f32();
    for_channel_slices(OC, [&](int64_t o0, int64_t o1) {
      for (int64_t i = 0; i < N; ++i) {
        const float* dyi = dy + i * ld;
        for (int64_t o = o0; o < o1; ++o) db[o] += dyi[o];
      }
    });
  }
}

}  // namespace shardtrain::cpu
