// The timeline of an offloaded run's steps (--trace): what the GPU computes, what crosses PCIe
// each way, what the host's optimizer and the disk do, as lanes of one picture, so that the time
// the GPU waits for the host (or the disk) is visible and attributed.
//
// Device lanes are timed by events on the streams that do the work (DeviceTimeline: the compute
// stream, each copy stream); host lanes by the host's steady clock. Both count seconds from
// start(), taken with the device idle, so that the device origin is also the host's.
//
// Files (write()): DIR/offload-trace.json, a Chrome trace (Trace Event Format: one "X" event
// per segment, ts and dur in microseconds, tid = lane, thread_name metadata; chrome://tracing or
// ui.perfetto.dev), and DIR/offload-timeline.svg (PNG beside it when monitor/render_png.h finds a
// renderer).
#pragma once

#include <chrono>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/host_transfer.h"

namespace shardtrain {

/// The lanes of a step timeline, top to bottom.
enum class TraceLane : int {
  kCompute = 0,    ///< GPU kernels of each layer's forward or backward (one segment per layer)
  kToHost,         ///< PCIe device → host copies (gradients)
  kToDevice,       ///< PCIe host → device copies (updated parameters)
  kHostOptimizer,  ///< the CPU AdamW of each part (and its rollback and redo)
  kDisk,           ///< waits for NVMe reads of the optimizer state
  kCount
};
const char* lane_name(TraceLane lane);

class StepTrace {
 public:
  using HostTime = std::chrono::steady_clock::time_point;
  explicit StepTrace(std::unique_ptr<DeviceTimeline> device);

  /// Starts the timeline (the device must be idle) and forgets what was recorded before.
  void start();
  /// A device timestamp after the work enqueued so far on `copies` (nullptr: compute stream).
  size_t mark(CopyStream* copies) { return device_->mark(copies); }
  /// A segment of device work between marks `begin` and `end` (indices from mark()).
  void device_segment(TraceLane lane, std::string label, size_t begin, size_t end);
  /// A segment of host work between host times `begin` and `end`.
  void host_segment(TraceLane lane, std::string label, HostTime begin, HostTime end);

  struct Segment {
    TraceLane lane;
    std::string label;
    double start = 0, end = 0;  ///< seconds from start()
  };
  /// Every segment, device marks resolved (waits for them), sorted by lane then start.
  std::vector<Segment> finish();

  /// Writes DIR/offload-trace.json and DIR/offload-timeline.svg (+ .png) of `segments`, titled
  /// `title`, creating DIR. Returns the summary lines: per lane its busy seconds, and the GPU's
  /// idle time between its first and last segment. Throws RuntimeFailure naming a file that
  /// cannot be written.
  static std::vector<std::string> write(const std::filesystem::path& dir,
                                        const std::vector<Segment>& segments,
                                        const std::string& title);

 private:
  struct DeviceSegment {
    TraceLane lane;
    std::string label;
    size_t begin, end;
  };
  std::unique_ptr<DeviceTimeline> device_;
  std::mutex mu_;
  std::vector<DeviceSegment> device_segments_;
  std::vector<Segment> host_segments_;
};

/// The SVG of a timeline: one row per lane, one rectangle per segment, a seconds axis.
std::string step_timeline_svg(const std::vector<StepTrace::Segment>& segments,
                              const std::string& title);

}  // namespace shardtrain
