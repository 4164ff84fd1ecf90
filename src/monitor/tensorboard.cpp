#include "monitor/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>

#include "core/error.h"
#include "monitor/tensorboard_event.pb.h"

namespace shardtrain {
namespace fs = std::filesystem;
namespace tb = shardtrain::tensorboard;

namespace {

constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = kCrc32cTable[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t crc = crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord_frame(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_u64(out, data.size());
  put_u32(out, masked_crc32c(out.data(), 8));
  out.append(data);
  put_u32(out, masked_crc32c(data.data(), data.size()));
  return out;
}

std::vector<std::string> read_tfrecords(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw RuntimeFailure(fmt::format("cannot open {}", path.string()));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> records;
  size_t pos = 0;
  while (pos < bytes.size()) {
    const auto bad = [&](std::string_view what) {
      return RuntimeFailure(
          fmt::format("{}: {} in the record at byte offset {}", path.string(), what, pos));
    };
    if (bytes.size() - pos < 12) throw bad("truncated length");
    const char* p = bytes.data() + pos;
    const uint64_t len = get_le(p, 8);
    if (static_cast<uint32_t>(get_le(p + 8, 4)) != masked_crc32c(p, 8))
      throw bad("length CRC mismatch");
    if (bytes.size() - pos - 12 < len + 4) throw bad("truncated data");
    const char* d = p + 12;
    if (static_cast<uint32_t>(get_le(d + len, 4)) != masked_crc32c(d, len))
      throw bad("data CRC mismatch");
    records.emplace_back(d, len);
    pos += 12 + len + 4;
  }
  return records;
}

TensorBoardWriter::TensorBoardWriter(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw RuntimeFailure(
        fmt::format("cannot create the TensorBoard directory {}: {}", dir.string(), ec.message()));
  const auto unix_time = static_cast<int64_t>(wall_time_now());
  path_ = dir / fmt::format("events.out.tfevents.{}.{}.{}.v2", unix_time, host_name(),
                            static_cast<long>(getpid()));
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_)
    throw RuntimeFailure(
        fmt::format("cannot open {} for writing: {}", path_.string(), std::strerror(errno)));
  tb::Event ev;
  ev.set_wall_time(wall_time_now());
  ev.set_step(0);
  ev.set_file_version("brain.Event:2");
  write_event(ev.SerializeAsString());
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::add_scalar(std::string_view tag, double value, int64_t step) {
  tb::Event ev;
  ev.set_wall_time(wall_time_now());
  ev.set_step(step);
  tb::Summary::Value* v = ev.mutable_summary()->add_value();
  v->set_tag(std::string(tag));
  v->set_simple_value(static_cast<float>(value));
  write_event(ev.SerializeAsString());
}

void TensorBoardWriter::add_text(std::string_view tag, std::string_view text, int64_t step) {
  tb::Event ev;
  ev.set_wall_time(wall_time_now());
  ev.set_step(step);
  tb::Summary::Value* v = ev.mutable_summary()->add_value();
  v->set_tag(std::string(tag));
  // What tensorboard.plugins.text.summary writes: plugin "text", content a TextPluginData
  // (version 0: empty), a DT_STRING tensor of shape [] holding the Markdown.
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  v->mutable_metadata()->set_data_class(tb::DATA_CLASS_TENSOR);
  tb::TensorProto* t = v->mutable_tensor();
  t->set_dtype(tb::DT_STRING);
  t->mutable_tensor_shape();  // a scalar: no dims
  t->add_string_val(std::string(text));
  write_event(ev.SerializeAsString());
}

void TensorBoardWriter::add_session_start(int64_t step) {
  tb::Event ev;
  ev.set_wall_time(wall_time_now());
  ev.set_step(step);
  ev.mutable_session_log()->set_status(tb::SessionLog::START);
  write_event(ev.SerializeAsString());
}

void TensorBoardWriter::write_event(const std::string& serialized_event) {
  const std::string rec = tfrecord_frame(serialized_event);
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size() || std::fflush(file_) != 0)
    throw RuntimeFailure(fmt::format("cannot write {}: {}", path_.string(), std::strerror(errno)));
}

}  // namespace shardtrain
