// The pipeline schedules by name (--pipeline-schedule, the DeepSpeed JSON's pipeline.schedule);
// the schedules themselves are parallel/pipeline/schedule.h.
#pragma once

#include <string>

namespace shardtrain {

enum class PipelineSchedule {
  kGPipe,        ///< all forwards, then all backwards (Huang et al., arXiv 1811.06965)
  k1F1B,         ///< PipeDream-Flush: warm-up forwards, then one forward one backward
  kInterleaved,  ///< 1F1B over V model chunks per rank (arXiv 2104.04473 §2.2)
  kZBH1,         ///< 1F1B with backward split into B (input gradient) and W (weight gradient),
                 ///< W deferred into the cool-down bubble (Qi et al., arXiv 2401.10241, ZB-H1)
  k2BW,          ///< PipeDream-2BW: 1F1B order, no flush, two weight versions (arXiv 2006.09503)
};

/// Parses gpipe | 1f1b | interleaved-1f1b | zb-h1 | 2bw. Throws ConfigError listing them.
PipelineSchedule parse_pipeline_schedule(const std::string& name);
std::string to_string(PipelineSchedule s);

/// What a schedule is asked for.
///
/// `fill` and `drain` (2bw only; both true for every other schedule): PipeDream-2BW runs without
/// a flush between optimizer steps (arXiv 2006.09503 §3). A step that does not drain ends with
/// the look-ahead forwards of the next step's first micro-batches — rank r runs w_r = P−1−r of
/// them, numbered M..M+w_r−1 in this step — in the slots its cool-down backwards would have left
/// idle, and rank r ≥ 1 receives the activation of micro-batch M + w_r, its first forward of the
/// next step. The next step then does not fill: rank r starts with the forward of micro-batch w_r
/// (its input already there). fill && drain is one step of 1F1B.
struct PipelineShape {
  int stages = 1;          ///< P ranks in the pipeline
  int micro_batches = 1;   ///< M micro-batches per optimizer step
  int virtual_stages = 1;  ///< V model chunks per rank (interleaved only; 1 otherwise)
  bool fill = true;        ///< 2bw: the step starts with an empty pipeline (its warm-up forwards)
  bool drain = true;       ///< 2bw: the step ends with an empty pipeline (no look-ahead)
};

/// Checks that `schedule` can run `shape`: P ≥ 1, M ≥ 1, V ≥ 1; V > 1 only for interleaved;
/// interleaved needs V ≥ 2 and M a multiple of P (Megatron's rule); fill or drain false only for
/// 2bw, with M ≥ P. Throws ConfigError naming the numbers and the fix.
void check_pipeline_shape(PipelineSchedule schedule, const PipelineShape& shape);

}  // namespace shardtrain
