#include "train/train_step.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "config/knob.h"
#include "core/error.h"

namespace shardtrain {

namespace {

/// The strategy's hooks, and around each layer's forward and backward a GPU-compute segment of a
/// step timeline (marks on the compute stream after the strategy's before_* hook, so that its
/// waits for parameters show as gaps, and before its after_* hook). Nested passes (the head's
/// forward and backward back to back in a layer-major backward) make one segment.
class TracedHooks final : public LayerHooks {
 public:
  TracedHooks(LayerHooks* inner, StepTrace& trace) : inner_(inner), trace_(trace) {}
  void before_forward(int layer) override {
    if (inner_) inner_->before_forward(layer);
    begin("forward", layer);
  }
  void after_forward(int layer) override {
    end();
    if (inner_) inner_->after_forward(layer);
  }
  void before_backward(int layer) override {
    if (inner_) inner_->before_backward(layer);
    begin("backward", layer);
  }
  void after_backward(int layer) override {
    end();
    if (inner_) inner_->after_backward(layer);
  }
  void between_layers() override {
    if (inner_) inner_->between_layers();
  }
  bool capturable() const override { return false; }
  bool allow_capture() override { return false; }
  bool take_tied_embedding_grad(int64_t rows) override {
    return inner_ && inner_->take_tied_embedding_grad(rows);
  }
  void tied_embedding_grad(Tensor dx, Tensor tokens) override {
    if (inner_) inner_->tied_embedding_grad(dx, tokens);
  }

 private:
  void begin(const char* pass, int layer) {
    if (depth_++ == 0) {
      begin_ = trace_.mark(nullptr);
      label_ = fmt::format("{} {}", pass, layer);
    } else {
      label_ += fmt::format(" and {}", pass);
    }
  }
  void end() {
    if (--depth_ == 0)
      trace_.device_segment(TraceLane::kCompute, label_, begin_, trace_.mark(nullptr));
  }
  LayerHooks* inner_;
  StepTrace& trace_;
  size_t begin_ = 0;
  int depth_ = 0;
  std::string label_;
};

}  // namespace

// ---- TrainStep ----------------------------------------------------------------------------------

TrainStep::TrainStep(Model& model, Strategy& strategy, Communicator& comm, Backend& backend,
                     LossScaler& scaler, TrainStepOptions options, StreamClock* clock)
    : model_(model),
      strategy_(strategy),
      comm_(comm),
      backend_(backend),
      scaler_(scaler),
      options_(options),
      clock_(clock),
      loss_sum_(backend, comm, 1) {
  check<ConfigError>(options_.accumulation_steps >= 1, "{} {} is not valid: it must be >= 1",
                     knob_for(&TrainConfig::gradient_accumulation_steps).path,
                     options_.accumulation_steps);
  check<ConfigError>(options_.gradient_clipping >= 0,
                     "gradient_clipping {} is not valid: use 0 (off) or a max norm > 0",
                     options_.gradient_clipping);
}

StepResult TrainStep::run(int64_t step, double lr, const MicroBatchSource& batches) {
  if (!trace_) return run_step(step, lr, batches);
  LayerHooks* inner = model_.hooks();
  TracedHooks traced(inner, *trace_);
  model_.set_hooks(&traced);
  try {
    StepResult r = run_step(step, lr, batches);
    model_.set_hooks(inner);
    return r;
  } catch (...) {
    model_.set_hooks(inner);
    throw;
  }
}

StepResult TrainStep::run_step(int64_t step, double lr, const MicroBatchSource& batches) {
  const int64_t accum = options_.accumulation_steps;
  StepResult r;
  r.loss_scale = scaler_.scale();
  if (clock_) clock_->mark();
  strategy_.zero_grad();
  double loss = 0;
  // The first `group` micro-batches: their forwards layer by layer (Model::forward_layer_major),
  // then each one's head and backward in turn — or, when the group is the whole step, every
  // backward layer by layer too; the rest one after the other.
  const int64_t group = std::min(accum, options_.forward_group);
  const bool layer_major =
      group > 1 && model_.supports_layer_major_forward() && strategy_.allows_layer_major_forward();
  const auto input_of = [&](int64_t k, const MicroBatch& mb) {
    return ModelInput{
        .batch = mb.batch,
        .seq_len = mb.seq_len,
        .tokens = mb.tokens,
        .images = mb.images,
        .pixels = mb.pixels,
        .pixel_affine = mb.pixel_affine,
        .targets = mb.targets,
        .dropout_seed = micro_batch_dropout_seed(options_.dropout_seed, comm_.rank(), step, k)};
  };
  // Each micro-batch's loss is a mean over its tokens (or images), scaled for fp16.
  const auto scale_of = [&](const MicroBatch& mb) {
    return static_cast<float>(r.loss_scale / static_cast<double>(mb.loss_units()));
  };
  // Gradients hold Σ over micro-steps and ranks of ∂(loss_scale · mean micro-batch loss)/∂θ.
  const double mean_scale = 1.0 / (static_cast<double>(accum * comm_.world_size()) * r.loss_scale);
  // The update an offloaded optimizer may start during the last micro-step's backward: unless
  // the last step was clipped (clipping comes in runs, early in training: a speculation would
  // likely be rolled back, costing a second update).
  const bool speculate = options_.speculative_update && !scaler_.enabled() && !last_clipped_;
  const auto last_micro_step = [&] {
    if (speculate) strategy_.expect_update(lr, mean_scale);
    strategy_.begin_micro_step(accum - 1, accum);
  };
  // Every micro-batch in the group: the backward is layer-major too (each layer's gradient final
  // at once), the whole of it one last micro-step.
  const bool backward_layer_major =
      layer_major && group == accum && strategy_.allows_layer_major_backward();
  int64_t first = 0;
  if (backward_layer_major) {
    for (int64_t k = 0; k < group; ++k) {
      const MicroBatch mb = batches(k);
      model_.stage_micro_batch(static_cast<int>(k), input_of(k, mb), scale_of(mb));
    }
    model_.forward_layer_major(static_cast<int>(group));
    if (clock_) clock_->mark();  // the forward, then every head and the backward
    last_micro_step();
    loss += model_.head_and_backward_layer_major(static_cast<int>(group));
    if (clock_) clock_->mark();
    first = accum;
  } else if (layer_major) {
    for (int64_t k = 0; k < group; ++k) {
      const MicroBatch mb = batches(k);
      model_.stage_micro_batch(static_cast<int>(k), input_of(k, mb), scale_of(mb));
    }
    model_.forward_layer_major(static_cast<int>(group));
    if (clock_) {  // the grouped forward, then (the head's forward, backward) per micro-batch
      clock_->mark();
      clock_->mark();
    }
    for (int64_t k = 0; k < group; ++k) {
      if (k + 1 == accum)
        last_micro_step();
      else
        strategy_.begin_micro_step(k, accum);
      loss += model_.forward_head_layer_major(static_cast<int>(k));
      if (clock_) clock_->mark();
      model_.backward_layer_major(static_cast<int>(k));
      if (clock_) clock_->mark();
    }
    first = group;
  }
  for (int64_t k = first; k < accum; ++k) {
    const MicroBatch mb = batches(k);
    if (k + 1 == accum)
      last_micro_step();
    else
      strategy_.begin_micro_step(k, accum);
    const ModelInput input = input_of(k, mb);
    const float grad_scale = scale_of(mb);
    if (clock_) {  // the phases are timed apart
      loss += model_.forward(input, grad_scale, true);
      clock_->mark();
      model_.backward();
      clock_->mark();
    } else {
      loss += model_.train_micro_batch(input, grad_scale);
    }
  }
  strategy_.finish_gradients();
  if (clock_) clock_->mark();
  r.grad_norm = strategy_.grad_norm(mean_scale);
  bool updated = false;
  try {
    clip_and_update(r, step, lr, options_.gradient_clipping, mean_scale, scaler_,
                    [&](double grad_scale) {
                      updated = true;
                      strategy_.step(lr, grad_scale);
                    });
  } catch (...) {
    if (speculate && !updated) strategy_.cancel_expected_update();
    throw;
  }
  if (speculate && !updated) strategy_.cancel_expected_update();
  last_clipped_ = updated && r.clip_coef < 1.0;
  if (clock_) clock_->mark();
  // The global batch's loss: every rank's micro-batches weigh equally (as in the gradient).
  double sum = loss;
  loss_sum_.sum(std::span<double>(&sum, 1));
  r.loss = sum / static_cast<double>(accum * comm_.world_size());
  backend_.synchronize();
  if (clock_) r.phases = PhaseTimes::from_marks(clock_->intervals());  // no further wait
  check_loss_finite(r, step, lr);
  return r;
}

}  // namespace shardtrain
