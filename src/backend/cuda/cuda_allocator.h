// Device memory of the CUDA backend (cuda_allocator.cu): the caching allocator every tensor,
// workspace and scratch buffer comes from, and the memory a captured CUDA graph holds. The
// accounting and the graph memory follow PyTorch's (torch.cuda.memory_allocated /
// memory_reserved, private graph pools).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_common.h"

namespace shardtrain::cuda {

/// cudaMalloc-backed caching allocator. Requests are rounded up (512 B granularity below 1 MiB,
/// 2 MiB at and above); freed blocks go to a free list ordered by size, and a request takes the
/// smallest cached block that fits and is at most twice the rounded request. Blocks are never
/// split or merged. When cudaMalloc fails, every cached block is released (after synchronizing
/// the stream) and the request retried once. Memory is handed out zero-filled (stream-ordered)
/// unless the caller asks for it uninitialized.
///
/// Accounting, as PyTorch's (torch.cuda.memory_allocated / memory_reserved): "allocated" counts
/// the bytes of the live requests (rounded to 512 B), "reserved" every block taken from
/// cudaMalloc, so a block larger than its request shows its slack in reserved only. A graph's
/// temporaries (below) are reserved, not allocated, between its replays (as in PyTorch's private
/// graph pools); each replay raises the peak allocated by what they held at the capture's peak.
class CachingAllocator {
 public:
  static constexpr size_t kSmallGranularity = 512;
  static constexpr size_t kLargeThreshold = size_t{1} << 20;
  static constexpr size_t kLargeGranularity = size_t{2} << 20;

  CachingAllocator(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;
  ~CachingAllocator() { release_everything(); }

  void* allocate(size_t bytes, bool zero_fill = true);
  void deallocate(void* p) noexcept;

  // ---- CUDA graphs (Backend::capture) ----------------------------------------------------------
  // A replayed graph writes to the addresses it was captured with. So the blocks its work freed
  // during the capture (its temporaries) stay reserved for it until it is destroyed, and the
  // blocks live at the end of the capture (activations, parameters, workspaces) are pinned:
  // freeing one of them afterwards invalidates every graph (invalidations() changes).

  /// What a captured graph holds: its temporaries (size, block), the ids of the blocks it pins,
  /// and the bytes its temporaries' live requests reached (the capture's peak allocated above
  /// what was live at its end).
  struct GraphMemory {
    std::vector<std::pair<size_t, void*>> held;
    std::vector<uint64_t> pinned;
    size_t transient_peak = 0;
  };

  void begin_capture();
  /// Ends the capture; the temporaries become the graph's, the live blocks are pinned.
  GraphMemory end_capture();
  /// Returns a destroyed (or failed) graph's memory; its temporaries are cached again.
  void release_graph(const GraphMemory& g) noexcept;
  /// A replay of a graph holding `g` is enqueued: its temporaries are in use while it runs.
  void note_replay(const GraphMemory& g);
  /// Counts the frees of pinned blocks: a graph captured when it read v is valid while it is v.
  uint64_t invalidations() const {
    std::lock_guard<std::mutex> lock(mu_);
    return invalidations_;
  }

  /// Returns every cached (free) block to CUDA. Blocks in use are untouched.
  void release_cached() {
    std::lock_guard<std::mutex> lock(mu_);
    release_cached_locked();
  }

  size_t allocated() const { return locked(allocated_); }
  size_t peak_allocated() const { return locked(peak_allocated_); }
  size_t reserved() const { return locked(reserved_); }
  size_t peak_reserved() const { return locked(peak_reserved_); }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_allocated_ = allocated_;
    peak_reserved_ = reserved_;
  }

 private:
  static size_t round_up(size_t bytes, size_t g) {
    return (std::max<size_t>(bytes, 1) + g - 1) / g * g;
  }
  /// 0 when the rounded size would overflow.
  static size_t round_size(size_t bytes);

  size_t locked(const size_t& v) const {
    std::lock_guard<std::mutex> lock(mu_);
    return v;
  }

  /// The smallest block of `cache` that fits `want` and is at most twice it, taken out of the
  /// cache; {nullptr, 0} when none.
  static std::pair<void*, size_t> take_cached(std::multimap<size_t, void*>& cache, size_t want);

  void release_cached_locked();
  void release_everything() noexcept;
  [[noreturn]] void throw_oom(size_t bytes, cudaError_t err);

  int device_;
  cudaStream_t stream_;
  mutable std::mutex mu_;
  struct Block {
    size_t size;  ///< of the block (reserved)
    size_t used;  ///< the request rounded to 512 B (allocated)
    uint64_t id;  ///< unique over the allocator's life (an address may come back)
  };
  std::unordered_map<void*, Block> live_;       ///< blocks in use
  std::multimap<size_t, void*> free_;           ///< size -> block, cached
  std::multimap<size_t, void*> captured_free_;  ///< freed during the capture in progress
  std::unordered_map<uint64_t, int> pinned_;    ///< block id -> graphs pinning it
  bool capturing_ = false;
  uint64_t next_id_ = 0, invalidations_ = 0;
  size_t allocated_ = 0, peak_allocated_ = 0, reserved_ = 0, peak_reserved_ = 0;
  size_t capture_peak_ = 0;  ///< allocated_'s peak during the capture in progress
};

/// Backend::capture for the CUDA backend: captures `body`'s work on `stream` into a graph whose
/// memory `alloc` holds (CachingAllocator::GraphMemory). The graph must not outlive `alloc`.
/// Throws RuntimeFailure when the capture fails (the caller runs the step without graphs), and
/// rethrows what `body` throws.
std::unique_ptr<Backend::Graph> capture_graph(CachingAllocator& alloc, cudaStream_t stream,
                                              int device, const std::function<void()>& body);

}  // namespace shardtrain::cuda
