// dp, zero1 and zero2 under mpirun (tests/CMakeLists.txt runs this program with 2 and 4 ranks)
// against a single-process reference: "on CPU with 2 and 4 MPI ranks, dp, zero1
// and zero2 reach the same parameters after N steps as one rank with the same global batch (fp32,
// ≤ 1e-6 relative, including parameter counts that do not divide evenly by the rank count)", and
// checkpoints (FullState) moving between rank counts and strategies.
//
// Setup: a tiny GPT-2 (2 layers, 27 channels, 3 heads, vocabulary 97, T = 16) with 21,303
// parameters, odd, so that neither 2 nor 4 ranks divide it, and buckets that need padding. Every
// optimizer step takes a global batch of 16 samples: 2 micro-steps (gradient accumulation) of 8
// samples, split evenly over the W ranks (8/W each, in rank order, as DistributedSampler does).
// The reference is data parallelism on one rank (LocalCommunicator) with micro-batches of 8, run
// on every rank. The step is the trainer's own (train/train_step.h, TrainStep): zero_grad,
// begin_micro_step, forward/backward, finish_gradients, grad_norm, clipping (at 0.65), step.
//
// Measure (the bar): ‖a − b‖ / ‖b‖ ≤ 1e-6 over all parameters, b the reference. Also: every
// element within 0.1·lr of the reference (an element that missed an update is ~lr off), the
// gradient norm of every step and the loss of the final model on held-out data within 1e-6
// relative, and AdamW's m and v within 1e-5 (‖a − b‖ / ‖b‖; measured ≤ 1.3e-6). The element-wise
// relative difference |a − b| / max(1e-3, |b|) is printed but not held to 1e-6: no implementation
// that sums in another order than the reference can meet it, because AdamW divides by √v. Elements
// whose true gradient is ~0 (the attention key biases: softmax is invariant to them, so their
// gradient is exactly zero and what is computed is rounding noise; a GELU unit that is nearly off)
// get updates lr·g/(|g| + eps) that differ by up to ~1% of lr between summation orders. Measured
// with dp on 4 ranks: ‖a − b‖/‖b‖ = 4.4e-7 after the first step and flat afterwards, the
// element-wise measure ~5e-4. The learning rate is the trainer's default (6e-4); at 2e-3, dp itself
// exceeds 1e-6.
//
// Every rank runs every test in the same order (collectives must match). Rank 0 prints the usual
// GoogleTest report; the other ranks print only their failures. The exit status is the worst over
// all ranks.
#define OMPI_SKIP_MPICXX 1
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../tiny_gpt2.h"
#include "backend/backend.h"
#include "checkpoint/sharded_checkpoint.h"
#include "comm/communicator.h"
#include "core/rng.h"
#include "model/gpt2.h"
#include "mpi_test_support.h"
#include "optim/loss_scaler.h"
#include "parallel/buckets.h"
#include "parallel/strategy.h"
#include "parallel/zero3.h"
#include "train/strategy_from_config.h"
#include "train/train_step.h"

namespace st = shardtrain;

namespace {

constexpr int64_t kT = 16;
constexpr int64_t kAccum = 2;
constexpr int64_t kMicroSamples = 8;                 ///< samples per micro-step over all ranks
constexpr int64_t kGlobal = kMicroSamples * kAccum;  ///< samples per optimizer step
constexpr int64_t kSteps = 5;                        ///< steps before the "checkpoint"
constexpr int64_t kMore = 2;                         ///< steps after it
constexpr double kTolerance = 1e-6;
constexpr double kClip = 0.65;  ///< gradient clipping: some steps of the reference clip, some not

st::GPT2Config tiny_model() { return st::test_support::tiny_gpt2("zero-equivalence", kT); }

/// Tokens of sample `s`: T + 1 ids (inputs and shifted targets), deterministic.
std::vector<int32_t> sample_tokens(int64_t s) {
  st::SplitMix64 rng{0x5eed0000u + static_cast<uint64_t>(s)};
  std::vector<int32_t> out(kT + 1);
  for (auto& t : out) t = static_cast<int32_t>(rng.next() % 97);
  return out;
}

/// A learnable sample: a random start, then t[i + 1] = (7·t[i] + 3) mod 97 (a bigram the model
/// can learn, so that the loss falls far below the uniform entropy ln 97).
std::vector<int32_t> pattern_tokens(int64_t s) {
  st::SplitMix64 rng{0x7a77e700u + static_cast<uint64_t>(s)};
  std::vector<int32_t> out(kT + 1);
  out[0] = static_cast<int32_t>(rng.next() % 97);
  for (size_t i = 1; i < out.size(); ++i) out[i] = (7 * out[i - 1] + 3) % 97;
  return out;
}

constexpr double kLr = 6e-4;  ///< TrainConfig's default
double learning_rate(int64_t step) { return kLr * (1.0 - 0.05 * static_cast<double>(step)); }

st::TrainConfig config(st::StrategyKind kind, int64_t reduce_bucket) {
  st::TrainConfig cfg;
  cfg.strategy = kind;
  cfg.strategy_name = st::to_string(kind);
  cfg.zero.stage = st::zero_stage_of(kind);
  cfg.zero.reduce_bucket_size = reduce_bucket;
  cfg.zero.allgather_bucket_size = 4000;  // several all-gathers in flight, and some waits
  cfg.weight_decay = 0.1;
  cfg.gradient_clipping = kClip;
  cfg.plan = st::plan_of(cfg);
  return cfg;
}

/// One model + strategy on one communicator.
struct Trainee {
  Trainee(st::StrategyKind kind, st::Communicator& c, int64_t reduce_bucket,
          const std::vector<float>& init)
      : Trainee(st::strategy_options(config(kind, reduce_bucket)), c, init) {}
  Trainee(const st::StrategyOptions& options, st::Communicator& c, const std::vector<float>& init,
          bool activation_checkpointing = false)
      : comm(c),
        backend(st::make_cpu_backend()),
        model(tiny_model(), *backend, activation_checkpointing) {
    strategy = st::make_strategy(options, *backend, comm);
    strategy->setup(model, init);
  }

  /// Optimizer steps [first, first + count) with the global batches of those steps, through the
  /// trainer's TrainStep; at learning_rate(step), or at `fixed_lr` when given.
  void train(int64_t first, int64_t count, std::optional<double> fixed_lr = std::nullopt) {
    const int W = comm.world_size(), r = comm.rank();
    const int64_t B = kMicroSamples / W;
    std::vector<int32_t> tokens(static_cast<size_t>(B * kT)), targets(tokens.size());
    st::TrainStep train_step(model, *strategy, comm, *backend, scaler,
                             st::TrainStepOptions{kAccum, clip, 0, forward_group, speculative});
    for (int64_t step = first; step < first + count; ++step) {
      const st::MicroBatchSource batch = [&](int64_t k) {
        for (int64_t i = 0; i < B; ++i) {
          const auto s = data(step * kGlobal + k * kMicroSamples + r * B + i);
          std::copy(s.begin(), s.end() - 1, tokens.begin() + i * kT);
          std::copy(s.begin() + 1, s.end(), targets.begin() + i * kT);
        }
        return st::MicroBatch{tokens.data(), targets.data(), B, kT};
      };
      const st::StepResult res =
          train_step.run(step, fixed_lr.value_or(learning_rate(step)), batch);
      norms.push_back(res.grad_norm);
      losses.push_back(res.loss);
    }
  }

  /// Mean loss of the model as bound (every rank's full parameters) on a fixed held-out batch.
  double eval_loss() {
    const int64_t B = 4;
    std::vector<int32_t> tokens(static_cast<size_t>(B * kT)), targets(tokens.size());
    for (int64_t i = 0; i < B; ++i) {
      const auto s = sample_tokens(1'000'000 + i);
      std::copy(s.begin(), s.end() - 1, tokens.begin() + i * kT);
      std::copy(s.begin() + 1, s.end(), targets.begin() + i * kT);
    }
    return model.forward(tokens.data(), targets.data(), B, kT, 1.0f, false);
  }

  st::Communicator& comm;
  std::unique_ptr<st::Backend> backend;
  st::GPT2Model model;
  st::LossScaler scaler{st::LossScaleConfig{}, false};  ///< disabled (fp32): scale 1
  std::unique_ptr<st::Strategy> strategy;
  std::vector<double> norms;
  std::vector<double> losses;  ///< per step, mean over the global batch (TrainStep)
  /// The samples trained on (sample_tokens: uniform random tokens).
  std::vector<int32_t> (*data)(int64_t) = sample_tokens;
  /// TrainStepOptions::forward_group: micro-batches whose forward runs layer-major.
  int64_t forward_group = 1;
  double clip = kClip;       ///< TrainStepOptions::gradient_clipping
  bool speculative = false;  ///< TrainStepOptions::speculative_update
};

struct Diff {
  double max_rel = 0;   ///< max |a - b| / max(1e-3, |b|)
  double max_abs = 0;   ///< max |a - b|
  double norm_rel = 0;  ///< ‖a - b‖ / ‖b‖
};

Diff compare(const std::vector<float>& a, const std::vector<float>& ref) {
  Diff d;
  EXPECT_EQ(a.size(), ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), ref.size()); ++i) {
    const double x = a[i], y = ref[i];
    d.max_rel = std::max(d.max_rel, std::fabs(x - y) / std::max(1e-3, std::fabs(y)));
    d.max_abs = std::max(d.max_abs, std::fabs(x - y));
    num += (x - y) * (x - y);
    den += y * y;
  }
  d.norm_rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return d;
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(1e-12, std::fabs(b)); }

/// Element k of the weights the delayed update's step s (0-based) computed its gradient at:
/// W(s-1), i.e. w[s-1].
float at_params(const std::vector<st::FullState>& w, int64_t s, size_t k) {
  return w[static_cast<size_t>(s - 1)].params[k];
}

/// The single-rank reference: dp with micro-batches of 8, its state after kSteps and after
/// kSteps + kMore steps, and its per-step gradient norms. Computed once per process.
struct Reference {
  std::vector<float> init;
  st::FullState at_checkpoint, at_end;
  std::vector<double> norms;
  std::vector<double> losses;
  double eval_at_checkpoint = 0;
};

const Reference& reference() {
  static const Reference ref = [] {
    Reference r;
    auto backend = st::make_cpu_backend();
    st::GPT2Model m(tiny_model(), *backend);
    r.init.resize(static_cast<size_t>(m.layout().numel()));
    m.init_parameters(r.init.data(), 1234);
    auto local = st::make_local_communicator();
    Trainee run(st::StrategyKind::kDataParallel, *local, 500'000'000, r.init);
    run.train(0, kSteps);
    r.at_checkpoint = run.strategy->gather_state();
    r.eval_at_checkpoint = run.eval_loss();
    run.train(kSteps, kMore);
    r.at_end = run.strategy->gather_state();
    r.norms = run.norms;
    r.losses = run.losses;
    return r;
  }();
  return ref;
}

class ZeroEquivalence : public ::testing::Test {
 protected:
  void SetUp() override { comm = st::make_mpi_communicator(); }
  int rank() const { return comm->rank(); }
  int world() const { return comm->world_size(); }

  /// Checks a state against the reference's and reports the differences (rank 0 prints).
  void expect_state(const std::string& what, const st::FullState& s, const st::FullState& ref) {
    const Diff p = compare(s.params, ref.params);
    const Diff m = compare(s.exp_avg, ref.exp_avg);
    const Diff v = compare(s.exp_avg_sq, ref.exp_avg_sq);
    if (rank() == 0)
      std::printf(
          "  %-46s params: ‖a−b‖/‖b‖ %.2e, max |a−b| %.2e, max element rel %.2e | m %.2e "
          "| v %.2e\n",
          what.c_str(), p.norm_rel, p.max_abs, p.max_rel, m.norm_rel, v.norm_rel);
    EXPECT_LE(p.norm_rel, kTolerance) << what;
    EXPECT_LE(p.max_abs, 0.1 * kLr) << what;
    EXPECT_LE(m.norm_rel, 1e-5) << what;
    EXPECT_LE(v.norm_rel, 1e-5) << what;
    EXPECT_EQ(s.optimizer_steps, ref.optimizer_steps) << what;
  }

  /// Trains `run` for kSteps and checks its gradient norms, state and held-out loss against the
  /// reference's.
  void train_and_expect_reference(const std::string& what, Trainee& run) {
    const Reference& ref = reference();
    run.train(0, kSteps);
    for (int64_t s = 0; s < kSteps; ++s) {
      EXPECT_LE(rel(run.norms[static_cast<size_t>(s)], ref.norms[static_cast<size_t>(s)]),
                kTolerance)
          << what << ": gradient norm of step " << s;
      // The step's loss is the global batch's on every rank, not this rank's share.
      EXPECT_LE(rel(run.losses[static_cast<size_t>(s)], ref.losses[static_cast<size_t>(s)]),
                kTolerance)
          << what << ": loss of step " << s;
    }
    expect_state(what, run.strategy->gather_state(), ref.at_checkpoint);
    // Every rank's model is bound to the updated full parameters (all-gathered).
    EXPECT_LE(rel(run.eval_loss(), ref.eval_at_checkpoint), kTolerance) << what;
  }

  std::unique_ptr<st::Communicator> comm;
};

TEST_F(ZeroEquivalence, ParameterCountNeedsPadding) {
  const st::GPT2Config c = tiny_model();
  EXPECT_NE(c.num_parameters() % world(), 0) << c.num_parameters();
  auto backend = st::make_cpu_backend();
  st::GPT2Model m(c, *backend);
  for (int64_t bucket_size : {int64_t{10'000}, int64_t{500'000'000}}) {
    const auto buckets = st::build_grad_buckets(m.layout(), bucket_size, m.layout().tied_sources());
    bool padded = false;
    std::vector<int> owners(static_cast<size_t>(m.layout().numel()), 0);
    for (int r = 0; r < world(); ++r) {
      for (const st::BucketPartition& p : st::partition_buckets(buckets, world(), r)) {
        padded |= p.padded != p.bucket.numel;
        EXPECT_EQ(p.padded % (world() * st::ParamLayout::kAlign), 0);
        for (int64_t i = 0; i < p.owned_numel; ++i)
          ++owners[static_cast<size_t>(p.owned_offset + i)];
      }
    }
    EXPECT_TRUE(padded) << "some bucket must need padding at world size " << world();
    // Every element of the flat layout is owned by exactly one rank.
    EXPECT_EQ(std::count(owners.begin(), owners.end(), 1), static_cast<long>(owners.size()));
  }
}

TEST_F(ZeroEquivalence, SameParametersAsOneRank) {
  const Reference& ref = reference();
  if (rank() == 0)
    std::printf(
        "  reference: 1 rank, dp, %lld steps of %lld samples (2 × 8), %lld parameters, "
        "gradient norms %.3f .. %.3f (clipped at %.2f)\n",
        static_cast<long long>(kSteps), static_cast<long long>(kGlobal),
        static_cast<long long>(tiny_model().num_parameters()),
        *std::min_element(ref.norms.begin(), ref.norms.end()),
        *std::max_element(ref.norms.begin(), ref.norms.end()), kClip);
  for (st::StrategyKind kind : {st::StrategyKind::kDataParallel, st::StrategyKind::kZero1,
                                st::StrategyKind::kZero2, st::StrategyKind::kZero3}) {
    for (int64_t bucket : {int64_t{10'000}, int64_t{500'000'000}}) {
      const std::string what = fmt::format("{} on {} ranks, reduce_bucket_size {}",
                                           st::to_string(kind), world(), bucket);
      Trainee run(kind, *comm, bucket, ref.init);
      train_and_expect_reference(what, run);
      if (kind != st::StrategyKind::kDataParallel && world() > 1) {
        // Optimizer state partitioned: master weights, m and v of (about) 1/W of the elements.
        Trainee dp(st::StrategyKind::kDataParallel, *comm, bucket, ref.init);
        EXPECT_LT(run.strategy->model_state_bytes(), dp.strategy->model_state_bytes()) << what;
      }
    }
  }
}

/// zero3's options: layers under `persistence` parameters stay replicated; prefetch window and
/// reuse distance in elements (0: no prefetch / release every layer right after use).
st::StrategyOptions zero3_options(int64_t persistence, int64_t prefetch, int64_t reuse) {
  st::StrategyOptions o = st::strategy_options(config(st::StrategyKind::kZero3, 500'000'000));
  o.zero.stage3_param_persistence_threshold = persistence;
  o.zero.stage3_prefetch_bucket_size = prefetch;
  o.zero.stage3_max_reuse_distance = reuse;
  return o;
}

// dp, zero1, zero2 and zero3 summing their gradients hierarchically
// (parallel/hierarchical_reduction.h: dp all-reduces, ZeRO reduce-scatters), the world taken as
// nodes of k consecutive ranks — on 4 ranks 2 nodes × 2 (where ZeRO's chunks are reordered between
// the steps) and 1 × 4 and 4 × 1, on 2 ranks 2 × 1 and 1 × 2 — with buckets whose sizes k does not
// always divide and several buckets in flight at once: the same parameters as one rank.
TEST_F(ZeroEquivalence, HierarchicalReductionMatchesOneRank) {
  const Reference& ref = reference();
  for (st::StrategyKind kind : {st::StrategyKind::kDataParallel, st::StrategyKind::kZero1,
                                st::StrategyKind::kZero2, st::StrategyKind::kZero3}) {
    for (int k = 1; k <= world(); ++k) {
      if (world() % k != 0 || world() == 1) continue;
      for (int64_t bucket : {int64_t{10'001}, int64_t{500'000'000}}) {
        const bool zero3 = kind == st::StrategyKind::kZero3;
        if (zero3 && bucket > 10'001) continue;  // zero3 reduces layer by layer
        st::StrategyOptions o =
            zero3 ? zero3_options(0, 4'000, 0) : st::strategy_options(config(kind, bucket));
        o.hierarchical_ranks_per_node = k;
        o.zero.reduce_bucket_size_set = true;  // several buckets (dp would take DDP's default size)
        const std::string what =
            fmt::format("{}, hierarchical reduction, {} nodes × {} ranks, reduce_bucket_size {}",
                        st::to_string(kind), world() / k, k, bucket);
        Trainee run(o, *comm, ref.init);
        train_and_expect_reference(what, run);
        // Reported for the epoch summary: the bytes sent across nodes in the last step.
        if (world() / k > 1)
          EXPECT_GT(run.strategy->cross_node_bytes_last_step(), 0) << what;
        else
          EXPECT_EQ(run.strategy->cross_node_bytes_last_step(), 0) << what;
      }
    }
  }
}

// The gradients that cross nodes in int8 with per-block scales (ZeRO++'s qgZ): dp's hierarchical
// all-reduce and zero2's and zero3's hierarchical reduce-scatters on 4 ranks as 2 nodes × 2
// (2 ranks: 2 × 1), and zero3 sharded within groups of 2 on 4 ranks (hybrid sharding); 500 steps of
// a learnable pattern at a constant learning rate (the loss falls from ~4.6 to ~0.2): the mean loss
// of the last 50 steps within 1% of the unquantized run's — and not equal to it (the quantization
// acts).
TEST_F(ZeroEquivalence, QuantizedCrossNodeGradientsKeepTheLossCurve) {
  if (world() < 2) GTEST_SKIP() << "needs 2 nodes";
  const Reference& ref = reference();
  const int k = world() / 2;
  constexpr int64_t kLongSteps = 500;
  const std::vector<std::pair<st::StrategyKind, bool>> runs = {
      {st::StrategyKind::kDataParallel, false},
      {st::StrategyKind::kZero2, false},
      {st::StrategyKind::kZero3, false},
      {st::StrategyKind::kZero3, true}};  // (strategy, hybrid sharding)
  for (const auto& [kind, hybrid] : runs) {
    if (hybrid && world() < 4) continue;  // 2 groups of 2
    std::vector<double> last;
    for (const bool quantized : {false, true}) {
      st::StrategyOptions o = kind == st::StrategyKind::kZero3
                                  ? zero3_options(0, 4'000, 0)
                                  : st::strategy_options(config(kind, 10'001));
      o.zero.reduce_bucket_size_set = true;
      if (hybrid)
        o.zero.hpz_partition_size = 2;
      else
        o.hierarchical_ranks_per_node = k;
      o.zero.quantized_gradients = quantized;
      Trainee run(o, *comm, ref.init);
      run.data = pattern_tokens;
      run.train(0, kLongSteps, kLr);
      EXPECT_LT(run.losses.back(), 0.5 * run.losses.front()) << "the model learned the pattern";
      double sum = 0;
      for (int64_t s = kLongSteps - 50; s < kLongSteps; ++s)
        sum += run.losses[static_cast<size_t>(s)];
      last.push_back(sum / 50);
      if (quantized) {
        EXPECT_GT(run.strategy->cross_node_bytes_last_step(), 0);
      }
    }
    const std::string what = hybrid ? std::string("zero3 in 2 groups of 2")
                                    : fmt::format("{}, 2 nodes × {}", st::to_string(kind), k);
    if (rank() == 0)
      std::printf(
          "  %s, 500 steps: mean loss of the last 50 %.5f (fp32 across nodes) vs %.5f "
          "(int8 across nodes), %+.3f%%\n",
          what.c_str(), last[0], last[1], 100.0 * (last[1] - last[0]) / last[0]);
    EXPECT_LE(std::fabs(last[1] - last[0]) / last[0], 0.01) << what;
    EXPECT_NE(last[1], last[0]) << what;
  }
}

// zero3 with hybrid sharding (zero_hpz_partition_size, HSDP): sharded within groups of 2 ranks,
// replicated across groups, the gradient shards summed across the groups — the same parameters
// as one rank, less model state per rank than dp, and a sharded checkpoint (written by the first
// group only) holding the whole state.
TEST_F(ZeroEquivalence, HybridShardingMatchesOneRank) {
  if (world() < 4) GTEST_SKIP() << "2 groups of 2 need 4 ranks";
  const Reference& ref = reference();
  for (const int64_t persistence : {int64_t{0}, int64_t{100'000}}) {
    st::StrategyOptions o = zero3_options(persistence, 4'000, 0);
    o.zero.hpz_partition_size = 2;
    const std::string what = fmt::format(
        "zero3, hybrid sharding in groups of 2 of {} ranks, persistence {}", world(), persistence);
    Trainee run(o, *comm, ref.init);
    train_and_expect_reference(what, run);
    Trainee dp(st::StrategyKind::kDataParallel, *comm, 500'000'000, ref.init);
    EXPECT_LT(run.strategy->model_state_bytes(), dp.strategy->model_state_bytes()) << what;
    EXPECT_GT(run.strategy->cross_node_bytes_last_step(), 0) << what;
    const std::filesystem::path dir = st::test_support::job_temp_dir("shardtrain_hpz");
    st::CheckpointInfo info;
    info.model = run.model.config();
    info.progress.step = kSteps;
    st::save_sharded_checkpoint(dir, "hpz", run.model.layout(), *run.strategy, *comm, info);
    expect_state(
        what + ", its sharded checkpoint",
        st::load_full_state(st::read_checkpoint_info(dir / "hpz"), run.model.layout(), true),
        ref.at_checkpoint);
    comm->barrier();
    if (rank() == 0) std::filesystem::remove_all(dir);
  }
}

// ZeRO-3 with every combination of its options that changes what happens when: persistence off
// (every layer partitioned, the 54-parameter head too) and on (the head and the 3,051-parameter
// embedding replicated), prefetch on (several layers ahead) and off, layers kept between forward
// and backward (reuse distance large) or released and gathered again (0), with and without
// activation checkpointing. All must land on the one-rank dp reference, and each rank must hold
// less model state than zero2 and about 16Ψ/N.
/// A communicator whose all-gathers deliver their data only when waited for (into a buffer of
/// their own until then), as MPI may on a machine where the ranks' progress is truly concurrent:
/// whoever reads an all-gather's output before wait() sees the old contents, every time.
class LateAllGathers final : public st::Communicator {
 public:
  explicit LateAllGathers(st::Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::string backend_name() const override { return inner_.backend_name(); }
  std::unique_ptr<st::Work> all_reduce(st::Tensor t, st::ReduceOp op) override {
    return inner_.all_reduce(t, op);
  }
  std::unique_ptr<st::Work> reduce_scatter(st::Tensor out, st::Tensor in,
                                           st::ReduceOp op) override {
    return inner_.reduce_scatter(out, in, op);
  }
  std::unique_ptr<st::Work> all_gather(st::Tensor output, st::Tensor input) override {
    auto late = std::make_unique<Late>();
    late->output = output;
    late->staging.assign(static_cast<const char*>(output.data),
                         static_cast<const char*>(output.data) + output.bytes());
    const st::Tensor staged(late->staging.data(), output.dtype, output.device, {output.numel()});
    // An in-place input is this rank's slice of `output`: gather from its copy in the staging.
    const auto* own = static_cast<const char*>(output.data) + input.bytes() * rank();
    const st::Tensor from = input.data == own
                                ? st::Tensor(late->staging.data() + input.bytes() * rank(),
                                             input.dtype, input.device, {input.numel()})
                                : input;
    late->inner = inner_.all_gather(staged, from);
    return late;
  }
  std::unique_ptr<st::Work> broadcast(st::Tensor t, int root) override {
    return inner_.broadcast(t, root);
  }
  std::unique_ptr<st::Work> all_to_all(st::Tensor out, st::Tensor in) override {
    return inner_.all_to_all(out, in);
  }
  std::unique_ptr<st::Work> send(st::Tensor t, int peer) override { return inner_.send(t, peer); }
  std::unique_ptr<st::Work> recv(st::Tensor t, int peer) override { return inner_.recv(t, peer); }
  void barrier() override { inner_.barrier(); }
  std::unique_ptr<st::Communicator> split(const std::vector<int>& ranks) override {
    return inner_.split(ranks);
  }

 private:
  struct Late final : st::Work {
    st::Tensor output;
    std::vector<char> staging;
    std::unique_ptr<st::Work> inner;
    bool delivered = false;
    ~Late() override {
      if (!delivered) inner->wait();  // never leave MPI writing into freed staging
    }
    void wait() override {
      if (delivered) return;
      inner->wait();
      std::memcpy(output.data, staging.data(), staging.size());
      delivered = true;
    }
    bool completed() override { return delivered; }
  };
  st::Communicator& inner_;
};

TEST_F(ZeroEquivalence, Zero3WaitsForEveryAllGatherBeforeReadingItsUnit) {
  // Resident units (persistence 5000) are all-gathered by step() while the next forward starts;
  // prefetched units are gathered ahead of their layer. With all-gathers that land only when
  // waited for, any read before the wait sees stale parameters and the run leaves the reference.
  if (world() == 1) GTEST_SKIP() << "one rank gathers nothing";
  const Reference& ref = reference();
  LateAllGathers late(*comm);
  for (const int64_t prefetch : {int64_t{0}, int64_t{4'000}}) {
    Trainee run(zero3_options(5'000, prefetch, 0), late, ref.init);
    train_and_expect_reference(
        fmt::format("zero3 ×{} persistence 5000 prefetch {}, late all-gathers", world(), prefetch),
        run);
  }
}

TEST_F(ZeroEquivalence, Zero3OptionsAllMatchOneRank) {
  const Reference& ref = reference();
  struct Case {
    int64_t persistence, prefetch, reuse;
    bool checkpointing;
  };
  const Case cases[] = {{0, 50'000'000, 1'000'000'000, false},
                        {0, 0, 0, false},
                        {5'000, 4'000, 0, false},
                        {0, 8'000, 20'000, true},
                        {5'000, 0, 1'000'000'000, true}};
  for (const Case& c : cases) {
    const std::string what =
        fmt::format("zero3 ×{} persistence {} prefetch {} reuse {}{}", world(), c.persistence,
                    c.prefetch, c.reuse, c.checkpointing ? " checkpointing" : "");
    Trainee run(zero3_options(c.persistence, c.prefetch, c.reuse), *comm, ref.init,
                c.checkpointing);
    train_and_expect_reference(what, run);
    {
      // The gathered parameters and gradient buffers the strategy held at their peak are what
      // the estimator's replay of the same schedule predicts (parallel/zero3_schedule.h).
      const st::StrategyOptions o = zero3_options(c.persistence, c.prefetch, c.reuse);
      const st::ParamLayout& layout = run.model.layout();
      std::vector<int64_t> padded;
      std::vector<bool> resident;
      for (const auto& l : layout.layers()) {
        int64_t params = 0;
        for (const auto& t : l.tensors) params += t.numel;
        padded.push_back(st::zero_padded_numel(l.numel, world()));
        resident.push_back(world() == 1 || params < c.persistence);
      }
      const st::Zero3Schedule schedule(layout, padded, resident, st::zero3_limits(o));
      const auto peak =
          st::simulate_zero3_pass(layout, schedule, world(), st::kZero3ReductionsInFlight);
      EXPECT_EQ(run.strategy->peak_transient_bytes(),
                static_cast<size_t>(peak.total) * sizeof(float))
          << what;
    }
    if (world() > 1 && c.persistence == 0) {
      Trainee zero2(st::StrategyKind::kZero2, *comm, 500'000'000, ref.init);
      const size_t z3 = run.strategy->model_state_bytes(), z2 = zero2.strategy->model_state_bytes();
      EXPECT_LT(z3, z2) << what;
      // fp32 compute: parameters, gradients and AdamW m and v of the rank's slice of every
      // layer (4 + 4 + 4 + 4 bytes per element, its padding included: each layer is padded to a
      // multiple of W·16 elements).
      const st::ParamLayout& layout = run.model.layout();
      int64_t expected = 0;
      for (const st::BucketPartition& p :
           st::partition_buckets(st::build_grad_buckets(layout, 1), world(), rank()))
        expected += 16 * p.shard;
      EXPECT_EQ(z3, static_cast<size_t>(expected)) << what;
      if (rank() == 0)
        std::printf("  %-58s model states %zu B per rank (zero2 %zu B, 16Ψ/N %lld B)\n",
                    what.c_str(), z3, z2,
                    static_cast<long long>(16 * layout.num_parameters() / world()));
    }
  }
}

// zero_optimization.overlap_comm false: every strategy reduces (and zero3 gathers) only when
// the result is needed, and must reach the same state.
TEST_F(ZeroEquivalence, OverlapCommOffMatchesOneRank) {
  const Reference& ref = reference();
  for (st::StrategyKind kind : {st::StrategyKind::kDataParallel, st::StrategyKind::kZero1,
                                st::StrategyKind::kZero2, st::StrategyKind::kZero3}) {
    st::StrategyOptions o = st::strategy_options(config(kind, 10'000));
    o.zero.overlap_comm = false;
    o.zero.stage3_param_persistence_threshold = 0;
    Trainee run(o, *comm, ref.init);
    run.train(0, kSteps);
    expect_state(fmt::format("{} ×{} overlap_comm false", st::to_string(kind), world()),
                 run.strategy->gather_state(), ref.at_checkpoint);
  }
}

// A FullState saved with N ranks resumes with M ranks and another strategy: 4 (or 2) ranks of
// zero2 → half as many ranks of zero1 (a sub-group) and one rank of dp; one rank of dp → all ranks
// of zero2. Each continues kMore steps and must land on the reference's state.
TEST_F(ZeroEquivalence, CheckpointMovesBetweenRankCounts) {
  const Reference& ref = reference();
  st::FullState saved;
  {
    Trainee zero2(st::StrategyKind::kZero2, *comm, 10'000, ref.init);
    zero2.train(0, kSteps);
    saved = zero2.strategy->gather_state();
  }
  expect_state(fmt::format("saved: zero2 on {} ranks", world()), saved, ref.at_checkpoint);

  // zero1 on half the ranks: two groups of W/2 (MPI sub-communicators) or one rank each.
  std::unique_ptr<st::Communicator> half;
  if (world() >= 4) {
    std::vector<int> group;
    const int h = world() / 2, first = rank() < h ? 0 : h;
    for (int r = first; r < first + h; ++r) group.push_back(r);
    half = comm->split(group);
  } else {
    half = st::make_local_communicator();
  }
  {
    Trainee zero1(st::StrategyKind::kZero1, *half, 10'000, ref.init);
    zero1.strategy->load_state(saved);
    zero1.train(kSteps, kMore);
    expect_state(fmt::format("zero2 ×{} → zero1 ×{}", world(), half->world_size()),
                 zero1.strategy->gather_state(), ref.at_end);
  }
  auto local = st::make_local_communicator();
  {
    Trainee dp(st::StrategyKind::kDataParallel, *local, 500'000'000, ref.init);
    dp.strategy->load_state(saved);
    dp.train(kSteps, kMore);
    expect_state(fmt::format("zero2 ×{} → dp ×1", world()), dp.strategy->gather_state(),
                 ref.at_end);
  }
  {
    Trainee zero3(zero3_options(0, 4'000, 0), *comm, ref.init);
    zero3.strategy->load_state(saved);
    zero3.train(kSteps, kMore);
    expect_state(fmt::format("zero2 ×{} → zero3 ×{}", world(), world()),
                 zero3.strategy->gather_state(), ref.at_end);
  }
  {
    Trainee zero2(st::StrategyKind::kZero2, *comm, 500'000'000, ref.init);
    zero2.strategy->load_state(ref.at_checkpoint);
    zero2.train(kSteps, kMore);
    expect_state(fmt::format("dp ×1 → zero2 ×{}", world()), zero2.strategy->gather_state(),
                 ref.at_end);
  }
}

/// Options of an offloaded plan at ZeRO `stage` (optimizer on `opt`, parameters on `param`).
st::StrategyOptions offload_options(int stage, st::OffloadDevice opt, st::OffloadDevice param,
                                    double ratio, const std::string& nvme_dir = "") {
  st::StrategyOptions o = st::strategy_options(
      config(stage == 3 ? st::StrategyKind::kZero3 : st::StrategyKind::kZero2, 10'000));
  o.plan.zero_stage = stage;
  o.plan.optimizer_offload = opt;
  o.plan.param_offload = param;
  o.plan.optimizer_offload_ratio = ratio;
  o.zero.stage3_param_persistence_threshold = 0;
  o.zero.stage3_prefetch_bucket_size = 4'000;
  o.zero.nvme_path = nvme_dir;
  o.aio.block_size = 8192;  // several requests per range
  o.aio.thread_count = 2;
  return o;
}

/// A temporary directory, removed with its content.
struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/shardtrain-nvme-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string path;
};

// ZeRO-Offload / ZeRO-Infinity: the optimizer stepped on the CPU (all of it, half of it, none of
// it), its state in memory, paged to a swap file, or split between them (max_in_cpu), parameters
// offloaded at stage 3 — each must reach the one-rank reference's state: the CPU AdamW equals the
// device one within fp32 rounding. Offloaded parameters take their gradients in place (no pinned
// gradient buffer), and max_in_cpu moves state from the swap file to memory.
TEST_F(ZeroEquivalence, OffloadMatchesOneRank) {
  using D = st::OffloadDevice;
  TempDir dir;
  struct Case {
    int stage;
    D opt, param;
    double ratio;
    int64_t max_in_cpu = 0;     ///< elements per rank with their optimizer state in memory (NVMe)
    int64_t param_in_cpu = -1;  ///< offload_param.max_in_cpu (-1: all in host memory)
  };
  const auto per_rank = static_cast<int64_t>(reference().init.size()) / world();
  std::map<std::string, st::HostMemory> seen;
  for (const Case& c :
       {Case{1, D::kCpu, D::kNone, 1.0}, Case{2, D::kCpu, D::kNone, 1.0},
        Case{2, D::kCpu, D::kNone, 0.5}, Case{2, D::kCpu, D::kNone, 0.0},
        Case{3, D::kCpu, D::kNone, 1.0}, Case{3, D::kCpu, D::kCpu, 1.0},
        Case{2, D::kNvme, D::kNone, 1.0}, Case{3, D::kNvme, D::kCpu, 0.5},
        Case{3, D::kNvme, D::kCpu, 1.0}, Case{3, D::kNvme, D::kCpu, 1.0, per_rank / 2},
        Case{3, D::kCpu, D::kNvme, 1.0, 0, 0}, Case{3, D::kCpu, D::kNvme, 1.0, 0, per_rank / 3},
        Case{3, D::kNvme, D::kNvme, 1.0, per_rank / 2, per_rank / 3}}) {
    st::StrategyOptions o = offload_options(c.stage, c.opt, c.param, c.ratio, dir.path);
    o.zero.offload_optimizer_max_in_cpu = c.max_in_cpu;
    o.zero.offload_param_max_in_cpu = c.param_in_cpu;
    o.zero.offload_param_buffer_count = 2;  // the fewest: every read waits for a free buffer
    Trainee run(o, *comm, reference().init);
    const st::HostMemory h = run.strategy->host_memory();
    EXPECT_EQ(h.nvme > 0, c.opt == D::kNvme || c.param_in_cpu >= 0);
    EXPECT_EQ(h.pageable > 0, c.ratio > 0);
    const std::string key = fmt::format("{}{}{}", c.stage, st::to_string(c.opt), c.ratio);
    if (c.stage == 3 && c.ratio == 1.0 && c.max_in_cpu == 0) {
      seen[key + st::to_string(c.param)] = h;
      if (c.param == D::kCpu && c.opt == D::kCpu) {
        // Offloaded parameters (2 bytes per element) hold the gradients too: far less pinned
        // memory than the parameters plus a gradient buffer of the same size.
        const st::HostMemory device_params = seen.at("3cpu1none");
        EXPECT_LT(h.pinned, device_params.pinned * 3 / 2)
            << "offloaded parameters and a separate pinned gradient buffer";
      }
    }
    if (c.param_in_cpu == 0) {  // every layer partitioned (no persistence): all paged
      EXPECT_GE(h.nvme, static_cast<size_t>(per_rank) * sizeof(float)) << "parameters paged";
    }
    if (c.max_in_cpu > 0 && c.param_in_cpu < 0) {
      const st::HostMemory all_nvme = seen.at("3nvme1cpu");
      EXPECT_LT(h.nvme, all_nvme.nvme) << "max_in_cpu " << c.max_in_cpu;
      EXPECT_GT(h.nvme, 0u) << "max_in_cpu " << c.max_in_cpu << " of " << per_rank;
      EXPECT_GT(h.pageable, all_nvme.pageable) << "max_in_cpu " << c.max_in_cpu;
    }
    train_and_expect_reference(
        fmt::format("stage {} ×{} optimizer on {} (ratio {}, max_in_cpu {}), parameters on {} "
                    "(max_in_cpu {})",
                    c.stage, world(), st::to_string(c.opt), c.ratio, c.max_in_cpu,
                    st::to_string(c.param), c.param_in_cpu),
        run);
  }
  // The swap files are removed with their strategies.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path));
}

// bf16 moments (offload_optimizer.moments_dtype): the host's m and v in bf16, rounded
// stochastically with bits of (flat index, step). In memory and on NVMe the arithmetic is the same
// (bit for bit); a checkpoint moves the moments as fp32 and back without changing a bit (a resume
// at the same stage continues the run exactly; at stage 3, to fp32 rounding); and the run stays
// near the fp32 reference.
TEST_F(ZeroEquivalence, Bf16MomentsAreExactAcrossPlacementsAndResume) {
  using D = st::OffloadDevice;
  const Reference& ref = reference();
  TempDir dir;
  const auto bf16 = [&](int stage, D opt, D param) {
    st::StrategyOptions o = offload_options(stage, opt, param, 1.0, dir.path);
    o.zero.offload_moments_dtype = "bf16";
    return o;
  };
  Trainee memory(bf16(2, D::kCpu, D::kNone), *comm, ref.init);
  Trainee nvme(bf16(2, D::kNvme, D::kNone), *comm, ref.init);
  memory.train(0, kSteps);
  nvme.train(0, kSteps);
  const st::FullState a = memory.strategy->gather_state(), b = nvme.strategy->gather_state();
  EXPECT_TRUE(a.params == b.params && a.exp_avg == b.exp_avg && a.exp_avg_sq == b.exp_avg_sq)
      << "bf16 moments: memory and NVMe differ";
  // Near the fp32 run: the parameters within 1% of the distance the reference moved them.
  double off = 0, moved = 0;
  for (size_t i = 0; i < a.params.size(); ++i) {
    off += std::pow(double(a.params[i]) - ref.at_checkpoint.params[i], 2);
    moved += std::pow(double(ref.at_checkpoint.params[i]) - ref.init[i], 2);
  }
  if (rank() == 0)
    std::printf("  bf16 moments ×%d: parameters %.2e of the distance moved off the fp32 run\n",
                world(), std::sqrt(off / moved));
  EXPECT_LE(std::sqrt(off / moved), 1e-2);
  // Resume: the saved state loaded into a fresh strategy continues as the run itself does — bit
  // for bit where the arithmetic is the same (stage 2, the state now on NVMe).
  memory.train(kSteps, kMore);
  Trainee resumed(bf16(2, D::kNvme, D::kNone), *comm, {});
  resumed.strategy->load_state(a);
  resumed.train(kSteps, kMore);
  const st::FullState c = memory.strategy->gather_state(), d = resumed.strategy->gather_state();
  EXPECT_TRUE(c.params == d.params && c.exp_avg == d.exp_avg && c.exp_avg_sq == d.exp_avg_sq)
      << "bf16 moments: the resumed run differs";
  // Stage 3 gathers the parameters into other buffers, where the BLAS may sum a GEMM in another
  // order (OpenBLAS's AVX-512 kernels do): the parameters agree to fp32 rounding, and a moment
  // whose fp32 value moved by an ulp may round stochastically to the neighbouring bf16 value.
  Trainee resumed3(bf16(3, D::kNvme, D::kCpu), *comm, {});
  resumed3.strategy->load_state(a);
  resumed3.train(kSteps, kMore);
  expect_state("bf16 moments, resumed at stage 3 on NVMe", resumed3.strategy->gather_state(), c);
}

// The forward group (offload_optimizer.forward_group): the step's micro-batches run their forwards
// layer by layer while an offloaded optimizer's update lands layer by layer; the group being the
// whole step here, their backwards run layer by layer too (all heads, then each layer for all
// micro-batches). The arithmetic of every micro-batch is unchanged, and so is the order in which
// every gradient accumulates but the tied wte's (heads first, then embeddings): the first step's
// losses are the same bit for bit and the state after kSteps equals the one-at-a-time run's to
// fp32 rounding — for the strategies that allow it, with the optimizer on the device, on the CPU
// (all of it, half of it) and on NVMe, with activation checkpointing's recompute sharing buffers.
TEST_F(ZeroEquivalence, ForwardGroupEqualsOneMicroBatchAtATime) {
  using D = st::OffloadDevice;
  TempDir dir;
  struct Case {
    std::string name;
    st::StrategyOptions options;
  };
  std::vector<Case> cases = {
      {"dp", st::strategy_options(config(st::StrategyKind::kDataParallel, 10'000))},
      {"zero1", st::strategy_options(config(st::StrategyKind::kZero1, 10'000))},
      {"zero1 offload", offload_options(1, D::kCpu, D::kNone, 1.0)},
      {"zero2 offload", offload_options(2, D::kCpu, D::kNone, 1.0)},
      {"zero2 offload ratio 0.5", offload_options(2, D::kCpu, D::kNone, 0.5)},
      {"zero2 offload nvme", offload_options(2, D::kNvme, D::kNone, 1.0, dir.path)}};
  for (const Case& c : cases) {
    Trainee one(c.options, *comm, reference().init, /*activation_checkpointing=*/true);
    Trainee grouped(c.options, *comm, reference().init, /*activation_checkpointing=*/true);
    grouped.forward_group = kAccum;
    ASSERT_TRUE(grouped.model.supports_layer_major_forward()) << c.name;
    ASSERT_TRUE(grouped.strategy->allows_layer_major_forward()) << c.name;
    ASSERT_TRUE(grouped.strategy->allows_layer_major_backward()) << c.name;
    one.train(0, kSteps);
    grouped.train(0, kSteps);
    EXPECT_EQ(grouped.losses.front(), one.losses.front()) << c.name;
    const st::FullState a = grouped.strategy->gather_state(), b = one.strategy->gather_state();
    expect_state(c.name + ", forward group vs one at a time", a, b);
    // And both are the reference's run.
    expect_state(c.name + ", forward group", a, reference().at_checkpoint);
  }
  // Stage 3 gathers per micro-step: it declines the group (the step then runs one at a time).
  Trainee z3(offload_options(3, D::kCpu, D::kNone, 1.0), *comm, reference().init, true);
  EXPECT_FALSE(z3.strategy->allows_layer_major_forward());
}

// The speculative update (offload_optimizer.speculative_update): the host starts each part's
// update during the last micro-step's backward, assuming no clipping, and step() validates it.
// Unclipped, it is the same arithmetic: bit for bit the run without speculation, with the
// backward layer-major (forward group = the step) or micro-batch by micro-batch, the optimizer
// all or half on the host, in memory or on NVMe (not speculated), moments fp32 or bf16. With
// clipping (kClip: some steps clip) the speculated parts of a clipped step are rolled back and
// redone: the same run to fp32 rounding (bf16 moments: to bf16 rounding), one rollback per
// clipped step that follows an unclipped one (after a clipped step TrainStep does not speculate).
TEST_F(ZeroEquivalence, SpeculativeUpdateIsTheUpdate) {
  using D = st::OffloadDevice;
  TempDir dir;
  struct Case {
    std::string name;
    st::StrategyOptions options;
    int64_t group;
  };
  st::StrategyOptions bf16 = offload_options(2, D::kCpu, D::kNone, 1.0);
  bf16.zero.offload_moments_dtype = "bf16";
  const std::vector<Case> cases = {
      {"zero1 offload, layer-major", offload_options(1, D::kCpu, D::kNone, 1.0), kAccum},
      {"zero2 offload, layer-major", offload_options(2, D::kCpu, D::kNone, 1.0), kAccum},
      {"zero2 offload, one at a time", offload_options(2, D::kCpu, D::kNone, 1.0), 1},
      {"zero2 offload ratio 0.5", offload_options(2, D::kCpu, D::kNone, 0.5), kAccum},
      {"zero2 offload nvme", offload_options(2, D::kNvme, D::kNone, 1.0, dir.path), kAccum},
      {"zero2 offload bf16 moments", bf16, kAccum}};
  for (const Case& c : cases) {
    for (const double clip : {1e9, kClip}) {
      Trainee plain(c.options, *comm, reference().init, /*activation_checkpointing=*/true);
      Trainee spec(c.options, *comm, reference().init, /*activation_checkpointing=*/true);
      plain.forward_group = spec.forward_group = c.group;
      plain.clip = spec.clip = clip;
      spec.speculative = true;
      plain.train(0, kSteps);
      spec.train(0, kSteps);
      const st::FullState a = spec.strategy->gather_state(), b = plain.strategy->gather_state();
      const int64_t rolled_back = spec.strategy->rolled_back_updates();
      EXPECT_EQ(plain.strategy->rolled_back_updates(), 0) << c.name;
      if (clip > 1e8) {
        EXPECT_EQ(rolled_back, 0) << c.name;
        EXPECT_EQ(spec.losses, plain.losses) << c.name;
        EXPECT_TRUE(a.params == b.params) << c.name << ": parameters differ";
        EXPECT_TRUE(a.exp_avg == b.exp_avg) << c.name << ": m differs";
        EXPECT_TRUE(a.exp_avg_sq == b.exp_avg_sq) << c.name << ": v differs";
        if (rank() == 0) std::printf("  speculative update, %s: bit for bit\n", c.name.c_str());
        continue;
      }
      // A clipped step after an unclipped one was speculated and rolled back; after a clipped
      // one it was not speculated (TrainStep).
      int64_t expected = 0;
      for (size_t s = 0; s < spec.norms.size(); ++s)
        expected += spec.norms[s] > kClip && (s == 0 || spec.norms[s - 1] <= kClip);
      ASSERT_GT(expected, 0) << "no clipped step was speculated: the rollback is not exercised";
      // NVMe state is never speculated: nothing to roll back there.
      if (c.options.plan.optimizer_offload == D::kCpu) {
        EXPECT_EQ(rolled_back, expected) << c.name;
      }
      const std::string what =
          fmt::format("{}, {} of {} steps rolled back", c.name, rolled_back, kSteps);
      if (c.options.moment_dtype() == st::DType::kF32) {
        expect_state(what, a, b);
        continue;
      }
      // bf16 moments are restored to bf16 rounding (0.4%), the noise their stochastic rounding
      // already has; the parameters stay within 1e-4 of the run without speculation.
      const Diff p = compare(a.params, b.params), m = compare(a.exp_avg, b.exp_avg),
                 v = compare(a.exp_avg_sq, b.exp_avg_sq);
      if (rank() == 0)
        std::printf("  %s: params %.2e, m %.2e, v %.2e\n", what.c_str(), p.norm_rel, m.norm_rel,
                    v.norm_rel);
      EXPECT_LE(p.norm_rel, 1e-4) << what;
      EXPECT_LE(m.norm_rel, 1e-2) << what;
      EXPECT_LE(v.norm_rel, 1e-2) << what;
    }
  }
}

// Parameters paged from NVMe take their updates from the CPU optimizer: an optimizer kept partly
// on the GPU (ratio < 1) or the delayed update is refused at set-up, naming the keys.
TEST_F(ZeroEquivalence, ParamPagingRefusesPartialOffloadAndTheDelayedUpdate) {
  using D = st::OffloadDevice;
  TempDir dir;
  st::StrategyOptions o = offload_options(3, D::kCpu, D::kNvme, 0.5, dir.path);
  o.zero.offload_param_max_in_cpu = 0;
  try {
    Trainee run(o, *comm, reference().init);
    ADD_FAILURE() << "ratio 0.5 with paged parameters was accepted";
  } catch (const st::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("offload_param.max_in_cpu"), std::string::npos)
        << e.what();
  }
  o = offload_options(3, D::kCpu, D::kNvme, 1.0, dir.path);
  o.zero.offload_param_max_in_cpu = 0;
  o.zero.offload_delayed_update = true;
  try {
    Trainee run(o, *comm, reference().init);
    ADD_FAILURE() << "the delayed update with paged parameters was accepted";
  } catch (const st::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("delayed_update"), std::string::npos) << e.what();
  }
}

// Resume across offload settings: a state saved by offload (optimizer on the CPU) continues on
// the device (zero2), and one saved there continues in infinity (state on NVMe, parameters
// offloaded); each lands on the reference.
TEST_F(ZeroEquivalence, ResumeAcrossOffloadSettings) {
  using D = st::OffloadDevice;
  const Reference& ref = reference();
  TempDir dir;
  st::FullState saved;
  {
    Trainee offload(offload_options(2, D::kCpu, D::kNone, 1.0), *comm, ref.init);
    offload.train(0, kSteps);
    saved = offload.strategy->gather_state();
  }
  expect_state(fmt::format("saved: offload ×{}", world()), saved, ref.at_checkpoint);
  {
    Trainee zero2(st::StrategyKind::kZero2, *comm, 10'000, ref.init);
    zero2.strategy->load_state(saved);
    zero2.train(kSteps, kMore);
    expect_state(fmt::format("offload ×{} → zero2", world()), zero2.strategy->gather_state(),
                 ref.at_end);
  }
  {
    Trainee infinity(offload_options(3, D::kNvme, D::kCpu, 1.0, dir.path), *comm, {});
    infinity.strategy->load_state(ref.at_checkpoint);
    infinity.train(kSteps, kMore);
    expect_state(fmt::format("zero2 → infinity ×{}", world()), infinity.strategy->gather_state(),
                 ref.at_end);
  }
}

// The delayed parameter update (ZeRO-Offload DPU, arXiv 2101.06840 §4.3) against its recurrence,
// built from one-rank dp steps: steps 1 and 2 are exact; from step 3 on, step s computes its
// gradient at W(s-2) and the update lands on W(s-1): W(s) = W(s-1) - lr·adam(g(W(s-2))). Without
// weight decay the update's direction does not depend on the weights it is applied to, so one dp
// step from W(s-2) (with m, v after s-1 updates) gives W(s) = W(s-1) + (dp's result - W(s-2)).
TEST_F(ZeroEquivalence, DelayedUpdateFollowsItsRecurrence) {
  const Reference& ref = reference();
  st::StrategyOptions o = offload_options(2, st::OffloadDevice::kCpu, st::OffloadDevice::kNone, 1);
  o.optimizer.weight_decay = 0;
  o.zero.offload_delayed_update = true;
  Trainee run(o, *comm, ref.init);
  run.train(0, kSteps);
  const st::FullState got = run.strategy->gather_state();

  // The recurrence, on one rank.
  st::StrategyOptions d =
      st::strategy_options(config(st::StrategyKind::kDataParallel, 500'000'000));
  d.optimizer.weight_decay = 0;
  auto local = st::make_local_communicator();
  Trainee dp(d, *local, ref.init);
  std::vector<st::FullState> w;  // w[k] = state after k updates
  w.push_back(dp.strategy->gather_state());
  std::vector<double> losses;
  for (int64_t s = 0; s < kSteps; ++s) {
    if (s >= 2) {  // gradient at W(s-1) (0-based step s computes at W(s-1) for step s+1)
      st::FullState at = w[static_cast<size_t>(s - 1)];
      at.exp_avg = w.back().exp_avg;
      at.exp_avg_sq = w.back().exp_avg_sq;
      at.optimizer_steps = w.back().optimizer_steps;
      dp.strategy->load_state(at);
    }
    dp.train(s, 1);
    st::FullState next = dp.strategy->gather_state();
    if (s >= 2)
      for (size_t k = 0; k < next.params.size(); ++k)
        next.params[k] = w.back().params[k] + (next.params[k] - at_params(w, s, k));
    dp.strategy->load_state(next);
    w.push_back(next);
  }
  for (int64_t s = 0; s < kSteps; ++s)
    EXPECT_LE(rel(run.losses[static_cast<size_t>(s)], dp.losses[static_cast<size_t>(s)]),
              kTolerance)
        << "delayed update: loss of step " << s + 1;
  expect_state(fmt::format("offload ×{} delayed update", world()), got, w.back());
  // The two update rules differ: the exact run's state is not the delayed one's.
  EXPECT_GT(compare(got.params, ref.at_checkpoint.params).norm_rel, 10 * kTolerance);
}

}  // namespace

// main(): tests/mpi/mpi_gtest_main.cpp
