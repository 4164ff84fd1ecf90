// Sharded checkpoints (checkpoint/sharded_checkpoint.h) in one process: round trips through the
// real strategies, resharding between simulated world sizes (ranks as threads over a fake
// communicator whose barrier is a std::barrier), missing/truncated/corrupt shards, layout
// mismatches, a save that dies half-way, format-1 checkpoints, and consolidation into a Hugging
// Face model (fp32 and bf16) against the dp run's export.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <exception>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/sharded_checkpoint.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "data/data_dir.h"
#include "data/dataset.h"
#include "io/atomic_file.h"
#include "model/gpt2.h"
#include "parallel/strategy.h"
#include "tiny_gpt2.h"
#include "train/strategy_from_config.h"
#include "train/trainer.h"

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("shardtrain_ckpt_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

GPT2Config tiny_model(int64_t n_positions = 16) {
  return test_support::tiny_gpt2("ckpt-tiny", n_positions);
}

/// A state with distinct values in every tensor element (v > 0), zero alignment padding (as
/// training keeps it) and 7 AdamW steps.
FullState random_state(const ParamLayout& layout, uint64_t seed) {
  SplitMix64 rng{seed};
  FullState s;
  for (auto* v : {&s.params, &s.exp_avg, &s.exp_avg_sq}) {
    v->assign(static_cast<size_t>(layout.numel()), 0.0f);
    for (const ParamTensor* t : layout.tensors())
      for (int64_t i = 0; i < t->numel; ++i)
        (*v)[static_cast<size_t>(t->offset + i)] = static_cast<float>(rng.uniform() - 0.5);
  }
  for (float& x : s.exp_avg_sq) x = x * x;
  s.optimizer_steps = 7;
  return s;
}

std::vector<float>& quantity(FullState& s, StateTensor q) {
  return q == StateTensor::kParams   ? s.params
         : q == StateTensor::kExpAvg ? s.exp_avg
                                     : s.exp_avg_sq;
}

/// A rank of a simulated group: saves ranges of a reference state, records what a load writes.
class FakeRank : public Strategy {
 public:
  FakeRank(FullState* source, std::vector<FlatRange> save, std::vector<FlatRange> load,
           int64_t numel)
      : source_(source), save_(std::move(save)), load_(std::move(load)) {
    for (auto* v : {&loaded.params, &loaded.exp_avg, &loaded.exp_avg_sq})
      v->assign(static_cast<size_t>(numel), -999.0f);
  }
  std::string name() const override { return "fake"; }
  void setup(Model&, const std::vector<float>&) override { unused(); }
  void zero_grad() override { unused(); }
  void begin_micro_step(int64_t, int64_t) override { unused(); }
  void finish_gradients() override { unused(); }
  double grad_norm(double) override { unused(); }
  void step(double, double) override { unused(); }
  FullState gather_state() override { unused(); }
  void load_state(const FullState&) override { unused(); }
  size_t model_state_bytes() const override { return 0; }
  std::vector<FlatRange> save_ranges() const override { return save_; }
  std::vector<FlatRange> load_ranges() const override { return load_; }
  void read_state(StateTensor q, int64_t offset, int64_t numel, float* host) override {
    expect_inside(save_, offset, numel);
    if (fail_after >= 0 && reads++ >= fail_after) throw RuntimeFailure("disk on fire");
    std::copy_n(quantity(*source_, q).begin() + offset, numel, host);
  }
  void write_state(StateTensor q, int64_t offset, int64_t numel, const float* host) override {
    expect_inside(load_, offset, numel);
    std::copy_n(host, numel, quantity(loaded, q).begin() + offset);
  }
  void finish_load(int64_t steps) override { loaded.optimizer_steps = steps; }
  int64_t optimizer_steps() const override { return source_->optimizer_steps; }
  OptimizerKind optimizer_kind() const override { return source_->optimizer; }

  FullState loaded;
  int fail_after = -1;  ///< read_state throws after this many calls (≥ 0)
  int reads = 0;

 private:
  [[noreturn]] static void unused() { throw std::logic_error("not used by checkpoints"); }
  static void expect_inside(const std::vector<FlatRange>& rs, int64_t offset, int64_t numel) {
    bool inside = false;
    for (const FlatRange& r : rs)
      inside |= offset >= r.offset && offset + numel <= r.offset + r.numel;
    EXPECT_TRUE(inside) << "[" << offset << ", " << offset + numel << ") crosses a range";
  }
  FullState* source_;
  std::vector<FlatRange> save_, load_;
};

/// Rank `rank` of `world` ranks that are threads of this process: only barrier() works.
class ThreadComm : public Communicator {
 public:
  ThreadComm(int rank, int world, std::barrier<>& b) : rank_(rank), world_(world), barrier_(b) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return "threads"; }
  std::unique_ptr<Work> all_reduce(Tensor, ReduceOp) override { unused(); }
  std::unique_ptr<Work> reduce_scatter(Tensor, Tensor, ReduceOp) override { unused(); }
  std::unique_ptr<Work> all_gather(Tensor, Tensor) override { unused(); }
  std::unique_ptr<Work> all_to_all(Tensor, Tensor) override { unused(); }
  std::unique_ptr<Work> broadcast(Tensor, int) override { unused(); }
  std::unique_ptr<Work> send(Tensor, int) override { unused(); }
  std::unique_ptr<Work> recv(Tensor, int) override { unused(); }
  void barrier() override { barrier_.arrive_and_wait(); }
  std::unique_ptr<Communicator> split(const std::vector<int>&) override { unused(); }

 private:
  [[noreturn]] static void unused() { throw std::logic_error("not used by checkpoints"); }
  int rank_, world_;
  std::barrier<>& barrier_;
};

/// Saves `state` as `world` ranks with even splits (threads); returns the checkpoint directory.
fs::path save_as_ranks(const fs::path& out, const std::string& name, const ParamLayout& layout,
                       FullState& state, int world, const CheckpointInfo& info,
                       ShardedSaveOptions options = {}) {
  std::barrier<> sync(world);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  fs::path dir;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ThreadComm comm(r, world, sync);
        FakeRank rank(&state, even_split(layout.numel(), world, r), {}, layout.numel());
        const fs::path d = save_sharded_checkpoint(out, name, layout, rank, comm, info, options);
        if (r == 0) dir = d;
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return dir;
}

struct Fixture {
  Fixture() : backend(make_cpu_backend()), model(tiny_model(), *backend) {
    info.model = tiny_model();
    info.progress.step = 3;
    info.progress.epoch = 1;
    info.progress.seed = 42;
    info.config = {{"strategy", "zero2"}};
    state = random_state(model.layout(), 11);
  }
  const ParamLayout& layout() const { return model.layout(); }
  std::unique_ptr<Backend> backend;
  GPT2Model model;
  CheckpointInfo info;
  FullState state;
};

std::unique_ptr<Strategy> real_strategy(StrategyKind kind, Backend& backend, Communicator& comm,
                                        GPT2Model& model,
                                        OptimizerKind optimizer = OptimizerKind::kAdamW) {
  TrainConfig cfg;
  cfg.optimizer = optimizer;
  if (optimizer == OptimizerKind::kSGD) cfg.momentum = 0.9;
  if (kind == StrategyKind::kOffload) cfg.zero.offload_optimizer_device = "cpu";
  cfg.strategy = kind;
  cfg.strategy_name = to_string(kind);
  cfg.zero.stage = zero_stage_of(kind);
  cfg.zero.reduce_bucket_size = 5000;
  cfg.plan = plan_of(cfg);  // what validate() derives
  auto s = make_strategy(cfg, backend, comm);
  std::vector<float> init(static_cast<size_t>(model.layout().numel()), 0.0f);
  s->setup(model, init);
  return s;
}

void expect_same_state(const FullState& a, const FullState& b, const std::string& what) {
  EXPECT_TRUE(a.params == b.params) << what << ": params differ";
  EXPECT_TRUE(a.exp_avg == b.exp_avg) << what << ": exp_avg differs";
  EXPECT_TRUE(a.exp_avg_sq == b.exp_avg_sq) << what << ": exp_avg_sq differs";
  EXPECT_EQ(a.optimizer_steps, b.optimizer_steps) << what;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "(no CheckpointError)";
}

}  // namespace

TEST(ShardedCheckpoint, RoundTripsThroughEveryStrategy) {
  const fs::path dir = temp_dir("roundtrip");
  Fixture f;
  auto comm = make_local_communicator();
  const StrategyKind kinds[] = {StrategyKind::kDataParallel, StrategyKind::kZero1,
                                StrategyKind::kZero2};
  for (StrategyKind from : kinds) {
    auto saver = real_strategy(from, *f.backend, *comm, f.model);
    saver->load_state(f.state);
    ShardedSaveOptions opts;
    opts.chunk_elements = 1000;  // many chunks per range
    const std::string name = "ck-" + to_string(from);
    const fs::path ck = save_sharded_checkpoint(dir, name, f.layout(), *saver, *comm, f.info, opts);
    EXPECT_EQ(ck, dir / name);
    EXPECT_EQ(resolve_checkpoint(dir), ck);
    const CheckpointInfo info = read_checkpoint_info(ck);
    EXPECT_EQ(info.version, 2);
    EXPECT_EQ(info.progress.step, 3);
    EXPECT_EQ(info.progress.seed, 42u);
    EXPECT_EQ(info.optimizer_step, 7);
    EXPECT_EQ(info.manifest.at("strategy"), to_string(from));
    EXPECT_TRUE(fs::exists(ck / "rank-00000-of-00001.safetensors"));
    EXPECT_TRUE(fs::exists(ck / "rank-00000.json"));
    for (StrategyKind to : kinds) {
      auto loader = real_strategy(to, *f.backend, *comm, f.model);
      load_sharded_checkpoint(info, f.layout(), *loader, *comm, true, 777);
      expect_same_state(loader->gather_state(), f.state, to_string(from) + " -> " + to_string(to));
    }
    expect_same_state(load_full_state(info, f.layout(), true), f.state, "load_full_state");
  }
  fs::remove_all(dir);
}

TEST(ShardedCheckpoint, ReshardsBetweenWorldSizes) {
  const fs::path dir = temp_dir("reshard");
  Fixture f;
  const int64_t numel = f.layout().numel();
  for (int saved : {1, 2, 3, 4}) {
    const fs::path ck =
        save_as_ranks(dir, fmt::format("w{}", saved), f.layout(), f.state, saved, f.info);
    const CheckpointInfo info = read_checkpoint_info(ck);
    EXPECT_EQ(info.manifest.at("world_size"), saved);
    for (int r = 0; r < saved; ++r) EXPECT_TRUE(fs::exists(ck / shard_file_name(r, saved)));
    for (int loaded : {1, 2, 3, 5}) {
      auto comm = make_local_communicator();
      for (int r = 0; r < loaded; ++r) {
        // Two ranges per rank: its even piece split in two (ZeRO owns several slices).
        const FlatRange p = even_split(numel, loaded, r)[0];
        const std::vector<FlatRange> ranges = {{p.offset, p.numel / 3},
                                               {p.offset + p.numel / 3, p.numel - p.numel / 3}};
        FakeRank rank(&f.state, {}, ranges, numel);
        load_sharded_checkpoint(info, f.layout(), rank, *comm, true, 501);
        EXPECT_EQ(rank.loaded.optimizer_steps, 7);
        for (StateTensor q : {StateTensor::kParams, StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
          const auto& got = quantity(rank.loaded, q);
          const auto& want = quantity(f.state, q);
          for (int64_t i = 0; i < numel; ++i) {
            const bool mine = i >= p.offset && i < p.offset + p.numel;
            const auto k = static_cast<size_t>(i);
            if (mine ? got[k] != want[k] : got[k] != -999.0f) {
              ADD_FAILURE() << saved << " -> " << loaded << " ranks, rank " << r << ", element "
                            << i;
              break;
            }
          }
        }
      }
      // A params-only load (--init-from) writes no optimizer state and step 0.
      FakeRank params_only(&f.state, {}, {{0, numel}}, numel);
      load_sharded_checkpoint(info, f.layout(), params_only, *comm, false);
      EXPECT_EQ(params_only.loaded.params, f.state.params);
      EXPECT_EQ(params_only.loaded.exp_avg[0], -999.0f);
      EXPECT_EQ(params_only.loaded.optimizer_steps, 0);
    }
    // Into a real strategy (dp on one rank) and as the full state.
    auto comm = make_local_communicator();
    auto zero2 = real_strategy(StrategyKind::kZero2, *f.backend, *comm, f.model);
    load_sharded_checkpoint(info, f.layout(), *zero2, *comm);
    expect_same_state(zero2->gather_state(), f.state, fmt::format("{} ranks -> zero2 x1", saved));
    EXPECT_EQ(load_checkpoint_params(info, f.layout()), f.state.params);
  }
  fs::remove_all(dir);
}

TEST(ShardedCheckpoint, MissingTruncatedAndCorruptShardsAreNamed) {
  const fs::path dir = temp_dir("missing");
  Fixture f;
  const fs::path ck = save_as_ranks(dir, "ck", f.layout(), f.state, 4, f.info);
  const CheckpointInfo info = read_checkpoint_info(dir);
  auto comm = make_local_communicator();
  FakeRank rank(&f.state, {}, {{0, f.layout().numel()}}, f.layout().numel());
  const auto load = [&] { load_sharded_checkpoint(info, f.layout(), rank, *comm); };

  const fs::path shard = ck / "rank-00002-of-00004.safetensors";
  fs::rename(shard, dir / "aside");
  std::string msg = error_of(load);
  EXPECT_NE(msg.find("rank-00002-of-00004.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  fs::rename(dir / "aside", shard);

  const auto bytes = fs::file_size(shard);
  fs::resize_file(shard, bytes - 4);
  msg = error_of(load);
  EXPECT_NE(msg.find("rank-00002-of-00004.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  fs::resize_file(shard, bytes);  // zero-filled: right size, wrong bytes
  msg = error_of(load);
  EXPECT_NE(msg.find("rank-00002-of-00004.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("checksum"), std::string::npos) << msg;
  EXPECT_EQ(rank.loaded.params[0], -999.0f) << "nothing is written before the checks pass";
  fs::remove_all(dir);
}

TEST(ShardedCheckpoint, LayoutMismatchNamesTheFirstTensor) {
  const fs::path dir = temp_dir("layout");
  Fixture f;
  save_as_ranks(dir, "ck", f.layout(), f.state, 2, f.info);
  const CheckpointInfo info = read_checkpoint_info(dir);
  GPT2Model longer(tiny_model(32), *f.backend);  // only wpe differs
  auto comm = make_local_communicator();
  FakeRank rank(&f.state, {}, {{0, longer.layout().numel()}}, longer.layout().numel());
  const std::string msg =
      error_of([&] { load_sharded_checkpoint(info, longer.layout(), rank, *comm); });
  EXPECT_NE(msg.find("tensor 'transformer.wpe.weight' has shape [16, 27] in the checkpoint but "
                     "[32, 27] in the model"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find("transformer.h.0"), std::string::npos) << "only the first mismatch: " << msg;
  fs::remove_all(dir);
}

TEST(ShardedCheckpoint, SaveKilledHalfWayLeavesThePreviousCheckpoint) {
  const fs::path dir = temp_dir("killed");
  Fixture f;
  const fs::path first = save_as_ranks(dir, "checkpoint-000003", f.layout(), f.state, 2, f.info);
  ASSERT_EQ(read_file(dir / "latest"), "checkpoint-000003\n");

  // Rank 0 dies while streaming its shard (after 2 chunks); the other rank's shard is complete.
  FullState next = random_state(f.layout(), 12);
  CheckpointInfo later = f.info;
  later.progress.step = 4;
  std::barrier<> sync(2);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ThreadComm comm(r, 2, sync);
      FakeRank rank(&next, even_split(f.layout().numel(), 2, r), {}, f.layout().numel());
      ShardedSaveOptions opts;
      opts.chunk_elements = 1000;
      if (r == 0) rank.fail_after = 2;
      try {
        save_sharded_checkpoint(dir, "checkpoint-000004", f.layout(), rank, comm, later, opts);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        if (r == 0) sync.arrive_and_drop();  // the dead rank leaves the group
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors[0], "disk on fire");
  const fs::path tmp = dir / ".checkpoint-000004.tmp.s4";
  EXPECT_TRUE(fs::exists(tmp / "rank-00000-of-00002.safetensors")) << "partial file left";
  EXPECT_FALSE(fs::exists(tmp / "manifest.json"));
  EXPECT_FALSE(fs::exists(dir / "checkpoint-000004"));
  EXPECT_EQ(read_file(dir / "latest"), "checkpoint-000003\n");
  EXPECT_EQ(resolve_checkpoint(dir), first);
  expect_same_state(load_full_state(read_checkpoint_info(dir), f.layout(), true), f.state,
                    "previous checkpoint");

  // The next attempt at the same step replaces the leftovers and becomes the latest.
  save_as_ranks(dir, "checkpoint-000004", f.layout(), next, 3, later);
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_EQ(read_file(dir / "latest"), "checkpoint-000004\n");
  expect_same_state(load_full_state(read_checkpoint_info(dir), f.layout(), true), next, "retry");
  fs::remove_all(dir);
}

TEST(ShardedCheckpoint, FormatOneCheckpointsStillLoad) {
  const fs::path dir = temp_dir("v1");
  Fixture f;
  save_checkpoint(dir, "old", f.layout(), f.state, f.info);
  const CheckpointInfo info = read_checkpoint_info(dir);
  EXPECT_EQ(info.version, 1);
  auto comm = make_local_communicator();
  auto zero1 = real_strategy(StrategyKind::kZero1, *f.backend, *comm, f.model);
  load_sharded_checkpoint(info, f.layout(), *zero1, *comm);
  expect_same_state(zero1->gather_state(), f.state, "format 1 -> zero1");
  FakeRank part(&f.state, {}, {{100, 2000}}, f.layout().numel());
  load_sharded_checkpoint(info, f.layout(), part, *comm, true, 300);
  EXPECT_TRUE(std::equal(f.state.exp_avg_sq.begin() + 100, f.state.exp_avg_sq.begin() + 2100,
                         part.loaded.exp_avg_sq.begin() + 100));
  fs::remove_all(dir);
}

// SGD's state (params and the momentum buffer, no exp_avg_sq) round-trips through every
// strategy's save and load, in both formats, and never crosses into AdamW (or back).
TEST(ShardedCheckpoint, SgdStateRoundTripsAndIsNotLoadedIntoAdamW) {
  const fs::path dir = temp_dir("sgd");
  Fixture f;
  FullState sgd = f.state;
  sgd.optimizer = OptimizerKind::kSGD;
  sgd.exp_avg_sq.clear();
  auto comm = make_local_communicator();
  for (StrategyKind kind : {StrategyKind::kDataParallel, StrategyKind::kZero1, StrategyKind::kZero2,
                            StrategyKind::kZero3, StrategyKind::kOffload}) {
    SCOPED_TRACE(to_string(kind));
    auto saver = real_strategy(kind, *f.backend, *comm, f.model, OptimizerKind::kSGD);
    EXPECT_EQ(saver->optimizer_kind(), OptimizerKind::kSGD);
    saver->load_state(sgd);
    expect_same_state(saver->gather_state(), sgd, "load_state/gather_state");
    const std::string name = "sgd-" + to_string(kind);
    const fs::path ck = save_sharded_checkpoint(dir, name, f.layout(), *saver, *comm, f.info, {});
    const CheckpointInfo info = read_checkpoint_info(ck);
    EXPECT_EQ(info.optimizer, OptimizerKind::kSGD);
    EXPECT_EQ(info.manifest.at("optimizer").at("type"), "SGD");
    SafetensorsFile shard(ck / shard_file_name(0, 1));
    EXPECT_TRUE(shard.contains("exp_avg"));
    EXPECT_FALSE(shard.contains("exp_avg_sq")) << "SGD wrote a second moment";
    auto loader = real_strategy(kind, *f.backend, *comm, f.model, OptimizerKind::kSGD);
    load_sharded_checkpoint(info, f.layout(), *loader, *comm);
    expect_same_state(loader->gather_state(), sgd, "sharded save -> load");
    const FullState full = load_full_state(info, f.layout(), true);
    expect_same_state(full, sgd, "load_full_state");
    EXPECT_EQ(full.optimizer, OptimizerKind::kSGD);
    // SGD state into AdamW: refused, naming the fix.
    auto adamw = real_strategy(kind, *f.backend, *comm, f.model);
    EXPECT_NE(error_of([&] {
                load_sharded_checkpoint(info, f.layout(), *adamw, *comm);
              }).find("--optimizer sgd"),
              std::string::npos);
    // Weights only (--init-from) are fine across optimizers.
    EXPECT_NO_THROW(load_sharded_checkpoint(info, f.layout(), *adamw, *comm, false));
  }
  // AdamW state into SGD: refused.
  auto adamw_dp = real_strategy(StrategyKind::kDataParallel, *f.backend, *comm, f.model);
  adamw_dp->load_state(f.state);
  const fs::path ack =
      save_sharded_checkpoint(dir, "adamw", f.layout(), *adamw_dp, *comm, f.info, {});
  EXPECT_EQ(read_checkpoint_info(ack).optimizer, OptimizerKind::kAdamW);
  auto sgd_dp =
      real_strategy(StrategyKind::kDataParallel, *f.backend, *comm, f.model, OptimizerKind::kSGD);
  EXPECT_NE(error_of([&] {
              load_sharded_checkpoint(read_checkpoint_info(ack), f.layout(), *sgd_dp, *comm);
            }).find("--optimizer adamw"),
            std::string::npos);
  EXPECT_THROW(sgd_dp->load_state(f.state), CheckpointError);
  // Format 1 (save_checkpoint / load_checkpoint_state) keeps the type too.
  save_checkpoint(dir / "v1", "old", f.layout(), sgd, f.info);
  const CheckpointInfo v1 = read_checkpoint_info(dir / "v1");
  EXPECT_EQ(v1.version, 1);
  EXPECT_EQ(v1.optimizer, OptimizerKind::kSGD);
  expect_same_state(load_checkpoint_state(v1, f.layout(), true), sgd, "format 1");
  load_sharded_checkpoint(v1, f.layout(), *sgd_dp, *comm);
  expect_same_state(sgd_dp->gather_state(), sgd, "format 1 -> dp");
  fs::remove_all(dir);
}

TEST(ShardedCheckpoint, ConsolidateEqualsTheDataParallelExport) {
  const fs::path dir = temp_dir("consolidate");
  Fixture f;
  // The reference: dp's full parameters written as a Hugging Face file.
  auto comm = make_local_communicator();
  auto dp = real_strategy(StrategyKind::kDataParallel, *f.backend, *comm, f.model);
  dp->load_state(f.state);
  save_hf_weights(dir / "expected.safetensors", f.layout(), dp->gather_state().params.data());

  ShardedSaveOptions opts;
  opts.consolidated_bf16_model = true;  // stage3_gather_16bit_weights_on_model_save
  const fs::path ck = save_as_ranks(dir, "ck", f.layout(), f.state, 3, f.info, opts);
  const CheckpointInfo info = read_checkpoint_info(ck);
  const fs::path tokenizer = default_data_dir() / "gpt2-tokenizer";
  export_hf_model(info, dir / "fp32", tokenizer, HfDtype::kF32);
  export_hf_model(info, dir / "bf16", tokenizer, HfDtype::kBF16);
  for (const char* file : {"model.safetensors", "config.json", "vocab.json", "merges.txt"}) {
    EXPECT_TRUE(fs::exists(dir / "fp32" / file)) << file;
    EXPECT_TRUE(fs::exists(dir / "bf16" / file)) << file;
  }

  const SafetensorsFile want(dir / "expected.safetensors"), got(dir / "fp32" / "model.safetensors"),
      half(dir / "bf16" / "model.safetensors");
  ASSERT_EQ(got.entries().size(), want.entries().size());
  ASSERT_EQ(half.entries().size(), want.entries().size());
  for (const auto& [name, e] : want.entries()) {
    ASSERT_TRUE(got.contains(name)) << name;
    EXPECT_EQ(got.entry(name).shape, e.shape) << name;
    EXPECT_EQ(got.entry(name).dtype, "F32") << name;
    std::vector<float> a(e.bytes / 4), b(e.bytes / 4);
    want.read(name, a.data());
    got.read(name, b.data());
    EXPECT_EQ(a, b) << name;
    EXPECT_EQ(half.entry(name).shape, e.shape) << name;
    EXPECT_EQ(half.entry(name).dtype, "BF16") << name;
    std::vector<uint16_t> h(a.size());
    half.read(name, h.data());
    size_t wrong = 0;
    for (size_t i = 0; i < a.size(); ++i) wrong += h[i] != float_to_bf16(a[i]);
    EXPECT_EQ(wrong, 0u) << name;
  }
  // The checkpoint's own bf16 model (written before the directory was published) is the same file.
  EXPECT_EQ(read_file(ck / "model.safetensors"), read_file(dir / "bf16" / "model.safetensors"));
  EXPECT_TRUE(info.files.contains("model.safetensors"));
  fs::remove_all(dir);
}

// Weights larger than the shard size are split as transformers' save_pretrained splits them:
// model-0000K-of-0000N.safetensors files of at most that size (whole tensors in order) and an
// index whose weight_map names every tensor's file; they load back tensor for tensor (through the
// index, as --init-from reads an exported directory), and a later single-file export of the same
// directory removes the index.
TEST(ShardedCheckpoint, ExportSplitsLargeWeightsIntoShardsWithAnIndex) {
  const fs::path dir = temp_dir("hf_shards");
  Fixture f;
  const fs::path ck = save_as_ranks(dir, "ck", f.layout(), f.state, 2, f.info);
  const CheckpointInfo info = read_checkpoint_info(ck);
  const fs::path tokenizer = default_data_dir() / "gpt2-tokenizer";
  const int64_t total = f.layout().num_parameters() * 4;
  const int64_t max_shard = total / 3;
  export_hf_model(info, dir / "hf", tokenizer, HfDtype::kF32, max_shard);
  EXPECT_FALSE(fs::exists(dir / "hf" / "model.safetensors"));
  const nlohmann::json index =
      nlohmann::json::parse(read_file(dir / "hf" / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items())
    files.insert(file.get<std::string>());
  ASSERT_GE(files.size(), 3u);
  const size_t n = files.size();
  int64_t largest_tensor = 0;
  for (const ParamTensor* t : f.layout().tensors())
    largest_tensor = std::max(largest_tensor, t->numel * 4);
  size_t k = 0;
  for (const std::string& file : files) {
    EXPECT_EQ(file, fmt::format("model-{:05d}-of-{:05d}.safetensors", ++k, n));
    const SafetensorsFile st(dir / "hf" / file);
    int64_t bytes = 0;
    for (const auto& [name, e] : st.entries()) {
      EXPECT_EQ(index["weight_map"][name].get<std::string>(), file) << name;
      bytes += static_cast<int64_t>(e.bytes);
    }
    EXPECT_LE(bytes, std::max(max_shard, largest_tensor)) << file;
  }
  EXPECT_EQ(index["weight_map"].size(), f.layout().tensors().size());
  // Loads back through the index: every tensor equals the checkpoint's.
  std::vector<float> back(static_cast<size_t>(f.layout().numel()), 0.0f);
  load_hf_weights(dir / "hf" / "model.safetensors.index.json", f.layout(), back.data());
  for (const ParamTensor* t : f.layout().tensors())
    for (int64_t i = 0; i < t->numel; ++i)
      ASSERT_EQ(back[static_cast<size_t>(t->offset + i)],
                f.state.params[static_cast<size_t>(t->offset + i)])
          << t->name << " element " << i;
  // One file again: the index goes, so nothing reads the stale shards.
  export_hf_model(info, dir / "hf", tokenizer, HfDtype::kF32);
  EXPECT_TRUE(fs::exists(dir / "hf" / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "hf" / "model.safetensors.index.json"));
  EXPECT_EQ(parse_shard_size("5GB"), 5'000'000'000);
  EXPECT_EQ(parse_shard_size("500MB"), 500'000'000);
  EXPECT_EQ(parse_shard_size("2GiB"), int64_t{2} << 30);
  EXPECT_EQ(parse_shard_size("4096"), 4096);
  EXPECT_THROW(parse_shard_size("5 parsecs"), ConfigError);
  EXPECT_THROW(parse_shard_size("0"), ConfigError);
  fs::remove_all(dir);
}

TEST(ShardedCheckpoint, TrainerWritesTheGathered16BitModelAndInitsFromShards) {
  const fs::path dir = temp_dir("trainer");
  TrainConfig c;
  c.model = "gpt2-micro";
  c.device = "cpu";
  c.train_file = std::string(SHARDTRAIN_TEST_DATA_DIR) + "/wikitext-2/wiki.valid.tokens";
  c.cache_dir = (dir / "cache").string();
  c.output_dir = (dir / "run").string();
  c.max_length = 32;
  c.micro_batch_size = 2;
  c.train_batch_size = 2;
  c.max_steps = 2;
  c.log_interval = 1000;
  c.zero.stage3_gather_16bit_weights_on_model_save = true;
  auto comm = make_local_communicator();
  train(c, *comm);
  const CheckpointInfo info = read_checkpoint_info(c.output_dir);
  const fs::path ck = info.dir;
  ASSERT_TRUE(fs::exists(ck / "model.safetensors"));
  EXPECT_TRUE(fs::exists(ck / "config.json"));
  EXPECT_TRUE(info.files.contains("model.safetensors"));
  // The same bytes as consolidating the shards afterwards.
  export_hf_model(info, dir / "hf", default_data_dir() / "gpt2-tokenizer", HfDtype::kBF16);
  EXPECT_EQ(read_file(ck / "model.safetensors"), read_file(dir / "hf" / "model.safetensors"));

  // --init-from a sharded checkpoint: its weights (one step at a negligible learning rate keeps
  // them to within 1e-20), a fresh optimizer (AdamW step 1 after one step).
  TrainConfig fine = c;
  fine.output_dir = (dir / "fine").string();
  fine.init_from = ck.string();
  fine.max_steps = 1;
  fine.lr = 1e-30;
  fine.zero.stage3_gather_16bit_weights_on_model_save = false;
  train(fine, *comm);
  const CheckpointInfo after = read_checkpoint_info(fine.output_dir);
  EXPECT_EQ(after.optimizer_step, 1);
  auto be = make_cpu_backend();
  GPT2Model model(gpt2_preset("gpt2-micro"), *be);
  const std::vector<float> a = load_checkpoint_params(info, model.layout()),
                           b = load_checkpoint_params(after, model.layout());
  ASSERT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  EXPECT_LT(worst, 1e-20f);
  fs::remove_all(dir);
}
