// The strategy comparison report (train/report.h, `shardtrain compare` and `shardtrain report`):
// its numbers are the runs' metrics.jsonl numbers, its estimates the memory estimator's, a failed
// run is marked failed, the pictures are valid PNG and SVG of the size asked for, and a missing
// gnuplot skips the pictures but not the report. The last test runs `shardtrain compare` on CPU
// (gpt2-tiny, dp/zero1/zero2, 2 MPI ranks through the launcher).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/gpt2_config.h"
#include "monitor/plot.h"
#include "parallel/memory_estimator.h"
#include "test_support.h"
#include "train/report.h"

namespace fs = std::filesystem;
using nlohmann::json;
using shardtrain::test_support::make_temp_dir;

namespace {

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Why `path` is not a PNG of `width` × `height` pixels ("" when it is): the signature, then
/// the IHDR chunk's big-endian width and height.
std::string png_problem(const fs::path& path, uint32_t width, uint32_t height) {
  const std::string b = read_all(path);
  if (b.size() < 24) return path.string() + ": too short for a PNG";
  if (b.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0) return path.string() + ": no PNG signature";
  if (b.compare(12, 4, "IHDR") != 0) return path.string() + ": no IHDR chunk first";
  const auto be32 = [&](size_t o) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(b[o + i]);
    return v;
  };
  if (be32(16) != width || be32(20) != height)
    return fmt::format("{}: {}×{}, expected {}×{}", path.string(), be32(16), be32(20), width,
                       height);
  return "";
}

/// Why `path` is not a well-formed SVG whose root says width="W" height="H" ("" when it is).
std::string svg_problem(const fs::path& path, int width, int height) {
  const std::string x = read_all(path);
  const std::string xml = shardtrain::test_support::xml_problem(x, "svg");
  if (!xml.empty()) return path.string() + ": " + xml;
  const size_t root = x.find("<svg");
  const std::string head = x.substr(root, x.find('>', root) - root);
  if (head.find(fmt::format("width=\"{}\"", width)) == std::string::npos ||
      head.find(fmt::format("height=\"{}\"", height)) == std::string::npos)
    return path.string() + ": root is not " + std::to_string(width) + "×" + std::to_string(height) +
           ": " + head;
  return "";
}

void expect_pictures(const fs::path& dir) {
  for (const char* stem : {"time_per_epoch", "peak_memory", "loss_curves", "memory_breakdown"}) {
    EXPECT_EQ(png_problem(dir / (std::string(stem) + ".png"), 960, 540), "") << stem;
    EXPECT_EQ(svg_problem(dir / (std::string(stem) + ".svg"), 960, 540), "") << stem;
  }
}

/// A finished run's directory as the trainer writes it: run.json and metrics.jsonl with the
/// losses of steps 1..n, one epoch record and a validation and a "done" record.
void write_run(const fs::path& dir, const std::string& strategy, double time_s, double peak,
               const std::vector<double>& losses, double samples = 64) {
  fs::create_directories(dir);
  std::ofstream(dir / "run.json") << json{{"model", "gpt2-tiny"},   {"strategy", strategy},
                                          {"device", "cpu"},        {"world_size", 2},
                                          {"micro_batch_size", 4},  {"global_batch", 8},
                                          {"max_length", 64},       {"parameters", 1234},
                                          {"flops_per_token", 1e6}, {"peak_tflops", 989.0},
                                          {"on_gpu", false}}
                                         .dump();
  std::ofstream m(dir / "metrics.jsonl");
  for (size_t i = 0; i < losses.size(); ++i)
    m << json{{"step", i + 1}, {"epoch", 1}, {"loss", losses[i]}, {"tokens_per_s", 100.0}}.dump()
      << "\n";
  m << json{{"epoch", 1},
            {"steps", losses.size()},
            {"time_s", time_s},
            {"samples_per_s", samples / time_s},
            {"tokens_per_s", samples * 64 / time_s},
            {"peak_memory_bytes", peak},
            {"peak_memory_bytes_per_rank", {peak, peak * 1.5}},
            {"peak_rss_bytes", peak + 1}}
           .dump()
    << "\n";
  m << json{{"step", losses.size()},    {"epoch", 1},        {"val_loss", 5.0},
            {"val_ppl", std::exp(5.0)}, {"val_samples", 16}, {"time_s", 0.5}}
           .dump()
    << "\n";
  m << json{{"event", "done"},      {"step", losses.size()},
            {"time_s", time_s + 1}, {"final_loss", losses.back()},
            {"val_loss", 5.0},      {"val_ppl", std::exp(5.0)}}
           .dump()
    << "\n";
}

}  // namespace

namespace shardtrain {

TEST(Report, NumbersAreTheRunsMetricsAndTheEstimatorsPrediction) {
  const fs::path dir = make_temp_dir("shardtrain_report");
  write_run(dir / "dp", "dp", 4.0, 200e6, {10.0, 9.0, 8.5});
  write_run(dir / "zero1", "zero1", 2.0, 100e6, {10.0, 9.1, 8.4});
  fs::create_directories(dir / "broken");  // no metrics.jsonl: failed
  std::vector<RunRecord> runs = {read_run(dir / "dp"), read_run(dir / "zero1"),
                                 read_run(dir / "broken")};
  ASSERT_TRUE(runs[0].ok) << runs[0].failure;
  EXPECT_FALSE(runs[2].ok);
  EXPECT_EQ(runs[0].epoch_time_s, 4.0);
  EXPECT_EQ(runs[0].samples_per_s, 16.0);
  EXPECT_EQ(runs[0].tokens_per_s, 1024.0);
  EXPECT_EQ(runs[0].peak_memory_bytes, 300e6);  // the largest rank's
  EXPECT_EQ(runs[0].host_peak_bytes, 200e6 + 1);
  EXPECT_EQ(runs[0].final_loss, 8.5);
  EXPECT_DOUBLE_EQ(runs[0].val_ppl, std::exp(5.0));
  EXPECT_TRUE(std::isnan(runs[0].mfu));  // CPU run
  ASSERT_EQ(runs[1].losses.size(), 3u);
  EXPECT_EQ(runs[1].losses[1], (std::pair<int64_t, double>{2, 9.1}));

  ASSERT_TRUE(write_report(runs, dir / "report") || gnuplot_program().empty());
  EXPECT_EQ(runs[0].label, "dp");
  EXPECT_DOUBLE_EQ(runs[1].speed_vs_dp, 2.0);
  EXPECT_DOUBLE_EQ(runs[1].memory_vs_dp, 0.5);

  // The estimate is the estimator's for gpt2-tiny on 2 GPUs, micro-batch 4 × 64 tokens.
  MemoryEstimateOptions o;
  o.model = resolve_model("gpt2-tiny");
  o.gpus = 2;
  o.micro_batch = 4;
  o.max_length = 64;
  const MemoryEstimate e = estimate_memory(o);
  ASSERT_TRUE(runs[1].estimate.has_value());
  EXPECT_NEAR(runs[1].estimate->total(), e.strategies[1].total(), 1.0);
  EXPECT_NEAR(runs[1].estimate->optimizer, 12.0 * static_cast<double>(e.parameters) / 2, 1.0);

  const json j = json::parse(read_all(dir / "report" / "report.json"));
  ASSERT_EQ(j["runs"].size(), 3u);
  EXPECT_EQ(j["runs"][1]["time_per_epoch_s"].get<double>(), 2.0);
  EXPECT_EQ(j["runs"][1]["peak_memory_bytes"].get<double>(), 150e6);
  EXPECT_EQ(j["runs"][1]["final_loss"].get<double>(), 8.4);
  EXPECT_EQ(j["runs"][1]["loss_curve"]["loss"][2].get<double>(), 8.4);
  EXPECT_NEAR(j["runs"][1]["estimate"]["total_bytes"].get<double>(), e.strategies[1].total(), 1.0);
  EXPECT_EQ(j["runs"][2]["status"], "failed");
  const std::string md = read_all(dir / "report" / "report.md");
  EXPECT_CONTAINS(md, "| zero1 | gpt2-tiny | 2 | 4 | 64 | 2.00 | 32.00 | 2048 |");
  EXPECT_CONTAINS(md, "**failed**");
  EXPECT_CONTAINS(md, "2.00×");
  if (gnuplot_program().empty()) GTEST_SKIP() << "gnuplot is not installed: no pictures to check";
  expect_pictures(dir / "report");
  fs::remove_all(dir);
}

TEST(Report, WithoutGnuplotTheReportIsWrittenWithoutPictures) {
  const fs::path dir = make_temp_dir("shardtrain_report_nognuplot");
  write_run(dir / "dp", "dp", 4.0, 200e6, {10.0, 9.0});
  std::vector<RunRecord> runs = {read_run(dir / "dp")};
  const char* before = std::getenv("SHARDTRAIN_GNUPLOT");
  const std::string saved = before ? before : "";
  ::setenv("SHARDTRAIN_GNUPLOT", (dir / "no-such-gnuplot").c_str(), 1);
  testing::internal::CaptureStderr();
  const bool drawn = write_report(runs, dir / "report");
  const std::string err = testing::internal::GetCapturedStderr();
  if (before)
    ::setenv("SHARDTRAIN_GNUPLOT", saved.c_str(), 1);
  else
    ::unsetenv("SHARDTRAIN_GNUPLOT");
  EXPECT_FALSE(drawn);
  EXPECT_CONTAINS(err, "pictures were skipped");
  EXPECT_CONTAINS(err, "gnuplot-nox");
  EXPECT_TRUE(fs::exists(dir / "report" / "report.json"));
  EXPECT_TRUE(fs::exists(dir / "report" / "report.md"));
  EXPECT_FALSE(fs::exists(dir / "report" / "time_per_epoch.png"));
  fs::remove_all(dir);
}

// The pictures say what was measured (model, micro-batch × length, device × ranks) and cannot
// mislead when the runs differ in length: epochs of other sample counts are compared per 1,000
// samples, and the loss curves run over samples seen, each legend entry with its run's length.
TEST(Report, PicturesNameTheWorkloadAndCompareRunsOfOtherLengthsPerSample) {
  const fs::path dir = make_temp_dir("shardtrain_report_lengths");
  write_run(dir / "dp", "dp", 4.0, 200e6, {10.0, 9.0, 8.5});       // 64 samples
  write_run(dir / "zero1", "zero1", 2.0, 100e6, {10.0, 9.5}, 16);  // 16 samples
  std::vector<RunRecord> runs = {read_run(dir / "dp"), read_run(dir / "zero1")};
  EXPECT_EQ(workload_title(runs), "gpt2-tiny, micro-batch 4 × 64, cpu × 2");
  EXPECT_EQ(samples_last_epoch(runs[1]), 16.0);
  const bool drawn = write_report(runs, dir / "report");
  if (gnuplot_program().empty()) GTEST_SKIP() << "gnuplot is not installed: no pictures to check";
  ASSERT_TRUE(drawn);
  const fs::path out = dir / "report";
  EXPECT_FALSE(fs::exists(out / "time_per_epoch.png"));
  EXPECT_EQ(png_problem(out / "time_per_sample.png", 960, 540), "");
  EXPECT_CONTAINS(read_all(out / "report.md"), "(time_per_sample.png)");
  const std::string time_gp = read_all(out / "time_per_sample.gp");
  EXPECT_CONTAINS(time_gp, "Time per 1,000 samples —");
  EXPECT_CONTAINS(time_gp, "gpt2-tiny, micro-batch 4 × 64, cpu × 2");
  const std::string time_dat = read_all(out / "time_per_sample.dat");
  EXPECT_CONTAINS(time_dat, "zero1 (16 samples)");
  EXPECT_CONTAINS(time_dat, "\t125\n");   // 2 s / 16 samples
  EXPECT_CONTAINS(time_dat, "\t62.5\n");  // 4 s / 64 samples
  const std::string loss_gp = read_all(out / "loss_curves.gp");
  EXPECT_CONTAINS(loss_gp, "samples seen");
  EXPECT_CONTAINS(loss_gp, "dp (3 steps, 3 logged)");
  EXPECT_CONTAINS(loss_gp, "zero1 (2 steps, 2 logged)");
  EXPECT_CONTAINS(read_all(out / "loss_curves.dat"), "24\t8.5\n");  // step 3 × global batch 8
  fs::remove_all(dir);
}

// `shardtrain compare` on CPU: gpt2-tiny under dp, zero1 and zero2 on 2 MPI ranks (the launcher
// starts them through mpirun). report.json's numbers are the runs' own metrics.jsonl numbers.
TEST(Report, CompareOnCpuReportsTheRunsMetrics) {
  const fs::path dir = make_temp_dir("shardtrain_compare");
  const auto r = test_support::run_command(
      std::string("OMP_NUM_THREADS=1 ") + SHARDTRAIN_BINARY +
      " compare --device cpu --models gpt2-tiny --strategies dp,zero1,zero2 --gpus 2 "
      "--batch-sizes 2 --num-samples 32 --max-length 32 -o " +
      (dir / "report").string() + " -- --train-file " + SHARDTRAIN_TEST_DATA_DIR +
      "/wikitext-2/wiki.valid.tokens --valid-file " + SHARDTRAIN_TEST_DATA_DIR +
      "/wikitext-2/wiki.test.tokens --eval-samples 8 --cache-dir " + (dir / "cache").string() +
      " 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "[1/3] ");
  EXPECT_CONTAINS(r.output, "launch --nproc-per-node 2 -- train --device cpu");
  const json j = json::parse(read_all(dir / "report" / "report.json"));
  ASSERT_EQ(j["runs"].size(), 3u);
  const char* strategies[] = {"dp", "zero1", "zero2"};
  for (size_t i = 0; i < 3; ++i) {
    const json& run = j["runs"][i];
    ASSERT_EQ(run["status"], "ok") << run.dump(2);
    EXPECT_EQ(run["strategy"], strategies[i]);
    EXPECT_EQ(run["world_size"], 2);
    EXPECT_NE(run["command"].get<std::string>().find(std::string("--strategy ") + strategies[i]),
              std::string::npos);
    // The run's own records.
    json epoch, done, val;
    std::vector<double> losses;
    std::ifstream in(fs::path(run["dir"].get<std::string>()) / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const json rec = json::parse(line);
      if (rec.contains("event"))
        done = rec;
      else if (rec.contains("val_loss"))
        val = rec;
      else if (rec.contains("peak_memory_bytes"))
        epoch = rec;
      else if (rec.contains("loss"))
        losses.push_back(rec["loss"].get<double>());
    }
    ASSERT_FALSE(epoch.is_null());
    double peak = 0;
    for (const auto& p : epoch["peak_memory_bytes_per_rank"])
      peak = std::max(peak, p.get<double>());
    EXPECT_EQ(run["time_per_epoch_s"].get<double>(), epoch["time_s"].get<double>());
    EXPECT_EQ(run["samples_per_s"].get<double>(), epoch["samples_per_s"].get<double>());
    EXPECT_EQ(run["tokens_per_s"].get<double>(), epoch["tokens_per_s"].get<double>());
    EXPECT_EQ(run["peak_memory_bytes"].get<double>(), peak);
    EXPECT_EQ(run["host_peak_bytes"].get<double>(), epoch["peak_rss_bytes"].get<double>());
    EXPECT_EQ(run["final_loss"].get<double>(), done["final_loss"].get<double>());
    EXPECT_EQ(run["val_ppl"].get<double>(), val["val_ppl"].get<double>());
    EXPECT_EQ(run["loss_curve"]["loss"].get<std::vector<double>>(), losses);
    EXPECT_EQ(losses.size(), 8u);  // 32 samples / (2 ranks × 2), every step logged
    EXPECT_FALSE(run["estimate"].is_null());
  }
  EXPECT_DOUBLE_EQ(j["runs"][0]["speed_vs_dp"].get<double>(), 1.0);
  const std::string md = read_all(dir / "report" / "report.md");
  EXPECT_CONTAINS(md, "| zero2 | gpt2-tiny | 2 | 2 |");
  if (gnuplot_program().empty()) GTEST_SKIP() << "gnuplot is not installed: no pictures to check";
  expect_pictures(dir / "report");
  fs::remove_all(dir);
}

}  // namespace shardtrain
