#include "monitor/step_trace.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/strings.h"
#include "io/atomic_file.h"
#include "monitor/render_png.h"

namespace shardtrain {

const char* lane_name(TraceLane lane) {
  switch (lane) {
    case TraceLane::kCompute:
      return "GPU compute";
    case TraceLane::kToHost:
      return "PCIe to host";
    case TraceLane::kToDevice:
      return "PCIe to GPU";
    case TraceLane::kHostOptimizer:
      return "host AdamW";
    case TraceLane::kDisk:
      return "NVMe read wait";
    case TraceLane::kCount:
      break;
  }
  return "?";
}

StepTrace::StepTrace(std::unique_ptr<DeviceTimeline> device) : device_(std::move(device)) {
  ST_ASSERT(device_);
}

void StepTrace::start() {
  std::lock_guard<std::mutex> lock(mu_);
  device_segments_.clear();
  host_segments_.clear();
  device_->start();
}

void StepTrace::device_segment(TraceLane lane, std::string label, size_t begin, size_t end) {
  std::lock_guard<std::mutex> lock(mu_);
  device_segments_.push_back({lane, std::move(label), begin, end});
}

void StepTrace::host_segment(TraceLane lane, std::string label, HostTime begin, HostTime end) {
  const auto origin = device_->host_origin();
  const auto seconds = [&](HostTime t) {
    return std::chrono::duration<double>(t - origin).count();
  };
  std::lock_guard<std::mutex> lock(mu_);
  host_segments_.push_back({lane, std::move(label), seconds(begin), seconds(end)});
}

std::vector<StepTrace::Segment> StepTrace::finish() {
  const std::vector<double> at = device_->read();
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Segment> out = host_segments_;
  for (const DeviceSegment& d : device_segments_) {
    ST_ASSERT(d.begin < at.size() && d.end < at.size());
    out.push_back({d.lane, d.label, at[d.begin], std::max(at[d.begin], at[d.end])});
  }
  std::sort(out.begin(), out.end(), [](const Segment& a, const Segment& b) {
    return a.lane != b.lane ? a.lane < b.lane : a.start < b.start;
  });
  return out;
}

std::string step_timeline_svg(const std::vector<StepTrace::Segment>& segments,
                              const std::string& title) {
  const int lanes = static_cast<int>(TraceLane::kCount);
  const double width = 1200, left = 120, right = 16, row = 30, top = 44;
  double end = 0;
  for (const auto& s : segments) end = std::max(end, s.end);
  const double scale = end > 0 ? (width - left - right) / end : 1;
  const double height = top + row * lanes + 48;
  std::string svg = svg_begin(width, height, left, title);
  const char* colors[] = {"#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1"};
  for (int l = 0; l < lanes; ++l) {
    svg += fmt::format(
        "<text x=\"8\" y=\"{:.1f}\" font-size=\"12\">{}</text>\n"
        "<rect x=\"{:.0f}\" y=\"{:.1f}\" width=\"{:.0f}\" height=\"{:.1f}\" fill=\"#f4f4f4\"/>\n",
        top + row * l + row * 0.6, lane_name(static_cast<TraceLane>(l)), left, top + row * l + 3,
        width - left - right, row - 6);
  }
  for (const auto& s : segments) {
    const int l = static_cast<int>(s.lane);
    const double x = left + s.start * scale, w = std::max(0.5, (s.end - s.start) * scale);
    svg += fmt::format(
        "<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{:.1f}\" fill=\"{}\" "
        "stroke=\"white\" stroke-width=\"0.3\"><title>{} {:.3f}–{:.3f} s</title></rect>\n",
        x, top + row * l + 3, w, row - 6, colors[l], xml_escape(s.label), s.start, s.end);
  }
  // The seconds axis: about ten ticks at 1, 2 or 5 × a power of ten.
  const double raw = end / 10;
  const double p10 = raw > 0 ? std::pow(10.0, std::floor(std::log10(raw))) : 1;
  const double tick = raw <= p10       ? p10
                      : raw <= 2 * p10 ? 2 * p10
                      : raw <= 5 * p10 ? 5 * p10
                                       : 10 * p10;
  const double axis = top + row * lanes + 4;
  for (double t = 0; t <= end + 1e-12 && tick > 0; t += tick)
    svg += fmt::format(
        "<line x1=\"{0:.2f}\" x2=\"{0:.2f}\" y1=\"{1:.1f}\" y2=\"{2:.1f}\" stroke=\"#999\"/>"
        "<text x=\"{0:.2f}\" y=\"{3:.1f}\" font-size=\"10\" text-anchor=\"middle\">{4:g}</text>\n",
        left + t * scale, axis, axis + 5, axis + 16, t);
  svg += fmt::format("<text x=\"{:.0f}\" y=\"{:.1f}\" font-size=\"12\">seconds →</text>\n</svg>\n",
                     left, axis + 36);
  return svg;
}

std::vector<std::string> StepTrace::write(const std::filesystem::path& dir,
                                          const std::vector<Segment>& segments,
                                          const std::string& title) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  check<RuntimeFailure>(!ec, "--trace: cannot create the directory '{}': {}", dir.string(),
                        ec.message());
  nlohmann::json events = nlohmann::json::array();
  for (int l = 0; l < static_cast<int>(TraceLane::kCount); ++l)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", l},
                      {"args", {{"name", lane_name(static_cast<TraceLane>(l))}}}});
  for (const Segment& s : segments)
    events.push_back({{"name", s.label},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", static_cast<int>(s.lane)},
                      {"ts", 1e6 * s.start},
                      {"dur", 1e6 * (s.end - s.start)}});
  write_file_atomic(
      dir / "offload-trace.json",
      nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() + "\n");
  const std::filesystem::path svg = dir / "offload-timeline.svg";
  write_file_atomic(svg, step_timeline_svg(segments, title));
  const bool png = render_png(svg, dir / "offload-timeline.png");
  // Per lane: busy seconds (segments of a lane do not overlap, except host tasks never do and
  // copies of one stream run in order). The GPU's idle time: the gaps between its segments.
  std::vector<double> busy(static_cast<size_t>(TraceLane::kCount), 0.0);
  double first = -1, last = 0, computed = 0;
  for (const Segment& s : segments) {
    busy[static_cast<size_t>(s.lane)] += s.end - s.start;
    if (s.lane != TraceLane::kCompute) continue;
    if (first < 0) first = s.start;
    last = std::max(last, s.end);
    computed += s.end - s.start;
  }
  std::vector<std::string> lines;
  lines.push_back(fmt::format("trace: {} and {}{} in {}", "offload-trace.json",
                              "offload-timeline.svg", png ? " (+ .png)" : "", dir.string()));
  std::string per_lane;
  for (int l = 0; l < static_cast<int>(TraceLane::kCount); ++l)
    per_lane += fmt::format("{}{} {:.3f} s", l ? ", " : "", lane_name(static_cast<TraceLane>(l)),
                            busy[static_cast<size_t>(l)]);
  lines.push_back("trace: busy " + per_lane);
  if (first >= 0)
    lines.push_back(fmt::format(
        "trace: the GPU computed {:.3f} s of {:.3f} s ({:.1f}%); idle between layers {:.3f} s "
        "(waiting for parameters, reductions, the steps' ends)",
        computed, last - first, 100.0 * computed / std::max(1e-12, last - first),
        last - first - computed));
  return lines;
}

}  // namespace shardtrain
