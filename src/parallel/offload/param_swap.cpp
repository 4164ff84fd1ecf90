// Stage 3's parameters paged from NVMe: see param_swap.h.
#include "parallel/offload/param_swap.h"

#include <algorithm>
#include <cstring>

#include "config/knob.h"
#include "core/error.h"

namespace shardtrain {

ParamSwap::ParamSwap(Backend& backend, const std::string& dir, int rank, const AioConfig& aio,
                     DType dtype, std::vector<int64_t> numel, int buffers)
    : numel_(std::move(numel)), dtype_(dtype) {
  check<ConfigError>(buffers >= 2,
                     "{} {} is too small: parameters paged from NVMe need at least 2 buffers (one "
                     "read ahead while one is copied)",
                     zero_knob(&ZeroConfig::offload_param_buffer_count).label(), buffers);
  int64_t file = 0, largest = 0;
  for (size_t u = 0; u < numel_.size(); ++u) {
    region_.push_back(numel_[u] > 0 ? file : -1);
    file += region_bytes(u);
    largest = std::max(largest, region_bytes(u));
  }
  check_nvme_path(dir, file, zero_knob(&ZeroConfig::nvme_path).label());
  file_ = std::make_unique<SwapFile>(dir, rank, file, aio, "params");
  buffers_.resize(static_cast<size_t>(buffers));
  for (Buffer& b : buffers_)
    b.mem = PinnedBuffer(backend, dtype, largest / static_cast<int64_t>(dtype_size(dtype)));
}

ParamSwap::~ParamSwap() {
  try {
    drop_all();
  } catch (const std::exception&) {
    // Unwinding after an error: the file goes with file_.
  }
}

int64_t ParamSwap::region_bytes(size_t u) const {
  return swap_round_up(numel_[u] * static_cast<int64_t>(dtype_size(dtype_)));
}

ParamSwap::Buffer* ParamSwap::holding(int u) {
  for (Buffer& b : buffers_)
    if (b.unit == u) return &b;
  return nullptr;
}

void ParamSwap::settle(Buffer& b) {
  if (b.read.id) file_->wait(b.read);
  b.read = {};
  if (b.copies) b.copies->host_wait(b.fence);
  b.copies = nullptr;
}

ParamSwap::Buffer* ParamSwap::free_buffer() {
  for (size_t k = 0; k < buffers_.size(); ++k) {
    Buffer& b = buffers_[(next_ + k) % buffers_.size()];
    if (b.reserved) continue;
    next_ = (next_ + k + 1) % buffers_.size();
    settle(b);
    b.unit = -1;
    return &b;
  }
  return nullptr;
}

void ParamSwap::prefetch(int u) {
  if (!on_nvme(u) || holding(u)) return;
  Buffer* b = free_buffer();
  if (!b) return;
  const auto i = static_cast<size_t>(u);
  b->unit = u;
  b->read = file_->read_async(region_[i], b->mem.data(), region_bytes(i));
}

Tensor ParamSwap::acquire(int u) {
  ST_ASSERT(on_nvme(u));
  prefetch(u);
  Buffer* b = holding(u);
  check<RuntimeFailure>(b != nullptr,
                        "{}: no staging buffer free for layer {} (every one of the {} holds a "
                        "layer in use: raise {})",
                        zero_knob(&ZeroConfig::offload_param_device).section(), u, buffers_.size(),
                        zero_knob(&ZeroConfig::offload_param_buffer_count).label());
  if (b->read.id) file_->wait(b->read);
  b->read = {};
  b->reserved = true;
  return b->mem.slice(0, numel_[static_cast<size_t>(u)]);
}

void ParamSwap::release(int u, CopyStream& copies, uint64_t fence) {
  Buffer* b = holding(u);
  ST_ASSERT(b != nullptr && b->reserved);
  b->reserved = false;
  b->copies = &copies;
  b->fence = fence;
}

void ParamSwap::drop_all() {
  for (Buffer& b : buffers_) {
    settle(b);
    b.unit = -1;
    b.reserved = false;
  }
}

void ParamSwap::write(int u, const void* src, int64_t count) {
  const auto i = static_cast<size_t>(u);
  ST_ASSERT(on_nvme(u) && count >= 0 && count <= numel_[i]);
  // O_DIRECT needs an aligned source of whole 4096-byte blocks: a host buffer of this thread's.
  const auto esize = static_cast<int64_t>(dtype_size(dtype_));
  const int64_t bytes = numel_[i] * esize;
  thread_local AlignedHostBuffer staging;
  if (staging.bytes() < swap_round_up(bytes)) staging = AlignedHostBuffer(bytes);
  std::memcpy(staging.data(), src, static_cast<size_t>(count * esize));
  std::memset(static_cast<char*>(staging.data()) + count * esize, 0,
              static_cast<size_t>(bytes - count * esize));
  file_->wait(file_->write_async(region_[i], staging.data(), region_bytes(i)));
}

size_t ParamSwap::pinned_bytes() const {
  size_t b = 0;
  for (const Buffer& x : buffers_) b += x.mem.bytes();
  return b;
}

size_t ParamSwap::nvme_bytes() const { return static_cast<size_t>(file_->bytes()); }

}  // namespace shardtrain
