#include "parallel/pipeline/trace.h"

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "core/error.h"
#include "io/atomic_file.h"
#include "monitor/render_png.h"

namespace shardtrain {
namespace {

using nlohmann::json;

constexpr std::string_view kFormat = "shardtrain-pipeline-stage-trace";
constexpr int kVersion = 1;

/// The action types as the stage files spell them, in ActionType's order.
constexpr std::array<std::string_view, 8> kTypeNames = {
    "forward",         "backward",        "backward_input", "backward_weight",
    "recv_activation", "send_activation", "recv_gradient",  "send_gradient"};

std::string_view type_name(ActionType t) { return kTypeNames[static_cast<size_t>(t)]; }

bool is_compute(ActionType t) {
  return t == ActionType::kForward || t == ActionType::kBackward ||
         t == ActionType::kBackwardInput || t == ActionType::kBackwardWeight;
}

bool is_recv(ActionType t) {
  return t == ActionType::kRecvActivation || t == ActionType::kRecvGradient;
}

std::filesystem::path stage_file(const std::filesystem::path& dir, int stage) {
  return dir / fmt::format("stage-{:03d}.json", stage);
}

/// "F3", "B3b" for compute actions; "recv act 3", "send grad 3a" for transfers.
std::string event_name(const PipelineShape& s, const PipelineAction& a) {
  if (is_compute(a.type)) return action_label(s, a);
  std::string name;
  switch (a.type) {
    case ActionType::kRecvActivation:
      name = "recv act";
      break;
    case ActionType::kSendActivation:
      name = "send act";
      break;
    case ActionType::kRecvGradient:
      name = "recv grad";
      break;
    default:
      name = "send grad";
  }
  name += fmt::format(" {}", a.micro_batch);
  if (s.virtual_stages > 1) name += static_cast<char>('a' + a.chunk);
  return name;
}

/// One stage's file as read back.
struct StageTrace {
  int step = 0;
  std::vector<MeasuredAction> actions;
};

/// Reads and checks dir/stage-SSS.json. Throws RuntimeFailure naming the file.
StageTrace read_stage_trace(const std::filesystem::path& dir, int stage,
                            const PipelineShape& shape) {
  const std::filesystem::path path = stage_file(dir, stage);
  const auto corrupt = [&](const std::string& why) {
    return RuntimeFailure(fmt::format("pipeline trace {} is corrupt: {}", path.string(), why));
  };
  if (!std::filesystem::exists(path))
    throw RuntimeFailure(fmt::format(
        "pipeline trace {} is missing: merging needs one file per stage (stage-000.json .. "
        "stage-{:03d}.json for {} stages), each written by that stage's rank",
        path.string(), shape.stages - 1, shape.stages));
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error& e) {
    throw RuntimeFailure(fmt::format("pipeline trace {}: {}", path.string(), e.what()));
  }
  StageTrace t;
  try {
    const json j = json::parse(text);
    if (j.at("format").get<std::string>() != kFormat || j.at("version").get<int>() != kVersion)
      throw corrupt(fmt::format("not a {} version {} file", kFormat, kVersion));
    const int file_stage = j.at("stage").get<int>();
    if (file_stage != stage)
      throw corrupt(fmt::format("it records stage {}, not {}", file_stage, stage));
    t.step = j.at("step").get<int>();
    for (const json& a : j.at("actions")) {
      const std::string type = a.at("type").get<std::string>();
      const auto it = std::find(kTypeNames.begin(), kTypeNames.end(), type);
      if (it == kTypeNames.end()) throw corrupt(fmt::format("unknown action type '{}'", type));
      MeasuredAction m{{static_cast<ActionType>(it - kTypeNames.begin()),
                        a.at("micro_batch").get<int>(), a.at("chunk").get<int>()},
                       a.at("start").get<double>(),
                       a.at("end").get<double>()};
      // 2bw without drain: the look-ahead forwards are numbered M..2M−1.
      const int micro_batches = shape.micro_batches * (shape.drain ? 1 : 2);
      if (m.action.micro_batch < 0 || m.action.micro_batch >= micro_batches || m.action.chunk < 0 ||
          m.action.chunk >= shape.virtual_stages)
        throw corrupt(fmt::format("action {} {} chunk {} is outside {} micro-batches × {} chunks",
                                  type, m.action.micro_batch, m.action.chunk, micro_batches,
                                  shape.virtual_stages));
      if (!std::isfinite(m.start) || !std::isfinite(m.end) || m.end < m.start)
        throw corrupt(fmt::format("action {} {} ends ({}) before it starts ({})", type,
                                  m.action.micro_batch, m.end, m.start));
      t.actions.push_back(m);
    }
  } catch (const json::exception& e) {
    throw corrupt(e.what());
  }
  return t;
}

/// The Chrome trace (Trace Event Format) of every recorded action.
json chrome_trace(const PipelineShape& shape, const std::vector<StageTrace>& stages,
                  const std::string& title) {
  double origin = std::numeric_limits<double>::infinity();
  for (const StageTrace& s : stages)
    for (const MeasuredAction& a : s.actions) origin = std::min(origin, a.start);
  json events = json::array();
  for (int r = 0; r < shape.stages; ++r) {
    events.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", r},
                      {"tid", 0},
                      {"args", {{"name", fmt::format("stage {}", r)}}}});
    events.push_back({{"name", "process_sort_index"},
                      {"ph", "M"},
                      {"pid", r},
                      {"tid", 0},
                      {"args", {{"sort_index", r}}}});
    for (int tid : {0, 1})
      events.push_back({{"name", "thread_name"},
                        {"ph", "M"},
                        {"pid", r},
                        {"tid", tid},
                        {"args", {{"name", tid == 0 ? "compute" : "communication"}}}});
    for (const MeasuredAction& a : stages[static_cast<size_t>(r)].actions) {
      const bool compute = is_compute(a.action.type);
      events.push_back({{"name", event_name(shape, a.action)},
                        {"cat", compute                  ? "compute"
                                : is_recv(a.action.type) ? "recv"
                                                         : "send"},
                        {"ph", "X"},
                        {"ts", (a.start - origin) * 1e6},
                        {"dur", (a.end - a.start) * 1e6},
                        {"pid", r},
                        {"tid", compute ? 0 : 1},
                        {"args",
                         {{"type", type_name(a.action.type)},
                          {"micro_batch", a.action.micro_batch},
                          {"chunk", a.action.chunk}}}});
    }
  }
  return {{"traceEvents", std::move(events)},
          {"displayTimeUnit", "ms"},
          {"otherData", {{"title", title}}}};
}

std::string shape_text(PipelineSchedule schedule, const PipelineShape& s) {
  return fmt::format("{}, P={}, M={}, V={}{}", to_string(schedule), s.stages, s.micro_batches,
                     s.virtual_stages,
                     s.fill && s.drain     ? ""
                     : !s.fill && !s.drain ? ", steady (no flush)"
                     : !s.fill             ? ", no fill"
                                           : ", no drain");
}

}  // namespace

void write_stage_trace(const std::filesystem::path& dir, int stage, int step,
                       const std::vector<MeasuredAction>& actions) {
  json list = json::array();
  for (const MeasuredAction& a : actions)
    list.push_back({{"type", type_name(a.action.type)},
                    {"micro_batch", a.action.micro_batch},
                    {"chunk", a.action.chunk},
                    {"start", a.start},
                    {"end", a.end}});
  const json j = {{"format", kFormat},
                  {"version", kVersion},
                  {"stage", stage},
                  {"step", step},
                  {"actions", std::move(list)}};
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw RuntimeFailure(fmt::format("pipeline trace: cannot create the directory {}: {}",
                                     dir.string(), ec.message()));
  write_file_atomic(stage_file(dir, stage), j.dump(1) + "\n");
}

MeasuredPipeline merge_pipeline_trace(const std::filesystem::path& dir, PipelineSchedule schedule,
                                      const PipelineShape& shape) {
  check_pipeline_shape(schedule, shape);
  const auto P = static_cast<size_t>(shape.stages);
  std::vector<StageTrace> stages;
  for (int r = 0; r < shape.stages; ++r) {
    stages.push_back(read_stage_trace(dir, r, shape));
    if (stages.back().step != stages.front().step)
      throw RuntimeFailure(fmt::format(
          "pipeline trace {} records step {} but {} step {}: the stage files come from different "
          "steps (or runs); write them again",
          stage_file(dir, r).string(), stages.back().step, stage_file(dir, 0).string(),
          stages.front().step));
  }

  MeasuredPipeline m;
  m.step = stages.front().step;
  m.measured.schedule = schedule;
  m.measured.shape = shape;
  m.stage_recv_wait.assign(P, 0.0);
  double origin = std::numeric_limits<double>::infinity();
  for (const StageTrace& s : stages)
    for (const MeasuredAction& a : s.actions)
      if (is_compute(a.action.type)) origin = std::min(origin, a.start);
  // Sums and counts of the measured durations per virtual stage, and over all of them (the last
  // entry): forward, input gradient (or fused), weight.
  const auto V = static_cast<size_t>(shape.stages * shape.virtual_stages);
  std::vector<std::array<double, 3>> sum(V + 1, std::array<double, 3>{});
  std::vector<std::array<int, 3>> count(V + 1, std::array<int, 3>{});
  for (int r = 0; r < shape.stages; ++r) {
    const std::vector<PipelineAction> expected = pipeline_compute_actions(schedule, shape, r);
    size_t i = 0;
    for (const MeasuredAction& a : stages[static_cast<size_t>(r)].actions) {
      if (is_recv(a.action.type)) m.stage_recv_wait[static_cast<size_t>(r)] += a.end - a.start;
      if (!is_compute(a.action.type)) continue;
      if (i >= expected.size() || !(a.action == expected[i]))
        throw RuntimeFailure(fmt::format(
            "pipeline trace {} does not match schedule {}: its compute action {} is {}, the "
            "schedule's is {} (was it written by a run with another schedule or shape?)",
            stage_file(dir, r).string(), shape_text(schedule, shape), i,
            action_label(shape, a.action),
            i < expected.size() ? action_label(shape, expected[i]) : std::string("none")));
      ++i;
      m.measured.entries.push_back({r, a.action, a.start - origin, a.end - origin});
      const size_t k = a.action.type == ActionType::kForward          ? 0
                       : a.action.type == ActionType::kBackwardWeight ? 2
                                                                      : 1;
      const auto v = static_cast<size_t>(virtual_stage(shape, r, a.action.chunk));
      for (size_t j : {v, V}) {
        sum[j][k] += a.end - a.start;
        ++count[j][k];
      }
    }
    if (i != expected.size())
      throw RuntimeFailure(fmt::format(
          "pipeline trace {} is incomplete: {} compute actions of the {} schedule {} gives "
          "stage {}",
          stage_file(dir, r).string(), i, expected.size(), shape_text(schedule, shape), r));
    m.recv_wait_seconds += m.stage_recv_wait[static_cast<size_t>(r)];
  }
  finish_timeline(m.measured);
  const auto mean = [&](size_t j) {
    const auto of = [&](size_t k) { return count[j][k] > 0 ? sum[j][k] / count[j][k] : 0.0; };
    return PipelineOpTimes{of(0), of(1), of(2)};
  };
  for (size_t v = 0; v < V; ++v) m.stage_mean_times.push_back(mean(v));
  m.mean_times = mean(V);
  m.predicted = simulate_pipeline(schedule, shape, m.stage_mean_times);
  m.measured_bubble = m.measured.bubble_fraction();
  m.predicted_bubble = m.predicted.bubble_fraction();

  const std::string what = fmt::format("{}, step {}", shape_text(schedule, shape), m.step);
  const auto write = [&](const std::filesystem::path& path, const std::string& text) {
    write_file_atomic(path, text);
    m.files.push_back(path);
  };
  write(dir / "trace.json", chrome_trace(shape, stages, "measured " + what).dump() + "\n");
  write(dir / "timeline.svg", timeline_svg(m.measured, fmt::format("measured: {} ({:.3g} ms)", what,
                                                                   1e3 * m.measured.makespan)));
  write(
      dir / "predicted.svg",
      timeline_svg(m.predicted,
                   fmt::format("simulated for the measured op times of each stage: {} ({:.3g} ms)",
                               shape_text(schedule, shape), 1e3 * m.predicted.makespan)));
  for (const char* name : {"timeline", "predicted"}) {
    const std::filesystem::path png = dir / fmt::format("{}.png", name);
    if (render_png(dir / fmt::format("{}.svg", name), png)) m.files.push_back(png);
  }
  return m;
}

std::string format_measured_summary(const MeasuredPipeline& m) {
  const PipelineShape& s = m.measured.shape;
  const bool split = m.measured.schedule == PipelineSchedule::kZBH1;
  // "F 4.1 ms, B 8.3 ms" (the fused backward) or "F 4.1 ms, B 4 ms, W 4.3 ms" (zb-h1).
  const auto times = [&](const PipelineOpTimes& t) {
    return split ? fmt::format("F {:.3g} ms, B {:.3g} ms, W {:.3g} ms", 1e3 * t.forward,
                               1e3 * t.backward_input, 1e3 * t.backward_weight)
                 : fmt::format("F {:.3g} ms, B {:.3g} ms", 1e3 * t.forward,
                               1e3 * (t.backward_input + t.backward_weight));
  };
  std::string out = fmt::format(
      "measured bubble {:.1f}% (simulator, for the measured op times of each stage: {:.1f}%) | "
      "step time {:.3g} ms (simulated {:.3g} ms) | recv wait {:.3g} ms over {} stages | mean op "
      "times over all stages {}\n",
      100.0 * m.measured_bubble, 100.0 * m.predicted_bubble, 1e3 * m.measured.makespan,
      1e3 * m.predicted.makespan, 1e3 * m.recv_wait_seconds, s.stages, times(m.mean_times));
  for (int r = 0; r < s.stages; ++r) {
    const auto i = static_cast<size_t>(r);
    std::string stage_times;
    for (int c = 0; c < s.virtual_stages; ++c) {
      const auto v = static_cast<size_t>(virtual_stage(s, r, c));
      if (v >= m.stage_mean_times.size()) continue;
      if (c > 0) stage_times += "; ";
      if (s.virtual_stages > 1)
        stage_times += fmt::format("chunk {}: ", static_cast<char>('a' + c));
      stage_times += times(m.stage_mean_times[v]);
    }
    out += fmt::format(
        "  stage {:>2}: {} | utilization {:5.1f}% (simulated {:5.1f}%) | recv wait {:.3g} ms | "
        "peak in-flight activations {}\n",
        r, stage_times, 100.0 * m.measured.utilization(r), 100.0 * m.predicted.utilization(r),
        1e3 * (i < m.stage_recv_wait.size() ? m.stage_recv_wait[i] : 0.0),
        m.measured.peak_in_flight[i]);
  }
  return out;
}

}  // namespace shardtrain
