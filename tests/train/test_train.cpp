// End-to-end training on the CPU: the loss falls, resuming from a checkpoint continues the exact
// same trajectory (bit-identical), checkpoints are verified, and metrics.jsonl is written.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint/checkpoint.h"
#include "checkpoint/sharded_checkpoint.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "train/trainer.h"

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("shardtrain_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

TrainConfig tiny_config(const fs::path& out) {
  TrainConfig c;
  c.model = "gpt2-micro";
  c.device = "cpu";
  c.train_file = std::string(SHARDTRAIN_TEST_DATA_DIR) + "/wikitext-2/wiki.valid.tokens";
  c.valid_file = std::string(SHARDTRAIN_TEST_DATA_DIR) + "/wikitext-2/wiki.test.tokens";
  c.eval_samples = 16;
  c.cache_dir = (out / "cache").string();
  c.output_dir = (out / "run").string();
  c.max_length = 32;
  c.micro_batch_size = 4;
  c.gradient_accumulation_steps = 1;
  c.train_batch_size = 4;
  c.lr = 3e-3;
  c.warmup_steps = 2;
  c.log_interval = 1000;
  c.seed = 1234;
  return c;
}

std::vector<nlohmann::json> read_metrics(const fs::path& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace

TEST(Train, LossFallsAndMetricsAreWritten) {
  const fs::path dir = temp_dir("loss");
  TrainConfig c = tiny_config(dir);
  c.max_steps = 40;
  c.log_interval = 10;
  auto comm = make_local_communicator();
  const TrainSummary s = train(c, *comm);
  ASSERT_EQ(s.losses.size(), 40u);
  EXPECT_NEAR(s.first_loss, std::log(50257.0), 0.3);  // a fresh model predicts ~uniformly
  double tail = 0;
  for (size_t i = 35; i < 40; ++i) tail += s.losses[i] / 5;
  EXPECT_LT(tail, s.first_loss - 2.5);
  EXPECT_TRUE(std::isfinite(s.val_loss));
  EXPECT_NEAR(s.val_ppl, std::exp(s.val_loss), 1e-6 * s.val_ppl);

  const auto records = read_metrics(fs::path(c.output_dir) / "metrics.jsonl");
  int steps = 0, epochs = 0, vals = 0;
  for (const auto& r : records) {
    if (r.contains("loss")) {
      ++steps;
      for (const char* k : {"step", "epoch", "loss", "lr", "tokens_per_s"})
        EXPECT_TRUE(r.contains(k)) << k;
    }
    if (r.contains("peak_memory_bytes")) {
      ++epochs;
      for (const char* k : {"epoch", "avg_loss", "time_s", "tokens_per_s"})
        EXPECT_TRUE(r.contains(k)) << k;
      EXPECT_GT(r["peak_memory_bytes"].get<double>(), 0);
    }
    if (r.contains("val_loss") && r.contains("val_ppl") && !r.contains("event")) ++vals;
  }
  EXPECT_EQ(steps, 5);  // steps 1, 10, 20, 30, 40
  EXPECT_GE(epochs, 1);
  EXPECT_GE(vals, 1);
  // run.json: what the run was, for `shardtrain report`.
  std::ifstream run_file(fs::path(c.output_dir) / "run.json");
  ASSERT_TRUE(run_file) << "no run.json";
  const auto run = nlohmann::json::parse(run_file);
  EXPECT_EQ(run["strategy"], "dp");
  EXPECT_EQ(run["model"], c.model);
  EXPECT_EQ(run["world_size"], 1);
  EXPECT_EQ(run["micro_batch_size"], 4);
  EXPECT_EQ(run["global_batch"], 4);
  EXPECT_EQ(run["max_length"], c.max_length);
  EXPECT_GT(run["parameters"].get<int64_t>(), 0);
  EXPECT_GT(run["flops_per_token"].get<double>(), 0);
  EXPECT_EQ(run["on_gpu"], false);
  fs::remove_all(dir);
}

// wall_clock_breakdown: the phases are logged for every log line, none is negative, and together
// they account for the step time (the marks bracket all of a step but its final synchronize).
TEST(Train, WallClockBreakdownAccountsForTheStepTime) {
  const fs::path dir = temp_dir("breakdown");
  TrainConfig c = tiny_config(dir);
  c.max_steps = 6;
  c.log_interval = 3;
  c.gradient_accumulation_steps = 2;  // forward and backward summed over the micro-steps
  c.train_batch_size = 8;
  c.wall_clock_breakdown = true;
  c.save_checkpoints = false;
  auto comm = make_local_communicator();
  train(c, *comm);
  int logged = 0;
  for (const auto& r : read_metrics(fs::path(c.output_dir) / "metrics.jsonl")) {
    if (!r.contains("loss")) continue;
    ++logged;
    double sum = 0;
    for (const char* k : {"forward_ms", "backward_ms", "reduce_wait_ms", "optimizer_ms"}) {
      ASSERT_TRUE(r.contains(k)) << k;
      EXPECT_GE(r[k].get<double>(), 0.0) << k;
      sum += r[k].get<double>();
    }
    EXPECT_GT(r["forward_ms"].get<double>(), 0.0);
    EXPECT_GT(r["backward_ms"].get<double>(), 0.0);
    const double step_ms = 1e3 * r["step_time_s"].get<double>();
    EXPECT_LE(sum, step_ms * 1.001 + 0.01);
    EXPECT_GE(sum, 0.8 * step_ms);
  }
  EXPECT_EQ(logged, 3);  // steps 1, 3 and 6
  fs::remove_all(dir);
}

TEST(Train, ResumeContinuesTheSameTrajectoryBitForBit) {
  const fs::path dir = temp_dir("resume");
  TrainConfig c = tiny_config(dir);
  c.num_samples = 24;                 // 3 optimizer steps per epoch: resume crosses epochs
  c.gradient_accumulation_steps = 2;  // and accumulates gradients
  c.train_batch_size = 8;
  c.max_steps = 12;
  c.eval_interval = 1000;
  auto comm = make_local_communicator();

  TrainConfig straight = c;
  straight.output_dir = (dir / "straight").string();
  const TrainSummary a = train(straight, *comm);

  TrainConfig first = c;
  first.output_dir = (dir / "first").string();
  first.save_interval = 5;
  train(first, *comm);
  ASSERT_TRUE(fs::exists(fs::path(first.output_dir) / "checkpoint-000005" / "manifest.json"));

  TrainConfig second = c;
  second.output_dir = (dir / "second").string();
  second.resume = (fs::path(first.output_dir) / "checkpoint-000005").string();
  const TrainSummary b = train(second, *comm);

  ASSERT_EQ(a.losses.size(), 12u);
  ASSERT_EQ(b.losses.size(), 7u);
  for (size_t i = 0; i < 7; ++i) EXPECT_EQ(a.losses[5 + i], b.losses[i]) << "step " << 6 + i;
  // Final weights and optimizer state are byte-identical.
  const char* shard = "rank-00000-of-00001.safetensors";
  EXPECT_EQ(read_file(fs::path(straight.output_dir) / "checkpoint-000012" / shard),
            read_file(fs::path(second.output_dir) / "checkpoint-000012" / shard));

  // Resumed at its last step, a run says there is nothing left (not "loss 0.0000 → 0.0000").
  TrainConfig third = c;
  third.output_dir = (dir / "third").string();
  third.resume = (fs::path(second.output_dir) / "checkpoint-000012").string();
  testing::internal::CaptureStdout();
  const TrainSummary d = train(third, *comm);
  const std::string printed = testing::internal::GetCapturedStdout();
  EXPECT_TRUE(d.losses.empty());
  EXPECT_NE(printed.find("done | 12 steps | no step left to run"), std::string::npos) << printed;
  EXPECT_EQ(printed.find("loss 0.0000"), std::string::npos) << printed;
  // --num-samples 24: the banner counts the samples used, out of the corpus's.
  EXPECT_NE(printed.find("24 training samples of the corpus's "), std::string::npos) << printed;
  fs::remove_all(dir);
}

TEST(Train, SgdResumeContinuesTheSameTrajectoryBitForBit) {
  const fs::path dir = temp_dir("resume_sgd");
  TrainConfig c = tiny_config(dir);
  c.optimizer = OptimizerKind::kSGD;
  c.momentum = 0.9;
  c.nesterov = true;
  c.weight_decay = 1e-3;
  c.lr = 0.05;
  c.num_samples = 24;  // 3 optimizer steps per epoch: resume crosses epochs
  c.max_steps = 8;
  c.eval_interval = 1000;
  auto comm = make_local_communicator();

  TrainConfig straight = c;
  straight.output_dir = (dir / "straight").string();
  const TrainSummary a = train(straight, *comm);

  TrainConfig first = c;
  first.output_dir = (dir / "first").string();
  first.save_interval = 4;
  train(first, *comm);
  const fs::path ck = fs::path(first.output_dir) / "checkpoint-000004";
  ASSERT_TRUE(fs::exists(ck / "manifest.json"));
  // The checkpoint says it holds SGD state, and holds no second moment.
  const CheckpointInfo info = read_checkpoint_info(ck);
  EXPECT_EQ(info.optimizer, OptimizerKind::kSGD);
  EXPECT_EQ(info.manifest.at("optimizer").at("type"), "SGD");
  auto be = make_cpu_backend();
  GPT2Model model(gpt2_preset("gpt2-micro"), *be);
  const FullState saved = load_full_state(info, model.layout(), true);
  EXPECT_EQ(saved.optimizer, OptimizerKind::kSGD);
  EXPECT_EQ(saved.exp_avg.size(), static_cast<size_t>(model.layout().numel()));
  EXPECT_TRUE(saved.exp_avg_sq.empty());
  EXPECT_EQ(saved.optimizer_steps, 4);
  double buf_norm = 0;
  for (float x : saved.exp_avg) buf_norm += static_cast<double>(x) * x;
  EXPECT_GT(buf_norm, 0.0);  // the momentum buffer was saved, not zeros

  TrainConfig second = c;
  second.output_dir = (dir / "second").string();
  second.resume = ck.string();
  const TrainSummary b = train(second, *comm);
  ASSERT_EQ(a.losses.size(), 8u);
  ASSERT_EQ(b.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(a.losses[4 + i], b.losses[i]) << "step " << 5 + i;
  // Final weights and momentum buffers are byte-identical.
  const char* shard = "rank-00000-of-00001.safetensors";
  EXPECT_EQ(read_file(fs::path(straight.output_dir) / "checkpoint-000008" / shard),
            read_file(fs::path(second.output_dir) / "checkpoint-000008" / shard));

  // SGD state cannot seed AdamW (nor the reverse): a clear CheckpointError.
  TrainConfig wrong = tiny_config(dir);
  wrong.output_dir = (dir / "wrong").string();
  wrong.resume = ck.string();
  wrong.max_steps = 6;
  try {
    train(wrong, *comm);
    FAIL() << "SGD state resumed into AdamW";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("--optimizer sgd"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Checkpoint, CorruptionAndIncompleteSavesAreDetected) {
  const fs::path dir = temp_dir("corrupt");
  TrainConfig c = tiny_config(dir);
  c.max_steps = 2;
  auto comm = make_local_communicator();
  train(c, *comm);
  const fs::path out = c.output_dir;
  const fs::path ck = resolve_checkpoint(out);
  EXPECT_EQ(ck.filename(), "checkpoint-000002");

  // A save that died half-way leaves a temporary directory that is never picked up.
  fs::create_directories(out / ".checkpoint-000004.tmp.999");
  EXPECT_EQ(resolve_checkpoint(out), ck);

  GPT2Config mc = gpt2_preset("gpt2-micro");
  auto be = make_cpu_backend();
  GPT2Model model(mc, *be);
  const CheckpointInfo info = read_checkpoint_info(out);
  EXPECT_EQ(info.progress.step, 2);
  EXPECT_NO_THROW(load_full_state(info, model.layout(), true));

  const fs::path shard = ck / "rank-00000-of-00001.safetensors";
  {  // flip one byte of the state
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  EXPECT_THROW(load_full_state(info, model.layout(), true), CheckpointError);
  fs::resize_file(shard, 100);
  try {
    load_full_state(info, model.layout(), true);
    FAIL() << "truncated checkpoint accepted";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("rank-00000-of-00001.safetensors"), std::string::npos)
        << e.what();
  }
  write_file_atomic(ck / "manifest.json", "{ not json");
  EXPECT_THROW(read_checkpoint_info(ck), CheckpointError);
  EXPECT_THROW(resolve_checkpoint(dir / "nowhere"), CheckpointError);

  // Resuming a checkpoint of another model is refused before any work.
  TrainConfig other = tiny_config(dir);
  other.model = "gpt2-tiny";
  other.resume = (dir / "nowhere").string();
  EXPECT_THROW(train(other, *comm), CheckpointError);
  fs::remove_all(dir);
}

TEST(Checkpoint, HuggingFaceLayoutRoundTrip) {
  const fs::path dir = temp_dir("hf");
  GPT2Config mc = gpt2_preset("gpt2-micro");
  auto be = make_cpu_backend();
  GPT2Model model(mc, *be);
  std::vector<float> w(static_cast<size_t>(model.layout().numel()), 0.f), back(w.size(), 0.f);
  model.init_parameters(w.data(), 99);
  save_hf_weights(dir / "model.safetensors", model.layout(), w.data());
  load_hf_weights(dir / "model.safetensors", model.layout(), back.data());
  EXPECT_EQ(w, back);
  // A different model shape is reported tensor by tensor.
  GPT2Model tiny(gpt2_preset("gpt2-tiny"), *be);
  std::vector<float> t(static_cast<size_t>(tiny.layout().numel()));
  try {
    load_hf_weights(dir / "model.safetensors", tiny.layout(), t.data());
    FAIL() << "mismatched shapes accepted";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("transformer.wte.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("missing tensor 'transformer.h.2.ln_1.weight'"),
              std::string::npos);
  }
  fs::remove_all(dir);
}
