// Evaluation over held-out sets whose size the rank count and the micro-batch do not divide,
// under mpirun (tests/CMakeLists.txt runs this program with 2, 3 and 4 ranks).
//
// The bug this guards against: evaluation split the samples into contiguous per-rank ranges and
// each rank ran ceil(range / batch) forwards, so ranks ran different numbers of forwards; under
// ZeRO-3 (and fsdp_stage3 for image models), forward all-gathers each layer's parameters, so the
// rank with one forward more waited in all-gathers the others never joined (MPI crashed, NCCL
// would hang). Now every rank runs the same number of micro-batches (eval_micro_batches,
// train/train_common.h), padding with uncounted ones.
//
// What is checked, for every sample count in kCounts (every remainder modulo 2, 3 and 4, counts
// below the rank count, counts the micro-batch does not divide) and micro-batches of 2 and 3:
//   - eval_micro_batches itself: the same number of micro-batches on every rank, the counted ones
//     covering [0, samples) exactly once, padding valid (for 1..5 ranks, no MPI);
//   - GPT-2 (the 21,303-parameter test model) under dp and zero3 (every layer sharded, so forward
//     all-gathers): evaluate_gpt2 on all ranks returns the loss of one rank evaluating the same
//     model on the same samples (≤ 1e-6 relative, fp32) and exactly the real sample count;
//   - a pipeline of 2 stages × W/2 replicas (dp and zero2 across the replicas; even W): the same
//     through PipelineParallel::evaluate;
//   - the cnn image classifier under ddp and fsdp_stage3: evaluate_images returns one rank's loss,
//     top-1, top-5 and confusion matrix, and the real image count (also for an empty set).
// Without the padding, the zero3 and fsdp_stage3 cases crash or hang (the test's timeout).
//
// Every rank runs every test in the same order (collectives must match); the pipeline test is
// skipped on every rank alike when the world is odd.
#define OMPI_SKIP_MPICXX 1
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../tiny_gpt2.h"
#include "backend/backend.h"
#include "comm/communicator.h"
#include "comm/scalar_all_reduce.h"
#include "config/config.h"
#include "core/error.h"
#include "core/rng.h"
#include "data/dataset.h"
#include "data/image_dataset.h"
#include "model/gpt2.h"
#include "model/image/image_model.h"
#include "model/image/image_zoo.h"
#include "parallel/pipeline/pipeline_parallel.h"
#include "parallel/strategy.h"
#include "train/image_trainer.h"
#include "train/strategy_from_config.h"
#include "train/train_common.h"
#include "train/trainer.h"

namespace st = shardtrain;

namespace {

constexpr int64_t kT = 16;
constexpr double kTolerance = 1e-6;
/// Sample counts: every remainder modulo 2, 3 and 4; fewer samples than ranks (1, 2, 3); counts
/// that leave some ranks one micro-batch fewer than others at batch 2 and 3 (e.g. 9 on 4 ranks:
/// ranges 3, 2, 2, 2 → 2, 1, 1, 1 micro-batches of 2).
const std::vector<int64_t> kCounts = {1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 14, 23};
const std::vector<int64_t> kBatches = {2, 3};

double rel(double a, double b) { return std::fabs(a - b) / std::max(1e-12, std::fabs(b)); }

// ---- the helper --------------------------------------------------------------------------------

TEST(EvalMicroBatches, SameCountOnEveryRankAndEverySampleOnce) {
  for (int world = 1; world <= 5; ++world)
    for (int64_t samples = 0; samples <= 30; ++samples)
      for (int64_t batch = 1; batch <= 4; ++batch) {
        const std::string what =
            fmt::format("{} samples, batch {}, {} ranks", samples, batch, world);
        std::vector<int> seen(static_cast<size_t>(samples), 0);
        int64_t next = 0;  // counted micro-batches come in rank order, contiguous
        size_t forwards = 0;
        bool padded = false;
        for (int rank = 0; rank < world; ++rank) {
          const auto mbs = st::eval_micro_batches(samples, batch, world, rank);
          if (rank == 0) forwards = mbs.size();
          EXPECT_EQ(mbs.size(), forwards) << what << ": rank " << rank;
          bool padding_started = false;
          for (const st::EvalMicroBatch& mb : mbs) {
            EXPECT_GE(mb.count, 1) << what;
            EXPECT_LE(mb.count, batch) << what;
            EXPECT_GE(mb.start, 0) << what;
            EXPECT_LE(mb.start + mb.count, samples) << what;  // padding reads real samples too
            if (!mb.counted) {
              padding_started = padded = true;
              continue;
            }
            EXPECT_FALSE(padding_started) << what << ": padding before real samples";
            EXPECT_EQ(mb.start, next) << what;
            next = mb.start + mb.count;
            for (int64_t s = mb.start; s < mb.start + mb.count; ++s)
              if (s >= 0 && s < samples) ++seen[static_cast<size_t>(s)];
          }
        }
        EXPECT_EQ(next, samples) << what;
        for (int64_t s = 0; s < samples; ++s)
          EXPECT_EQ(seen[static_cast<size_t>(s)], 1) << what << ": sample " << s;
        // As few forwards as the longest range needs.
        const int64_t longest = (samples + world - 1) / world;
        EXPECT_EQ(static_cast<int64_t>(forwards), (longest + batch - 1) / batch) << what;
        if (samples == 9 && batch == 2 && world == 4) {
          EXPECT_TRUE(padded) << what;
        }
      }
  EXPECT_EQ(st::eval_micro_batches(3, 2, 4, 3),
            (std::vector<st::EvalMicroBatch>{{0, 1, false}}));  // an empty range: one padding
  EXPECT_THROW(st::eval_micro_batches(3, 0, 4, 0), st::ConfigError);
  EXPECT_THROW(st::eval_micro_batches(3, 2, 4, 4), st::ConfigError);
}

// ---- GPT-2 -------------------------------------------------------------------------------------

st::GPT2Config gpt2(int layers = 2) {
  st::GPT2Config c = st::test_support::tiny_gpt2("uneven-eval", kT);
  c.n_layer = layers;
  return c;
}

std::vector<float> gpt2_init(int layers = 2) {
  auto backend = st::make_cpu_backend();
  st::GPT2Model m(gpt2(layers), *backend);
  std::vector<float> init(static_cast<size_t>(m.layout().numel()));
  m.init_parameters(init.data(), 777);
  return init;
}

/// `n` samples of T + 1 random tokens of the test model's vocabulary, deterministic.
st::PackedDataset gpt2_data(int64_t n) {
  st::SplitMix64 rng{0xe7a10000u};
  std::vector<uint16_t> tokens(static_cast<size_t>(n * (kT + 1)));
  for (auto& t : tokens) t = static_cast<uint16_t>(rng.next() % 97);
  return st::PackedDataset(std::move(tokens), kT, "uneven-eval data");
}

st::StrategyOptions gpt2_options(st::StrategyKind kind) {
  st::TrainConfig cfg;
  cfg.strategy = kind;
  cfg.strategy_name = st::to_string(kind);
  cfg.zero.stage = st::zero_stage_of(kind);
  cfg.zero.stage3_param_persistence_threshold = 0;  // every layer sharded: forward all-gathers
  cfg.zero.allgather_bucket_size = 4000;
  cfg.plan = st::plan_of(cfg);
  return st::strategy_options(cfg);
}

/// The test model with `kind` on `comm`, from gpt2_init().
struct Gpt2Run {
  Gpt2Run(st::StrategyKind kind, st::Communicator& c)
      : comm(c), backend(st::make_cpu_backend()), model(gpt2(), *backend) {
    strategy = st::make_strategy(gpt2_options(kind), *backend, comm);
    strategy->setup(model, gpt2_init());
  }
  st::GPT2Evaluation evaluate(const st::PackedDataset& data, int64_t batch) {
    st::ScalarAllReduce reduce(*backend, comm, 2);
    return st::evaluate_gpt2(model, data, batch, comm, reduce);
  }
  st::Communicator& comm;
  std::unique_ptr<st::Backend> backend;
  st::GPT2Model model;
  std::unique_ptr<st::Strategy> strategy;
};

/// One rank (dp, LocalCommunicator) evaluating the first `n` samples in one micro-batch.
double gpt2_reference(int64_t n) {
  auto local = st::make_local_communicator();
  Gpt2Run one(st::StrategyKind::kDataParallel, *local);
  const st::GPT2Evaluation ev = one.evaluate(gpt2_data(n), n);
  EXPECT_EQ(ev.samples, n);
  return ev.loss;
}

class UnevenEval : public ::testing::Test {
 protected:
  void SetUp() override { comm = st::make_mpi_communicator(); }
  std::unique_ptr<st::Communicator> comm;
};

TEST_F(UnevenEval, Gpt2DpAndZero3MatchOneRank) {
  std::vector<double> reference;
  for (const int64_t n : kCounts) reference.push_back(gpt2_reference(n));
  for (const st::StrategyKind kind : {st::StrategyKind::kDataParallel, st::StrategyKind::kZero3}) {
    Gpt2Run run(kind, *comm);
    double worst = 0;
    for (size_t i = 0; i < kCounts.size(); ++i)
      for (const int64_t batch : kBatches) {
        const int64_t n = kCounts[i];
        const st::GPT2Evaluation ev = run.evaluate(gpt2_data(n), batch);
        const std::string what = fmt::format("{} on {} ranks, {} samples, batch {}",
                                             st::to_string(kind), comm->world_size(), n, batch);
        EXPECT_EQ(ev.samples, n) << what;
        EXPECT_LE(rel(ev.loss, reference[i]), kTolerance)
            << what << ": " << ev.loss << " vs " << reference[i];
        worst = std::max(worst, rel(ev.loss, reference[i]));
      }
    if (comm->rank() == 0)
      fmt::print("{} on {} ranks: worst relative loss difference {:.3g}\n", st::to_string(kind),
                 comm->world_size(), worst);
  }
}

// Pipelines split the samples by replica (every stage of a replica runs the same range, its
// stages exchanging activations point to point) and run dp, zero1 or zero2 across the replicas,
// which issue no collectives in forward; the replicas' counts may differ.
TEST_F(UnevenEval, PipelineMatchesOneRank) {
  const int W = comm->world_size();
  if (W % 2 != 0) GTEST_SKIP() << "2 stages need an even world";
  constexpr int kLayers = 4;
  std::vector<double> reference;
  {
    auto backend = st::make_cpu_backend();
    auto local = st::make_local_communicator();
    st::GPT2Model model(gpt2(kLayers), *backend);
    auto strategy =
        st::make_strategy(gpt2_options(st::StrategyKind::kDataParallel), *backend, *local);
    strategy->setup(model, gpt2_init(kLayers));
    st::ScalarAllReduce reduce(*backend, *local, 2);
    for (const int64_t n : kCounts)
      reference.push_back(st::evaluate_gpt2(model, gpt2_data(n), n, *local, reduce).loss);
  }
  for (const int zero_stage : {0, 2}) {
    for (const int64_t batch : kBatches) {
      st::TrainConfig cfg;
      cfg.strategy = st::StrategyKind::kPipeline;
      cfg.strategy_name = "pipeline";
      cfg.zero.stage = zero_stage;
      cfg.world_size = W;
      cfg.micro_batch_size = batch;
      cfg.gradient_accumulation_steps = 2;
      cfg.max_length = kT;
      cfg.pipeline.stages = 2;
      cfg.plan = st::plan_of(cfg);
      auto backend = st::make_cpu_backend();
      st::GPT2Model whole(gpt2(kLayers), *backend);
      auto strategy = st::make_pipeline_strategy(cfg, *backend, *comm);
      strategy->setup(whole, gpt2_init(kLayers));
      st::PipelineParallel* pipe = strategy.get();
      for (size_t i = 0; i < kCounts.size(); ++i) {
        const int64_t n = kCounts[i];
        const st::PipelineEvaluation ev = pipe->evaluate(gpt2_data(n), batch);
        const double loss = ev.loss_sum / static_cast<double>(ev.samples);
        const std::string what = fmt::format("pipeline 2 × {} zero{}, {} samples, batch {}", W / 2,
                                             zero_stage, n, batch);
        EXPECT_EQ(ev.samples, n) << what;
        EXPECT_LE(rel(loss, reference[i]), kTolerance)
            << what << ": " << loss << " vs " << reference[i];
      }
    }
  }
}

// ---- image classifier --------------------------------------------------------------------------

constexpr int64_t kSide = 12;
constexpr int64_t kClasses = 10;

st::ImageModelSpec cnn() {
  st::ImageModelSpec s;
  s.name = "cnn";
  s.channels = 1;
  s.height = s.width = kSide;
  s.num_classes = kClasses;
  return s;
}

st::ImageTransform transform() {
  st::ImageTransform t;
  t.channels = 1;
  t.mean = {0.5f};
  t.stdev = {0.25f};
  return t;
}

/// The first `n` of 23 fixed synthetic images (keep_first as --eval-samples does).
st::ImageSet images(int64_t n) {
  st::ImageSet set = st::synthetic_images(23, 1, kSide, kSide, kClasses, 4242);
  set.labels.resize(static_cast<size_t>(n));
  set.pixels.resize(static_cast<size_t>(n * set.image_bytes()));
  return set;
}

struct ImageRun {
  ImageRun(st::StrategyKind kind, st::Communicator& c)
      : comm(c), backend(st::make_cpu_backend()), model(st::make_image_model(cnn(), *backend)) {
    std::vector<float> init(static_cast<size_t>(model->layout().numel()));
    model->init_parameters(init.data(), 99);
    st::TrainConfig cfg;
    cfg.strategy = kind;
    cfg.strategy_name = st::to_string(kind);
    cfg.zero.stage = st::zero_stage_of(kind);
    cfg.zero.stage3_param_persistence_threshold = 0;  // every layer sharded
    cfg.zero.allgather_bucket_size = 20'000;
    cfg.plan = st::plan_of(cfg);
    strategy = st::make_strategy(st::strategy_options(cfg), *backend, comm);
    strategy->setup(*model, init);
  }
  st::ImageEvaluation evaluate(const st::ImageSet& set, int64_t batch) {
    st::ScalarAllReduce reduce(*backend, comm,
                               static_cast<int>(4 + kClasses + kClasses * kClasses));
    return st::evaluate_images(*model, set, transform(), batch, comm, reduce);
  }
  st::Communicator& comm;
  std::unique_ptr<st::Backend> backend;
  std::unique_ptr<st::ImageModel> model;
  std::unique_ptr<st::Strategy> strategy;
};

TEST_F(UnevenEval, ImageDdpAndFsdpStage3MatchOneRank) {
  std::vector<int64_t> counts = kCounts;
  counts.insert(counts.begin(), 0);  // an empty held-out set: nothing counted, nothing hangs
  std::vector<st::ImageEvaluation> reference;
  {
    auto local = st::make_local_communicator();
    ImageRun one(st::StrategyKind::kDataParallel, *local);
    for (const int64_t n : counts) reference.push_back(one.evaluate(images(n), 64));
  }
  for (const char* name : {"ddp", "fsdp_stage3"}) {
    ImageRun run(st::parse_strategy(name), *comm);
    double worst = 0;
    for (size_t i = 0; i < counts.size(); ++i)
      for (const int64_t batch : kBatches) {
        const int64_t n = counts[i];
        const st::ImageEvaluation ev = run.evaluate(images(n), batch);
        const st::ImageEvaluation& ref = reference[i];
        const std::string what =
            fmt::format("{} on {} ranks, {} images, batch {}", name, comm->world_size(), n, batch);
        EXPECT_EQ(ev.samples, n) << what;
        EXPECT_EQ(ref.samples, n) << what;
        if (n == 0) continue;
        EXPECT_LE(rel(ev.loss, ref.loss), kTolerance)
            << what << ": " << ev.loss << " vs " << ref.loss;
        EXPECT_EQ(ev.top1, ref.top1) << what;
        EXPECT_EQ(ev.top5, ref.top5) << what;
        EXPECT_EQ(ev.confusion, ref.confusion) << what;
        int64_t total = 0;
        for (const int64_t c : ev.confusion) total += c;
        EXPECT_EQ(total, n) << what << ": every image once in the confusion matrix";
        worst = std::max(worst, rel(ev.loss, ref.loss));
      }
    if (comm->rank() == 0)
      fmt::print("{} on {} ranks: worst relative loss difference {:.3g}\n", name,
                 comm->world_size(), worst);
  }
}

}  // namespace
