// Training monitors (DeepSpeed's "tensorboard" and "csv_monitor" sections, --tensorboard): the
// scalars of the run, written beside metrics.jsonl. A Monitor fans each scalar out to the
// writers that are on; a default-constructed one (or one on a rank that does not write) does
// nothing.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "config/config.h"
#include "monitor/tensorboard.h"

namespace shardtrain {

/// DeepSpeed's csv_monitor: one CSV file per tag in `dir`, named after the tag with '/' and ' '
/// made '_' ("train/loss" -> train_loss.csv), with the header "step,<last part of the tag>" and
/// one "step,value" row per scalar (appended to, as DeepSpeed's CSV monitor does).
class CsvMonitor {
 public:
  /// Creates `dir`; throws RuntimeFailure naming it when it cannot.
  explicit CsvMonitor(const std::filesystem::path& dir);
  CsvMonitor(const CsvMonitor&) = delete;
  CsvMonitor& operator=(const CsvMonitor&) = delete;
  ~CsvMonitor();
  void add_scalar(std::string_view tag, double value, int64_t step);
  /// The file of `tag` in `dir` ("train/loss" -> dir/train_loss.csv).
  static std::filesystem::path file_of(const std::filesystem::path& dir, std::string_view tag);

 private:
  std::filesystem::path dir_;
  std::map<std::string, std::FILE*, std::less<>> files_;
};

class Monitor {
 public:
  Monitor() = default;
  /// Opens the writers `cfg` (TrainConfig::monitor) turns on for rank `rank`; the TensorBoard file
  /// starts with the run's configuration as text (tag "config") when `config_text` is not empty.
  Monitor(const MonitorConfig& cfg, int rank, std::string_view config_text = {});
  Monitor(Monitor&&) noexcept = default;
  Monitor& operator=(Monitor&&) noexcept = default;
  ~Monitor();

  bool active() const { return tensorboard_ || csv_; }
  void scalar(std::string_view tag, double value, int64_t step);
  /// The run continues at `step` (resumed, or restarted from the start: 0): TensorBoard drops
  /// what earlier runs in the directory logged from `step` on (TensorBoardWriter::
  /// add_session_start).
  void restart_at(int64_t step);
  const TensorBoardWriter* tensorboard() const { return tensorboard_.get(); }

 private:
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<CsvMonitor> csv_;
};

}  // namespace shardtrain
