// The names of the image models (model/image/image_zoo.h), apart from the models themselves: the
// configuration checks them without building one.
#include <algorithm>
#include <string>
#include <vector>

#include "model/image/image_zoo.h"

namespace shardtrain {

const std::vector<std::string>& image_model_names() {
  static const std::vector<std::string> names = {"cnn",      "mobilenet_v2", "efficientnet_b0",
                                                 "vgg11_bn", "vgg16_bn",     "cnn_lstm"};
  return names;
}

bool is_image_model(const std::string& name) {
  const auto& n = image_model_names();
  return std::find(n.begin(), n.end(), name) != n.end() || name.starts_with("ensemble:");
}

}  // namespace shardtrain
