// The flags of `shardtrain train` (DeepSpeed / torchrun style long names) and the step that
// merges them with the DeepSpeed JSON config into a validated TrainConfig.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"

namespace shardtrain {

/// Registers the flags of `shardtrain train` on `cmd`, bound to the fields of `cfg` (which must
/// outlive the parse). Help texts give units and defaults (taken from `cfg`'s current values).
/// Ranges are checked while parsing: bad values make CLI::App::parse throw CLI::ValidationError
/// ("--batch-size: must be an integer >= 1, got '0'").
void add_train_flags(CLI::App& cmd, TrainConfig& cfg);

/// Names of the flags of `cmd` given on the command line, as TrainConfig keys: the long name
/// without dashes, '-' read as '_' ("--batch-size" -> "batch_size", "--lr" -> "lr").
ExplicitFlags explicit_train_flags(const CLI::App& cmd);

/// Completes `cfg` after `cmd` was parsed: resolves --strategy / --zero-stage, applies the
/// DeepSpeed JSON (--deepspeed-config) except fields whose flags were given explicitly, and
/// calls validate(cfg, model_context). `cfg.world_size` must already be set (launcher).
/// Appends to `warnings` (lines without a "warning:" prefix): one line naming all ignored
/// DeepSpeed keys; one when zero_optimization.stage in the JSON contradicts an explicit
/// --strategy (the JSON decides, as in DeepSpeed); one naming the JSON values that explicit
/// flags overrode.
/// Throws ConfigError: unknown strategy, --strategy contradicting --zero-stage, pipeline flags
/// (--pipeline-stages, --pipeline-schedule, --virtual-stages, --partition-method,
/// --activation-checkpoint-interval, --trace) given with a strategy other than pipeline, any error
/// of apply_deepspeed_config() (unreadable or malformed JSON, unknown keys, wrong types) or of
/// validate() (out-of-range values, batch identity, strategy against ZeRO stage and offload).
TrainConfig finalize_train_config(const CLI::App& cmd, TrainConfig cfg, int64_t model_context,
                                  std::vector<std::string>& warnings);

}  // namespace shardtrain
