// The training loop: data → micro-batches → forward/backward → strategy (gradient reduction,
// clipping, AdamW) → logging, validation, checkpoints.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "io/config.h"
#include "model/gpt2_config.h"

namespace shardtrain {

struct TrainSummary {
  int64_t steps = 0;           ///< optimizer steps completed (total, including resumed ones)
  double first_loss = 0;       ///< loss of the first step this run executed
  double last_loss = 0;        ///< loss of the last step
  double val_loss = 0;         ///< last validation loss (NaN when none ran)
  double val_ppl = 0;          ///< exp(val_loss)
  double seconds = 0;          ///< wall time of the training loop, seconds
  std::vector<double> losses;  ///< loss of every step this run executed, in order
  std::string checkpoint;      ///< last checkpoint written ("" when none)
};

/// Trains per `cfg` (validated) on this rank of `comm`. Prints progress on rank 0 and writes
/// metrics.jsonl and checkpoints under cfg.output_dir. Throws Error subclasses on bad input.
TrainSummary train(const TrainConfig& cfg, Communicator& comm);

/// The model a run of `cfg` trains: cfg.model resolved (resolve_model: a preset or a
/// config.json), or, when cfg.model is empty and cfg.resume names a checkpoint, the shape that
/// checkpoint records (so a custom shape resumes without its config.json).
GPT2Config resolve_train_model(const TrainConfig& cfg);

/// Picks the backend for `device` ("auto": CUDA when available, else CPU) on GPU `local_rank`,
/// computing in the dtype `precision` asks for (auto: bf16 on GPU, fp32 on CPU). Throws
/// ConfigError for a precision the device cannot run and RuntimeFailure when CUDA is unavailable.
std::unique_ptr<Backend> make_backend(const std::string& device, int local_rank,
                                      Precision precision = Precision::kAuto);

}  // namespace shardtrain
