#include "checkpoint/safetensors.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/hash.h"
#include "io/atomic_file.h"

namespace shardtrain {

size_t safetensors_dtype_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

SafetensorsWriter::SafetensorsWriter(const std::filesystem::path& path,
                                     const std::vector<SafetensorEntry>& entries,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), file_{0, fnv1a64(nullptr, 0)} {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const auto& e : entries) {
    header[e.name] = {{"dtype", e.dtype},
                      {"shape", e.shape},
                      {"data_offsets", {data_bytes_, data_bytes_ + e.bytes}}};
    data_bytes_ += e.bytes;
  }
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  out_.open(path, std::ios::binary | std::ios::trunc);
  if (!out_)
    throw RuntimeFailure(fmt::format("cannot write {}: {}", path.string(), std::strerror(errno)));
  const uint64_t len = text.size();
  put(&len, 8);
  put(text.data(), text.size());
}

void SafetensorsWriter::put(const void* data, size_t bytes) {
  out_.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out_) throw RuntimeFailure(fmt::format("writing {} failed (disk full?)", path_.string()));
  file_.bytes += bytes;
  file_.fnv1a64 = fnv1a64(data, bytes, file_.fnv1a64);
}

void SafetensorsWriter::write(const void* data, size_t bytes) {
  if (written_ + bytes > data_bytes_)
    throw RuntimeFailure(
        fmt::format("{}: {} bytes of tensor data written but the header declares "
                    "{} (a bug in the writer's caller)",
                    path_.string(), written_ + bytes, data_bytes_));
  put(data, bytes);
  written_ += bytes;
}

WrittenFile SafetensorsWriter::finish() {
  if (written_ != data_bytes_)
    throw RuntimeFailure(fmt::format("{}: only {} of the {} bytes of tensor data were written",
                                     path_.string(), written_, data_bytes_));
  out_.flush();
  if (!out_) throw RuntimeFailure(fmt::format("writing {} failed (disk full?)", path_.string()));
  out_.close();
  fsync_path(path_);
  return file_;
}

void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafetensorEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter w(path, entries, metadata);
  for (const auto& e : entries) w.write(e.data, e.bytes);
  w.finish();
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : path_(path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw CheckpointError(fmt::format("cannot open {}: {}", path.string(), std::strerror(errno)));
  uint64_t len = 0;
  in.read(reinterpret_cast<char*>(&len), 8);
  const auto file_size = std::filesystem::file_size(path);
  if (!in || len == 0 || len > file_size - 8) {
    throw CheckpointError(
        fmt::format("{} is not a safetensors file (bad header length)", path.string()));
  }
  std::string text(len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(len));
  data_start_ = 8 + len;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(
        fmt::format("{}: corrupt safetensors header: {}", path.string(), e.what()));
  }
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      for (auto m = it->begin(); m != it->end(); ++m)
        if (m->is_string()) metadata_[m.key()] = m->get<std::string>();
      continue;
    }
    try {
      SafetensorEntry e;
      e.name = it.key();
      e.dtype = it->at("dtype").get<std::string>();
      e.shape = it->at("shape").get<std::vector<int64_t>>();
      const auto offs = it->at("data_offsets").get<std::vector<uint64_t>>();
      if (offs.size() != 2 || offs[1] < offs[0] || data_start_ + offs[1] > file_size)
        throw CheckpointError("bad data_offsets");
      e.offset = offs[0];
      e.bytes = offs[1] - offs[0];
      entries_[e.name] = e;
    } catch (const std::exception& ex) {
      throw CheckpointError(
          fmt::format("{}: tensor '{}' has a corrupt header entry ({}); the file is "
                      "truncated or not safetensors",
                      path.string(), it.key(), ex.what()));
    }
  }
}

const SafetensorEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end())
    throw CheckpointError(fmt::format("{} has no tensor '{}'", path_.string(), name));
  return it->second;
}

void SafetensorsFile::read(const std::string& name, void* dst) const {
  const SafetensorEntry& e = entry(name);
  std::ifstream in(path_, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(data_start_ + e.offset));
  in.read(static_cast<char*>(dst), static_cast<std::streamsize>(e.bytes));
  if (!in) throw CheckpointError(fmt::format("{}: tensor '{}' is truncated", path_.string(), name));
}

void SafetensorsFile::read_range(const std::string& name, int64_t elem_offset, int64_t count,
                                 void* dst) const {
  const SafetensorEntry& e = entry(name);
  const size_t esize = safetensors_dtype_size(e.dtype);
  if (esize == 0)
    throw CheckpointError(
        fmt::format("{}: tensor '{}' has dtype {}, which cannot be read in ranges", path_.string(),
                    name, e.dtype));
  const auto numel = static_cast<int64_t>(e.bytes / esize);
  if (elem_offset < 0 || count < 0 || elem_offset + count > numel)
    throw CheckpointError(
        fmt::format("{}: elements [{}, {}) of tensor '{}' requested, but it holds {} elements",
                    path_.string(), elem_offset, elem_offset + count, name, numel));
  std::ifstream in(path_, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(data_start_ + e.offset +
                                       static_cast<uint64_t>(elem_offset) * esize));
  in.read(static_cast<char*>(dst),
          static_cast<std::streamsize>(static_cast<size_t>(count) * esize));
  if (!in) throw CheckpointError(fmt::format("{}: tensor '{}' is truncated", path_.string(), name));
}

}  // namespace shardtrain
