// Reading and writing the safetensors format (Hugging Face): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {}},
// then the raw little-endian tensor bytes.
#pragma once

#include <cstdint>
#include <filesystem>
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

/// Writes `entries` to `path` (not atomic by itself; write into a temporary directory).
/// Throws RuntimeFailure on I/O errors.
void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafetensorEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

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
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::filesystem::path path_;
  uint64_t data_start_ = 0;
  std::map<std::string, SafetensorEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace shardtrain
