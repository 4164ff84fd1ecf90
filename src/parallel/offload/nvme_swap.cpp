// NVMe swap of ZeRO-Infinity: a thread pool issuing pread/pwrite on a file opened with O_DIRECT.
#include "parallel/offload/nvme_swap.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {

namespace {

constexpr int64_t kAlignment = 4096;

/// The system's text for an errno value (thread-safe, unlike strerror).
std::string errno_text(int err) {
  char buf[256];
  // The GNU strerror_r returns the message (maybe not in buf); the XSI one returns 0 on success.
  auto r = strerror_r(err, buf, sizeof(buf));
  if constexpr (std::is_same_v<decltype(r), char*>) {
    return r;
  } else {
    return r == 0 ? std::string(buf) : fmt::format("error {}", err);
  }
}

/// "12.30 GiB (13207024435 bytes)".
std::string bytes_text(int64_t bytes) {
  return fmt::format("{} ({} bytes)", human_bytes(static_cast<double>(bytes)), bytes);
}

/// Bytes free for unprivileged users on the filesystem of `dir`, or nullopt (errno set).
std::optional<int64_t> free_bytes(const std::string& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return std::nullopt;
  const unsigned long long free = static_cast<unsigned long long>(st.f_bavail) * st.f_frsize;
  return static_cast<int64_t>(std::min<unsigned long long>(free, INT64_MAX));
}

bool aligned(int64_t v) { return v % kAlignment == 0; }

/// A bug in the code calling SwapFile (as ST_ASSERT, with the numbers).
[[noreturn]] void misuse(const std::string& path, const std::string& what) {
  throw Error(fmt::format(
      "internal error: swap file '{}': {} — this is a bug in shardtrain, please report it", path,
      what));
}

}  // namespace

int64_t swap_alignment() { return kAlignment; }

int64_t swap_round_up(int64_t bytes) {
  ST_ASSERT(bytes >= 0);
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// ---- AlignedHostBuffer --------------------------------------------------------------------------

AlignedHostBuffer::AlignedHostBuffer(int64_t bytes) {
  ST_ASSERT(bytes >= 0);
  if (bytes == 0) return;
  const int64_t rounded = swap_round_up(bytes);
  data_ =
      std::aligned_alloc(static_cast<std::size_t>(kAlignment), static_cast<std::size_t>(rounded));
  if (data_ == nullptr) {
    throw RuntimeFailure(fmt::format(
        "cannot allocate {} of aligned host memory (offloaded optimizer state or NVMe staging)",
        bytes_text(rounded)));
  }
  std::memset(data_, 0, static_cast<std::size_t>(rounded));
  bytes_ = rounded;
}

AlignedHostBuffer::~AlignedHostBuffer() { std::free(data_); }

AlignedHostBuffer::AlignedHostBuffer(AlignedHostBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

AlignedHostBuffer& AlignedHostBuffer::operator=(AlignedHostBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

// ---- SwapFile -----------------------------------------------------------------------------------

struct SwapFile::Impl {
  /// One pread/pwrite of at most aio.block_size bytes, part of a transfer.
  struct Request {
    uint64_t ticket;
    bool write;
    int64_t offset;  ///< in the file
    char* host;
    int64_t bytes;
    int64_t transfer_offset;  ///< the whole transfer's, for error messages
    int64_t transfer_bytes;
  };
  /// A transfer in progress, or failed and not yet waited for.
  struct Transfer {
    int64_t pending = 0;  ///< requests not yet done
    std::string error;    ///< the first failure
  };

  std::string path;
  int fd = -1;
  int64_t bytes = 0;
  bool direct = false;
  AioConfig aio;

  std::mutex mu;
  std::condition_variable work_cv;  ///< a request can start, or stop
  std::condition_variable done_cv;  ///< a request completed
  std::deque<Request> queue;        ///< requests not started, in submission order
  int in_flight = 0;                ///< requests running (<= aio.queue_depth)
  int peak_in_flight = 0;
  bool stop = false;
  uint64_t next_ticket = 1;
  std::unordered_map<uint64_t, Transfer> transfers;
  std::vector<std::thread> threads;

  std::atomic<int64_t> read_total{0};
  std::atomic<int64_t> written_total{0};

  /// Runs one request to its end (short transfers continued, EINTR retried); "" or the error.
  std::string run(const Request& r) {
    int64_t done = 0;
    while (done < r.bytes) {
      const auto count = static_cast<std::size_t>(r.bytes - done);
      const ssize_t n = r.write ? ::pwrite(fd, r.host + done, count, r.offset + done)
                                : ::pread(fd, r.host + done, count, r.offset + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string why =
            n < 0 ? errno_text(errno)
                  : (r.write ? "the device accepted no more bytes" : "unexpected end of file");
        return fmt::format(
            "cannot {} swap file '{}': {} bytes at offset {} (a request of {} bytes at offset "
            "{}{}): {}",
            r.write ? "write" : "read", path, r.transfer_bytes, r.transfer_offset, r.bytes - done,
            r.offset + done, direct ? ", O_DIRECT" : "", why);
      }
      done += n;
    }
    (r.write ? written_total : read_total).fetch_add(r.bytes, std::memory_order_relaxed);
    return {};
  }

  void worker() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      work_cv.wait(lock, [&] { return stop || (!queue.empty() && in_flight < aio.queue_depth); });
      if (queue.empty() || in_flight >= aio.queue_depth) {
        if (stop) return;
        continue;
      }
      const Request r = queue.front();
      queue.pop_front();
      peak_in_flight = std::max(peak_in_flight, ++in_flight);
      lock.unlock();
      std::string error = run(r);
      lock.lock();
      --in_flight;
      auto it = transfers.find(r.ticket);
      ST_ASSERT(it != transfers.end());
      if (!error.empty() && it->second.error.empty()) it->second.error = std::move(error);
      if (--it->second.pending == 0 && it->second.error.empty()) transfers.erase(it);
      done_cv.notify_all();
      // This thread takes the next request itself; wake another in case there are several.
      if (!queue.empty()) work_cv.notify_one();
    }
  }

  SwapTicket submit(bool write, int64_t offset, char* host, int64_t n) {
    const char* op = write ? "write_async" : "read_async";
    if (offset < 0 || n < 0 || offset > bytes || n > bytes - offset) {
      misuse(path, fmt::format("{} of {} bytes at offset {} is outside the file of {} bytes", op, n,
                               offset, bytes));
    }
    if (!aligned(offset) || !aligned(n) ||
        reinterpret_cast<std::uintptr_t>(host) % static_cast<std::uintptr_t>(kAlignment) != 0) {
      misuse(path, fmt::format("{} of {} bytes at offset {} from host address {}: the offset, "
                               "the size and the address must be multiples of {}",
                               op, n, offset, static_cast<const void*>(host), kAlignment));
    }
    if (n == 0) return SwapTicket{};
    std::lock_guard<std::mutex> lock(mu);
    const uint64_t id = next_ticket++;
    Transfer& t = transfers[id];
    for (int64_t at = 0; at < n; at += aio.block_size) {
      queue.push_back(
          Request{id, write, offset + at, host + at, std::min(aio.block_size, n - at), offset, n});
      ++t.pending;
    }
    work_cv.notify_all();
    return SwapTicket{id};
  }

  /// Waits until no request is queued or running (lock held).
  void drain(std::unique_lock<std::mutex>& lock) {
    done_cv.wait(lock, [&] { return queue.empty() && in_flight == 0; });
  }

  /// Closes the file; having no name, it is gone with its descriptor.
  void close_and_remove() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

SwapFile::SwapFile(const std::string& dir, int rank, int64_t bytes, const AioConfig& aio,
                   const std::string& kind)
    : impl_(std::make_unique<Impl>()) {
  check<ConfigError>(aio.block_size >= kAlignment && aligned(aio.block_size),
                     "aio.block_size {} is not valid: use a multiple of {} bytes (O_DIRECT "
                     "alignment), e.g. 1048576",
                     aio.block_size, kAlignment);
  check<ConfigError>(aio.queue_depth >= 1,
                     "aio.queue_depth {} is not valid: use an integer >= 1, e.g. 8",
                     aio.queue_depth);
  check<ConfigError>(aio.thread_count >= 1 && aio.thread_count <= 256,
                     "aio.thread_count {} is not valid: use an integer in [1, 256], e.g. 1",
                     aio.thread_count);
  ST_ASSERT(bytes >= 0);
  Impl& m = *impl_;
  m.aio = aio;
  m.bytes = std::max(kAlignment, swap_round_up(bytes));
  m.path = (std::filesystem::path(dir) /
            fmt::format("shardtrain-{}-rank{}-{}.bin", kind, rank, static_cast<long>(::getpid())))
               .string();

  // Refuse up front rather than let fallocate fill the disk part way.
  if (auto free = free_bytes(dir); free && *free < m.bytes) {
    throw RuntimeFailure(fmt::format(
        "not enough free space for the swap file '{}': it needs {}, its filesystem has {} free: "
        "free some space or choose an nvme_path with more",
        m.path, bytes_text(m.bytes), bytes_text(*free)));
  }

  // The file has no name once it is open (O_TMPFILE; where the filesystem lacks it, a named file
  // unlinked at once), so no exit — SIGTERM, SIGKILL, a restart by launch — leaves it behind:
  // its blocks return to the filesystem when the descriptor closes.
  const auto open_unnamed = [&](int extra) {
    int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC | extra, 0600);
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR)) {
      fd = ::open(m.path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | extra, 0600);
      if (fd >= 0) ::unlink(m.path.c_str());
    }
    return fd;
  };
  const char* env = std::getenv("SHARDTRAIN_SWAP_DIRECT");
  const bool want_direct = env == nullptr || std::string(env) != "0";
  if (want_direct) {
    m.fd = open_unnamed(O_DIRECT);
    m.direct = m.fd >= 0;
  }
  if (m.fd < 0 && (!want_direct || errno == EINVAL)) {  // EINVAL: O_DIRECT refused
    m.fd = open_unnamed(0);
  }
  if (m.fd < 0) {
    const int err = errno;
    throw RuntimeFailure(fmt::format("cannot create the swap file '{}': {}: check nvme_path",
                                     m.path, errno_text(err)));
  }
  try {
    if (::fallocate(m.fd, 0, 0, m.bytes) != 0) {
      const int err = errno;
      if (err == ENOSPC) {
        const auto free = free_bytes(dir);
        throw RuntimeFailure(fmt::format(
            "not enough free space for the swap file '{}': it needs {}, its filesystem has {} "
            "free: free some space or choose an nvme_path with more",
            m.path, bytes_text(m.bytes), free ? bytes_text(*free) : std::string("unknown")));
      }
      // A filesystem without fallocate: a sparse file of the size (blocks allocated on write).
      if ((err != EOPNOTSUPP && err != ENOSYS) || ::ftruncate(m.fd, m.bytes) != 0) {
        throw RuntimeFailure(fmt::format("cannot allocate {} for the swap file '{}': {}",
                                         bytes_text(m.bytes), m.path, errno_text(errno)));
      }
    }
    if (m.direct) {
      // Some filesystems accept O_DIRECT at open and refuse it on I/O: probe one block.
      AlignedHostBuffer probe(kAlignment);
      if (::pwrite(m.fd, probe.data(), static_cast<std::size_t>(kAlignment), 0) < 0) {
        const int err = errno;
        if (err != EINVAL) {
          throw RuntimeFailure(
              fmt::format("cannot write the swap file '{}': {}", m.path, errno_text(err)));
        }
        // Buffered I/O on the same (nameless) file.
        m.direct = false;
        const int fl = ::fcntl(m.fd, F_GETFL);
        if (fl < 0 || ::fcntl(m.fd, F_SETFL, fl & ~O_DIRECT) != 0) {
          throw RuntimeFailure(fmt::format("cannot turn O_DIRECT off for the swap file '{}': {}",
                                           m.path, errno_text(errno)));
        }
      }
    }
    m.threads.reserve(static_cast<std::size_t>(aio.thread_count));
    for (int i = 0; i < aio.thread_count; ++i) m.threads.emplace_back([&m] { m.worker(); });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(m.mu);
      m.stop = true;
    }
    m.work_cv.notify_all();
    for (auto& t : m.threads) t.join();
    m.close_and_remove();
    throw;
  }
}

SwapFile::~SwapFile() {
  Impl& m = *impl_;
  {
    std::unique_lock<std::mutex> lock(m.mu);
    m.drain(lock);
    m.stop = true;
  }
  m.work_cv.notify_all();
  for (auto& t : m.threads) t.join();
  m.close_and_remove();
}

SwapTicket SwapFile::write_async(int64_t file_offset, const void* host, int64_t bytes) {
  // pwrite only reads the host memory; Request keeps one pointer type for both directions.
  return impl_->submit(true, file_offset, static_cast<char*>(const_cast<void*>(host)), bytes);
}

SwapTicket SwapFile::read_async(int64_t file_offset, void* host, int64_t bytes) {
  return impl_->submit(false, file_offset, static_cast<char*>(host), bytes);
}

void SwapFile::wait(SwapTicket ticket) {
  if (ticket.id == 0) return;
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  m.done_cv.wait(lock, [&] {
    auto it = m.transfers.find(ticket.id);
    return it == m.transfers.end() || it->second.pending == 0;
  });
  auto it = m.transfers.find(ticket.id);
  if (it == m.transfers.end()) return;
  std::string error = std::move(it->second.error);
  m.transfers.erase(it);
  throw RuntimeFailure(error);
}

bool SwapFile::done(SwapTicket ticket) {
  if (ticket.id == 0) return true;
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->transfers.find(ticket.id);
  return it == impl_->transfers.end() || it->second.pending == 0;
}

void SwapFile::wait_all() {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  m.drain(lock);
  // Only failed transfers are left: report the first one started.
  if (m.transfers.empty()) return;
  auto first = std::min_element(m.transfers.begin(), m.transfers.end(),
                                [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string error = std::move(first->second.error);
  const std::size_t failed = m.transfers.size();
  m.transfers.clear();
  if (failed > 1) error += fmt::format(" (and {} more failed transfers)", failed - 1);
  throw RuntimeFailure(error);
}

const std::string& SwapFile::path() const { return impl_->path; }

int64_t SwapFile::file_size() const {
  struct stat st {};
  if (::fstat(impl_->fd, &st) != 0)
    throw RuntimeFailure(
        fmt::format("cannot stat the swap file '{}': {}", impl_->path, errno_text(errno)));
  return static_cast<int64_t>(st.st_size);
}
int64_t SwapFile::bytes() const { return impl_->bytes; }
bool SwapFile::direct() const { return impl_->direct; }
const AioConfig& SwapFile::aio() const { return impl_->aio; }
int64_t SwapFile::bytes_read() const { return impl_->read_total.load(); }
int64_t SwapFile::bytes_written() const { return impl_->written_total.load(); }
int SwapFile::peak_in_flight() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->peak_in_flight;
}

// ---- check_nvme_path ----------------------------------------------------------------------------

void check_nvme_path(const std::string& dir, int64_t bytes_needed, const std::string& key) {
  const std::string need = bytes_text(bytes_needed);
  if (dir.empty()) {
    throw ConfigError(fmt::format(
        "{} is empty: set it to a directory on a local NVMe drive with at least {} free", key,
        need));
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) {
      throw ConfigError(fmt::format(
          "{} '{}' does not exist: create it (mkdir -p {}) or choose an existing directory; the "
          "swap files need {} there",
          key, dir, dir, need));
    }
    throw ConfigError(fmt::format(
        "{} '{}' cannot be accessed: {}: fix its permissions or choose another directory; the "
        "swap files need {} there",
        key, dir, errno_text(err), need));
  }
  if (!S_ISDIR(st.st_mode)) {
    throw ConfigError(fmt::format(
        "{} '{}' is not a directory: choose a directory (the swap files, {}, are created in it)",
        key, dir, need));
  }
  const auto unwritable = [&](int err) {
    return ConfigError(fmt::format(
        "{} '{}' is not writable: {}: fix its permissions (e.g. chmod u+rwx '{}') or choose a "
        "directory you can write to; the swap files need {} there",
        key, dir, errno_text(err), dir, need));
  };
  if (::access(dir.c_str(), W_OK | X_OK) != 0) throw unwritable(errno);
  static std::atomic<int> probes{0};
  const std::string probe =
      (std::filesystem::path(dir) /
       fmt::format(".shardtrain-probe-{}-{}", static_cast<long>(::getpid()), probes++))
          .string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw unwritable(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  const auto free = free_bytes(dir);
  if (!free) {
    throw ConfigError(fmt::format("{} '{}': cannot read the free space of its filesystem: {}", key,
                                  dir, errno_text(errno)));
  }
  if (*free < bytes_needed) {
    throw ConfigError(fmt::format(
        "{} '{}' has too little free space: the swap files need {}, its filesystem has {} free: "
        "free some space or choose a path with more space",
        key, dir, need, bytes_text(*free)));
  }
}

}  // namespace shardtrain
