// --offload auto: the run's ZeRO stage and where the optimizer state and the parameters live,
// chosen at start-up by the placement planner (parallel/placement_planner.h) for this machine.
#pragma once

#include "backend/backend.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "model/gpt2_config.h"
#include "parallel/placement_planner.h"
#include "train/train_common.h"

namespace shardtrain {

/// The budgets of this rank (bytes): the GPU's, --gpu-memory or the device's total memory; the
/// host's, --max-host-memory or the node's available memory, and the free space of --nvme-path
/// (none without it), each divided by the ranks per node.
PlacementBudget rank_budget(const TrainConfig& cfg, const Backend& backend);

/// `cfg` with the strategy, ZeRO stage and offload of `chosen` (validated again: its plan set).
TrainConfig with_placement(const TrainConfig& cfg, const Placement& chosen, int64_t model_context);

/// What the placement planner is asked for a run of `cfg` and `model`: its ranks, micro-batch,
/// length, activation checkpointing, optimizer, ZeRO limits and offload options.
MemoryEstimateOptions placement_options(const TrainConfig& cfg, const GPT2Config& model);

/// --offload auto: every rank's budget is gathered and the smallest of each planned for, so that
/// every rank chooses the same plan; returns `cfg` placed as chosen and prints the choice on rank
/// 0. When only the global batch is given (train_batch_size, neither the micro-batch nor the
/// accumulation), the micro-batch × accumulation split is chosen too (plan_batch: the fastest
/// predicted). Collective. Throws ConfigError (the same on every rank) when no plan fits, naming
/// the one that came closest and the bytes it lacks.
TrainConfig with_automatic_placement(const TrainConfig& cfg, const GPT2Config& model,
                                     Backend& backend, Communicator& comm, Console& out);

}  // namespace shardtrain
