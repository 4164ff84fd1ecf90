// Token files on disk: the format, a memory-mapped read-only view of one, and a streaming writer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace shardtrain {

// ---- token file format ---------------------------------------------------------------------
//
// A token file holds GPT-2 ids as little-endian uint16 after a 64-byte header:
//   bytes 0..7   magic "STTOKENS"
//   bytes 8..11  format version (uint32, = 1)
//   bytes 12..15 bytes per id (uint32, = 2)
//   bytes 16..23 number of ids (uint64)
//   bytes 24..31 FNV-1a 64 of the source text bytes (uint64)
//   bytes 32..39 tokenizer fingerprint (uint64)
//   bytes 40..47 FNV-1a 64 of the id bytes (uint64; detects truncation and corruption)
//   bytes 48..63 zero
// So a file of N ids takes 64 + 2·N bytes. `shardtrain tokenize --output` writes this format and
// --train-file/--valid-file accept it.

struct TokenFileHeader {
  uint64_t count = 0;
  uint64_t source_hash = 0;
  uint64_t tokenizer_hash = 0;
};

/// True when `path` starts with the token-file magic (false when it cannot be read).
bool is_token_file(const std::filesystem::path& path);

/// Who produced a token file: decides the fix named in error messages (re-run tokenize for a
/// user's file, delete it for a cache).
enum class TokenFileRole { kUser, kCache };

/// Read-only token ids: either a token file mapped into memory or ids held in an owned vector.
/// Copies share the same ids (reference counted); the ids never change.
///
/// A mapped store maps the whole file with mmap(PROT_READ, MAP_SHARED): its pages are the
/// kernel's page cache of the file, so every process of a node that maps the same file (the
/// ranks of a run) shares one copy of it, and a process holds in memory only the pages it has
/// touched since (for training, the pages of its own samples). Nothing is copied. The file must
/// not be truncated or rewritten in place while it is mapped (reading a page past a truncation
/// ends the process with SIGBUS); shardtrain's writers replace a file by renaming a new one over
/// it, which leaves an existing mapping intact.
class TokenStore {
 public:
  TokenStore() = default;
  /// Takes ownership of `ids` (implicit, so code holding a vector passes it as it is).
  TokenStore(std::vector<uint16_t> ids);  // NOLINT(google-explicit-constructor)

  /// Maps the token file `path` and validates it without copying: the header (magic, version,
  /// bytes per id), the file size against the header's count (exactly 64 + 2·count bytes), and
  /// the FNV-1a 64 of the id bytes against the header. The validation reads every page of the
  /// file once, streaming: it hashes 16 MiB at a time and then drops that window from this
  /// process's page tables (madvise MADV_DONTNEED; the page cache keeps the pages), so it adds
  /// at most 16 MiB to the resident set; it also records largest_id(). It costs about one second
  /// per GB on one core, from the page cache. `header` (optional) receives the header. Throws
  /// DataError naming the file (and the fix for `role`) when it is missing, unreadable,
  /// truncated, corrupt or not a token file.
  static TokenStore map_file(const std::filesystem::path& path, TokenFileHeader* header = nullptr,
                             TokenFileRole role = TokenFileRole::kUser);

  const uint16_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  uint16_t operator[](size_t i) const { return data_[i]; }
  const uint16_t* begin() const { return data_; }
  const uint16_t* end() const { return data_ + size_; }
  std::span<const uint16_t> span() const { return {data_, size_}; }
  /// The largest id (0 when empty), found while validating or taking the ids.
  uint16_t largest_id() const { return largest_; }
  /// True when the ids are a mapped file (shared by the node's processes), false when owned.
  bool is_mapped() const { return mapped_; }
  /// A copy of the ids in a vector (2 bytes per id).
  std::vector<uint16_t> to_vector() const { return {begin(), end()}; }

 private:
  std::shared_ptr<const void> keep_;  ///< the mapping or the vector that holds the ids
  const uint16_t* data_ = nullptr;
  size_t size_ = 0;
  uint16_t largest_ = 0;
  bool mapped_ = false;
};

/// Writes a token file as ids arrive, holding none of them: a temporary file (PATH.tmp.PID) gets
/// a placeholder header and the ids; finish() writes the real header (count and id hash),
/// fsyncs and renames it to `path`. A writer destroyed before finish() removes the temporary.
/// Throws DataError "cannot write token file PATH: ..." on any I/O failure.
class TokenFileWriter {
 public:
  TokenFileWriter(const std::filesystem::path& path, uint64_t source_hash, uint64_t tokenizer_hash);
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  /// Appends ids (host order; stored little-endian).
  void append(std::span<const uint16_t> ids);
  /// Ids appended so far.
  uint64_t count() const { return count_; }
  /// The source hash, settable until finish() (a streaming writer learns it at the end).
  void set_source_hash(uint64_t h) { source_hash_ = h; }
  /// Completes the file and renames it into place.
  void finish();

 private:
  [[noreturn]] void fail(const std::string& why);
  std::filesystem::path path_, tmp_;
  std::FILE* f_ = nullptr;
  uint64_t source_hash_, tokenizer_hash_;
  uint64_t count_ = 0;
  uint64_t ids_hash_;
};

}  // namespace shardtrain
