// NVMe swap of ZeRO-Infinity: state paged to one file per rank with direct asynchronous I/O.
//
// A SwapFile is one preallocated, nameless file under the nvme_path directory, opened with O_DIRECT (page
// cache bypassed), read and written asynchronously by a small pool of threads issuing
// pread/pwrite. A transfer is split into requests of aio.block_size bytes; at most
// aio.queue_depth of them are in flight at once (AioConfig in config/config.h maps DeepSpeed's
// "aio" keys). The caller lays out its regions in the file (4096-byte aligned), starts transfers
// with read_async/write_async and waits on the tickets they return. Nothing here knows about
// strategies or tensors.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "config/config.h"

namespace shardtrain {

/// Alignment of file offsets, host addresses and sizes for O_DIRECT: 4096 bytes.
int64_t swap_alignment();

/// `bytes` rounded up to a multiple of swap_alignment().
int64_t swap_round_up(int64_t bytes);

/// Host memory aligned for O_DIRECT: swap_alignment()-aligned, its size rounded up to a multiple
/// of swap_alignment(), zero-filled. Move-only; freed by the destructor.
class AlignedHostBuffer {
 public:
  AlignedHostBuffer() = default;
  /// Allocates swap_round_up(bytes) bytes (none for bytes 0). Throws RuntimeFailure when the
  /// allocation fails.
  explicit AlignedHostBuffer(int64_t bytes);
  ~AlignedHostBuffer();
  AlignedHostBuffer(AlignedHostBuffer&& other) noexcept;
  AlignedHostBuffer& operator=(AlignedHostBuffer&& other) noexcept;
  AlignedHostBuffer(const AlignedHostBuffer&) = delete;
  AlignedHostBuffer& operator=(const AlignedHostBuffer&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  /// The allocated size: a multiple of swap_alignment().
  int64_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;
};

/// One asynchronous transfer of a SwapFile. id 0 is a transfer that had nothing to do.
struct SwapTicket {
  uint64_t id = 0;
};

/// A swap file of one rank: `dir`/shardtrain-<kind>-rank<rank>-<pid>.bin (kind "swap" for the
/// optimizer state, "params" for stage 3's parameters).
///
/// - Created (truncated) and preallocated with fallocate (or sparse), so a fresh file reads as
///   zeros; removed by the destructor after all its
///   transfers are done, so files go away when the run ends or unwinds after an error (not after
///   SIGKILL: the pid in the name keeps a later run from colliding with a leftover).
/// - Opened with O_DIRECT. A filesystem that refuses it (EINVAL at open or at a first probe
///   write, e.g. tmpfs before Linux 6.6 or some FUSE mounts) gets buffered I/O instead, with
///   direct() false so that the caller can warn. The environment variable
///   SHARDTRAIN_SWAP_DIRECT=0 asks for buffered I/O.
/// - Transfers: file offset and host address multiples of swap_alignment(), and (what O_DIRECT
///   needs of each request) the byte count a multiple of swap_alignment() too: callers round
///   their regions up (swap_round_up) and allocate host buffers accordingly (AlignedHostBuffer
///   does). The same rules hold under buffered I/O, so code that works on one works on both.
///   Each transfer is split into aio.block_size requests run by aio.thread_count threads with at
///   most aio.queue_depth in flight; short reads and writes are continued, EINTR retried.
/// - Transfers in flight at once run in no particular order: wait for a write before reading the
///   same bytes back. The host memory of a transfer must stay valid until it is waited for.
/// - Thread-safe: transfers may be started and waited for from several threads.
class SwapFile {
 public:
  /// Creates the file of swap_round_up(bytes) bytes (at least swap_alignment()). Throws
  /// RuntimeFailure when the directory's filesystem has too little free space (naming the bytes
  /// needed and free) or the file cannot be created or preallocated, and ConfigError for an
  /// invalid `aio` (naming the aio key).
  SwapFile(const std::string& dir, int rank, int64_t bytes, const AioConfig& aio,
           const std::string& kind = "swap");
  /// Waits for every transfer (errors are dropped), closes and removes the file.
  ~SwapFile();
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;

  /// Starts writing `bytes` bytes at `host` to the file at `file_offset`.
  SwapTicket write_async(int64_t file_offset, const void* host, int64_t bytes);
  /// Starts reading `bytes` bytes of the file at `file_offset` into `host`.
  SwapTicket read_async(int64_t file_offset, void* host, int64_t bytes);

  /// Blocks until the transfer is done. Throws RuntimeFailure naming the file, offset, bytes and
  /// the system's error text when one of its requests failed. A ticket already waited for (or
  /// collected by wait_all) returns at once.
  void wait(SwapTicket ticket);
  /// Whether the transfer is done (successfully or not: wait() reports the error).
  bool done(SwapTicket ticket);
  /// Blocks until every transfer started so far is done; throws the first error among the
  /// transfers not yet waited for (all of them are collected).
  void wait_all();

  /// Where the file lives, for messages: `nvme_path`/shardtrain-KIND-rankR-PID.bin. The file
  /// itself has no name (O_TMPFILE, or unlinked as soon as it is opened where the filesystem
  /// lacks O_TMPFILE), so nothing is left behind on any exit; this is the name it would have.
  const std::string& path() const;
  /// The open file's size as the filesystem reports it (fstat), in bytes.
  int64_t file_size() const;
  /// Size of the file: a multiple of swap_alignment().
  int64_t bytes() const;
  /// Whether I/O bypasses the page cache (O_DIRECT); false: buffered fallback.
  bool direct() const;
  const AioConfig& aio() const;
  /// Bytes transferred by completed requests.
  int64_t bytes_read() const;
  int64_t bytes_written() const;
  /// The most requests that have run at once so far: at most min(thread_count, queue_depth).
  int peak_in_flight() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Checks before training that `dir` can hold `bytes_needed` bytes of swap files: it exists, is a
/// directory, is writable (access(W_OK) and creating and removing a probe file) and its
/// filesystem has at least `bytes_needed` bytes free for unprivileged users (statvfs f_bavail *
/// f_frsize). Throws ConfigError naming `key` (e.g. "zero_optimization.offload_optimizer.
/// nvme_path"), the path, the bytes needed and free, and the fix.
void check_nvme_path(const std::string& dir, int64_t bytes_needed, const std::string& key);

}  // namespace shardtrain
