// Reading and writing the safetensors format (Hugging Face): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {}},
// then the raw little-endian tensor bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace shardtrain {

struct SafetensorEntry {
  std::string name;
  std::string dtype;  ///< "F32", "BF16", "F16", "I32", ...
  std::vector<int64_t> shape;
  const void* data = nullptr;  ///< for writing
  size_t bytes = 0;
  uint64_t offset = 0;  ///< for reading: byte offset in the data section
};

/// Size and FNV-1a 64 checksum of a written file.
struct WrittenFile {
  uint64_t bytes = 0;
  uint64_t fnv1a64 = 0;
};

/// Writes a safetensors file as a stream: the header (from the entries' names, dtypes, shapes
/// and byte sizes; `data` is ignored) first, then the tensors' bytes in entry order, in pieces
/// of any size. Memory: the header only. The checksum is computed while writing (no re-read).
/// Not atomic by itself: write into a temporary directory. Throws RuntimeFailure naming the
/// file on I/O errors.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::filesystem::path& path, const std::vector<SafetensorEntry>& entries,
                    const std::map<std::string, std::string>& metadata = {});
  /// Appends `bytes` bytes of tensor data (the next bytes in entry order).
  void write(const void* data, size_t bytes);
  /// Checks that every declared byte was written, flushes and fsyncs the file. Throws
  /// RuntimeFailure when too few or too many bytes were written, or on I/O errors.
  WrittenFile finish();
  const std::filesystem::path& path() const { return path_; }

 private:
  void put(const void* data, size_t bytes);

  std::filesystem::path path_;
  std::ofstream out_;
  uint64_t data_bytes_ = 0;  ///< declared by the header
  uint64_t written_ = 0;     ///< data bytes written so far
  WrittenFile file_;
};

/// Writes `entries` (with their data) to `path` (not atomic by itself; write into a temporary
/// directory). Throws RuntimeFailure on I/O errors.
void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafetensorEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

/// Bytes per element of a safetensors dtype ("F32": 4, "BF16": 2, "F8_E4M3": 1, ...); 0 for a
/// name the format does not define.
size_t safetensors_dtype_size(const std::string& dtype);

/// The largest header a safetensors file may declare, in bytes (the format's own reader refuses
/// more than 100,000,000).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

/// A safetensors file's header, validated against the file's size.
struct SafetensorsHeader {
  uint64_t data_start = 0;  ///< byte offset of the data section: 8 + the header's length
  std::map<std::string, SafetensorEntry> entries;
  std::map<std::string, std::string> metadata;
};

/// Parses and validates the header of a safetensors file of `file_size` bytes whose first bytes
/// are `prefix` (at least 8 + the declared header length of them, or the whole file). Checks
/// that the header length fits the file, that the header is a JSON object (nested at most 4
/// levels), that "__metadata__" is an object of strings, and that every tensor has a known dtype, a
/// shape of non-negative integers whose element count × the dtype's size equals its data_offsets'
/// span (computed without overflow), and offsets that lie inside the data section and overlap no
/// other tensor's. `name` names the file in messages. Throws CheckpointError saying which tensor
/// and field is wrong, with bounded excerpts of the input; never reads outside `prefix`.
SafetensorsHeader parse_safetensors_header(std::string_view prefix, uint64_t file_size,
                                           const std::string& name);

class SafetensorsFile {
 public:
  /// Reads and validates the header of `path` (parse_safetensors_header). Throws CheckpointError
  /// naming the file when it is missing, not a regular file, truncated or not valid safetensors.
  explicit SafetensorsFile(const std::filesystem::path& path);

  const std::map<std::string, SafetensorEntry>& entries() const { return entries_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const SafetensorEntry& entry(const std::string& name) const;
  /// Reads tensor `name`'s bytes into `dst` (entry(name).bytes bytes).
  void read(const std::string& name, void* dst) const;
  /// Reads `count` elements of 1-D-flattened tensor `name` from element `elem_offset` into
  /// `dst` (random access: only those bytes are read). Throws CheckpointError naming the file
  /// and tensor when the range lies outside the tensor, the dtype is unknown or the file is
  /// truncated.
  void read_range(const std::string& name, int64_t elem_offset, int64_t count, void* dst) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::filesystem::path path_;
  uint64_t data_start_ = 0;
  std::map<std::string, SafetensorEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace shardtrain
