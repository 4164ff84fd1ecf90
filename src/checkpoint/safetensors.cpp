#include "checkpoint/safetensors.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/hash.h"
#include "core/json_input.h"
#include "core/strings.h"
#include "io/atomic_file.h"

namespace shardtrain {

size_t safetensors_dtype_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2")
    return 1;
  return 0;
}

namespace {

uint64_t get_u64_le(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

/// One tensor's header entry, validated (see parse_safetensors_header).
SafetensorEntry parse_entry(const std::string& file, const std::string& tensor,
                            const nlohmann::json& j, uint64_t data_bytes) {
  const std::string what = fmt::format("{}: tensor {}", file, excerpt(tensor));
  auto fail = [&](const std::string& problem) -> SafetensorEntry {
    throw CheckpointError(
        fmt::format("{}: {}; the file is corrupt or not safetensors", what, problem));
  };
  if (!j.is_object())
    return fail(fmt::format("its entry is {}, not an object", json_type_phrase(j)));
  SafetensorEntry e;
  e.name = tensor;
  const auto dtype = j.find("dtype");
  if (dtype == j.end() || !dtype->is_string()) return fail("\"dtype\" is missing or not a string");
  e.dtype = dtype->get<std::string>();
  const size_t esize = safetensors_dtype_size(e.dtype);
  if (esize == 0)
    return fail(
        fmt::format("dtype {} is not a safetensors dtype (F64, F32, F16, BF16, F8_E4M3, "
                    "F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL)",
                    excerpt(e.dtype, 16)));
  const auto shape = j.find("shape");
  if (shape == j.end() || !shape->is_array()) return fail("\"shape\" is missing or not an array");
  if (shape->size() > 16) return fail(fmt::format("its shape has {} dimensions", shape->size()));
  // numel × esize must fit in the data section (< 2^64), so each product is checked as it grows.
  uint64_t bytes = esize;
  for (const auto& d : *shape) {
    if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0))
      return fail(fmt::format("shape {} holds {}, not a non-negative integer",
                              json_excerpt(*shape, 80), json_excerpt(d, 24)));
    const uint64_t n = d.get<uint64_t>();
    if (n > static_cast<uint64_t>(INT64_MAX))
      return fail(fmt::format("dimension {} is too large", n));
    e.shape.push_back(static_cast<int64_t>(n));
    if (n != 0 && bytes > UINT64_MAX / n)
      bytes = UINT64_MAX;  // saturate: compared below
    else
      bytes *= n;
  }
  const auto offs = j.find("data_offsets");
  if (offs == j.end() || !offs->is_array() || offs->size() != 2 ||
      !(*offs)[0].is_number_unsigned() || !(*offs)[1].is_number_unsigned())
    return fail("\"data_offsets\" is missing or not [BEGIN, END] with non-negative integers");
  const uint64_t begin = (*offs)[0].get<uint64_t>(), end = (*offs)[1].get<uint64_t>();
  if (begin > end || end > data_bytes)
    return fail(fmt::format("data_offsets [{}, {}] lie outside the file's {} bytes of data", begin,
                            end, data_bytes));
  if (end - begin != bytes)
    return fail(
        fmt::format("data_offsets [{}, {}] span {} bytes but shape [{}] of {} needs {}", begin, end,
                    end - begin, fmt::join(e.shape, ", "), e.dtype,
                    bytes == UINT64_MAX ? std::string("more than 2^64") : std::to_string(bytes)));
  e.offset = begin;
  e.bytes = static_cast<size_t>(end - begin);
  return e;
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::string_view prefix, uint64_t file_size,
                                           const std::string& name) {
  if (file_size < 8 || prefix.size() < 8)
    throw CheckpointError(fmt::format(
        "{} is not a safetensors file: it holds {} bytes, fewer than the 8-byte header length",
        name, file_size));
  const uint64_t len = get_u64_le(prefix.data());
  if (len < 2 || len > kMaxSafetensorsHeaderBytes || len > file_size - 8)
    throw CheckpointError(fmt::format(
        "{} is not a safetensors file: its header length {} is {} (the file holds {} bytes)", name,
        len, len > file_size - 8 ? "past the end of the file" : "not between 2 and 100,000,000",
        file_size));
  if (prefix.size() < 8 + len)
    throw CheckpointError(fmt::format("{}: the safetensors header is truncated", name));
  SafetensorsHeader h;
  h.data_start = 8 + len;
  const uint64_t data_bytes = file_size - h.data_start;
  JsonInputOptions limits;
  limits.max_depth = 4;  // {name: {"shape": [...]}} is 3; one more for a clearer message
  const nlohmann::json header = parse_json_or_throw<CheckpointError>(
      prefix.substr(8, len), fmt::format("{}: the safetensors header", name), limits);
  if (!header.is_object())
    throw CheckpointError(fmt::format(
        "{}: the safetensors header is {}, not an object of tensors: the file is corrupt or not "
        "safetensors",
        name, json_type_phrase(header)));
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() != "__metadata__") {
      h.entries.emplace(it.key(), parse_entry(name, it.key(), *it, data_bytes));
      continue;
    }
    if (!it->is_object())
      throw CheckpointError(
          fmt::format("{}: \"__metadata__\" is {}; the format wants an object of strings", name,
                      json_type_phrase(*it)));
    for (auto m = it->begin(); m != it->end(); ++m) {
      if (!m->is_string())
        throw CheckpointError(
            fmt::format("{}: \"__metadata__\" key {} is {}; the format wants an object of strings",
                        name, excerpt(m.key()), json_type_phrase(*m)));
      h.metadata[m.key()] = m->get<std::string>();
    }
  }
  // No two tensors may share bytes (zero-sized ones share none).
  std::vector<const SafetensorEntry*> by_offset;
  for (const auto& [n, e] : h.entries)
    if (e.bytes > 0) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto* a, const auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SafetensorEntry& a = *by_offset[i - 1];
    const SafetensorEntry& b = *by_offset[i];
    if (b.offset < a.offset + a.bytes)
      throw CheckpointError(fmt::format(
          "{}: tensors {} (bytes [{}, {})) and {} (bytes [{}, {})) overlap; the file is corrupt",
          name, excerpt(a.name), a.offset, a.offset + a.bytes, excerpt(b.name), b.offset,
          b.offset + b.bytes));
  }
  return h;
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
  const std::string name = path.string();
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status))
    throw CheckpointError(fmt::format("safetensors file {} not found: check the path", name));
  if (std::filesystem::is_directory(status))
    throw CheckpointError(
        fmt::format("{} is a directory, not a safetensors file: name its model.safetensors or "
                    "model.safetensors.index.json",
                    name));
  if (!std::filesystem::is_regular_file(status))
    throw CheckpointError(fmt::format("{} is not a regular file: pass a .safetensors file", name));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(fmt::format("cannot open {}: {}", name, std::strerror(errno)));
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  if (ec) throw CheckpointError(fmt::format("cannot stat {}: {}", name, ec.message()));
  std::string prefix(8, '\0');
  in.read(prefix.data(), 8);
  if (in && file_size >= 8) {
    const uint64_t len = get_u64_le(prefix.data());
    // Read the header only once its length is known to fit the file (and the limit).
    if (len <= kMaxSafetensorsHeaderBytes && len <= file_size - 8) {
      prefix.resize(8 + len);
      in.read(prefix.data() + 8, static_cast<std::streamsize>(len));
      if (!in) throw CheckpointError(fmt::format("{}: cannot read the safetensors header", name));
    }
  }
  SafetensorsHeader h = parse_safetensors_header(prefix, file_size, name);
  data_start_ = h.data_start;
  entries_ = std::move(h.entries);
  metadata_ = std::move(h.metadata);
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
