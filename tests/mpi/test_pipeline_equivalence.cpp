// Pipeline parallelism under mpirun (tests/CMakeLists.txt runs this program with 2 and 4 ranks)
// against a single-process reference: every schedule with 2 and 4 stages, and 2 stages × 2
// replicas with dp, zero1 and zero2 across the replicas, reach the parameters and AdamW state of
// data parallelism on one rank with the same global batch after N steps (fp32, ‖a − b‖/‖b‖ ≤
// 1e-6); PipeDream-2BW equals a single-process implementation of its update rule; a pipeline
// checkpoint resumes as dp; with dropout (2 stages) the pipeline draws dp's masks.
//
// Setup: tiny GPT-2s (3 heads, 27 channels, vocabulary 97, T = 16) with 4 blocks (2 stages) or 8
// (4 stages). Every optimizer step takes a global batch of 16 samples: M micro-batches of 16/M,
// each split over the D replicas (replica d takes its d-th share, as DistributedSampler does).
// The reference is dp on one rank with micro-batches of 16/M and M accumulation steps
// (TrainStep), the same samples in the same micro-batches. The pipeline's state is read back
// through a sharded checkpoint (the whole model's flat layout), which tests the checkpoint path
// too. Gradient clipping at 0.65 clips some steps and not others; the loss and the gradient norm
// of every step are compared too.
//
// Every rank runs every test in the same order (collectives must match); tests needing more
// ranks than the job has are skipped on every rank alike.
#define OMPI_SKIP_MPICXX 1
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
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
#include "parallel/pipeline/pipeline_parallel.h"
#include "parallel/strategy.h"
#include "train/strategy_from_config.h"
#include "train/train_step.h"

namespace st = shardtrain;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kT = 16;
constexpr int64_t kGlobal = 16;  ///< samples per optimizer step
constexpr int64_t kSteps = 4;
constexpr int64_t kMore = 2;  ///< steps after a checkpoint
constexpr double kTolerance = 1e-6;
constexpr double kClip = 0.65;
constexpr double kLr = 6e-4;

double learning_rate(int64_t step) { return kLr * (1.0 - 0.05 * static_cast<double>(step)); }

constexpr uint64_t kRunSeed = 42;  ///< TrainStepOptions::dropout_seed of every run

/// `dropout`: embd/attn/resid_pdrop (0: none).
st::GPT2Config model_with(int layers, float dropout = 0.0f) {
  st::GPT2Config c = st::test_support::tiny_gpt2(fmt::format("pipeline-{}", layers), kT);
  c.n_layer = layers;
  c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = dropout;
  return c;
}

std::vector<int32_t> sample_tokens(int64_t s) {
  st::SplitMix64 rng{0x9e3779b9u + static_cast<uint64_t>(s)};
  std::vector<int32_t> out(kT + 1);
  for (auto& t : out) t = static_cast<int32_t>(rng.next() % 97);
  return out;
}

/// Micro-batch `k` of step `step` (M per step), replica `d`'s share of D.
struct Batches {
  int64_t M = 1;
  int D = 1, d = 0;
  std::vector<int32_t> tokens, targets;

  st::MicroBatch get(int64_t step, int64_t k) {
    const int64_t B = kGlobal / M / D;
    tokens.resize(static_cast<size_t>(B * kT));
    targets.resize(tokens.size());
    for (int64_t i = 0; i < B; ++i) {
      const auto s = sample_tokens(step * kGlobal + k * (kGlobal / M) + d * B + i);
      std::copy(s.begin(), s.end() - 1, tokens.begin() + i * kT);
      std::copy(s.begin() + 1, s.end(), targets.begin() + i * kT);
    }
    return st::MicroBatch{tokens.data(), targets.data(), B, kT};
  }
};

std::vector<float> initial_params(int layers) {
  auto backend = st::make_cpu_backend();
  st::GPT2Model m(model_with(layers), *backend);
  std::vector<float> init(static_cast<size_t>(m.layout().numel()));
  m.init_parameters(init.data(), 4321);
  return init;
}

st::StrategyOptions dp_options() {
  st::TrainConfig cfg;
  cfg.weight_decay = 0.1;
  cfg.plan = st::plan_of(cfg);
  return st::strategy_options(cfg);
}

/// The reference: dp on one rank. With `two_bw`, each step's gradient is computed on the weights
/// before the previous update and applied to the current ones (PipeDream-2BW's rule, written out
/// here on the plain strategy interface).
struct Reference {
  std::vector<st::FullState> states;  ///< after each step
  std::vector<double> losses, norms;
};

st::FullState state_of(st::Strategy& s) { return s.gather_state(); }

Reference run_reference(int layers, int64_t M, int64_t steps, bool two_bw, float dropout) {
  Reference ref;
  auto backend = st::make_cpu_backend();
  auto local = st::make_local_communicator();
  st::GPT2Model model(model_with(layers, dropout), *backend);
  auto strategy = st::make_strategy(dp_options(), *backend, *local);
  strategy->setup(model, initial_params(layers));
  st::LossScaler scaler{st::LossScaleConfig{}, false};
  Batches batches{M, 1, 0, {}, {}};
  if (!two_bw) {
    st::TrainStep train_step(model, *strategy, *local, *backend, scaler,
                             st::TrainStepOptions{M, kClip, kRunSeed});
    for (int64_t step = 0; step < steps; ++step) {
      const auto r = train_step.run(step, learning_rate(step),
                                    [&](int64_t k) { return batches.get(step, k); });
      ref.losses.push_back(r.loss);
      ref.norms.push_back(r.grad_norm);
      ref.states.push_back(state_of(*strategy));
    }
    return ref;
  }
  st::Tensor params = strategy->compute_parameters();
  const auto n = static_cast<size_t>(params.numel());
  std::vector<float> previous(n), current(n);
  for (int64_t step = 0; step < steps; ++step) {
    std::copy_n(params.f32(), n, current.begin());
    if (step > 0) std::copy(previous.begin(), previous.end(), params.f32());  // W(t-1)
    strategy->zero_grad();
    double loss = 0;
    for (int64_t k = 0; k < M; ++k) {
      const st::MicroBatch mb = batches.get(step, k);
      strategy->begin_micro_step(k, M);
      const st::ModelInput input{
          .batch = mb.batch,
          .seq_len = mb.seq_len,
          .tokens = mb.tokens,
          .targets = mb.targets,
          .dropout_seed = st::micro_batch_dropout_seed(kRunSeed, 0, step, k)};
      loss += model.forward(input, 1.0f / static_cast<float>(mb.batch * mb.seq_len), true);
      model.backward();
    }
    strategy->finish_gradients();
    std::copy(current.begin(), current.end(), params.f32());  // back to W(t) for the update
    previous = current;
    const double scale = 1.0 / static_cast<double>(M);
    const double norm = strategy->grad_norm(scale);
    const double clip = norm > kClip ? kClip / (norm + 1e-6) : 1.0;
    strategy->step(learning_rate(step), scale * clip);
    ref.losses.push_back(loss / static_cast<double>(M));
    ref.norms.push_back(norm);
    ref.states.push_back(state_of(*strategy));
  }
  return ref;
}

const Reference& reference(int layers, int64_t M, bool two_bw = false, float dropout = 0.0f) {
  static std::map<std::tuple<int, int64_t, bool, float>, Reference> cache;
  auto key = std::make_tuple(layers, M, two_bw, dropout);
  auto it = cache.find(key);
  if (it == cache.end())
    it = cache.emplace(key, run_reference(layers, M, kSteps + kMore, two_bw, dropout)).first;
  return it->second;
}

double norm_rel(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(1e-12, std::fabs(b)); }

struct Case {
  st::PipelineSchedule schedule = st::PipelineSchedule::k1F1B;
  int stages = 2;
  int virtual_stages = 1;
  int64_t M = 4;
  int zero_stage = 0;
  int layers = 4;
  std::string partition = "parameters";
  bool checkpointing = false;
  float dropout = 0.0f;    ///< the model's embd/attn/resid_pdrop
  bool flushless = false;  ///< 2bw: each step but the last runs the next step's first forwards
};

std::string describe(const Case& c, int D) {
  return fmt::format(
      "{} P={} V={} D={} M={} zero{} {}{}{}{}", st::to_string(c.schedule), c.stages,
      c.virtual_stages, D, c.M, c.zero_stage, c.partition, c.checkpointing ? " checkpointing" : "",
      c.dropout > 0 ? fmt::format(" dropout {}", c.dropout) : "", c.flushless ? " no flush" : "");
}

class PipelineMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = st::make_mpi_communicator();
    dir = st::test_support::job_temp_dir("shardtrain_pipeline_mpi");
  }
  void TearDown() override {
    comm->barrier();
    if (comm->rank() == 0) fs::remove_all(dir);
  }

  /// One pipeline run on the whole world.
  struct Run {
    std::unique_ptr<st::Backend> backend = st::make_cpu_backend();
    std::unique_ptr<st::GPT2Model> model;
    std::unique_ptr<st::Strategy> strategy;
    st::PipelineParallel* pipe = nullptr;
    st::LossScaler scaler{st::LossScaleConfig{}, false};
    std::vector<double> losses, norms;
  };

  std::unique_ptr<Run> start(const Case& c, bool with_init = true) {
    auto run = std::make_unique<Run>();
    st::TrainConfig cfg;
    cfg.strategy = st::StrategyKind::kPipeline;
    cfg.strategy_name = "pipeline";
    cfg.zero.stage = c.zero_stage;
    cfg.weight_decay = 0.1;
    cfg.gradient_clipping = kClip;
    cfg.gradient_accumulation_steps = c.M;
    cfg.world_size = comm->world_size();
    cfg.micro_batch_size = kGlobal / c.M / (comm->world_size() / c.stages);
    cfg.max_length = kT;
    cfg.pipeline.stages = c.stages;
    cfg.pipeline.schedule = c.schedule;
    cfg.pipeline.virtual_stages = c.virtual_stages;
    cfg.pipeline.partition_method = c.partition;
    cfg.activation_checkpointing = c.checkpointing;
    cfg.plan = st::plan_of(cfg);
    run->model = std::make_unique<st::GPT2Model>(model_with(c.layers, c.dropout), *run->backend);
    std::unique_ptr<st::PipelineParallel> pipe =
        st::make_pipeline_strategy(cfg, *run->backend, *comm);
    run->pipe = pipe.get();
    run->strategy = std::move(pipe);
    run->strategy->setup(*run->model, with_init ? initial_params(c.layers) : std::vector<float>());
    return run;
  }

  void train(Run& run, const Case& c, int64_t first, int64_t count) {
    const int D = comm->world_size() / c.stages;
    Batches batches{c.M, D, run.pipe->replica(), {}, {}};
    Batches next_batches{c.M, D, run.pipe->replica(), {}, {}};
    for (int64_t step = first; step < first + count; ++step) {
      const st::MicroBatchSource next = [&](int64_t k) { return next_batches.get(step + 1, k); };
      const bool lookahead = c.flushless && step + 1 < first + count;
      const auto r = run.pipe->run_step(
          step, learning_rate(step), [&](int64_t k) { return batches.get(step, k); }, run.scaler,
          st::TrainStepOptions{c.M, kClip, kRunSeed}, lookahead ? &next : nullptr);
      if (c.flushless) {  // the steps between the first and the last neither fill nor drain
        const st::PipelineShape& shape = run.pipe->last_step_shape();
        EXPECT_EQ(shape.fill, step == first) << "step " << step;
        EXPECT_EQ(shape.drain, step + 1 == first + count) << "step " << step;
      }
      run.losses.push_back(r.loss);
      run.norms.push_back(r.grad_norm);
    }
  }

  /// The run's full state, through a sharded checkpoint named `name`.
  st::FullState full_state(Run& run, const std::string& name, int64_t step) {
    st::CheckpointInfo info;
    info.model = run.model->config();
    info.progress.step = step;
    st::save_sharded_checkpoint(dir, name, run.model->layout(), *run.strategy, *comm, info);
    return st::load_full_state(st::read_checkpoint_info(dir / name), run.model->layout(), true);
  }

  void expect_matches(const st::FullState& got, const st::FullState& want,
                      const std::string& what) {
    const double p = norm_rel(got.params, want.params);
    const double m = norm_rel(got.exp_avg, want.exp_avg);
    const double v = norm_rel(got.exp_avg_sq, want.exp_avg_sq);
    EXPECT_LE(p, kTolerance) << what << ": parameters";
    EXPECT_LE(m, 1e-5) << what << ": AdamW m";
    EXPECT_LE(v, 1e-5) << what << ": AdamW v";
    EXPECT_EQ(got.optimizer_steps, want.optimizer_steps) << what;
    if (comm->rank() == 0)
      std::printf("  %-48s params %.2e  m %.2e  v %.2e\n", what.c_str(), p, m, v);
  }

  /// Trains `c` for kSteps and compares with the reference.
  void check_case(const Case& c) {
    const int W = comm->world_size();
    if (W % c.stages != 0) return;
    const int D = W / c.stages;
    const std::string what = describe(c, D);
    auto run = start(c);
    train(*run, c, 0, kSteps);
    const bool two_bw = c.schedule == st::PipelineSchedule::k2BW;
    const Reference& ref = reference(c.layers, c.M, two_bw, c.dropout);
    for (int64_t s = 0; s < kSteps; ++s) {
      EXPECT_LE(rel(run->losses[static_cast<size_t>(s)], ref.losses[static_cast<size_t>(s)]),
                kTolerance)
          << what << ": loss of step " << s;
      EXPECT_LE(rel(run->norms[static_cast<size_t>(s)], ref.norms[static_cast<size_t>(s)]),
                kTolerance)
          << what << ": gradient norm of step " << s;
    }
    const std::string name = fmt::format("case{}", case_index++);
    expect_matches(full_state(*run, name, kSteps), ref.states[kSteps - 1], what);
  }

  std::unique_ptr<st::Communicator> comm;
  fs::path dir;
  int case_index = 0;
};

using S = st::PipelineSchedule;

TEST_F(PipelineMpi, TwoStagesEverySchedule) {
  if (comm->world_size() != 2) GTEST_SKIP() << "2 ranks";
  check_case({.schedule = S::kGPipe});
  check_case({.schedule = S::k1F1B});
  check_case({.schedule = S::kInterleaved, .virtual_stages = 2});
  // Chunks of unequal block counts: 5 blocks in 4 chunks, cut by parameters and by time.
  check_case({.schedule = S::kInterleaved, .virtual_stages = 2, .layers = 5});
  check_case({.schedule = S::kInterleaved, .virtual_stages = 2, .layers = 5, .partition = "time"});
  check_case({.schedule = S::kZBH1});
  check_case({.schedule = S::k1F1B, .M = 1});  // the naive pipeline
  check_case({.schedule = S::k1F1B, .M = 8, .partition = "uniform"});
  check_case({.schedule = S::k1F1B, .layers = 3, .partition = "time"});  // cut by measured time
  check_case({.schedule = S::k1F1B, .checkpointing = true});
  check_case({.schedule = S::kZBH1, .checkpointing = true});
  check_case({.schedule = S::k2BW});
  check_case({.schedule = S::k2BW, .flushless = true});
  check_case({.schedule = S::k2BW, .M = 2, .flushless = true});
  check_case({.schedule = S::k2BW, .checkpointing = true, .flushless = true});
}

// Dropout (p = 0.1): each micro-batch's masks are drawn from (run seed, replica, step, micro-batch
// index) in its forward, recompute and backward, whatever order the schedule runs them in: the
// pipeline draws the masks of dp on one rank with the same micro-batches.
TEST_F(PipelineMpi, TwoStagesWithDropoutMatchDataParallel) {
  if (comm->world_size() != 2) GTEST_SKIP() << "2 ranks";
  check_case({.schedule = S::kGPipe, .dropout = 0.1f});
  check_case({.schedule = S::k1F1B, .dropout = 0.1f});
  check_case({.schedule = S::kInterleaved, .virtual_stages = 2, .dropout = 0.1f});
  check_case({.schedule = S::kZBH1, .dropout = 0.1f});
  check_case({.schedule = S::k1F1B, .checkpointing = true, .dropout = 0.1f});
  // 2bw's look-ahead forwards draw the next step's masks.
  check_case({.schedule = S::k2BW, .dropout = 0.1f, .flushless = true});
}

TEST_F(PipelineMpi, FourStagesEverySchedule) {
  if (comm->world_size() != 4) GTEST_SKIP() << "4 ranks";
  check_case({.schedule = S::kGPipe, .stages = 4, .layers = 8});
  check_case({.schedule = S::k1F1B, .stages = 4, .layers = 8});
  check_case({.schedule = S::kInterleaved, .stages = 4, .virtual_stages = 2, .layers = 8});
  check_case({.schedule = S::kZBH1, .stages = 4, .M = 8, .layers = 8});
  check_case({.schedule = S::k2BW, .stages = 4, .layers = 8});
  check_case({.schedule = S::k2BW, .stages = 4, .layers = 8, .flushless = true});
}

TEST_F(PipelineMpi, TwoStagesTimesTwoReplicas) {
  if (comm->world_size() != 4) GTEST_SKIP() << "4 ranks";
  check_case({.schedule = S::k1F1B, .zero_stage = 0});
  check_case({.schedule = S::k1F1B, .zero_stage = 1});
  check_case({.schedule = S::k1F1B, .zero_stage = 2});
  check_case({.schedule = S::kGPipe, .zero_stage = 2});
  check_case({.schedule = S::kInterleaved, .virtual_stages = 2, .zero_stage = 2});
  check_case({.schedule = S::kZBH1, .zero_stage = 1});
  check_case({.schedule = S::k2BW, .zero_stage = 2, .flushless = true});
}

TEST_F(PipelineMpi, CheckpointResumesAsDataParallel) {
  const int W = comm->world_size();
  const Case c{.schedule = S::k1F1B, .stages = W, .layers = 2 * W};
  auto run = start(c);
  train(*run, c, 0, kSteps);
  full_state(*run, "pipeline", kSteps);  // saves it
  // dp on one rank (every rank alone) resumes from the pipeline's checkpoint ...
  auto backend = st::make_cpu_backend();
  auto local = st::make_local_communicator();
  st::GPT2Model model(model_with(c.layers), *backend);
  auto dp = st::make_strategy(dp_options(), *backend, *local);
  dp->setup(model, {});
  st::load_sharded_checkpoint(st::read_checkpoint_info(dir / "pipeline"), model.layout(), *dp,
                              *local);
  st::LossScaler scaler{st::LossScaleConfig{}, false};
  st::TrainStep train_step(model, *dp, *local, *backend, scaler,
                           st::TrainStepOptions{c.M, kClip, kRunSeed});
  Batches batches{c.M, 1, 0, {}, {}};
  for (int64_t step = kSteps; step < kSteps + kMore; ++step)
    train_step.run(step, learning_rate(step), [&](int64_t k) { return batches.get(step, k); });
  const Reference& ref = reference(c.layers, c.M);
  expect_matches(dp->gather_state(), ref.states.back(), "pipeline checkpoint resumed as dp");
  // ... and the pipeline resumes from a dp checkpoint.
  comm->barrier();
  if (comm->rank() == 0) {
    st::CheckpointInfo info;
    info.model = model.config();
    info.progress.step = kSteps;
    auto ref_run = st::make_strategy(dp_options(), *backend, *local);
    st::GPT2Model m2(model_with(c.layers), *backend);
    ref_run->setup(m2, {});
    ref_run->load_state(ref.states[kSteps - 1]);
    st::save_sharded_checkpoint(dir, "dp", m2.layout(), *ref_run, *local, info);
  }
  comm->barrier();
  auto resumed = start(c, /*with_init=*/false);
  st::load_sharded_checkpoint(st::read_checkpoint_info(dir / "dp"), resumed->model->layout(),
                              *resumed->strategy, *comm);
  train(*resumed, c, kSteps, kMore);
  expect_matches(full_state(*resumed, "pipeline-end", kSteps + kMore), ref.states.back(),
                 "dp checkpoint resumed as pipeline");
}

}  // namespace
