// Pipeline schedules as pure functions: (stages P, micro-batches M, rank r, virtual stages V) →
// the ordered compute actions of rank r for one optimizer step. The executor (executor.h) and the
// simulator (simulator.h) run the same lists; point-to-point transfers follow from the actions
// (with_transfers): an activation arrives before a forward of every virtual stage but the first
// and leaves after a forward of every one but the last; a gradient the other way round.
//
// Virtual stages (interleaving): rank r holds the model chunks c = 0..V-1, chunk c being virtual
// stage v = c·P + r of the P·V stages the layers are cut into (Narayanan et al., "Efficient
// Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473, §2.2).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

enum class ActionType {
  kForward,         ///< F: forward of one micro-batch through one model chunk
  kBackward,        ///< B+W: input and weight gradients together
  kBackwardInput,   ///< B: input gradient only (zb-h1)
  kBackwardWeight,  ///< W: weight gradient only (zb-h1)
  kRecvActivation,  ///< receive the forward input from the previous virtual stage
  kSendActivation,  ///< send the forward output to the next virtual stage
  kRecvGradient,    ///< receive ∂L/∂output from the next virtual stage
  kSendGradient,    ///< send ∂L/∂input to the previous virtual stage
};

/// One action of a rank: `type` on micro-batch `micro_batch` through model chunk `chunk`.
struct PipelineAction {
  ActionType type;
  int micro_batch;
  int chunk;
  bool operator==(const PipelineAction&) const = default;
};

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

/// The look-ahead forwards rank `rank` runs at the end of a 2bw step that does not drain:
/// min(P − 1 − rank, M) (its 1F1B warm-up count).
inline int two_bw_lookahead(const PipelineShape& s, int rank) {
  const int w = s.stages - 1 - rank;
  return w < s.micro_batches ? w : s.micro_batches;
}

/// The compute actions (F, B+W or B and W) of `rank` for one optimizer step, in execution order.
/// Throws ConfigError for shapes check_pipeline_shape rejects.
std::vector<PipelineAction> pipeline_compute_actions(PipelineSchedule schedule,
                                                     const PipelineShape& shape, int rank);

/// `compute` with the transfers inserted: a receive right before each forward (backward) that
/// needs one, a send right after each forward (input-gradient pass) that produces one. 2bw
/// without fill: no receive before rank r's first forward (received in the step before); without
/// drain: rank r ≥ 1 ends with the receive of micro-batch M + w_r (two_bw_lookahead).
std::vector<PipelineAction> with_transfers(const std::vector<PipelineAction>& compute,
                                           const PipelineShape& shape, int rank);

/// The virtual stage of model chunk `chunk` on `rank` (c·P + r).
inline int virtual_stage(const PipelineShape& s, int rank, int chunk) {
  return chunk * s.stages + rank;
}

}  // namespace shardtrain
