#include "monitor/monitor.h"

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace shardtrain {
namespace fs = std::filesystem;

CsvMonitor::CsvMonitor(const fs::path& dir) : dir_(dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw RuntimeFailure(
        fmt::format("cannot create the CSV monitor directory {}: {}", dir.string(), ec.message()));
}

CsvMonitor::~CsvMonitor() {
  for (auto& [tag, f] : files_) std::fclose(f);
}

fs::path CsvMonitor::file_of(const fs::path& dir, std::string_view tag) {
  std::string name(tag);
  for (char& c : name)
    if (c == '/' || c == ' ') c = '_';
  return dir / (name + ".csv");
}

void CsvMonitor::add_scalar(std::string_view tag, double value, int64_t step) {
  auto it = files_.find(tag);
  if (it == files_.end()) {
    const fs::path path = file_of(dir_, tag);
    std::error_code ec;
    const bool fresh = !fs::exists(path, ec) || fs::file_size(path, ec) == 0;
    std::FILE* f = std::fopen(path.c_str(), "a");
    if (!f)
      throw RuntimeFailure(
          fmt::format("cannot open {} for writing: {}", path.string(), std::strerror(errno)));
    if (fresh) {
      const size_t slash = tag.rfind('/');
      fmt::print(f, "step,{}\n", slash == std::string_view::npos ? tag : tag.substr(slash + 1));
    }
    it = files_.emplace(std::string(tag), f).first;
  }
  errno = 0;
  const std::string line = fmt::format("{},{}\n", step, value);
  if (std::fwrite(line.data(), 1, line.size(), it->second) != line.size() ||
      std::fflush(it->second) != 0)
    throw RuntimeFailure(fmt::format(
        "writing {} failed: {}: free some space and resume from the "
        "last checkpoint",
        file_of(dir_, tag).string(), errno != 0 ? std::strerror(errno) : "short write"));
}

Monitor::Monitor(const MonitorConfig& cfg, int rank, std::string_view config_text) {
  if (!cfg.tensorboard_dir.empty() && (rank == 0 || cfg.tensorboard_all_ranks)) {
    const fs::path dir = cfg.tensorboard_all_ranks
                             ? fs::path(cfg.tensorboard_dir) / fmt::format("rank-{}", rank)
                             : fs::path(cfg.tensorboard_dir);
    tensorboard_ = std::make_unique<TensorBoardWriter>(dir);
    if (!config_text.empty()) tensorboard_->add_text("config", config_text, 0);
  }
  if (!cfg.csv_dir.empty() && rank == 0) csv_ = std::make_unique<CsvMonitor>(cfg.csv_dir);
}

Monitor::~Monitor() = default;

void Monitor::restart_at(int64_t step) {
  if (tensorboard_) tensorboard_->add_session_start(step);
}

void Monitor::scalar(std::string_view tag, double value, int64_t step) {
  if (tensorboard_) tensorboard_->add_scalar(tag, value, step);
  if (csv_) csv_->add_scalar(tag, value, step);
}

}  // namespace shardtrain
