#include "io/metrics.h"

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace shardtrain {

MetricsWriter::MetricsWriter(const std::filesystem::path& path) {
  file_ = std::fopen(path.c_str(), "a");
  if (!file_)
    throw RuntimeFailure(
        fmt::format("cannot open {} for writing: {}", path.string(), std::strerror(errno)));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (!file_) return;
  const std::string line = record.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

}  // namespace shardtrain
