// The `shardtrain` program as a user meets it: bad input gets a clear error (exit status 2) that
// names the problem and the fix; a short real run writes metrics and a checkpoint that
// `generate` and `--resume` accept.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/gpt2_config.h"
#include "test_support.h"

namespace fs = std::filesystem;

namespace {

using Result = shardtrain::test_support::CommandResult;

Result run(const std::string& args) { return shardtrain::test_support::run_shardtrain(args); }

fs::path temp_dir(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("shardtrain_cli_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

const std::string kData = std::string("--train-file ") + SHARDTRAIN_TEST_DATA_DIR +
                          "/wikitext-2/wiki.valid.tokens --device cpu";

void expect_error(const std::string& args, const std::string& needle) {
  const Result r = run("train " + args);
  EXPECT_NE(r.status, 0) << args;
  EXPECT_NE(r.output.find(needle), std::string::npos)
      << "args: " << args << "\noutput: " << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Assertion"), std::string::npos) << r.output;
}

}  // namespace

// Run from the build tree, the program finds the build tree's data next to itself (<build>/data);
// no path is compiled in (test_install.cpp covers an installed, moved tree).
TEST(Cli, DataDirFromBuildTree) {
  const Result r = shardtrain::test_support::run_command(
      std::string("env -u SHARDTRAIN_DATA_DIR -u SHARDTRAIN_TOKENIZER_DIR ") + SHARDTRAIN_BINARY +
      " data-dir 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::equivalent(fs::path(r.output.substr(0, r.output.find('\n'))),
                             fs::path(SHARDTRAIN_TEST_DATA_DIR)))
      << r.output;
  EXPECT_NE(r.output.find("build tree"), std::string::npos) << r.output;
}

TEST(Cli, UnknownModelAndStrategy) {
  expect_error("--model gpt3 --dataset wikitext-2", "gpt3");
  expect_error("--model gpt2-tiniest --dataset wikitext-2", "did you mean 'gpt2-tiny'");
  expect_error("--strategy pipeline --pipeline-stages 2 --dataset wikitext-2",
               "world size 1 is not divisible by --pipeline-stages 2");
  expect_error("--pipeline-stages 2 --dataset wikitext-2", "add --strategy pipeline");
  expect_error("--strategy infinity --dataset wikitext-2", "--nvme-path DIR");
  expect_error("--strategy zero9 --dataset wikitext-2", "zero9");
}

TEST(Cli, EstimatePrintsMemoryPerStrategy) {
  const Result r = run("estimate --model gpt2 --gpus 8 --micro-batch 4 --max-length 1024");
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* needle : {"124,439,808", "8 GPUs", "zero1", "2Ψ + 14Ψ/N", "infinity", "NVMe"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  const Result bad = run("estimate --model gpt2 --gpus 8 --max-length 4096");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("--max-length 4096"), std::string::npos) << bad.output;
}

TEST(Cli, EstimateChoosesTheBatchShapeForAGlobalBatch) {
  // 48 sequences on 2 GPUs of 20 GiB: micro-batches 1, 2, 4 and 8 make it up whole (16 does
  // not: 48 / (16 · 2) is not an integer), each planned; the fastest marked.
  const Result r =
      run("estimate --model gpt2-xl --max-length 512 --gpus 2 --gpu-memory 20 --max-host-memory 64 "
          "--train-batch-size 48");
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* needle : {"Global batch 48 sequences", "1 × 24", "2 × 12", "4 × 6", "8 × 3",
                             "chosen (*): the fastest predicted"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  EXPECT_EQ(r.output.find("16 × "), std::string::npos) << r.output;
  const size_t global = r.output.find("Global batch");
  EXPECT_NE(r.output.find("\n* ", global), std::string::npos) << r.output;
}

TEST(Cli, EnvSaysWhatTheBuildHas) {
  const Result r = run("env");
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* needle : {"shardtrain", "compiler", "OpenMP", "OpenBLAS", "MPI", "CUDA"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
#ifdef SHARDTRAIN_WITH_CUDA
  for (const char* needle : {"cuDNN", "NCCL", "GPU architectures compiled in"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
#endif
}

TEST(Cli, MaxLengthBeyondContextAndInvalidNumbers) {
  expect_error("--model gpt2-tiny --max-length 2048 --dataset wikitext-2", "1024");
  expect_error("--lr abc --dataset wikitext-2", "--lr");
  expect_error("--batch-size 0 --dataset wikitext-2", "--batch-size");
  expect_error("--lr -1 --dataset wikitext-2", "lr");
}

TEST(Cli, MissingDataAndDatasets) {
  expect_error("--train-file /nonexistent/file.txt --device cpu", "/nonexistent/file.txt");
  expect_error("--dataset wikitext-3", "wikitext-3");
  expect_error("--device cpu", "--dataset");
  expect_error(kData + " --num-samples 1000000", "--num-samples");
}

TEST(Cli, DeepSpeedConfigErrors) {
  const fs::path dir = temp_dir("ds");
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  expect_error(
      "--dataset wikitext-2 --deepspeed-config " + write("bad.json", "{ \"train_batch_size\": 8,"),
      "bad.json");
  expect_error("--dataset wikitext-2 --deepspeed-config " +
                   write("typo.json", R"({"train_micro_batch_size_per_gpus": 4})"),
               "did you mean 'train_micro_batch_size_per_gpu'");
  expect_error(
      "--dataset wikitext-2 --deepspeed-config " +
          write("batch.json", R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
                                          "gradient_accumulation_steps": 2})"),
      "16");
  expect_error("--dataset wikitext-2 --deepspeed-config " + (dir / "absent.json").string(),
               "absent.json");
  fs::remove_all(dir);
}

TEST(Cli, CorruptTokenizerAndCheckpointAreReported) {
  const fs::path dir = temp_dir("tok");
  fs::create_directories(dir / "tok");
  std::ofstream(dir / "tok" / "encoder.json") << "{ broken";
  std::ofstream(dir / "tok" / "vocab.bpe") << "#version: 0.2\n";
  const Result r = run("tokenize " + (dir / "tok" / "vocab.bpe").string() + " --tokenizer-dir " +
                       (dir / "tok").string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("encoder.json"), std::string::npos) << r.output;
  const Result g = run("generate --checkpoint " + (dir / "nothing").string());
  EXPECT_EQ(g.status, 2) << g.output;
  EXPECT_NE(g.output.find("no checkpoint"), std::string::npos) << g.output;
  fs::remove_all(dir);
}

// --profile-step N: the FLOPs profiler's table at step N, whose total is the analytic model FLOPs
// (6·N_params + 12·L·C·T per token) of the step; with an output_file it goes there instead.
TEST(Cli, FlopsProfilerPrintsTheTable) {
  const fs::path dir = temp_dir("flops");
  const std::string common =
      "train --model gpt2-tiny --dataset wikitext-2 --max-steps 3 --batch-size 2 --max-length 32 "
      "--device cpu --no-save --eval-samples 8 --cache-dir " +
      (dir / "cache").string() + " --output-dir " + (dir / "out").string();
  Result r = run(common + " --profile-step 2");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* needle : {"FLOPs profiler", "profile step 2", "embedding", "block 0", "block 3",
                             "attention", "mlp", "ln_1", "head", "optimizer step",
                             "gradient reduce wait", "latency ms", "TFLOP/s", "% step"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  // gpt2-tiny: (6·N + 12·4·128·32)·64 tokens.
  const shardtrain::GPT2Config c = shardtrain::gpt2_preset("gpt2-tiny");
  const double total = c.flops_per_token(32) * 64.0;
  const std::string total_line = fmt::format("total model FLOPs of the step: {:.0f} ", total);
  EXPECT_NE(r.output.find(total_line), std::string::npos) << total_line << "\n" << r.output;
  EXPECT_EQ(r.output.find("profile step 1 "), std::string::npos) << r.output;

  const fs::path file = dir / "profile.txt";
  std::ofstream(dir / "fp.json") << R"({"flops_profiler": {"enabled": true, "profile_step": 3,
                                        "output_file": ")"
                                 << file.string() << R"("}})";
  r = run(common + " --deepspeed-config " + (dir / "fp.json").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("profile written to"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("total model FLOPs"), std::string::npos) << r.output;
  std::ifstream in(file);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("profile step 3"), std::string::npos) << text;
  EXPECT_NE(text.find(total_line), std::string::npos) << text;
  fs::remove_all(dir);
}

// --trace on an offloaded run: the timeline of its 3rd and 4th steps — every layer's forward and
// backward once per step on the GPU lane (layer-major with a forward group of the whole step),
// each part's gradient copy, host update and parameter copy, in order — as a Chrome trace and an
// SVG; a run that offloads nothing refuses the flag, naming both uses.
TEST(Cli, TraceDrawsTheOffloadTimeline) {
  const fs::path dir = temp_dir("trace");
  const std::string common =
      "train --model gpt2-tiny --dataset wikitext-2 --max-steps 5 --batch-size 2 --max-length 32 "
      "--gradient-accumulation-steps 3 --activation-checkpointing --device cpu --no-save "
      "--eval-samples 8 --cache-dir " +
      (dir / "cache").string() + " --output-dir " + (dir / "out").string();
  Result r = run(common + " --strategy offload --trace " + (dir / "trace").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("the GPU computed"), std::string::npos) << r.output;
  std::ifstream in(dir / "trace" / "offload-trace.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  std::map<std::string, int> count;
  std::map<int, std::vector<std::pair<double, double>>> lanes;
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const std::string name = e.at("name");
    ++count[name.substr(0, name.find(' '))];
    lanes[e.at("tid").get<int>()].emplace_back(
        e.at("ts").get<double>(), e.at("ts").get<double>() + e.at("dur").get<double>());
  }
  // gpt2-tiny: the embedding, 4 blocks and the head; two steps.
  EXPECT_EQ(count["forward"], 2 * 6) << j.dump();  // the head's with its backward, counted here
  EXPECT_EQ(count["backward"], 2 * 5) << j.dump();
  EXPECT_GT(count["gradient"], 0);
  EXPECT_EQ(count["gradient"], count["parameters"]);
  EXPECT_EQ(count["gradient"], count["update"]);
  for (auto& [lane, spans] : lanes) {  // a lane's segments never overlap
    std::sort(spans.begin(), spans.end());
    for (size_t k = 1; k < spans.size(); ++k)
      EXPECT_LE(spans[k - 1].second, spans[k].first + 1e-3) << "lane " << lane;
  }
  EXPECT_TRUE(fs::exists(dir / "trace" / "offload-timeline.svg"));
  r = run(common + " --strategy zero2 --trace " + (dir / "trace").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--trace"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// --dropout: refused outside [0, 1); a run with it shows the three probabilities in the banner,
// records them in the checkpoint's manifest, and a rerun with the same seed logs the same losses
// (the masks are reproducible).
TEST(Cli, DropoutFlagBannerCheckpointAndReproducibleLoss) {
  expect_error(kData + " --dropout 1", "--dropout");
  expect_error(kData + " --dropout -0.2", "--dropout");
  const fs::path dir = temp_dir("dropout");
  const std::string common = "train --model gpt2-micro " + kData +
                             " --max-length 32 --batch-size 2 --eval-samples 8 --max-steps 3 "
                             "--log-interval 1 --dropout 0.1 --cache-dir " +
                             (dir / "cache").string();
  Result a = run(common + " --output-dir " + (dir / "a").string());
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("dropout: embd_pdrop 0.1, attn_pdrop 0.1, resid_pdrop 0.1"),
            std::string::npos)
      << a.output;
  std::ifstream cfg(dir / "a" / "checkpoint-000003" / "manifest.json");
  const std::string text((std::istreambuf_iterator<char>(cfg)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"attn_pdrop\": 0.1"), std::string::npos) << text;
  Result b = run(common + " --no-save --output-dir " + (dir / "b").string());
  ASSERT_EQ(b.status, 0) << b.output;
  auto losses = [](const fs::path& metrics) {
    std::ifstream in(metrics);
    std::vector<std::string> out;
    for (std::string line; std::getline(in, line);) {
      const auto at = line.find("\"loss\":");
      if (at != std::string::npos && line.find("\"step\":") != std::string::npos)
        out.push_back(line.substr(at, line.find(',', at) - at));
    }
    return out;
  };
  const auto la = losses(dir / "a" / "metrics.jsonl"), lb = losses(dir / "b" / "metrics.jsonl");
  EXPECT_FALSE(la.empty());
  EXPECT_EQ(la, lb);
  // The Hugging Face export writes the values; its config.json given to --model supplies them.
  Result c = run("consolidate " + (dir / "a").string() + " --output " + (dir / "hf").string());
  ASSERT_EQ(c.status, 0) << c.output;
  std::ifstream hf(dir / "hf" / "config.json");
  const std::string hf_text((std::istreambuf_iterator<char>(hf)), std::istreambuf_iterator<char>());
  EXPECT_NE(hf_text.find("\"resid_pdrop\": 0.1"), std::string::npos) << hf_text;
  Result d = run("train --model " + (dir / "hf").string() + " " + kData +
                 " --max-length 32 --batch-size 2 --max-steps 1 --no-save --cache-dir " +
                 (dir / "cache").string() + " --output-dir " + (dir / "d").string());
  ASSERT_EQ(d.status, 0) << d.output;
  EXPECT_NE(d.output.find("dropout: embd_pdrop 0.1, attn_pdrop 0.1, resid_pdrop 0.1"),
            std::string::npos)
      << d.output;
  fs::remove_all(dir);
}

TEST(Cli, TrainGenerateAndResume) {
  const fs::path dir = temp_dir("run");
  const std::string common = "--model gpt2-micro " + kData +
                             " --max-length 32 --batch-size 2 --eval-samples 8 " + "--cache-dir " +
                             (dir / "cache").string() + " --output-dir " + (dir / "out").string();
  Result r = run("train " + common + " --max-steps 3");
  ASSERT_EQ(r.status, 0) << r.output;
  // --train-file without --valid-file: no validation set, said as such (not "nan").
  EXPECT_NE(r.output.find("no validation (no validation set)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("nan"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "metrics.jsonl"));
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-000003" / "manifest.json"));

  r = run("consolidate " + (dir / "out").string() + " --output " + (dir / "hf").string() +
          " --dtype bf16");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* f : {"model.safetensors", "config.json", "vocab.json", "merges.txt"})
    EXPECT_TRUE(fs::exists(dir / "hf" / f)) << f;
  r = run("consolidate " + (dir / "out").string() + " --output " + (dir / "hf").string() +
          " --dtype fp8");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("use bf16 or fp32"), std::string::npos) << r.output;

  r = run("generate --checkpoint " + (dir / "out").string() +
          " --prompt \"The game\" --max-new-tokens 5 --device cpu");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.rfind("The game", 0), 0u) << r.output;
  EXPECT_GT(r.output.size(), std::string("The game").size() + 1);

  r = run("train " + common + " --max-steps 5 --resume " + (dir / "out").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-000005"));
  fs::remove_all(dir);
}

TEST(Cli, ExportLoadsBackWithInitFrom) {
  const fs::path dir = temp_dir("export");
  const std::string common = "--model gpt2-micro " + kData +
                             " --max-length 32 --batch-size 4 --eval-samples 8 --lr 3e-3 " +
                             "--cache-dir " + (dir / "cache").string();
  Result r = run("train " + common + " --max-steps 30 --output-dir " + (dir / "a").string());
  ASSERT_EQ(r.status, 0) << r.output;
  r = run("export --checkpoint " + (dir / "a").string() + " --output " + (dir / "hf").string());
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* f : {"model.safetensors", "config.json", "vocab.json", "merges.txt"})
    EXPECT_TRUE(fs::exists(dir / "hf" / f)) << f;
  // Fine-tuning from the exported Hugging Face directory starts from the trained weights: the
  // first loss is far below a fresh model's ln(50257) ≈ 10.8.
  r = run("train " + common + " --max-steps 1 --log-interval 1 --init-from " +
          (dir / "hf").string() + " --output-dir " + (dir / "b").string());
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream metrics(dir / "b" / "metrics.jsonl");
  std::string first;
  std::getline(metrics, first);
  const auto pos = first.find("\"loss\":");
  ASSERT_NE(pos, std::string::npos) << first;
  EXPECT_LT(std::stod(first.substr(pos + 7)), 9.5) << first;
  // A mis-shaped model is refused, naming the tensor.
  r = run("train --model gpt2-tiny " + kData + " --max-length 32 --max-steps 1 --init-from " +
          (dir / "hf").string() + " --output-dir " + (dir / "c").string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("transformer.wte.weight"), std::string::npos) << r.output;
  fs::remove_all(dir);
}
