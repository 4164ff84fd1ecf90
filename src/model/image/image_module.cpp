#include "model/image/image_module.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/hash.h"

namespace shardtrain {
namespace {

ImageShape shape_of(const Tensor& t) {
  ST_ASSERT(t.ndim == 4);
  return {t.shape[0], t.shape[1], t.shape[2], t.shape[3]};
}

Tensor with_shape(Tensor t, const ImageShape& s) {
  return Tensor(t.data, t.dtype, t.device, {s.N, s.C, s.H, s.W});
}

std::string shape_str(const ImageShape& s) {
  return fmt::format("[{}, {}, {}, {}]", s.N, s.C, s.H, s.W);
}

// ---- convolution -----------------------------------------------------------------------------

class Conv2d final : public Module {
 public:
  Conv2d(std::string name, const Conv2dOptions& o) : Module(std::move(name)), o_(o) {
    if (o_.padding < 0) o_.padding = o_.kernel / 2;
    check<ConfigError>(o_.in_channels > 0 && o_.out_channels > 0 && o_.groups > 0 &&
                           o_.in_channels % o_.groups == 0 && o_.out_channels % o_.groups == 0,
                       "{}: channels {} → {} are not divisible into {} groups", this->name(),
                       o_.in_channels, o_.out_channels, o_.groups);
  }

  void param_specs(std::vector<ParamTensor>& out) const override {
    const int64_t K = o_.out_channels, Cg = o_.in_channels / o_.groups, R = o_.kernel;
    const double fan = o_.init == ConvInit::kKaimingFanOut ? static_cast<double>(K * R * R)
                                                           : static_cast<double>(Cg * R * R);
    out.push_back({.name = name() + ".weight",
                   .shape = {K, Cg, R, R},
                   .weight_decay = true,
                   .init_std = static_cast<float>(std::sqrt(2.0 / fan))});
    if (o_.bias) out.push_back({.name = name() + ".bias", .shape = {K}});
  }
  void bind(const ParamSource& src) override {
    std::tie(w_, dw_) = src.param(name() + ".weight");
    if (o_.bias) std::tie(b_, db_) = src.param(name() + ".bias");
  }
  ImageShape output_shape(const ImageShape& in) const override {
    const Conv2dShape s = geometry(in);
    check<ConfigError>(in.C == o_.in_channels,
                       "{} takes {} input channels but receives {} (input {})", name(),
                       o_.in_channels, in.C, shape_str(in));
    check<ConfigError>(
        s.P() >= 1 && s.Q() >= 1 && in.H + 2 * s.pad_h >= s.R && in.W + 2 * s.pad_w >= s.S,
        "{}: an input of {}×{} pixels is too small for its {}×{} kernel (stride "
        "{}); use larger images (--image-size) or a model with less downsampling",
        name(), in.H, in.W, o_.kernel, o_.kernel, o_.stride);
    return {in.N, o_.out_channels, s.P(), s.Q()};
  }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    const ImageShape is = shape_of(in);
    Tensor out = output(ctx.be, output_shape(is));
    ctx.ops.conv2d_forward(out, in, w_, b_, geometry(is));
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override {
    ctx.ops.conv2d_backward(din, dw_, db_, dout, in, w_, geometry(shape_of(in)));
  }
  int64_t macs_per_image(const ImageShape& in) const override {
    const ImageShape o = output_shape(in);
    return o.C * o.H * o.W * (o_.in_channels / o_.groups) * o_.kernel * o_.kernel;
  }

 private:
  Conv2dShape geometry(const ImageShape& in) const {
    return {.N = in.N,
            .C = in.C,
            .H = in.H,
            .W = in.W,
            .K = o_.out_channels,
            .R = o_.kernel,
            .S = o_.kernel,
            .stride_h = o_.stride,
            .stride_w = o_.stride,
            .pad_h = o_.padding,
            .pad_w = o_.padding,
            .groups = o_.groups};
  }

  Conv2dOptions o_;
  Tensor w_, dw_, b_, db_;
};

// ---- batch norm -------------------------------------------------------------------------------

class BatchNorm2d final : public Module {
 public:
  BatchNorm2d(std::string name, int64_t channels, Activation act, float eps, float momentum)
      : Module(std::move(name)), C_(channels), act_(act), eps_(eps), momentum_(momentum) {}

  void param_specs(std::vector<ParamTensor>& out) const override {
    out.push_back({.name = name() + ".weight", .shape = {C_}, .init_value = 1.0f});
    out.push_back({.name = name() + ".bias", .shape = {C_}});
  }
  void buffer_specs(std::vector<BufferSpec>& out) const override {
    out.push_back({name() + ".running_mean", C_, 0.0f});
    out.push_back({name() + ".running_var", C_, 1.0f});
  }
  void bind(const ParamSource& src) override {
    std::tie(w_, dw_) = src.param(name() + ".weight");
    std::tie(b_, db_) = src.param(name() + ".bias");
    running_mean_ = src.buffer(name() + ".running_mean");
    running_var_ = src.buffer(name() + ".running_var");
  }
  ImageShape output_shape(const ImageShape& in) const override {
    check<ConfigError>(in.C == C_, "{} normalizes {} channels but receives {} (input {})", name(),
                       C_, in.C, shape_str(in));
    return in;
  }
  void reserve(Backend& be, const ImageShape& /*in*/) override {
    if (stats_.numel() == 0) stats_ = FlatBuffer(be, DType::kF32, 2 * C_);
    if (sums_.numel() == 0) sums_ = FlatBuffer(be, DType::kF64, 4 * C_);
  }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    const ImageShape s = output_shape(shape_of(in));
    reserve(ctx.be, s);
    Tensor out = output(ctx.be, s);
    if (!ctx.training) {
      ctx.ops.batchnorm_forward_eval(out, in, w_, b_, running_mean_, running_var_, eps_, act_);
      return out;
    }
    Tensor sums = sums_of(0), mean = stat(0), invstd = stat(1);
    ctx.ops.batchnorm_statistics(sums, in);
    if (ctx.sync_sums) ctx.sync_sums(sums);
    ctx.ops.batchnorm_forward_train(out, mean, invstd, running_mean_, running_var_, in, w_, b_,
                                    sums, count(ctx, s), eps_, momentum_, act_);
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override {
    const ImageShape s = shape_of(in);
    Tensor mean = stat(0), invstd = stat(1), dsums = sums_of(1);
    ctx.ops.batchnorm_backward_reduce(dsums, dw_, db_, dout, in, w_, b_, mean, invstd, act_);
    if (din.empty()) return;
    if (ctx.sync_sums) ctx.sync_sums(dsums);
    ctx.ops.batchnorm_backward_input(din, dout, in, w_, b_, mean, invstd, dsums, count(ctx, s),
                                     act_);
  }

 private:
  /// stats_ (fp32) holds mean [C] | invstd [C]; sums_ (fp64) the forward's sums [2,C] (which 0)
  /// | the backward's dsums [2,C] (which 1).
  Tensor stat(int64_t row) const { return stats_.slice(row * C_, C_); }
  Tensor sums_of(int64_t which) const {
    const Tensor t = sums_.slice(which * 2 * C_, 2 * C_);
    return Tensor(t.data, DType::kF64, t.device, {2, C_});
  }
  static int64_t count(const ModuleContext& ctx, const ImageShape& s) {
    return s.N * s.H * s.W * (ctx.sync_sums ? ctx.sync_ranks : 1);
  }

  int64_t C_;
  Activation act_;
  float eps_, momentum_;
  Tensor w_, dw_, b_, db_, running_mean_, running_var_;
  FlatBuffer stats_, sums_;
};

// ---- activations, pooling, linear -----------------------------------------------------------

class ActivationModule final : public Module {
 public:
  ActivationModule(std::string name, Activation act) : Module(std::move(name)), act_(act) {}
  ImageShape output_shape(const ImageShape& in) const override { return in; }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    Tensor out = output(ctx.be, shape_of(in));
    ctx.ops.activation_forward(out, in, act_);
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override {
    if (!din.empty()) ctx.ops.activation_backward(din, dout, in, act_);
  }

 private:
  Activation act_;
};

class MaxPool2d final : public Module {
 public:
  MaxPool2d(std::string name, int64_t k, int64_t stride, int64_t pad)
      : Module(std::move(name)), k_(k), stride_(stride), pad_(pad) {}
  ImageShape output_shape(const ImageShape& in) const override {
    const Pool2dShape s = geometry(in);
    check<ConfigError>(in.H + 2 * pad_ >= k_ && in.W + 2 * pad_ >= k_,
                       "{}: an input of {}×{} pixels is too small for its {}×{} window; use larger "
                       "images (--image-size) or a model with less downsampling",
                       name(), in.H, in.W, k_, k_);
    return {in.N, in.C, s.P(), s.Q()};
  }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    const ImageShape is = shape_of(in);
    Tensor out = output(ctx.be, output_shape(is));
    ctx.ops.maxpool2d_forward(out, in, geometry(is));
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override {
    if (!din.empty()) ctx.ops.maxpool2d_backward(din, dout, in, geometry(shape_of(in)));
  }

 private:
  Pool2dShape geometry(const ImageShape& in) const {
    return {.N = in.N,
            .C = in.C,
            .H = in.H,
            .W = in.W,
            .R = k_,
            .S = k_,
            .stride_h = stride_,
            .stride_w = stride_,
            .pad_h = pad_,
            .pad_w = pad_};
  }
  int64_t k_, stride_, pad_;
};

class AdaptiveAvgPool2d final : public Module {
 public:
  AdaptiveAvgPool2d(std::string name, int64_t h, int64_t w)
      : Module(std::move(name)), h_(h), w_(w) {}
  ImageShape output_shape(const ImageShape& in) const override { return {in.N, in.C, h_, w_}; }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    Tensor out = output(ctx.be, output_shape(shape_of(in)));
    ctx.ops.adaptive_avgpool2d_forward(out, in);
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor&, const Tensor& dout, const Tensor& din) override {
    if (!din.empty()) ctx.ops.adaptive_avgpool2d_backward(din, dout);
  }

 private:
  int64_t h_, w_;
};

class Linear final : public Module {
 public:
  Linear(std::string name, int64_t in, int64_t out, float init_std, float init_uniform)
      : Module(std::move(name)),
        in_(in),
        out_features_(out),
        init_std_(init_std),
        init_uniform_(init_uniform) {}
  void param_specs(std::vector<ParamTensor>& out) const override {
    out.push_back({.name = name() + ".weight",
                   .shape = {out_features_, in_},
                   .weight_decay = true,
                   .init_std = init_std_,
                   .init_uniform = init_uniform_});
    out.push_back({.name = name() + ".bias", .shape = {out_features_}});
  }
  void bind(const ParamSource& src) override {
    std::tie(w_, dw_) = src.param(name() + ".weight");
    std::tie(b_, db_) = src.param(name() + ".bias");
  }
  ImageShape output_shape(const ImageShape& in) const override {
    check<ConfigError>(in.C * in.H * in.W == in_,
                       "{} takes {} features but receives {} (input {}); the input size does not "
                       "match the classifier",
                       name(), in_, in.C * in.H * in.W, shape_str(in));
    return {in.N, out_features_, 1, 1};
  }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    const ImageShape is = shape_of(in);
    Tensor out = output(ctx.be, output_shape(is));
    ctx.be.matmul_forward(flat(out, is.N, out_features_), flat(features(ctx, in), is.N, in_), w_,
                          b_);
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override {
    const int64_t N = in.shape[0];
    const bool relayout = needs_nchw(ctx, in);
    Tensor dflat = din;
    if (relayout && !din.empty()) dflat = activation(ctx.be, dflat_, shape_of(in));
    ctx.be.matmul_backward(din.empty() ? Tensor() : flat(dflat, N, in_), dw_, db_,
                           flat(dout, N, out_features_), flat(features(ctx, in), N, in_), w_);
    if (relayout && !din.empty()) ctx.ops.image_from_nchw(din, dflat);
  }
  int64_t macs_per_image(const ImageShape&) const override { return in_ * out_features_; }

 private:
  static Tensor flat(const Tensor& t, int64_t n, int64_t c) {
    return Tensor(t.data, t.dtype, t.device, {n, c});
  }
  /// A channels-last feature map with H·W > 1 (VGG's 7×7 before its classifier) is flattened in
  /// PyTorch's (C, H, W) order, which the weight's columns follow: through an NCHW copy.
  static bool needs_nchw(const ModuleContext& ctx, const Tensor& in) {
    return ctx.ops.channels_last() && in.shape[2] * in.shape[3] > 1;
  }
  /// The input in (C, H, W) feature order: `in` itself, or an NCHW copy (made again by the
  /// backward: a small tensor, [N, 512, 7, 7] for VGG).
  Tensor features(ModuleContext& ctx, const Tensor& in) {
    if (!needs_nchw(ctx, in)) return in;
    Tensor t = activation(ctx.be, nchw_, shape_of(in));
    ctx.ops.image_to_nchw(t, in);
    return t;
  }
  int64_t in_, out_features_;
  float init_std_, init_uniform_;
  Tensor w_, dw_, b_, db_;
  FlatBuffer nchw_, dflat_;  ///< nchw_, dflat_: channels-last inputs only
};

class Residual final : public Module {
 public:
  Residual(std::string name, ModulePtr body) : Module(std::move(name)), body_(std::move(body)) {}
  void param_specs(std::vector<ParamTensor>& out) const override { body_->param_specs(out); }
  void buffer_specs(std::vector<BufferSpec>& out) const override { body_->buffer_specs(out); }
  void bind(const ParamSource& src) override { body_->bind(src); }
  ImageShape output_shape(const ImageShape& in) const override {
    const ImageShape o = body_->output_shape(in);
    check<ConfigError>(o == in,
                       "{}: a residual connection needs its body to keep the shape {}, "
                       "not change it to {}",
                       name(), shape_str(in), shape_str(o));
    return o;
  }
  void reserve(Backend& be, const ImageShape& in) override { body_->reserve(be, in); }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    Tensor y = body_->forward(ctx, in);
    Tensor out = output(ctx.be, shape_of(in));
    ctx.be.add(out, y, in);
    body_->release_output();  // backward reads only the body's inner activations
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override {
    body_->backward(ctx, in, dout, din);
    if (!din.empty()) ctx.be.add(din, din, dout);
  }
  int64_t macs_per_image(const ImageShape& in) const override { return body_->macs_per_image(in); }

 private:
  ModulePtr body_;
};

}  // namespace

uint32_t dropout_site_of(const std::string& module_name) {
  const uint64_t h = fnv1a64(module_name);
  return static_cast<uint32_t>(h ^ (h >> 32));
}

Tensor Module::activation(Backend& be, FlatBuffer& buf, const ImageShape& shape) {
  if (buf.numel() < shape.numel()) {
    buf = FlatBuffer();
    buf = FlatBuffer::uninitialized(be, be.compute_dtype(), shape.numel());
  }
  return with_shape(buf.view(), shape);
}

// ---- Sequential -------------------------------------------------------------------------------

void Sequential::param_specs(std::vector<ParamTensor>& out) const {
  for (const auto& c : children_) c->param_specs(out);
}
void Sequential::buffer_specs(std::vector<BufferSpec>& out) const {
  for (const auto& c : children_) c->buffer_specs(out);
}
void Sequential::bind(const ParamSource& src) {
  for (auto& c : children_) c->bind(src);
}
ImageShape Sequential::output_shape(const ImageShape& in) const {
  ImageShape s = in;
  for (const auto& c : children_) s = c->output_shape(s);
  return s;
}
void Sequential::reserve(Backend& be, const ImageShape& in) {
  shapes_.assign(1, in);
  for (auto& c : children_) {
    c->reserve(be, shapes_.back());
    shapes_.push_back(c->output_shape(shapes_.back()));
  }
}
Tensor Sequential::forward(ModuleContext& ctx, const Tensor& in) {
  if (shapes_.empty() || !(shapes_.front() == shape_of(in))) reserve(ctx.be, shape_of(in));
  inputs_.resize(children_.size());
  Tensor x = in;
  for (size_t i = 0; i < children_.size(); ++i) {
    inputs_[i] = x;
    x = children_[i]->forward(ctx, x);
    if (!ctx.for_backward && i > 0) children_[i - 1]->release_output();
  }
  return x;
}
void Sequential::backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                          const Tensor& din) {
  ST_ASSERT(inputs_.size() == children_.size() && inputs_.front().data == in.data);
  // ∂L/∂(input of child k) is taken for child k's backward and returned after child k−1's read
  // it; child k−1's output is returned once child k's backward (its last reader) has run.
  FlatBuffer g_buf;  // holds g unless g is dout
  Tensor g = dout;
  for (size_t k = children_.size(); k-- > 0;) {
    FlatBuffer target_buf;
    const Tensor target = k > 0 ? activation(ctx.be, target_buf, shapes_[k]) : din;
    children_[k]->backward(ctx, inputs_[k], g, target);
    if (k > 0) children_[k - 1]->release_output();
    g_buf = std::move(target_buf);
    g = target;
  }
}
int64_t Sequential::macs_per_image(const ImageShape& in) const {
  int64_t total = 0;
  ImageShape s = in;
  for (const auto& c : children_) {
    total += c->macs_per_image(s);
    s = c->output_shape(s);
  }
  return total;
}

// ---- factories ---------------------------------------------------------------------------------

ModulePtr make_conv2d(const std::string& name, const Conv2dOptions& o) {
  return std::make_unique<Conv2d>(name, o);
}
ModulePtr make_batchnorm2d(const std::string& name, int64_t channels, Activation act, float eps,
                           float momentum) {
  return std::make_unique<BatchNorm2d>(name, channels, act, eps, momentum);
}
ModulePtr make_activation(const std::string& name, Activation act) {
  return std::make_unique<ActivationModule>(name, act);
}
ModulePtr make_maxpool2d(const std::string& name, int64_t kernel, int64_t stride, int64_t padding) {
  return std::make_unique<MaxPool2d>(name, kernel, stride, padding);
}
ModulePtr make_adaptive_avgpool2d(const std::string& name, int64_t out_h, int64_t out_w) {
  return std::make_unique<AdaptiveAvgPool2d>(name, out_h, out_w);
}
ModulePtr make_residual(const std::string& name, ModulePtr body) {
  return std::make_unique<Residual>(name, std::move(body));
}
ModulePtr make_linear(const std::string& name, int64_t in_features, int64_t out_features,
                      float init_std, float init_uniform) {
  return std::make_unique<Linear>(name, in_features, out_features, init_std, init_uniform);
}

}  // namespace shardtrain
