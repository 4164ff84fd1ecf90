// ZeRO stage 3 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models", arXiv 1910.02054, §5.3 P_os+g+p): the strategy `zero3` (zero3.cpp).
#pragma once

#include <memory>

#include "parallel/offload/zero_offload.h"
#include "parallel/strategy.h"
#include "parallel/zero3_schedule.h"

namespace shardtrain {

/// Gradient reduce-scatters a zero3 rank keeps in flight during backward (each holds a layer's
/// full gradient buffer until it completes).
inline constexpr size_t kZero3ReductionsInFlight = 2;

/// The schedule limits `options` set.
inline Zero3Limits zero3_limits(const StrategyOptions& options) {
  return {options.zero.stage3_prefetch_bucket_size, options.zero.stage3_max_live_parameters,
          options.zero.stage3_max_reuse_distance, options.zero.overlap_comm};
}

/// Builds the ZeRO-3 strategy over the data-parallel group `comm`: every rank holds 1/N of the
/// parameters, gradients and optimizer state, and gathers each layer's parameters before it runs
/// (options.zero.stage3_prefetch_bucket_size, param_persistence_threshold, max_live_parameters,
/// max_reuse_distance), offloading what `offload` says (the optimizer's host half, the
/// parameters). See zero3.cpp for the design.
std::unique_ptr<Strategy> make_zero3_strategy(const StrategyOptions& options,
                                              const OffloadPolicy& offload, Backend& backend,
                                              Communicator& comm);

}  // namespace shardtrain
