// Helpers of the fuzz targets (tests/fuzz/fuzz_*.cpp): each defines LLVMFuzzerTestOneInput, built
// with libFuzzer by tests/fuzz/CMakeLists.txt (clang) and, in the main build, with replay_main.cpp
// to replay the seed corpus and the regressions in CTest.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace shardtrain::fuzz {

/// The fuzzer's bytes as an in-memory file (memfd) with a path the readers can open, so each
/// path-based reader is fuzzed through its real code. Nothing touches the disk.
class MemoryFile {
 public:
  MemoryFile(const uint8_t* data, size_t size) {
    fd_ = ::memfd_create("fuzz-input", MFD_CLOEXEC);
    size_t done = 0;
    while (fd_ >= 0 && done < size) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemoryFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  bool ok() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

inline std::string_view bytes(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace shardtrain::fuzz
