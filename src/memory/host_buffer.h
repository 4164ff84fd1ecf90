// Host buffers of the offloaded state: PinnedBuffer, a backend's transfer memory (RAII), and
// host_slice, the typed view of any host array. (Pageable state the CPU updates — fp32 master
// weights and AdamW moments, which never cross PCIe and so need not be locked — lives in
// AlignedHostBuffer, parallel/offload/nvme_swap.h.)
#pragma once

#include <cstdint>
#include <utility>

#include "backend/backend.h"
#include "core/error.h"
#include "core/tensor.h"

namespace shardtrain {

/// Elements [offset, offset + count) of a host array of `numel` elements of `dtype` at `data`.
inline Tensor host_slice(void* data, DType dtype, int64_t numel, int64_t offset, int64_t count) {
  ST_ASSERT(offset >= 0 && offset + count <= numel);
  return Tensor(static_cast<char*>(data) + offset * static_cast<int64_t>(dtype_size(dtype)), dtype,
                DeviceKind::kCPU, {count});
}

/// `numel` elements of `dtype` from Backend::allocate_pinned (not zeroed), freed on destruction.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(Backend& backend, DType dtype, int64_t numel)
      : backend_(&backend), dtype_(dtype), numel_(numel) {
    if (numel > 0) data_ = backend.allocate_pinned(bytes());
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept { swap(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    swap(o);
    return *this;
  }
  ~PinnedBuffer() {
    if (data_) backend_->free_pinned(data_, bytes());
  }
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  int64_t numel() const { return data_ ? numel_ : 0; }
  DType dtype() const { return dtype_; }
  size_t bytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  /// Elements [offset, offset + count) as a host tensor.
  Tensor slice(int64_t offset, int64_t count) const {
    return host_slice(data_, dtype_, numel_, offset, count);
  }

 private:
  void swap(PinnedBuffer& o) noexcept {
    std::swap(backend_, o.backend_);
    std::swap(data_, o.data_);
    std::swap(dtype_, o.dtype_);
    std::swap(numel_, o.numel_);
  }
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  int64_t numel_ = 0;
};

}  // namespace shardtrain
