// Opening files a user names: a path that is missing, a directory, or a device (/dev/zero) is
// said as such, and a file read whole into memory has a size limit.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace shardtrain {

/// Why `path` cannot be read as a regular file: "" when it can, else "not found", "is a
/// directory, not a file" or "is not a regular file (a device, pipe or socket)". Follows
/// symbolic links.
std::string regular_file_problem(const std::filesystem::path& path);

/// The whole of the regular file `path`, or a one-line problem.
struct FileInput {
  std::string bytes;
  std::string
      error;  ///< "" when read; else e.g. "DeepSpeed config ds.json is a directory, not a file"
};

/// Reads the regular file `path` whole when it holds at most `max_bytes` bytes. `what` names
/// its role in the error ("DeepSpeed config"). Never throws for bad input; std::bad_alloc only.
FileInput read_input_file(const std::filesystem::path& path, std::string_view what,
                          uint64_t max_bytes);

/// read_input_file(), throwing E(error) when the file cannot be read.
template <typename E>
std::string read_input_file_or_throw(const std::filesystem::path& path, std::string_view what,
                                     uint64_t max_bytes) {
  FileInput f = read_input_file(path, what, max_bytes);
  if (!f.error.empty()) throw E(f.error);
  return std::move(f.bytes);
}

/// The size limit for configuration-like files read whole (JSON configs, manifests, hostfiles,
/// indexes): 64 MiB, far above any real one.
inline constexpr uint64_t kMaxConfigFileBytes = 64ull << 20;

}  // namespace shardtrain
