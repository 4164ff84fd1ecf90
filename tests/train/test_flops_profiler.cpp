// The FLOPs profiler (train/flops_profiler.h): the analytic per-module FLOPs add up to the model
// FLOPs the trainer's MFU uses; the profiling hooks forward every call to the strategy's hooks
// and time each layer; the table has a total row of the analytic total.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "train/flops_profiler.h"

namespace shardtrain {
namespace {

double sum_depth(const std::vector<ModuleFlops>& rows, int depth) {
  double s = 0;
  for (const ModuleFlops& m : rows)
    if (m.depth == depth) s += m.flops;
  return s;
}

TEST(FlopsProfiler, ModulesAddUpToTheAnalyticTotal) {
  for (const char* name : {"gpt2-tiny", "gpt2", "gpt2-medium"}) {
    const GPT2Config c = gpt2_preset(name);
    for (const auto& [tokens, T] : {std::pair<int64_t, int64_t>{64, 32}, {8 * 1024, 1024}}) {
      const std::vector<ModuleFlops> rows = analytic_module_flops(c, tokens, T);
      const double total = analytic_total_flops(c, tokens, T);
      EXPECT_DOUBLE_EQ(total, c.flops_per_token(T) * static_cast<double>(tokens)) << name;
      EXPECT_NEAR(sum_depth(rows, 0), total, total * 1e-12) << name << " T " << T;
      // Every block is the sum of its parts; parameters add up to the model's.
      int64_t params = 0;
      for (size_t i = 0; i < rows.size(); ++i) {
        if (rows[i].depth != 0) continue;
        params += rows[i].params;
        if (rows[i].name.rfind("block", 0) != 0) continue;
        ASSERT_LE(i + 4, rows.size() - 1);
        double parts = 0;
        int64_t part_params = 0;
        for (size_t k = i + 1; k <= i + 4; ++k) {
          EXPECT_EQ(rows[k].depth, 1);
          EXPECT_EQ(rows[k].layer, rows[i].layer);
          parts += rows[k].flops;
          part_params += rows[k].params;
        }
        EXPECT_DOUBLE_EQ(parts, rows[i].flops);
        EXPECT_EQ(part_params, rows[i].params);
      }
      EXPECT_EQ(params, c.num_parameters()) << name;
      // embedding, L blocks of 4 parts, head.
      EXPECT_EQ(rows.size(), static_cast<size_t>(2 + 5 * c.n_layer));
    }
  }
}

TEST(FlopsProfiler, Gpt2BlockFlopsByHand) {
  // GPT-2 small, B·T = 8·1024 tokens: attention = 6·(4C² + 4C)·N + 12·C·T·N (QKᵀ and AV 2·B·T²·C
  // each forward, twice that backward); mlp = 6·(8C² + 5C)·N; head = 6·(V·C + 2C)·N.
  const GPT2Config c = gpt2_preset("gpt2");
  const double C = 768, T = 1024, N = 8 * 1024, V = c.vocab_size;
  const std::vector<ModuleFlops> rows = analytic_module_flops(c, 8 * 1024, 1024);
  EXPECT_EQ(rows[0].name, "embedding");
  EXPECT_DOUBLE_EQ(rows[0].flops, 6 * 1024 * C * N);  // wpe's share of 6·N_params
  EXPECT_EQ(rows[1].name, "block 0");
  EXPECT_EQ(rows[3].name, "attention");
  EXPECT_DOUBLE_EQ(rows[3].flops, 6 * (4 * C * C + 4 * C) * N + 12 * C * T * N);
  EXPECT_EQ(rows[5].name, "mlp");
  EXPECT_DOUBLE_EQ(rows[5].flops, 6 * (8 * C * C + 5 * C) * N);
  EXPECT_EQ(rows.back().name, "head");
  EXPECT_DOUBLE_EQ(rows.back().flops, 6 * (V * C + 2 * C) * N);
}

/// Records the calls it gets.
class RecordingHooks final : public LayerHooks {
 public:
  void before_forward(int l) override { calls.push_back("bf" + std::to_string(l)); }
  void after_forward(int l) override { calls.push_back("af" + std::to_string(l)); }
  void before_backward(int l) override { calls.push_back("bb" + std::to_string(l)); }
  void after_backward(int l) override { calls.push_back("ab" + std::to_string(l)); }
  void between_layers() override { calls.push_back("x"); }
  std::vector<std::string> calls;
};

TEST(FlopsProfiler, HooksForwardEveryCallAndTimeEachLayer) {
  RecordingHooks inner;
  StreamClock clock;
  ProfilingHooks p(&inner, clock, 2);
  for (int micro = 0; micro < 2; ++micro) {
    for (int l = 0; l < 2; ++l) {
      p.before_forward(l);
      p.after_forward(l);
      p.between_layers();
    }
    for (int l = 1; l >= 0; --l) {
      p.before_backward(l);
      p.after_backward(l);
    }
  }
  p.collect();
  const std::vector<std::string> once = {"bf0", "af0", "x",   "bf1", "af1",
                                         "x",   "bb1", "ab1", "bb0", "ab0"};
  std::vector<std::string> expected = once;
  expected.insert(expected.end(), once.begin(), once.end());
  EXPECT_EQ(inner.calls, expected);
  ASSERT_EQ(p.forward_seconds().size(), 2u);
  for (int l = 0; l < 2; ++l) {
    EXPECT_GE(p.forward_seconds()[static_cast<size_t>(l)], 0.0);
    EXPECT_GE(p.backward_seconds()[static_cast<size_t>(l)], 0.0);
  }
  ProfilingHooks none(nullptr, clock, 1);  // no strategy hooks: still times
  none.before_forward(0);
  none.after_forward(0);
  none.collect();
  EXPECT_GE(none.forward_seconds()[0], 0.0);
}

TEST(FlopsProfiler, TableHasRowsAndTheTotal) {
  FlopsProfileInput in;
  in.model = gpt2_preset("gpt2-tiny");
  in.step = 2;
  in.tokens = 64;
  in.seq_len = 32;
  in.micro_batch = 2;
  const size_t layers = static_cast<size_t>(in.model.n_layer + 2);
  in.layer_forward_s.assign(layers, 1e-3);
  in.layer_backward_s.assign(layers, 2e-3);
  in.phases = PhaseTimes{0.01, 0.02, 0.001, 0.005};
  in.on_gpu = true;
  in.peak_tflops = 989;
  std::string text;
  for (const std::string& l : format_flops_profile(in)) text += l + "\n";
  for (const char* needle :
       {"embedding", "block 0", "block 3", "attention", "mlp", "ln_1", "ln_2", "head",
        "optimizer step", "gradient reduce wait", "total", "MFU", "top 1 modules by latency"})
    EXPECT_NE(text.find(needle), std::string::npos) << needle << "\n" << text;
  const double total = analytic_total_flops(in.model, 64, 32);
  EXPECT_NE(text.find(fmt::format("total model FLOPs of the step: {:.0f} ", total)),
            std::string::npos)
      << text;
  // detailed = false: no block parts.
  in.options.detailed = false;
  text.clear();
  for (const std::string& l : format_flops_profile(in)) text += l + "\n";
  EXPECT_EQ(text.find("  attention "), std::string::npos) << text;
  EXPECT_NE(text.find("block 3"), std::string::npos) << text;
}

}  // namespace
}  // namespace shardtrain
