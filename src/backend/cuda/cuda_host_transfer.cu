// The CUDA backend's transfer machinery for offloading: pinned host memory (cudaHostAlloc) and
// CudaCopyStream, a non-blocking CUDA stream for host ↔ device copies whose order against the
// compute stream is kept with events (fences), so that the copies run on the copy engines while
// kernels run (ZeRO-Offload, Ren et al., arXiv 2101.06840, §4.2 "overlapping communication").
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_host_transfer.h"

namespace shardtrain::cuda {
namespace {

class CudaCopyStream final : public CopyStream {
 public:
  CudaCopyStream(int device, cudaStream_t compute) : device_(device), compute_(compute) {
    ST_CUDA_CHECK(cudaSetDevice(device_));
    ST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ST_CUDA_CHECK(cudaEventCreateWithFlags(&compute_mark_, cudaEventDisableTiming));
  }
  ~CudaCopyStream() override {
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(stream_);
    for (auto& [id, e] : live_) (void)cudaEventDestroy(e);
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
    (void)cudaEventDestroy(compute_mark_);
    (void)cudaStreamDestroy(stream_);
  }

  void after_compute() override {
    std::lock_guard<std::mutex> lock(mu_);
    ST_CUDA_CHECK(cudaSetDevice(device_));
    // The wait captures the event's state now, so one event serves every call.
    ST_CUDA_CHECK(cudaEventRecord(compute_mark_, compute_));
    ST_CUDA_CHECK(cudaStreamWaitEvent(stream_, compute_mark_, 0));
  }
  void to_host(void* host, const void* device, size_t bytes) override {
    if (bytes == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    ST_CUDA_CHECK(cudaSetDevice(device_));
    ST_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_));
  }
  void to_device(void* device, const void* host, size_t bytes) override {
    if (bytes == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    ST_CUDA_CHECK(cudaSetDevice(device_));
    ST_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
  }
  uint64_t fence() override {
    std::lock_guard<std::mutex> lock(mu_);
    ST_CUDA_CHECK(cudaSetDevice(device_));
    cudaEvent_t e = nullptr;
    if (!free_.empty()) {
      e = free_.back();
      free_.pop_back();
    } else {
      ST_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    ST_CUDA_CHECK(cudaEventRecord(e, stream_));
    live_.emplace_back(++next_, e);
    return next_;
  }
  void host_wait(uint64_t fence) override {
    cudaEvent_t e = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fence <= completed_) return;
      for (auto& [id, ev] : live_)
        if (id == fence) e = ev;
      if (e == nullptr) return;  // recycled: complete
    }
    ST_CUDA_CHECK(cudaSetDevice(device_));
    ST_CUDA_CHECK(cudaEventSynchronize(e));
    std::lock_guard<std::mutex> lock(mu_);
    // Fences complete in order: every earlier one is done too; their events can be reused.
    while (!live_.empty() && live_.front().first <= fence) {
      free_.push_back(live_.front().second);
      live_.pop_front();
    }
    completed_ = std::max(completed_, fence);
  }
  void compute_waits(uint64_t fence) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fence <= completed_) return;
    ST_CUDA_CHECK(cudaSetDevice(device_));
    for (auto& [id, ev] : live_)
      if (id == fence) ST_CUDA_CHECK(cudaStreamWaitEvent(compute_, ev, 0));
  }

  /// Records `e` after the copies enqueued so far (in their order against other callers).
  void record(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    ST_CUDA_CHECK(cudaSetDevice(device_));
    ST_CUDA_CHECK(cudaEventRecord(e, stream_));
  }

 private:
  int device_;
  cudaStream_t compute_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t compute_mark_ = nullptr;
  std::mutex mu_;
  std::deque<std::pair<uint64_t, cudaEvent_t>> live_;  ///< fences not known complete, in order
  std::vector<cudaEvent_t> free_;
  uint64_t next_ = 0, completed_ = 0;
};

/// Timing events on the compute stream or a CudaCopyStream, against an origin event on the
/// compute stream; the events are kept (and reused) across start()s.
class CudaDeviceTimeline final : public DeviceTimeline {
 public:
  CudaDeviceTimeline(int device, cudaStream_t compute) : device_(device), compute_(compute) {}
  ~CudaDeviceTimeline() override {
    (void)cudaSetDevice(device_);
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  }
  void start() override {
    std::lock_guard<std::mutex> lock(mu_);
    ST_CUDA_CHECK(cudaSetDevice(device_));
    used_ = 0;
    ST_CUDA_CHECK(cudaEventRecord(next_event(), compute_));  // the origin: event 0
    host_origin_ = std::chrono::steady_clock::now();
  }
  size_t mark(CopyStream* copies) override {
    std::lock_guard<std::mutex> lock(mu_);
    ST_CUDA_CHECK(cudaSetDevice(device_));
    cudaEvent_t e = next_event();
    if (copies)
      static_cast<CudaCopyStream*>(copies)->record(e);
    else
      ST_CUDA_CHECK(cudaEventRecord(e, compute_));
    return used_ - 2;  // event 0 is the origin
  }
  std::vector<double> read() override {
    std::lock_guard<std::mutex> lock(mu_);
    ST_CUDA_CHECK(cudaSetDevice(device_));
    std::vector<double> out;
    for (size_t i = 1; i < used_; ++i) {
      ST_CUDA_CHECK(cudaEventSynchronize(events_[i]));
      float ms = 0;
      ST_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[0], events_[i]));
      out.push_back(1e-3 * ms);
    }
    return out;
  }

 private:
  cudaEvent_t next_event() {
    if (used_ == events_.size()) {
      cudaEvent_t e = nullptr;
      ST_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    return events_[used_++];
  }
  int device_;
  cudaStream_t compute_;
  std::vector<cudaEvent_t> events_;
  size_t used_ = 0;
};

std::string gib(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / 1073741824.0);
  return buf;
}

}  // namespace

std::unique_ptr<CopyStream> make_copy_stream(int device, cudaStream_t compute) {
  return std::make_unique<CudaCopyStream>(device, compute);
}

std::unique_ptr<DeviceTimeline> make_device_timeline(int device, cudaStream_t compute) {
  return std::make_unique<CudaDeviceTimeline>(device, compute);
}

void* pinned_allocate(int device, size_t bytes, size_t held) {
  if (bytes == 0) return nullptr;
  ST_CUDA_CHECK(cudaSetDevice(device));
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (err == cudaSuccess) return p;
  (void)cudaGetLastError();
  const int64_t avail = available_host_bytes();
  throw OutOfMemory(
      Memory::kPinnedHost,
      std::string("could not pin ") + gib(static_cast<double>(bytes)) + " of host memory (" +
          std::to_string(bytes) + " bytes) for offloading: cudaHostAlloc: " +
          cudaGetErrorString(err) + "; this process already holds " +
          gib(static_cast<double>(held)) + " pinned and the host " +
          (avail >= 0 ? "has " + gib(static_cast<double>(avail)) + " available"
                      : std::string("reports no available figure")) +
          ". Fix: raise the job's memory limit (container/cgroup memory.max; `ulimit -l unlimited` "
          "or `--ulimit memlock=-1` in containers)");
}

void pinned_free(int device, void* p) noexcept {
  if (p == nullptr) return;
  (void)cudaSetDevice(device);
  (void)cudaFreeHost(p);
}

}  // namespace shardtrain::cuda
