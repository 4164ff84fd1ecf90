// Parity with Hugging Face transformers: a tiny random GPT-2 saved by transformers
// (tests/fixtures/hf_gpt2_tiny, made by tools/make_hf_fixture.py), loaded through our HF
// safetensors reader, must reproduce transformers' logits and loss on a fixed batch — on the CPU
// (always, in CI) and on the GPU when one is present (fp32 and bf16).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "backend/backend.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "io/atomic_file.h"
#include "model/gpt2.h"

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {

const fs::path kFixture = fs::path(SHARDTRAIN_TEST_FIXTURES) / "hf_gpt2_tiny";

struct Fixture {
  GPT2Config config;
  std::vector<float> params;  // flat layout
  std::vector<int32_t> tokens, targets;
  std::vector<float> logits;  // [B, T, V]
  float loss = 0;
  int64_t B = 0, T = 0;
};

Fixture load_fixture(Backend& be) {
  Fixture f;
  const auto cfg = nlohmann::json::parse(read_file(kFixture / "config.json"));
  f.config.name = "hf-fixture";
  f.config.vocab_size = cfg.at("vocab_size");
  f.config.n_positions = cfg.at("n_positions");
  f.config.n_embd = cfg.at("n_embd");
  f.config.n_layer = cfg.at("n_layer");
  f.config.n_head = cfg.at("n_head");
  GPT2Model layout_only(f.config, be);
  f.params.assign(static_cast<size_t>(layout_only.layout().numel()), 0.0f);
  load_hf_weights(kFixture / "model.safetensors", layout_only.layout(), f.params.data());
  SafetensorsFile expected(kFixture / "expected.safetensors");
  f.B = expected.entry("tokens").shape[0];
  f.T = expected.entry("tokens").shape[1];
  f.tokens.resize(static_cast<size_t>(f.B * f.T));
  f.targets.resize(f.tokens.size());
  f.logits.resize(f.tokens.size() * static_cast<size_t>(f.config.vocab_size));
  expected.read("tokens", f.tokens.data());
  expected.read("targets", f.targets.data());
  expected.read("logits", f.logits.data());
  expected.read("loss", &f.loss);
  return f;
}

/// Runs the forward pass on `be` with parameters in its compute dtype; returns the loss and
/// fills `logits` (host fp32, [B*T, V]).
double forward_on(Backend& be, const Fixture& f, std::vector<float>& logits) {
  GPT2Model model(f.config, be);
  const int64_t n = model.layout().numel();
  FlatBuffer master(be, DType::kF32, n);
  be.copy_from_host(master.data(), f.params.data(), f.params.size() * sizeof(float));
  FlatBuffer compute(be, be.compute_dtype(), n);
  be.convert(compute.view(), master.view());
  model.bind(compute.view(), Tensor());
  const double loss = model.forward(f.tokens.data(), f.targets.data(), f.B, f.T, 1.0f, false);
  logits.clear();
  for (int64_t b = 0; b < f.B; ++b)
    for (int64_t t = 0; t < f.T; ++t) {
      const auto row = model.logits_at(b, t);
      logits.insert(logits.end(), row.begin(), row.end());
    }
  return loss;
}

void expect_parity(Backend& be, double logit_tol, double loss_tol) {
  const Fixture f = load_fixture(be);
  std::vector<float> logits;
  const double loss = forward_on(be, f, logits);
  ASSERT_EQ(logits.size(), f.logits.size());
  double max_diff = 0;
  for (size_t i = 0; i < logits.size(); ++i)
    max_diff = std::max(max_diff, static_cast<double>(std::abs(logits[i] - f.logits[i])));
  EXPECT_LT(max_diff, logit_tol) << "largest logit difference against transformers";
  EXPECT_NEAR(loss, f.loss, loss_tol);
}

}  // namespace

TEST(HuggingFaceParity, FixtureIsPresent) {
  for (const char* name : {"config.json", "model.safetensors", "expected.safetensors"})
    EXPECT_TRUE(fs::exists(kFixture / name))
        << (kFixture / name) << " is missing: run tools/make_hf_fixture.py";
}

TEST(HuggingFaceParity, CpuForwardMatchesTransformers) {
  auto be = make_cpu_backend();
  // fp32 throughout on both sides; differences are summation order only.
  expect_parity(*be, 1e-4, 1e-5);
}

TEST(HuggingFaceParity, CudaForwardMatchesTransformers) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  auto fp32 = make_cuda_backend(0, DType::kF32);
  expect_parity(*fp32, 1e-3, 1e-4);  // fp32 (no TF32) GEMMs and kernels: order-level differences
  auto bf16 = make_cuda_backend(0, DType::kBF16);
  expect_parity(*bf16, 0.1, 2e-2);  // bf16 weights/activations: ~3 significant digits
}
