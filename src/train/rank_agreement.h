// Ranks agree before they train: every rank's configuration — the fields that shape the run — is
// compared across the job before its first collective, so that ranks started with different
// settings (nodes reading different copies of a DeepSpeed config, a flag left out on one node)
// stop with a message naming the keys and the ranks, instead of training with wrong losses or
// corrupting memory in mismatched collectives.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "config/config.h"

namespace shardtrain {

/// The fields of `cfg` that must be equal on every rank, flattened to "section.key" → value:
/// config_snapshot() without its paths (data files, data and cache directories, monitor
/// directories, the --model argument: nodes may keep their copies in different places), plus
/// `model_shape` (the resolved model, which is what must agree) and the run-shaping fields the
/// snapshot leaves out (activation checkpointing, loss scaling, offload, aio, evaluation and
/// checkpoint intervals, resume and init, flops profiler).
nlohmann::json agreement_record(const TrainConfig& cfg, const std::string& model_shape);

/// The message naming the keys on which `records` (one per rank, agreement_record()) differ, with
/// each value and the ranks holding it; "" when they are all equal.
std::string rank_disagreement(const std::vector<nlohmann::json>& records);

/// Collective: compares agreement_record(cfg, model_shape) across the ranks of `comm` (one
/// all-gather of a 64-bit hash and a length; only when they differ, a second of every rank's
/// record). Throws ConfigError (the same on every rank, so it is printed once) naming the keys
/// and ranks that differ. Call it before any other collective. Nothing is communicated on one rank.
void check_ranks_agree(const TrainConfig& cfg, const std::string& model_shape, Backend& backend,
                       Communicator& comm);

}  // namespace shardtrain
