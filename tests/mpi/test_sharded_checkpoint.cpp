// Sharded checkpoints under mpirun (tests/CMakeLists.txt runs this program with 2 and 4 ranks):
// zero2 on W ranks saves; zero1 on W/2 ranks (sub-groups; one rank at W = 2) and dp on one rank
// load it; they save again and zero2 on W ranks loads that; dp on W ranks saves and zero1 on W
// ranks loads. Every loaded state must equal the saved one bit for bit (loading copies).
#define OMPI_SKIP_MPICXX 1
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "../tiny_gpt2.h"
#include "backend/backend.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/sharded_checkpoint.h"
#include "comm/communicator.h"
#include "core/rng.h"
#include "model/gpt2.h"
#include "mpi_test_support.h"
#include "parallel/strategy.h"
#include "train/strategy_from_config.h"

namespace st = shardtrain;
namespace fs = std::filesystem;

namespace {

st::GPT2Config tiny_model() { return st::test_support::tiny_gpt2("sharded-checkpoint"); }

/// One model + strategy on one communicator, holding `state`.
struct Trainee {
  Trainee(st::StrategyKind kind, st::Communicator& c)
      : comm(c), backend(st::make_cpu_backend()), model(tiny_model(), *backend) {
    st::TrainConfig cfg;
    cfg.strategy = kind;
    cfg.strategy_name = st::to_string(kind);
    cfg.zero.stage = st::zero_stage_of(kind);
    cfg.zero.reduce_bucket_size = 4000;  // several buckets, each padded to the rank count
    strategy = st::make_strategy(cfg, *backend, comm);
    strategy->setup(model, std::vector<float>(static_cast<size_t>(model.layout().numel()), 0.f));
  }
  st::Communicator& comm;
  std::unique_ptr<st::Backend> backend;
  st::GPT2Model model;
  std::unique_ptr<st::Strategy> strategy;
};

/// The same pseudo-random state on every rank, 9 AdamW steps.
st::FullState reference_state(int64_t numel) {
  st::SplitMix64 rng{77};
  st::FullState s;
  for (auto* v : {&s.params, &s.exp_avg, &s.exp_avg_sq}) {
    v->resize(static_cast<size_t>(numel));
    for (float& x : *v) x = static_cast<float>(rng.uniform() - 0.5);
  }
  s.optimizer_steps = 9;
  return s;
}

class ShardedCheckpointMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = st::make_mpi_communicator();
    dir = st::test_support::job_temp_dir("shardtrain_sharded_mpi");
  }
  void TearDown() override {
    comm->barrier();
    if (comm->rank() == 0) fs::remove_all(dir);
  }
  void expect_equal(const st::FullState& a, const st::FullState& b, const std::string& what) {
    const bool same = a.params == b.params && a.exp_avg == b.exp_avg &&
                      a.exp_avg_sq == b.exp_avg_sq && a.optimizer_steps == b.optimizer_steps;
    EXPECT_TRUE(a.params == b.params) << what << ": params differ";
    EXPECT_TRUE(a.exp_avg == b.exp_avg) << what << ": exp_avg differs";
    EXPECT_TRUE(a.exp_avg_sq == b.exp_avg_sq) << what << ": exp_avg_sq differs";
    EXPECT_EQ(a.optimizer_steps, b.optimizer_steps) << what;
    if (comm->rank() == 0)
      std::printf("  %s: state %s\n", what.c_str(), same ? "equal bit for bit" : "DIFFERS");
  }
  std::unique_ptr<st::Communicator> comm;
  fs::path dir;
};

TEST_F(ShardedCheckpointMpi, ZeroTwoReshardsToOtherStrategiesAndRankCounts) {
  const int W = comm->world_size();
  st::CheckpointInfo info;
  info.model = tiny_model();
  info.progress.step = 5;

  Trainee zero2(st::StrategyKind::kZero2, *comm);
  const st::FullState ref = reference_state(zero2.model.layout().numel());
  zero2.strategy->load_state(ref);
  const fs::path saved =
      st::save_sharded_checkpoint(dir, "zero2", zero2.model.layout(), *zero2.strategy, *comm, info);
  // Every rank wrote its own file; the manifest lists W ranks.
  const st::CheckpointInfo ck = st::read_checkpoint_info(saved);
  EXPECT_EQ(ck.manifest.at("world_size").get<int>(), W);
  EXPECT_TRUE(fs::exists(saved / st::shard_file_name(comm->rank(), W)));

  // zero1 on half the ranks (two sub-groups at W = 4, one rank each at W = 2).
  std::unique_ptr<st::Communicator> half;
  int group = comm->rank();
  if (W >= 4) {
    std::vector<int> ranks;
    const int h = W / 2, first = comm->rank() < h ? 0 : h;
    for (int r = first; r < first + h; ++r) ranks.push_back(r);
    half = comm->split(ranks);
    group = first;
  } else {
    half = st::make_local_communicator();
  }
  {
    Trainee zero1(st::StrategyKind::kZero1, *half);
    st::load_sharded_checkpoint(ck, zero1.model.layout(), *zero1.strategy, *half, true, 1000);
    expect_equal(zero1.strategy->gather_state(), ref,
                 fmt::format("zero2 x{} -> zero1 x{}", W, half->world_size()));
    // ... and back: each group saves its own copy, which zero2 on all ranks loads.
    st::save_sharded_checkpoint(dir / fmt::format("group{}", group), "zero1", zero1.model.layout(),
                                *zero1.strategy, *half, info);
  }
  comm->barrier();
  {
    Trainee back(st::StrategyKind::kZero2, *comm);
    st::load_sharded_checkpoint(st::read_checkpoint_info(dir / "group0"), back.model.layout(),
                                *back.strategy, *comm);
    expect_equal(back.strategy->gather_state(), ref,
                 fmt::format("zero1 x{} -> zero2 x{}", half->world_size(), W));
  }
  auto local = st::make_local_communicator();
  {
    Trainee dp(st::StrategyKind::kDataParallel, *local);
    st::load_sharded_checkpoint(ck, dp.model.layout(), *dp.strategy, *local);
    expect_equal(dp.strategy->gather_state(), ref, fmt::format("zero2 x{} -> dp x1", W));
  }
  {
    // dp on W ranks saves an even split; zero1 on W ranks loads it.
    Trainee dp(st::StrategyKind::kDataParallel, *comm);
    dp.strategy->load_state(ref);
    const fs::path p =
        st::save_sharded_checkpoint(dir, "dp", dp.model.layout(), *dp.strategy, *comm, info);
    Trainee zero1(st::StrategyKind::kZero1, *comm);
    st::load_sharded_checkpoint(st::read_checkpoint_info(p), zero1.model.layout(), *zero1.strategy,
                                *comm);
    expect_equal(zero1.strategy->gather_state(), ref, fmt::format("dp x{} -> zero1 x{}", W, W));
  }
  EXPECT_EQ(st::read_checkpoint_info(dir).dir.filename(), "dp") << "latest follows the saves";
}

}  // namespace

// main(): tests/mpi/mpi_gtest_main.cpp
