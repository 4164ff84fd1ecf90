#include "io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/hash.h"

namespace shardtrain {

void fsync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0)
    throw RuntimeFailure(
        fmt::format("cannot open {} to sync it: {}", path.string(), std::strerror(errno)));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0 && errno != EINVAL)
    throw RuntimeFailure(fmt::format("fsync {} failed: {}", path.string(), std::strerror(errno)));
}

void write_file_atomic(const std::filesystem::path& path, std::string_view contents) {
  const auto tmp = path.string() + fmt::format(".tmp.{}", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw RuntimeFailure(fmt::format("cannot write {}: {}", tmp, std::strerror(errno)));
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.flush();
    if (!out) throw RuntimeFailure(fmt::format("writing {} failed (disk full?)", tmp));
  }
  fsync_path(tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec)
    throw RuntimeFailure(
        fmt::format("cannot rename {} to {}: {}", tmp, path.string(), ec.message()));
  fsync_path(path.has_parent_path() ? path.parent_path() : std::filesystem::path("."));
}

uint64_t fnv1a64_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw RuntimeFailure(fmt::format("cannot read {}: {}", path.string(), std::strerror(errno)));
  std::vector<char> buf(size_t{1} << 20);
  uint64_t h = fnv1a64(nullptr, 0);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    h = fnv1a64(buf.data(), static_cast<size_t>(in.gcount()), h);
  }
  if (in.bad()) throw RuntimeFailure(fmt::format("reading {} failed", path.string()));
  return h;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read {}: {}", path.string(), std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace shardtrain
