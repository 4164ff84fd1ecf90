#include "config/pipeline_schedule.h"

#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "config/knob.h"
#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

struct ScheduleName {
  const char* name;
  PipelineSchedule schedule;
};
constexpr ScheduleName kNames[] = {{"gpipe", PipelineSchedule::kGPipe},
                                   {"1f1b", PipelineSchedule::k1F1B},
                                   {"interleaved-1f1b", PipelineSchedule::kInterleaved},
                                   {"zb-h1", PipelineSchedule::kZBH1},
                                   {"2bw", PipelineSchedule::k2BW}};

}  // namespace

PipelineSchedule parse_pipeline_schedule(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char ch) {
    return ch == '_' ? '-' : static_cast<char>(std::tolower(ch));
  });
  for (const ScheduleName& s : kNames)
    if (n == s.name) return s.schedule;
  if (n == "interleaved" || n == "interleaved1f1b") return PipelineSchedule::kInterleaved;
  std::vector<std::string> names;
  for (const ScheduleName& s : kNames) names.emplace_back(s.name);
  throw ConfigError(
      fmt::format("unknown pipeline schedule '{}'{}: use gpipe, 1f1b, "
                  "interleaved-1f1b, zb-h1 or 2bw",
                  name, did_you_mean(n, names)));
}

std::string to_string(PipelineSchedule s) {
  for (const ScheduleName& n : kNames)
    if (n.schedule == s) return n.name;
  return "unknown";
}

void check_pipeline_shape(PipelineSchedule schedule, const PipelineShape& s) {
  const std::string stages = knob_for(&TrainConfig::pipeline, &PipelineConfig::stages).name();
  const std::string chunks =
      knob_for(&TrainConfig::pipeline, &PipelineConfig::virtual_stages).name();
  check<ConfigError>(s.stages >= 1, "{} {} is not valid: use 1 or more", stages, s.stages);
  check<ConfigError>(s.micro_batches >= 1,
                     "{} micro-batches per step is not valid: use 1 or more (the micro-batches of "
                     "a pipeline step are its gradient-accumulation steps)",
                     s.micro_batches);
  check<ConfigError>(s.virtual_stages >= 1, "{} {} is not valid: use 1 or more", chunks,
                     s.virtual_stages);
  if (!s.fill || !s.drain) {
    check<ConfigError>(schedule == PipelineSchedule::k2BW,
                       "{}: every step fills and drains the pipeline (only 2bw runs without a "
                       "flush)",
                       to_string(schedule));
    check<ConfigError>(s.micro_batches >= s.stages,
                       "2bw without a flush needs at least as many micro-batches per step ({}) "
                       "as pipeline stages ({})",
                       s.micro_batches, s.stages);
  }
  if (schedule != PipelineSchedule::kInterleaved) {
    check<ConfigError>(s.virtual_stages == 1,
                       "{} {} needs --pipeline-schedule interleaved-1f1b ({} runs one model "
                       "chunk per stage): drop {} or switch schedules",
                       chunks, s.virtual_stages, to_string(schedule), chunks);
    return;
  }
  check<ConfigError>(s.virtual_stages >= 2,
                     "interleaved-1f1b needs {} 2 or more (got {}); with one chunk per stage "
                     "use 1f1b",
                     chunks, s.virtual_stages);
  check<ConfigError>(s.micro_batches % s.stages == 0,
                     "interleaved-1f1b needs the micro-batches per step ({}) to be a multiple of "
                     "the pipeline stages ({}): use {} or {} micro-batches",
                     s.micro_batches, s.stages, s.micro_batches / s.stages * s.stages,
                     (s.micro_batches / s.stages + 1) * s.stages);
}

}  // namespace shardtrain
