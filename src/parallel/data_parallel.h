// Data parallelism (ZeRO stage 0): the strategy `dp` (data_parallel.cpp).
#pragma once

#include <memory>

#include "parallel/strategy.h"

namespace shardtrain {

/// Every rank holds all parameters, gradients and optimizer state; gradients are all-reduced in
/// buckets during the last micro-step's backward.
std::unique_ptr<Strategy> make_data_parallel_strategy(const StrategyOptions& options,
                                                      Backend& backend, Communicator& comm);

}  // namespace shardtrain
