// Reading and writing the safetensors format (Hugging Face): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {}},
// then the raw little-endian tensor bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
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

/// Bytes per element of a safetensors dtype ("F32": 4, "BF16": 2, ...); 0 when unknown.
size_t safetensors_dtype_size(const std::string& dtype);

class SafetensorsFile {
 public:
  /// Reads the header of `path`. Throws CheckpointError naming the file when it is missing,
  /// truncated or not safetensors.
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
