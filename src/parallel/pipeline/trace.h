// Measured pipeline timelines: every rank of the pipeline executor records when each action of
// one optimizer step started and ended (write_stage_trace, one file per stage); merging the files
// (merge_pipeline_trace) draws the measured timeline next to the simulator's prediction for the
// measured op times, and writes a Chrome trace for chrome://tracing and Perfetto.
//
// Clocks: a rank's times are seconds from the start of the step on that rank. The executor starts
// each step after a barrier, so the ranks' step starts are aligned to within the barrier's exit
// skew (on one host, with every rank reading the same steady clock, the times are comparable
// as they are; on several hosts only through that alignment — a rank that leaves the barrier late
// shows its actions shifted by the difference).
//
// Files in the trace directory (docs/PIPELINE.md, "Measured timelines"):
//   stage-000.json ..  one per stage, written by write_stage_trace
//   trace.json         Chrome trace (Trace Event Format) of every recorded action
//   timeline.svg/.png  the measured compute timeline (PNG when a renderer is found,
//   monitor/render_png.h) predicted.svg/.png the simulator's timeline for the measured mean op
//   times of each virtual stage
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/simulator.h"

namespace shardtrain {

/// One action a rank ran, with its times in seconds from the step's start on that rank.
/// Compute actions (kForward, kBackward, kBackwardInput, kBackwardWeight): the time computing.
/// Receives (kRecvActivation, kRecvGradient): the time the rank waited for the message.
/// Sends (kSendActivation, kSendGradient): the time to post the (nonblocking) send.
struct MeasuredAction {
  PipelineAction action;
  double start = 0, end = 0;
};

/// Writes `actions` (one rank's, in the order it ran them) as dir/stage-SSS.json (SSS: `stage`,
/// three digits), creating `dir`; the file is replaced atomically, so each call overwrites the
/// stage's previous trace with the step `step` the caller wants drawn. Throws RuntimeFailure
/// naming the file when it cannot be written.
void write_stage_trace(const std::filesystem::path& dir, int stage, int step,
                       const std::vector<MeasuredAction>& actions);

/// A merged measured step and the simulator's prediction for it.
struct MeasuredPipeline {
  /// The compute actions of every stage, their times shifted so the earliest compute start over
  /// all stages is 0 (work before the first forward, e.g. loading micro-batches, is not bubble);
  /// busy = compute durations, peak in-flight as the simulator counts it (finish_timeline).
  PipelineTimeline measured;
  /// Per virtual stage v = c·P + r (P·V entries): the means of its measured compute durations, in
  /// seconds: forward; backward_input = the fused backward and backward_weight = 0 for schedules
  /// without a split backward; zb-h1: the means of B and of W. Stages are rarely balanced
  /// (GPT-2's last holds the LM head), so the prediction uses these.
  std::vector<PipelineOpTimes> stage_mean_times;
  /// The same means over all stages and chunks (shown in the summary; not used to predict).
  PipelineOpTimes mean_times;
  /// simulate_pipeline(schedule, shape, stage_mean_times): what the step would take if every pass
  /// through a virtual stage took that stage's mean time and transfers none.
  PipelineTimeline predicted;
  double measured_bubble = 0, predicted_bubble = 0;  ///< bubble_fraction() of the two
  double recv_wait_seconds = 0;                      ///< all stages' receive waits together
  std::vector<double> stage_recv_wait;               ///< per stage: its receive waits, seconds
  int step = 0;                                      ///< the step the stage files recorded
  std::vector<std::filesystem::path> files;          ///< what merge_pipeline_trace wrote
};

/// Reads dir/stage-000.json .. stage-(P−1).json and merges them; writes dir/trace.json (Chrome
/// trace: one "X" event per recorded action, ts and dur in microseconds from the earliest
/// recorded start, pid = stage, tid 0 compute and tid 1 communication, process_name "stage S"),
/// dir/timeline.svg (the measured timeline) and dir/predicted.svg (the prediction), and PNG
/// copies of both when render_png finds a renderer. Throws ConfigError for shapes
/// check_pipeline_shape rejects and RuntimeFailure naming the file when a stage file is missing
/// or corrupt: unreadable JSON, a missing field, another stage's number or another step than
/// stage 0's, an end before its start, or compute actions other than those `schedule` gives the
/// stage for `shape`, in its order.
MeasuredPipeline merge_pipeline_trace(const std::filesystem::path& dir, PipelineSchedule schedule,
                                      const PipelineShape& shape);

/// The summary lines: the measured bubble next to the simulator's for the measured op times of
/// each stage, step time measured and predicted, the receive waits, the mean op times over all
/// stages, and per stage its mean op times (per chunk when interleaved), utilization (measured
/// and predicted), receive wait and peak in-flight activations. E.g.
///   measured bubble 68.1% (simulator, for the measured op times of each stage: 66.9%) | ...
///     stage  3: F 20.5 ms, B 41.2 ms | utilization  97.0% (simulated  98.1%) | ...
std::string format_measured_summary(const MeasuredPipeline& m);

}  // namespace shardtrain
