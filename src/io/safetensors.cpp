#include "io/safetensors.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace shardtrain {

void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafetensorEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& e : entries) {
    header[e.name] = {
        {"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.bytes}}};
    offset += e.bytes;
  }
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    throw RuntimeFailure(fmt::format("cannot write {}: {}", path.string(), std::strerror(errno)));
  const uint64_t len = text.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& e : entries)
    out.write(static_cast<const char*>(e.data), static_cast<std::streamsize>(e.bytes));
  out.flush();
  if (!out) throw RuntimeFailure(fmt::format("writing {} failed (disk full?)", path.string()));
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

}  // namespace shardtrain
