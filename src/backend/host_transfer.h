// Host memory for transfers and the copy stream beside the compute stream: what offloading
// (ZeRO-Offload, Ren et al., arXiv 2101.06840, §4) needs from a backend. Gradients leave the
// device and updated parameters return to it on a stream of their own, ordered against the compute
// stream by fences, so that the copies overlap computation.
//
// The defaults here are the CPU backend's: "device" memory is host memory, copies are memcpy and
// run at once, so every fence is complete when it is taken. The CUDA backend gives pinned memory
// (cudaHostAlloc) and a CUDA stream with events (backend/cuda/cuda_host_transfer.cu).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

namespace shardtrain {

/// Copies between host memory and a backend's device on a stream of their own. Thread-safe: one
/// thread may enqueue copies while others wait on fences.
class CopyStream {
 public:
  virtual ~CopyStream() = default;
  /// Copies enqueued from now on start after the work enqueued on the compute stream so far.
  virtual void after_compute() {}
  /// Enqueues a device → host copy of `bytes` (host memory from Backend::allocate_pinned).
  virtual void to_host(void* host, const void* device, size_t bytes) {
    if (bytes) std::memcpy(host, device, bytes);
  }
  /// Enqueues a host → device copy of `bytes`.
  virtual void to_device(void* device, const void* host, size_t bytes) {
    if (bytes) std::memcpy(device, host, bytes);
  }
  /// A fence after the copies enqueued so far; fences of one stream increase and complete in
  /// order.
  virtual uint64_t fence() { return ++fences_; }
  /// Blocks the calling thread until the copies before `fence` are done. Throws RuntimeFailure
  /// when a copy failed.
  virtual void host_wait(uint64_t /*fence*/) {}
  /// Work enqueued on the compute stream from now on starts after the copies before `fence`.
  virtual void compute_waits(uint64_t /*fence*/) {}

 private:
  uint64_t fences_ = 0;
};

/// Timestamps of device work on the compute stream and on copy streams, in seconds from one
/// origin: what a step's timeline (--trace) is drawn from. The default (CPU backend) takes the
/// host's clock at each call, where the work has already run. Thread-safe.
class DeviceTimeline {
 public:
  virtual ~DeviceTimeline() = default;
  /// Sets the origin at the compute stream's position now and forgets earlier marks. Call with
  /// the device idle, so that the origin is also the host's now (host_origin()).
  virtual void start() {
    std::lock_guard<std::mutex> lock(mu_);
    host_origin_ = std::chrono::steady_clock::now();
    marks_.clear();
  }
  /// A timestamp after the work enqueued so far on `copies` (nullptr: the compute stream).
  /// Returns its index for read().
  virtual size_t mark(CopyStream* /*copies*/) {
    std::lock_guard<std::mutex> lock(mu_);
    marks_.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - host_origin_).count());
    return marks_.size() - 1;
  }
  /// Seconds from the origin of every mark since start(), by index; waits for them.
  virtual std::vector<double> read() {
    std::lock_guard<std::mutex> lock(mu_);
    return marks_;
  }
  std::chrono::steady_clock::time_point host_origin() const { return host_origin_; }

 protected:
  std::mutex mu_;
  std::chrono::steady_clock::time_point host_origin_ = std::chrono::steady_clock::now();

 private:
  std::vector<double> marks_;
};

/// The bytes of host memory this process can still lock and use: MemAvailable of /proc/meminfo,
/// capped by the cgroup's memory.max (v2) or memory.limit_in_bytes (v1) minus its usage.
/// -1 when unknown.
int64_t available_host_bytes();

}  // namespace shardtrain
