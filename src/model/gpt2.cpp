#include "model/gpt2.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numbers>
#include <optional>

#include "core/error.h"
#include "core/hash.h"
#include "core/rng.h"
#include "model/gpt2_layers.h"

namespace shardtrain {
GPT2Model::GPT2Model(const GPT2Config& config, Backend& backend, bool activation_checkpointing)
    : config_(config), backend_(backend), checkpointing_(activation_checkpointing) {
  std::vector<int> all(static_cast<size_t>(config.n_layer) + 2);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
  build(all, /*head_places_shared=*/true);
  ST_ASSERT(layout_.num_parameters() == config.num_parameters());
}

GPT2Model::GPT2Model(const GPT2Config& config, Backend& backend, bool activation_checkpointing,
                     const std::vector<int>& layer_ids)
    : config_(config), backend_(backend), checkpointing_(activation_checkpointing) {
  build(layer_ids, /*head_places_shared=*/false);
}

GPT2Model::~GPT2Model() = default;

void GPT2Model::build(const std::vector<int>& ids, bool head_places_shared) {
  head_places_shared_ = head_places_shared;
  check<ConfigError>(config_.n_embd % config_.n_head == 0,
                     "model {}: n_embd {} is not divisible by n_head {}", config_.name,
                     config_.n_embd, config_.n_head);
  check<ConfigError>(!ids.empty() && std::is_sorted(ids.begin(), ids.end()) &&
                         std::adjacent_find(ids.begin(), ids.end()) == ids.end() &&
                         ids.front() >= 0 && ids.back() <= config_.n_layer + 1,
                     "a model part needs distinct ascending layer indices in [0, {}]",
                     config_.n_layer + 1);
  ids_ = ids;
  LayerFactory factory = make_layer_factory(config_, TiedEmbedding{&external_wte_, &external_dwte_},
                                            checkpointing_, head_places_shared);
  bool first_block = true;
  for (int id : ids) {
    if (id == config_.n_layer + 1 && ids.front() == 0) factory.tied = embedding_views(*layers_[0]);
    const bool block = id > 0 && id <= config_.n_layer;
    layers_.push_back(factory.make(id, block && first_block && !head_places_shared));
    if (block) first_block = false;
  }
  for (auto& l : layers_) layout_.add_layer(l->name(), l->param_specs());
  // The LM head is tied to the token embedding: it reads (and writes the gradient of) wte.
  if (has_head() && has_embedding()) layout_.tie(num_layers() - 1, "transformer.wte.weight");
}

Tensor GPT2Model::embedding_weight() const {
  ST_ASSERT(has_embedding());
  return *embedding_views(*layers_[0]).wte;
}

Tensor GPT2Model::embedding_weight_grad() const {
  ST_ASSERT(has_embedding());
  return *embedding_views(*layers_[0]).dwte;
}

void GPT2Model::set_tied_embedding(Tensor wte, Tensor dwte) {
  external_wte_ = wte;
  external_dwte_ = dwte;
}

void GPT2Model::bind(const Tensor& params, const Tensor& grads) {
  ST_ASSERT(params.numel() == layout_.numel());
  ST_ASSERT(grads.empty() || grads.numel() == layout_.numel());
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerRange& r = layout_.layers()[i];
    layers_[i]->bind(r, params.slice1d(r.offset, r.numel),
                     grads.empty() ? Tensor() : grads.slice1d(r.offset, r.numel));
  }
}

double GPT2Model::train_flops_per_sample(int64_t seq_len) const {
  return config_.flops_per_token(seq_len) * static_cast<double>(seq_len);
}

void GPT2Model::init_parameters(float* host, uint64_t seed) const {
  init_layout_parameters(layout_, host, seed);
}

GPT2Model::Slot& GPT2Model::slot(int s) {
  ST_ASSERT(s >= 0);
  if (static_cast<size_t>(s) >= slots_.size()) slots_.resize(static_cast<size_t>(s) + 1);
  auto& p = slots_[static_cast<size_t>(s)];
  if (!p) p = std::make_unique<Slot>();
  return *p;
}

void GPT2Model::reserve(int s, int64_t B, int64_t T) {
  Slot& sl = slot(s);
  const int64_t C = config_.n_embd;
  const int n = num_layers();
  if (B * T > sl.B * sl.T || T > sl.T || B > sl.B) {
    sl.residual.clear();
    // residual[i]: the input of layer i; the embedding has none, the head no output.
    for (int i = 0; i < n; ++i)
      sl.residual.emplace_back(backend_, backend_.compute_dtype(),
                               i == 0 && has_embedding() ? 0 : B * T * C);
    if (!has_head()) sl.residual.emplace_back(backend_, backend_.compute_dtype(), B * T * C);
    sl.dresid = FlatBuffer(backend_, backend_.compute_dtype(), B * T * C);
    sl.tokens = FlatBuffer(backend_, DType::kI32, B * T);
    sl.targets = FlatBuffer(backend_, DType::kI32, B * T);
    sl.losses = FlatBuffer(backend_, DType::kF32, B * T);
    sl.B = B;
    sl.T = T;
  }
  for (int i = 0; i < n; ++i) {
    Layer& l = *layers_[static_cast<size_t>(i)];
    l.use_slot(layer_slot(i, s));
    l.reserve(backend_, B, T);
  }
}

void GPT2Model::prepare(int s, const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
                        float grad_scale, bool for_backward, uint64_t dropout_seed) {
  check<ConfigError>(T <= config_.n_positions,
                     "sequence length {} exceeds the context of {} ({} positions)", T, config_.name,
                     config_.n_positions);
  reserve(s, B, T);
  Slot& sl = slot(s);
  StepContext& ctx = sl.ctx;
  ctx = StepContext();
  ctx.B = B;
  ctx.T = T;
  const size_t bytes = static_cast<size_t>(B * T) * sizeof(int32_t);
  ctx.tokens = Tensor(sl.tokens.data(), DType::kI32, backend_.kind(), {B, T});
  if (tokens) backend_.copy_from_host(sl.tokens.data(), tokens, bytes);
  if (targets) {
    ctx.targets = Tensor(sl.targets.data(), DType::kI32, backend_.kind(), {B, T});
    backend_.copy_from_host(sl.targets.data(), targets, bytes);
  }
  ctx.losses = Tensor(sl.losses.data(), DType::kF32, backend_.kind(), {B * T});
  ctx.grad_scale = grad_scale;
  ctx.for_backward = for_backward;
  if (for_backward) {  // dropout only while training
    ctx.embd_pdrop = config_.embd_pdrop;
    ctx.attn_pdrop = config_.attn_pdrop;
    ctx.resid_pdrop = config_.resid_pdrop;
    ctx.dropout_seed = dropout_seed;
  }
}

Tensor GPT2Model::activation(int s, int i) {
  Slot& sl = slot(s);
  ST_ASSERT(i >= 0 && static_cast<size_t>(i) < sl.residual.size());
  return Tensor(sl.residual[static_cast<size_t>(i)].data(), backend_.compute_dtype(),
                backend_.kind(), {sl.ctx.B, sl.ctx.T, config_.n_embd});
}

Tensor GPT2Model::activation_grad(int s) {
  Slot& sl = slot(s);
  return Tensor(sl.dresid.data(), backend_.compute_dtype(), backend_.kind(),
                {sl.ctx.B, sl.ctx.T, config_.n_embd});
}

void GPT2Model::layer_forward(int i, int s) {
  Slot& sl = slot(s);
  Layer& l = *layers_[static_cast<size_t>(i)];
  l.use_slot(layer_slot(i, s));
  const bool embed = i == 0 && has_embedding();
  const bool head = i == num_layers() - 1 && has_head();
  l.forward(backend_, sl.ctx, embed ? Tensor() : activation(s, i),
            head ? Tensor() : activation(s, i + 1));
}

void GPT2Model::forward_layers(int s, int first, int last) {
  ST_ASSERT(0 <= first && first < last && last <= num_layers());
  for (int i = first; i < last; ++i) {
    if (hooks_) hooks_->before_forward(i);
    layer_forward(i, s);
    if (hooks_) {
      hooks_->after_forward(i);
      hooks_->between_layers();
    }
  }
}

void GPT2Model::backward_layers(int s, int first, int last, BackwardPass pass) {
  Slot& sl = slot(s);
  ST_ASSERT(sl.ctx.for_backward);
  ST_ASSERT(0 <= first && first < last && last <= num_layers());
  Tensor dresid = activation_grad(s);
  const bool hooks = hooks_ && pass != BackwardPass::kInput;
  // The LM head is tied to wte: the hooks may take over the embedding's part of wte's gradient
  // (LayerHooks::take_tied_embedding_grad) when this backward runs both.
  const bool hand_off = hooks && pass == BackwardPass::kFull && first == 0 &&
                        last == num_layers() && has_embedding() && has_head() &&
                        hooks_->take_tied_embedding_grad(sl.ctx.B * sl.ctx.T);
  for (int i = last - 1; i >= first; --i) {
    if (hooks) hooks_->before_backward(i);
    Layer& l = *layers_[static_cast<size_t>(i)];
    l.use_slot(layer_slot(i, s));
    const Tensor in = i == 0 && has_embedding() ? Tensor() : activation(s, i);
    if (hand_off && i == 0) {  // wpe's gradient here, wte's rows to the hooks
      embedding_backward_positions(backend_, l, sl.ctx, dresid);
      const int64_t rows = sl.ctx.B * sl.ctx.T;
      hooks_->tied_embedding_grad(dresid.reshape({rows, config_.n_embd}),
                                  sl.ctx.tokens.reshape({rows}));
    } else {
      switch (pass) {
        case BackwardPass::kFull:
          l.backward(backend_, sl.ctx, in, dresid);
          break;
        case BackwardPass::kInput:
          l.backward_input(backend_, sl.ctx, in, dresid);
          break;
        case BackwardPass::kWeight:
          l.backward_weight(backend_, sl.ctx, in, dresid);
          break;
      }
    }
    if (hooks) hooks_->after_backward(i);
    if (hooks_) hooks_->between_layers();
  }
}

double GPT2Model::slot_loss(int s) {
  Slot& sl = slot(s);
  return backend_.sum(sl.ctx.losses) / static_cast<double>(sl.ctx.B * sl.ctx.T);
}

Tensor GPT2Model::slot_losses(int s) { return slot(s).ctx.losses; }

double GPT2Model::forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
                          float grad_scale, bool for_backward, uint64_t dropout_seed) {
  prepare(0, tokens, targets, B, T, grad_scale, for_backward && targets != nullptr, dropout_seed);
  forward_layers(0, 0, num_layers());
  if (!targets) return 0.0;
  return slot_loss(0);
}

uint64_t micro_batch_dropout_seed(uint64_t run_seed, int64_t rank, int64_t step,
                                  int64_t micro_batch) {
  uint64_t s =
      mix_seed(run_seed ^ 0x44524F504F555421ull, static_cast<uint64_t>(rank));  // "DROPOUT!"
  s = mix_seed(s, static_cast<uint64_t>(step));
  return mix_seed(s, static_cast<uint64_t>(micro_batch));
}

void GPT2Model::backward() { backward_layers(0, 0, num_layers(), BackwardPass::kFull); }

void GPT2Model::stage_micro_batch(int k, const ModelInput& in, float grad_scale) {
  ST_ASSERT(supports_layer_major_forward() && in.tokens && in.targets);
  prepare(k, in.tokens, in.targets, in.batch, in.seq_len, grad_scale, true, in.dropout_seed);
}

void GPT2Model::forward_layer_major(int count) {
  ST_ASSERT(supports_layer_major_forward() && count >= 1);
  const int n = num_layers();
  for (int i = 0; i + 1 < n; ++i) {
    if (hooks_) hooks_->before_forward(i);
    for (int s = 0; s < count; ++s) {
      layer_forward(i, s);
      if (hooks_) hooks_->between_layers();
    }
    if (hooks_) hooks_->after_forward(i);
  }
}

double GPT2Model::forward_head_layer_major(int k) {
  const int n = num_layers();
  forward_layers(k, n - 1, n);  // the head, in slot 0
  return slot_loss(k);
}

void GPT2Model::backward_layer_major(int k) {
  backward_layers(k, 0, num_layers(), BackwardPass::kFull);
}

double GPT2Model::head_and_backward_layer_major(int count) {
  ST_ASSERT(supports_layer_major_forward() && count >= 1);
  const int n = num_layers();
  const int head = n - 1;
  // The heads share their activations (slot 0): each micro-batch's head runs its forward and
  // backward back to back, leaving ∂L/∂x_L in the micro-batch's own slot.
  if (hooks_) {
    hooks_->before_forward(head);
    hooks_->before_backward(head);
  }
  for (int s = 0; s < count; ++s) {
    Slot& sl = slot(s);
    ST_ASSERT(sl.ctx.for_backward);
    layer_forward(head, s);
    layers_[static_cast<size_t>(head)]->backward(backend_, sl.ctx, activation(s, head),
                                                 activation_grad(s));
    if (hooks_) hooks_->between_layers();
  }
  if (hooks_) {
    hooks_->after_forward(head);
    hooks_->after_backward(head);
  }
  for (int i = head - 1; i >= 0; --i) {
    if (hooks_) hooks_->before_backward(i);
    Layer& l = *layers_[static_cast<size_t>(i)];
    for (int s = 0; s < count; ++s) {
      l.use_slot(layer_slot(i, s));
      const Tensor in = i == 0 && has_embedding() ? Tensor() : activation(s, i);
      l.backward(backend_, slot(s).ctx, in, activation_grad(s));
      if (hooks_) hooks_->between_layers();
    }
    if (hooks_) hooks_->after_backward(i);
  }
  double loss = 0;
  for (int s = 0; s < count; ++s) loss += slot_loss(s);
  return loss;
}

std::vector<float> GPT2Model::logits_at(int64_t b, int64_t t) {
  ST_ASSERT(has_head());
  Layer& head = *layers_.back();
  head.use_slot(0);
  return head_logits_row(backend_, head, b * slot(0).ctx.T + t);
}

}  // namespace shardtrain
