// The CUDA image ops (backend/cuda/cuda_image_ops.cu, cuda_conv.cu, cuda_batchnorm.cu,
// cuda_lstm.cu) against the CPU reference (backend/cpu/cpu_image_ops.cpp): every op on random
// inputs, forward and backward, with odd shapes (stride 2 and padding, depthwise and grouped
// convolutions, overlapping pooling windows, adaptive pooling whose cells overlap).
//
// Each op runs with make_cuda_backend(0, kF32) (tight tolerance: only summation order differs;
// cuDNN runs fp32 without TF32) and with make_cuda_backend(0, kBF16) (loose: stored results are
// rounded to bf16), each with images stored NCHW and channels-last (NHWC; set_channels_last). In
// bf16 mode the inputs are rounded to bf16 first and the CPU computes from the same values. Image
// operands keep NCHW values on the host (the CPU reference is NCHW) and go to the GPU through
// image_from_nchw; image results come back through image_to_nchw before the comparison.
// Parameters, statistics and non-image tensors are uploaded as they are. Parameter gradients
// start non-zero to check that they accumulate. Skips when no GPU is visible (cuda_available()).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/half.h"
#include "core/rng.h"
#include "memory/flat_buffer.h"

using namespace shardtrain;

namespace {

/// fp32 -> bf16 -> fp32 with round-to-nearest-even (NaN kept NaN): the reference for convert().
float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

/// One op's operands on both backends: a T2 holds the CPU tensor `h` (fp32 or fp64, NCHW) and the
/// GPU tensor `d`; `in`/`zeros` upload plain tensors (rounded to the GPU dtype first), `img` and
/// `img_zeros` upload images in the GPU ops' layout, `expect_close` compares a result (an image
/// converted back to NCHW first).
class Pair {
 public:
  Pair(Backend& gpu, ImageOps& gpu_ops, ImageOps& cpu_ops)
      : gpu_(gpu), gops(gpu_ops), cops(cpu_ops) {}

  struct T2 {
    Tensor h, d;
    bool image = false;  ///< d is an image in gops' layout (h is NCHW)
  };
  /// Random values uniform in [offset − scale, offset + scale); `fp32` keeps fp32 on the GPU
  /// (batch-norm statistics, running stats, saved LSTM gates), `f64` makes fp64 tensors.
  T2 in(std::initializer_list<int64_t> dims, uint64_t seed, float scale = 1.0f, float offset = 0.0f,
        bool fp32 = false) {
    const DType dt = fp32 ? DType::kF32 : gpu_.compute_dtype();
    return make(dims, random_values(dims, seed, scale, offset, dt), dt, false);
  }
  T2 zeros(std::initializer_list<int64_t> dims, bool fp32 = false) {
    return make(dims, std::vector<float>(numel(dims), 0.0f),
                fp32 ? DType::kF32 : gpu_.compute_dtype(), false);
  }
  /// An image [N, C, H, W] of random values as in(): NCHW on the host, in gops' layout (through
  /// image_from_nchw) on the GPU, in the compute dtype.
  T2 img(std::initializer_list<int64_t> dims, uint64_t seed, float scale = 1.0f,
         float offset = 0.0f) {
    const DType dt = gpu_.compute_dtype();
    return make(dims, random_values(dims, seed, scale, offset, dt), dt, true);
  }
  /// An all-zero image [N, C, H, W] (an op's image output).
  T2 img_zeros(std::initializer_list<int64_t> dims) {
    return make(dims, std::vector<float>(numel(dims), 0.0f), gpu_.compute_dtype(), true);
  }
  T2 f64(std::initializer_list<int64_t> dims) {
    const Tensor shape(nullptr, DType::kF64, DeviceKind::kCPU, dims);
    host_f64_.emplace_back(static_cast<size_t>(shape.numel()), 0.0);
    Tensor h(host_f64_.back().data(), DType::kF64, DeviceKind::kCPU, dims);
    dev_.emplace_back(gpu_, DType::kF64, shape.numel());
    Tensor d(dev_.back().data(), DType::kF64, DeviceKind::kCUDA, dims);
    return {h, d};
  }
  T2 ints(std::initializer_list<int64_t> dims, int32_t bound, uint64_t seed) {
    SplitMix64 g{seed};
    const Tensor shape(nullptr, DType::kI32, DeviceKind::kCPU, dims);
    host_i32_.emplace_back(static_cast<size_t>(shape.numel()));
    for (auto& x : host_i32_.back())
      x = static_cast<int32_t>(g.below(static_cast<uint64_t>(bound)));
    Tensor h(host_i32_.back().data(), DType::kI32, DeviceKind::kCPU, dims);
    dev_.emplace_back(gpu_, DType::kI32, shape.numel());
    Tensor d(dev_.back().data(), DType::kI32, DeviceKind::kCUDA, dims);
    gpu_.copy_from_host(d.data, h.data, d.bytes());
    return {h, d};
  }

  /// The GPU tensor's values as fp64 in memory order, or NCHW order for an `image` (converted
  /// with image_to_nchw first).
  std::vector<double> gpu_values(const Tensor& d, bool image = false) {
    std::vector<double> out(static_cast<size_t>(d.numel()));
    if (d.dtype == DType::kF64) {
      gpu_.copy_to_host(out.data(), d.data, d.bytes());
      return out;
    }
    FlatBuffer nchw;
    Tensor src = d;
    if (image) {
      nchw = FlatBuffer(gpu_, d.dtype, d.numel());
      src.data = nchw.data();
      gops.image_to_nchw(src, d);
    }
    FlatBuffer f(gpu_, DType::kF32, d.numel());
    gpu_.convert(f.view(), Tensor(src.data, src.dtype, src.device, {src.numel()}));
    std::vector<float> v(out.size());
    gpu_.copy_to_host(v.data(), f.data(), v.size() * 4);
    std::copy(v.begin(), v.end(), out.begin());
    return out;
  }
  static std::vector<double> cpu_values(const Tensor& h) {
    std::vector<double> out(static_cast<size_t>(h.numel()));
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = h.dtype == DType::kF64 ? h.as<double>()[i] : h.as<float>()[i];
    return out;
  }

  /// max |gpu − cpu| ≤ tol · max(max |cpu|, 1e-3).
  void expect_close(const T2& t, double tol, const std::string& what) {
    const std::vector<double> g = gpu_values(t.d, t.image), c = cpu_values(t.h);
    double ref = 1e-3, err = 0.0;
    size_t worst = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      ref = std::max(ref, std::abs(c[i]));
      const double e = std::isnan(g[i]) ? INFINITY : std::abs(g[i] - c[i]);
      if (e > err) err = e, worst = i;
    }
    EXPECT_LE(err, tol * ref) << what << ": element " << worst << " gpu " << g[worst] << " cpu "
                              << c[worst] << " (scale " << ref << ")";
  }

 private:
  static size_t numel(std::initializer_list<int64_t> dims) {
    return static_cast<size_t>(Tensor(nullptr, DType::kF32, DeviceKind::kCPU, dims).numel());
  }
  /// Uniform in [offset − scale, offset + scale), rounded to bf16 when `dt` is.
  static std::vector<float> random_values(std::initializer_list<int64_t> dims, uint64_t seed,
                                          float scale, float offset, DType dt) {
    SplitMix64 g{seed};
    std::vector<float> v(numel(dims));
    for (auto& x : v) {
      x = offset + static_cast<float>((g.uniform() * 2.0 - 1.0) * scale);
      if (dt == DType::kBF16) x = round_bf16(x);
    }
    return v;
  }
  /// Host tensor of `v` and a GPU copy in `dt`; an `image` is converted to gops' layout.
  T2 make(std::initializer_list<int64_t> dims, const std::vector<float>& v, DType dt, bool image) {
    host_f32_.push_back(v);
    Tensor h(host_f32_.back().data(), DType::kF32, DeviceKind::kCPU, dims);
    FlatBuffer staging(gpu_, DType::kF32, h.numel());
    gpu_.copy_from_host(staging.data(), v.data(), v.size() * 4);
    dev_.emplace_back(gpu_, dt, h.numel());
    Tensor d(dev_.back().data(), dt, DeviceKind::kCUDA, dims);
    if (!image) {
      gpu_.convert(Tensor(d.data, dt, d.device, {h.numel()}), staging.view());
      return {h, d, false};
    }
    FlatBuffer nchw(gpu_, dt, h.numel());
    gpu_.convert(Tensor(nchw.data(), dt, d.device, {h.numel()}), staging.view());
    Tensor src = d;
    src.data = nchw.data();
    gops.image_from_nchw(d, src);
    return {h, d, true};
  }

  Backend& gpu_;
  std::deque<std::vector<float>> host_f32_;
  std::deque<std::vector<double>> host_f64_;
  std::deque<std::vector<int32_t>> host_i32_;
  std::deque<FlatBuffer> dev_;

 public:
  ImageOps& gops;
  ImageOps& cops;
};

/// The GPU backend's compute dtype and image layout under test.
struct Mode {
  DType dtype;
  bool channels_last;
};
std::string mode_name(const Mode& m) {
  return std::string(m.dtype == DType::kF32 ? "F32" : "BF16") +
         (m.channels_last ? "_NHWC" : "_NCHW");
}
void PrintTo(const Mode& m, std::ostream* os) { *os << mode_name(m); }

class CudaImageOps : public ::testing::TestWithParam<Mode> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
    gpu_ = make_cuda_backend(0, dtype());
    gpu_->image_ops()->set_channels_last(GetParam().channels_last);
    cpu_ = make_cpu_backend();  // the reference: NCHW
    pair_ = std::make_unique<Pair>(*gpu_, *gpu_->image_ops(), *cpu_->image_ops());
  }
  DType dtype() const { return GetParam().dtype; }
  /// Tolerance relative to the largest reference value.
  double tol() const { return dtype() == DType::kF32 ? 2e-5 : 2e-2; }

  std::unique_ptr<Backend> gpu_, cpu_;
  std::unique_ptr<Pair> pair_;
};

// conv2d forward (with bias and fused activation) and backward (dinp, accumulated dweight and
// dbias) over strided, padded, depthwise, grouped, 1×1 (GEMM path) and 3-channel geometries.
TEST_P(CudaImageOps, Convolution) {
  Pair& p = *pair_;
  struct Geo {
    Conv2dShape s;
    bool bias;
    Activation act;
  };
  const Geo cases[] = {
      {{.N = 3,
        .C = 5,
        .H = 9,
        .W = 7,
        .K = 6,
        .R = 3,
        .S = 3,
        .stride_h = 2,
        .stride_w = 2,
        .pad_h = 1,
        .pad_w = 1},
       true,
       Activation::kRelu6},
      {{.N = 2,
        .C = 8,
        .H = 6,
        .W = 6,
        .K = 8,
        .R = 3,
        .S = 3,
        .pad_h = 1,
        .pad_w = 1,
        .groups = 8},
       false,
       Activation::kNone},
      {{.N = 2, .C = 6, .H = 5, .W = 4, .K = 4, .R = 1, .S = 1, .groups = 2},
       true,
       Activation::kSilu},
      // depthwise 5×5 stride 2 (EfficientNet's), with a bias: the direct kernels
      {{.N = 3,
        .C = 7,
        .H = 11,
        .W = 9,
        .K = 7,
        .R = 5,
        .S = 5,
        .stride_h = 2,
        .stride_w = 2,
        .pad_h = 2,
        .pad_w = 2,
        .groups = 7},
       true,
       Activation::kRelu},
      // ... and with 16 channels: the channels-last 8-channel vector kernels (stride 2 input
      // gradient included), bias and activation epilogue too
      {{.N = 2,
        .C = 16,
        .H = 9,
        .W = 7,
        .K = 16,
        .R = 5,
        .S = 5,
        .stride_h = 2,
        .stride_w = 2,
        .pad_h = 2,
        .pad_w = 2,
        .groups = 16},
       true,
       Activation::kSilu},
      // 1×1, groups 1, stride 1, no padding, C and K multiples of 8: the GEMM path
      {{.N = 2, .C = 16, .H = 5, .W = 3, .K = 24, .R = 1, .S = 1}, true, Activation::kRelu},
      // ... on 1×1 images (H = W = 1: both layouts the same), without a bias
      {{.N = 4, .C = 8, .H = 1, .W = 1, .K = 16, .R = 1, .S = 1}, false, Activation::kNone},
      // ... with more input than output channels (a projection)
      {{.N = 3, .C = 24, .H = 4, .W = 4, .K = 8, .R = 1, .S = 1}, false, Activation::kSilu},
      // a gray first layer (Fashion-MNIST's), 3×3 stride 1
      {{.N = 3, .C = 1, .H = 8, .W = 7, .K = 16, .R = 3, .S = 3, .pad_h = 1, .pad_w = 1},
       false,
       Activation::kNone},
      // a first layer: 3 input channels (RGB), 3×3 stride 2
      {{.N = 2,
        .C = 3,
        .H = 8,
        .W = 8,
        .K = 16,
        .R = 3,
        .S = 3,
        .stride_h = 2,
        .stride_w = 2,
        .pad_h = 1,
        .pad_w = 1},
       false,
       Activation::kNone},
  };
  uint64_t seed = 100;
  for (const Geo& c : cases) {
    const Conv2dShape& s = c.s;
    const std::string what = "conv C=" + std::to_string(s.C) + " H=" + std::to_string(s.H) +
                             " K=" + std::to_string(s.K) + " R=" + std::to_string(s.R) +
                             " groups=" + std::to_string(s.groups);
    auto x = p.img({s.N, s.C, s.H, s.W}, ++seed);
    auto w = p.in({s.K, s.C / s.groups, s.R, s.S}, ++seed, 0.5f);
    auto b = c.bias ? p.in({s.K}, ++seed) : Pair::T2{};
    auto y = p.img_zeros({s.N, s.K, s.P(), s.Q()});
    p.cops.conv2d_forward(y.h, x.h, w.h, b.h, s, c.act);
    p.gops.conv2d_forward(y.d, x.d, w.d, b.d, s, c.act);
    p.expect_close(y, tol(), what + " forward");

    auto dy = p.img({s.N, s.K, s.P(), s.Q()}, ++seed);
    auto dx = p.img_zeros({s.N, s.C, s.H, s.W});
    auto dw = p.in({s.K, s.C / s.groups, s.R, s.S}, ++seed);
    auto db = c.bias ? p.in({s.K}, ++seed) : Pair::T2{};
    p.cops.conv2d_backward(dx.h, dw.h, db.h, dy.h, x.h, w.h, s);
    p.gops.conv2d_backward(dx.d, dw.d, db.d, dy.d, x.d, w.d, s);
    p.expect_close(dx, tol(), what + " dinp");
    p.expect_close(dw, tol(), what + " dweight (accumulated)");
    if (c.bias) p.expect_close(db, tol(), what + " dbias (accumulated)");

    // As a first layer (no input gradient): 1- and 3-channel inputs take im2col + GEMM for the
    // weight gradient in channels-last bf16.
    auto dw0 = p.in({s.K, s.C / s.groups, s.R, s.S}, ++seed);
    p.cops.conv2d_backward({}, dw0.h, {}, dy.h, x.h, w.h, s);
    p.gops.conv2d_backward({}, dw0.d, {}, dy.d, x.d, w.d, s);
    p.expect_close(dw0, tol(), what + " dweight without dinp (accumulated)");
  }
}

// Batch norm's statistics, training and evaluation forward, and both backward halves, with each
// fused activation.
TEST_P(CudaImageOps, BatchNorm) {
  Pair& p = *pair_;
  const int64_t N = 4, H = 5, W = 3;
  // C = 16: the channels-last kernels' 8-channel vector path; C = 6 their scalar path.
  for (const int64_t C : {int64_t{6}, int64_t{16}})
    for (Activation act : {Activation::kNone, Activation::kRelu6, Activation::kSilu}) {
      const std::string what =
          std::string("batchnorm C=") + std::to_string(C) + " " + activation_name(act);
      // A mean large against the spread: the case fp64 sums exist for.
      auto x = p.img({N, C, H, W}, 1, 1.0f, 3.0f);
      auto gamma = p.in({C}, 2, 0.5f, 1.0f), beta = p.in({C}, 3, 0.5f);
      auto sums = p.f64({2, C});
      p.cops.batchnorm_statistics(sums.h, x.h);
      p.gops.batchnorm_statistics(sums.d, x.d);
      p.expect_close(sums, 1e-6, what + " sums");

      auto y = p.img_zeros({N, C, H, W});
      auto mean = p.zeros({C}, true), invstd = p.zeros({C}, true);
      auto rm = p.in({C}, 4, 0.1f, 0.0f, true), rv = p.in({C}, 5, 0.1f, 1.0f, true);
      const int64_t count = N * H * W;
      p.cops.batchnorm_forward_train(y.h, mean.h, invstd.h, rm.h, rv.h, x.h, gamma.h, beta.h,
                                     sums.h, count, 1e-5f, 0.1f, act);
      p.gops.batchnorm_forward_train(y.d, mean.d, invstd.d, rm.d, rv.d, x.d, gamma.d, beta.d,
                                     sums.d, count, 1e-5f, 0.1f, act);
      p.expect_close(mean, 1e-6, what + " mean");
      p.expect_close(invstd, 1e-5, what + " invstd");
      p.expect_close(rm, 1e-6, what + " running_mean");
      p.expect_close(rv, 1e-5, what + " running_var");
      p.expect_close(y, tol(), what + " train forward");

      auto ye = p.img_zeros({N, C, H, W});
      p.cops.batchnorm_forward_eval(ye.h, x.h, gamma.h, beta.h, rm.h, rv.h, 1e-5f, act);
      p.gops.batchnorm_forward_eval(ye.d, x.d, gamma.d, beta.d, rm.d, rv.d, 1e-5f, act);
      p.expect_close(ye, tol(), what + " eval forward");

      auto dy = p.img({N, C, H, W}, 6);
      auto dsums = p.f64({2, C});
      auto dg = p.in({C}, 7), dbt = p.in({C}, 8);
      p.cops.batchnorm_backward_reduce(dsums.h, dg.h, dbt.h, dy.h, x.h, gamma.h, beta.h, mean.h,
                                       invstd.h, act);
      p.gops.batchnorm_backward_reduce(dsums.d, dg.d, dbt.d, dy.d, x.d, gamma.d, beta.d, mean.d,
                                       invstd.d, act);
      p.expect_close(dsums, dtype() == DType::kF32 ? 1e-5 : 1e-2, what + " dsums");
      p.expect_close(dg, tol(), what + " dweight");
      p.expect_close(dbt, tol(), what + " dbias");
      auto dx = p.img_zeros({N, C, H, W});
      p.cops.batchnorm_backward_input(dx.h, dy.h, x.h, gamma.h, beta.h, mean.h, invstd.h, dsums.h,
                                      count, act);
      p.gops.batchnorm_backward_input(dx.d, dy.d, x.d, gamma.d, beta.d, mean.d, invstd.d, dsums.d,
                                      count, act);
      p.expect_close(dx, dtype() == DType::kF32 ? 1e-4 : 3e-2, what + " dinp");
    }
}

// Element-wise activations forward and backward on images, then channel_scale (image · [N, C]
// scale) forward and backward.
TEST_P(CudaImageOps, ActivationsAndChannelScale) {
  Pair& p = *pair_;
  for (Activation act :
       {Activation::kRelu, Activation::kRelu6, Activation::kSilu, Activation::kSigmoid}) {
    auto x = p.img({2, 3, 4, 5}, 11, 8.0f);
    auto y = p.img_zeros({2, 3, 4, 5});
    p.cops.activation_forward(y.h, x.h, act);
    p.gops.activation_forward(y.d, x.d, act);
    p.expect_close(y, tol(), std::string(activation_name(act)) + " forward");
    auto dy = p.img({2, 3, 4, 5}, 12), dx = p.img_zeros({2, 3, 4, 5});
    p.cops.activation_backward(dx.h, dy.h, x.h, act);
    p.gops.activation_backward(dx.d, dy.d, x.d, act);
    p.expect_close(dx, tol(), std::string(activation_name(act)) + " backward");
  }
  auto x = p.img({3, 4, 6, 5}, 13), sc = p.in({3, 4}, 14);  // scale [N, C]: not an image
  auto y = p.img_zeros({3, 4, 6, 5});
  p.cops.channel_scale_forward(y.h, x.h, sc.h);
  p.gops.channel_scale_forward(y.d, x.d, sc.d);
  p.expect_close(y, tol(), "channel_scale forward");
  auto dy = p.img({3, 4, 6, 5}, 15), dx = p.img_zeros({3, 4, 6, 5}), ds = p.zeros({3, 4});
  p.cops.channel_scale_backward(dx.h, ds.h, dy.h, x.h, sc.h);
  p.gops.channel_scale_backward(dx.d, ds.d, dy.d, x.d, sc.d);
  p.expect_close(dx, tol(), "channel_scale dinp");
  p.expect_close(ds, tol(), "channel_scale dscale");
}

// Max and average pooling with overlapping padded windows, and adaptive average pooling, forward
// and backward.
TEST_P(CudaImageOps, Pooling) {
  Pair& p = *pair_;
  // Overlapping padded 3×3/2 windows (the gather backward), and non-overlapping 2×2/2 ones (the
  // tiled backward; 7×5 leaves a row and a column outside every window); C = 8 takes the
  // channels-last kernels' 8-channel vector path.
  const Pool2dShape shapes[] = {
      {.N = 2,
       .C = 3,
       .H = 9,
       .W = 8,
       .R = 3,
       .S = 3,
       .stride_h = 2,
       .stride_w = 2,
       .pad_h = 1,
       .pad_w = 1},
      {.N = 2,
       .C = 8,
       .H = 9,
       .W = 8,
       .R = 3,
       .S = 3,
       .stride_h = 2,
       .stride_w = 2,
       .pad_h = 1,
       .pad_w = 1},
      {.N = 2, .C = 8, .H = 8, .W = 6, .R = 2, .S = 2, .stride_h = 2, .stride_w = 2},
      {.N = 2, .C = 3, .H = 7, .W = 5, .R = 2, .S = 2, .stride_h = 2, .stride_w = 2},
  };
  for (const Pool2dShape& s : shapes) {
    const std::string what = "C=" + std::to_string(s.C) + " window " + std::to_string(s.R) +
                             " stride " + std::to_string(s.stride_h) + " on " +
                             std::to_string(s.H) + "x" + std::to_string(s.W);
    auto x = p.img({s.N, s.C, s.H, s.W}, 21);
    auto y = p.img_zeros({s.N, s.C, s.P(), s.Q()});
    auto dy = p.img({s.N, s.C, s.P(), s.Q()}, 22);
    p.cops.maxpool2d_forward(y.h, x.h, s);
    p.gops.maxpool2d_forward(y.d, x.d, s);
    p.expect_close(y, tol(), "maxpool forward " + what);
    auto dx = p.img_zeros({s.N, s.C, s.H, s.W});
    p.cops.maxpool2d_backward(dx.h, dy.h, x.h, s);
    p.gops.maxpool2d_backward(dx.d, dy.d, x.d, s);
    p.expect_close(dx, tol(), "maxpool backward " + what);

    auto ya = p.img_zeros({s.N, s.C, s.P(), s.Q()});
    p.cops.avgpool2d_forward(ya.h, x.h, s);
    p.gops.avgpool2d_forward(ya.d, x.d, s);
    p.expect_close(ya, tol(), "avgpool forward " + what);
    auto dxa = p.img_zeros({s.N, s.C, s.H, s.W});
    p.cops.avgpool2d_backward(dxa.h, dy.h, s);
    p.gops.avgpool2d_backward(dxa.d, dy.d, s);
    p.expect_close(dxa, tol(), "avgpool backward " + what);
  }

  // 7×5 → 3×2: PyTorch's adaptive cells overlap when the sizes do not divide.
  auto xa = p.img({2, 3, 7, 5}, 23), out = p.img_zeros({2, 3, 3, 2});
  p.cops.adaptive_avgpool2d_forward(out.h, xa.h);
  p.gops.adaptive_avgpool2d_forward(out.d, xa.d);
  p.expect_close(out, tol(), "adaptive avgpool forward");
  auto dout = p.img({2, 3, 3, 2}, 24), dxd = p.img_zeros({2, 3, 7, 5});
  p.cops.adaptive_avgpool2d_backward(dxd.h, dout.h);
  p.gops.adaptive_avgpool2d_backward(dxd.d, dout.d);
  p.expect_close(dxd, tol(), "adaptive avgpool backward");
}

// swap_middle_axes on plain row-major tensors (not images: the same in both layouts).
TEST_P(CudaImageOps, SwapMiddleAxes) {
  Pair& p = *pair_;
  auto x = p.in({2, 3, 5, 4}, 51), y = p.zeros({2, 5, 3, 4});
  p.cops.swap_middle_axes(y.h, x.h);
  p.gops.swap_middle_axes(y.d, x.d);
  p.expect_close(y, 0.0, "swap_middle_axes (exact)");
}

// image_rows_as_sequence: an image (in the GPU ops' layout) to the row-major sequence
// [N, H, C·W]; sequence_as_image_rows: back to an image. Both exact, on an odd shape.
TEST_P(CudaImageOps, ImageRowsAsSequence) {
  Pair& p = *pair_;
  const int64_t N = 2, C = 3, H = 4, W = 5;
  auto x = p.img({N, C, H, W}, 52), y = p.zeros({N, H, C * W});
  p.cops.image_rows_as_sequence(y.h, x.h);
  p.gops.image_rows_as_sequence(y.d, x.d);
  p.expect_close(y, 0.0, "image_rows_as_sequence (exact)");
  auto dy = p.in({N, H, C * W}, 53), dx = p.img_zeros({N, C, H, W});
  p.cops.sequence_as_image_rows(dx.h, dy.h);
  p.gops.sequence_as_image_rows(dx.d, dy.d);
  p.expect_close(dx, 0.0, "sequence_as_image_rows (exact)");
}

// The layout itself: channels_last() reports the mode set, image_from_nchw stores element
// (n, c, h, w) at the NCHW or NHWC offset, and image_to_nchw inverts it (exact).
TEST_P(CudaImageOps, ImageLayout) {
  Pair& p = *pair_;
  const bool nhwc = GetParam().channels_last;
  EXPECT_EQ(p.gops.channels_last(), nhwc);
  const int64_t N = 2, C = 3, H = 4, W = 5;
  auto x = p.img({N, C, H, W}, 54);
  const std::vector<double> raw = p.gpu_values(x.d), ref = Pair::cpu_values(x.h);
  size_t wrong = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t w = 0; w < W; ++w) {
          const int64_t at = nhwc ? ((n * H + h) * W + w) * C + c : ((n * C + c) * H + h) * W + w;
          if (raw[static_cast<size_t>(at)] !=
              ref[static_cast<size_t>(((n * C + c) * H + h) * W + w)])
            ++wrong;
        }
  EXPECT_EQ(wrong, 0u) << "image_from_nchw: elements not at their " << (nhwc ? "NHWC" : "NCHW")
                       << " offsets";
  p.expect_close(x, 0.0, "image_to_nchw round trip (exact)");
}

// image_from_pixels: uint8 NCHW pixels to the normalized input in the GPU ops' layout and
// dtype, against the CPU op (fp32: the same fp32 value up to a fused multiply-add's rounding;
// bf16: that value rounded once), on an odd shape.
TEST_P(CudaImageOps, ImageFromPixels) {
  Pair& p = *pair_;
  const int64_t N = 3, C = 3, H = 5, W = 7;
  std::vector<uint8_t> px(static_cast<size_t>(N * C * H * W));
  SplitMix64 g{55};
  for (uint8_t& v : px) v = static_cast<uint8_t>(g.below(256));
  std::vector<float> affine = {1 / (255 * 0.2f), 1 / (255 * 0.3f), 1 / (255 * 0.4f),
                               -0.4f / 0.2f,     -0.5f / 0.3f,     -0.6f / 0.4f};
  FlatBuffer dpx(*gpu_, DType::kU8, N * C * H * W), daff(*gpu_, DType::kF32, 2 * C);
  gpu_->copy_from_host(dpx.data(), px.data(), px.size());
  gpu_->copy_from_host(daff.data(), affine.data(), affine.size() * sizeof(float));
  auto y = p.img_zeros({N, C, H, W});
  p.cops.image_from_pixels(y.h, Tensor(px.data(), DType::kU8, DeviceKind::kCPU, {N, C, H, W}),
                           Tensor(affine.data(), DType::kF32, DeviceKind::kCPU, {2, C}));
  p.gops.image_from_pixels(y.d, Tensor(dpx.data(), DType::kU8, DeviceKind::kCUDA, {N, C, H, W}),
                           Tensor(daff.data(), DType::kF32, DeviceKind::kCUDA, {2, C}));
  p.expect_close(y, dtype() == DType::kF32 ? 1e-6 : 4e-3, "image_from_pixels");
}

// The LSTM forward (outputs and saved gates) and backpropagation through time (not images).
TEST_P(CudaImageOps, Lstm) {
  Pair& p = *pair_;
  const int64_t N = 3, L = 5, I = 7, H = 8;
  auto x = p.in({N, L, I}, 31);
  auto wih = p.in({4 * H, I}, 32, 0.4f), whh = p.in({4 * H, H}, 33, 0.4f);
  auto bih = p.in({4 * H}, 34, 0.3f), bhh = p.in({4 * H}, 35, 0.3f);
  auto out = p.zeros({N, L, H}), saved = p.zeros({L, N, 6 * H}, true);
  p.cops.lstm_forward(out.h, saved.h, x.h, wih.h, whh.h, bih.h, bhh.h);
  p.gops.lstm_forward(out.d, saved.d, x.d, wih.d, whh.d, bih.d, bhh.d);
  p.expect_close(out, tol(), "lstm out");
  p.expect_close(saved, tol(), "lstm saved gates");

  auto dy = p.in({N, L, H}, 36), dx = p.zeros({N, L, I});
  auto dwih = p.in({4 * H, I}, 37), dwhh = p.in({4 * H, H}, 38);
  auto dbih = p.in({4 * H}, 39), dbhh = p.in({4 * H}, 40);
  p.cops.lstm_backward(dx.h, dwih.h, dwhh.h, dbih.h, dbhh.h, dy.h, x.h, out.h, saved.h, wih.h,
                       whh.h);
  p.gops.lstm_backward(dx.d, dwih.d, dwhh.d, dbih.d, dbhh.d, dy.d, x.d, out.d, saved.d, wih.d,
                       whh.d);
  const double t = dtype() == DType::kF32 ? 1e-4 : 4e-2;  // BPTT compounds the rounding
  p.expect_close(dx, t, "lstm dinp");
  p.expect_close(dwih, t, "lstm dweight_ih");
  p.expect_close(dwhh, t, "lstm dweight_hh");
  p.expect_close(dbih, t, "lstm dbias_ih");
  p.expect_close(dbhh, t, "lstm dbias_hh");
}

// Softmax cross-entropy with label smoothing: per-row losses and the scaled logit gradient.
TEST_P(CudaImageOps, ClassificationLoss) {
  Pair& p = *pair_;
  for (int64_t K : {10, 1000}) {
    const int64_t N = 5;
    auto z = p.in({N, K}, 41, 4.0f);
    auto tg = p.ints({N}, static_cast<int32_t>(K), 42);
    auto loss = p.zeros({N}, true);
    p.cops.classification_loss(loss.h, z.h, tg.h, 0.1f, 0.5f);
    p.gops.classification_loss(loss.d, z.d, tg.d, 0.1f, 0.5f);
    p.expect_close(loss, dtype() == DType::kF32 ? 1e-5 : 1e-2, "loss K=" + std::to_string(K));
    p.expect_close(z, tol(), "loss gradient K=" + std::to_string(K));
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaImageOps,
                         ::testing::Values(Mode{DType::kF32, false}, Mode{DType::kF32, true},
                                           Mode{DType::kBF16, false}, Mode{DType::kBF16, true}),
                         [](const ::testing::TestParamInfo<Mode>& i) {
                           return mode_name(i.param);
                         });

}  // namespace
