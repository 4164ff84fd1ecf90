// Image-model blocks (model/image/image_blocks.h) through the Module API on the CPU backend:
// gradients of squeeze-and-excitation, the LSTM over a feature map's rows and an MBConv block
// against central differences; dropout's and stochastic depth's masks; an ensemble's logits
// against its members'.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/hash.h"
#include "core/rng.h"
#include "gradcheck_support.h"
#include "image_fixture_weights.h"
#include "model/image/image_blocks.h"
#include "model/image/image_zoo.h"
#include "test_support.h"

namespace shardtrain {
namespace {

using test_support::random_uniform;
std::vector<float> randu(size_t n, uint64_t seed, float scale = 1.0f) {
  return random_uniform(n, seed, scale);
}

Tensor tensor_of(std::vector<float>& v, const std::vector<int64_t>& shape) {
  Tensor t(v.data(), DType::kF32, DeviceKind::kCPU, {static_cast<int64_t>(v.size())});
  t.ndim = static_cast<int>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  return t;
}

/// A module bound to host parameters (the CPU backend's memory is the host's), its input and
/// the weights w of the objective Σ w·out.
class Rig {
 public:
  Rig(ModulePtr m, ImageShape in, uint64_t seed = 7)
      : be_(make_cpu_backend()), m_(std::move(m)), in_(in) {
    m_->param_specs(specs_);
    m_->buffer_specs(bspecs_);
    for (const ParamTensor& t : specs_) {
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      params_.push_back(randu(static_cast<size_t>(n), fnv1a64(t.name), 0.5f));
      grads_.emplace_back(static_cast<size_t>(n), 0.0f);
    }
    for (const BufferSpec& b : bspecs_) buffers_.emplace_back(b.numel, b.init_value);
    ParamSource src;
    src.param = [this](const std::string& name) {
      for (size_t i = 0; i < specs_.size(); ++i)
        if (specs_[i].name == name)
          return std::pair{tensor_of(params_[i], specs_[i].shape),
                           tensor_of(grads_[i], specs_[i].shape)};
      throw std::runtime_error("no parameter " + name);
    };
    src.buffer = [this](const std::string& name) {
      for (size_t i = 0; i < bspecs_.size(); ++i)
        if (bspecs_[i].name == name) return tensor_of(buffers_[i], {bspecs_[i].numel});
      throw std::runtime_error("no buffer " + name);
    };
    m_->bind(src);
    x_ = randu(static_cast<size_t>(in.numel()), seed);
    const ImageShape o = m_->output_shape(in);
    w_ = randu(static_cast<size_t>(o.numel()), seed + 1);
    out_shape_ = o;
  }

  ModuleContext context(bool training) {
    return ModuleContext{*be_, *be_->image_ops(), training, true, {}, 1, seed_};
  }
  Tensor input() { return tensor_of(x_, {in_.N, in_.C, in_.H, in_.W}); }
  std::vector<float> forward(bool training) {
    ModuleContext ctx = context(training);
    const Tensor out = m_->forward(ctx, input());
    const float* p = out.f32();
    return std::vector<float>(p, p + out.numel());
  }
  double objective() {
    const std::vector<float> out = forward(true);
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * w_[i];
    return s;
  }
  /// Forward then backward of Σ w·out: ∂/∂input (returned) and the parameter gradients.
  std::vector<float> gradients() {
    for (auto& g : grads_) std::fill(g.begin(), g.end(), 0.0f);
    forward(true);
    std::vector<float> din(x_.size());
    ModuleContext ctx = context(true);
    m_->backward(ctx, input(),
                 tensor_of(w_, {out_shape_.N, out_shape_.C, out_shape_.H, out_shape_.W}),
                 tensor_of(din, {in_.N, in_.C, in_.H, in_.W}));
    return din;
  }

  /// Checks ∂/∂input and every parameter's gradient against central differences.
  void check_gradients(float h = 1e-3f, double rtol = 2e-2, double atol = 2e-3) {
    const std::vector<float> din = gradients();
    const std::vector<std::vector<float>> grads = grads_;
    check(x_, din, "input", h, rtol, atol);
    for (size_t i = 0; i < specs_.size(); ++i)
      check(params_[i], grads[i], specs_[i].name, h, rtol, atol);
  }

  std::unique_ptr<Backend> be_;
  ModulePtr m_;
  ImageShape in_, out_shape_;
  uint64_t seed_ = 1234;
  std::vector<ParamTensor> specs_;
  std::vector<BufferSpec> bspecs_;
  std::vector<std::vector<float>> params_, grads_, buffers_;
  std::vector<float> x_, w_;

 private:
  void check(std::vector<float>& x, const std::vector<float>& analytic, const std::string& what,
             float h, double rtol, double atol) {
    test_support::expect_grad_close(
        x, analytic, [this] { return objective(); }, what, h, rtol, atol, 30);
  }
};

TEST(ImageBlocks, SqueezeExcitationGradients) {
  Rig rig(make_squeeze_excitation("se", 8, 2), {2, 8, 5, 5});
  std::vector<std::string> names;
  for (const ParamTensor& t : rig.specs_) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"se.fc1.weight", "se.fc1.bias", "se.fc2.weight",
                                             "se.fc2.bias"}));
  rig.check_gradients();
}

TEST(ImageBlocks, LstmOverRowsGradients) {
  auto seq = std::make_unique<Sequential>("m");
  seq->add(make_rows_to_sequence("sequence"));
  seq->add(make_lstm("lstm", 3 * 5, 6));
  Rig rig(std::move(seq), {2, 3, 4, 5});
  EXPECT_EQ(rig.out_shape_, (ImageShape{2, 6, 1, 1}));
  std::vector<std::string> names;
  for (const ParamTensor& t : rig.specs_) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"lstm.weight_ih_l0", "lstm.weight_hh_l0",
                                             "lstm.bias_ih_l0", "lstm.bias_hh_l0"}));
  rig.check_gradients();
}

/// EfficientNet's MBConv (expand 1×1, depthwise 3×3, SE, project 1×1, stochastic depth,
/// residual), built from the modules as image_zoo.cpp does.
ModulePtr mbconv(float p_drop) {
  auto body = std::make_unique<Sequential>("b.block");
  const auto conv_bn = [&](const std::string& n, int64_t in, int64_t out, int64_t k, int64_t g,
                           Activation act) {
    auto s = std::make_unique<Sequential>(n);
    s->add(
        make_conv2d(n + ".0", {.in_channels = in, .out_channels = out, .kernel = k, .groups = g}));
    s->add(make_batchnorm2d(n + ".1", out, act));
    return s;
  };
  body->add(conv_bn("b.block.0", 4, 16, 1, 1, Activation::kSilu));
  body->add(conv_bn("b.block.1", 16, 16, 3, 16, Activation::kSilu));
  body->add(make_squeeze_excitation("b.block.2", 16, 1));
  body->add(conv_bn("b.block.3", 16, 4, 1, 1, Activation::kNone));
  body->add(make_stochastic_depth("b.stochastic_depth", p_drop));
  return make_residual("b", std::move(body));
}

TEST(ImageBlocks, MBConvGradients) {
  Rig rig(mbconv(0.0f), {3, 4, 6, 6});
  rig.check_gradients(1e-2f, 3e-2, 5e-3);
}

TEST(ImageBlocks, MBConvWithStochasticDepthGradients) {
  // The per-sample draws depend on the seed alone, so the objective is smooth in the inputs.
  Rig rig(mbconv(0.5f), {4, 4, 6, 6});
  rig.check_gradients(1e-2f, 3e-2, 5e-3);
}

TEST(ImageBlocks, DropoutMasks) {
  Rig rig(make_dropout("classifier.0", 0.3f), {4, 16, 8, 8});
  std::fill(rig.x_.begin(), rig.x_.end(), 1.0f);
  const std::vector<float> out = rig.forward(true);
  int64_t kept = 0;
  for (float v : out) {
    ASSERT_TRUE(v == 0.0f || std::abs(v - 1.0f / 0.7f) < 1e-6f) << v;
    kept += v != 0.0f;
  }
  EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(out.size()), 0.7, 0.03);
  // Backward regenerates forward's mask: with ∂L/∂out = 1, ∂L/∂in = out.
  std::fill(rig.w_.begin(), rig.w_.end(), 1.0f);
  EXPECT_EQ(rig.gradients(), out);
  // Another micro-batch seed draws another mask; evaluation is the identity.
  rig.seed_ = 99;
  EXPECT_NE(rig.forward(true), out);
  EXPECT_EQ(rig.forward(false), rig.x_);
  // p = 0 is the identity in training too.
  Rig off(make_dropout("d", 0.0f), {2, 3, 4, 4});
  EXPECT_EQ(off.forward(true), off.x_);
}

TEST(ImageBlocks, StochasticDepthDropsWholeSamples) {
  Rig rig(make_stochastic_depth("features.2.1.stochastic_depth", 0.5f), {64, 3, 2, 2});
  std::fill(rig.x_.begin(), rig.x_.end(), 1.0f);
  const std::vector<float> out = rig.forward(true);
  int dropped = 0;
  for (int64_t n = 0; n < 64; ++n) {
    const float first = out[static_cast<size_t>(n * 12)];
    ASSERT_TRUE(first == 0.0f || first == 2.0f) << first;
    for (int64_t i = 0; i < 12; ++i) ASSERT_EQ(out[static_cast<size_t>(n * 12 + i)], first);
    dropped += first == 0.0f;
  }
  EXPECT_GT(dropped, 16);
  EXPECT_LT(dropped, 48);
  std::fill(rig.w_.begin(), rig.w_.end(), 1.0f);
  EXPECT_EQ(rig.gradients(), out);
  EXPECT_EQ(rig.forward(false), rig.x_);
}

/// Fills a model's parameters by the fixture formula, with `prefix` prepended to each name.
void fill_params(ImageModel& m, FlatBuffer& params, const std::string& prefix) {
  const ParamLayout& layout = m.layout();
  std::vector<float> host(static_cast<size_t>(layout.numel()), 0.0f);
  for (const ParamTensor* t : layout.tensors()) {
    const std::vector<float> v = test_support::fixture_fill(prefix + t->name, t->shape);
    std::copy(v.begin(), v.end(), host.begin() + t->offset);
  }
  m.backend().copy_from_host(params.data(), host.data(), host.size() * sizeof(float));
  m.bind(params.view(), Tensor());
}

TEST(ImageBlocks, EnsembleLogitsAreTheMeanOfItsMembers) {
  auto be = make_cpu_backend();
  const ImageModelSpec spec{"ensemble:cnn,cnn_lstm", 1, 28, 28, 10};
  auto ens = make_image_model(spec, *be);
  auto cnn = make_image_model({"cnn", 1, 28, 28, 10}, *be);
  auto lstm = make_image_model({"cnn_lstm", 1, 28, 28, 10}, *be);
  FlatBuffer pe(*be, DType::kF32, ens->layout().numel());
  FlatBuffer p0(*be, DType::kF32, cnn->layout().numel());
  FlatBuffer p1(*be, DType::kF32, lstm->layout().numel());
  fill_params(*ens, pe, "");
  fill_params(*cnn, p0, "members.0.");
  fill_params(*lstm, p1, "members.1.");
  const std::vector<float> images = randu(3 * 28 * 28, 5);
  const std::vector<float> e = ens->predict(images.data(), 3);
  const std::vector<float> a = cnn->predict(images.data(), 3);
  const std::vector<float> b = lstm->predict(images.data(), 3);
  ASSERT_EQ(e.size(), a.size());
  for (size_t i = 0; i < e.size(); ++i) EXPECT_NEAR(e[i], 0.5f * (a[i] + b[i]), 1e-5f) << i;

  // A training step reaches every member's parameters.
  FlatBuffer grads(*be, DType::kF32, ens->layout().numel());
  ens->bind(pe.view(), grads.view());
  const int32_t targets[3] = {1, 2, 3};
  const double loss =
      ens->forward({.batch = 3, .images = images.data(), .targets = targets, .dropout_seed = 11},
                   1.0f / 3, true);
  EXPECT_TRUE(std::isfinite(loss));
  ens->backward();
  std::vector<float> g(static_cast<size_t>(ens->layout().numel()));
  be->copy_to_host(g.data(), grads.data(), g.size() * sizeof(float));
  for (const char* name : {"members.0.features.0.weight", "members.1.lstm.weight_ih_l0",
                           "members.1.features.0.weight", "members.0.classifier.bias"}) {
    const ParamTensor* t = ens->layout().find(name);
    ASSERT_NE(t, nullptr) << name;
    double sq = 0;
    for (int64_t i = 0; i < t->numel; ++i)
      sq += g[static_cast<size_t>(t->offset + i)] * g[static_cast<size_t>(t->offset + i)];
    EXPECT_GT(sq, 0.0) << name;
  }
}

TEST(ImageBlocks, EfficientNetTrainsWithDropoutAndStochasticDepth) {
  auto be = make_cpu_backend();
  auto m = make_image_model({"efficientnet_b0", 3, 32, 32, 10}, *be);
  std::vector<float> host(static_cast<size_t>(m->layout().numel()));
  m->init_parameters(host.data(), 3);
  FlatBuffer params(*be, DType::kF32, m->layout().numel());
  FlatBuffer grads(*be, DType::kF32, m->layout().numel());
  be->copy_from_host(params.data(), host.data(), host.size() * sizeof(float));
  m->bind(params.view(), grads.view());
  const std::vector<float> images = randu(4 * 3 * 32 * 32, 9);
  const int32_t targets[4] = {0, 1, 2, 3};
  const double loss = m->forward(
      {.batch = 4, .images = images.data(), .targets = targets, .dropout_seed = 5}, 0.25f, true);
  EXPECT_TRUE(std::isfinite(loss));
  m->backward();
  std::vector<float> g(host.size());
  be->copy_to_host(g.data(), grads.data(), g.size() * sizeof(float));
  double sq = 0;
  for (float v : g) sq += static_cast<double>(v) * v;
  EXPECT_TRUE(std::isfinite(sq));
  EXPECT_GT(sq, 0.0);
  // Torchvision's names.
  EXPECT_NE(m->layout().find("features.1.0.block.1.fc1.weight"), nullptr);
  const auto& bufs = m->buffer_specs();
  EXPECT_TRUE(std::any_of(bufs.begin(), bufs.end(), [](const BufferSpec& b) {
    return b.name == "features.2.1.block.3.1.running_mean";
  }));
  EXPECT_NE(m->layout().find("classifier.1.weight"), nullptr);
}

}  // namespace
}  // namespace shardtrain
