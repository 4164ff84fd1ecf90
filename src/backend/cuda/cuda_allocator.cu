// The CUDA backend's device memory (cuda_allocator.h): the caching allocator's definitions, and
// CUDA graphs (Backend::capture) with the memory they hold — a graph keeps the temporaries its
// captured work freed and pins the blocks live at the end of the capture.
#include <cstdio>
#include <string>
#include <tuple>
#include <utility>

#include "backend/cuda/cuda_allocator.h"
#include "backend/cuda/cuda_ops_common.h"

namespace shardtrain::cuda {
namespace {

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 6) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? strf("%.0f B", bytes) : strf("%.2f %s", bytes, units[u]);
}

}  // namespace

// ==== caching allocator ========================================================================

void* CachingAllocator::allocate(size_t bytes, bool zero_fill) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t want = round_size(bytes);
  if (want == 0) throw_oom(bytes, cudaErrorMemoryAllocation);  // overflowed: absurd request
  void* p = nullptr;
  size_t got = 0;
  // While a graph is captured, the blocks its work freed come first (they are its own).
  if (capturing_) std::tie(p, got) = take_cached(captured_free_, want);
  if (p == nullptr) std::tie(p, got) = take_cached(free_, want);
  if (p == nullptr) {
    cudaError_t err = cudaMalloc(&p, want);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear the non-sticky error before going on
      release_cached_locked();
      err = cudaMalloc(&p, want);
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        throw_oom(bytes, err);
      }
    }
    ST_CUDA_CHECK(err);
    got = want;
    reserved_ += got;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
  }
  const size_t used = round_up(bytes, kSmallGranularity);
  live_.emplace(p, Block{got, used, next_id_++});
  allocated_ += used;
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  if (capturing_) capture_peak_ = std::max(capture_peak_, allocated_);
  const cudaError_t err = zero_fill ? cudaMemsetAsync(p, 0, want, stream_) : cudaSuccess;
  if (err != cudaSuccess) {
    live_.erase(p);
    allocated_ -= used;
    free_.emplace(got, p);
    ST_CUDA_CHECK(err);
  }
  return p;
}

void CachingAllocator::deallocate(void* p) noexcept {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(p);
  if (it == live_.end()) {
    // Not ours (or freed twice): a bug in the caller. Keep going without corrupting the books.
    std::fprintf(stderr, "shardtrain: cuda deallocate of unknown pointer %p ignored\n", p);
    return;
  }
  allocated_ -= it->second.used;
  if (pinned_.erase(it->second.id) > 0) ++invalidations_;
  (capturing_ ? captured_free_ : free_).emplace(it->second.size, p);
  live_.erase(it);
}

void CachingAllocator::begin_capture() {
  std::lock_guard<std::mutex> lock(mu_);
  ST_ASSERT(!capturing_);
  capturing_ = true;
  capture_peak_ = allocated_;
}

CachingAllocator::GraphMemory CachingAllocator::end_capture() {
  std::lock_guard<std::mutex> lock(mu_);
  capturing_ = false;
  GraphMemory g;
  g.held.assign(captured_free_.begin(), captured_free_.end());
  captured_free_.clear();
  g.transient_peak = capture_peak_ - allocated_;
  for (const auto& [p, b] : live_) {
    ++pinned_[b.id];
    g.pinned.push_back(b.id);
  }
  return g;
}

void CachingAllocator::release_graph(const GraphMemory& g) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [size, p] : g.held) free_.emplace(size, p);
  for (uint64_t id : g.pinned) {
    auto it = pinned_.find(id);
    if (it != pinned_.end() && --it->second == 0) pinned_.erase(it);
  }
}

void CachingAllocator::note_replay(const GraphMemory& g) {
  std::lock_guard<std::mutex> lock(mu_);
  peak_allocated_ = std::max(peak_allocated_, allocated_ + g.transient_peak);
}

size_t CachingAllocator::round_size(size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  const size_t g = bytes >= kLargeThreshold ? kLargeGranularity : kSmallGranularity;
  if (bytes > SIZE_MAX - g) return 0;
  return (bytes + g - 1) / g * g;
}

std::pair<void*, size_t> CachingAllocator::take_cached(std::multimap<size_t, void*>& cache,
                                                       size_t want) {
  auto it = cache.lower_bound(want);
  if (it == cache.end() || it->first > 2 * want) return {nullptr, 0};
  const std::pair<void*, size_t> got{it->second, it->first};
  cache.erase(it);
  return got;
}

void CachingAllocator::release_cached_locked() {
  // Blocks on the free list may still be in use by enqueued kernels (stream-ordered reuse).
  ST_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (auto& [size, p] : free_) {
    ST_CUDA_CHECK(cudaFree(p));
    reserved_ -= size;
  }
  free_.clear();
}

void CachingAllocator::release_everything() noexcept {
  (void)cudaStreamSynchronize(stream_);
  for (auto& [size, p] : free_) (void)cudaFree(p);
  for (auto& [size, p] : captured_free_) (void)cudaFree(p);
  for (auto& [p, b] : live_) (void)cudaFree(p);
  captured_free_.clear();
  free_.clear();
  live_.clear();
  reserved_ = allocated_ = 0;
  (void)cudaGetLastError();
}

void CachingAllocator::throw_oom(size_t bytes, cudaError_t err) {
  size_t free_mem = 0, total_mem = 0;
  if (cudaMemGetInfo(&free_mem, &total_mem) != cudaSuccess) (void)cudaGetLastError();
  throw OutOfMemory(
      Memory::kGpu,
      strf(
          "CUDA out of memory on cuda:%d: could not allocate %s (%zu bytes; %s). shardtrain "
          "holds %s in tensors and %s reserved by its caching allocator; the device has %s free of "
          "%s",
          device_, format_bytes(static_cast<double>(bytes)).c_str(), bytes, cudaGetErrorString(err),
          format_bytes(static_cast<double>(allocated_)).c_str(),
          format_bytes(static_cast<double>(reserved_)).c_str(),
          format_bytes(static_cast<double>(free_mem)).c_str(),
          format_bytes(static_cast<double>(total_mem)).c_str()));
}

// ==== CUDA graphs ==============================================================================

namespace {

/// An instantiated graph and the memory it holds (CachingAllocator::GraphMemory). Must not
/// outlive the backend that captured it.
class CudaGraph final : public Backend::Graph {
 public:
  CudaGraph(CachingAllocator& alloc, cudaStream_t stream, int device, cudaGraphExec_t exec,
            CachingAllocator::GraphMemory memory)
      : alloc_(alloc),
        stream_(stream),
        device_(device),
        exec_(exec),
        memory_(std::move(memory)),
        captured_at_(alloc.invalidations()) {}
  ~CudaGraph() override {
    (void)cudaSetDevice(device_);
    // Replays in flight still use the held temporaries; later work on the stream may reuse them
    // (stream order), so returning them needs no wait.
    (void)cudaGraphExecDestroy(exec_);
    alloc_.release_graph(memory_);
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  void replay() override {
    if (!valid()) throw RuntimeFailure("replay of an invalidated CUDA graph: capture it again");
    ST_CUDA_CHECK(cudaSetDevice(device_));
    ST_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    alloc_.note_replay(memory_);
  }
  bool valid() const override { return alloc_.invalidations() == captured_at_; }

 private:
  CachingAllocator& alloc_;
  cudaStream_t stream_;
  int device_;
  cudaGraphExec_t exec_;
  CachingAllocator::GraphMemory memory_;
  uint64_t captured_at_;
};

}  // namespace

std::unique_ptr<Backend::Graph> capture_graph(CachingAllocator& alloc, cudaStream_t stream,
                                              int device, const std::function<void()>& body) {
  // Relaxed: the body's allocations may still reach cudaMalloc (memory outside the graph, kept
  // by the allocator); everything it enqueues is on this stream.
  ST_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  alloc.begin_capture();
  cudaGraph_t graph = nullptr;
  const auto abandon = [&](const char* what, cudaError_t err) {
    CachingAllocator::GraphMemory memory = alloc.end_capture();
    alloc.release_graph(memory);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    return RuntimeFailure(strf("CUDA graph capture failed: %s (%s); the step runs without graphs",
                               what, cudaGetErrorString(err)));
  };
  try {
    body();
  } catch (...) {
    const cudaError_t err = cudaStreamEndCapture(stream, &graph);
    (void)abandon("the captured work raised an error", err);
    throw;
  }
  cudaError_t err = cudaStreamEndCapture(stream, &graph);
  if (err != cudaSuccess) throw abandon("ending the capture", err);
  cudaGraphExec_t exec = nullptr;
  err = cudaGraphInstantiate(&exec, graph, 0);
  if (err != cudaSuccess) throw abandon("instantiating the graph", err);
  (void)cudaGraphDestroy(graph);
  return std::make_unique<CudaGraph>(alloc, stream, device, exec, alloc.end_capture());
}

}  // namespace shardtrain::cuda
