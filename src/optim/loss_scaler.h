// Dynamic loss scaling for fp16 mixed precision, configured like DeepSpeed's fp16 section
// (Micikevicius et al., "Mixed Precision Training", arXiv 1710.03740, §3.2; DeepSpeed's
// DynamicLossScaler): the loss is multiplied by `scale` before backward; a step whose gradients
// overflow (inf/NaN) is skipped; once `hysteresis` overflows have happened since the last
// increase, each overflow halves the scale (not below min_loss_scale); after `loss_scale_window`
// clean steps in a row it doubles and the hysteresis budget is restored.
#pragma once

#include <cstdint>

#include "config/config.h"

namespace shardtrain {

class LossScaler {
 public:
  /// enabled=false: scale is 1 and never changes (bf16 / fp32).
  LossScaler(const LossScaleConfig& cfg, bool enabled);

  double scale() const { return scale_; }
  bool enabled() const { return enabled_; }
  /// Records the outcome of a step; returns true when the optimizer step must be skipped
  /// (gradients overflowed).
  bool update(bool overflow);
  int64_t skipped_steps() const { return skipped_; }

  /// Everything update() depends on, for checkpoints: a resumed run continues the same scale
  /// schedule (the manifest's "loss_scaler" object).
  struct State {
    double scale = 1;
    int hysteresis_left = 0;
    int64_t clean_steps = 0;  ///< clean steps since the last change of scale
    int64_t skipped_steps = 0;
  };
  State state() const { return {scale_, hysteresis_left_, clean_steps_, skipped_}; }
  /// Continues from `s` (no-op when disabled).
  void restore(const State& s);

 private:
  LossScaleConfig cfg_;
  bool enabled_;
  double scale_;
  int hysteresis_left_;
  int64_t clean_steps_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace shardtrain
