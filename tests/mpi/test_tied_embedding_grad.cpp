// dp's tied-embedding gradient exchange (parallel/tied_embedding_grad.h) under mpirun
// (tests/CMakeLists.txt runs this program with 2 and 4 ranks): on the last micro-step dp
// all-reduces wte's gradient right after the LM head's backward and all-gathers the embedding's
// rows instead of letting the embedding scatter into wte's gradient.
//
// Checked against dp on one rank with the same global batch (the tiny GPT-2 of the strategy
// tests, micro-steps of 8 samples split evenly over the W ranks), with gradient accumulation 1
// and 2:
//  * the gradients after finish_gradients(), all of them and wte's alone, within 1e-6 (‖a−b‖/‖b‖)
//    of W times the reference's (each rank's micro-batch loss is a mean over its B/W samples);
//    the test is shown to be sensitive: dropping the embedding's rows (hooks that take them and
//    throw them away) or counting them twice moves wte's gradient by far more than that;
//  * training through TrainStep (clipping at 0.65): parameters within 1e-6 of the reference;
//  * with dropout (masks differ per rank, so no one-rank reference): the exchange against the
//    whole-bucket path (overlap_comm off) on the same ranks, within 1e-6;
//  * the exchange runs exactly once per optimizer step (the last micro-step), never on one rank
//    or without overlap_comm, and unequal micro-batches across ranks are refused on every rank.
#define OMPI_SKIP_MPICXX 1
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "../tiny_gpt2.h"
#include "backend/backend.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/gpt2.h"
#include "optim/loss_scaler.h"
#include "parallel/strategy.h"
#include "train/strategy_from_config.h"
#include "train/train_step.h"

namespace st = shardtrain;

namespace {

constexpr int64_t kT = 16;
constexpr int64_t kMicroSamples = 8;  ///< samples per micro-step over all ranks
constexpr double kTolerance = 1e-6;
constexpr double kClip = 0.65;
constexpr uint64_t kSeed = 77;

st::GPT2Config tiny_model(float pdrop = 0) {
  st::GPT2Config c = st::test_support::tiny_gpt2("tied-embedding-grad", kT);
  c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = pdrop;
  return c;
}

/// Tokens of sample `s`: T + 1 ids (inputs and shifted targets). Ids below 40 only, so that
/// tokens repeat within and across ranks' micro-batches (rows of one wte row from several ranks).
std::vector<int32_t> sample_tokens(int64_t s) {
  st::SplitMix64 rng{0x7133d000u + static_cast<uint64_t>(s)};
  std::vector<int32_t> out(kT + 1);
  for (auto& t : out) t = static_cast<int32_t>(rng.next() % 40);
  return out;
}

/// Forwards every call to the strategy and counts the hand-offs it accepted.
class CountingHooks final : public st::LayerHooks {
 public:
  explicit CountingHooks(st::LayerHooks& inner) : inner_(inner) {}
  void before_forward(int l) override { inner_.before_forward(l); }
  void after_forward(int l) override { inner_.after_forward(l); }
  void before_backward(int l) override { inner_.before_backward(l); }
  void after_backward(int l) override { inner_.after_backward(l); }
  void between_layers() override { inner_.between_layers(); }
  bool take_tied_embedding_grad(int64_t rows) override {
    const bool take = inner_.take_tied_embedding_grad(rows);
    taken += take ? 1 : 0;
    return take;
  }
  void tied_embedding_grad(st::Tensor dx, st::Tensor tokens) override {
    ++handed;
    inner_.tied_embedding_grad(dx, tokens);
  }
  int taken = 0, handed = 0;

 private:
  st::LayerHooks& inner_;
};

/// Hooks that take the embedding's rows and drop them (or, `twice`, also let them count twice)
/// — what a broken exchange would do; the test must see the difference.
class BrokenHooks final : public st::LayerHooks {
 public:
  BrokenHooks(st::GPT2Model& model, bool twice) : model_(model), twice_(twice) {}
  bool take_tied_embedding_grad(int64_t) override { return true; }
  void tied_embedding_grad(st::Tensor dx, st::Tensor tokens) override {
    if (!twice_) return;
    const int64_t rows = tokens.numel(), C = dx.numel() / rows;
    for (int k = 0; k < 2; ++k)
      model_.backend().embedding_backward(model_.embedding_weight_grad(), st::Tensor(),
                                          dx.reshape({rows, 1, C}), tokens);
  }

 private:
  st::GPT2Model& model_;
  bool twice_;
};

/// One model + dp strategy on one communicator.
struct DpRun {
  DpRun(st::Communicator& c, const std::vector<float>& init, bool overlap, float pdrop = 0)
      : comm(c), backend(st::make_cpu_backend()), model(tiny_model(pdrop), *backend) {
    st::TrainConfig cfg;
    cfg.strategy = st::StrategyKind::kDataParallel;
    cfg.strategy_name = st::to_string(cfg.strategy);
    cfg.zero.reduce_bucket_size = 10'000;  // several buckets: wte's with wpe only
    cfg.weight_decay = 0.1;
    cfg.gradient_clipping = kClip;
    cfg.plan = st::plan_of(cfg);
    st::StrategyOptions o = st::strategy_options(cfg);
    o.zero.overlap_comm = overlap;
    strategy = st::make_strategy(o, *backend, comm);
    strategy->setup(model, init);
    counting = std::make_unique<CountingHooks>(*strategy);
    model.set_hooks(counting.get());
  }

  /// The micro-batch k of optimizer step `step`: this rank's share of the global micro-batch.
  void micro_batch(int64_t step, int64_t accum, int64_t k, std::vector<int32_t>& tokens,
                   std::vector<int32_t>& targets) const {
    const int W = comm.world_size(), r = comm.rank();
    const int64_t B = kMicroSamples / W;
    tokens.resize(static_cast<size_t>(B * kT));
    targets.resize(tokens.size());
    for (int64_t i = 0; i < B; ++i) {
      const auto s = sample_tokens((step * accum + k) * kMicroSamples + r * B + i);
      std::copy(s.begin(), s.end() - 1, tokens.begin() + i * kT);
      std::copy(s.begin() + 1, s.end(), targets.begin() + i * kT);
    }
  }

  /// The gradients of step 0 after finish_gradients() (the flat buffer, host copy): TrainStep's
  /// sequence without the update.
  std::vector<float> gradients(int64_t accum) {
    std::vector<int32_t> tokens, targets;
    strategy->zero_grad();
    for (int64_t k = 0; k < accum; ++k) {
      micro_batch(0, accum, k, tokens, targets);
      const int64_t B = static_cast<int64_t>(tokens.size()) / kT;
      strategy->begin_micro_step(k, accum);
      model.forward(tokens.data(), targets.data(), B, kT, 1.0f / static_cast<float>(B * kT * accum),
                    true, st::micro_batch_dropout_seed(kSeed, comm.rank(), 0, k));
      model.backward();
    }
    strategy->finish_gradients();
    return flat_gradients();
  }

  /// The whole flat gradient buffer: wte is the layout's first tensor, so its gradient's address
  /// is the buffer's.
  std::vector<float> flat_gradients() {
    EXPECT_EQ(model.layout().layers().front().tensors.front().offset, 0);
    std::vector<float> g(static_cast<size_t>(model.layout().numel()));
    backend->copy_to_host(g.data(), model.embedding_weight_grad().data, g.size() * sizeof(float));
    return g;
  }

  /// `count` optimizer steps through TrainStep; returns the parameters.
  std::vector<float> train(int64_t accum, int64_t count) {
    st::TrainStep step(model, *strategy, comm, *backend, scaler,
                       st::TrainStepOptions{accum, kClip, kSeed});
    std::vector<int32_t> tokens, targets;
    for (int64_t s = 0; s < count; ++s) {
      const st::MicroBatchSource batch = [&](int64_t k) {
        micro_batch(s, accum, k, tokens, targets);
        return st::MicroBatch{tokens.data(), targets.data(),
                              static_cast<int64_t>(tokens.size()) / kT, kT};
      };
      step.run(s, 6e-4, batch);
    }
    return strategy->gather_state().params;
  }

  st::Communicator& comm;
  std::unique_ptr<st::Backend> backend;
  st::GPT2Model model;
  st::LossScaler scaler{st::LossScaleConfig{}, false};
  std::unique_ptr<st::Strategy> strategy;
  std::unique_ptr<CountingHooks> counting;
};

/// ‖a − s·b‖ / ‖s·b‖ over [begin, end).
double rel_diff(const std::vector<float>& a, const std::vector<float>& b, double s, size_t begin,
                size_t end) {
  double num = 0, den = 0;
  for (size_t i = begin; i < end; ++i) {
    const double y = s * b[i];
    num += (a[i] - y) * (a[i] - y);
    den += y * y;
  }
  return std::sqrt(num / den);
}

class TiedEmbeddingGrad : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = st::make_mpi_communicator();
    local = st::make_local_communicator();
    auto backend = st::make_cpu_backend();
    st::GPT2Model m(tiny_model(), *backend);
    init.resize(static_cast<size_t>(m.layout().numel()));
    m.init_parameters(init.data(), 4321);
    wte_numel = static_cast<size_t>(m.layout().layers().front().tensors.front().numel);
  }
  int world() const { return comm->world_size(); }
  void report(const std::string& what, double value) const {
    if (comm->rank() == 0) std::printf("  %-60s %.2e\n", what.c_str(), value);
  }

  std::unique_ptr<st::Communicator> comm, local;
  std::vector<float> init;
  size_t wte_numel = 0;
};

TEST_F(TiedEmbeddingGrad, GradientsMatchOneRank) {
  for (int64_t accum : {1, 2}) {
    DpRun ref(*local, init, true);
    const std::vector<float> want = ref.gradients(accum);
    EXPECT_EQ(ref.counting->taken, 0) << "one rank keeps the whole-bucket path";

    DpRun run(*comm, init, true);
    const std::vector<float> got = run.gradients(accum);
    EXPECT_EQ(run.counting->taken, 1) << "once per step, on the last micro-step";
    EXPECT_EQ(run.counting->handed, 1);
    const double all = rel_diff(got, want, world(), 0, got.size());
    const double wte = rel_diff(got, want, world(), 0, wte_numel);
    report(fmt::format("accumulation {}: all gradients vs one rank", accum), all);
    report(fmt::format("accumulation {}: wte's gradient vs one rank", accum), wte);
    EXPECT_LE(all, kTolerance) << "accumulation " << accum;
    EXPECT_LE(wte, kTolerance) << "accumulation " << accum;

    // The comparison sees an exchange that drops the embedding's rows or counts them twice.
    for (bool twice : {false, true}) {
      DpRun broken(*local, init, true);
      BrokenHooks hooks(broken.model, twice);
      broken.model.set_hooks(&hooks);
      const std::vector<float> bad = broken.gradients(accum);
      const double d = rel_diff(bad, want, 1.0, 0, wte_numel);
      report(fmt::format("accumulation {}: wte's gradient with the rows {}", accum,
                         twice ? "counted twice" : "dropped"),
             d);
      EXPECT_GT(d, 1e3 * kTolerance);
    }
  }
}

TEST_F(TiedEmbeddingGrad, TrainingMatchesOneRank) {
  for (int64_t accum : {1, 2}) {
    DpRun ref(*local, init, true);
    const std::vector<float> want = ref.train(accum, 3);
    DpRun run(*comm, init, true);
    const std::vector<float> got = run.train(accum, 3);
    EXPECT_EQ(run.counting->taken, 3);
    const double d = rel_diff(got, want, 1.0, 0, got.size());
    report(fmt::format("accumulation {}: parameters after 3 steps vs one rank", accum), d);
    EXPECT_LE(d, kTolerance) << "accumulation " << accum;
  }
}

TEST_F(TiedEmbeddingGrad, MatchesWholeBucketPathWithDropout) {
  for (int64_t accum : {1, 2}) {
    DpRun old_path(*comm, init, /*overlap=*/false, 0.1f);
    const std::vector<float> want = old_path.gradients(accum);
    EXPECT_EQ(old_path.counting->taken, 0) << "overlap_comm off keeps the whole-bucket path";
    DpRun run(*comm, init, true, 0.1f);
    const std::vector<float> got = run.gradients(accum);
    EXPECT_EQ(run.counting->taken, 1);
    const double d = rel_diff(got, want, 1.0, 0, got.size());
    report(fmt::format("accumulation {}, dropout 0.1: gradients vs overlap_comm off", accum), d);
    EXPECT_LE(d, kTolerance) << "accumulation " << accum;
  }
}

TEST_F(TiedEmbeddingGrad, UnequalMicroBatchesAreRefused) {
  DpRun run(*comm, init, true);
  const int64_t B = 1 + comm->rank() % 2;  // ranks 0, 2: 1 sample; ranks 1, 3: 2
  std::vector<int32_t> tokens(static_cast<size_t>(B * kT), 3), targets(tokens.size(), 5);
  run.strategy->zero_grad();
  run.strategy->begin_micro_step(0, 1);
  run.model.forward(tokens.data(), targets.data(), B, kT, 1.0f, true);
  EXPECT_THROW(run.model.backward(), st::RuntimeFailure);
}

}  // namespace
