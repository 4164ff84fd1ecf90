#include "data/idx_file.h"

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <fmt/std.h>
#include <zlib.h>

#include <memory>

#include "core/error.h"

namespace shardtrain {
namespace {

struct GzCloser {
  void operator()(gzFile_s* f) const {
    if (f) gzclose(f);
  }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

/// Reads exactly `n` bytes; false at a premature end of file.
bool read_exact(gzFile f, void* dst, size_t n) {
  auto* p = static_cast<unsigned char*>(dst);
  while (n > 0) {
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n, 1u << 30));
    const int got = gzread(f, p, chunk);
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

}  // namespace

IdxArray read_idx(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw DataError(fmt::format("IDX file {} does not exist or is not a file", path));
  // gzopen reads plain files unchanged, so one path serves both.
  GzFile f(gzopen(path.c_str(), "rb"));
  if (!f) throw DataError(fmt::format("cannot open IDX file {}", path));
  unsigned char magic[4];
  if (!read_exact(f.get(), magic, 4))
    throw DataError(fmt::format("{} is empty or truncated: not an IDX file", path));
  if (magic[0] != 0 || magic[1] != 0)
    throw DataError(fmt::format(
        "{} is not an IDX file (it does not start with two zero bytes); Fashion-MNIST's files are "
        "train-images-idx3-ubyte(.gz) and friends",
        path));
  if (magic[2] != 0x08)
    throw DataError(fmt::format(
        "{} holds IDX elements of type 0x{:02x}; only unsigned bytes (0x08) are supported", path,
        magic[2]));
  const int ndims = magic[3];
  if (ndims < 1 || ndims > 4)
    throw DataError(fmt::format("{} declares {} dimensions; expected 1 to 4", path, ndims));
  IdxArray out;
  uint64_t total = 1;
  for (int d = 0; d < ndims; ++d) {
    unsigned char b[4];
    if (!read_exact(f.get(), b, 4))
      throw DataError(fmt::format("{} is truncated inside its header", path));
    const uint32_t v =
        (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
    out.dims.push_back(v);
    // The product is checked before it is formed: it never wraps.
    if (v != 0 && total > kMaxIdxElements / v)
      total = kMaxIdxElements + 1;
    else
      total *= v;
    if (total > kMaxIdxElements)
      throw DataError(fmt::format(
          "{} declares dimensions {}{}: more than {} elements, too many to be real; the file is "
          "corrupt or not IDX",
          path, fmt::join(out.dims, "×"), d + 1 < ndims ? "×..." : "", kMaxIdxElements));
  }
  const uint64_t header = 4 + 4 * static_cast<uint64_t>(ndims);
  if (gzdirect(f.get()) == 1) {  // an uncompressed file: its size is known before reading
    std::error_code size_error;
    const uint64_t size = std::filesystem::file_size(path, size_error);
    if (!size_error && size != header + total)
      throw DataError(fmt::format(
          "{} is {} bytes but its header (dimensions {}) promises {} bytes of data after {} "
          "bytes of header: the file is {}; download or reinstall it",
          path, size, fmt::join(out.dims, "×"), total, header,
          size < header + total ? "truncated" : "followed by extra bytes"));
  }
  // Read in pieces, so that a compressed file's header cannot make us allocate what its data
  // does not hold.
  constexpr uint64_t kPiece = uint64_t{64} << 20;
  while (out.data.size() < total) {
    const uint64_t have = out.data.size();
    const uint64_t n = std::min(kPiece, total - have);
    out.data.resize(have + n);
    if (!read_exact(f.get(), out.data.data() + have, n))
      throw DataError(fmt::format(
          "{} is truncated: its header promises {} bytes of data (dimensions {}); download or "
          "reinstall it",
          path, total, fmt::join(out.dims, "×")));
  }
  return out;
}

void write_idx(const std::filesystem::path& path, const IdxArray& array) {
  uint64_t total = 1;
  for (int64_t d : array.dims) total *= static_cast<uint64_t>(d);
  if (total != array.data.size() || array.dims.empty() || array.dims.size() > 4)
    throw DataError(fmt::format("write_idx({}): {} bytes do not match dimensions {}", path,
                                array.data.size(), fmt::join(array.dims, "×")));
  const bool gz = path.extension() == ".gz";
  GzFile f(gzopen(path.c_str(), gz ? "wb6" : "wbT"));
  if (!f) throw DataError(fmt::format("cannot create {}", path));
  std::vector<unsigned char> header = {0, 0, 0x08, static_cast<unsigned char>(array.dims.size())};
  for (int64_t d : array.dims)
    for (int s = 24; s >= 0; s -= 8) header.push_back(static_cast<unsigned char>(d >> s));
  bool ok = gzwrite(f.get(), header.data(), static_cast<unsigned>(header.size())) > 0;
  if (!array.data.empty())
    ok = ok && gzwrite(f.get(), array.data.data(), static_cast<unsigned>(array.data.size())) > 0;
  if (!ok || gzclose(f.release()) != Z_OK) throw DataError(fmt::format("writing {} failed", path));
}

}  // namespace shardtrain
