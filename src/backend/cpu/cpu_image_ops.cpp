// CpuImageOps: argument checks and the non-convolution image ops (batch normalization,
// activations, channel scaling, LSTM, classification loss); convolution and pooling kernels are
// in cpu_conv.cpp. See cpu_image_ops.h for the algorithms.
#include "backend/cpu/cpu_image_ops.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_image_detail.h"
#include "core/error.h"

namespace shardtrain {
namespace {

using cpu_image::act_derivative;
using cpu_image::act_forward;
using cpu_image::expect_f32;
using cpu_image::expect_f32_or_empty;
using cpu_image::expect_f64;
using cpu_image::expect_nchw;
using cpu_image::sigmoid;
using cpu_image::worth_parallel;

/// Throws unless `t` is an fp32 CPU tensor of `ref`'s shape.
void expect_like(const char* op, const char* name, const Tensor& t, const char* ref_name,
                 const Tensor& ref) {
  check(!t.empty(), "{}: {} is empty, expected the shape of {} {}", op, name, ref_name,
        ref.shape_str());
  check(t.dtype == DType::kF32 && t.device == DeviceKind::kCPU,
        "{}: {} {} is {} on {}, expected fp32 on the CPU", op, name, t.shape_str(),
        dtype_name(t.dtype), device_name(t.device));
  bool same = t.ndim == ref.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.dim(i) == ref.dim(i);
  check(same, "{}: {} has shape {}, but {} has shape {}", op, name, t.shape_str(), ref_name,
        ref.shape_str());
}

void check_conv_shape(const char* op, const Conv2dShape& s) {
  check(s.N > 0 && s.C > 0 && s.H > 0 && s.W > 0 && s.K > 0 && s.R > 0 && s.S > 0 &&
            s.stride_h > 0 && s.stride_w > 0 && s.pad_h >= 0 && s.pad_w >= 0 && s.groups > 0,
        "{}: invalid geometry N={} C={} H={} W={} K={} R={} S={} stride {}x{} pad {}x{} groups {}",
        op, s.N, s.C, s.H, s.W, s.K, s.R, s.S, s.stride_h, s.stride_w, s.pad_h, s.pad_w, s.groups);
  check(s.C % s.groups == 0 && s.K % s.groups == 0,
        "{}: groups={} must divide the input channels C={} and the output channels K={}", op,
        s.groups, s.C, s.K);
  check(s.H + 2 * s.pad_h >= s.R && s.W + 2 * s.pad_w >= s.S,
        "{}: the {}x{} kernel is larger than the padded {}x{} input", op, s.R, s.S,
        s.H + 2 * s.pad_h, s.W + 2 * s.pad_w);
}

void check_pool_shape(const char* op, const Pool2dShape& s) {
  check(s.N > 0 && s.C > 0 && s.H > 0 && s.W > 0 && s.R > 0 && s.S > 0 && s.stride_h > 0 &&
            s.stride_w > 0 && s.pad_h >= 0 && s.pad_w >= 0 && s.H + 2 * s.pad_h >= s.R &&
            s.W + 2 * s.pad_w >= s.S,
        "{}: invalid geometry N={} C={} H={} W={} window {}x{} stride {}x{} pad {}x{}", op, s.N,
        s.C, s.H, s.W, s.R, s.S, s.stride_h, s.stride_w, s.pad_h, s.pad_w);
}

float* ptr_or_null(const Tensor& t) { return t.empty() ? nullptr : t.f32(); }

/// Per-channel batch-norm parameters: the scale a = γ·invstd and shift b = β − μ·a, so that the
/// pre-activation is x·a + b.
struct ChannelAffine {
  float mean, invstd, gamma, beta;
  float pre(float x) const { return (x - mean) * invstd * gamma + beta; }
  float xhat(float x) const { return (x - mean) * invstd; }
};

class CpuImageOps final : public ImageOps {
 public:
  // ---- layout: NCHW only ------------------------------------------------------------------
  void image_from_nchw(Tensor dst, Tensor src) override { copy_image("image_from_nchw", dst, src); }
  void image_to_nchw(Tensor dst, Tensor src) override { copy_image("image_to_nchw", dst, src); }
  void image_from_pixels(Tensor dst, Tensor pixels, Tensor affine) override {
    const char* op = "image_from_pixels";
    check(pixels.ndim == 4 && pixels.dtype == DType::kU8 && pixels.device == DeviceKind::kCPU,
          "{}: pixels must be a CPU uint8 [N, C, H, W] tensor, got {} {}", op,
          dtype_name(pixels.dtype), pixels.shape_str());
    const int64_t N = pixels.dim(0), C = pixels.dim(1), HW = pixels.dim(2) * pixels.dim(3);
    expect_f32(op, "dst", dst, {N, C, pixels.dim(2), pixels.dim(3)});
    expect_f32(op, "affine", affine, {2, C});
    const uint8_t* p = static_cast<const uint8_t*>(pixels.data);
    const float* a = affine.f32();
    float* y = dst.f32();
#pragma omp parallel for collapse(2) schedule(static) if (worth_parallel(N * C * HW))
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        const float scale = a[c], shift = a[C + c];
        const int64_t base = (n * C + c) * HW;
        for (int64_t i = 0; i < HW; ++i)
          y[base + i] = static_cast<float>(p[base + i]) * scale + shift;
      }
  }

  // ---- convolution ------------------------------------------------------------------------------
  void conv2d_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, const Conv2dShape& s,
                      Activation act) override {
    const char* op = "conv2d_forward";
    check_conv_shape(op, s);
    expect_f32(op, "inp", inp, {s.N, s.C, s.H, s.W});
    expect_f32(op, "weight", weight, {s.K, s.C / s.groups, s.R, s.S});
    expect_f32_or_empty(op, "bias", bias, {s.K});
    expect_f32(op, "out", out, {s.N, s.K, s.P(), s.Q()});
    cpu_image::conv2d_forward(out.f32(), inp.f32(), weight.f32(), ptr_or_null(bias), s, act);
  }
  void conv2d_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, const Conv2dShape& s) override {
    const char* op = "conv2d_backward";
    check_conv_shape(op, s);
    expect_f32(op, "dout", dout, {s.N, s.K, s.P(), s.Q()});
    expect_f32(op, "inp", inp, {s.N, s.C, s.H, s.W});
    expect_f32(op, "weight", weight, {s.K, s.C / s.groups, s.R, s.S});
    expect_f32(op, "dweight", dweight, {s.K, s.C / s.groups, s.R, s.S});
    expect_f32_or_empty(op, "dbias", dbias, {s.K});
    expect_f32_or_empty(op, "dinp", dinp, {s.N, s.C, s.H, s.W});
    cpu_image::conv2d_backward(ptr_or_null(dinp), dweight.f32(), ptr_or_null(dbias), dout.f32(),
                               inp.f32(), weight.f32(), s);
  }

  // ---- batch normalization --------------------------------------------------------------------
  void batchnorm_statistics(Tensor sums, Tensor inp) override {
    const char* op = "batchnorm_statistics";
    expect_nchw(op, "inp", inp);
    const int64_t N = inp.dim(0), C = inp.dim(1), HW = inp.dim(2) * inp.dim(3);
    expect_f64(op, "sums", sums, {2, C});
    const float* x = inp.f32();
    auto* sp = sums.as<double>();
#pragma omp parallel for schedule(static) if (worth_parallel(N * C * HW))
    for (int64_t c = 0; c < C; ++c) {
      double s1 = 0.0, s2 = 0.0;
      for (int64_t n = 0; n < N; ++n) {
        const float* xc = x + (n * C + c) * HW;
        for (int64_t i = 0; i < HW; ++i) {
          s1 += xc[i];
          s2 += static_cast<double>(xc[i]) * xc[i];
        }
      }
      sp[c] = s1;
      sp[C + c] = s2;
    }
  }

  void batchnorm_forward_train(Tensor out, Tensor mean, Tensor invstd, Tensor running_mean,
                               Tensor running_var, Tensor inp, Tensor weight, Tensor bias,
                               Tensor sums, int64_t count, float eps, float momentum,
                               Activation act) override {
    const char* op = "batchnorm_forward_train";
    expect_nchw(op, "inp", inp);
    const int64_t N = inp.dim(0), C = inp.dim(1), HW = inp.dim(2) * inp.dim(3);
    expect_like(op, "out", out, "inp", inp);
    expect_f32(op, "mean", mean, {C});
    expect_f32(op, "invstd", invstd, {C});
    expect_f32_or_empty(op, "running_mean", running_mean, {C});
    expect_f32_or_empty(op, "running_var", running_var, {C});
    expect_f32(op, "weight", weight, {C});
    expect_f32(op, "bias", bias, {C});
    expect_f64(op, "sums", sums, {2, C});
    check(count > 1,
          "{}: count={} values per channel; training batch norm needs more than one (inp {})", op,
          count, inp.shape_str());
    const auto* sp = sums.as<const double>();
    const float *x = inp.f32(), *g = weight.f32(), *b = bias.f32();
    float *mu = mean.f32(), *is = invstd.f32(), *y = out.f32();
    float* rm = ptr_or_null(running_mean);
    float* rv = ptr_or_null(running_var);
    const double n = static_cast<double>(count);
#pragma omp parallel for schedule(static) if (worth_parallel(C * 64))
    for (int64_t c = 0; c < C; ++c) {
      const double m = sp[c] / n;
      const double var = std::max(sp[C + c] / n - m * m, 0.0);
      mu[c] = static_cast<float>(m);
      is[c] = static_cast<float>(1.0 / std::sqrt(var + eps));
      if (rm) rm[c] = static_cast<float>((1.0 - momentum) * rm[c] + momentum * m);
      if (rv) rv[c] = static_cast<float>((1.0 - momentum) * rv[c] + momentum * var * n / (n - 1.0));
    }
#pragma omp parallel for schedule(static) if (worth_parallel(N * C * HW))
    for (int64_t nc = 0; nc < N * C; ++nc) {
      const int64_t c = nc % C;
      const ChannelAffine a{mu[c], is[c], g[c], b[c]};
      const float* xc = x + nc * HW;
      float* yc = y + nc * HW;
      for (int64_t i = 0; i < HW; ++i) yc[i] = act_forward(a.pre(xc[i]), act);
    }
  }

  void batchnorm_forward_eval(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                              Tensor running_mean, Tensor running_var, float eps,
                              Activation act) override {
    const char* op = "batchnorm_forward_eval";
    expect_nchw(op, "inp", inp);
    const int64_t N = inp.dim(0), C = inp.dim(1), HW = inp.dim(2) * inp.dim(3);
    expect_like(op, "out", out, "inp", inp);
    expect_f32(op, "weight", weight, {C});
    expect_f32(op, "bias", bias, {C});
    expect_f32(op, "running_mean", running_mean, {C});
    expect_f32(op, "running_var", running_var, {C});
    const float *x = inp.f32(), *g = weight.f32(), *b = bias.f32(), *rm = running_mean.f32(),
                *rv = running_var.f32();
    float* y = out.f32();
#pragma omp parallel for schedule(static) if (worth_parallel(N * C * HW))
    for (int64_t nc = 0; nc < N * C; ++nc) {
      const int64_t c = nc % C;
      const ChannelAffine a{rm[c], 1.0f / std::sqrt(rv[c] + eps), g[c], b[c]};
      const float* xc = x + nc * HW;
      float* yc = y + nc * HW;
      for (int64_t i = 0; i < HW; ++i) yc[i] = act_forward(a.pre(xc[i]), act);
    }
  }

  void batchnorm_backward_reduce(Tensor dsums, Tensor dweight, Tensor dbias, Tensor dout,
                                 Tensor inp, Tensor weight, Tensor bias, Tensor mean, Tensor invstd,
                                 Activation act) override {
    const char* op = "batchnorm_backward_reduce";
    expect_nchw(op, "inp", inp);
    const int64_t N = inp.dim(0), C = inp.dim(1), HW = inp.dim(2) * inp.dim(3);
    expect_like(op, "dout", dout, "inp", inp);
    expect_f64(op, "dsums", dsums, {2, C});
    expect_f32(op, "dweight", dweight, {C});
    expect_f32(op, "dbias", dbias, {C});
    expect_f32(op, "weight", weight, {C});
    expect_f32(op, "bias", bias, {C});
    expect_f32(op, "mean", mean, {C});
    expect_f32(op, "invstd", invstd, {C});
    const float *x = inp.f32(), *dy = dout.f32(), *g = weight.f32(), *b = bias.f32(),
                *mu = mean.f32(), *is = invstd.f32();
    auto* ds = dsums.as<double>();
    float *dw = dweight.f32(), *db = dbias.f32();
#pragma omp parallel for schedule(static) if (worth_parallel(N * C * HW))
    for (int64_t c = 0; c < C; ++c) {
      const ChannelAffine a{mu[c], is[c], g[c], b[c]};
      double s1 = 0.0, s2 = 0.0;
      for (int64_t n = 0; n < N; ++n) {
        const float* xc = x + (n * C + c) * HW;
        const float* dyc = dy + (n * C + c) * HW;
        for (int64_t i = 0; i < HW; ++i) {
          const float d = dyc[i] * act_derivative(a.pre(xc[i]), act);
          s1 += d;
          s2 += static_cast<double>(d) * a.xhat(xc[i]);
        }
      }
      ds[c] = s1;
      ds[C + c] = s2;
      dw[c] += static_cast<float>(s2);
      db[c] += static_cast<float>(s1);
    }
  }

  void batchnorm_backward_input(Tensor dinp, Tensor dout, Tensor inp, Tensor weight, Tensor bias,
                                Tensor mean, Tensor invstd, Tensor dsums, int64_t count,
                                Activation act) override {
    const char* op = "batchnorm_backward_input";
    expect_nchw(op, "inp", inp);
    const int64_t N = inp.dim(0), C = inp.dim(1), HW = inp.dim(2) * inp.dim(3);
    expect_like(op, "dinp", dinp, "inp", inp);
    expect_like(op, "dout", dout, "inp", inp);
    expect_f32(op, "weight", weight, {C});
    expect_f32(op, "bias", bias, {C});
    expect_f32(op, "mean", mean, {C});
    expect_f32(op, "invstd", invstd, {C});
    expect_f64(op, "dsums", dsums, {2, C});
    check(count > 0, "{}: count={} values per channel (inp {})", op, count, inp.shape_str());
    const float *x = inp.f32(), *dy = dout.f32(), *g = weight.f32(), *b = bias.f32(),
                *mu = mean.f32(), *is = invstd.f32();
    const auto* ds = dsums.as<const double>();
    float* dx = dinp.f32();
    const double inv_count = 1.0 / static_cast<double>(count);
#pragma omp parallel for schedule(static) if (worth_parallel(N * C * HW))
    for (int64_t nc = 0; nc < N * C; ++nc) {
      const int64_t c = nc % C;
      const ChannelAffine a{mu[c], is[c], g[c], b[c]};
      const auto mean_dy = static_cast<float>(ds[c] * inv_count);
      const auto mean_dy_xhat = static_cast<float>(ds[C + c] * inv_count);
      const float scale = g[c] * is[c];
      const float* xc = x + nc * HW;
      const float* dyc = dy + nc * HW;
      float* dxc = dx + nc * HW;
      for (int64_t i = 0; i < HW; ++i) {
        const float d = dyc[i] * act_derivative(a.pre(xc[i]), act);
        dxc[i] = scale * (d - mean_dy - a.xhat(xc[i]) * mean_dy_xhat);
      }
    }
  }

  // ---- activations ------------------------------------------------------------------------------
  void activation_forward(Tensor out, Tensor inp, Activation act) override {
    const char* op = "activation_forward";
    check(!inp.empty(), "{}: inp is empty", op);
    expect_like(op, "inp", inp, "inp", inp);  // fp32 on the CPU
    expect_like(op, "out", out, "inp", inp);
    const float* x = inp.f32();
    float* y = out.f32();
    const int64_t n = inp.numel();
#pragma omp parallel for schedule(static) if (worth_parallel(n))
    for (int64_t i = 0; i < n; ++i) y[i] = act_forward(x[i], act);
  }
  void activation_backward(Tensor dinp, Tensor dout, Tensor inp, Activation act) override {
    const char* op = "activation_backward";
    check(!inp.empty(), "{}: inp is empty", op);
    expect_like(op, "inp", inp, "inp", inp);  // fp32 on the CPU
    expect_like(op, "dout", dout, "inp", inp);
    expect_like(op, "dinp", dinp, "inp", inp);
    const float *x = inp.f32(), *dy = dout.f32();
    float* dx = dinp.f32();
    const int64_t n = inp.numel();
#pragma omp parallel for schedule(static) if (worth_parallel(n))
    for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * act_derivative(x[i], act);
  }

  // ---- pooling ----------------------------------------------------------------------------------
  void maxpool2d_forward(Tensor out, Tensor inp, const Pool2dShape& s) override {
    check_pool("maxpool2d_forward", out, inp, s, "out");
    cpu_image::maxpool2d_forward(out.f32(), inp.f32(), s);
  }
  void maxpool2d_backward(Tensor dinp, Tensor dout, Tensor inp, const Pool2dShape& s) override {
    check_pool("maxpool2d_backward", dout, inp, s, "dout");
    expect_like("maxpool2d_backward", "dinp", dinp, "inp", inp);
    cpu_image::maxpool2d_backward(dinp.f32(), dout.f32(), inp.f32(), s);
  }
  void avgpool2d_forward(Tensor out, Tensor inp, const Pool2dShape& s) override {
    check_pool("avgpool2d_forward", out, inp, s, "out");
    cpu_image::avgpool2d_forward(out.f32(), inp.f32(), s);
  }
  void avgpool2d_backward(Tensor dinp, Tensor dout, const Pool2dShape& s) override {
    check_pool("avgpool2d_backward", dout, dinp, s, "dout", "dinp");
    cpu_image::avgpool2d_backward(dinp.f32(), dout.f32(), s);
  }
  void adaptive_avgpool2d_forward(Tensor out, Tensor inp) override {
    const char* op = "adaptive_avgpool2d_forward";
    expect_nchw(op, "inp", inp);
    expect_nchw(op, "out", out);
    check_adaptive(op, out, "out", inp, "inp");
    cpu_image::adaptive_avgpool2d_forward(out.f32(), inp.f32(), inp.dim(0) * inp.dim(1), inp.dim(2),
                                          inp.dim(3), out.dim(2), out.dim(3));
  }
  void adaptive_avgpool2d_backward(Tensor dinp, Tensor dout) override {
    const char* op = "adaptive_avgpool2d_backward";
    expect_nchw(op, "dinp", dinp);
    expect_nchw(op, "dout", dout);
    check_adaptive(op, dout, "dout", dinp, "dinp");
    cpu_image::adaptive_avgpool2d_backward(dinp.f32(), dout.f32(), dinp.dim(0) * dinp.dim(1),
                                           dinp.dim(2), dinp.dim(3), dout.dim(2), dout.dim(3));
  }

  // ---- channel scaling --------------------------------------------------------------------------
  void channel_scale_forward(Tensor out, Tensor inp, Tensor scale) override {
    const char* op = "channel_scale_forward";
    expect_nchw(op, "inp", inp);
    expect_like(op, "out", out, "inp", inp);
    const int64_t NC = inp.dim(0) * inp.dim(1), HW = inp.dim(2) * inp.dim(3);
    expect_f32(op, "scale", scale, {inp.dim(0), inp.dim(1)});
    const float *x = inp.f32(), *sc = scale.f32();
    float* y = out.f32();
#pragma omp parallel for schedule(static) if (worth_parallel(NC * HW))
    for (int64_t nc = 0; nc < NC; ++nc)
      for (int64_t i = 0; i < HW; ++i) y[nc * HW + i] = x[nc * HW + i] * sc[nc];
  }
  void channel_scale_backward(Tensor dinp, Tensor dscale, Tensor dout, Tensor inp,
                              Tensor scale) override {
    const char* op = "channel_scale_backward";
    expect_nchw(op, "inp", inp);
    expect_like(op, "dout", dout, "inp", inp);
    expect_like(op, "dinp", dinp, "inp", inp);
    const int64_t NC = inp.dim(0) * inp.dim(1), HW = inp.dim(2) * inp.dim(3);
    expect_f32(op, "scale", scale, {inp.dim(0), inp.dim(1)});
    expect_f32(op, "dscale", dscale, {inp.dim(0), inp.dim(1)});
    const float *x = inp.f32(), *sc = scale.f32(), *dy = dout.f32();
    float *dx = dinp.f32(), *ds = dscale.f32();
#pragma omp parallel for schedule(static) if (worth_parallel(NC * HW))
    for (int64_t nc = 0; nc < NC; ++nc) {
      double acc = 0.0;
      for (int64_t i = 0; i < HW; ++i) {
        acc += static_cast<double>(dy[nc * HW + i]) * x[nc * HW + i];
        dx[nc * HW + i] = dy[nc * HW + i] * sc[nc];  // after the read: dinp may alias dout
      }
      ds[nc] = static_cast<float>(acc);
    }
  }

  void sample_scale(Tensor scale, const Dropout& drop) override {
    expect_f32("sample_scale", "scale", scale, {scale.dim(0), scale.dim(1)});
    const int64_t N = scale.dim(0), C = scale.dim(1);
    float* sc = scale.f32();
    for (int64_t n = 0; n < N; ++n)
      std::fill(sc + n * C, sc + (n + 1) * C, drop.factor(static_cast<uint64_t>(n)));
  }

  // ---- LSTM -------------------------------------------------------------------------------------
  void lstm_forward(Tensor out, Tensor saved, Tensor inp, Tensor weight_ih, Tensor weight_hh,
                    Tensor bias_ih, Tensor bias_hh) override {
    const char* op = "lstm_forward";
    const Dims d = lstm_dims(op, inp, weight_ih);
    const int64_t N = d.N, L = d.L, I = d.I, H = d.H, G = 4 * H;
    expect_f32(op, "weight_hh", weight_hh, {G, H});
    expect_f32(op, "bias_ih", bias_ih, {G});
    expect_f32(op, "bias_hh", bias_hh, {G});
    expect_f32(op, "out", out, {N, L, H});
    expect_f32(op, "saved", saved, {L, N, 6 * H});
    const float *bi = bias_ih.f32(), *bh = bias_hh.f32(), *whh = weight_hh.f32();
    float *y = out.f32(), *sv = saved.f32();
    // Input projections of every step at once: gates [N·L, 4H] = inp · W_ihᵀ (row n·L + t).
    std::vector<float> gates(static_cast<size_t>(N * L * G));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(N * L),
                static_cast<int>(G), static_cast<int>(I), 1.0f, inp.f32(), static_cast<int>(I),
                weight_ih.f32(), static_cast<int>(I), 0.0f, gates.data(), static_cast<int>(G));
    for (int64_t t = 0; t < L; ++t) {
      // gates_t += h_{t−1} · W_hhᵀ (h_{t−1} rows of out with stride L·H).
      if (t > 0) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(N),
                    static_cast<int>(G), static_cast<int>(H), 1.0f, y + (t - 1) * H,
                    static_cast<int>(L * H), whh, static_cast<int>(H), 1.0f, gates.data() + t * G,
                    static_cast<int>(L * G));
      }
#pragma omp parallel for schedule(static) if (worth_parallel(N * H * 16))
      for (int64_t n = 0; n < N; ++n) {
        const float* gp = gates.data() + (n * L + t) * G;
        float* s = sv + (t * N + n) * 6 * H;
        const float* c_prev = t > 0 ? sv + ((t - 1) * N + n) * 6 * H + 4 * H : nullptr;
        float* h = y + (n * L + t) * H;
        for (int64_t j = 0; j < H; ++j) {
          const float ig = sigmoid(gp[j] + bi[j] + bh[j]);
          const float fg = sigmoid(gp[H + j] + bi[H + j] + bh[H + j]);
          const float gg = std::tanh(gp[2 * H + j] + bi[2 * H + j] + bh[2 * H + j]);
          const float og = sigmoid(gp[3 * H + j] + bi[3 * H + j] + bh[3 * H + j]);
          const float c = (c_prev ? fg * c_prev[j] : 0.0f) + ig * gg;
          const float tc = std::tanh(c);
          s[j] = ig;
          s[H + j] = fg;
          s[2 * H + j] = gg;
          s[3 * H + j] = og;
          s[4 * H + j] = c;
          s[5 * H + j] = tc;
          h[j] = og * tc;
        }
      }
    }
  }

  void lstm_backward(Tensor dinp, Tensor dweight_ih, Tensor dweight_hh, Tensor dbias_ih,
                     Tensor dbias_hh, Tensor dout, Tensor inp, Tensor out, Tensor saved,
                     Tensor weight_ih, Tensor weight_hh) override {
    const char* op = "lstm_backward";
    const Dims d = lstm_dims(op, inp, weight_ih);
    const int64_t N = d.N, L = d.L, I = d.I, H = d.H, G = 4 * H;
    expect_f32(op, "weight_hh", weight_hh, {G, H});
    expect_f32(op, "dweight_ih", dweight_ih, {G, I});
    expect_f32(op, "dweight_hh", dweight_hh, {G, H});
    expect_f32(op, "dbias_ih", dbias_ih, {G});
    expect_f32(op, "dbias_hh", dbias_hh, {G});
    expect_f32(op, "dout", dout, {N, L, H});
    expect_f32(op, "out", out, {N, L, H});
    expect_f32(op, "saved", saved, {L, N, 6 * H});
    expect_f32_or_empty(op, "dinp", dinp, {N, L, I});
    const float *sv = saved.f32(), *dy = dout.f32(), *y = out.f32();
    // dG [N·L, 4H]: the gradients of the pre-activation gates, rows as the forward's gates.
    std::vector<float> dG(static_cast<size_t>(N * L * G));
    std::vector<float> dh_next(static_cast<size_t>(N * H), 0.0f),
        dc_next(static_cast<size_t>(N * H), 0.0f);
    for (int64_t t = L - 1; t >= 0; --t) {
#pragma omp parallel for schedule(static) if (worth_parallel(N * H * 16))
      for (int64_t n = 0; n < N; ++n) {
        const float* s = sv + (t * N + n) * 6 * H;
        const float* c_prev = t > 0 ? sv + ((t - 1) * N + n) * 6 * H + 4 * H : nullptr;
        const float* dyt = dy + (n * L + t) * H;
        float* g = dG.data() + (n * L + t) * G;
        float* dhn = dh_next.data() + n * H;
        float* dcn = dc_next.data() + n * H;
        for (int64_t j = 0; j < H; ++j) {
          const float ig = s[j], fg = s[H + j], gg = s[2 * H + j], og = s[3 * H + j],
                      tc = s[5 * H + j];
          const float dh = dyt[j] + dhn[j];
          const float dc = dcn[j] + dh * og * (1.0f - tc * tc);
          g[j] = dc * gg * ig * (1.0f - ig);
          g[H + j] = c_prev ? dc * c_prev[j] * fg * (1.0f - fg) : 0.0f;
          g[2 * H + j] = dc * ig * (1.0f - gg * gg);
          g[3 * H + j] = dh * tc * og * (1.0f - og);
          dcn[j] = dc * fg;
        }
      }
      if (t > 0) {
        // dh_{t−1} = dG_t [N, 4H] · W_hh [4H, H]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(N),
                    static_cast<int>(H), static_cast<int>(G), 1.0f, dG.data() + t * G,
                    static_cast<int>(L * G), weight_hh.f32(), static_cast<int>(H), 0.0f,
                    dh_next.data(), static_cast<int>(H));
      }
    }
    // dW_ih += dGᵀ [4H, N·L] · inp [N·L, I]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(G), static_cast<int>(I),
                static_cast<int>(N * L), 1.0f, dG.data(), static_cast<int>(G), inp.f32(),
                static_cast<int>(I), 1.0f, dweight_ih.f32(), static_cast<int>(I));
    // dW_hh += Σ_n dG[n, 1..L)ᵀ · out[n, 0..L−1) (step t's gates saw h_{t−1})
    if (L > 1) {
      for (int64_t n = 0; n < N; ++n) {
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(G),
                    static_cast<int>(H), static_cast<int>(L - 1), 1.0f, dG.data() + (n * L + 1) * G,
                    static_cast<int>(G), y + n * L * H, static_cast<int>(H), 1.0f, dweight_hh.f32(),
                    static_cast<int>(H));
      }
    }
    float *dbi = dbias_ih.f32(), *dbh = dbias_hh.f32();
#pragma omp parallel for schedule(static) if (worth_parallel(G * N * L))
    for (int64_t j = 0; j < G; ++j) {
      double acc = 0.0;
      for (int64_t r = 0; r < N * L; ++r) acc += dG[static_cast<size_t>(r * G + j)];
      dbi[j] += static_cast<float>(acc);
      dbh[j] += static_cast<float>(acc);
    }
    if (!dinp.empty()) {
      // dinp [N·L, I] = dG [N·L, 4H] · W_ih [4H, I]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(N * L),
                  static_cast<int>(I), static_cast<int>(G), 1.0f, dG.data(), static_cast<int>(G),
                  weight_ih.f32(), static_cast<int>(I), 0.0f, dinp.f32(), static_cast<int>(I));
    }
  }

  // ---- layout -----------------------------------------------------------------------------------
  static void copy_image(const char* op, Tensor dst, Tensor src) {
    expect_nchw(op, "src", src);
    expect_like(op, "dst", dst, "src", src);
    std::memcpy(dst.f32(), src.f32(), src.bytes());
  }

  void swap_middle_axes(Tensor out, Tensor inp) override {
    const char* op = "swap_middle_axes";
    expect_nchw(op, "inp", inp);
    const int64_t A = inp.dim(0), B = inp.dim(1), C = inp.dim(2), D = inp.dim(3);
    expect_f32(op, "out", out, {A, C, B, D});
    check(out.data != inp.data, "{}: out must not alias inp", op);
    const float* x = inp.f32();
    float* y = out.f32();
#pragma omp parallel for collapse(2) schedule(static) if (worth_parallel(A * B * C * D))
    for (int64_t a = 0; a < A; ++a)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < C; ++c)
          std::memcpy(y + ((a * C + c) * B + b) * D, x + ((a * B + b) * C + c) * D,
                      static_cast<size_t>(D) * sizeof(float));
  }

  // ---- classification loss --------------------------------------------------------------------
  void classification_loss(Tensor losses, Tensor logits, Tensor targets, float label_smoothing,
                           float grad_scale) override {
    const char* op = "classification_loss";
    check(!logits.empty() && logits.ndim == 2, "{}: logits has shape {}, expected [N, K]", op,
          logits.empty() ? std::string("(empty)") : logits.shape_str());
    const int64_t N = logits.dim(0), K = logits.dim(1);
    expect_f32(op, "logits", logits, {N, K});
    expect_f32(op, "losses", losses, {N});
    check(!targets.empty() && targets.dtype == DType::kI32 && targets.ndim == 1 &&
              targets.dim(0) == N,
          "{}: targets {} ({}) must be int32 of shape [{}] (logits {})", op,
          targets.empty() ? std::string("(empty)") : targets.shape_str(), dtype_name(targets.dtype),
          N, logits.shape_str());
    check(label_smoothing >= 0.0f && label_smoothing <= 1.0f,
          "{}: label_smoothing={} must be in [0, 1]", op, label_smoothing);
    const int32_t* tg = targets.i32();
    for (int64_t n = 0; n < N; ++n) {
      check(tg[n] >= 0 && tg[n] < K, "{}: target {} of row {} is outside [0, {}) (logits {})", op,
            tg[n], n, K, logits.shape_str());
    }
    float *z = logits.f32(), *ls = losses.f32();
    const float eps = label_smoothing, off = eps / static_cast<float>(K);
#pragma omp parallel for schedule(static) if (worth_parallel(N * K * 8))
    for (int64_t n = 0; n < N; ++n) {
      float* row = z + n * K;
      float m = row[0];
      for (int64_t k = 1; k < K; ++k) m = std::max(m, row[k]);
      double sum = 0.0, sum_logits = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        sum += std::exp(static_cast<double>(row[k] - m));
        sum_logits += row[k];
      }
      const double lse = m + std::log(sum);
      // loss = −(1 − ε)·log p_target − (ε/K)·Σ_k log p_k
      const double loss = -(1.0 - eps) * (row[tg[n]] - lse) - off * (sum_logits - K * lse);
      ls[n] = static_cast<float>(loss);
      for (int64_t k = 0; k < K; ++k) {
        const double p = std::exp(row[k] - lse);
        const double target = (k == tg[n] ? 1.0 - eps : 0.0) + off;
        row[k] = static_cast<float>((p - target) * grad_scale);
      }
    }
  }

 private:
  struct Dims {
    int64_t N, L, I, H;
  };
  static Dims lstm_dims(const char* op, const Tensor& inp, const Tensor& weight_ih) {
    check(!inp.empty() && inp.ndim == 3, "{}: inp has shape {}, expected [N, L, I]", op,
          inp.empty() ? std::string("(empty)") : inp.shape_str());
    check(!weight_ih.empty() && weight_ih.ndim == 2 && weight_ih.dim(0) % 4 == 0,
          "{}: weight_ih has shape {}, expected [4H, I]", op,
          weight_ih.empty() ? std::string("(empty)") : weight_ih.shape_str());
    const Dims d{inp.dim(0), inp.dim(1), inp.dim(2), weight_ih.dim(0) / 4};
    expect_f32(op, "inp", inp, {d.N, d.L, d.I});
    expect_f32(op, "weight_ih", weight_ih, {4 * d.H, d.I});
    return d;
  }

  /// y is the pooled tensor (out or dout), x the input-sized one (inp or dinp).
  static void check_pool(const char* op, const Tensor& y, const Tensor& x, const Pool2dShape& s,
                         const char* y_name, const char* x_name = "inp") {
    check_pool_shape(op, s);
    expect_f32(op, x_name, x, {s.N, s.C, s.H, s.W});
    expect_f32(op, y_name, y, {s.N, s.C, s.P(), s.Q()});
  }

  static void check_adaptive(const char* op, const Tensor& y, const char* y_name, const Tensor& x,
                             const char* x_name) {
    check(y.dim(0) == x.dim(0) && y.dim(1) == x.dim(1) && y.dim(2) > 0 && y.dim(3) > 0,
          "{}: {} has shape {}, expected [{}, {}, P, Q] for {} {}", op, y_name, y.shape_str(),
          x.dim(0), x.dim(1), x_name, x.shape_str());
  }
};

}  // namespace

std::unique_ptr<ImageOps> make_cpu_image_ops() { return std::make_unique<CpuImageOps>(); }

}  // namespace shardtrain
