// TensorBoard event files: TFRecord-framed protobuf Event messages
// (monitor/tensorboard_event.proto, TensorFlow's field numbers), as TensorFlow's and TensorBoard's
// summary writers write them.
//
// A record is: uint64 length (little endian), uint32 masked CRC32C of those 8 bytes, the data,
// uint32 masked CRC32C of the data. CRC32C is the Castagnoli polynomial (reflected 0x82F63B78);
// masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace shardtrain {

/// CRC32C (Castagnoli) of `n` bytes, continuing from `crc` (0 to start).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
/// TFRecord's masked CRC32C.
uint32_t masked_crc32c(const void* data, size_t n);

/// One TFRecord: the framing of `data` (length, its masked CRC, data, its masked CRC).
std::string tfrecord_frame(std::string_view data);
/// The records of a TFRecord file, in order. Throws RuntimeFailure naming the file and offset on
/// a truncated record or a CRC mismatch.
std::vector<std::string> read_tfrecords(const std::filesystem::path& path);

/// Writes one TensorBoard event file, `events.out.tfevents.<unix time>.<hostname>.<pid>.v2`, in
/// `dir` (created). The first event is the file version "brain.Event:2". Every event is flushed
/// as written, so a stopped run leaves a readable file.
class TensorBoardWriter {
 public:
  /// Throws RuntimeFailure naming the path when the directory or file cannot be created.
  explicit TensorBoardWriter(const std::filesystem::path& dir);
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  ~TensorBoardWriter();

  /// A scalar (Summary.Value.simple_value, a float32) at `step`.
  void add_scalar(std::string_view tag, double value, int64_t step);
  /// Text for TensorBoard's text plugin (a string tensor with plugin_name "text"; rendered as
  /// Markdown) at `step`.
  void add_text(std::string_view tag, std::string_view text, int64_t step);

  /// A SessionLog START at `step`: TensorBoard drops what earlier event files of the directory
  /// logged at `step` or later (a run resumed from a checkpoint of step − 1 logs those again).
  void add_session_start(int64_t step);

  const std::filesystem::path& path() const { return path_; }

 private:
  void write_event(const std::string& serialized_event);

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

}  // namespace shardtrain
