// FlatBuffer: one contiguous allocation on a backend's device, owned (RAII).
#pragma once

#include <cstdint>
#include <utility>

#include "backend/backend.h"
#include "core/tensor.h"

namespace shardtrain {

class FlatBuffer {
 public:
  FlatBuffer() = default;
  /// Allocates `numel` zeroed elements of `dtype` on `backend`; nothing for numel 0 (an empty
  /// buffer: data() null). Throws RuntimeFailure (OOM).
  FlatBuffer(Backend& backend, DType dtype, int64_t numel)
      : FlatBuffer(backend, dtype, numel,
                   numel > 0 ? backend.allocate(bytes_of(dtype, numel)) : nullptr) {}
  /// As the constructor without the zero fill (Backend::allocate_uninitialized): for memory
  /// written before it is read (activations, gradients a pass overwrites).
  static FlatBuffer uninitialized(Backend& backend, DType dtype, int64_t numel) {
    return FlatBuffer(backend, dtype, numel,
                      numel > 0 ? backend.allocate_uninitialized(bytes_of(dtype, numel)) : nullptr);
  }
  FlatBuffer(const FlatBuffer&) = delete;
  FlatBuffer& operator=(const FlatBuffer&) = delete;
  FlatBuffer(FlatBuffer&& o) noexcept : backend_(o.backend_), view_(o.view_) { o.view_ = {}; }
  FlatBuffer& operator=(FlatBuffer&& o) noexcept {
    std::swap(backend_, o.backend_);
    std::swap(view_, o.view_);
    return *this;
  }
  ~FlatBuffer() {
    if (backend_ && view_.data) backend_->deallocate(view_.data);
  }

  /// The whole buffer as a 1-D tensor [numel].
  const Tensor& view() const { return view_; }
  /// Elements [offset, offset + count) as a tensor of the given shape (or 1-D).
  Tensor slice(int64_t offset, int64_t count) const { return view_.slice1d(offset, count); }
  int64_t numel() const { return view_.data ? view_.numel() : 0; }
  DType dtype() const { return view_.dtype; }
  void* data() const { return view_.data; }
  size_t bytes() const { return view_.data ? view_.bytes() : 0; }

 private:
  /// Owns `data` (from `backend`, numel elements of `dtype`; null for numel 0).
  FlatBuffer(Backend& backend, DType dtype, int64_t numel, void* data)
      : backend_(&backend), view_(data, dtype, backend.kind(), {numel}) {}
  static size_t bytes_of(DType dtype, int64_t numel) {
    return static_cast<size_t>(numel) * dtype_size(dtype);
  }

  Backend* backend_ = nullptr;
  Tensor view_;
};

/// Makes `buf` hold at least `numel` elements of `dtype` on `be`: when it is smaller, its memory
/// is returned first and a new zeroed buffer taken (the contents are not kept). Throws
/// RuntimeFailure (OOM).
inline void grow(Backend& be, FlatBuffer& buf, DType dtype, int64_t numel) {
  if (buf.numel() >= numel) return;
  buf = FlatBuffer();
  buf = FlatBuffer(be, dtype, numel);
}

}  // namespace shardtrain
