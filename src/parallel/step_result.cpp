#include "parallel/step_result.h"

#include <cmath>
#include <utility>

#include "core/error.h"

namespace shardtrain {

// ---- PhaseTimes ---------------------------------------------------------------------------------

PhaseTimes PhaseTimes::from_marks(const std::vector<double>& t) {
  ST_ASSERT(t.size() >= 4 && t.size() % 2 == 0);
  PhaseTimes p;
  const size_t micro = t.size() - 2;
  for (size_t i = 0; i < micro; i += 2) {
    p.forward += t[i];
    p.backward += t[i + 1];
  }
  p.reduce_wait = t[micro];
  p.optimizer = t[micro + 1];
  return p;
}

PhaseTimes& PhaseTimes::operator+=(const PhaseTimes& o) {
  forward += o.forward;
  backward += o.backward;
  reduce_wait += o.reduce_wait;
  optimizer += o.optimizer;
  return *this;
}

PhaseTimes PhaseTimes::scaled(double f) const {
  return {forward * f, backward * f, reduce_wait * f, optimizer * f};
}

// ---- the end of a step, shared with the pipeline
// ---------------------------------------------------

void clip_and_update(StepResult& r, int64_t step, double lr, double clip, double mean_scale,
                     LossScaler& scaler, const std::function<void(double)>& update) {
  const bool overflow = !std::isfinite(r.grad_norm);
  r.skipped = scaler.update(overflow);
  if (r.skipped) return;
  check<RuntimeFailure>(!overflow,
                        "gradients became non-finite (norm {}) at step {} (learning rate "
                        "{:g}): training diverged; lower --lr or raise --warmup-steps",
                        r.grad_norm, step + 1, lr);
  r.clip_coef = clip > 0 && r.grad_norm > clip ? clip / (r.grad_norm + 1e-6) : 1.0;
  update(mean_scale * r.clip_coef);
}

void check_loss_finite(const StepResult& r, int64_t step, double lr) {
  check<RuntimeFailure>(std::isfinite(r.loss),
                        "loss became {} at step {} (learning rate {:g}): training diverged; "
                        "lower --lr or raise --warmup-steps",
                        r.loss, step + 1, lr);
}

}  // namespace shardtrain
