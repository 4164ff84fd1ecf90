// The FLOPs profiler (DeepSpeed's flops_profiler, --profile-step N): at one optimizer step, a
// per-module table of parameters, analytic FLOPs, measured device latency, achieved TFLOP/s and
// share of the step, with the model's total and MFU.
//
// FLOPs conventions (per optimizer step of one rank; tokens = B·T·accumulation):
//   * every parameter costs 6 FLOPs per token, forward + backward: a linear layer [N,IC]→[N,OC]
//     is 2·N·IC·OC forward and 4·N·IC·OC backward, its bias 6·N·OC, a LayerNorm 6·N·2C (its
//     elementwise work counted as this small constant); GELU, softmax, the residual adds and the
//     cross-entropy are counted as 0;
//   * attention's QKᵀ and AV are 2·B·T²·C each forward and twice that backward, i.e. 12·T·C per
//     token per block; causal masking is ignored (the full T² is counted, as most references
//     and the trainer's MFU do);
//   * the embedding's wte is tied to the LM head: its 6·V·C per token belongs to the head's
//     projection (the embedding lookup itself is 0); the embedding row carries wpe's 6·P·C per
//     token, which is no real work but part of the 6·N_params convention;
//   * the optimizer and the gradient reduction are not model FLOPs (0).
// So the rows add up to GPT2Config::flops_per_token(T)·tokens = (6·N_params + 12·L·C·T)·tokens,
// the model FLOPs the trainer's MFU uses.
//
// Latency: a StreamClock (device timers) marked around every layer's forward and backward of the
// profiled step (ProfilingHooks); a block's attention/MLP/LayerNorm parts are not timed
// separately (their rows have FLOPs only). The optimizer and the reduction wait come from the
// step's phase marks (PhaseTimes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "config/config.h"
#include "model/gpt2.h"
#include "model/gpt2_config.h"
#include "train/train_step.h"

namespace shardtrain {

/// One row of the analytic profile.
struct ModuleFlops {
  std::string name;    ///< "embedding", "block 3", "  attention", "head", ...
  int depth = 0;       ///< 0: a model layer; 1: a part of a block
  int layer = 0;       ///< the model layer (0 embedding, 1..L blocks, L+1 head)
  int64_t params = 0;  ///< parameters the module owns
  double flops = 0;    ///< forward + backward FLOPs for `tokens` tokens
};

/// The analytic per-module FLOPs of forward + backward over `tokens` tokens in sequences of
/// `seq_len`: embedding, per block (depth 0, the sum of its parts) its ln_1, attention, ln_2 and
/// mlp (depth 1), the head (ln_f + tied projection + cross-entropy). The depth-0 rows add up to
/// analytic_total_flops().
std::vector<ModuleFlops> analytic_module_flops(const GPT2Config& c, int64_t tokens,
                                               int64_t seq_len);
/// (6·N_params + 12·L·C·T)·tokens: GPT2Config::flops_per_token, as the trainer's MFU.
double analytic_total_flops(const GPT2Config& c, int64_t tokens, int64_t seq_len);

/// Wraps the strategy's hooks (every call forwarded) and marks `clock` around each layer's
/// forward and backward computation (after the inner before_* hook, before the inner after_*
/// hook: a ZeRO-3 gather or a reduction launch is not counted in the layer).
class ProfilingHooks final : public LayerHooks {
 public:
  ProfilingHooks(LayerHooks* inner, StreamClock& clock, int num_layers);
  void before_forward(int layer) override;
  void after_forward(int layer) override;
  void before_backward(int layer) override;
  void after_backward(int layer) override;
  void between_layers() override;
  bool take_tied_embedding_grad(int64_t rows) override;
  void tied_embedding_grad(Tensor dx, Tensor tokens) override;
  /// Reads the clock (waits for its marks): the seconds of each local layer's forward and
  /// backward, summed over the micro-batches.
  void collect();
  const std::vector<double>& forward_seconds() const { return fwd_; }
  const std::vector<double>& backward_seconds() const { return bwd_; }

 private:
  LayerHooks* inner_;
  StreamClock& clock_;
  std::vector<std::pair<int, bool>> spans_;  ///< (layer, backward) per mark pair, in order
  std::vector<double> fwd_, bwd_;
};

/// What the table is made of.
struct FlopsProfileInput {
  GPT2Config model;
  int64_t step = 0;     ///< 1-based
  int64_t tokens = 0;   ///< this rank's tokens of the step (B·T·accumulation)
  int64_t seq_len = 0;  ///< T
  int64_t micro_batch = 0;
  int64_t accumulation = 1;
  std::vector<double> layer_forward_s, layer_backward_s;  ///< per model layer (L + 2)
  PhaseTimes phases;                                      ///< the step's phases (device seconds)
  bool on_gpu = false;
  double peak_tflops = 0;  ///< per GPU, for MFU
  FlopsProfilerConfig options;
};

/// The table's lines (no trailing newlines).
std::vector<std::string> format_flops_profile(const FlopsProfileInput& in);

}  // namespace shardtrain
