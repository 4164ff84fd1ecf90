#include "model/gpt2.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numbers>
#include <optional>

#include "core/error.h"
#include "core/hash.h"
#include "core/rng.h"

namespace shardtrain {
namespace {

constexpr float kInitStd = 0.02f;

/// A zeroed device allocation of at least `bytes` bytes (untyped memory that views are carved
/// out of).
FlatBuffer byte_buffer(Backend& be, size_t bytes) {
  return FlatBuffer(be, DType::kU16, static_cast<int64_t>((bytes + 1) / 2));
}

/// Bytes of `numel` elements of `dt` rounded up to 64: the pieces carved out of one allocation
/// (BlockActivations, BlockScratch) each start 64-byte aligned.
size_t piece_bytes(int64_t numel, DType dt) {
  return (static_cast<size_t>(numel) * dtype_size(dt) + 63) / 64 * 64;
}

/// A device buffer that grows to the largest size asked for, or a fixed piece of memory owned
/// elsewhere (place()).
class Scratch {
 public:
  Tensor get(Backend& be, DType dt, std::initializer_list<int64_t> dims) {
    Tensor shape(nullptr, dt, be.kind(), dims);
    if (placed_) {
      ST_ASSERT(shape.bytes() <= placed_bytes_);
      shape.data = placed_;
      return shape;
    }
    if (buf_.bytes() < shape.bytes()) {
      buf_ = FlatBuffer();
      buf_ = byte_buffer(be, shape.bytes());
    }
    shape.data = buf_.data();
    return shape;
  }
  /// From now on get() hands out `bytes` bytes at `p` (and allocates nothing).
  void place(void* p, size_t bytes) {
    buf_ = FlatBuffer();
    placed_ = p;
    placed_bytes_ = bytes;
  }

 private:
  FlatBuffer buf_;
  void* placed_ = nullptr;
  size_t placed_bytes_ = 0;
};

Tensor tensor_of(const Tensor& base, const ParamTensor& p, int64_t layer_offset) {
  if (base.empty()) return {};
  Tensor t = base.slice1d(p.offset - layer_offset, p.numel);
  t.ndim = static_cast<int>(p.shape.size());
  for (size_t i = 0; i < p.shape.size(); ++i) t.shape[i] = p.shape[i];
  return t;
}

// ---- embedding -----------------------------------------------------------------------------

class EmbeddingLayer final : public Layer {
 public:
  explicit EmbeddingLayer(const GPT2Config& c) : Layer("embed"), c_(c) {}

  std::vector<ParamTensor> param_specs() const override {
    ParamTensor wte{.name = "transformer.wte.weight",
                    .shape = {c_.vocab_size, c_.n_embd},
                    .weight_decay = true,
                    .init_std = kInitStd};
    ParamTensor wpe{.name = "transformer.wpe.weight",
                    .shape = {c_.n_positions, c_.n_embd},
                    .weight_decay = true,
                    .init_std = kInitStd};
    return {wte, wpe};
  }
  void bind(const LayerRange& r, Tensor params, Tensor grads) override {
    wte_ = tensor_of(params, r.tensors[0], r.offset);
    wpe_ = tensor_of(params, r.tensors[1], r.offset);
    dwte_ = tensor_of(grads, r.tensors[0], r.offset);
    dwpe_ = tensor_of(grads, r.tensors[1], r.offset);
  }
  void reserve(Backend&, int64_t, int64_t) override {}
  void forward(Backend& be, StepContext& ctx, Tensor, Tensor out) override {
    be.embedding_forward(out, ctx.tokens, wte_, wpe_);
  }
  void backward(Backend& be, StepContext& ctx, Tensor, Tensor dresid) override {
    be.embedding_backward(dwte_, dwpe_, dresid, ctx.tokens);
  }
  const Tensor& wte() const { return wte_; }
  const Tensor& dwte() const { return dwte_; }

 private:
  GPT2Config c_;
  Tensor wte_, wpe_, dwte_, dwpe_;
};

// ---- transformer block ---------------------------------------------------------------------

/// What one block keeps between forward and backward: views carved out of one allocation,
/// owned here (`storage`) or, under activation checkpointing, out of the memory the head's
/// logits use too (HeadLayer::reserve). Each piece starts 64-byte aligned.
struct BlockActivations {
  Tensor ln1, ln1_mean, ln1_rstd, qkv, atty, att_probs, att_lse, x2, ln2, ln2_mean, ln2_rstd, fch,
      fch_gelu;
  int64_t B = 0, T = 0;
  FlatBuffer storage;

  bool fits(int64_t B_, int64_t T_) const { return B_ * T_ <= B * T && T_ <= T && B_ <= B; }

  /// Bytes of one set for micro-batches [B_, T_] (what carve() takes).
  static size_t bytes_for(Backend& be, const GPT2Config& c, int64_t B_, int64_t T_) {
    BlockActivations a;
    return a.carve(nullptr, be, c, B_, T_);
  }

  /// Points every view into `base` (nullptr: only sizes them); returns the bytes used.
  size_t carve(char* base, Backend& be, const GPT2Config& c, int64_t B_, int64_t T_) {
    const DType dt = be.compute_dtype();
    const int64_t N = B_ * T_, C = c.n_embd, NH = c.n_head;
    size_t used = 0;
    const auto take = [&](Tensor& t, DType type, int64_t numel) {
      t = Tensor(base ? base + used : nullptr, type, be.kind(), {numel});
      used += piece_bytes(numel, type);
    };
    take(ln1, dt, N * C);
    take(ln1_mean, DType::kF32, N);
    take(ln1_rstd, DType::kF32, N);
    take(qkv, dt, N * 3 * C);
    take(atty, dt, N * C);
    if (be.attention_saves_probs(static_cast<int>(C / NH)))
      take(att_probs, be.attention_probs_dtype(), B_ * NH * T_ * T_);
    else
      take(att_lse, DType::kF32, B_ * NH * T_);
    take(x2, dt, N * C);
    take(ln2, dt, N * C);
    take(ln2_mean, DType::kF32, N);
    take(ln2_rstd, DType::kF32, N);
    take(fch, dt, N * 4 * C);
    take(fch_gelu, dt, N * 4 * C);
    B = B_;
    T = T_;
    return used;
  }

  /// Own memory for [B_, T_] (blocks without checkpointing).
  void reserve(Backend& be, const GPT2Config& c, int64_t B_, int64_t T_) {
    if (fits(B_, T_)) return;
    storage = FlatBuffer();
    const size_t bytes = bytes_for(be, c, B_, T_);
    storage = byte_buffer(be, bytes);
    carve(static_cast<char*>(storage.data()), be, c, B_, T_);
  }
};

/// Buffers every block uses only transiently (shared by all blocks).
struct BlockScratch {
  Scratch tmp, d4c, dc, dqkv;
  /// Their widths in channels: tmp [N,C], d4c [N,4C], dc [N,C], dqkv [N,3C].
  static constexpr int64_t kWidths[] = {1, 4, 1, 3};

  /// Bytes of the four buffers for N rows of C channels in dtype `dt` (what place() takes).
  static size_t bytes_for(DType dt, int64_t N, int64_t C) {
    size_t bytes = 0;
    for (int64_t w : kWidths) bytes += piece_bytes(N * w * C, dt);
    return bytes;
  }
  /// Places the four buffers at `base` (bytes_for(dt, N, C) bytes).
  void place(char* base, DType dt, int64_t N, int64_t C) {
    Scratch* buffers[] = {&tmp, &d4c, &dc, &dqkv};
    size_t used = 0;
    for (size_t i = 0; i < std::size(buffers); ++i) {
      const size_t b = piece_bytes(N * kWidths[i] * C, dt);
      buffers[i]->place(base + used, b);
      used += b;
    }
  }
};

class BlockLayer final : public Layer {
 public:
  BlockLayer(const GPT2Config& c, int index, std::shared_ptr<BlockActivations> shared_acts,
             std::shared_ptr<BlockScratch> scratch)
      : Layer(fmt::format("block.{}", index)),
        c_(c),
        index_(index),
        checkpointed_(shared_acts != nullptr),
        acts_(shared_acts ? std::move(shared_acts) : std::make_shared<BlockActivations>()),
        scratch_(std::move(scratch)) {}

  std::vector<ParamTensor> param_specs() const override {
    const int64_t C = c_.n_embd;
    const std::string p = fmt::format("transformer.h.{}.", index_);
    const float proj_std = kInitStd / std::sqrt(2.0f * static_cast<float>(c_.n_layer));
    auto ln = [&](const std::string& n, bool w) {
      return ParamTensor{
          .name = p + n + (w ? ".weight" : ".bias"), .shape = {C}, .init_value = w ? 1.0f : 0.0f};
    };
    auto weight = [&](const std::string& n, int64_t out, int64_t in, float std) {
      return ParamTensor{.name = p + n + ".weight",
                         .shape = {out, in},
                         .weight_decay = true,
                         .hf_transposed = true,
                         .init_std = std};
    };
    auto bias = [&](const std::string& n, int64_t out) {
      return ParamTensor{.name = p + n + ".bias", .shape = {out}};
    };
    return {ln("ln_1", true),
            ln("ln_1", false),
            weight("attn.c_attn", 3 * C, C, kInitStd),
            bias("attn.c_attn", 3 * C),
            weight("attn.c_proj", C, C, proj_std),
            bias("attn.c_proj", C),
            ln("ln_2", true),
            ln("ln_2", false),
            weight("mlp.c_fc", 4 * C, C, kInitStd),
            bias("mlp.c_fc", 4 * C),
            weight("mlp.c_proj", C, 4 * C, proj_std),
            bias("mlp.c_proj", C)};
  }

  void bind(const LayerRange& r, Tensor params, Tensor grads) override {
    for (size_t i = 0; i < kNumTensors; ++i) {
      w_[i] = tensor_of(params, r.tensors[i], r.offset);
      g_[i] = tensor_of(grads, r.tensors[i], r.offset);
    }
  }

  void reserve(Backend& be, int64_t B, int64_t T) override {
    if (!checkpointed_) acts_->reserve(be, c_, B, T);  // else the head places the shared set
  }

  void forward(Backend& be, StepContext& ctx, Tensor in, Tensor out) override {
    compute_forward(be, ctx, in, out);
  }

  void backward(Backend& be, StepContext& ctx, Tensor in, Tensor dresid) override {
    const int64_t B = ctx.B, T = ctx.T, C = c_.n_embd, N = B * T;
    BlockActivations& a = *acts_;
    if (checkpointed_) {
      // Activation checkpointing: recompute this block's activations from its saved input
      // (Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174).
      Tensor discard = scratch_->tmp.get(be, be.compute_dtype(), {B, T, C});
      compute_forward(be, ctx, in, discard);
    }
    const DType dt = be.compute_dtype();
    const auto view = [&](const Tensor& f, std::initializer_list<int64_t> dims) {
      return Tensor(f.data, f.dtype, be.kind(), dims);
    };
    Tensor d4c = scratch_->d4c.get(be, dt, {N, 4 * C});
    Tensor dc = scratch_->dc.get(be, dt, {N, C});
    Tensor dqkv = scratch_->dqkv.get(be, dt, {B, T, 3 * C});
    Tensor dres2 = dresid.reshape({N, C});

    // MLP: x3 = x2 + c_proj(gelu(c_fc(ln_2(x2))))
    be.matmul_backward(d4c, g_[kFcProjW], g_[kFcProjB], dres2, view(a.fch_gelu, {N, 4 * C}),
                       w_[kFcProjW], view(a.fch, {N, 4 * C}));
    be.matmul_backward(dc, g_[kFcW], g_[kFcB], d4c, view(a.ln2, {N, C}), w_[kFcW]);
    be.layernorm_backward(dres2, g_[kLn2W], g_[kLn2B], dc, view(a.x2, {N, C}), w_[kLn2W],
                          view(a.ln2_mean, {N}), view(a.ln2_rstd, {N}));
    // Attention: x2 = x + c_proj(attn(c_attn(ln_1(x))))
    be.matmul_backward(dc, g_[kAttnProjW], g_[kAttnProjB], dres2, view(a.atty, {N, C}),
                       w_[kAttnProjW]);
    be.attention_backward(dqkv, dc.reshape({B, T, C}), view(a.qkv, {B, T, 3 * C}),
                          view(a.atty, {B, T, C}), saved(be, B, T), c_.n_head);
    be.matmul_backward(dc, g_[kQkvW], g_[kQkvB], dqkv.reshape({N, 3 * C}), view(a.ln1, {N, C}),
                       w_[kQkvW]);
    be.layernorm_backward(dres2, g_[kLn1W], g_[kLn1B], dc, in.reshape({N, C}), w_[kLn1W],
                          view(a.ln1_mean, {N}), view(a.ln1_rstd, {N}));
  }

 private:
  enum : size_t {
    kLn1W,
    kLn1B,
    kQkvW,
    kQkvB,
    kAttnProjW,
    kAttnProjB,
    kLn2W,
    kLn2B,
    kFcW,
    kFcB,
    kFcProjW,
    kFcProjB,
    kNumTensors
  };

  AttentionSaved saved(Backend& be, int64_t B, int64_t T) {
    AttentionSaved s;
    const int64_t NH = c_.n_head;
    if (be.attention_saves_probs(static_cast<int>(c_.n_embd / NH)))
      s.probs = Tensor(acts_->att_probs.data, be.attention_probs_dtype(), be.kind(), {B, NH, T, T});
    else
      s.lse = Tensor(acts_->att_lse.data, DType::kF32, be.kind(), {B, NH, T});
    return s;
  }

  void compute_forward(Backend& be, StepContext& ctx, Tensor in, Tensor out) {
    const int64_t B = ctx.B, T = ctx.T, C = c_.n_embd, N = B * T;
    BlockActivations& a = *acts_;
    const DType dt = be.compute_dtype();
    const auto view = [&](const Tensor& f, std::initializer_list<int64_t> dims) {
      return Tensor(f.data, f.dtype, be.kind(), dims);
    };
    Tensor x = in.reshape({N, C});
    Tensor ln1 = view(a.ln1, {N, C}), qkv = view(a.qkv, {N, 3 * C}), atty = view(a.atty, {N, C});
    Tensor x2 = view(a.x2, {N, C}), ln2 = view(a.ln2, {N, C});
    Tensor fch = view(a.fch, {N, 4 * C}), fch_gelu = view(a.fch_gelu, {N, 4 * C});
    Tensor tmp = scratch_->tmp.get(be, dt, {N, C});
    if (checkpointed_ && tmp.data == out.data) tmp = x2;  // recompute: out is discarded

    be.layernorm_forward(ln1, view(a.ln1_mean, {N}), view(a.ln1_rstd, {N}), x, w_[kLn1W],
                         w_[kLn1B]);
    be.matmul_forward(qkv, ln1, w_[kQkvW], w_[kQkvB]);
    be.attention_forward(atty.reshape({B, T, C}), saved(be, B, T), qkv.reshape({B, T, 3 * C}),
                         c_.n_head);
    if (tmp.data == x2.data) {
      be.matmul_forward(x2, atty, w_[kAttnProjW], w_[kAttnProjB]);
      be.add(x2, x2, x);
    } else {
      be.matmul_forward(tmp, atty, w_[kAttnProjW], w_[kAttnProjB]);
      be.add(x2, x, tmp);
    }
    be.layernorm_forward(ln2, view(a.ln2_mean, {N}), view(a.ln2_rstd, {N}), x2, w_[kLn2W],
                         w_[kLn2B]);
    be.matmul_forward(fch_gelu, ln2, w_[kFcW], w_[kFcB], Epilogue::kGelu, fch);
    Tensor y = out.reshape({N, C});
    be.matmul_forward(y, fch_gelu, w_[kFcProjW], w_[kFcProjB]);
    be.add(y, y, x2);
  }

  GPT2Config c_;
  int index_;
  bool checkpointed_;
  std::shared_ptr<BlockActivations> acts_;
  std::shared_ptr<BlockScratch> scratch_;
  Tensor w_[kNumTensors], g_[kNumTensors];
};

// ---- head: ln_f, tied LM head, softmax cross-entropy -------------------------------------------

class HeadLayer final : public Layer {
 public:
  /// `shared_acts`: the blocks' one recomputed set under activation checkpointing (else null);
  /// it and the blocks' scratch `block_scratch` are then placed in the logits' memory: blocks
  /// run before the head in forward and after it in backward, so they are never live at once.
  HeadLayer(const GPT2Config& c, const EmbeddingLayer& embed,
            std::shared_ptr<BlockActivations> shared_acts,
            std::shared_ptr<BlockScratch> block_scratch)
      : Layer("head"),
        c_(c),
        embed_(embed),
        shared_acts_(std::move(shared_acts)),
        block_scratch_(std::move(block_scratch)) {}

  std::vector<ParamTensor> param_specs() const override {
    return {ParamTensor{.name = "transformer.ln_f.weight", .shape = {c_.n_embd}, .init_value = 1},
            ParamTensor{.name = "transformer.ln_f.bias", .shape = {c_.n_embd}}};
  }
  void bind(const LayerRange& r, Tensor params, Tensor grads) override {
    lnw_ = tensor_of(params, r.tensors[0], r.offset);
    lnb_ = tensor_of(params, r.tensors[1], r.offset);
    dlnw_ = tensor_of(grads, r.tensors[0], r.offset);
    dlnb_ = tensor_of(grads, r.tensors[1], r.offset);
  }
  void reserve(Backend& be, int64_t B, int64_t T) override {
    const int64_t N = B * T;
    if (N <= N_ && (!shared_acts_ || shared_acts_->fits(B, T))) return;
    const DType dt = be.compute_dtype();
    lnf_ = FlatBuffer(be, dt, N * c_.n_embd);
    mean_ = FlatBuffer(be, DType::kF32, N);
    rstd_ = FlatBuffer(be, DType::kF32, N);
    Vp_ = be.padded_columns(c_.vocab_size);
    const size_t logits_bytes = static_cast<size_t>(N * Vp_) * dtype_size(dt);
    const size_t set_bytes = shared_acts_ ? BlockActivations::bytes_for(be, c_, B, T) : 0;
    const size_t shared_bytes =
        shared_acts_ ? set_bytes + BlockScratch::bytes_for(dt, N, c_.n_embd) : size_t{0};
    logits_mem_ = FlatBuffer();
    logits_mem_ = byte_buffer(be, std::max(logits_bytes, shared_bytes));
    logits_ = Tensor(logits_mem_.data(), dt, be.kind(), {N * Vp_});
    if (shared_acts_) {
      char* base = static_cast<char*>(logits_mem_.data());
      shared_acts_->carve(base, be, c_, B, T);
      block_scratch_->place(base + set_bytes, dt, N, c_.n_embd);
    }
    N_ = N;
  }
  void forward(Backend& be, StepContext& ctx, Tensor in, Tensor) override {
    const int64_t N = ctx.B * ctx.T, C = c_.n_embd, V = c_.vocab_size;
    Tensor lnf = view(be, lnf_, {N, C});
    Tensor logits(logits_.data, logits_.dtype, be.kind(), {N, Vp_});  // rows padded: Vp_ ≥ V
    be.layernorm_forward(lnf, view(be, mean_, {N}), view(be, rstd_, {N}), in.reshape({N, C}), lnw_,
                         lnb_);
    be.matmul_forward(logits, lnf, embed_.wte(), Tensor());
    if (ctx.targets.empty()) return;
    Tensor targets = ctx.targets.reshape({N});
    if (ctx.for_backward)
      be.softmax_cross_entropy(ctx.losses, logits, targets, ctx.grad_scale, V);
    else
      be.cross_entropy_forward(ctx.losses, logits, targets, V);
  }
  void backward(Backend& be, StepContext& ctx, Tensor in, Tensor dresid) override {
    const int64_t N = ctx.B * ctx.T, C = c_.n_embd;
    Tensor lnf = view(be, lnf_, {N, C});
    Tensor dlogits(logits_.data, logits_.dtype, be.kind(), {N, Vp_});
    // The LM head's input gradient goes to a scratch buffer: ln_f's backward then accumulates
    // into the (zeroed) residual gradient.
    Tensor dlnf = scratch_.get(be, be.compute_dtype(), {N, C});
    be.matmul_backward(dlnf, embed_.dwte(), Tensor(), dlogits, lnf, embed_.wte());
    be.fill_zero(dresid);
    be.layernorm_backward(dresid.reshape({N, C}), dlnw_, dlnb_, dlnf, in.reshape({N, C}), lnw_,
                          view(be, mean_, {N}), view(be, rstd_, {N}));
  }
  /// Host copy of the logits row for position (b, t) of the last forward.
  std::vector<float> logits_row(Backend& be, int64_t row) const {
    std::vector<float> out(static_cast<size_t>(c_.vocab_size));
    Tensor src = logits_.slice1d(row * Vp_, c_.vocab_size);
    if (src.dtype == DType::kF32) {
      be.copy_to_host(out.data(), src.data, src.bytes());
    } else {
      FlatBuffer tmp(be, DType::kF32, c_.vocab_size);
      be.convert(tmp.view(), src);
      be.copy_to_host(out.data(), tmp.data(), tmp.bytes());
    }
    return out;
  }

 private:
  static Tensor view(Backend& be, const FlatBuffer& f, std::initializer_list<int64_t> dims) {
    return Tensor(f.data(), f.dtype(), be.kind(), dims);
  }
  GPT2Config c_;
  const EmbeddingLayer& embed_;
  Tensor lnw_, lnb_, dlnw_, dlnb_;
  std::shared_ptr<BlockActivations> shared_acts_;
  std::shared_ptr<BlockScratch> block_scratch_;
  FlatBuffer lnf_, mean_, rstd_, logits_mem_;
  Tensor logits_;  ///< [N·Vp_] in logits_mem_: rows padded to Vp_ columns for the backend
  Scratch scratch_;
  int64_t N_ = 0, Vp_ = 0;
};

}  // namespace

GPT2Model::GPT2Model(const GPT2Config& config, Backend& backend, bool activation_checkpointing)
    : config_(config), backend_(backend), checkpointing_(activation_checkpointing) {
  check<ConfigError>(config.n_embd % config.n_head == 0,
                     "model {}: n_embd {} is not divisible by n_head {}", config.name,
                     config.n_embd, config.n_head);
  auto embed = std::make_unique<EmbeddingLayer>(config);
  const EmbeddingLayer& embed_ref = *embed;
  layers_.push_back(std::move(embed));
  auto shared = checkpointing_ ? std::make_shared<BlockActivations>() : nullptr;
  auto scratch = std::make_shared<BlockScratch>();
  for (int i = 0; i < config.n_layer; ++i)
    layers_.push_back(std::make_unique<BlockLayer>(config, i, shared, scratch));
  layers_.push_back(
      std::make_unique<HeadLayer>(config, embed_ref, shared, shared ? scratch : nullptr));
  for (auto& l : layers_) layout_.add_layer(l->name(), l->param_specs());
  // The LM head is tied to the token embedding: it reads (and writes the gradient of) wte.
  layout_.tie(num_layers() - 1, "transformer.wte.weight");
  ST_ASSERT(layout_.num_parameters() == config.num_parameters());
}

GPT2Model::~GPT2Model() = default;

void GPT2Model::bind(const Tensor& params, const Tensor& grads) {
  ST_ASSERT(params.numel() == layout_.numel());
  ST_ASSERT(grads.empty() || grads.numel() == layout_.numel());
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerRange& r = layout_.layers()[i];
    layers_[i]->bind(r, params.slice1d(r.offset, r.numel),
                     grads.empty() ? Tensor() : grads.slice1d(r.offset, r.numel));
  }
}

void GPT2Model::init_parameters(float* host, uint64_t seed) const {
  const auto tensors = layout_.tensors();
#pragma omp parallel for schedule(dynamic)
  for (size_t k = 0; k < tensors.size(); ++k) {
    const ParamTensor& t = *tensors[k];
    float* p = host + t.offset;
    if (t.init_std == 0.0f) {
      for (int64_t i = 0; i < t.numel; ++i) p[i] = t.init_value;
      continue;
    }
    SplitMix64 rng{seed ^ fnv1a64(t.name)};
    for (int64_t i = 0; i < t.numel; i += 2) {
      // Box–Muller: two independent normals per pair of uniforms.
      const double u1 = 1.0 - rng.uniform(), u2 = rng.uniform();
      const double r = std::sqrt(-2.0 * std::log(u1));
      p[i] = static_cast<float>(t.init_std * r * std::cos(2.0 * std::numbers::pi * u2));
      if (i + 1 < t.numel)
        p[i + 1] = static_cast<float>(t.init_std * r * std::sin(2.0 * std::numbers::pi * u2));
    }
  }
}

void GPT2Model::reserve(int64_t B, int64_t T) {
  const int64_t C = config_.n_embd;
  if (B * T > B_ * T_ || T > T_ || B > B_) {
    residual_.clear();
    // residual_[i]: the input of layer i (1..num_layers()−1); the head has no output.
    for (int i = 0; i < num_layers(); ++i)
      residual_.emplace_back(backend_, backend_.compute_dtype(), i == 0 ? 0 : B * T * C);
    dresid_ = FlatBuffer(backend_, backend_.compute_dtype(), B * T * C);
    tokens_ = FlatBuffer(backend_, DType::kI32, B * T);
    targets_ = FlatBuffer(backend_, DType::kI32, B * T);
    losses_ = FlatBuffer(backend_, DType::kF32, B * T);
    B_ = B;
    T_ = T;
  }
  for (auto& l : layers_) l->reserve(backend_, B, T);
}

double GPT2Model::forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
                          float grad_scale, bool for_backward) {
  check<ConfigError>(T <= config_.n_positions,
                     "sequence length {} exceeds the context of {} ({} positions)", T, config_.name,
                     config_.n_positions);
  reserve(B, T);
  const int64_t C = config_.n_embd;
  ctx_ = StepContext();
  ctx_.B = B;
  ctx_.T = T;
  ctx_.tokens = Tensor(tokens_.data(), DType::kI32, backend_.kind(), {B, T});
  backend_.copy_from_host(tokens_.data(), tokens, static_cast<size_t>(B * T) * sizeof(int32_t));
  if (targets) {
    ctx_.targets = Tensor(targets_.data(), DType::kI32, backend_.kind(), {B, T});
    backend_.copy_from_host(targets_.data(), targets, static_cast<size_t>(B * T) * sizeof(int32_t));
  }
  ctx_.losses = Tensor(losses_.data(), DType::kF32, backend_.kind(), {B * T});
  ctx_.grad_scale = grad_scale;
  ctx_.for_backward = for_backward && targets != nullptr;

  const DType dt = backend_.compute_dtype();
  for (int i = 0; i < num_layers(); ++i) {
    if (hooks_) hooks_->before_forward(i);
    Tensor in =
        i == 0 ? Tensor()
               : Tensor(residual_[static_cast<size_t>(i)].data(), dt, backend_.kind(), {B, T, C});
    Tensor out = i + 1 < num_layers() ? Tensor(residual_[static_cast<size_t>(i) + 1].data(), dt,
                                               backend_.kind(), {B, T, C})
                                      : Tensor();
    layers_[static_cast<size_t>(i)]->forward(backend_, ctx_, in, out);
    if (hooks_) hooks_->after_forward(i);
  }
  if (!targets) return 0.0;
  return backend_.sum(ctx_.losses) / static_cast<double>(B * T);
}

void GPT2Model::backward() {
  ST_ASSERT(ctx_.for_backward);
  const int64_t B = ctx_.B, T = ctx_.T, C = config_.n_embd;
  const DType dt = backend_.compute_dtype();
  Tensor dresid(dresid_.data(), dt, backend_.kind(), {B, T, C});
  for (int i = num_layers() - 1; i >= 0; --i) {
    if (hooks_) hooks_->before_backward(i);
    Tensor in =
        i == 0 ? Tensor()
               : Tensor(residual_[static_cast<size_t>(i)].data(), dt, backend_.kind(), {B, T, C});
    layers_[static_cast<size_t>(i)]->backward(backend_, ctx_, in, dresid);
    if (hooks_) hooks_->after_backward(i);
  }
}

std::vector<float> GPT2Model::logits_at(int64_t b, int64_t t) {
  auto& head = static_cast<HeadLayer&>(*layers_.back());
  return head.logits_row(backend_, b * ctx_.T + t);
}

}  // namespace shardtrain
