// Host memory bookkeeping for offloading: the default (CPU) pinned allocation and the host's
// available memory.
#include "backend/host_transfer.h"

#include <cstdlib>
#include <fstream>
#include <limits>
#include <new>
#include <sstream>
#include <string>

#include "backend/backend.h"
#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

/// The first integer of file `path`, or -1 ("max" and unreadable files give -1).
int64_t read_int_file(const char* path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word)) return -1;
  try {
    return std::stoll(word);
  } catch (...) {
    return -1;
  }
}

/// Bytes the cgroup of this process may still use, or -1 when it sets no limit.
int64_t cgroup_headroom() {
  int64_t limit = read_int_file("/sys/fs/cgroup/memory.max");  // v2
  int64_t used = read_int_file("/sys/fs/cgroup/memory.current");
  if (limit < 0) {
    limit = read_int_file("/sys/fs/cgroup/memory/memory.limit_in_bytes");  // v1
    used = read_int_file("/sys/fs/cgroup/memory/memory.usage_in_bytes");
  }
  // v1 reports "no limit" as a huge number near LLONG_MAX.
  if (limit < 0 || limit > (int64_t{1} << 60)) return -1;
  return std::max<int64_t>(0, limit - std::max<int64_t>(0, used));
}

}  // namespace

int64_t available_host_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  int64_t avail = -1;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key;
    int64_t kib = 0;
    if (ls >> key >> kib && key == "MemAvailable:") avail = kib * 1024;
  }
  const int64_t cg = cgroup_headroom();
  if (cg >= 0 && (avail < 0 || cg < avail)) avail = cg;
  return avail;
}

void* Backend::allocate_pinned(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, rounded);
  if (p == nullptr) {
    throw OutOfMemory(
        Memory::kPinnedHost,
        fmt::format(
            "out of host memory: could not allocate {} for offloading ({} already held; the "
            "host has {} available). Fix: raise the memory limit of the job",
            human_bytes(static_cast<double>(bytes)),
            human_bytes(static_cast<double>(pinned_bytes_)),
            human_bytes(static_cast<double>(available_host_bytes()))));
  }
  pinned_bytes_ += bytes;
  return p;
}

void Backend::free_pinned(void* ptr, size_t bytes) noexcept {
  if (ptr == nullptr) return;
  std::free(ptr);
  pinned_bytes_ -= bytes;
}

}  // namespace shardtrain
