// Names of the ImageOps activations (for messages and logs).
#include "backend/image_ops.h"

namespace shardtrain {

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::kNone:
      return "none";
    case Activation::kRelu:
      return "relu";
    case Activation::kRelu6:
      return "relu6";
    case Activation::kSilu:
      return "silu";
    case Activation::kSigmoid:
      return "sigmoid";
  }
  return "unknown";
}

}  // namespace shardtrain
