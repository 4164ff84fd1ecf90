// Pipeline building blocks of the model, on any backend (tests/model/test_model.cpp on the CPU,
// tests/backend/test_cuda_backend.cpp on the GPU): the split backward (B then W) against the fused one,
// with another micro-batch's slot run in between, and a model cut into two stage parts that
// exchange activations, their gradients and the tied wte gradient by hand.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "core/rng.h"
#include "memory/flat_buffer.h"
#include "model/gpt2.h"

namespace shardtrain::test_support {

/// A model part bound to its own parameters (from `whole_init`, the whole model's fp32 flat
/// init) and zeroed gradients, in the backend's compute dtype.
struct BoundPart {
  BoundPart(const GPT2Config& c, Backend& be, const std::vector<int>& ids,
            const std::vector<float>& whole_init, const ParamLayout& whole)
      : model(c, be, false, ids) {
    const ParamLayout& l = model.layout();
    std::vector<float> init(static_cast<size_t>(l.numel()));
    for (int i = 0; i < l.num_layers(); ++i) {
      const LayerRange& mine = l.layers()[static_cast<size_t>(i)];
      const LayerRange& w = whole.layers()[static_cast<size_t>(ids[static_cast<size_t>(i)])];
      std::copy_n(whole_init.begin() + w.offset, mine.numel, init.begin() + mine.offset);
    }
    FlatBuffer master(be, DType::kF32, l.numel());
    be.copy_from_host(master.data(), init.data(), init.size() * sizeof(float));
    params = FlatBuffer(be, be.compute_dtype(), l.numel());
    grads = FlatBuffer(be, be.compute_dtype(), l.numel());
    be.convert(params.view(), master.view());
    model.bind(params.view(), grads.view());
  }
  GPT2Model model;
  FlatBuffer params, grads;
};

inline std::vector<float> to_host_f32(Backend& be, Tensor t) {
  FlatBuffer f(be, DType::kF32, t.numel());
  be.convert(f.view(), t);
  std::vector<float> out(static_cast<size_t>(t.numel()));
  be.copy_to_host(out.data(), f.data(), f.bytes());
  return out;
}

inline std::vector<int32_t> random_tokens(int64_t n, int vocab, uint64_t seed) {
  SplitMix64 rng{seed};
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab));
  return t;
}

/// The whole model's fused backward against B then W, with a second micro-batch forwarded in
/// slot 2 between the first one's forward and its B, and its W after that: identical gradients
/// (bit for bit: the same GEMMs on the same operands) and losses.
inline void check_split_backward(Backend& be, const GPT2Config& c, int64_t B, int64_t T) {
  std::vector<int> all;
  for (int i = 0; i < c.n_layer + 2; ++i) all.push_back(i);
  GPT2Model shape(c, be);
  std::vector<float> init(static_cast<size_t>(shape.layout().numel()));
  shape.init_parameters(init.data(), 7);
  BoundPart fused(c, be, all, init, shape.layout()), split(c, be, all, init, shape.layout());
  const auto tok = random_tokens(B * T, static_cast<int>(c.vocab_size), 1);
  const auto tgt = random_tokens(B * T, static_cast<int>(c.vocab_size), 2);
  const auto tok2 = random_tokens(B * T, static_cast<int>(c.vocab_size), 3);
  const float scale = 1.0f / static_cast<float>(B * T);
  const double loss = fused.model.forward(tok.data(), tgt.data(), B, T, scale, true);
  fused.model.backward();

  GPT2Model& m = split.model;
  const int n = m.num_layers();
  m.prepare(1, tok.data(), tgt.data(), B, T, scale);
  m.forward_layers(1, 0, n);
  m.prepare(2, tok2.data(), tgt.data(), B, T, scale);  // another micro-batch in flight
  m.forward_layers(2, 0, n);
  m.backward_layers(1, 0, n, BackwardPass::kInput);
  const auto grads_after_b = to_host_f32(be, split.grads.view());
  m.backward_layers(1, 0, n, BackwardPass::kWeight);
  EXPECT_EQ(m.slot_loss(1), loss);
  for (float g : grads_after_b) ASSERT_EQ(g, 0.0f) << "the input-gradient pass wrote a weight grad";
  EXPECT_EQ(to_host_f32(be, split.grads.view()), to_host_f32(be, fused.grads.view()))
      << "B then W differs from the fused backward";
}

/// The model cut after block `cut - 1` into two parts [embed .. block cut-1] and [block cut ..
/// head], run as two pipeline stages by hand (the head reads a copy of wte and its gradient is
/// added to the embedding's): the same loss, and the gradients of the whole model within `tol`
/// relative L2 (wte sums its two parts in another order).
inline void check_stage_parts(Backend& be, const GPT2Config& c, int cut, int64_t B, int64_t T,
                              double tol) {
  GPT2Model whole(c, be);
  std::vector<float> init(static_cast<size_t>(whole.layout().numel()));
  whole.init_parameters(init.data(), 11);
  std::vector<int> all, first, second;
  for (int i = 0; i < c.n_layer + 2; ++i) {
    (i <= cut ? first : second).push_back(i);
    all.push_back(i);
  }
  BoundPart ref(c, be, all, init, whole.layout());
  BoundPart a(c, be, first, init, whole.layout()), b(c, be, second, init, whole.layout());
  const int64_t VC = c.vocab_size * c.n_embd;
  FlatBuffer wte(be, be.compute_dtype(), VC), dwte(be, be.compute_dtype(), VC);
  be.copy(wte.data(), a.model.embedding_weight().data, wte.bytes());
  b.model.set_tied_embedding(
      Tensor(wte.data(), be.compute_dtype(), be.kind(), {c.vocab_size, c.n_embd}),
      Tensor(dwte.data(), be.compute_dtype(), be.kind(), {c.vocab_size, c.n_embd}));

  const auto tok = random_tokens(B * T, static_cast<int>(c.vocab_size), 5);
  const auto tgt = random_tokens(B * T, static_cast<int>(c.vocab_size), 6);
  const float scale = 1.0f / static_cast<float>(B * T);
  const double loss = ref.model.forward(tok.data(), tgt.data(), B, T, scale, true);
  ref.model.backward();

  a.model.prepare(0, tok.data(), nullptr, B, T, scale);
  a.model.forward_layers(0, 0, a.model.num_layers());
  b.model.prepare(0, nullptr, tgt.data(), B, T, scale);
  Tensor act = a.model.activation(0, a.model.num_layers());
  be.copy(b.model.activation(0, 0).data, act.data, act.bytes());
  b.model.forward_layers(0, 0, b.model.num_layers());
  EXPECT_NEAR(b.model.slot_loss(0), loss, 1e-6 * std::abs(loss));
  b.model.backward_layers(0, 0, b.model.num_layers(), BackwardPass::kFull);
  Tensor g = b.model.activation_grad(0);
  be.copy(a.model.activation_grad(0).data, g.data, g.bytes());
  a.model.backward_layers(0, 0, a.model.num_layers(), BackwardPass::kFull);
  Tensor dw = a.model.embedding_weight_grad();
  Tensor received = dw;
  received.data = dwte.data();
  be.add(dw, dw, received);

  // Every tensor of both parts against the whole model's.
  const auto want = to_host_f32(be, ref.grads.view());
  for (BoundPart* p : {&a, &b}) {
    const auto got = to_host_f32(be, p->grads.view());
    for (const ParamTensor* t : p->model.layout().tensors()) {
      const ParamTensor* w = whole.layout().find(t->name);
      ASSERT_NE(w, nullptr) << t->name;
      double num = 0, den = 0;
      for (int64_t i = 0; i < t->numel; ++i) {
        const double x = got[static_cast<size_t>(t->offset + i)];
        const double y = want[static_cast<size_t>(w->offset + i)];
        num += (x - y) * (x - y);
        den += y * y;
      }
      EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), tol) << t->name;
    }
  }
}

}  // namespace shardtrain::test_support
