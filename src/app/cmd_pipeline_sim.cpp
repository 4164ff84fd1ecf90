// `shardtrain pipeline-sim`: runs a pipeline schedule's action lists (parallel/pipeline/) with
// given op times and prints the per-stage timeline, the bubble, utilization and peak in-flight
// activations; --output writes the timeline as SVG (and as PNG beside it when rsvg-convert or
// ImageMagick is installed).
#include <fmt/core.h>

#include <filesystem>
#include <memory>
#include <sstream>
#include <string>

#include "app/commands.h"
#include "config/knob.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "monitor/render_png.h"
#include "parallel/pipeline/simulator.h"

namespace shardtrain {
namespace {

struct SimFlags {
  int stages = 4;
  int micro_batches = 8;
  int virtual_stages = 1;
  std::string schedule = "1f1b";
  std::string times = "1,2,0";
  std::string stage_times;  ///< "F,B[,W];F,B[,W];…": one group per virtual stage (empty: --times)
  std::string output;
  bool flushed = false;  ///< 2bw: simulate a step that fills and drains (default: the steady one)
};

/// "F,B" or "F,B,W" (op times of one micro-batch through one stage; B alone when W is absent).
/// `flag` and `whole` name what the user gave, for the errors.
PipelineOpTimes parse_times(const std::string& text, const std::string& flag = "--times",
                            const std::string& whole = "") {
  const std::string given = whole.empty() ? text : fmt::format("{} (group '{}')", whole, text);
  std::vector<double> v;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      v.push_back(std::stod(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw ConfigError(
          fmt::format("{} {}: '{}' is not a number; give F,B or F,B,W (e.g. "
                      "1,2 or 1,1,1)",
                      flag, given, item));
    }
  }
  check<ConfigError>(
      (v.size() == 2 || v.size() == 3) && v[0] > 0 && v[1] > 0 && (v.size() == 2 || v[2] >= 0),
      "{} {}: give F,B or F,B,W with F, B > 0 and W >= 0 (e.g. 1,2 or 1,1,1)", flag, given);
  return {v[0], v[1], v.size() == 3 ? v[2] : 0.0};
}

/// "F,B[,W];F,B[,W];…": one group per virtual stage v = c·P + r, `count` (P·V) groups.
std::vector<PipelineOpTimes> parse_stage_times(const std::string& text, const PipelineShape& s) {
  std::vector<PipelineOpTimes> out;
  std::stringstream in(text);
  std::string group;
  while (std::getline(in, group, ';')) out.push_back(parse_times(group, "--stage-times", text));
  const int expected = s.stages * s.virtual_stages;
  check<ConfigError>(
      out.size() == static_cast<size_t>(expected),
      "--stage-times {}: {} groups given, {} expected — one F,B[,W] per virtual stage ({} stages "
      "× {} virtual stages), separated by ';', in the order v = chunk·P + stage",
      text, out.size(), expected, s.stages, s.virtual_stages);
  return out;
}

void run_sim(const SimFlags& f) {
  const PipelineSchedule schedule = parse_pipeline_schedule(f.schedule);
  PipelineShape shape{f.stages, f.micro_batches, f.virtual_stages};
  // 2bw runs without a flush: its steady step neither fills nor drains the pipeline.
  if (schedule == PipelineSchedule::k2BW && !f.flushed && f.micro_batches >= f.stages)
    shape.fill = shape.drain = false;
  check_pipeline_shape(schedule, shape);
  const bool per_stage = !f.stage_times.empty();
  const std::vector<PipelineOpTimes> times =
      per_stage
          ? parse_stage_times(f.stage_times, shape)
          : std::vector<PipelineOpTimes>(static_cast<size_t>(shape.stages * shape.virtual_stages),
                                         parse_times(f.times));
  // Schedules without a split backward run B+W as one pass: "1,2,0" and "1,1,1" mean the same.
  for (const PipelineOpTimes& t : times)
    if (schedule == PipelineSchedule::kZBH1 && t.backward_weight == 0)
      throw ConfigError(fmt::format(
          "zb-h1 splits the backward into B and W: give {} F,B,W with W > 0 (got {})",
          per_stage ? "--stage-times" : "--times", per_stage ? f.stage_times : f.times));
  const PipelineTimeline t = simulate_pipeline(schedule, shape, times);
  double unit = times.front().forward;
  for (const PipelineOpTimes& o : times)
    for (double d : {o.forward, o.backward_input, o.backward_weight})
      if (d > 0) unit = std::min(unit, d);
  fmt::print("{}\n{}", format_timeline_text(t, unit), format_timeline_summary(t));
  if (per_stage) {
    std::string line = "  op times per virtual stage (F, B[, W]):";
    for (size_t v = 0; v < times.size(); ++v)
      line += fmt::format(
          "{} {}: {:g}, {:g}{}", v ? " |" : "", v, times[v].forward, times[v].backward_input,
          times[v].backward_weight > 0 ? fmt::format(", {:g}", times[v].backward_weight)
                                       : std::string());
    fmt::print("{}\n", line);
  }
  if (!f.output.empty()) {
    write_file_atomic(
        f.output,
        timeline_svg(
            t, fmt::format(
                   "{}: {} stages, {} micro-batches{}{}", to_string(schedule), f.stages,
                   f.micro_batches,
                   f.virtual_stages > 1 ? fmt::format(", {} virtual stages", f.virtual_stages) : "",
                   shape.fill ? "" : ", a steady step (no flush)")));
    // A PNG copy next to it when a renderer (rsvg-convert, ImageMagick) is installed.
    std::filesystem::path png(f.output);
    png.replace_extension(".png");
    if (png != std::filesystem::path(f.output) && render_png(f.output, png))
      fmt::print("wrote {} and {}\n", f.output, png.string());
    else
      fmt::print("wrote {} (no PNG copy: no rsvg-convert or ImageMagick convert, or it failed)\n",
                 f.output);
  }
}

}  // namespace

void register_pipeline_sim_command(CLI::App& app) {
  auto f = std::make_shared<SimFlags>();
  CLI::App* cmd = app.add_subcommand(
      "pipeline-sim", "simulate a pipeline schedule: timeline, bubble, utilization, SVG picture");
  cmd->add_option("--stages", f->stages, "pipeline stages P (default 4)");
  cmd->add_option("--micro-batches", f->micro_batches, "micro-batches per step M (default 8)");
  cmd->add_option("--schedule", f->schedule,
                  "gpipe | 1f1b | interleaved-1f1b | zb-h1 | 2bw (default 1f1b)");
  // train's flag, under its name.
  cmd->add_option(knob_for(&TrainConfig::pipeline, &PipelineConfig::virtual_stages).name(),
                  f->virtual_stages, "model chunks per stage V (interleaved-1f1b; default 1)");
  CLI::Option* times =
      cmd->add_option("--times", f->times,
                      "op times F,B[,W] of one micro-batch through one stage, the same for every "
                      "stage (default 1,2,0: backward twice the forward)");
  cmd->add_option("--stage-times", f->stage_times,
                  "op times per virtual stage for unbalanced stages: one F,B[,W] group per "
                  "virtual stage v = chunk·P + stage, P·V groups separated by ';' (e.g. "
                  "\"1,2;1,2;1,2;3,6\": the last of 4 stages 3x slower); instead of --times")
      ->excludes(times);
  cmd->add_flag("--flushed", f->flushed,
                "2bw: simulate a step that fills and drains the pipeline (the first and last of a "
                "run, or one before an evaluation; default: the steady step, whose look-ahead "
                "forwards of the next step fill the drain)");
  cmd->add_option("--output", f->output,
                  "write the timeline picture as SVG (and a .png beside it when rsvg-convert or "
                  "ImageMagick is installed)");
  cmd->callback([f]() { run_sim(*f); });
}

}  // namespace shardtrain
