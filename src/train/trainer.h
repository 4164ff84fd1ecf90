// The training loop: data → micro-batches → forward/backward → strategy (gradient reduction,
// clipping, AdamW) → logging, validation, checkpoints.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "model/gpt2_config.h"

namespace shardtrain {

class GPT2Model;        // model/gpt2.h
class PackedDataset;    // data/dataset.h
class ScalarAllReduce;  // comm/scalar_all_reduce.h

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

/// A validation of a GPT-2 model (evaluate_gpt2).
struct GPT2Evaluation {
  double loss = std::numeric_limits<double>::quiet_NaN();  ///< mean per-sample loss (nats/token)
  int64_t samples = 0;                                     ///< samples it is the mean over
  double seconds = 0;                                      ///< wall time of the evaluation
};

/// Mean loss of `model` (as bound by its strategy) over all of `data`, forward only: each
/// sample's loss is its mean next-token cross-entropy over its T tokens, and the result is the
/// mean over samples. The samples are divided over the ranks of `comm` by eval_micro_batches
/// (train/train_common.h) in micro-batches of up to `batch` samples: every sample counted exactly
/// once, and every rank runs the same number of forwards (ranks with fewer samples run uncounted
/// padding micro-batches), so collectives inside forward (ZeRO-3's all-gathers) match on every
/// rank whatever data.size() and the rank count are. The per-rank loss sums and sample counts
/// are summed with `reduce` (a ScalarAllReduce over `comm` of at least 2 values), so every rank
/// returns the same evaluation; loss is NaN when data is empty. Collective over `comm`.
GPT2Evaluation evaluate_gpt2(GPT2Model& model, const PackedDataset& data, int64_t batch,
                             const Communicator& comm, ScalarAllReduce& reduce);

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
