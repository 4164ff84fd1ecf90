#include "parallel/pipeline/simulator.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

/// Key of a pass: (kind, micro-batch, virtual stage); kind 0 forward, 1 input gradient (the
/// fused backward counts as one), 2 weight gradient.
using PassKey = std::tuple<int, int, int>;

int pass_kind(ActionType t) {
  switch (t) {
    case ActionType::kForward:
      return 0;
    case ActionType::kBackward:
    case ActionType::kBackwardInput:
      return 1;
    default:
      return 2;
  }
}

double duration(ActionType t, const PipelineOpTimes& times) {
  switch (t) {
    case ActionType::kForward:
      return times.forward;
    case ActionType::kBackward:
      return times.backward_input + times.backward_weight;
    case ActionType::kBackwardInput:
      return times.backward_input;
    default:
      return times.backward_weight;
  }
}

char letter(ActionType t) {
  switch (t) {
    case ActionType::kForward:
      return 'F';
    case ActionType::kBackwardWeight:
      return 'W';
    default:
      return 'B';
  }
}

}  // namespace

std::string action_label(const PipelineShape& s, const PipelineAction& a) {
  std::string l = fmt::format("{}{}", letter(a.type), a.micro_batch);
  if (s.virtual_stages > 1) l += static_cast<char>('a' + a.chunk);
  return l;
}

void finish_timeline(PipelineTimeline& t) {
  const auto P = static_cast<size_t>(t.shape.stages);
  std::stable_sort(t.entries.begin(), t.entries.end(),
                   [](const TimelineEntry& a, const TimelineEntry& b) { return a.rank < b.rank; });
  t.makespan = 0;
  t.busy.assign(P, 0.0);
  t.peak_in_flight.assign(P, 0);
  std::vector<int> in_flight(P, 0);
  // 2bw without fill: the look-ahead forwards of the step before are held from the start.
  if (!t.shape.fill)
    for (size_t r = 0; r < P; ++r) in_flight[r] = two_bw_lookahead(t.shape, static_cast<int>(r));
  for (const TimelineEntry& e : t.entries) {
    const auto r = static_cast<size_t>(e.rank);
    ST_ASSERT(r < P);
    t.busy[r] += e.end - e.start;
    t.makespan = std::max(t.makespan, e.end);
    if (e.action.type == ActionType::kForward) ++in_flight[r];
    if (e.action.type == ActionType::kBackward || e.action.type == ActionType::kBackwardWeight)
      --in_flight[r];
    t.peak_in_flight[r] = std::max(t.peak_in_flight[r], in_flight[r]);
  }
}

double PipelineTimeline::bubble_fraction() const {
  if (makespan <= 0) return 0;
  double total = 0;
  for (double b : busy) total += b;
  return 1.0 - total / (static_cast<double>(busy.size()) * makespan);
}

double PipelineTimeline::utilization(int rank) const {
  return makespan > 0 ? busy[static_cast<size_t>(rank)] / makespan : 0;
}

PipelineTimeline simulate_pipeline(PipelineSchedule schedule, const PipelineShape& s,
                                   const PipelineOpTimes& times) {
  check_pipeline_shape(schedule, s);
  return simulate_pipeline(
      schedule, s,
      std::vector<PipelineOpTimes>(static_cast<size_t>(s.stages * s.virtual_stages), times));
}

PipelineTimeline simulate_pipeline(PipelineSchedule schedule, const PipelineShape& s,
                                   const std::vector<PipelineOpTimes>& per_virtual_stage) {
  check_pipeline_shape(schedule, s);
  const int P = s.stages, last = s.stages * s.virtual_stages - 1;
  check<ConfigError>(per_virtual_stage.size() == static_cast<size_t>(last + 1),
                     "pipeline simulation: {} op times given for {} virtual stages ({} stages × "
                     "{} chunks): give one F,B[,W] per virtual stage",
                     per_virtual_stage.size(), last + 1, s.stages, s.virtual_stages);
  std::vector<std::vector<PipelineAction>> actions(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r)
    actions[static_cast<size_t>(r)] = pipeline_compute_actions(schedule, s, r);
  PipelineTimeline t;
  t.schedule = schedule;
  t.shape = s;
  std::map<PassKey, double> done;  // pass → end time
  // 2bw without fill: a pass no rank runs in this step ran in the step before (ready at 0).
  std::set<PassKey> in_step;
  for (int r = 0; r < P; ++r)
    for (const PipelineAction& a : actions[static_cast<size_t>(r)])
      in_step.insert({pass_kind(a.type), a.micro_batch, virtual_stage(s, r, a.chunk)});
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  std::vector<double> free_at(static_cast<size_t>(P), 0.0);
  size_t remaining = 0;
  for (const auto& a : actions) remaining += a.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < P; ++r) {
      auto& list = actions[static_cast<size_t>(r)];
      size_t& i = next[static_cast<size_t>(r)];
      while (i < list.size()) {
        const PipelineAction& a = list[i];
        const int v = virtual_stage(s, r, a.chunk), kind = pass_kind(a.type);
        PassKey dep{-1, 0, 0};
        if (kind == 0 && v > 0) dep = {0, a.micro_batch, v - 1};
        if (kind == 1)
          dep = v < last ? PassKey{1, a.micro_batch, v + 1} : PassKey{0, a.micro_batch, v};
        if (kind == 2) dep = {1, a.micro_batch, v};
        double ready = 0;
        if (std::get<0>(dep) >= 0 && in_step.count(dep)) {
          const auto it = done.find(dep);
          if (it == done.end()) break;  // blocked on a receive
          ready = it->second;
        }
        TimelineEntry e{r, a, std::max(ready, free_at[static_cast<size_t>(r)]), 0};
        e.end = e.start + duration(a.type, per_virtual_stage[static_cast<size_t>(v)]);
        free_at[static_cast<size_t>(r)] = e.end;
        done[{kind, a.micro_batch, v}] = e.end;
        t.entries.push_back(e);
        ++i;
        --remaining;
        progressed = true;
      }
    }
    if (!progressed)
      throw RuntimeFailure(fmt::format(
          "pipeline schedule {} deadlocks for {} stages, {} micro-batches, {} virtual stages: "
          "every rank waits for a transfer no rank will send",
          to_string(schedule), s.stages, s.micro_batches, s.virtual_stages));
  }
  finish_timeline(t);  // the entries of each rank were appended in its execution order
  return t;
}

std::string format_timeline_text(const PipelineTimeline& t, double unit) {
  ST_ASSERT(unit > 0);
  std::string out;
  const auto column = [&](double time) { return static_cast<size_t>(std::lround(time / unit)); };
  constexpr size_t kCell = 4;  // characters per unit of time
  for (int r = 0; r < t.shape.stages; ++r) {
    std::string row(column(t.makespan) * kCell, '.');
    for (const TimelineEntry& e : t.entries) {
      if (e.rank != r) continue;
      const size_t b = column(e.start) * kCell,
                   n = std::max<size_t>(1, column(e.end - e.start)) * kCell;
      std::string cell = action_label(t.shape, e.action);
      cell.resize(n - 1, ' ');
      cell += '|';
      row.replace(b, std::min(n, row.size() - b), cell.substr(0, std::min(n, row.size() - b)));
    }
    out += fmt::format("stage {:>2} |{}\n", r, row);
  }
  return out;
}

std::string format_timeline_summary(const PipelineTimeline& t) {
  const PipelineShape& s = t.shape;
  std::string out = fmt::format(
      "schedule {} | {} stages × {} micro-batches{} | step time {:g} | bubble {:.1f}% "
      "(GPipe/1F1B theory (P−1)/(M+P−1) = {:.1f}%)\n",
      to_string(t.schedule), s.stages, s.micro_batches,
      s.virtual_stages > 1 ? fmt::format(" × {} virtual stages", s.virtual_stages) : "", t.makespan,
      100.0 * t.bubble_fraction(),
      100.0 * (s.stages - 1) / static_cast<double>(s.micro_batches + s.stages - 1));
  for (int r = 0; r < s.stages; ++r)
    out += fmt::format(
        "  stage {:>2}: utilization {:5.1f}% | peak in-flight activations {} "
        "micro-batch{}\n",
        r, 100.0 * t.utilization(r), t.peak_in_flight[static_cast<size_t>(r)],
        s.virtual_stages > 1 ? " chunks" : "es");
  if (t.schedule == PipelineSchedule::k2BW)
    out += fmt::format(
        "  weights (PipeDream-2BW, arXiv 2006.09503): every forward and backward of step t "
        "uses W(t−1) (the\n  stashed copy); the update W(t+1) = W(t) − η·∇f(W(t−1)) applies "
        "after step t's last backward: one step stale, two versions held\n"
        "  {}\n",
        s.fill && s.drain ? "this step fills and drains the pipeline (a flush, as 1F1B)"
        : !s.fill && !s.drain
            ? "steady state (no flush): the previous step's look-ahead forwards are in flight at "
              "the start, the next step's run at the end"
        : !s.fill ? "no fill (the previous step's look-ahead forwards in flight), then a drain"
                  : "a fill, then the next step's look-ahead forwards instead of a drain");
  return out;
}

std::string timeline_svg(const PipelineTimeline& t, const std::string& title) {
  const double width = 960, left = 70, row = 34, top = 44;
  const double scale = t.makespan > 0 ? (width - left - 10) / t.makespan : 1;
  const double height = top + row * t.shape.stages + 40;
  std::string svg = svg_begin(width, height, left, title);
  for (int r = 0; r < t.shape.stages; ++r)
    svg += fmt::format("<text x=\"8\" y=\"{:.1f}\" font-size=\"12\">stage {}</text>\n",
                       top + row * r + row * 0.6, r);
  for (const TimelineEntry& e : t.entries) {
    const char* colors[] = {"#4e79a7", "#59a14f", "#f28e2b"};
    const char* fill = colors[pass_kind(e.action.type)];
    const double x = left + e.start * scale, w = (e.end - e.start) * scale;
    const double y = top + row * e.rank + 3;
    const double opacity = 1.0 - 0.35 * e.action.chunk / std::max(1, t.shape.virtual_stages);
    svg += fmt::format(
        "<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{:.1f}\" fill=\"{}\" "
        "fill-opacity=\"{:.2f}\" stroke=\"white\" stroke-width=\"1\"/>\n",
        x, y, w, row - 6, fill, opacity);
    if (w >= 14)
      svg += fmt::format(
          "<text x=\"{:.2f}\" y=\"{:.1f}\" font-size=\"10\" fill=\"white\" "
          "text-anchor=\"middle\">{}</text>\n",
          x + w / 2, y + (row - 6) / 2 + 4, action_label(t.shape, e.action));
  }
  svg += fmt::format(
      "<text x=\"{:.0f}\" y=\"{:.1f}\" font-size=\"12\">bubble {:.1f}% · F blue, B green, W "
      "orange · time →</text>\n</svg>\n",
      left, top + row * t.shape.stages + 24, 100.0 * t.bubble_fraction());
  return svg;
}

}  // namespace shardtrain
