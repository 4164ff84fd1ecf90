// Measured pipeline traces (parallel/pipeline/trace.h): stage files made from the simulator's own
// timeline merge back into the same timeline and prediction; the Chrome trace, the pictures and
// the errors for missing or corrupt files; the PNG renderer (monitor/render_png.h).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "comm/launch.h"
#include "core/error.h"
#include "core/process.h"
#include "io/atomic_file.h"
#include "monitor/render_png.h"
#include "parallel/pipeline/trace.h"
#include "test_support.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;
using test_support::make_temp_dir;
using test_support::xml_problem;

constexpr double kScale = 1e-3;   // a simulated time unit is a millisecond
constexpr double kOffset = 0.25;  // the ranks' recorded times start at 0.25 s

/// What each rank would record running `t`'s step: its compute actions at the simulated times
/// (scaled and shifted), each receive waiting from the rank's previous action's end to the start
/// of the pass it feeds, each send taking no time right after its pass.
std::vector<std::vector<MeasuredAction>> synthesize(const PipelineTimeline& t) {
  std::vector<std::vector<MeasuredAction>> out(static_cast<size_t>(t.shape.stages));
  for (int r = 0; r < t.shape.stages; ++r) {
    std::vector<TimelineEntry> mine;
    std::vector<PipelineAction> compute;
    for (const TimelineEntry& e : t.entries)
      if (e.rank == r) {
        mine.push_back(e);
        compute.push_back(e.action);
      }
    size_t next = 0;
    double free_at = kOffset;
    for (const PipelineAction& a : with_transfers(compute, t.shape, r)) {
      MeasuredAction m{a, free_at, free_at};
      if (a.type == ActionType::kRecvActivation || a.type == ActionType::kRecvGradient) {
        m.end = kOffset + kScale * mine[next].start;
      } else if (a.type != ActionType::kSendActivation && a.type != ActionType::kSendGradient) {
        EXPECT_EQ(a, mine[next].action);
        m.start = kOffset + kScale * mine[next].start;
        m.end = kOffset + kScale * mine[next].end;
        ++next;
      }
      free_at = m.end;
      out[static_cast<size_t>(r)].push_back(m);
    }
    EXPECT_EQ(next, mine.size());
  }
  return out;
}

struct Case {
  PipelineSchedule schedule;
  PipelineShape shape;
  std::vector<PipelineOpTimes> times;  ///< per virtual stage; one entry: every stage's
  /// The op times of virtual stage v.
  PipelineOpTimes at(size_t v) const { return times.size() == 1 ? times[0] : times[v]; }
  std::vector<PipelineOpTimes> per_stage() const {
    std::vector<PipelineOpTimes> out;
    for (size_t v = 0; v < static_cast<size_t>(shape.stages * shape.virtual_stages); ++v)
      out.push_back(at(v));
    return out;
  }
};

const Case kCases[] = {
    {PipelineSchedule::kGPipe, {4, 8, 1}, {{1, 2, 0}}},
    {PipelineSchedule::k1F1B, {4, 8, 1}, {{1, 2, 0}}},
    {PipelineSchedule::kInterleaved, {4, 8, 2}, {{0.5, 1, 0}}},
    {PipelineSchedule::kZBH1, {4, 8, 1}, {{1, 1, 1}}},
    {PipelineSchedule::k2BW, {3, 5, 1}, {{1, 1.5, 0.5}}},
    {PipelineSchedule::k1F1B, {1, 3, 1}, {{1, 2, 0}}},
    // Unbalanced stages (the last holds the LM head): the prediction must use each stage's times.
    {PipelineSchedule::k1F1B, {4, 8, 1}, {{1, 2, 0}, {1, 2, 0}, {1, 2, 0}, {3, 6, 0}}},
    {PipelineSchedule::kGPipe, {3, 6, 1}, {{1, 2, 0}, {1.5, 2.5, 0}, {4, 8, 0}}},
    {PipelineSchedule::kZBH1, {4, 8, 1}, {{1, 1, 1}, {1, 1, 1}, {2, 1.5, 1}, {3, 3, 2}}},
    {PipelineSchedule::kInterleaved,
     {2, 4, 2},
     {{0.5, 1, 0}, {0.25, 0.5, 0}, {0.75, 1.5, 0}, {2, 3, 0}}},
};

TEST(PipelineTrace, MergedTimelineIsTheSimulatedOne) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(to_string(c.schedule) + " P " + std::to_string(c.shape.stages));
    const PipelineTimeline sim = simulate_pipeline(c.schedule, c.shape, c.per_stage());
    const auto recorded = synthesize(sim);
    const fs::path dir = make_temp_dir("pipeline_trace") / "nested" / "trace";
    double recv_wait = 0;
    size_t actions = 0;
    for (int r = 0; r < c.shape.stages; ++r) {
      write_stage_trace(dir, r, 7, recorded[static_cast<size_t>(r)]);
      for (const MeasuredAction& a : recorded[static_cast<size_t>(r)]) {
        ++actions;
        if (a.action.type == ActionType::kRecvActivation ||
            a.action.type == ActionType::kRecvGradient)
          recv_wait += a.end - a.start;
      }
    }
    const MeasuredPipeline m = merge_pipeline_trace(dir, c.schedule, c.shape);
    EXPECT_EQ(m.step, 7);

    // The measured timeline is the simulated one, in seconds from the first forward.
    ASSERT_EQ(m.measured.entries.size(), sim.entries.size());
    for (size_t i = 0; i < sim.entries.size(); ++i) {
      EXPECT_EQ(m.measured.entries[i].rank, sim.entries[i].rank);
      EXPECT_EQ(m.measured.entries[i].action, sim.entries[i].action);
      EXPECT_NEAR(m.measured.entries[i].start, kScale * sim.entries[i].start, 1e-12);
      EXPECT_NEAR(m.measured.entries[i].end, kScale * sim.entries[i].end, 1e-12);
    }
    EXPECT_NEAR(m.measured.makespan, kScale * sim.makespan, 1e-12);
    EXPECT_NEAR(m.measured_bubble, sim.bubble_fraction(), 1e-9);
    EXPECT_EQ(m.measured.peak_in_flight, sim.peak_in_flight);
    EXPECT_NEAR(m.recv_wait_seconds, recv_wait, 1e-12);

    // Mean op times of each virtual stage, and over all (every virtual stage runs M of each
    // pass, so the overall mean is the mean of the stages'): the fused backward whole unless the
    // schedule splits it.
    const size_t V = c.per_stage().size();
    ASSERT_EQ(m.stage_mean_times.size(), V);
    PipelineOpTimes all{0, 0, 0};
    const auto expect_times = [&](const PipelineOpTimes& got, const PipelineOpTimes& want) {
      EXPECT_NEAR(got.forward, kScale * want.forward, 1e-12);
      if (c.schedule == PipelineSchedule::kZBH1) {
        EXPECT_NEAR(got.backward_input, kScale * want.backward_input, 1e-12);
        EXPECT_NEAR(got.backward_weight, kScale * want.backward_weight, 1e-12);
      } else {
        EXPECT_NEAR(got.backward_input, kScale * (want.backward_input + want.backward_weight),
                    1e-12);
        EXPECT_EQ(got.backward_weight, 0);
      }
    };
    for (size_t v = 0; v < V; ++v) {
      SCOPED_TRACE("virtual stage " + std::to_string(v));
      expect_times(m.stage_mean_times[v], c.at(v));
      all.forward += c.at(v).forward / static_cast<double>(V);
      all.backward_input += c.at(v).backward_input / static_cast<double>(V);
      all.backward_weight += c.at(v).backward_weight / static_cast<double>(V);
    }
    expect_times(m.mean_times, all);
    // ... for which the simulator predicts the same step, unbalanced stages included.
    EXPECT_NEAR(m.predicted_bubble, sim.bubble_fraction(), 1e-9);
    EXPECT_NEAR(m.predicted.makespan, kScale * sim.makespan, 1e-12);
    EXPECT_EQ(m.predicted.peak_in_flight, sim.peak_in_flight);

    // Chrome trace: one complete event per recorded action on its stage's pid, compute on tid 0.
    const auto trace = nlohmann::json::parse(read_file(dir / "trace.json"));
    std::map<int, size_t> per_pid, names;
    size_t complete = 0;
    for (const auto& e : trace.at("traceEvents")) {
      if (e.at("ph") == "M" && e.at("name") == "process_name") {
        EXPECT_EQ(e.at("args").at("name"), fmt::format("stage {}", e.at("pid").get<int>()));
        ++names[e.at("pid").get<int>()];
      }
      if (e.at("ph") != "X") continue;
      ++complete;
      ++per_pid[e.at("pid").get<int>()];
      EXPECT_GE(e.at("ts").get<double>(), 0);
      EXPECT_GE(e.at("dur").get<double>(), 0);
      const std::string name = e.at("name");
      const bool comm = name.rfind("recv", 0) == 0 || name.rfind("send", 0) == 0;
      EXPECT_EQ(e.at("tid").get<int>(), comm ? 1 : 0) << name;
    }
    EXPECT_EQ(complete, actions);
    for (int r = 0; r < c.shape.stages; ++r) {
      EXPECT_EQ(per_pid[r], recorded[static_cast<size_t>(r)].size()) << "stage " << r;
      EXPECT_EQ(names[r], 1u) << "stage " << r;
    }

    // The pictures and the summary.
    const std::string svg = read_file(dir / "timeline.svg");
    EXPECT_EQ(xml_problem(svg, "svg"), "");
    EXPECT_CONTAINS(svg, "measured");
    EXPECT_CONTAINS(svg, to_string(c.schedule));
    EXPECT_EQ(xml_problem(read_file(dir / "predicted.svg"), "svg"), "");
    for (const fs::path& f : m.files) EXPECT_TRUE(fs::exists(f)) << f;
    EXPECT_GE(m.files.size(), 3u);
    const std::string summary = format_measured_summary(m);
    EXPECT_CONTAINS(summary,
                    fmt::format("measured bubble {:.1f}% (simulator, for the measured op times of "
                                "each stage: {:.1f}%)",
                                100 * sim.bubble_fraction(), 100 * sim.bubble_fraction()));
    EXPECT_CONTAINS(summary, "recv wait");
    // Each stage's line shows its own op times (per chunk when interleaved).
    const PipelineOpTimes last = c.at(static_cast<size_t>(c.shape.stages - 1));
    const std::string last_times =
        c.schedule == PipelineSchedule::kZBH1
            ? fmt::format("F {:g} ms, B {:g} ms, W {:g} ms", last.forward, last.backward_input,
                          last.backward_weight)
            : fmt::format("F {:g} ms, B {:g} ms", last.forward,
                          last.backward_input + last.backward_weight);
    EXPECT_CONTAINS(summary,
                    fmt::format("stage {:>2}: {}{}", c.shape.stages - 1,
                                c.shape.virtual_stages > 1 ? "chunk a: " : "", last_times));
    fs::remove_all(dir.parent_path().parent_path());
  }
}

TEST(PipelineTrace, InterleavedNamesCarryTheChunk) {
  const PipelineShape shape{2, 2, 2};
  const PipelineTimeline sim = simulate_pipeline(PipelineSchedule::kInterleaved, shape, {1, 2, 0});
  const auto recorded = synthesize(sim);
  const fs::path dir = make_temp_dir("pipeline_trace_names");
  for (int r = 0; r < 2; ++r) write_stage_trace(dir, r, 0, recorded[static_cast<size_t>(r)]);
  merge_pipeline_trace(dir, PipelineSchedule::kInterleaved, shape);
  const std::string trace = read_file(dir / "trace.json");
  EXPECT_CONTAINS(trace, "\"F1b\"");
  EXPECT_CONTAINS(trace, "\"recv act 0b\"");
  EXPECT_CONTAINS(trace, "\"send grad 1a\"");
  fs::remove_all(dir);
}

TEST(PipelineTrace, MissingOrCorruptFilesAreNamed) {
  const PipelineShape shape{4, 4, 1};
  const auto recorded = synthesize(simulate_pipeline(PipelineSchedule::k1F1B, shape, {1, 2, 0}));
  const fs::path dir = make_temp_dir("pipeline_trace_errors");
  for (int r = 0; r < 3; ++r) write_stage_trace(dir, r, 1, recorded[static_cast<size_t>(r)]);
  const auto error = [&](PipelineSchedule s) -> std::string {
    try {
      merge_pipeline_trace(dir, s, shape);
    } catch (const RuntimeFailure& e) {
      return e.what();
    }
    return "no RuntimeFailure";
  };
  std::string what = error(PipelineSchedule::k1F1B);
  EXPECT_CONTAINS(what, (dir / "stage-003.json").string());
  EXPECT_CONTAINS(what, "missing");

  write_stage_trace(dir, 3, 1, recorded[3]);
  EXPECT_NO_THROW(merge_pipeline_trace(dir, PipelineSchedule::k1F1B, shape));
  // Another schedule's order.
  what = error(PipelineSchedule::kGPipe);
  EXPECT_CONTAINS(what, "does not match schedule gpipe");
  // Another step on one stage.
  write_stage_trace(dir, 2, 2, recorded[2]);
  EXPECT_CONTAINS(error(PipelineSchedule::k1F1B), "stage-002.json records step 2");
  write_stage_trace(dir, 2, 1, recorded[2]);
  // Truncated JSON, another stage's file, an action ending before it starts, a missing action.
  write_file_atomic(dir / "stage-001.json", "{\"format\": \"shardtrain-pipeline-stage-trace\"");
  what = error(PipelineSchedule::k1F1B);
  EXPECT_CONTAINS(what, (dir / "stage-001.json").string());
  EXPECT_CONTAINS(what, "corrupt");
  fs::copy_file(dir / "stage-000.json", dir / "stage-001.json",
                fs::copy_options::overwrite_existing);
  EXPECT_CONTAINS(error(PipelineSchedule::k1F1B), "records stage 0, not 1");
  auto bad = recorded[1];
  std::swap(bad[1].start, bad[1].end);
  write_stage_trace(dir, 1, 1, bad);
  EXPECT_CONTAINS(error(PipelineSchedule::k1F1B), "before it starts");
  bad = recorded[1];
  bad.pop_back();  // its last action: a compute pass or the send after it
  bad.pop_back();
  write_stage_trace(dir, 1, 1, bad);
  EXPECT_CONTAINS(error(PipelineSchedule::k1F1B), "stage-001.json is incomplete");
  fs::remove_all(dir);
}

TEST(RenderPng, WritesAPngWhenRsvgConvertIsInstalled) {
  if (find_on_path("rsvg-convert").empty()) GTEST_SKIP() << "rsvg-convert is not installed";
  const fs::path dir = make_temp_dir("render_png");
  const auto t = simulate_pipeline(PipelineSchedule::k1F1B, {4, 8, 1}, {1, 2, 0});
  write_file_atomic(dir / "t.svg", timeline_svg(t, "1f1b"));
  ASSERT_TRUE(render_png(dir / "t.svg", dir / "t.png"));
  EXPECT_EQ(read_file(dir / "t.png").substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  // A file the renderer cannot read: false, and nothing written.
  write_file_atomic(dir / "bad.svg", "not an svg");
  EXPECT_FALSE(render_png(dir / "bad.svg", dir / "bad.png"));
  EXPECT_FALSE(fs::exists(dir / "bad.png"));
  EXPECT_FALSE(fs::exists(dir / "bad.png.tmp"));
  fs::remove_all(dir);
}

TEST(RenderPng, NoRendererOnPathIsNoError) {
  const std::string path = std::getenv("PATH") ? std::getenv("PATH") : "";
  const fs::path dir = make_temp_dir("render_png_none");
  write_file_atomic(dir / "t.svg", "<svg xmlns=\"http://www.w3.org/2000/svg\"/>");
  ::setenv("PATH", (dir / "empty").c_str(), 1);
  const std::string renderer = png_renderer();
  const bool ok = render_png(dir / "t.svg", dir / "t.png");
  ::setenv("PATH", path.c_str(), 1);
  EXPECT_EQ(renderer, "");
  EXPECT_FALSE(ok);
  EXPECT_FALSE(fs::exists(dir / "t.png"));
  fs::remove_all(dir);
}

// The check the SVG tests rely on finds what it should.
TEST(XmlProblem, FindsUnbalancedAndStrayMarkup) {
  EXPECT_EQ(xml_problem("<svg a=\"x>y\"><g/><text>a &amp; b</text></svg>\n", "svg"), "");
  EXPECT_NE(xml_problem("<svg><g></svg>", "svg"), "");
  EXPECT_NE(xml_problem("<svg><text>a & b</text></svg>", "svg"), "");
  EXPECT_NE(xml_problem("<svg></svg><svg></svg>", "svg"), "");
  EXPECT_NE(xml_problem("<svg><rect x=\"1></svg>", "svg"), "");
  EXPECT_NE(xml_problem("<html></html>", "svg"), "");
  EXPECT_NE(xml_problem("<svg>", "svg"), "");
}

TEST(RenderPng, PipelineSimWritesThePngBesideTheSvg) {
  const fs::path dir = make_temp_dir("pipeline_sim_png");
  const auto r = test_support::run_shardtrain(fmt::format(
      "pipeline-sim --stages 2 --micro-batches 3 --output {}", (dir / "p.svg").string()));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "p.svg"));
  if (png_renderer().empty() || r.output.find("no PNG copy") != std::string::npos) {
    EXPECT_FALSE(fs::exists(dir / "p.png"));
  } else {
    EXPECT_CONTAINS(r.output, (dir / "p.png").string());
    EXPECT_TRUE(fs::exists(dir / "p.png"));
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace shardtrain
