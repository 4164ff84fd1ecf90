#include "model/gpt2_layers.h"

#include <cmath>
#include <iterator>

#include "core/error.h"

namespace shardtrain {

constexpr float kInitStd = 0.02f;

namespace {

/// A zeroed device allocation of at least `bytes` bytes (untyped memory that views are carved
/// out of).
FlatBuffer byte_buffer(Backend& be, size_t bytes) {
  return FlatBuffer(be, DType::kU16, static_cast<int64_t>((bytes + 1) / 2));
}

/// Bytes of `numel` elements of `dt` rounded up to 64: the pieces carved out of one allocation
/// (BlockActivations, BlockScratch, BlockGradStash) each start 64-byte aligned.
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

Tensor view_of(Backend& be, const Tensor& f, std::initializer_list<int64_t> dims) {
  return Tensor(f.data, f.dtype, be.kind(), dims);
}

/// One value per slot, created on first use.
template <typename T>
class PerSlot {
 public:
  T& at(int slot) {
    if (static_cast<size_t>(slot) >= items_.size()) items_.resize(static_cast<size_t>(slot) + 1);
    auto& p = items_[static_cast<size_t>(slot)];
    if (!p) p = std::make_unique<T>();
    return *p;
  }

 private:
  std::vector<std::unique_ptr<T>> items_;
};

}  // namespace

// ---- embedding -----------------------------------------------------------------------------

namespace {

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
    be.embedding_forward(out, ctx.tokens, wte_, wpe_,
                         ctx.dropout(ctx.embd_pdrop, kEmbeddingDropoutSite));
  }
  void backward(Backend& be, StepContext& ctx, Tensor, Tensor dresid) override {
    be.embedding_backward(dwte_, dwpe_, dresid, ctx.tokens,
                          ctx.dropout(ctx.embd_pdrop, kEmbeddingDropoutSite));
  }
  // The embedding has no input gradient: B is empty and W is its whole backward.
  void backward_input(Backend&, StepContext&, Tensor, Tensor) override {}
  void backward_weight(Backend& be, StepContext& ctx, Tensor in, Tensor dresid) override {
    backward(be, ctx, in, dresid);
  }
  TiedEmbedding views() const { return {&wte_, &dwte_}; }
  /// The backward's position part alone (embedding_backward_positions in gpt2_layers.h).
  void backward_positions(Backend& be, StepContext& ctx, Tensor dresid) {
    const Dropout drop = ctx.dropout(ctx.embd_pdrop, kEmbeddingDropoutSite);
    if (drop.active()) be.dropout_backward(dresid, dresid, drop);
    be.embedding_backward(Tensor(), dwpe_, dresid, ctx.tokens);
  }

 private:
  GPT2Config c_;
  Tensor wte_, wpe_, dwte_, dwpe_;
};

}  // namespace

TiedEmbedding embedding_views(const Layer& embedding) {
  return static_cast<const EmbeddingLayer&>(embedding).views();
}

void embedding_backward_positions(Backend& be, Layer& embedding, StepContext& ctx, Tensor dresid) {
  static_cast<EmbeddingLayer&>(embedding).backward_positions(be, ctx, dresid);
}

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

  /// Own memory for [B_, T_] (blocks without checkpointing, or the owner of the shared set).
  void reserve(Backend& be, const GPT2Config& c, int64_t B_, int64_t T_) {
    if (fits(B_, T_)) return;
    storage = FlatBuffer();
    const size_t bytes = bytes_for(be, c, B_, T_);
    storage = byte_buffer(be, bytes);
    carve(static_cast<char*>(storage.data()), be, c, B_, T_);
  }
};

/// Buffers every block uses only transiently (shared by all blocks and slots).
struct BlockScratch {
  Scratch tmp, d4c, dc, dqkv;
  /// LayerNorm parameter gradients the input-gradient pass computes and discards ([C] each).
  Scratch ln_dw, ln_db;
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

namespace {

/// The output gradients of a block's linear layers and LayerNorms, kept from its input-gradient
/// pass for its weight-gradient pass (one per slot).
struct BlockGradStash {
  FlatBuffer storage;
  Tensor d_fc_proj, d_fc, d_ln2, d_attn_proj, d_qkv,
      d_ln1;  // [N,C] [N,4C] [N,C] [N,C] [N,3C] [N,C]
  int64_t N = 0;

  void reserve(Backend& be, int64_t N_, int64_t C) {
    if (N_ <= N) return;
    const DType dt = be.compute_dtype();
    Tensor* parts[] = {&d_fc_proj, &d_fc, &d_ln2, &d_attn_proj, &d_qkv, &d_ln1};
    constexpr int64_t widths[] = {1, 4, 1, 1, 3, 1};
    size_t bytes = 0;
    for (int64_t w : widths) bytes += piece_bytes(N_ * w * C, dt);
    storage = FlatBuffer();
    storage = byte_buffer(be, bytes);
    size_t used = 0;
    for (size_t i = 0; i < std::size(parts); ++i) {
      *parts[i] =
          Tensor(static_cast<char*>(storage.data()) + used, dt, be.kind(), {N_ * widths[i] * C});
      used += piece_bytes(N_ * widths[i] * C, dt);
    }
    N = N_;
  }
};

class BlockLayer final : public Layer {
 public:
  BlockLayer(const GPT2Config& c, int index, std::shared_ptr<BlockActivations> shared_acts,
             bool owns_shared, std::shared_ptr<BlockScratch> scratch)
      : Layer(fmt::format("block.{}", index)),
        c_(c),
        index_(index),
        checkpointed_(shared_acts != nullptr),
        owns_shared_(owns_shared),
        shared_(std::move(shared_acts)),
        scratch_(std::move(scratch)) {
    use_slot(0);
  }

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

  void use_slot(int slot) override {
    acts_ = checkpointed_ ? shared_.get() : &own_acts_.at(slot);
    stash_ = &stash_slots_.at(slot);
  }

  void reserve(Backend& be, int64_t B, int64_t T) override {
    // Under checkpointing the set is shared: its owner reserves it, or the head places it.
    if (!checkpointed_ || owns_shared_) acts_->reserve(be, c_, B, T);
  }

  void forward(Backend& be, StepContext& ctx, Tensor in, Tensor out) override {
    compute_forward(be, ctx, in, out);
  }

  void backward(Backend& be, StepContext& ctx, Tensor in, Tensor dresid) override {
    recompute_if_checkpointed(be, ctx, in);
    const Grads g = all_grads();
    run_backward(be, ctx, in, dresid, g, nullptr);
  }

  void backward_input(Backend& be, StepContext& ctx, Tensor in, Tensor dresid) override {
    recompute_if_checkpointed(be, ctx, in);
    const int64_t N = ctx.B * ctx.T, C = c_.n_embd;
    stash_->reserve(be, N, C);
    const DType dt = be.compute_dtype();
    Grads g;  // no parameter gradients; LayerNorm's go to discarded scratch
    g.ln_dw = scratch_->ln_dw.get(be, dt, {C});
    g.ln_db = scratch_->ln_db.get(be, dt, {C});
    run_backward(be, ctx, in, dresid, g, stash_);
  }

  void backward_weight(Backend& be, StepContext& ctx, Tensor in, Tensor) override {
    recompute_if_checkpointed(be, ctx, in);
    const int64_t N = ctx.B * ctx.T, C = c_.n_embd;
    const BlockActivations& a = *acts_;
    const BlockGradStash& s = *stash_;
    const auto v = [&](const Tensor& t, int64_t w) { return view_of(be, t, {N, w * C}); };
    // LayerNorm backward also writes an input gradient: into scratch, discarded.
    Tensor discard = scratch_->tmp.get(be, be.compute_dtype(), {N, C});
    be.matmul_backward(Tensor(), g_[kFcProjW], g_[kFcProjB], v(s.d_fc_proj, 1), v(a.fch_gelu, 4),
                       w_[kFcProjW]);
    be.matmul_backward(Tensor(), g_[kFcW], g_[kFcB], v(s.d_fc, 4), v(a.ln2, 1), w_[kFcW]);
    be.layernorm_backward(discard, g_[kLn2W], g_[kLn2B], v(s.d_ln2, 1), v(a.x2, 1), w_[kLn2W],
                          view_of(be, a.ln2_mean, {N}), view_of(be, a.ln2_rstd, {N}));
    be.matmul_backward(Tensor(), g_[kAttnProjW], g_[kAttnProjB], v(s.d_attn_proj, 1), v(a.atty, 1),
                       w_[kAttnProjW]);
    be.matmul_backward(Tensor(), g_[kQkvW], g_[kQkvB], v(s.d_qkv, 3), v(a.ln1, 1), w_[kQkvW]);
    be.layernorm_backward(discard, g_[kLn1W], g_[kLn1B], v(s.d_ln1, 1), in.reshape({N, C}),
                          w_[kLn1W], view_of(be, a.ln1_mean, {N}), view_of(be, a.ln1_rstd, {N}));
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

  /// Where a backward pass accumulates parameter gradients: empty weight/bias gradients skip
  /// them (the input-gradient pass), ln_dw/ln_db override LayerNorm's when set.
  struct Grads {
    Tensor qkv_w, qkv_b, attn_proj_w, attn_proj_b, fc_w, fc_b, fc_proj_w, fc_proj_b;
    Tensor ln1_w, ln1_b, ln2_w, ln2_b, ln_dw, ln_db;
  };
  Grads all_grads() const {
    return {g_[kQkvW], g_[kQkvB],    g_[kAttnProjW], g_[kAttnProjB], g_[kFcW],
            g_[kFcB],  g_[kFcProjW], g_[kFcProjB],   g_[kLn1W],      g_[kLn1B],
            g_[kLn2W], g_[kLn2B],    Tensor(),       Tensor()};
  }

  void recompute_if_checkpointed(Backend& be, StepContext& ctx, Tensor in) {
    if (!checkpointed_) return;
    // Activation checkpointing: recompute this block's activations from its saved input
    // (Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174).
    Tensor discard = scratch_->tmp.get(be, be.compute_dtype(), {ctx.B, ctx.T, c_.n_embd});
    compute_forward(be, ctx, in, discard);
  }

  /// The block's backward: with `stash`, each linear layer's and LayerNorm's output gradient is
  /// written into (or copied to) it for backward_weight().
  void run_backward(Backend& be, StepContext& ctx, Tensor in, Tensor dresid, const Grads& g,
                    BlockGradStash* stash) {
    const int64_t B = ctx.B, T = ctx.T, C = c_.n_embd, N = B * T;
    BlockActivations& a = *acts_;
    const DType dt = be.compute_dtype();
    const auto v = [&](const Tensor& t, int64_t w) { return view_of(be, t, {N, w * C}); };
    Tensor d4c = stash ? v(stash->d_fc, 4) : scratch_->d4c.get(be, dt, {N, 4 * C});
    Tensor dc = scratch_->dc.get(be, dt, {N, C});
    Tensor dln2 = stash ? v(stash->d_ln2, 1) : dc;
    Tensor dln1 = stash ? v(stash->d_ln1, 1) : dc;
    Tensor dqkv = stash ? view_of(be, stash->d_qkv, {B, T, 3 * C})
                        : scratch_->dqkv.get(be, dt, {B, T, 3 * C});
    Tensor dres2 = dresid.reshape({N, C});
    const Tensor ln2_w = g.ln_dw.empty() ? g.ln2_w : g.ln_dw;
    const Tensor ln2_b = g.ln_db.empty() ? g.ln2_b : g.ln_db;
    const Tensor ln1_w = g.ln_dw.empty() ? g.ln1_w : g.ln_dw;
    const Tensor ln1_b = g.ln_db.empty() ? g.ln1_b : g.ln_db;

    const Dropout mlp_drop = ctx.dropout(ctx.resid_pdrop, site(DropoutKind::kMlpResid));
    const Dropout proj_drop = ctx.dropout(ctx.resid_pdrop, site(DropoutKind::kAttnResid));
    const Dropout att_drop = ctx.dropout(ctx.attn_pdrop, site(DropoutKind::kAttnProbs));
    // The gradient of a residual branch's output: dres2, or dres2∘mask/(1-p) under dropout
    // (into the stash for backward_weight, else into scratch).
    const auto branch_grad = [&](const Dropout& d, const Tensor& stashed) {
      if (!d.active()) {
        if (stash) be.copy(stashed.data, dres2.data, dres2.bytes());
        return dres2;
      }
      Tensor dst = stash ? v(stashed, 1) : scratch_->tmp.get(be, dt, {N, C});
      be.dropout_backward(dst, dres2, d);
      return dst;
    };

    // MLP: x3 = x2 + dropout(c_proj(gelu(c_fc(ln_2(x2)))))
    const Tensor dmlp = branch_grad(mlp_drop, stash ? stash->d_fc_proj : Tensor());
    be.matmul_backward(d4c, g.fc_proj_w, g.fc_proj_b, dmlp, v(a.fch_gelu, 4), w_[kFcProjW],
                       v(a.fch, 4));
    be.matmul_backward(dln2, g.fc_w, g.fc_b, d4c, v(a.ln2, 1), w_[kFcW]);
    be.layernorm_backward(dres2, ln2_w, ln2_b, dln2, v(a.x2, 1), w_[kLn2W],
                          view_of(be, a.ln2_mean, {N}), view_of(be, a.ln2_rstd, {N}));
    // Attention: x2 = x + dropout(c_proj(attn(c_attn(ln_1(x))))), attn's probabilities dropped
    const Tensor dproj = branch_grad(proj_drop, stash ? stash->d_attn_proj : Tensor());
    be.matmul_backward(dc, g.attn_proj_w, g.attn_proj_b, dproj, v(a.atty, 1), w_[kAttnProjW]);
    be.attention_backward(dqkv, dc.reshape({B, T, C}), view_of(be, a.qkv, {B, T, 3 * C}),
                          view_of(be, a.atty, {B, T, C}), saved(be, B, T), c_.n_head, att_drop);
    be.matmul_backward(dln1, g.qkv_w, g.qkv_b, dqkv.reshape({N, 3 * C}), v(a.ln1, 1), w_[kQkvW]);
    be.layernorm_backward(dres2, ln1_w, ln1_b, dln1, in.reshape({N, C}), w_[kLn1W],
                          view_of(be, a.ln1_mean, {N}), view_of(be, a.ln1_rstd, {N}));
  }

  uint32_t site(DropoutKind kind) const { return dropout_site(index_, kind); }

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
    const auto v = [&](const Tensor& t, int64_t w) { return view_of(be, t, {N, w * C}); };
    Tensor x = in.reshape({N, C});
    Tensor ln1 = v(a.ln1, 1), qkv = v(a.qkv, 3), atty = v(a.atty, 1);
    Tensor x2 = v(a.x2, 1), ln2 = v(a.ln2, 1);
    Tensor fch = v(a.fch, 4), fch_gelu = v(a.fch_gelu, 4);
    Tensor tmp = scratch_->tmp.get(be, dt, {N, C});
    if (checkpointed_ && tmp.data == out.data) tmp = x2;  // recompute: out is discarded

    be.layernorm_forward(ln1, view_of(be, a.ln1_mean, {N}), view_of(be, a.ln1_rstd, {N}), x,
                         w_[kLn1W], w_[kLn1B]);
    be.matmul_forward(qkv, ln1, w_[kQkvW], w_[kQkvB]);
    be.attention_forward(atty.reshape({B, T, C}), saved(be, B, T), qkv.reshape({B, T, 3 * C}),
                         c_.n_head, ctx.dropout(ctx.attn_pdrop, site(DropoutKind::kAttnProbs)));
    const Dropout proj_drop = ctx.dropout(ctx.resid_pdrop, site(DropoutKind::kAttnResid));
    if (tmp.data == x2.data) {
      be.matmul_forward(x2, atty, w_[kAttnProjW], w_[kAttnProjB]);
      be.add(x2, x, x2, proj_drop);
    } else {
      be.matmul_forward(tmp, atty, w_[kAttnProjW], w_[kAttnProjB]);
      be.add(x2, x, tmp, proj_drop);
    }
    be.layernorm_forward(ln2, view_of(be, a.ln2_mean, {N}), view_of(be, a.ln2_rstd, {N}), x2,
                         w_[kLn2W], w_[kLn2B]);
    be.matmul_forward(fch_gelu, ln2, w_[kFcW], w_[kFcB], Epilogue::kGelu, fch);
    Tensor y = out.reshape({N, C});
    be.matmul_forward(y, fch_gelu, w_[kFcProjW], w_[kFcProjB]);
    be.add(y, x2, y, ctx.dropout(ctx.resid_pdrop, site(DropoutKind::kMlpResid)));
  }

  GPT2Config c_;
  int index_;
  bool checkpointed_, owns_shared_;
  std::shared_ptr<BlockActivations> shared_;
  std::shared_ptr<BlockScratch> scratch_;
  PerSlot<BlockActivations> own_acts_;
  PerSlot<BlockGradStash> stash_slots_;
  BlockActivations* acts_ = nullptr;
  BlockGradStash* stash_ = nullptr;
  Tensor w_[kNumTensors], g_[kNumTensors];
};

// ---- head: ln_f, tied LM head, softmax cross-entropy -------------------------------------------

class HeadLayer final : public Layer {
 public:
  /// `shared_acts`: the blocks' one recomputed set under activation checkpointing when the head
  /// places it (else null); it and the blocks' scratch `block_scratch` are then placed in the
  /// logits' memory: blocks run before the head in forward and after it in backward, so they are
  /// never live at once (with one slot).
  HeadLayer(const GPT2Config& c, TiedEmbedding tied, std::shared_ptr<BlockActivations> shared_acts,
            std::shared_ptr<BlockScratch> block_scratch)
      : Layer("head"),
        c_(c),
        tied_(tied),
        shared_acts_(std::move(shared_acts)),
        block_scratch_(std::move(block_scratch)) {
    use_slot(0);
  }

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
  void use_slot(int slot) override { s_ = &slots_.at(slot); }

  void reserve(Backend& be, int64_t B, int64_t T) override {
    const int64_t N = B * T;
    Slot& s = *s_;
    if (N <= s.N && (!shared_acts_ || shared_acts_->fits(B, T))) return;
    const DType dt = be.compute_dtype();
    s.lnf = FlatBuffer(be, dt, N * c_.n_embd);
    s.mean = FlatBuffer(be, DType::kF32, N);
    s.rstd = FlatBuffer(be, DType::kF32, N);
    Vp_ = be.padded_columns(c_.vocab_size);
    const size_t logits_bytes = static_cast<size_t>(N * Vp_) * dtype_size(dt);
    const size_t set_bytes = shared_acts_ ? BlockActivations::bytes_for(be, c_, B, T) : 0;
    const size_t shared_bytes =
        shared_acts_ ? set_bytes + BlockScratch::bytes_for(dt, N, c_.n_embd) : size_t{0};
    s.logits_mem = FlatBuffer();
    s.logits_mem = byte_buffer(be, std::max(logits_bytes, shared_bytes));
    s.logits = Tensor(s.logits_mem.data(), dt, be.kind(), {N * Vp_});
    if (shared_acts_) {
      char* base = static_cast<char*>(s.logits_mem.data());
      shared_acts_->carve(base, be, c_, B, T);
      block_scratch_->place(base + set_bytes, dt, N, c_.n_embd);
    }
    s.N = N;
  }
  void forward(Backend& be, StepContext& ctx, Tensor in, Tensor) override {
    const int64_t N = ctx.B * ctx.T, C = c_.n_embd, V = c_.vocab_size;
    Slot& s = *s_;
    Tensor lnf = view(be, s.lnf, {N, C});
    Tensor logits(s.logits.data, s.logits.dtype, be.kind(), {N, Vp_});  // rows padded: Vp_ ≥ V
    be.layernorm_forward(lnf, view(be, s.mean, {N}), view(be, s.rstd, {N}), in.reshape({N, C}),
                         lnw_, lnb_);
    be.matmul_forward(logits, lnf, *tied_.wte, Tensor());
    if (ctx.targets.empty()) return;
    Tensor targets = ctx.targets.reshape({N});
    if (ctx.for_backward)
      be.softmax_cross_entropy(ctx.losses, logits, targets, ctx.grad_scale, V);
    else
      be.cross_entropy_forward(ctx.losses, logits, targets, V);
  }
  void backward(Backend& be, StepContext& ctx, Tensor in, Tensor dresid) override {
    run_backward(be, ctx, in, dresid, *tied_.dwte, dlnw_, dlnb_, &scratch_);
  }
  void backward_input(Backend& be, StepContext& ctx, Tensor in, Tensor dresid) override {
    const int64_t C = c_.n_embd;
    const DType dt = be.compute_dtype();
    Slot& s = *s_;
    if (s.dlnf.numel() < ctx.B * ctx.T * C) s.dlnf = FlatBuffer(be, dt, ctx.B * ctx.T * C);
    // dlnf goes to the slot (for backward_weight), ln_f's parameter gradients to discarded scratch.
    run_backward(be, ctx, in, dresid, Tensor(), ln_dw_.get(be, dt, {C}), ln_db_.get(be, dt, {C}),
                 nullptr);
  }
  void backward_weight(Backend& be, StepContext& ctx, Tensor in, Tensor) override {
    const int64_t N = ctx.B * ctx.T, C = c_.n_embd;
    Slot& s = *s_;
    Tensor lnf = view(be, s.lnf, {N, C});
    Tensor dlogits(s.logits.data, s.logits.dtype, be.kind(), {N, Vp_});
    Tensor dlnf = view(be, s.dlnf, {N, C});
    Tensor discard = scratch_.get(be, be.compute_dtype(), {N, C});
    be.matmul_backward(Tensor(), *tied_.dwte, Tensor(), dlogits, lnf, *tied_.wte);
    be.layernorm_backward(discard, dlnw_, dlnb_, dlnf, in.reshape({N, C}), lnw_,
                          view(be, s.mean, {N}), view(be, s.rstd, {N}));
  }
  /// Host copy of the logits row `row` of the last forward in the current slot.
  std::vector<float> logits_row(Backend& be, int64_t row) const {
    std::vector<float> out(static_cast<size_t>(c_.vocab_size));
    Tensor src = s_->logits.slice1d(row * Vp_, c_.vocab_size);
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
  struct Slot {
    FlatBuffer lnf, mean, rstd, logits_mem, dlnf;
    Tensor logits;  ///< [N·Vp_] in logits_mem: rows padded to Vp_ columns for the backend
    int64_t N = 0;
  };

  /// The head's backward into `dresid` (overwritten); the LM head's weight gradient goes to
  /// `dwte` (skipped when empty), ln_f's to dlnw/dlnb. The LM head's input gradient goes to
  /// `scratch` (null: the slot's dlnf, kept for backward_weight).
  void run_backward(Backend& be, StepContext& ctx, Tensor in, Tensor dresid, Tensor dwte,
                    Tensor dlnw, Tensor dlnb, Scratch* scratch) {
    const int64_t N = ctx.B * ctx.T, C = c_.n_embd;
    Slot& s = *s_;
    Tensor lnf = view(be, s.lnf, {N, C});
    Tensor dlogits(s.logits.data, s.logits.dtype, be.kind(), {N, Vp_});
    Tensor dlnf = scratch ? scratch->get(be, be.compute_dtype(), {N, C}) : view(be, s.dlnf, {N, C});
    be.matmul_backward(dlnf, dwte, Tensor(), dlogits, lnf, *tied_.wte);
    // ln_f's backward accumulates into the residual gradient: zero it first.
    be.fill_zero(dresid);
    be.layernorm_backward(dresid.reshape({N, C}), dlnw, dlnb, dlnf, in.reshape({N, C}), lnw_,
                          view(be, s.mean, {N}), view(be, s.rstd, {N}));
  }

  static Tensor view(Backend& be, const FlatBuffer& f, std::initializer_list<int64_t> dims) {
    return Tensor(f.data(), f.dtype(), be.kind(), dims);
  }
  GPT2Config c_;
  TiedEmbedding tied_;
  Tensor lnw_, lnb_, dlnw_, dlnb_;
  std::shared_ptr<BlockActivations> shared_acts_;
  std::shared_ptr<BlockScratch> block_scratch_;
  PerSlot<Slot> slots_;
  Slot* s_ = nullptr;
  Scratch scratch_, ln_dw_, ln_db_;
  int64_t Vp_ = 0;
};

}  // namespace

std::unique_ptr<Layer> LayerFactory::make(int id, bool owns_shared) const {
  if (id == 0) return std::make_unique<EmbeddingLayer>(config);
  if (id <= config.n_layer)
    return std::make_unique<BlockLayer>(config, id - 1, shared, owns_shared, scratch);
  ST_ASSERT(id == config.n_layer + 1);
  return std::make_unique<HeadLayer>(config, tied, head_places_shared ? shared : nullptr,
                                     head_places_shared ? scratch : nullptr);
}

LayerFactory make_layer_factory(const GPT2Config& config, TiedEmbedding tied, bool checkpointing,
                                bool head_places_shared) {
  return LayerFactory{config,
                      tied,
                      checkpointing,
                      head_places_shared,
                      checkpointing ? std::make_shared<BlockActivations>() : nullptr,
                      std::make_shared<BlockScratch>()};
}

std::vector<float> head_logits_row(Backend& be, Layer& head, int64_t row) {
  return static_cast<HeadLayer&>(head).logits_row(be, row);
}

}  // namespace shardtrain
