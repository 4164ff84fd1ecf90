// One device allocation handed out in pieces: ZeRO-3's gathered parameters and full gradient
// buffers (zero3.cpp). Why: the copy-engine collectives (comm/peer_collectives.h) move only data
// in buffers every rank registered up front, at the same offsets on every rank. Per-unit buffers
// from the caching allocator are neither, so their all-gathers and reduce-scatters fell back to
// NCCL's kernels, which hold SMs for the whole collective and slowed the layers they overlap
// (gpt2-xl, micro-batch 4 on 2 H200s: forward 18.5 ms against 14.5 ms on one GPU). One arena,
// registered once and carved up by the same deterministic first-fit on every rank (ranks run the
// same schedule), gives every piece the same offset everywhere.
//
// Header-only: used by zero3.cpp and its tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <utility>

#include "backend/backend.h"
#include "core/error.h"
#include "core/tensor.h"
#include "memory/flat_buffer.h"

namespace shardtrain {

/// A fixed buffer of `capacity` elements of one dtype, handed out as element ranges by first fit.
/// Pieces start at multiples of kAlign elements. Contents are not cleared: a piece holds whatever
/// its previous user left. Not thread-safe.
class DeviceArena {
 public:
  static constexpr int64_t kAlign = 256;  ///< elements: 512 bytes in bf16, 1 KiB in fp32

  /// `n` elements rounded up to kAlign: what a piece, or the arena, of `n` elements takes.
  static int64_t rounded(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

  DeviceArena() = default;
  /// One allocation of `capacity` elements (rounded up to kAlign) of `dtype` on `backend`.
  /// Throws RuntimeFailure when the backend is out of memory.
  DeviceArena(Backend& backend, DType dtype, int64_t capacity)
      : buffer_(backend, dtype, rounded(capacity)), capacity_(rounded(capacity)) {
    if (capacity_ > 0) free_[0] = capacity_;
  }

  /// The lowest-offset free range of `numel` elements (rounded up to kAlign), as a 1-D tensor of
  /// `numel` elements; an empty tensor (data null) when no free range is large enough. The same
  /// sequence of take()/give() calls yields the same offsets on every rank.
  Tensor take(int64_t numel) {
    ST_ASSERT(numel > 0);
    const int64_t want = rounded(numel);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < want) continue;
      const int64_t offset = it->first, left = it->second - want;
      free_.erase(it);
      if (left > 0) free_[offset + want] = left;
      used_[offset] = want;
      in_use_ += want;
      return buffer_.slice(offset, numel);
    }
    return Tensor();
  }

  /// Returns a piece take() gave out; neighbouring free ranges merge.
  void give(const Tensor& piece) {
    const int64_t offset = offset_of(piece);
    auto u = used_.find(offset);
    ST_ASSERT(u != used_.end());
    int64_t start = offset, size = u->second;
    in_use_ -= size;
    used_.erase(u);
    auto next = free_.lower_bound(start);
    if (next != free_.end() && next->first == start + size) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        start = prev->first;
        size += prev->second;
        free_.erase(prev);
      }
    }
    free_[start] = size;
  }

  /// Whether `t` is a piece of this arena.
  bool owns(const Tensor& t) const {
    if (capacity_ == 0 || t.data == nullptr) return false;
    const auto* p = static_cast<const char*>(t.data);
    const auto* base = static_cast<const char*>(buffer_.data());
    return p >= base && p < base + buffer_.bytes();
  }

  /// The whole arena [capacity] (what the communicator registers).
  const Tensor& view() const { return buffer_.view(); }
  int64_t capacity() const { return capacity_; }
  int64_t in_use() const { return in_use_; }  ///< elements given out, alignment included

 private:
  int64_t offset_of(const Tensor& t) const {
    ST_ASSERT(owns(t));
    return static_cast<int64_t>(static_cast<const char*>(t.data) -
                                static_cast<const char*>(buffer_.data())) /
           static_cast<int64_t>(dtype_size(buffer_.dtype()));
  }

  FlatBuffer buffer_;
  int64_t capacity_ = 0;             ///< elements
  std::map<int64_t, int64_t> free_;  ///< offset → elements, disjoint, never adjacent
  std::map<int64_t, int64_t> used_;  ///< offset → elements (rounded) of each piece given out
  int64_t in_use_ = 0;
};

/// A buffer of `numel` elements: a piece of `arena` when it has room (contents left as they were),
/// else a FlatBuffer of its own (zero-filled). Gives the piece back when destroyed or reassigned;
/// move-only. An empty ArenaBuffer (default, or of 0 elements: a layer without parameters, whose
/// view is [0] like an empty FlatBuffer's) holds nothing.
class ArenaBuffer {
 public:
  ArenaBuffer() = default;
  ArenaBuffer(Backend& backend, DeviceArena* arena, DType dtype, int64_t numel) {
    if (numel > 0 && arena != nullptr && arena->capacity() > 0) {
      view_ = arena->take(numel);
      if (view_.data != nullptr) arena_ = arena;
    }
    if (arena_ == nullptr) {
      own_ = FlatBuffer(backend, dtype, numel);
      view_ = own_.view();
    }
  }
  ArenaBuffer(const ArenaBuffer&) = delete;
  ArenaBuffer& operator=(const ArenaBuffer&) = delete;
  ArenaBuffer(ArenaBuffer&& o) noexcept
      : arena_(std::exchange(o.arena_, nullptr)),
        own_(std::move(o.own_)),
        view_(std::exchange(o.view_, Tensor())) {}
  ArenaBuffer& operator=(ArenaBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      arena_ = std::exchange(o.arena_, nullptr);
      own_ = std::move(o.own_);
      view_ = std::exchange(o.view_, Tensor());
    }
    return *this;
  }
  ~ArenaBuffer() { reset(); }

  const Tensor& view() const { return view_; }
  Tensor slice(int64_t offset, int64_t count) const { return view_.slice1d(offset, count); }
  int64_t numel() const { return view_.data ? view_.numel() : 0; }
  size_t bytes() const { return view_.data ? view_.bytes() : 0; }
  /// Whether the buffer is a piece of the arena (false: a FlatBuffer of its own).
  bool in_arena() const { return arena_ != nullptr; }

 private:
  void reset() noexcept {
    if (arena_ != nullptr) arena_->give(view_);
    arena_ = nullptr;
    own_ = FlatBuffer();
    view_ = Tensor();
  }

  DeviceArena* arena_ = nullptr;
  FlatBuffer own_;
  Tensor view_;
};

}  // namespace shardtrain
