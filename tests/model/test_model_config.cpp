// `--model` takes a Hugging Face style config.json as well as a preset: the keys and their
// aliases, every refusal with the file, key, value and fix in its message, the parameter count
// of a large custom shape, and a tiny custom shape trained through the CLI, then resumed,
// exported and sampled from its checkpoint without the json.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/checkpoint.h"
#include "core/error.h"
#include "model/gpt2.h"
#include "model/gpt2_config.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace shardtrain;

namespace {

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() /
                     ("shardtrain_model_config_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

fs::path write(const fs::path& file, const std::string& text) {
  fs::create_directories(file.parent_path());
  std::ofstream(file) << text;
  return file;
}

GPT2Config parse(const std::string& text) { return parse_gpt2_config(text, "my.json", "my"); }

/// The ConfigError message parse() throws for `text` ("" when it accepts it).
std::string parse_error(const std::string& text) {
  try {
    parse(text);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

void expect_refused(const std::string& text, std::initializer_list<const char*> needles) {
  const std::string msg = parse_error(text);
  ASSERT_FALSE(msg.empty()) << "accepted: " << text;
  EXPECT_NE(msg.find("my.json"), std::string::npos) << msg;
  for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << n << "\n" << msg;
}

const char* kTiny =
    R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64, "vocab_size": 50257})";

using Result = shardtrain::test_support::CommandResult;

Result run(const std::string& args) { return shardtrain::test_support::run_shardtrain(args); }

}  // namespace

TEST(ModelConfig, ReadsTheGpt2Keys) {
  const GPT2Config c = parse(kTiny);
  EXPECT_EQ(c.name, "my");
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.n_embd, 32);
  EXPECT_EQ(c.n_head, 4);
  EXPECT_EQ(c.n_positions, 64);
  EXPECT_EQ(c.vocab_size, 50257);
  // Other Hugging Face keys are ignored; the ones that change the model are checked.
  const GPT2Config hf = parse(R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
      "activation_function": "gelu_new", "n_inner": null, "layer_norm_epsilon": 1e-5,
      "n_layer": 3, "n_embd": 64, "n_head": 2, "n_positions": 128, "n_ctx": 128,
      "vocab_size": 50304, "torch_dtype": "float32"})");
  EXPECT_EQ(hf.n_layer, 3);
  EXPECT_EQ(hf.vocab_size, 50304);
  EXPECT_NO_THROW(parse(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64,
      "vocab_size": 50257, "n_inner": 128, "activation_function": "gelu"})"));
}

// Dropout probabilities: Hugging Face's names, absent or null = 0 (the presets' value too),
// anything outside [0, 1) refused with the key, the value and the fix.
TEST(ModelConfig, ReadsDropoutProbabilities) {
  const GPT2Config none = parse(kTiny);
  EXPECT_EQ(none.embd_pdrop, 0.f);
  EXPECT_EQ(none.attn_pdrop, 0.f);
  EXPECT_EQ(none.resid_pdrop, 0.f);
  EXPECT_FALSE(none.has_dropout());
  const GPT2Config hf = parse(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64,
      "vocab_size": 50257, "embd_pdrop": 0.1, "attn_pdrop": 0.2, "resid_pdrop": 0.3})");
  EXPECT_FLOAT_EQ(hf.embd_pdrop, 0.1f);
  EXPECT_FLOAT_EQ(hf.attn_pdrop, 0.2f);
  EXPECT_FLOAT_EQ(hf.resid_pdrop, 0.3f);
  EXPECT_TRUE(hf.has_dropout());
  EXPECT_FALSE(parse(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64,
      "vocab_size": 50257, "attn_pdrop": null})")
                   .has_dropout());
  for (const std::string& name : gpt2_preset_names()) EXPECT_FALSE(gpt2_preset(name).has_dropout());
  expect_refused(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64,
      "vocab_size": 50257, "resid_pdrop": 1.0})",
                 {"resid_pdrop is 1", "[0, 1)", "0.1"});
  expect_refused(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64,
      "vocab_size": 50257, "embd_pdrop": -0.1})",
                 {"embd_pdrop is -0.1", "[0, 1)"});
  expect_refused(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64,
      "vocab_size": 50257, "attn_pdrop": "0.1"})",
                 {"attn_pdrop is \"0.1\"", "[0, 1)"});
}

TEST(ModelConfig, AcceptsHuggingFaceAliases) {
  // n_ctx stands for n_positions when n_positions is absent ...
  GPT2Config c = parse(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_ctx": 96,
      "vocab_size": 50257})");
  EXPECT_EQ(c.n_positions, 96);
  // ... and only then.
  c = parse(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64, "n_ctx": 96,
      "vocab_size": 50257})");
  EXPECT_EQ(c.n_positions, 64);
  // The generic transformers names.
  c = parse(R"({"num_hidden_layers": 5, "hidden_size": 48, "num_attention_heads": 3,
      "max_position_embeddings": 256, "vocab_size": 50257})");
  EXPECT_EQ(c.n_layer, 5);
  EXPECT_EQ(c.n_embd, 48);
  EXPECT_EQ(c.n_head, 3);
  EXPECT_EQ(c.n_positions, 256);
}

TEST(ModelConfig, RefusesWithFileKeyValueAndFix) {
  expect_refused("{ \"n_layer\": 2,", {"not valid JSON"});
  expect_refused("[1, 2]", {"expected a JSON object"});
  expect_refused(R"({"n_embd": 32, "n_head": 4, "n_positions": 64, "vocab_size": 50257})",
                 {"missing key 'n_layer'", "num_hidden_layers", "\"n_layer\": 12"});
  expect_refused(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 50257})",
                 {"missing key 'n_positions'", "n_ctx"});
  expect_refused(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64})",
                 {"missing key 'vocab_size'"});
  expect_refused(
      R"({"n_layer": 2.5, "n_embd": 32, "n_head": 4, "n_positions": 64, "vocab_size": 50257})",
      {"'n_layer' is 2.5", "positive integer"});
  expect_refused(
      R"({"n_layer": "2", "n_embd": 32, "n_head": 4, "n_positions": 64, "vocab_size": 50257})",
      {"'n_layer' is \"2\"", "positive integer"});
  expect_refused(
      R"({"n_layer": 2, "n_embd": 32, "n_head": 0, "n_positions": 64, "vocab_size": 50257})",
      {"'n_head' is 0", "at least 1"});
  expect_refused(
      R"({"n_layer": 2, "n_embd": -32, "n_head": 4, "n_positions": 64, "vocab_size": 50257})",
      {"'n_embd' is -32", "at least 1"});
  expect_refused(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_ctx": 0, "vocab_size": 50257})",
                 {"'n_ctx' is 0"});
  expect_refused(
      R"({"n_layer": 2, "n_embd": 30, "n_head": 4, "n_positions": 64, "vocab_size": 50257})",
      {"n_embd 30 is not divisible by n_head 4", "e.g. 3"});
  expect_refused(R"({"n_layer": 100000, "n_embd": 32, "n_head": 4, "n_positions": 64,
                     "vocab_size": 50257})",
                 {"'n_layer' is 100000", "typo"});
  expect_refused(R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64,
                     "vocab_size": 99999999999999})",
                 {"'vocab_size' is 99999999999999", "typo"});
  expect_refused(
      R"({"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64, "vocab_size": 1000})",
      {"vocab_size 1000", "50257"});
  expect_refused(R"({"model_type": "llama", "n_layer": 2, "n_embd": 32, "n_head": 4,
                     "n_positions": 64, "vocab_size": 50257})",
                 {"model_type is \"llama\"", "\"gpt2\""});
  expect_refused(R"({"activation_function": "relu", "n_layer": 2, "n_embd": 32, "n_head": 4,
                     "n_positions": 64, "vocab_size": 50257})",
                 {"activation_function is \"relu\"", "gelu_new"});
  expect_refused(R"({"n_inner": 100, "n_layer": 2, "n_embd": 32, "n_head": 4,
                     "n_positions": 64, "vocab_size": 50257})",
                 {"n_inner is 100", "128"});
}

TEST(ModelConfig, ResolvesPresetsFilesAndDirectories) {
  const fs::path dir = temp_dir("resolve");
  EXPECT_TRUE(resolve_model("gpt2-xl").same_shape(gpt2_preset("gpt2-xl")));
  EXPECT_EQ(resolve_model("gpt2").name, "gpt2");

  const GPT2Config f = resolve_model(write(dir / "tiny-gpt.json", kTiny).string());
  EXPECT_EQ(f.name, "tiny-gpt");
  EXPECT_EQ(f.n_embd, 32);
  // A Hugging Face model directory: its config.json, named after the directory.
  write(dir / "my-model" / "config.json", kTiny);
  for (const fs::path& p : {dir / "my-model", dir / "my-model" / "config.json"}) {
    const GPT2Config d = resolve_model(p.string());
    EXPECT_EQ(d.name, "my-model") << p;
    EXPECT_TRUE(d.same_shape(f)) << p;
  }
  // What save_hf_config writes (export, consolidate) reads back as the same shape.
  GPT2Config odd = f;
  odd.n_layer = 3;
  odd.n_embd = 48;
  odd.n_head = 4;
  fs::create_directories(dir / "hf");
  save_hf_config(dir / "hf", odd);
  EXPECT_TRUE(resolve_model((dir / "hf").string()).same_shape(odd));

  auto error_of = [](const std::string& arg) {
    try {
      resolve_model(arg);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string unknown = error_of("gpt2-huge");
  EXPECT_NE(unknown.find("unknown model 'gpt2-huge'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("config.json"), std::string::npos) << unknown;
  const std::string missing = error_of((dir / "absent.json").string());
  EXPECT_NE(missing.find("absent.json: no such file"), std::string::npos) << missing;
  fs::create_directories(dir / "empty");
  const std::string empty = error_of((dir / "empty").string());
  EXPECT_NE(empty.find("holds no config.json"), std::string::npos) << empty;
  const std::string bad = error_of(write(dir / "bad.json", R"({"n_layer": 2})").string());
  EXPECT_NE(bad.find((dir / "bad.json").string()), std::string::npos) << bad;
  EXPECT_NE(bad.find("missing key 'n_embd'"), std::string::npos) << bad;
  fs::remove_all(dir);
}

TEST(ModelConfig, ParameterCountOfA12BShape) {
  const GPT2Config c = parse(
      R"({"n_layer": 84, "n_embd": 3456, "n_head": 27, "n_positions": 1024, "vocab_size": 50257})");
  EXPECT_EQ(c.n_embd / c.n_head, 128);  // a head size the fused GPU attention kernels take
  // wte V·d + wpe P·d + per block (2 LayerNorms 4d, attention 4d² + 4d, MLP 8d² + 5d) + ln_f 2d.
  const int64_t V = 50257, P = 1024, d = 3456, L = 84;
  const int64_t expected = V * d + P * d + L * (12 * d * d + 13 * d) + 2 * d;
  EXPECT_EQ(expected, 12'220'495'488);
  EXPECT_EQ(c.num_parameters(), expected);
  auto be = make_cpu_backend();
  GPT2Model model(c, *be);  // the layout only: nothing is allocated
  EXPECT_EQ(model.layout().num_parameters(), expected);
}

TEST(ModelConfig, EstimateTakesAConfigJson) {
  const fs::path dir = temp_dir("estimate");
  const fs::path cfg = write(dir / "gpt-12b" / "config.json",
                             R"({"model_type": "gpt2", "n_layer": 84, "n_embd": 3456,
                                 "n_head": 27, "n_positions": 1024, "vocab_size": 50257})");
  Result r = run("estimate --model " + cfg.string() + " --gpus 8 --micro-batch 1");
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* needle : {"12,220,495,488", "8 GPUs", "zero3"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  r = run("estimate --model " + (dir / "gpt-12b").string() + " --gpus 8");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("12,220,495,488"), std::string::npos) << r.output;
  r = run("estimate --model " + write(dir / "bad.json", R"({"n_layer": 0})").string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("'n_layer' is 0"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

TEST(ModelConfig, CustomShapeTrainsResumesExportsAndGeneratesWithoutTheJson) {
  const fs::path dir = temp_dir("train");
  const fs::path json = write(dir / "tiny-custom.json", kTiny);
  const std::string common = std::string("--train-file ") + SHARDTRAIN_TEST_DATA_DIR +
                             "/wikitext-2/wiki.valid.tokens --device cpu --max-length 32 "
                             "--batch-size 2 --eval-samples 4 --cache-dir " +
                             (dir / "cache").string() + " --output-dir " + (dir / "out").string();
  Result r = run("train --model " + json.string() + " " + common + " --max-steps 2");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("tiny-custom"), std::string::npos) << r.output;
  const GPT2Config expected = parse(kTiny);
  EXPECT_EQ(expected.num_parameters(), 1'635'744);
  EXPECT_NE(r.output.find("1,635,744 parameters"), std::string::npos) << r.output;

  // The checkpoint records the whole shape, so the json is not needed again.
  fs::remove(json);
  const CheckpointInfo info = read_checkpoint_info(dir / "out");
  EXPECT_EQ(info.model.name, "tiny-custom");
  EXPECT_TRUE(info.model.same_shape(expected)) << info.model.shape_string();

  r = run("train " + common + " --max-steps 3 --resume " + (dir / "out").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-000003" / "manifest.json"));
  EXPECT_TRUE(read_checkpoint_info(dir / "out").model.same_shape(expected));

  // Another shape is refused, naming both.
  r = run("train --model gpt2-micro " + common + " --max-steps 4 --resume " +
          (dir / "out").string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("n_embd 32"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("leave --model out"), std::string::npos) << r.output;

  r = run("export --checkpoint " + (dir / "out").string() + " --output " + (dir / "hf").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "hf" / "model.safetensors"));
  // The exported directory is itself a --model: fine-tune from it with its own shape.
  EXPECT_TRUE(resolve_model((dir / "hf").string()).same_shape(expected));
  r = run("train --model " + (dir / "hf").string() + " --init-from " + (dir / "hf").string() + " " +
          common + "-finetuned --max-steps 1");  // output dir out-finetuned
  ASSERT_EQ(r.status, 0) << r.output;

  r = run("generate --checkpoint " + (dir / "out").string() +
          " --prompt \"The game\" --max-new-tokens 3 --device cpu");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.rfind("The game", 0), 0u) << r.output;
  fs::remove_all(dir);
}
