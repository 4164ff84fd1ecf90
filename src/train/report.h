// The strategy comparison report (`shardtrain compare`, `shardtrain report`): finished runs'
// metrics.jsonl and run.json (train/trainer.cpp writes both into --output-dir) read back, set
// side by side with the memory estimator's prediction (parallel/memory_estimator.h), and written
// as a report directory:
//   report.md    the table (time per epoch, samples/s, tokens/s, MFU, peak device and host
//                memory, final loss, validation perplexity, speed and memory relative to dp, the
//                estimator's prediction next to each measured peak) and the pictures;
//   report.json  the same numbers, per run, with the command that ran it;
//   *.png/*.svg  time per epoch and peak memory by run, the loss curves overlaid, and the
//                estimated memory breakdown (parameters, gradients, optimizer state,
//                activations, buffers) per run, drawn by gnuplot (monitor/plot.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"

namespace shardtrain {

/// The estimator's GPU memory per rank for one run, split by what it holds (bytes).
struct MemoryBreakdown {
  double parameters = 0;  ///< bf16 parameters resident on the GPU
  double gradients = 0;   ///< bf16 gradients
  double optimizer = 0;   ///< fp32 master weights, AdamW m and v (SGD: momentum) on the GPU
  double activations = 0;
  double buffers = 0;  ///< gradient buckets, zero3's gathered layers, workspaces, CUDA context
  double total() const { return parameters + gradients + optimizer + activations + buffers; }
};

/// One run of the comparison, as its output directory records it.
struct RunRecord {
  std::filesystem::path dir;  ///< the run's --output-dir
  std::string command;        ///< how it was started ("" when not known: `shardtrain report`)
  bool ok = true;             ///< false: failed (or wrote no epoch record)
  std::string failure;        ///< why, with the last lines of its log

  // From run.json (empty / 0 when the run wrote none).
  std::string model, strategy, device;
  std::string
      backend;  ///< what the run trained on, e.g. "NVIDIA H100 80GB HBM3 (cuda:0, 79.2 GiB)"
  int world_size = 1;
  int64_t micro_batch = 0, global_batch = 0, max_length = 0, parameters = 0;
  bool on_gpu = false;
  OptimizerKind optimizer = OptimizerKind::kAdamW;  ///< run.json's "optimizer" (absent: AdamW)

  // From metrics.jsonl: the last epoch record (time, throughput), every epoch (peaks), the "done"
  // record (final loss) and the last validation.
  int epochs = 0;                        ///< epoch records read
  double epoch_time_s = NAN;             ///< time_s of the last epoch (seconds)
  double samples_per_s = NAN;            ///< of the last epoch, all ranks together
  double tokens_per_s = NAN;             ///< of the last epoch, all ranks together
  double mfu = NAN;                      ///< model FLOPs utilization, GPU runs only (fraction)
  double peak_memory_bytes = NAN;        ///< largest rank's peak: GPU allocated, or RSS on CPU
  double host_peak_bytes = NAN;          ///< rank 0's peak resident set (peak_rss_bytes)
  double final_loss = NAN;               ///< loss of the last step
  double val_loss = NAN, val_ppl = NAN;  ///< the last validation
  std::vector<std::pair<int64_t, double>> losses;  ///< (step, loss) of every logged step

  std::optional<MemoryBreakdown> estimate;  ///< the estimator's; none for pipeline runs
  double speed_vs_dp = NAN;   ///< tokens/s over the dp run of the same model, batch and ranks
  double memory_vs_dp = NAN;  ///< peak memory over that dp run's

  /// "dp", or "dp gpt2 b4 ×2" when the comparison varies the model, batch or ranks.
  std::string label;
};

/// Reads a run's output directory (run.json and metrics.jsonl). A run without metrics.jsonl or
/// without an epoch record comes back with ok = false and `failure` saying so.
RunRecord read_run(const std::filesystem::path& dir);

/// The estimator's breakdown for `run` (its model, strategy, ranks, micro-batch and length),
/// or nullopt for strategies it does not model (pipeline) or a run without run.json.
std::optional<MemoryBreakdown> estimate_for(const RunRecord& run);

/// Fills in the estimates, the ratios to dp and the labels of `runs`.
void complete_runs(std::vector<RunRecord>& runs);

/// report.json's contents.
nlohmann::json report_json(const std::vector<RunRecord>& runs);

/// What the runs share, for the pictures' titles: their model(s), micro-batch × sequence length
/// and the device they trained on, e.g. "gpt2-medium, micro-batch 4 × 512, NVIDIA H100 80GB HBM3
/// × 1"; parts that differ between runs are left out (the runs' labels name them).
std::string workload_title(const std::vector<RunRecord>& runs);

/// Samples in the last epoch record of `r` (samples/s × time), NaN when unknown.
double samples_last_epoch(const RunRecord& r);

/// report.md's contents; `pictures`: the picture stems drawn (shown when not empty).
std::string report_markdown(const std::vector<RunRecord>& runs,
                            const std::vector<std::string>& pictures);

/// Draws the pictures into `dir` (time_per_epoch, peak_memory, loss_curves, memory_breakdown;
/// .png and .svg each); returns their stems. Throws RuntimeFailure when gnuplot is missing or
/// fails.
std::vector<std::string> draw_pictures(const std::vector<RunRecord>& runs,
                                       const std::filesystem::path& dir);

/// Everything: completes `runs`, draws the pictures (a warning on stderr and none when gnuplot
/// is missing or fails) and writes report.md and report.json into `dir`. Returns whether the
/// pictures were drawn.
bool write_report(std::vector<RunRecord>& runs, const std::filesystem::path& dir);

}  // namespace shardtrain
