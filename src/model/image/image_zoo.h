// The image classifiers shardtrain builds, with torchvision's architectures and parameter names
// where torchvision has them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "model/image/image_model.h"

namespace shardtrain {

/// The model names make_image_model() knows ("cnn", "mobilenet_v2", ...).
const std::vector<std::string>& image_model_names();

/// Whether `name` names an image model (a known one, or an "ensemble:" list).
bool is_image_model(const std::string& name);

/// Builds `spec.name` for spec's input and class count:
///  * cnn — a small conv-BN-ReLU network: [conv3×3 32, conv3×3 32, maxpool 2] [conv 64 ×2,
///    maxpool 2] [conv 128], global average pooling, linear (about 0.29 M parameters).
///  * mobilenet_v2 — Sandler et al., arXiv 1801.04381, table 2 (torchvision.models.mobilenet_v2,
///    width multiplier 1.0; the classifier's dropout is not applied yet).
/// Throws ConfigError for an unknown name (suggesting the nearest known one) or an input the
/// network cannot take (naming the layer).
std::unique_ptr<ImageModel> make_image_model(const ImageModelSpec& spec, Backend& backend);

}  // namespace shardtrain
