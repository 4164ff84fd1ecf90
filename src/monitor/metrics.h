// metrics.jsonl: one JSON object per line, flushed as written, for dashboards and scripts.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <utility>

namespace shardtrain {

/// Keeps the records of `path` logged before the first one whose "step" exceeds `step`, dropping
/// that one and every later one (and a line that is not JSON, cut short by a crash): a run
/// resumed from a checkpoint of `step` logs the later steps again. Rewritten atomically; nothing
/// happens when the file does not exist. Throws RuntimeFailure naming the path when it cannot be
/// read or written.
void keep_metrics_through(const std::filesystem::path& path, int64_t step);

class MetricsWriter {
 public:
  MetricsWriter() = default;
  /// Opens `path` for appending (created if absent). Throws RuntimeFailure naming the path.
  explicit MetricsWriter(const std::filesystem::path& path);
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  MetricsWriter(MetricsWriter&& o) noexcept : file_(o.file_), path_(std::move(o.path_)) {
    o.file_ = nullptr;
  }
  MetricsWriter& operator=(MetricsWriter&& o) noexcept {
    std::swap(file_, o.file_);
    std::swap(path_, o.path_);
    return *this;
  }
  ~MetricsWriter();
  /// Appends one record and flushes it. No-op when not opened (non-zero ranks). Throws
  /// RuntimeFailure naming the file when it cannot be written (a full disk): a run whose log is
  /// lost stops, rather than ending with exit 0 and an empty file.
  void write(const nlohmann::json& record);

 private:
  std::FILE* file_ = nullptr;
  std::filesystem::path path_;
};

}  // namespace shardtrain
