// ZeRO stages 1 and 2 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models", arXiv 1910.02054, §5): the strategies `zero1` and `zero2` (zero.cpp).
#pragma once

#include <memory>

#include "parallel/offload/zero_offload.h"
#include "parallel/strategy.h"

namespace shardtrain {

/// Builds the ZeRO strategy for options.plan.zero_stage 1 or 2 (ST_ASSERTs otherwise) over the
/// data-parallel group `comm`, offloading what `offload` says (the optimizer's host half).
/// Buckets come from options.zero.reduce_bucket_size and allgather_bucket_size (elements). See
/// zero.cpp for the design.
std::unique_ptr<Strategy> make_zero_strategy(const StrategyOptions& options,
                                             const OffloadPolicy& offload, Backend& backend,
                                             Communicator& comm);

}  // namespace shardtrain
