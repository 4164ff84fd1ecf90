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
///    width multiplier 1.0, classifier Dropout(0.2); 3,504,872 parameters at 1000 classes).
///  * efficientnet_b0 — Tan & Le, arXiv 1905.11946, table 1 (torchvision.models.efficientnet_b0:
///    MBConv blocks with squeeze-and-excitation, Hu et al., arXiv 1709.01507, and stochastic
///    depth 0.2·block/16, Huang et al., arXiv 1603.09382; SiLU; classifier Dropout(0.2);
///    5,288,548 parameters at 1000 classes).
///  * vgg11_bn, vgg16_bn — Simonyan & Zisserman, arXiv 1409.1556, table 1 configurations A and D
///    with batch norm after every convolution (torchvision.models.vgg11_bn / vgg16_bn: 7×7
///    adaptive pooling, classifier 4096-4096-K with Dropout(0.5); 132,868,840 and 138,365,992
///    parameters at 1000 classes).
///  * cnn_lstm — [conv3×3 32, BN, ReLU, maxpool 2] [conv3×3 64, BN, ReLU, maxpool 2]; the feature
///    map's rows as a sequence ([N, 64, H', W'] → [N, H', 64·W']) into nn.LSTM(64·W', 128,
///    batch_first=True); the last step's hidden state into Linear(128, K).
///  * ensemble:m1,m2,... — the members (any of the above) built for the same input, trained
///    jointly on the mean of their logits; parameters "members.<i>.<member's name>".
/// With spec.dropout false, dropout and stochastic depth are built with p = 0.
/// Throws ConfigError for an unknown name (suggesting the nearest known one) or an input the
/// network cannot take (naming the layer).
std::unique_ptr<ImageModel> make_image_model(const ImageModelSpec& spec, Backend& backend);

}  // namespace shardtrain
