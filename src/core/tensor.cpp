#include "core/tensor.h"

#include <fmt/format.h>

namespace shardtrain {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kI32:
      return "int32";
    case DType::kU16:
      return "uint16";
    case DType::kF64:
      return "fp64";
    case DType::kU8:
      return "uint8";
  }
  return "?";
}

const char* device_name(DeviceKind d) { return d == DeviceKind::kCPU ? "cpu" : "cuda"; }

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) {
    if (i) s += ", ";
    s += fmt::format("{}", shape[static_cast<size_t>(i)]);
  }
  return s + "]";
}

}  // namespace shardtrain
