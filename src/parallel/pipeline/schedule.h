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

#include "config/pipeline_schedule.h"

namespace shardtrain {

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
