// metrics.jsonl: one JSON object per line, flushed as written, for dashboards and scripts.
#pragma once

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <utility>

namespace shardtrain {

class MetricsWriter {
 public:
  MetricsWriter() = default;
  /// Opens `path` for appending (created if absent). Throws RuntimeFailure naming the path.
  explicit MetricsWriter(const std::filesystem::path& path);
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  MetricsWriter(MetricsWriter&& o) noexcept : file_(o.file_) { o.file_ = nullptr; }
  MetricsWriter& operator=(MetricsWriter&& o) noexcept {
    std::swap(file_, o.file_);
    return *this;
  }
  ~MetricsWriter();
  /// Appends one record and flushes it. No-op when not opened (non-zero ranks).
  void write(const nlohmann::json& record);

 private:
  std::FILE* file_ = nullptr;
};

}  // namespace shardtrain
