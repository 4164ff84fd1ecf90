// Strategy: how parameters, gradients and optimizer state are placed and kept consistent across
// data-parallel ranks. A strategy owns the flat buffers, binds the model to them, watches the
// model through LayerHooks (to overlap gradient reduction with backward, or to gather a layer's
// parameters before it runs) and performs the optimizer step on what its rank owns. The model
// never knows which strategy runs it (torchtitan's habit: parallelism applied to a plain model).
//
// Strategies: dp (parallel/data_parallel.cpp), zero1 and zero2 (parallel/zero.cpp); zero3,
// offload and pipeline arrive in later releases behind the same interface.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "io/config.h"
#include "model/gpt2.h"
#include "optim/adamw.h"

namespace shardtrain {

/// Host copies of the full training state, in the flat layout (numel = layout.numel()).
struct FullState {
  std::vector<float> params;      ///< fp32 master weights
  std::vector<float> exp_avg;     ///< AdamW m
  std::vector<float> exp_avg_sq;  ///< AdamW v
  int64_t optimizer_steps = 0;
};

class Strategy : public LayerHooks {
 public:
  ~Strategy() override = default;
  virtual std::string name() const = 0;

  /// Allocates the buffers this rank holds, binds `model` to them and loads `init_params`
  /// (host fp32, layout.numel() elements, identical on every rank).
  virtual void setup(GPT2Model& model, const std::vector<float>& init_params) = 0;
  /// Starts an optimizer step: zeroes the gradients this rank accumulates into.
  virtual void zero_grad() = 0;
  /// Declares which micro-batch of the accumulation window runs next (0-based of `count`):
  /// gradient communication happens during the last one's backward.
  virtual void begin_micro_step(int64_t index, int64_t count) = 0;
  /// Waits for the gradient reductions of the last micro-step. After it, the gradients this
  /// rank owns hold the SUM over ranks and micro-steps of ∂(mean loss per micro-batch)/∂θ.
  virtual void finish_gradients() = 0;
  /// Global L2 norm of the gradients as they stand (after finish_gradients), times `scale`.
  virtual double grad_norm(double scale) = 0;
  /// AdamW on this rank's part with gradients multiplied by `grad_scale`, then makes the
  /// updated parameters visible to the model on every rank.
  virtual void step(double lr, double grad_scale) = 0;

  /// Collects the full state on every rank (collective: every rank must call it).
  virtual FullState gather_state() = 0;
  /// Loads a full state (host, every rank passes the same) into this rank's buffers.
  virtual void load_state(const FullState& state) = 0;

  /// Bytes of parameters, gradients and optimizer state this rank holds.
  virtual size_t model_state_bytes() const = 0;
};

/// Builds the strategy `cfg.strategy`. Throws ConfigError for strategies not available yet.
std::unique_ptr<Strategy> make_strategy(const TrainConfig& cfg, Backend& backend,
                                        Communicator& comm);

}  // namespace shardtrain
