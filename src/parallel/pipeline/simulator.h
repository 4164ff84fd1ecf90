// The pipeline simulator: runs the schedules' action lists (schedule.h) with given op times and
// reports the timeline, the bubble, per-stage utilization and peak in-flight activations — the
// reference tutorial's pictures, made from the real scheduler (`shardtrain pipeline-sim`).
//
// Model: each rank runs its actions in order, one at a time; a forward of virtual stage v starts
// when the forward of v-1 on the same micro-batch has ended, a backward (or input-gradient pass)
// of v when that of v+1 has ended (the last virtual stage: after its own forward), a
// weight-gradient pass after its input-gradient pass. Transfers take no time and never block the
// sender (the executor posts them as nonblocking sends, receives block), so a schedule whose
// simulation finishes cannot deadlock.
#pragma once

#include <string>
#include <vector>

#include "parallel/pipeline/schedule.h"

namespace shardtrain {

/// Durations of the passes of one micro-batch through one model chunk (any unit, e.g. ms).
/// A fused backward (B+W) takes backward_input + backward_weight.
struct PipelineOpTimes {
  double forward = 1;
  double backward_input = 1;
  double backward_weight = 1;
};

/// One compute action as simulated (or measured).
struct TimelineEntry {
  int rank = 0;
  PipelineAction action{};
  double start = 0, end = 0;
};

struct PipelineTimeline {
  PipelineSchedule schedule{};
  PipelineShape shape;
  std::vector<TimelineEntry> entries;  ///< compute actions, per rank in execution order
  double makespan = 0;                 ///< end of the last action
  std::vector<double> busy;            ///< per rank: time spent computing
  std::vector<int> peak_in_flight;     ///< per rank: most micro-batch chunks whose activations
                                       ///< are held (forward done, weight gradient not yet)
  /// 1 − Σ busy / (P · makespan): the idle fraction of the step.
  double bubble_fraction() const;
  /// busy[r] / makespan.
  double utilization(int rank) const;
};

/// Fills `t.makespan`, `t.busy` and `t.peak_in_flight` from `t.entries` (and t.shape), and orders
/// the entries by rank, keeping each rank's entries in the order given (its execution order). A
/// rank's in-flight count rises with each forward and falls with each fused backward or
/// weight-gradient pass. The simulator and measured timelines (trace.h) both end with it.
void finish_timeline(PipelineTimeline& t);

/// The name of a compute action in pictures and traces: "F3" / "B3" / "W3" (micro-batch 3), with
/// the chunk as a suffix letter when interleaved ("F3a", "B3b").
std::string action_label(const PipelineShape& s, const PipelineAction& a);

/// Simulates one optimizer step of `schedule` on `shape` with the op times of each virtual stage:
/// `per_virtual_stage[v]` are the times of a pass through virtual stage v = c·P + r (model chunk c
/// on rank r, schedule.h), P·V entries — real stages are rarely balanced (GPT-2's last stage
/// holds the LM head), and the slowest stage sets the pace. Throws ConfigError for invalid shapes
/// or when `per_virtual_stage` does not have P·V entries, and RuntimeFailure if the schedule
/// deadlocks (no rank can proceed).
PipelineTimeline simulate_pipeline(PipelineSchedule schedule, const PipelineShape& shape,
                                   const std::vector<PipelineOpTimes>& per_virtual_stage);

/// The same with `times` for every virtual stage (balanced stages).
PipelineTimeline simulate_pipeline(PipelineSchedule schedule, const PipelineShape& shape,
                                   const PipelineOpTimes& times);

/// Per-stage text timeline: each action a cell "F3" / "B3" / "W3" (micro-batch 3; chunk as a
/// suffix letter when interleaved: F3a, F3b), idle time as dots, `unit` time per character.
std::string format_timeline_text(const PipelineTimeline& t, double unit);

/// The summary lines: bubble fraction, per-stage utilization and peak in-flight micro-batches,
/// and for 2bw the weight versions its passes use.
std::string format_timeline_summary(const PipelineTimeline& t);

/// An SVG picture of the timeline (stages as rows, time left to right; forwards blue, backwards
/// green, weight-gradient passes orange, labelled with the micro-batch), titled `title`.
std::string timeline_svg(const PipelineTimeline& t, const std::string& title);

}  // namespace shardtrain
