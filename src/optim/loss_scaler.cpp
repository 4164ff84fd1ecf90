#include "optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace shardtrain {

LossScaler::LossScaler(const LossScaleConfig& cfg, bool enabled)
    : cfg_(cfg),
      enabled_(enabled),
      scale_(!enabled             ? 1.0
             : cfg.loss_scale > 0 ? cfg.loss_scale
                                  : std::ldexp(1.0, cfg.initial_scale_power)),
      hysteresis_left_(cfg.hysteresis) {}

void LossScaler::restore(const State& s) {
  if (!enabled_) return;
  scale_ = s.scale;
  hysteresis_left_ = s.hysteresis_left;
  clean_steps_ = s.clean_steps;
  skipped_ = s.skipped_steps;
}

bool LossScaler::update(bool overflow) {
  if (!enabled_) return false;
  const bool dynamic = cfg_.loss_scale <= 0;
  if (overflow) {
    ++skipped_;
    clean_steps_ = 0;
    // DeepSpeed's delayed shift: the first hysteresis-1 overflows only use up the budget; from
    // then on every overflow halves the scale until a clean window restores the budget.
    if (dynamic) {
      if (hysteresis_left_ <= 1)
        scale_ = std::max(scale_ / 2.0, cfg_.min_loss_scale);
      else
        --hysteresis_left_;
    }
    return true;
  }
  if (dynamic && ++clean_steps_ >= cfg_.loss_scale_window) {
    scale_ *= 2.0;
    clean_steps_ = 0;
    hysteresis_left_ = cfg_.hysteresis;
  }
  return false;
}

}  // namespace shardtrain
