// Tensor: a non-owning view of typed memory on one device (ggml's habit: one tensor type,
// backends behind an interface). Memory is owned by flat buffers (memory/flat_buffer.h) and
// activation arenas; a Tensor never allocates or frees.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/error.h"

namespace shardtrain {

/// Element types. kF64 is for small exact accumulators (batch norm's per-channel sums), not for
/// parameters or activations; kU8 is for image pixels as decoded (0–255).
enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kU16, kF64, kU8 };

/// Bytes per element.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kI32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kU16:
      return 2;
    case DType::kF64:
      return 8;
    case DType::kU8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t);

enum class DeviceKind : uint8_t { kCPU, kCUDA };

const char* device_name(DeviceKind d);

/// A strided-free (contiguous, row-major) view of up to 4 dimensions.
struct Tensor {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::kF32;
  DeviceKind device = DeviceKind::kCPU;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};

  Tensor() = default;
  Tensor(void* ptr, DType t, DeviceKind dev, std::initializer_list<int64_t> dims)
      : data(ptr), dtype(t), device(dev) {
    ST_ASSERT(dims.size() <= static_cast<size_t>(kMaxDims));
    for (int64_t d : dims) shape[static_cast<size_t>(ndim++)] = d;
  }

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[static_cast<size_t>(i)];
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape[static_cast<size_t>(i < 0 ? ndim + i : i)]; }
  bool empty() const { return data == nullptr; }

  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  /// Typed pointer with a dtype check (for backends that support one dtype per op).
  float* f32() const {
    ST_ASSERT(dtype == DType::kF32);
    return static_cast<float*>(data);
  }
  int32_t* i32() const {
    ST_ASSERT(dtype == DType::kI32);
    return static_cast<int32_t*>(data);
  }

  /// The same memory with another shape of equal element count.
  Tensor reshape(std::initializer_list<int64_t> dims) const {
    Tensor t(data, dtype, device, dims);
    ST_ASSERT(t.numel() == numel());
    return t;
  }
  /// Elements [offset, offset + count) viewed as 1-D.
  Tensor slice1d(int64_t offset, int64_t count) const {
    ST_ASSERT(offset >= 0 && offset + count <= numel());
    return Tensor(static_cast<char*>(data) + static_cast<size_t>(offset) * dtype_size(dtype), dtype,
                  device, {count});
  }

  std::string shape_str() const;
};

}  // namespace shardtrain
