// Token files: memory-mapped validated reading and streaming writing (see token_store.h).
#include "data/token_store.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "core/error.h"
#include "core/hash.h"

namespace shardtrain {
namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'S', 'T', 'T', 'O', 'K', 'E', 'N', 'S'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kBytesPerId = 2;
constexpr size_t kHeaderBytes = 64;
constexpr uint64_t kFnvSeed = 14695981039346656037ull;
/// Bytes validated before they are dropped from the page tables again.
constexpr size_t kValidateWindow = size_t{16} << 20;

void put_u32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

uint16_t byte_swap(uint16_t v) { return static_cast<uint16_t>((v >> 8) | (v << 8)); }

std::string errno_text(int err) { return std::strerror(err); }

std::string fix_for(TokenFileRole role) {
  return role == TokenFileRole::kCache ? "delete it and it will be rebuilt"
                                       : "re-run shardtrain tokenize FILE --output to recreate it";
}

/// Closes a file descriptor at scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

/// A read-only mapping of a whole file, unmapped when the last TokenStore using it goes.
struct Mapping {
  void* addr = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (addr != nullptr) ::munmap(addr, bytes);
  }
};

/// Largest id of little-endian ids stored at `p` (n of them), in host order.
uint16_t largest_le(const uint16_t* p, size_t n) {
  uint16_t largest = 0;
  if constexpr (std::endian::native == std::endian::little) {
    for (size_t i = 0; i < n; ++i) largest = std::max(largest, p[i]);  // vectorized
  } else {
    for (size_t i = 0; i < n; ++i) largest = std::max(largest, byte_swap(p[i]));
  }
  return largest;
}

}  // namespace

bool is_token_file(const fs::path& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  char magic[sizeof(kMagic)];
  const size_t got = std::fread(magic, 1, sizeof(magic), f);
  std::fclose(f);
  return got == sizeof(magic) && std::memcmp(magic, kMagic, sizeof(kMagic)) == 0;
}

// ---- TokenStore --------------------------------------------------------------------------------

TokenStore::TokenStore(std::vector<uint16_t> ids) {
  auto owned = std::make_shared<const std::vector<uint16_t>>(std::move(ids));
  data_ = owned->data();
  size_ = owned->size();
  for (const uint16_t id : *owned) largest_ = std::max(largest_, id);  // vectorized
  keep_ = std::move(owned);
}

TokenStore TokenStore::map_file(const fs::path& path, TokenFileHeader* header, TokenFileRole role) {
  const char* what = role == TokenFileRole::kCache ? "token cache" : "token file";
  const std::string name = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      throw DataError(fmt::format("{} {} not found: check the path", what, name));
    }
    throw DataError(fmt::format("cannot open {} {}: {}", what, name, errno_text(err)));
  }
  FdCloser closer{fd};

  unsigned char h[kHeaderBytes];
  size_t got = 0;
  while (got < kHeaderBytes) {
    const ssize_t r = ::pread(fd, h + got, kHeaderBytes - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;  // end of file, or not readable (a directory): judged by the magic
    got += static_cast<size_t>(r);
  }
  if (got < sizeof(kMagic) || std::memcmp(h, kMagic, sizeof(kMagic)) != 0) {
    throw DataError(fmt::format(
        "{} is not a shardtrain token file (no STTOKENS magic): pass the text file instead, or "
        "create a token file with shardtrain tokenize FILE --output",
        name));
  }
  if (got < kHeaderBytes) {
    throw DataError(
        fmt::format("{} {} is truncated ({} bytes, shorter than the {}-byte header): {}", what,
                    name, got, kHeaderBytes, fix_for(role)));
  }
  const uint32_t version = get_u32(h + 8);
  if (version != kVersion) {
    throw DataError(fmt::format("{} {} has format version {}, this shardtrain reads version {}: {}",
                                what, name, version, kVersion, fix_for(role)));
  }
  const uint32_t bytes_per_id = get_u32(h + 12);
  if (bytes_per_id != kBytesPerId) {
    throw DataError(fmt::format("{} {} stores {} bytes per id, expected {}: {}", what, name,
                                bytes_per_id, kBytesPerId, fix_for(role)));
  }
  TokenFileHeader hdr;
  hdr.count = get_u64(h + 16);
  hdr.source_hash = get_u64(h + 24);
  hdr.tokenizer_hash = get_u64(h + 32);
  const uint64_t ids_hash = get_u64(h + 40);

  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    throw DataError(fmt::format("cannot stat {} {}: {}", what, name, errno_text(errno)));
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  const uint64_t payload = size - kHeaderBytes;  // size ≥ 64: the header was read
  if (hdr.count > payload / kBytesPerId || payload != hdr.count * kBytesPerId) {
    throw DataError(fmt::format(
        "{} {} is corrupt ({}: the header says {} ids, the file holds {} bytes after the "
        "header): {}",
        what, name, hdr.count > payload / kBytesPerId ? "truncated" : "size mismatch", hdr.count,
        payload, fix_for(role)));
  }
  auto map = std::make_shared<Mapping>();
  map->addr = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
  if (map->addr == MAP_FAILED) {
    map->addr = nullptr;
    throw DataError(fmt::format("cannot read {} {}: mmap of {} bytes failed: {}", what, name, size,
                                errno_text(errno)));
  }
  map->bytes = static_cast<size_t>(size);
  const auto* base = static_cast<const unsigned char*>(map->addr);
  const auto* ids = reinterpret_cast<const uint16_t*>(base + kHeaderBytes);
  const auto n = static_cast<size_t>(hdr.count);

  // One streaming pass: hash the file's (little-endian) id bytes and find the largest id, one
  // window at a time; a window is dropped from this process's page tables once read, so the
  // pass does not leave the whole file in the resident set.
  ::madvise(map->addr, map->bytes, MADV_SEQUENTIAL);
  uint64_t hash = kFnvSeed;
  uint16_t largest = 0;
  for (size_t begin = 0; begin < map->bytes; begin += kValidateWindow) {
    const size_t end = std::min(map->bytes, begin + kValidateWindow);
    const size_t id_begin = std::max(begin, kHeaderBytes);
    if (end > id_begin) {
      hash = fnv1a64(base + id_begin, end - id_begin, hash);
      // Windows start at multiples of 16 MiB (even) past the 64-byte header: whole ids.
      largest = std::max(largest, largest_le(reinterpret_cast<const uint16_t*>(base + id_begin),
                                             (end - id_begin) / kBytesPerId));
    }
    ::madvise(static_cast<unsigned char*>(map->addr) + begin, end - begin, MADV_DONTNEED);
  }
  ::madvise(map->addr, map->bytes, MADV_NORMAL);
  if (hash != ids_hash) {
    throw DataError(fmt::format("{} {} is corrupt (hash mismatch): {}", what, name, fix_for(role)));
  }
  if (header != nullptr) *header = hdr;

  if constexpr (std::endian::native == std::endian::big) {
    std::vector<uint16_t> host(ids, ids + n);  // big-endian hosts hold a converted copy
    for (uint16_t& v : host) v = byte_swap(v);
    return TokenStore(std::move(host));
  }
  TokenStore store;
  store.data_ = ids;
  store.size_ = n;
  store.largest_ = largest;
  store.mapped_ = true;
  store.keep_ = std::move(map);
  return store;
}

// ---- TokenFileWriter ---------------------------------------------------------------------------

TokenFileWriter::TokenFileWriter(const fs::path& path, uint64_t source_hash,
                                 uint64_t tokenizer_hash)
    : path_(path),
      tmp_(path.string() + ".tmp." + std::to_string(::getpid())),
      source_hash_(source_hash),
      tokenizer_hash_(tokenizer_hash),
      ids_hash_(kFnvSeed) {
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (f_ == nullptr) {
    throw DataError(fmt::format("cannot write token file {}: cannot create {}: {}", path_.string(),
                                tmp_.string(), errno_text(errno)));
  }
  const unsigned char placeholder[kHeaderBytes] = {};
  if (std::fwrite(placeholder, 1, kHeaderBytes, f_) != kHeaderBytes) fail(errno_text(errno));
}

TokenFileWriter::~TokenFileWriter() {
  if (f_ != nullptr) {
    std::fclose(f_);
    std::error_code ec;
    fs::remove(tmp_, ec);
  }
}

void TokenFileWriter::fail(const std::string& why) {
  if (f_ != nullptr) std::fclose(f_);
  f_ = nullptr;
  std::error_code ec;
  fs::remove(tmp_, ec);
  throw DataError(fmt::format("cannot write token file {}: {}", path_.string(), why));
}

void TokenFileWriter::append(std::span<const uint16_t> ids) {
  if (ids.empty()) return;
  if (f_ == nullptr) fail("the writer is already finished or failed");
  if constexpr (std::endian::native == std::endian::little) {
    ids_hash_ = fnv1a64(ids.data(), ids.size() * kBytesPerId, ids_hash_);
    if (std::fwrite(ids.data(), kBytesPerId, ids.size(), f_) != ids.size()) {
      fail(errno_text(errno));
    }
  } else {
    std::vector<uint16_t> le(ids.begin(), ids.end());
    for (uint16_t& v : le) v = byte_swap(v);
    ids_hash_ = fnv1a64(le.data(), le.size() * kBytesPerId, ids_hash_);
    if (std::fwrite(le.data(), kBytesPerId, le.size(), f_) != le.size()) fail(errno_text(errno));
  }
  count_ += ids.size();
}

void TokenFileWriter::finish() {
  if (f_ == nullptr) fail("the writer is already finished or failed");
  unsigned char h[kHeaderBytes] = {};
  std::memcpy(h, kMagic, sizeof(kMagic));
  put_u32(h + 8, kVersion);
  put_u32(h + 12, kBytesPerId);
  put_u64(h + 16, count_);
  put_u64(h + 24, source_hash_);
  put_u64(h + 32, tokenizer_hash_);
  put_u64(h + 40, ids_hash_);
  if (std::fflush(f_) != 0) fail(errno_text(errno));
  if (std::fseek(f_, 0, SEEK_SET) != 0) fail(errno_text(errno));
  if (std::fwrite(h, 1, kHeaderBytes, f_) != kHeaderBytes) fail(errno_text(errno));
  if (std::fflush(f_) != 0) fail(errno_text(errno));
  if (::fsync(::fileno(f_)) != 0) fail(errno_text(errno));
  std::FILE* f = f_;
  f_ = nullptr;
  if (std::fclose(f) != 0) {
    const int err = errno;
    std::error_code ec;
    fs::remove(tmp_, ec);
    throw DataError(fmt::format("cannot write token file {}: {}", path_.string(), errno_text(err)));
  }
  std::error_code ec;
  fs::rename(tmp_, path_, ec);
  if (ec) {
    std::error_code ec2;
    fs::remove(tmp_, ec2);
    throw DataError(fmt::format("cannot write token file {}: rename from {} failed: {}",
                                path_.string(), tmp_.string(), ec.message()));
  }
}

}  // namespace shardtrain
