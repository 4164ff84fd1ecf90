// Stage 3's parameters paged from NVMe (ZeRO-Infinity's parameter half: Rajbhandari et al.,
// "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep Learning", arXiv 2104.07857,
// §5 "infinity offload engine"): the rank's slices of the units that do not fit
// offload_param.max_in_cpu live in a swap file (parallel/offload/nvme_swap.h), one 4096-aligned
// region per unit, and reach the GPU through a few pinned staging buffers
// (offload_param.buffer_count):
//
//   swap file ──read ahead (prefetch)──▶ pinned buffer ──copy stream──▶ the unit's all-gather
//   CPU AdamW result (host) ──write (update task)──▶ swap file
//
// A buffer holding a unit is reused once the copy that read it has completed. Host memory: the
// buffers only. The strategy reads a unit ahead only once its latest update has been written
// (its optimizer part published), and drops every staged copy when the parameters change.
// Used from the strategy's thread, except write(), which the optimizer's worker calls: it touches
// only the file (SwapFile is thread-safe).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/host_transfer.h"
#include "memory/host_buffer.h"
#include "parallel/offload/nvme_swap.h"

namespace shardtrain {

class ParamSwap {
 public:
  /// `numel[u]`: elements of unit u's slice on NVMe (0: not on NVMe), `dtype` each; `buffers`
  /// pinned staging buffers (>= 2) of the largest slice. Throws ConfigError for a missing or
  /// too small `dir` (naming offload_param.nvme_path) and RuntimeFailure when the pinned memory
  /// cannot be had.
  ParamSwap(Backend& backend, const std::string& dir, int rank, const AioConfig& aio, DType dtype,
            std::vector<int64_t> numel, int buffers);
  ~ParamSwap();
  ParamSwap(const ParamSwap&) = delete;
  ParamSwap& operator=(const ParamSwap&) = delete;

  /// Whether unit u's slice lives on NVMe.
  bool on_nvme(int u) const { return numel_[static_cast<size_t>(u)] > 0; }
  /// Starts reading unit u into a free buffer unless a buffer holds it already; does nothing
  /// when every buffer is taken by a unit read but not yet copied.
  void prefetch(int u);
  /// Unit u's slice in a pinned buffer, its read complete ([numel], host). The buffer stays
  /// reserved until release().
  Tensor acquire(int u);
  /// The buffer of unit u may be reused once fence `fence` of `copies` (the copy that reads it)
  /// has completed.
  void release(int u, CopyStream& copies, uint64_t fence);
  /// Forgets every staged copy (the parameters are about to change); waits for the reads and
  /// copies still using the buffers.
  void drop_all();
  /// Writes `count` elements of `src` (dtype, host memory), zeros after them, as unit u's slice;
  /// blocks until it is on disk. Any thread.
  void write(int u, const void* src, int64_t count);

  size_t pinned_bytes() const;
  size_t nvme_bytes() const;

 private:
  struct Buffer {
    PinnedBuffer mem;
    int unit = -1;          ///< unit held (read issued), or -1
    bool reserved = false;  ///< acquired, not yet released
    SwapTicket read;
    CopyStream* copies = nullptr;  ///< the copy reading it, until host-waited
    uint64_t fence = 0;
  };
  Buffer* holding(int u);
  /// Bytes of unit u's region: its slice rounded up to the O_DIRECT alignment.
  int64_t region_bytes(size_t u) const;
  /// A buffer that may be overwritten now (waits for its copy), oldest first; null if every
  /// buffer is reserved.
  Buffer* free_buffer();
  void settle(Buffer& b);

  std::vector<int64_t> numel_, region_;
  DType dtype_;
  std::unique_ptr<SwapFile> file_;
  std::vector<Buffer> buffers_;
  size_t next_ = 0;
};

}  // namespace shardtrain
