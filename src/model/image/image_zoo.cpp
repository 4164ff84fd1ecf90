#include "model/image/image_zoo.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <iterator>

#include "core/error.h"
#include "core/strings.h"
#include "model/image/image_blocks.h"

namespace shardtrain {
namespace {

/// Conv2d + BatchNorm2d (+ activation): torchvision's Conv2dNormActivation, children "<name>.0"
/// (the convolution) and "<name>.1" (the batch norm, with the activation fused).
ModulePtr conv_bn(const std::string& name, int64_t in, int64_t out, int64_t kernel, int64_t stride,
                  int64_t groups, Activation act) {
  auto seq = std::make_unique<Sequential>(name);
  seq->add(make_conv2d(name + ".0", {.in_channels = in,
                                     .out_channels = out,
                                     .kernel = kernel,
                                     .stride = stride,
                                     .padding = (kernel - 1) / 2,
                                     .groups = groups}));
  seq->add(make_batchnorm2d(name + ".1", out, act));
  return seq;
}

std::vector<ModulePtr> build_cnn(const ImageModelSpec& s, const std::string& p) {
  std::vector<ModulePtr> layers;
  // features.<i>: conv, bn(+relu) pairs and pools, numbered like an nn.Sequential with the ReLUs
  // fused (their indices are skipped so names match a PyTorch Sequential of conv, bn, relu).
  struct Step {
    int64_t out;  // channels, or 0 for a 2×2 max pool
  };
  const Step plan[] = {{32}, {32}, {0}, {64}, {64}, {0}, {128}};
  int64_t in = s.channels, index = 0;
  for (const Step& step : plan) {
    const std::string name = p + fmt::format("features.{}", index);
    if (step.out == 0) {
      layers.push_back(make_maxpool2d(name, 2, 2));
      index += 1;
      continue;
    }
    auto seq = std::make_unique<Sequential>(name);
    seq->add(make_conv2d(p + fmt::format("features.{}", index), {.in_channels = in,
                                                                 .out_channels = step.out,
                                                                 .kernel = 3,
                                                                 .padding = 1,
                                                                 .init = ConvInit::kKaimingFanIn}));
    seq->add(
        make_batchnorm2d(p + fmt::format("features.{}", index + 1), step.out, Activation::kRelu));
    layers.push_back(std::move(seq));
    in = step.out;
    index += 3;
  }
  layers.push_back(make_adaptive_avgpool2d(p + "avgpool", 1, 1));
  layers.push_back(make_linear(p + "classifier", in, s.num_classes,
                               static_cast<float>(1.0 / std::sqrt(static_cast<double>(in)))));
  return layers;
}

/// torchvision's _make_divisible: round to the nearest multiple of `divisor`, not below 90%.
int64_t make_divisible(double v, int64_t divisor = 8) {
  int64_t nv = std::max(divisor, static_cast<int64_t>(v + divisor / 2.0) / divisor * divisor);
  if (static_cast<double>(nv) < 0.9 * v) nv += divisor;
  return nv;
}

std::vector<ModulePtr> build_mobilenet_v2(const ImageModelSpec& s, const std::string& p) {
  // (expansion t, output channels c, repeats n, first stride s): arXiv 1801.04381, table 2.
  const int64_t settings[][4] = {{1, 16, 1, 1}, {6, 24, 2, 2},  {6, 32, 3, 2}, {6, 64, 4, 2},
                                 {6, 96, 3, 1}, {6, 160, 3, 2}, {6, 320, 1, 1}};
  std::vector<ModulePtr> layers;
  int64_t in = make_divisible(32);
  const int64_t last = make_divisible(1280);
  layers.push_back(conv_bn(p + "features.0", s.channels, in, 3, 2, 1, Activation::kRelu6));
  int index = 1;
  for (const auto& st : settings) {
    const int64_t out = make_divisible(static_cast<double>(st[1]));
    for (int64_t i = 0; i < st[2]; ++i) {
      const int64_t stride = i == 0 ? st[3] : 1;
      const int64_t hidden = in * st[0];
      const std::string name = p + fmt::format("features.{}", index++);
      auto body = std::make_unique<Sequential>(name + ".conv");
      int k = 0;
      const auto child = [&] { return fmt::format("{}.conv.{}", name, k++); };
      if (st[0] != 1) body->add(conv_bn(child(), in, hidden, 1, 1, 1, Activation::kRelu6));
      body->add(conv_bn(child(), hidden, hidden, 3, stride, hidden, Activation::kRelu6));
      body->add(make_conv2d(child(), {.in_channels = hidden, .out_channels = out, .kernel = 1}));
      body->add(make_batchnorm2d(child(), out));
      if (stride == 1 && in == out)
        layers.push_back(make_residual(name, std::move(body)));
      else
        layers.push_back(std::move(body));
      in = out;
    }
  }
  layers.push_back(
      conv_bn(p + fmt::format("features.{}", index), in, last, 1, 1, 1, Activation::kRelu6));
  layers.push_back(make_adaptive_avgpool2d(p + "avgpool", 1, 1));
  layers.push_back(make_dropout(p + "classifier.0", s.classifier_dropout_or(0.2f)));
  layers.push_back(make_linear(p + "classifier.1", last, s.num_classes, 0.01f));
  return layers;
}

std::vector<ModulePtr> build_efficientnet_b0(const ImageModelSpec& s, const std::string& p) {
  // torchvision's MBConvConfig (expand ratio, kernel, stride, input channels, output channels,
  // layers) of efficientnet_b0 (width and depth multipliers 1.0): arXiv 1905.11946, table 1.
  const int64_t settings[][6] = {
      {1, 3, 1, 32, 16, 1},  {6, 3, 2, 16, 24, 2},   {6, 5, 2, 24, 40, 2},  {6, 3, 2, 40, 80, 3},
      {6, 5, 1, 80, 112, 3}, {6, 5, 2, 112, 192, 4}, {6, 3, 1, 192, 320, 1}};
  int64_t total_blocks = 0;
  for (const auto& st : settings) total_blocks += st[5];
  const double stochastic_depth = s.dropout ? 0.2 : 0.0;
  std::vector<ModulePtr> layers;
  layers.push_back(
      conv_bn(p + "features.0", s.channels, settings[0][3], 3, 2, 1, Activation::kSilu));
  int64_t block_id = 0;
  for (size_t stage = 0; stage < std::size(settings); ++stage) {
    const auto& st = settings[stage];
    for (int64_t j = 0; j < st[5]; ++j) {
      const int64_t in = j == 0 ? st[3] : st[4], out = st[4], stride = j == 0 ? st[2] : 1;
      const int64_t hidden = make_divisible(static_cast<double>(in * st[0]));
      const std::string name = p + fmt::format("features.{}.{}", stage + 1, j);
      auto body = std::make_unique<Sequential>(name + ".block");
      int k = 0;
      const auto child = [&] { return fmt::format("{}.block.{}", name, k++); };
      if (hidden != in) body->add(conv_bn(child(), in, hidden, 1, 1, 1, Activation::kSilu));
      body->add(conv_bn(child(), hidden, hidden, st[1], stride, hidden, Activation::kSilu));
      body->add(make_squeeze_excitation(child(), hidden, std::max<int64_t>(1, in / 4)));
      body->add(conv_bn(child(), hidden, out, 1, 1, 1, Activation::kNone));
      // Stochastic depth grows linearly with the block index (Huang et al., arXiv 1603.09382,
      // §3 "linear decay"), applied only to residual blocks as torchvision's MBConv.
      const auto p_drop = static_cast<float>(stochastic_depth * static_cast<double>(block_id) /
                                             static_cast<double>(total_blocks));
      if (stride == 1 && in == out) {
        body->add(make_stochastic_depth(name + ".stochastic_depth", p_drop));
        layers.push_back(make_residual(name, std::move(body)));
      } else {
        layers.push_back(std::move(body));
      }
      ++block_id;
    }
  }
  const int64_t last_in = settings[std::size(settings) - 1][4], last = 4 * last_in;
  layers.push_back(conv_bn(p + fmt::format("features.{}", std::size(settings) + 1), last_in, last,
                           1, 1, 1, Activation::kSilu));
  layers.push_back(make_adaptive_avgpool2d(p + "avgpool", 1, 1));
  layers.push_back(make_dropout(p + "classifier.0", s.classifier_dropout_or(0.2f)));
  layers.push_back(
      make_linear(p + "classifier.1", last, s.num_classes, 0.0f,
                  static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.num_classes)))));
  return layers;
}

/// VGG with batch norm (torchvision's vgg*_bn): `cfg` lists conv widths, 0 for a 2×2 max pool.
std::vector<ModulePtr> build_vgg_bn(const ImageModelSpec& s, const std::string& p,
                                    const std::vector<int64_t>& cfg) {
  std::vector<ModulePtr> layers;
  int64_t in = s.channels, index = 0;
  for (const int64_t v : cfg) {
    const std::string name = p + fmt::format("features.{}", index);
    if (v == 0) {
      layers.push_back(make_maxpool2d(name, 2, 2));
      index += 1;
      continue;
    }
    // conv (features.i, with bias), bn (i+1) and relu (i+2, fused into the bn).
    auto seq = std::make_unique<Sequential>(name);
    seq->add(make_conv2d(
        name, {.in_channels = in, .out_channels = v, .kernel = 3, .padding = 1, .bias = true}));
    seq->add(make_batchnorm2d(p + fmt::format("features.{}", index + 1), v, Activation::kRelu));
    layers.push_back(std::move(seq));
    in = v;
    index += 3;
  }
  const float drop = s.classifier_dropout_or(0.5f);
  layers.push_back(make_adaptive_avgpool2d(p + "avgpool", 7, 7));
  layers.push_back(make_linear(p + "classifier.0", in * 7 * 7, 4096, 0.01f));
  layers.push_back(make_activation(p + "classifier.1", Activation::kRelu));
  layers.push_back(make_dropout(p + "classifier.2", drop));
  layers.push_back(make_linear(p + "classifier.3", 4096, 4096, 0.01f));
  layers.push_back(make_activation(p + "classifier.4", Activation::kRelu));
  layers.push_back(make_dropout(p + "classifier.5", drop));
  layers.push_back(make_linear(p + "classifier.6", 4096, s.num_classes, 0.01f));
  return layers;
}

std::vector<ModulePtr> build_cnn_lstm(const ImageModelSpec& s, const std::string& p) {
  // features: [conv3×3 32, BN, ReLU, maxpool 2] [conv3×3 64, BN, ReLU, maxpool 2]
  std::vector<ModulePtr> layers;
  int64_t in = s.channels, index = 0;
  for (const int64_t out : {32, 64}) {
    const std::string name = p + fmt::format("features.{}", index);
    auto seq = std::make_unique<Sequential>(name);
    seq->add(make_conv2d(name, {.in_channels = in,
                                .out_channels = out,
                                .kernel = 3,
                                .padding = 1,
                                .init = ConvInit::kKaimingFanIn}));
    seq->add(make_batchnorm2d(p + fmt::format("features.{}", index + 1), out, Activation::kRelu));
    layers.push_back(std::move(seq));
    layers.push_back(make_maxpool2d(p + fmt::format("features.{}", index + 3), 2, 2));
    in = out;
    index += 4;
  }
  ImageShape f{1, s.channels, s.height, s.width};
  for (const auto& l : layers) f = l->output_shape(f);
  constexpr int64_t kHidden = 128;
  layers.push_back(make_rows_to_sequence(p + "sequence"));
  layers.push_back(make_lstm(p + "lstm", f.C * f.W, kHidden));
  layers.push_back(make_linear(p + "classifier", kHidden, s.num_classes,
                               static_cast<float>(1.0 / std::sqrt(static_cast<double>(kHidden)))));
  return layers;
}

std::vector<std::string> split_members(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t comma = list.find(',', start);
    out.push_back(list.substr(start, comma - start));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

std::vector<ModulePtr> build_single(const ImageModelSpec& spec, const std::string& prefix) {
  if (spec.name == "cnn") return build_cnn(spec, prefix);
  if (spec.name == "mobilenet_v2") return build_mobilenet_v2(spec, prefix);
  if (spec.name == "efficientnet_b0") return build_efficientnet_b0(spec, prefix);
  if (spec.name == "vgg11_bn")
    return build_vgg_bn(spec, prefix, {64, 0, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0});
  if (spec.name == "vgg16_bn")
    return build_vgg_bn(
        spec, prefix,
        {64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0});
  if (spec.name == "cnn_lstm") return build_cnn_lstm(spec, prefix);
  throw ConfigError(fmt::format("unknown image model '{}'{}; the image models are {}", spec.name,
                                did_you_mean(spec.name, image_model_names()),
                                join(image_model_names(), ", ")));
}

}  // namespace

std::unique_ptr<ImageModel> make_image_model(const ImageModelSpec& spec, Backend& backend) {
  constexpr std::string_view kEnsemble = "ensemble:";
  if (!spec.name.starts_with(kEnsemble))
    return std::make_unique<ImageModel>(spec, build_single(spec, ""), backend);
  const std::vector<std::string> names = split_members(spec.name.substr(kEnsemble.size()));
  for (const std::string& n : names)
    check<ConfigError>(!n.empty(), "'{}' has an empty member name; write ensemble:cnn,cnn_lstm",
                       spec.name);
  std::vector<std::vector<ModulePtr>> members;
  for (size_t i = 0; i < names.size(); ++i) {
    check<ConfigError>(!names[i].starts_with(kEnsemble), "{}: ensembles do not nest", spec.name);
    ImageModelSpec member = spec;
    member.name = names[i];
    members.push_back(build_single(member, fmt::format("members.{}.", i)));
  }
  return std::make_unique<ImageModel>(spec, std::move(members), backend);
}

}  // namespace shardtrain
