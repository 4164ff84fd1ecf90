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
#include "core/error.h"
#include "io/atomic_file.h"
#include "io/render_png.h"
#include "parallel/pipeline/simulator.h"

namespace shardtrain {
namespace {

struct SimFlags {
  int stages = 4;
  int micro_batches = 8;
  int virtual_stages = 1;
  std::string schedule = "1f1b";
  std::string times = "1,2,0";
  std::string output;
};

/// "F,B" or "F,B,W" (op times of one micro-batch through one stage; B alone when W is absent).
PipelineOpTimes parse_times(const std::string& text) {
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
          fmt::format("--times {}: '{}' is not a number; give F,B or F,B,W (e.g. "
                      "1,2 or 1,1,1)",
                      text, item));
    }
  }
  check<ConfigError>(
      (v.size() == 2 || v.size() == 3) && v[0] > 0 && v[1] > 0 && (v.size() == 2 || v[2] >= 0),
      "--times {}: give F,B or F,B,W with F, B > 0 and W >= 0 (e.g. 1,2 or 1,1,1)", text);
  return {v[0], v[1], v.size() == 3 ? v[2] : 0.0};
}

void run_sim(const SimFlags& f) {
  const PipelineSchedule schedule = parse_pipeline_schedule(f.schedule);
  PipelineOpTimes times = parse_times(f.times);
  // Schedules without a split backward run B+W as one pass: "1,2,0" and "1,1,1" mean the same.
  if (schedule == PipelineSchedule::kZBH1 && times.backward_weight == 0)
    throw ConfigError(
        fmt::format("zb-h1 splits the backward into B and W: give --times F,B,W "
                    "with W > 0 (got {})",
                    f.times));
  const PipelineShape shape{f.stages, f.micro_batches, f.virtual_stages};
  const PipelineTimeline t = simulate_pipeline(schedule, shape, times);
  double unit = times.forward;
  for (double d : {times.backward_input, times.backward_weight})
    if (d > 0) unit = std::min(unit, d);
  fmt::print("{}\n{}", format_timeline_text(t, unit), format_timeline_summary(t));
  if (!f.output.empty()) {
    write_file_atomic(
        f.output,
        timeline_svg(
            t,
            fmt::format(
                "{}: {} stages, {} micro-batches{}", to_string(schedule), f.stages, f.micro_batches,
                f.virtual_stages > 1 ? fmt::format(", {} virtual stages", f.virtual_stages) : "")));
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
  cmd->add_option("--virtual-stages", f->virtual_stages,
                  "model chunks per stage V (interleaved-1f1b; default 1)");
  cmd->add_option("--times", f->times,
                  "op times F,B[,W] of one micro-batch through one stage (default 1,2,0: "
                  "backward twice the forward)");
  cmd->add_option("--output", f->output,
                  "write the timeline picture as SVG (and a .png beside it when rsvg-convert or "
                  "ImageMagick is installed)");
  cmd->callback([f]() { run_sim(*f); });
}

}  // namespace shardtrain
