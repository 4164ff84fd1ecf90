#include "model/image/image_zoo.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/strings.h"

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

std::vector<ModulePtr> build_cnn(const ImageModelSpec& s) {
  std::vector<ModulePtr> layers;
  // features.<i>: conv, bn(+relu) pairs and pools, numbered like an nn.Sequential with the ReLUs
  // fused (their indices are skipped so names match a PyTorch Sequential of conv, bn, relu).
  struct Step {
    int64_t out;  // channels, or 0 for a 2×2 max pool
  };
  const Step plan[] = {{32}, {32}, {0}, {64}, {64}, {0}, {128}};
  int64_t in = s.channels, index = 0;
  for (const Step& p : plan) {
    const std::string name = fmt::format("features.{}", index);
    if (p.out == 0) {
      layers.push_back(make_maxpool2d(name, 2, 2));
      index += 1;
      continue;
    }
    auto seq = std::make_unique<Sequential>(name);
    seq->add(make_conv2d(fmt::format("features.{}", index), {.in_channels = in,
                                                             .out_channels = p.out,
                                                             .kernel = 3,
                                                             .padding = 1,
                                                             .init = ConvInit::kKaimingFanIn}));
    seq->add(make_batchnorm2d(fmt::format("features.{}", index + 1), p.out, Activation::kRelu));
    layers.push_back(std::move(seq));
    in = p.out;
    index += 3;
  }
  layers.push_back(make_adaptive_avgpool2d("avgpool", 1, 1));
  layers.push_back(make_linear("classifier", in, s.num_classes,
                               static_cast<float>(1.0 / std::sqrt(static_cast<double>(in)))));
  return layers;
}

/// torchvision's _make_divisible: round to the nearest multiple of `divisor`, not below 90%.
int64_t make_divisible(double v, int64_t divisor = 8) {
  int64_t nv = std::max(divisor, static_cast<int64_t>(v + divisor / 2.0) / divisor * divisor);
  if (static_cast<double>(nv) < 0.9 * v) nv += divisor;
  return nv;
}

std::vector<ModulePtr> build_mobilenet_v2(const ImageModelSpec& s) {
  // (expansion t, output channels c, repeats n, first stride s): arXiv 1801.04381, table 2.
  const int64_t settings[][4] = {{1, 16, 1, 1}, {6, 24, 2, 2},  {6, 32, 3, 2}, {6, 64, 4, 2},
                                 {6, 96, 3, 1}, {6, 160, 3, 2}, {6, 320, 1, 1}};
  std::vector<ModulePtr> layers;
  int64_t in = make_divisible(32);
  const int64_t last = make_divisible(1280);
  layers.push_back(conv_bn("features.0", s.channels, in, 3, 2, 1, Activation::kRelu6));
  int index = 1;
  for (const auto& st : settings) {
    const int64_t out = make_divisible(static_cast<double>(st[1]));
    for (int64_t i = 0; i < st[2]; ++i) {
      const int64_t stride = i == 0 ? st[3] : 1;
      const int64_t hidden = in * st[0];
      const std::string name = fmt::format("features.{}", index++);
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
      conv_bn(fmt::format("features.{}", index), in, last, 1, 1, 1, Activation::kRelu6));
  layers.push_back(make_adaptive_avgpool2d("avgpool", 1, 1));
  layers.push_back(make_linear("classifier.1", last, s.num_classes, 0.01f));
  return layers;
}

}  // namespace

const std::vector<std::string>& image_model_names() {
  static const std::vector<std::string> names = {"cnn", "mobilenet_v2"};
  return names;
}

bool is_image_model(const std::string& name) {
  const auto& n = image_model_names();
  return std::find(n.begin(), n.end(), name) != n.end() || name.starts_with("ensemble:");
}

std::unique_ptr<ImageModel> make_image_model(const ImageModelSpec& spec, Backend& backend) {
  std::vector<ModulePtr> layers;
  if (spec.name == "cnn") {
    layers = build_cnn(spec);
  } else if (spec.name == "mobilenet_v2") {
    layers = build_mobilenet_v2(spec);
  } else {
    throw ConfigError(fmt::format("unknown image model '{}'{}; the image models are {}", spec.name,
                                  did_you_mean(spec.name, image_model_names()),
                                  join(image_model_names(), ", ")));
  }
  return std::make_unique<ImageModel>(spec, std::move(layers), backend);
}

}  // namespace shardtrain
