#include "monitor/metrics.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "config/knob.h"
#include "core/error.h"
#include "io/atomic_file.h"

namespace shardtrain {

void keep_metrics_through(const std::filesystem::path& path, int64_t step) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return;
  std::ifstream in(path);
  check<RuntimeFailure>(static_cast<bool>(in), "cannot read {}: {}", path.string(),
                        std::strerror(errno));
  // Records are in the order they were logged: the first one of a later step, and everything
  // after it (an epoch summary of those steps, a line cut short by a crash), go.
  std::string kept, line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const nlohmann::json rec = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (rec.is_discarded() ||
        (rec.is_object() && rec.contains("step") && rec["step"].is_number_integer() &&
         rec["step"].get<int64_t>() > step))
      break;
    kept += line + "\n";
  }
  write_file_atomic(path, kept);
}

MetricsWriter::MetricsWriter(const std::filesystem::path& path) : path_(path) {
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
  errno = 0;
  const bool ok =
      std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0;
  if (!ok)
    throw RuntimeFailure(fmt::format(
        "writing {} failed: {}: free some space (or point {} elsewhere) and resume from the last "
        "checkpoint",
        path_.string(), errno != 0 ? std::strerror(errno) : "short write",
        knob_for(&TrainConfig::output_dir).name()));
}

}  // namespace shardtrain
