// The strategies of a run's configuration: the trainer hands each strategy its own section
// (StrategyOptions, PipelineOptions), made here from the validated TrainConfig, so that no
// strategy reads the whole configuration.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "parallel/pipeline/pipeline_parallel.h"
#include "parallel/strategy.h"

namespace shardtrain {

/// The options `cfg` (validated: its plan set) gives its strategy.
StrategyOptions strategy_options(const TrainConfig& cfg);

/// make_strategy(strategy_options(cfg), ...). Throws ConfigError as make_strategy does.
std::unique_ptr<Strategy> make_strategy(const TrainConfig& cfg, Backend& backend,
                                        Communicator& comm);

/// The pipeline strategy for `cfg` (strategy pipeline). Throws ConfigError as the
/// PipelineParallel constructor.
std::unique_ptr<PipelineParallel> make_pipeline_strategy(const TrainConfig& cfg, Backend& backend,
                                                         Communicator& world);

}  // namespace shardtrain
