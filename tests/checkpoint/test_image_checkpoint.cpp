// Checkpoints, resume and --init-from for image classifiers: an interrupted and resumed run ends
// bit for bit where an uninterrupted one does (parameters, AdamW state, batch-norm running
// statistics), torchvision-named weights round-trip through safetensors, a 1000-class head is
// replaced by a fresh one for a 10-class data set only when asked, and mismatches are clear
// errors. The training runs skip when Fashion-MNIST is not installed.
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/image_weights.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "core/rng.h"
#include "data/image_dataset.h"
#include "io/atomic_file.h"
#include "memory/flat_buffer.h"
#include "model/image/image_zoo.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace shardtrain;

namespace {

using Result = test_support::CommandResult;

Result run(const std::string& args) { return test_support::run_shardtrain(args); }

bool have_fashion_mnist() {
  try {
    find_fashion_mnist_dir();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

/// 128 Fashion-MNIST images in batches of 32: 4 steps per epoch, 2 epochs = 8 steps.
std::string small_run(const std::string& strategy) {
  return "train --model cnn --dataset fashion-mnist --device cpu --batch-size 32 --num-samples 128 "
         "--eval-samples 64 --epochs 2 --lr 3e-3 --warmup-steps 2 --log-interval 100 --seed 7 "
         "--strategy " +
         strategy;
}

/// The raw bytes of tensor `name` of a safetensors file.
std::string tensor_bytes(const fs::path& file, const std::string& name) {
  const SafetensorsFile st(file);
  std::string bytes(st.entry(name).bytes, '\0');
  st.read(name, bytes.data());
  return bytes;
}

std::vector<float> tensor_floats(const fs::path& file, const std::string& name) {
  const std::string b = tensor_bytes(file, name);
  std::vector<float> v(b.size() / sizeof(float));
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

ImageModelSpec cnn_spec(int64_t classes, int64_t channels = 1, int64_t side = 28) {
  return {
      .name = "cnn", .channels = channels, .height = side, .width = side, .num_classes = classes};
}

int64_t buffer_numel(const ImageModel& m) {
  int64_t n = 0;
  for (const ModelBuffer& b : m.state_buffers()) n += b.numel;
  return n;
}

/// A model's fresh parameters (seed) and non-trivial running statistics.
struct Weights {
  std::vector<float> params, buffers;
};
Weights make_weights(const ImageModel& m, uint64_t seed) {
  Weights w;
  w.params.assign(static_cast<size_t>(m.layout().numel()), 0.0f);
  m.init_parameters(w.params.data(), seed);
  SplitMix64 rng{seed + 100};
  for (int64_t i = 0; i < buffer_numel(m); ++i)
    w.buffers.push_back(0.25f + static_cast<float>(rng.uniform()));  // positive: valid variances
  return w;
}

/// Evaluation logits of `m` with weights `w` on `images` [batch, C, H, W].
std::vector<float> logits(ImageModel& m, Backend& be, const Weights& w,
                          const std::vector<float>& images, int64_t batch) {
  FlatBuffer params(be, DType::kF32, m.layout().numel());
  be.copy_from_host(params.data(), w.params.data(), w.params.size() * sizeof(float));
  m.bind(params.view(), Tensor());
  m.write_state_buffers(w.buffers.data());
  return m.predict(images.data(), batch);
}

}  // namespace

// N steps uninterrupted vs N/2 (here 3 of 8, mid-epoch) + save + resume: the final checkpoints
// hold bit-identical parameters, AdamW moments and batch-norm running statistics.
class ImageResume : public ::testing::TestWithParam<std::string> {};

TEST_P(ImageResume, ContinuesBitForBit) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  const fs::path a = test_support::make_temp_dir("image_resume_a");
  const fs::path b = test_support::make_temp_dir("image_resume_b");
  const Result ra = run(small_run(GetParam()) + " --save-interval 3 --output-dir " + a.string());
  ASSERT_EQ(ra.status, 0) << ra.output;
  ASSERT_TRUE(fs::exists(a / "checkpoint-000003" / "manifest.json")) << ra.output;
  const Result rb = run(small_run(GetParam()) + " --resume " + (a / "checkpoint-000003").string() +
                        " --output-dir " + b.string());
  ASSERT_EQ(rb.status, 0) << rb.output;
  EXPECT_CONTAINS(rb.output, "resumed from");
  EXPECT_CONTAINS(rb.output, "at step 3 (epoch 1, step 3 of the epoch)");

  const std::string shard = "rank-00000-of-00001.safetensors";
  const fs::path fa = a / "checkpoint-000008" / shard, fb = b / "checkpoint-000008" / shard;
  ASSERT_TRUE(fs::exists(fa)) << ra.output;
  ASSERT_TRUE(fs::exists(fb)) << rb.output;
  for (const char* t : {"params", "exp_avg", "exp_avg_sq", "buffers"})
    EXPECT_TRUE(tensor_bytes(fa, t) == tensor_bytes(fb, t)) << t << " differs after resume";
  // Training moved the weights and the statistics: the comparison is not of initial values.
  EXPECT_FALSE(tensor_bytes(a / "checkpoint-000003" / shard, "params") ==
               tensor_bytes(fa, "params"));
  const std::vector<float> stats = tensor_floats(fa, "buffers");
  const std::vector<float> early = tensor_floats(a / "checkpoint-000003" / shard, "buffers");
  ASSERT_EQ(stats.size(), early.size());
  EXPECT_NE(stats, early);
  // The first buffer is features.1.running_mean (initially 0): it holds batch means now.
  EXPECT_TRUE(std::any_of(stats.begin(), stats.begin() + 32, [](float x) { return x != 0.0f; }));

  // The manifest names the model and its statistics.
  const CheckpointInfo info = read_checkpoint_info(b);
  ASSERT_TRUE(info.image.has_value());
  EXPECT_EQ(info.image->name, "cnn");
  EXPECT_EQ(info.image->num_classes, 10);
  EXPECT_EQ(info.image->channels, 1);
  EXPECT_EQ(info.image->height, 28);
  EXPECT_EQ(info.progress.step, 8);
  EXPECT_EQ(info.manifest.at("buffers").at("tensors").at(0).at("name"), "features.1.running_mean");

  // Without --model, --resume takes the model from the checkpoint.
  const Result again =
      run("train --dataset fashion-mnist --device cpu --batch-size 32 --num-samples 128 --epochs 2 "
          "--eval-samples 64 --no-save --resume " +
          (a / "checkpoint-000006").string() + " --output-dir " + (b / "again").string());
  EXPECT_EQ(again.status, 0) << again.output;
  EXPECT_CONTAINS(again.output, "train cnn (");

  // --init-from a checkpoint: its weights and statistics, a fresh optimizer and step count.
  const Result init =
      run("train --model cnn --dataset fashion-mnist --device cpu --batch-size 32 --num-samples 64 "
          "--eval-samples 32 --max-steps 1 --no-save --init-from " +
          a.string() + " --output-dir " + (b / "init").string());
  EXPECT_EQ(init.status, 0) << init.output;
  EXPECT_CONTAINS(init.output, "initialized from checkpoint " + (a / "checkpoint-000008").string());

  // A checkpoint of another model: both are named.
  const Result wrong = run(
      "train --model cnn_lstm --dataset fashion-mnist --device cpu --batch-size 32 --num-samples "
      "128 --epochs 2 --resume " +
      (a / "checkpoint-000003").string() + " --output-dir " + b.string());
  EXPECT_EQ(wrong.status, 2) << wrong.output;
  EXPECT_CONTAINS(wrong.output, "holds image model 'cnn' (10 classes, input 1×28×28)");
  EXPECT_CONTAINS(wrong.output, "this run trains image model 'cnn_lstm'");
  // ... and of a GPT-2 run.
  const Result gpt = run("train --model gpt2-tiny --dataset wikitext-2 --device cpu --resume " +
                         (a / "checkpoint-000003").string() + " --output-dir " + b.string());
  EXPECT_EQ(gpt.status, 2) << gpt.output;
  EXPECT_CONTAINS(gpt.output, "holds image model 'cnn'");
  EXPECT_CONTAINS(gpt.output, "GPT-2 model 'gpt2-tiny'");
  // ... and of the GPT-2 tools.
  const Result exp = run("export --checkpoint " + b.string() + " --output " + (b / "hf").string());
  EXPECT_EQ(exp.status, 2) << exp.output;
  EXPECT_CONTAINS(exp.output, "works on GPT-2 checkpoints only");
  fs::remove_all(a);
  fs::remove_all(b);
}

INSTANTIATE_TEST_SUITE_P(Strategies, ImageResume, ::testing::Values("dp", "zero3"));

// Torchvision-named weights written as safetensors load into a fresh model (other seed) exactly:
// the same parameters, statistics and evaluation logits.
TEST(ImageInitFrom, SafetensorsRoundTrip) {
  auto be = make_cpu_backend();
  auto src = make_image_model(cnn_spec(10), *be);
  auto dst = make_image_model(cnn_spec(10), *be);
  const Weights w = make_weights(*src, 1);
  const fs::path dir = test_support::make_temp_dir("image_init_from");
  const fs::path file = dir / "cnn.safetensors";
  save_torchvision_weights(file, *src, w.params.data(), w.buffers.data());
  // Names are torchvision's state-dict names.
  const SafetensorsFile st(file);
  EXPECT_TRUE(st.contains("features.0.weight"));
  EXPECT_TRUE(st.contains("features.1.running_var"));
  EXPECT_TRUE(st.contains("classifier.weight"));

  Weights loaded = make_weights(*dst, 2);
  ASSERT_NE(loaded.params, w.params);
  const TorchvisionLoadReport r =
      load_torchvision_weights(file, *dst, loaded.params.data(), loaded.buffers.data(), false);
  EXPECT_TRUE(r.fresh_head.empty());
  EXPECT_EQ(r.file_classes, 10);
  EXPECT_EQ(r.tensors_loaded,
            static_cast<int64_t>(dst->layout().tensors().size() + dst->state_buffers().size()));
  // Parameters compared tensor by tensor (alignment padding between them is not in the file).
  for (const ParamTensor* t : dst->layout().tensors())
    EXPECT_TRUE(std::equal(w.params.begin() + t->offset, w.params.begin() + t->offset + t->numel,
                           loaded.params.begin() + t->offset))
        << t->name;
  EXPECT_EQ(loaded.buffers, w.buffers);

  std::vector<float> images(4 * 28 * 28);
  SplitMix64 rng{5};
  for (float& x : images) x = static_cast<float>(rng.uniform()) * 2 - 1;
  const std::vector<float> want = logits(*src, *be, w, images, 4);
  const std::vector<float> got = logits(*dst, *be, loaded, images, 4);
  ASSERT_EQ(want.size(), 40u);
  EXPECT_EQ(got, want);
  fs::remove_all(dir);
}

// ImageNet-style 1000-class weights into a 10-class model: with replace_head the body equals the
// file and the head keeps its fresh initialization; without it, a ConfigError says what to do.
TEST(ImageInitFrom, HeadReplacement) {
  auto be = make_cpu_backend();
  auto big = make_image_model(cnn_spec(1000), *be);
  auto small = make_image_model(cnn_spec(10), *be);
  const Weights file_w = make_weights(*big, 3);
  const fs::path dir = test_support::make_temp_dir("image_head");
  const fs::path file = dir / "cnn1000.safetensors";
  save_torchvision_weights(file, *big, file_w.params.data(), file_w.buffers.data());

  const Weights fresh = make_weights(*small, 4);
  Weights w = fresh;
  EXPECT_THROW_MSG(load_torchvision_weights(file, *small, w.params.data(), w.buffers.data(), false),
                   ConfigError, "pass --replace-head");
  EXPECT_THROW_MSG(load_torchvision_weights(file, *small, w.params.data(), w.buffers.data(), false),
                   ConfigError, "the file's head has 1000 classes");

  w = fresh;
  const TorchvisionLoadReport r =
      load_torchvision_weights(file, *small, w.params.data(), w.buffers.data(), true);
  EXPECT_EQ(r.file_classes, 1000);
  EXPECT_EQ(r.fresh_head, (std::vector<std::string>{"classifier.weight", "classifier.bias"}));
  const std::set<std::string> head(r.fresh_head.begin(), r.fresh_head.end());
  std::map<std::string, const ParamTensor*> in_file;
  for (const ParamTensor* t : big->layout().tensors()) in_file[t->name] = t;
  for (const ParamTensor* t : small->layout().tensors()) {
    const auto got = w.params.begin() + t->offset;
    if (head.count(t->name)) {
      EXPECT_TRUE(std::equal(got, got + t->numel, fresh.params.begin() + t->offset)) << t->name;
    } else {
      const ParamTensor* f = in_file.at(t->name);
      ASSERT_EQ(f->numel, t->numel);
      EXPECT_TRUE(std::equal(got, got + t->numel, file_w.params.begin() + f->offset)) << t->name;
    }
  }
  EXPECT_EQ(w.buffers, file_w.buffers);
  fs::remove_all(dir);
}

// The head is the last Linear of every member, by torchvision's names.
TEST(ImageInitFrom, HeadParameterNames) {
  auto be = make_cpu_backend();
  const auto names = [&](const std::string& model, int64_t side) {
    ImageModelSpec s = cnn_spec(10, 3, side);
    s.name = model;
    return make_image_model(s, *be)->head_parameter_names();
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(names("mobilenet_v2", 32), (V{"classifier.1.weight", "classifier.1.bias"}));
  EXPECT_EQ(names("efficientnet_b0", 32), (V{"classifier.1.weight", "classifier.1.bias"}));
  EXPECT_EQ(names("vgg11_bn", 32), (V{"classifier.6.weight", "classifier.6.bias"}));
  EXPECT_EQ(names("cnn_lstm", 28), (V{"classifier.weight", "classifier.bias"}));
  EXPECT_EQ(names("ensemble:cnn,cnn_lstm", 28),
            (V{"members.0.classifier.weight", "members.0.classifier.bias",
               "members.1.classifier.weight", "members.1.classifier.bias"}));
}

// A body tensor of another shape (weights of a 3-channel model for 1-channel images), a missing
// tensor and an unknown one are ConfigErrors naming the tensor and both shapes; num_batches_tracked
// is ignored.
TEST(ImageInitFrom, MismatchesAreNamed) {
  auto be = make_cpu_backend();
  auto rgb = make_image_model(cnn_spec(10, 3), *be);
  auto gray = make_image_model(cnn_spec(10, 1), *be);
  const fs::path dir = test_support::make_temp_dir("image_mismatch");
  const Weights rgb_w = make_weights(*rgb, 5);
  save_torchvision_weights(dir / "rgb.safetensors", *rgb, rgb_w.params.data(),
                           rgb_w.buffers.data());
  Weights w = make_weights(*gray, 6);
  EXPECT_THROW_MSG(load_torchvision_weights(dir / "rgb.safetensors", *gray, w.params.data(),
                                            w.buffers.data(), true),
                   ConfigError,
                   "tensor 'features.0.weight': expected shape [32, 1, 3, 3], found [32, 3, 3, 3]");

  // The gray model's own weights with one statistic dropped and num_batches_tracked added.
  const Weights gw = make_weights(*gray, 7);
  std::vector<SafetensorEntry> entries;
  for (const ParamTensor* t : gray->layout().tensors())
    entries.push_back({t->name, "F32", t->shape, gw.params.data() + t->offset,
                       static_cast<size_t>(t->numel) * 4, 0});
  int64_t off = 0;
  for (const ModelBuffer& b : gray->state_buffers()) {
    if (b.name != "features.4.running_var")
      entries.push_back(
          {b.name, "F32", {b.numel}, gw.buffers.data() + off, static_cast<size_t>(b.numel) * 4, 0});
    off += b.numel;
  }
  const int64_t tracked = 12;
  entries.push_back({"features.1.num_batches_tracked", "I64", {}, &tracked, 8, 0});
  write_safetensors(dir / "partial.safetensors", entries);
  EXPECT_THROW_MSG(load_torchvision_weights(dir / "partial.safetensors", *gray, w.params.data(),
                                            w.buffers.data(), false),
                   ConfigError, "tensor 'features.4.running_var' (shape [32]) is missing");

  entries.push_back({"features.4.running_var", "F32", {32}, gw.buffers.data(), 32 * 4, 0});
  const std::vector<float> extra(7, 1.0f);
  entries.push_back({"fc.weight", "F32", {7}, extra.data(), 7 * 4, 0});
  write_safetensors(dir / "extra.safetensors", entries);
  EXPECT_THROW_MSG(load_torchvision_weights(dir / "extra.safetensors", *gray, w.params.data(),
                                            w.buffers.data(), false),
                   ConfigError,
                   "tensor 'fc.weight' (shape [7]) is in the file but not in the model");

  entries.pop_back();
  write_safetensors(dir / "ok.safetensors", entries);
  const TorchvisionLoadReport r = load_torchvision_weights(
      dir / "ok.safetensors", *gray, w.params.data(), w.buffers.data(), false);
  EXPECT_EQ(r.ignored, std::vector<std::string>{"features.1.num_batches_tracked"});
  fs::remove_all(dir);
}

// The command line: --init-from a 1000-class file trains a 10-class cnn with --replace-head (and
// says so), and is an error without it.
TEST(ImageInitFrom, CommandLine) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  auto be = make_cpu_backend();
  auto big = make_image_model(cnn_spec(1000), *be);
  const Weights w = make_weights(*big, 8);
  const fs::path dir = test_support::make_temp_dir("image_init_cli");
  const fs::path file = dir / "cnn1000.safetensors";
  save_torchvision_weights(file, *big, w.params.data(), w.buffers.data());
  const std::string args =
      "train --model cnn --dataset fashion-mnist --device cpu --batch-size 32 --num-samples 64 "
      "--eval-samples 32 --max-steps 1 --no-save --output-dir " +
      (dir / "out").string() + " --init-from " + file.string();
  const Result no = run(args);
  EXPECT_EQ(no.status, 2) << no.output;
  EXPECT_CONTAINS(no.output, "pass --replace-head");
  const Result yes = run(args + " --replace-head");
  ASSERT_EQ(yes.status, 0) << yes.output;
  EXPECT_CONTAINS(yes.output, "--replace-head: the file's classifier head (1000 classes)");
  EXPECT_CONTAINS(yes.output, "classifier.weight, classifier.bias keep their fresh initialization");
  const Result lm =
      run("train --model gpt2-tiny --dataset wikitext-2 --device cpu --replace-head "
          "--output-dir " +
          (dir / "out").string());
  EXPECT_EQ(lm.status, 2) << lm.output;
  EXPECT_CONTAINS(lm.output, "--replace-head keeps a fresh classifier head");
  fs::remove_all(dir);
}

// Two ranks (shardtrain launch, zero2, per-rank batch norm): each rank's own running statistics
// are saved and restored, so the resumed pair ends bit for bit where the uninterrupted one does.
// Compared at step 6, before any validation (which gives every rank rank 0's statistics).
TEST(ImageResumeTwoRanks, RestoresEachRanksStatistics) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  const fs::path a = test_support::make_temp_dir("image_resume2_a");
  const fs::path b = test_support::make_temp_dir("image_resume2_b");
  const std::string train =
      "env OMP_NUM_THREADS=1 " + std::string(SHARDTRAIN_BINARY) +
      " launch --nproc-per-node 2 -- train --model cnn --dataset fashion-mnist --device cpu "
      "--batch-size 16 --num-samples 128 --eval-samples 32 --epochs 2 --lr 3e-3 --warmup-steps 2 "
      "--log-interval 100 --seed 3 --strategy zero2 --eval-interval 100 --save-interval 3";
  const Result ra = test_support::run_command(train + " --output-dir " + a.string() + " 2>&1");
  ASSERT_EQ(ra.status, 0) << ra.output;
  const Result rb =
      test_support::run_command(train + " --resume " + (a / "checkpoint-000003").string() +
                                " --output-dir " + b.string() + " 2>&1");
  ASSERT_EQ(rb.status, 0) << rb.output;
  std::vector<std::string> stats;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string shard = fmt::format("rank-{:05d}-of-00002.safetensors", rank);
    const fs::path fa = a / "checkpoint-000006" / shard, fb = b / "checkpoint-000006" / shard;
    ASSERT_TRUE(fs::exists(fa) && fs::exists(fb)) << ra.output << rb.output;
    for (const char* t : {"params", "exp_avg", "exp_avg_sq", "buffers"})
      EXPECT_TRUE(tensor_bytes(fa, t) == tensor_bytes(fb, t))
          << t << " of rank " << rank << " differs after resume";
    stats.push_back(tensor_bytes(fa, "buffers"));
  }
  // The ranks saw different images: their statistics differ, so each needs its own back.
  EXPECT_NE(stats[0], stats[1]);
  fs::remove_all(a);
  fs::remove_all(b);
}
