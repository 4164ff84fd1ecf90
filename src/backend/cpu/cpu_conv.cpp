// CPU convolution and pooling kernels (fp32) behind CpuImageOps.
//
// Convolution lowers each image's group to a matrix product (Chellapilla, Puri and Simard, "High
// Performance Convolutional Neural Networks for Document Processing", IWFHR 2006): im2col
// unfolds the input into col [C/g·R·S, P·Q], and out_g [K/g, P·Q] = W_g [K/g, C/g·R·S] · col is
// one sgemm. Backward is two more sgemms per image and group, dW_g += dout_g · colᵀ and
// dcol = W_gᵀ · dout_g, with col2im folding dcol back into the input gradient. A 1×1 convolution
// with stride 1 and no padding uses the input itself as col. Depthwise convolutions
// (groups = C = K) are direct loops: each is one R×S filter per plane, too little work for a
// matrix product.
//
// Parallelism: OpenMP over images (forward, input gradient) with per-thread weight-gradient
// accumulators reduced in thread order afterwards, so results are the same from run to run at a
// fixed thread count; over channels for depthwise and bias gradients; over planes for pooling.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/cpu_image_detail.h"

namespace shardtrain::cpu_image {
namespace {

bool is_pointwise(const Conv2dShape& s) {
  return s.R == 1 && s.S == 1 && s.stride_h == 1 && s.stride_w == 1 && s.pad_h == 0 && s.pad_w == 0;
}

bool is_depthwise(const Conv2dShape& s) {
  return s.groups > 1 && s.groups == s.C && s.groups == s.K;
}

/// col [Cg·R·S, P·Q] from the Cg planes at x (H×W each); padding reads as 0.
void im2col(float* col, const float* x, int64_t Cg, const Conv2dShape& s) {
  const int64_t P = s.P(), Q = s.Q();
  for (int64_t c = 0; c < Cg; ++c)
    for (int64_t r = 0; r < s.R; ++r)
      for (int64_t t = 0; t < s.S; ++t) {
        float* row = col + ((c * s.R + r) * s.S + t) * P * Q;
        for (int64_t p = 0; p < P; ++p) {
          const int64_t ih = p * s.stride_h - s.pad_h + r;
          float* dst = row + p * Q;
          if (ih < 0 || ih >= s.H) {
            std::fill(dst, dst + Q, 0.0f);
            continue;
          }
          const float* src = x + (c * s.H + ih) * s.W;
          for (int64_t q = 0; q < Q; ++q) {
            const int64_t iw = q * s.stride_w - s.pad_w + t;
            dst[q] = iw >= 0 && iw < s.W ? src[iw] : 0.0f;
          }
        }
      }
}

/// dx (Cg planes H×W, overwritten) = the fold of dcol [Cg·R·S, P·Q] (im2col's adjoint).
void col2im(float* dx, const float* dcol, int64_t Cg, const Conv2dShape& s) {
  const int64_t P = s.P(), Q = s.Q();
  std::fill(dx, dx + Cg * s.H * s.W, 0.0f);
  for (int64_t c = 0; c < Cg; ++c)
    for (int64_t r = 0; r < s.R; ++r)
      for (int64_t t = 0; t < s.S; ++t) {
        const float* row = dcol + ((c * s.R + r) * s.S + t) * P * Q;
        for (int64_t p = 0; p < P; ++p) {
          const int64_t ih = p * s.stride_h - s.pad_h + r;
          if (ih < 0 || ih >= s.H) continue;
          float* dst = dx + (c * s.H + ih) * s.W;
          for (int64_t q = 0; q < Q; ++q) {
            const int64_t iw = q * s.stride_w - s.pad_w + t;
            if (iw >= 0 && iw < s.W) dst[iw] += row[p * Q + q];
          }
        }
      }
}

void depthwise_forward(float* out, const float* inp, const float* weight, const float* bias,
                       const Conv2dShape& s, Activation act) {
  const int64_t C = s.C, P = s.P(), Q = s.Q();
#pragma omp parallel for schedule(static) if (worth_parallel(s.N * C * P * Q * s.R * s.S))
  for (int64_t nc = 0; nc < s.N * C; ++nc) {
    const int64_t c = nc % C;
    const float* x = inp + nc * s.H * s.W;
    const float* w = weight + c * s.R * s.S;
    float* y = out + nc * P * Q;
    const float b = bias ? bias[c] : 0.0f;
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        float acc = b;
        for (int64_t r = 0; r < s.R; ++r) {
          const int64_t ih = p * s.stride_h - s.pad_h + r;
          if (ih < 0 || ih >= s.H) continue;
          for (int64_t t = 0; t < s.S; ++t) {
            const int64_t iw = q * s.stride_w - s.pad_w + t;
            if (iw >= 0 && iw < s.W) acc += x[ih * s.W + iw] * w[r * s.S + t];
          }
        }
        y[p * Q + q] = act_forward(acc, act);
      }
  }
}

/// Depthwise backward, parallel over channels: each thread owns its channels' weight gradients
/// and input-gradient planes.
void depthwise_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                        const float* weight, const Conv2dShape& s) {
  const int64_t C = s.C, P = s.P(), Q = s.Q(), RS = s.R * s.S;
#pragma omp parallel for schedule(static) if (worth_parallel(s.N * C * P * Q * RS))
  for (int64_t c = 0; c < C; ++c) {
    const float* w = weight + c * RS;
    std::vector<double> dw(static_cast<size_t>(RS), 0.0);
    for (int64_t n = 0; n < s.N; ++n) {
      const float* x = inp + (n * C + c) * s.H * s.W;
      const float* dy = dout + (n * C + c) * P * Q;
      float* dx = dinp ? dinp + (n * C + c) * s.H * s.W : nullptr;
      if (dx) std::fill(dx, dx + s.H * s.W, 0.0f);
      for (int64_t p = 0; p < P; ++p)
        for (int64_t r = 0; r < s.R; ++r) {
          const int64_t ih = p * s.stride_h - s.pad_h + r;
          if (ih < 0 || ih >= s.H) continue;
          for (int64_t q = 0; q < Q; ++q) {
            const float g = dy[p * Q + q];
            for (int64_t t = 0; t < s.S; ++t) {
              const int64_t iw = q * s.stride_w - s.pad_w + t;
              if (iw < 0 || iw >= s.W) continue;
              dw[static_cast<size_t>(r * s.S + t)] += static_cast<double>(g) * x[ih * s.W + iw];
              if (dx) dx[ih * s.W + iw] += g * w[r * s.S + t];
            }
          }
        }
    }
    for (int64_t i = 0; i < RS; ++i)
      dweight[c * RS + i] += static_cast<float>(dw[static_cast<size_t>(i)]);
  }
}

}  // namespace

void conv2d_forward(float* out, const float* inp, const float* weight, const float* bias,
                    const Conv2dShape& s, Activation act) {
  if (is_depthwise(s)) return depthwise_forward(out, inp, weight, bias, s, act);
  const int64_t G = s.groups, Cg = s.C / G, Kg = s.K / G, P = s.P(), Q = s.Q(), PQ = P * Q;
  const int64_t CRS = Cg * s.R * s.S;
  const bool pointwise = is_pointwise(s);
  // One image per thread (each sgemm then single-threaded inside OpenMP); a single image leaves
  // OpenBLAS its own threads.
#pragma omp parallel if (s.N > 1 && worth_parallel(s.N * s.K * PQ * CRS))
  {
    std::vector<float> col(pointwise ? 0 : static_cast<size_t>(CRS * PQ));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < s.N; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        const float* x = inp + (n * s.C + g * Cg) * s.H * s.W;
        const float* b = x;
        if (!pointwise) {
          im2col(col.data(), x, Cg, s);
          b = col.data();
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(Kg),
                    static_cast<int>(PQ), static_cast<int>(CRS), 1.0f, weight + g * Kg * CRS,
                    static_cast<int>(CRS), b, static_cast<int>(PQ), 0.0f,
                    out + (n * s.K + g * Kg) * PQ, static_cast<int>(PQ));
      }
      if (bias || act != Activation::kNone) {
        for (int64_t k = 0; k < s.K; ++k) {
          float* y = out + (n * s.K + k) * PQ;
          const float bk = bias ? bias[k] : 0.0f;
          for (int64_t i = 0; i < PQ; ++i) y[i] = act_forward(y[i] + bk, act);
        }
      }
    }
  }
}

void conv2d_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, const Conv2dShape& s) {
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q;
  if (dbias) {
#pragma omp parallel for schedule(static) if (worth_parallel(s.N * s.K * PQ))
    for (int64_t k = 0; k < s.K; ++k) {
      double acc = 0.0;
      for (int64_t n = 0; n < s.N; ++n) {
        const float* dy = dout + (n * s.K + k) * PQ;
        for (int64_t i = 0; i < PQ; ++i) acc += dy[i];
      }
      dbias[k] += static_cast<float>(acc);
    }
  }
  if (is_depthwise(s)) return depthwise_backward(dinp, dweight, dout, inp, weight, s);

  const int64_t G = s.groups, Cg = s.C / G, Kg = s.K / G, CRS = Cg * s.R * s.S;
  const bool pointwise = is_pointwise(s);
  const int nth = s.N > 1 && worth_parallel(s.N * s.K * PQ * CRS) ? omp_get_max_threads() : 1;
  // Per-thread weight gradients, summed in thread order after the loop over images.
  // (All allocated here: the region may get fewer threads than asked for.)
  std::vector<std::vector<float>> dw_local(static_cast<size_t>(nth),
                                           std::vector<float>(static_cast<size_t>(s.K * CRS)));
#pragma omp parallel num_threads(nth)
  {
    const int id = omp_get_thread_num();
    std::vector<float>& dw = dw_local[static_cast<size_t>(id)];
    std::vector<float> col(pointwise ? 0 : static_cast<size_t>(CRS * PQ));
    std::vector<float> dcol(pointwise || !dinp ? 0 : static_cast<size_t>(CRS * PQ));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < s.N; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        const float* x = inp + (n * s.C + g * Cg) * s.H * s.W;
        const float* dy = dout + (n * s.K + g * Kg) * PQ;
        const float* w = weight + g * Kg * CRS;
        const float* b = x;
        if (!pointwise) {
          im2col(col.data(), x, Cg, s);
          b = col.data();
        }
        // dW_g [Kg, CRS] += dy_g [Kg, PQ] · colᵀ [PQ, CRS]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(Kg),
                    static_cast<int>(CRS), static_cast<int>(PQ), 1.0f, dy, static_cast<int>(PQ), b,
                    static_cast<int>(PQ), 1.0f, dw.data() + g * Kg * CRS, static_cast<int>(CRS));
        if (!dinp) continue;
        float* dx = dinp + (n * s.C + g * Cg) * s.H * s.W;
        // dcol [CRS, PQ] = W_gᵀ [CRS, Kg] · dy_g [Kg, PQ]; pointwise: dcol is dx itself.
        float* dc = pointwise ? dx : dcol.data();
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(CRS),
                    static_cast<int>(PQ), static_cast<int>(Kg), 1.0f, w, static_cast<int>(CRS), dy,
                    static_cast<int>(PQ), 0.0f, dc, static_cast<int>(PQ));
        if (!pointwise) col2im(dx, dcol.data(), Cg, s);
      }
    }
  }
  const int64_t total = s.K * CRS;
#pragma omp parallel for schedule(static) if (worth_parallel(total * nth))
  for (int64_t i = 0; i < total; ++i) {
    float acc = 0.0f;
    for (const auto& dw : dw_local) acc += dw[static_cast<size_t>(i)];
    dweight[i] += acc;
  }
}

// ---- pooling
// --------------------------------------------------------------------------------------

void maxpool2d_forward(float* out, const float* inp, const Pool2dShape& s) {
  const int64_t P = s.P(), Q = s.Q();
#pragma omp parallel for schedule(static) if (worth_parallel(s.N * s.C * P * Q * s.R * s.S))
  for (int64_t nc = 0; nc < s.N * s.C; ++nc) {
    const float* x = inp + nc * s.H * s.W;
    float* y = out + nc * P * Q;
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t r = 0; r < s.R; ++r) {
          const int64_t ih = p * s.stride_h - s.pad_h + r;
          if (ih < 0 || ih >= s.H) continue;
          for (int64_t t = 0; t < s.S; ++t) {
            const int64_t iw = q * s.stride_w - s.pad_w + t;
            if (iw >= 0 && iw < s.W) m = std::max(m, x[ih * s.W + iw]);
          }
        }
        y[p * Q + q] = m;
      }
  }
}

void maxpool2d_backward(float* dinp, const float* dout, const float* inp, const Pool2dShape& s) {
  const int64_t P = s.P(), Q = s.Q();
#pragma omp parallel for schedule(static) if (worth_parallel(s.N * s.C * P * Q * s.R * s.S))
  for (int64_t nc = 0; nc < s.N * s.C; ++nc) {
    const float* x = inp + nc * s.H * s.W;
    const float* dy = dout + nc * P * Q;
    float* dx = dinp + nc * s.H * s.W;
    std::fill(dx, dx + s.H * s.W, 0.0f);
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        float m = -std::numeric_limits<float>::infinity();
        int64_t arg = -1;
        for (int64_t r = 0; r < s.R; ++r) {
          const int64_t ih = p * s.stride_h - s.pad_h + r;
          if (ih < 0 || ih >= s.H) continue;
          for (int64_t t = 0; t < s.S; ++t) {
            const int64_t iw = q * s.stride_w - s.pad_w + t;
            if (iw < 0 || iw >= s.W) continue;
            const float v = x[ih * s.W + iw];
            if (arg < 0 || v > m) {  // the first maximum in row-major order wins
              m = v;
              arg = ih * s.W + iw;
            }
          }
        }
        if (arg >= 0) dx[arg] += dy[p * Q + q];
      }
  }
}

void avgpool2d_forward(float* out, const float* inp, const Pool2dShape& s) {
  const int64_t P = s.P(), Q = s.Q();
  const float inv = 1.0f / static_cast<float>(s.R * s.S);
#pragma omp parallel for schedule(static) if (worth_parallel(s.N * s.C * P * Q * s.R * s.S))
  for (int64_t nc = 0; nc < s.N * s.C; ++nc) {
    const float* x = inp + nc * s.H * s.W;
    float* y = out + nc * P * Q;
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        float acc = 0.0f;
        for (int64_t r = 0; r < s.R; ++r) {
          const int64_t ih = p * s.stride_h - s.pad_h + r;
          if (ih < 0 || ih >= s.H) continue;
          for (int64_t t = 0; t < s.S; ++t) {
            const int64_t iw = q * s.stride_w - s.pad_w + t;
            if (iw >= 0 && iw < s.W) acc += x[ih * s.W + iw];
          }
        }
        y[p * Q + q] = acc * inv;
      }
  }
}

void avgpool2d_backward(float* dinp, const float* dout, const Pool2dShape& s) {
  const int64_t P = s.P(), Q = s.Q();
  const float inv = 1.0f / static_cast<float>(s.R * s.S);
#pragma omp parallel for schedule(static) if (worth_parallel(s.N * s.C * P * Q * s.R * s.S))
  for (int64_t nc = 0; nc < s.N * s.C; ++nc) {
    const float* dy = dout + nc * P * Q;
    float* dx = dinp + nc * s.H * s.W;
    std::fill(dx, dx + s.H * s.W, 0.0f);
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        const float g = dy[p * Q + q] * inv;
        for (int64_t r = 0; r < s.R; ++r) {
          const int64_t ih = p * s.stride_h - s.pad_h + r;
          if (ih < 0 || ih >= s.H) continue;
          for (int64_t t = 0; t < s.S; ++t) {
            const int64_t iw = q * s.stride_w - s.pad_w + t;
            if (iw >= 0 && iw < s.W) dx[ih * s.W + iw] += g;
          }
        }
      }
  }
}

namespace {
/// PyTorch's adaptive window of output index i: [⌊i·In/Out⌋, ⌈(i+1)·In/Out⌉).
inline int64_t adaptive_begin(int64_t i, int64_t in, int64_t out) { return i * in / out; }
inline int64_t adaptive_end(int64_t i, int64_t in, int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}
}  // namespace

void adaptive_avgpool2d_forward(float* out, const float* inp, int64_t NC, int64_t H, int64_t W,
                                int64_t P, int64_t Q) {
#pragma omp parallel for schedule(static) if (worth_parallel(NC * H * W))
  for (int64_t nc = 0; nc < NC; ++nc) {
    const float* x = inp + nc * H * W;
    float* y = out + nc * P * Q;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t h0 = adaptive_begin(p, H, P), h1 = adaptive_end(p, H, P);
      for (int64_t q = 0; q < Q; ++q) {
        const int64_t w0 = adaptive_begin(q, W, Q), w1 = adaptive_end(q, W, Q);
        float acc = 0.0f;
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t w = w0; w < w1; ++w) acc += x[h * W + w];
        y[p * Q + q] = acc / static_cast<float>((h1 - h0) * (w1 - w0));
      }
    }
  }
}

void adaptive_avgpool2d_backward(float* dinp, const float* dout, int64_t NC, int64_t H, int64_t W,
                                 int64_t P, int64_t Q) {
#pragma omp parallel for schedule(static) if (worth_parallel(NC * H * W))
  for (int64_t nc = 0; nc < NC; ++nc) {
    const float* dy = dout + nc * P * Q;
    float* dx = dinp + nc * H * W;
    std::fill(dx, dx + H * W, 0.0f);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t h0 = adaptive_begin(p, H, P), h1 = adaptive_end(p, H, P);
      for (int64_t q = 0; q < Q; ++q) {
        const int64_t w0 = adaptive_begin(q, W, Q), w1 = adaptive_end(q, W, Q);
        const float g = dy[p * Q + q] / static_cast<float>((h1 - h0) * (w1 - w0));
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t w = w0; w < w1; ++w) dx[h * W + w] += g;
      }
    }
  }
}

}  // namespace shardtrain::cpu_image
