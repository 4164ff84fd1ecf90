#include "model/image/image_blocks.h"

#include <fmt/core.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/philox.h"

namespace shardtrain {
namespace {

ImageShape shape_of(const Tensor& t) {
  ST_ASSERT(t.ndim == 4);
  return {t.shape[0], t.shape[1], t.shape[2], t.shape[3]};
}

Tensor reshaped(const Tensor& t, std::initializer_list<int64_t> dims) {
  return Tensor(t.data, t.dtype, t.device, dims);
}

/// Copies `src` into `dst` (same shape and dtype).
void copy_tensor(Backend& be, const Tensor& dst, const Tensor& src) {
  ST_ASSERT(dst.numel() == src.numel() && dst.dtype == src.dtype);
  if (dst.data != src.data) be.copy(dst.data, src.data, src.bytes());
}

// ---- dropout
// -------------------------------------------------------------------------------------

class DropoutModule final : public Module {
 public:
  DropoutModule(std::string name, float p)
      : Module(std::move(name)), p_(p), site_(dropout_site_of(this->name())) {
    check<ConfigError>(p >= 0.0f && p < 1.0f, "{}: dropout probability {} is not in [0, 1)",
                       this->name(), p);
  }
  ImageShape output_shape(const ImageShape& in) const override { return in; }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    Tensor out = output(ctx.be, shape_of(in));
    const Dropout d = mask(ctx);
    // dropout_backward multiplies by the mask/(1 − p): dropout's forward as well.
    if (d.active())
      ctx.be.dropout_backward(out, in, d);
    else
      copy_tensor(ctx.be, out, in);
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor&, const Tensor& dout, const Tensor& din) override {
    if (din.empty()) return;
    const Dropout d = mask(ctx);
    if (d.active())
      ctx.be.dropout_backward(din, dout, d);
    else
      copy_tensor(ctx.be, din, dout);
  }

 private:
  Dropout mask(const ModuleContext& ctx) const {
    Dropout d;
    d.p = ctx.training ? p_ : 0.0f;
    d.seed = ctx.dropout_seed;
    d.device_seed = ctx.dropout_seed_device;
    d.site = site_;
    return d;
  }
  float p_;
  uint32_t site_;
};

// ---- stochastic depth --------------------------------------------------------------------------

class StochasticDepth final : public Module {
 public:
  StochasticDepth(std::string name, float p)
      : Module(std::move(name)), p_(p), site_(dropout_site_of(this->name())) {
    check<ConfigError>(p >= 0.0f && p < 1.0f,
                       "{}: stochastic depth probability {} is not in [0, 1)", this->name(), p);
  }
  ImageShape output_shape(const ImageShape& in) const override { return in; }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    Tensor out = output(ctx.be, shape_of(in));
    if (!active(ctx)) {
      copy_tensor(ctx.be, out, in);
      return out;
    }
    ctx.ops.channel_scale_forward(out, in, scale(ctx, shape_of(in)));
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override {
    if (din.empty()) return;
    if (!active(ctx)) {
      copy_tensor(ctx.be, din, dout);
      return;
    }
    const ImageShape s = shape_of(in);
    const Tensor sc = scale(ctx, s);  // regenerated: the same draws as forward's
    grow(ctx.be, dscale_, ctx.be.compute_dtype(), s.N * s.C);
    ctx.ops.channel_scale_backward(din, reshaped(dscale_.view(), {s.N, s.C}), dout, in, sc);
  }

 private:
  bool active(const ModuleContext& ctx) const { return ctx.training && p_ > 0.0f; }
  /// [N, C]: 1/(1 − p) for the kept samples, 0 for the dropped, in the compute dtype (drawn on
  /// the device from the micro-batch's seed and this module's site: ImageOps::sample_scale).
  Tensor scale(ModuleContext& ctx, const ImageShape& s) {
    grow(ctx.be, scale_, ctx.be.compute_dtype(), s.N * s.C);
    Tensor out = reshaped(scale_.view(), {s.N, s.C});
    Dropout d;
    d.p = p_;
    d.seed = ctx.dropout_seed;
    d.device_seed = ctx.dropout_seed_device;
    d.site = site_;
    ctx.ops.sample_scale(out, d);
    return out;
  }
  float p_;
  uint32_t site_;
  FlatBuffer scale_, dscale_;
};

// ---- squeeze-and-excitation ---------------------------------------------------------------------

class SqueezeExcitation final : public Module {
 public:
  SqueezeExcitation(std::string name, int64_t channels, int64_t squeeze, Activation act)
      : Module(std::move(name)), squeeze_(this->name()) {
    const std::string& n = this->name();
    squeeze_.add(make_adaptive_avgpool2d(n + ".avgpool", 1, 1));
    squeeze_.add(make_conv2d(
        n + ".fc1", {.in_channels = channels, .out_channels = squeeze, .kernel = 1, .bias = true}));
    squeeze_.add(make_activation(n + ".activation", act));
    squeeze_.add(make_conv2d(
        n + ".fc2", {.in_channels = squeeze, .out_channels = channels, .kernel = 1, .bias = true}));
    squeeze_.add(make_activation(n + ".scale_activation", Activation::kSigmoid));
  }
  void param_specs(std::vector<ParamTensor>& out) const override { squeeze_.param_specs(out); }
  void bind(const ParamSource& src) override { squeeze_.bind(src); }
  ImageShape output_shape(const ImageShape& in) const override {
    squeeze_.output_shape(in);  // checks the channels
    return in;
  }
  void reserve(Backend& be, const ImageShape& in) override { squeeze_.reserve(be, in); }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    const ImageShape s = shape_of(in);
    scale_ = squeeze_.forward(ctx, in);
    Tensor out = output(ctx.be, s);
    ctx.ops.channel_scale_forward(out, in, reshaped(scale_, {s.N, s.C}));
    if (!ctx.for_backward) squeeze_.release_output();  // else backward reads the scale
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override {
    const ImageShape s = shape_of(in);
    const DType dt = ctx.be.compute_dtype();
    grow(ctx.be, dscale_, dt, s.N * s.C);
    // Full-size temporaries for this backward only: ∂L/∂in through the scaling (dout · s; din
    // itself when it is wanted) and through the squeeze path.
    FlatBuffer direct_buf, through_buf;
    if (din.empty()) direct_buf = FlatBuffer::uninitialized(ctx.be, dt, s.numel());
    const Tensor direct = din.empty() ? reshaped(direct_buf.view(), {s.N, s.C, s.H, s.W}) : din;
    ctx.ops.channel_scale_backward(direct, reshaped(dscale_.view(), {s.N, s.C}), dout, in,
                                   reshaped(scale_, {s.N, s.C}));
    squeeze_.release_output();  // the scale was its last reader
    Tensor through;
    if (!din.empty()) {
      through_buf = FlatBuffer::uninitialized(ctx.be, dt, s.numel());
      through = reshaped(through_buf.view(), {s.N, s.C, s.H, s.W});
    }
    squeeze_.backward(ctx, in, reshaped(dscale_.view(), {s.N, s.C, 1, 1}), through);
    if (!din.empty()) ctx.be.add(din, din, through);
  }
  int64_t macs_per_image(const ImageShape& in) const override {
    return squeeze_.macs_per_image(in) + in.C * in.H * in.W;
  }

 private:
  Sequential squeeze_;
  Tensor scale_;  ///< σ(...) [N, C, 1, 1] of the last forward (owned by squeeze_)
  FlatBuffer dscale_;
};

// ---- rows to sequence
// ----------------------------------------------------------------------------

class RowsToSequence final : public Module {
 public:
  explicit RowsToSequence(std::string name) : Module(std::move(name)) {}
  ImageShape output_shape(const ImageShape& in) const override {
    return {in.N, in.H, in.C * in.W, 1};
  }
  /// The image [N, C, H, W] → the sequence [N, H, C·W] in row-major order (whatever the image
  /// layout; the output's shape names it [N, H, C·W, 1], a plain tensor for the LSTM).
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    const ImageShape s = shape_of(in);
    Tensor out = output(ctx.be, output_shape(s));
    ctx.ops.image_rows_as_sequence(reshaped(out, {s.N, s.H, s.C * s.W}), in);
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override {
    const ImageShape s = shape_of(in);
    if (!din.empty()) ctx.ops.sequence_as_image_rows(din, reshaped(dout, {s.N, s.H, s.C * s.W}));
  }

 private:
};

// ---- LSTM
// ------------------------------------------------------------------------------------------

class Lstm final : public Module {
 public:
  Lstm(std::string name, int64_t input, int64_t hidden)
      : Module(std::move(name)), I_(input), H_(hidden) {}
  void param_specs(std::vector<ParamTensor>& out) const override {
    const auto bound = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H_)));
    const auto add = [&](const char* suffix, std::vector<int64_t> shape, bool decay) {
      out.push_back({.name = name() + "." + suffix,
                     .shape = std::move(shape),
                     .weight_decay = decay,
                     .init_uniform = bound});
    };
    add("weight_ih_l0", {4 * H_, I_}, true);
    add("weight_hh_l0", {4 * H_, H_}, true);
    add("bias_ih_l0", {4 * H_}, false);
    add("bias_hh_l0", {4 * H_}, false);
  }
  void bind(const ParamSource& src) override {
    std::tie(wih_, dwih_) = src.param(name() + ".weight_ih_l0");
    std::tie(whh_, dwhh_) = src.param(name() + ".weight_hh_l0");
    std::tie(bih_, dbih_) = src.param(name() + ".bias_ih_l0");
    std::tie(bhh_, dbhh_) = src.param(name() + ".bias_hh_l0");
  }
  ImageShape output_shape(const ImageShape& in) const override {
    check<ConfigError>(in.H * in.W == I_ && in.C >= 1,
                       "{} takes sequences of {} features but receives [{}, {}, {}, {}]", name(),
                       I_, in.N, in.C, in.H, in.W);
    return {in.N, H_, 1, 1};
  }
  void reserve(Backend& be, const ImageShape& in) override {
    grow(be, seq_, be.compute_dtype(), in.N * in.C * H_);
    grow(be, saved_, DType::kF32, in.C * in.N * 6 * H_);
  }
  Tensor forward(ModuleContext& ctx, const Tensor& in) override {
    const ImageShape s = shape_of(in);
    const int64_t N = s.N, L = s.C;
    reserve(ctx.be, s);
    Tensor out = output(ctx.be, output_shape(s));
    ctx.ops.lstm_forward(seq(N, L), saved(N, L), reshaped(in, {N, L, I_}), wih_, whh_, bih_, bhh_);
    // The last step's hidden state of each sample: step-major [L, N, H], then its last block.
    grow(ctx.be, steps_, ctx.be.compute_dtype(), N * L * H_);
    ctx.ops.swap_middle_axes(reshaped(steps_.view(), {1, L, N, H_}),
                             reshaped(seq_.view(), {1, N, L, H_}));
    ctx.be.copy(out.data, steps_.slice((L - 1) * N * H_, N * H_).data, out.bytes());
    return out;
  }
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override {
    const ImageShape s = shape_of(in);
    const int64_t N = s.N, L = s.C;
    grow(ctx.be, dseq_, ctx.be.compute_dtype(), N * L * H_);
    grow(ctx.be, steps_, ctx.be.compute_dtype(), N * L * H_);
    Tensor dseq = reshaped(dseq_.view(), {N, L, H_});
    // Only the last step's output is used: its gradient, step-major, then batch-major.
    Tensor steps = reshaped(steps_.view(), {1, L, N, H_});
    ctx.be.fill_zero(steps);
    ctx.be.copy(steps_.slice((L - 1) * N * H_, N * H_).data, dout.data, dout.bytes());
    ctx.ops.swap_middle_axes(reshaped(dseq_.view(), {1, N, L, H_}), steps);
    ctx.ops.lstm_backward(din.empty() ? Tensor() : reshaped(din, {N, L, I_}), dwih_, dwhh_, dbih_,
                          dbhh_, dseq, reshaped(in, {N, L, I_}), seq(N, L), saved(N, L), wih_,
                          whh_);
  }
  int64_t macs_per_image(const ImageShape& in) const override { return in.C * 4 * H_ * (I_ + H_); }

 private:
  Tensor seq(int64_t N, int64_t L) const { return reshaped(seq_.view(), {N, L, H_}); }
  Tensor saved(int64_t N, int64_t L) const { return reshaped(saved_.view(), {L, N, 6 * H_}); }
  int64_t I_, H_;
  Tensor wih_, dwih_, whh_, dwhh_, bih_, dbih_, bhh_, dbhh_;
  FlatBuffer seq_, saved_, dseq_, steps_;
};

}  // namespace

ModulePtr make_dropout(const std::string& name, float p) {
  return std::make_unique<DropoutModule>(name, p);
}
ModulePtr make_squeeze_excitation(const std::string& name, int64_t channels, int64_t squeeze,
                                  Activation act) {
  return std::make_unique<SqueezeExcitation>(name, channels, squeeze, act);
}
ModulePtr make_stochastic_depth(const std::string& name, float p) {
  return std::make_unique<StochasticDepth>(name, p);
}
ModulePtr make_rows_to_sequence(const std::string& name) {
  return std::make_unique<RowsToSequence>(name);
}
ModulePtr make_lstm(const std::string& name, int64_t input_size, int64_t hidden_size) {
  return std::make_unique<Lstm>(name, input_size, hidden_size);
}

}  // namespace shardtrain
