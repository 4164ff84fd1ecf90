// Pipeline schedules (parallel/pipeline/schedule.h) and their simulator: the properties the
// papers state, for many shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "core/error.h"
#include "parallel/pipeline/simulator.h"
#include "test_support.h"

namespace shardtrain {
namespace {

constexpr PipelineSchedule kAll[] = {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                                     PipelineSchedule::kInterleaved, PipelineSchedule::kZBH1,
                                     PipelineSchedule::k2BW};

/// The shapes each schedule accepts, over P 1..5, M 1..12, V 1..3.
std::vector<PipelineShape> shapes_for(PipelineSchedule s) {
  std::vector<PipelineShape> out;
  for (int P = 1; P <= 5; ++P)
    for (int M = 1; M <= 12; ++M)
      for (int V = 1; V <= 3; ++V) {
        const PipelineShape shape{P, M, V};
        try {
          check_pipeline_shape(s, shape);
          out.push_back(shape);
        } catch (const ConfigError&) {
        }
      }
  return out;
}

TEST(PipelineSchedule, EveryPassOnceForwardBeforeBackward) {
  for (PipelineSchedule s : kAll) {
    const auto shapes = shapes_for(s);
    ASSERT_FALSE(shapes.empty()) << to_string(s);
    for (const PipelineShape& shape : shapes) {
      for (int r = 0; r < shape.stages; ++r) {
        const auto actions = pipeline_compute_actions(s, shape, r);
        std::map<std::tuple<int, int, int>, size_t> at;  // (kind, m, chunk) → index
        for (size_t i = 0; i < actions.size(); ++i) {
          const PipelineAction& a = actions[i];
          const int kind = a.type == ActionType::kForward          ? 0
                           : a.type == ActionType::kBackwardWeight ? 2
                                                                   : 1;
          EXPECT_TRUE(at.emplace(std::tuple{kind, a.micro_batch, a.chunk}, i).second)
              << to_string(s) << " rank " << r << ": pass repeated";
        }
        const bool split = s == PipelineSchedule::kZBH1;
        EXPECT_EQ(actions.size(), static_cast<size_t>(shape.micro_batches * shape.virtual_stages *
                                                      (split ? 3 : 2)));
        for (int m = 0; m < shape.micro_batches; ++m)
          for (int c = 0; c < shape.virtual_stages; ++c) {
            const auto index = [&](int kind) {
              const auto it = at.find(std::tuple{kind, m, c});
              return it == at.end() ? actions.size() : it->second;
            };
            ASSERT_LT(index(1), actions.size()) << to_string(s) << " m " << m;
            EXPECT_LT(index(0), index(1)) << to_string(s) << " m " << m;
            if (split) {
              EXPECT_LT(index(1), index(2)) << to_string(s) << " m " << m;
            }
          }
      }
    }
  }
}

// Cross-stage dependencies hold and no schedule deadlocks: the simulation, which blocks a rank on
// every receive whose send has not happened, finishes for every shape.
TEST(PipelineSchedule, NoShapeDeadlocks) {
  for (PipelineSchedule s : kAll)
    for (const PipelineShape& shape : shapes_for(s))
      EXPECT_NO_THROW(simulate_pipeline(s, shape, {1, 1, 1}))
          << to_string(s) << " P " << shape.stages << " M " << shape.micro_batches;
}

TEST(PipelineSchedule, TransfersSurroundTheirPasses) {
  const PipelineShape shape{4, 8, 1};
  for (int r = 0; r < 4; ++r) {
    const auto all =
        with_transfers(pipeline_compute_actions(PipelineSchedule::k1F1B, shape, r), shape, r);
    int recv_act = 0, send_act = 0, recv_grad = 0, send_grad = 0;
    for (const PipelineAction& a : all) {
      recv_act += a.type == ActionType::kRecvActivation;
      send_act += a.type == ActionType::kSendActivation;
      recv_grad += a.type == ActionType::kRecvGradient;
      send_grad += a.type == ActionType::kSendGradient;
    }
    EXPECT_EQ(recv_act, r > 0 ? 8 : 0);
    EXPECT_EQ(send_act, r < 3 ? 8 : 0);
    EXPECT_EQ(recv_grad, r < 3 ? 8 : 0);
    EXPECT_EQ(send_grad, r > 0 ? 8 : 0);
  }
}

// GPipe and 1F1B idle (P−1)/(M+P−1) of the step with uniform op times (Huang et al. 2019;
// Narayanan et al. 2021 §2.2.1); interleaving divides the bubble by about V (§2.2.2) and ZB-H1
// makes it smaller than 1F1B's (Qi et al. 2024, §3: (P−1)(F+B−W) against (P−1)(F+B+W)).
TEST(PipelineSchedule, BubbleFractions) {
  for (int P : {2, 4}) {
    for (int M : {4, 8, 16}) {
      const double theory = (P - 1) / static_cast<double>(M + P - 1);
      const PipelineShape flat{P, M, 1};
      const double gpipe =
          simulate_pipeline(PipelineSchedule::kGPipe, flat, {1, 1, 1}).bubble_fraction();
      const double one =
          simulate_pipeline(PipelineSchedule::k1F1B, flat, {1, 1, 1}).bubble_fraction();
      EXPECT_NEAR(gpipe, theory, 1e-12) << P << " " << M;
      EXPECT_NEAR(one, theory, 1e-12) << P << " " << M;
      const double zb =
          simulate_pipeline(PipelineSchedule::kZBH1, flat, {1, 1, 1}).bubble_fraction();
      EXPECT_LT(zb, one) << P << " " << M;
      // F = B = W = 1: ZB-H1's step is 3M + (P−1)(F+B−W) = 3M + P − 1 (1F1B's: 3(M + P − 1)).
      EXPECT_NEAR(zb, (P - 1) / static_cast<double>(3 * M + P - 1), 1e-12) << P << " " << M;
      const double il =
          simulate_pipeline(PipelineSchedule::kInterleaved, {P, M, 2}, {1, 1, 1}).bubble_fraction();
      EXPECT_LT(il, one) << P << " " << M;
    }
  }
  // The naive pipeline (one micro-batch): each stage works 1/P of the time (25% for 4 stages).
  const PipelineTimeline naive = simulate_pipeline(PipelineSchedule::kGPipe, {4, 1, 1}, {1, 1, 1});
  for (int r = 0; r < 4; ++r) EXPECT_NEAR(naive.utilization(r), 0.25, 1e-12);
}

TEST(PipelineSchedule, PeakInFlightActivations) {
  for (int P : {2, 3, 4})
    for (int M : {1, 4, 9}) {
      const auto gpipe = simulate_pipeline(PipelineSchedule::kGPipe, {P, M, 1}, {1, 1, 1});
      const auto one = simulate_pipeline(PipelineSchedule::k1F1B, {P, M, 1}, {1, 1, 1});
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(gpipe.peak_in_flight[static_cast<size_t>(r)], M);
        EXPECT_LE(one.peak_in_flight[static_cast<size_t>(r)], P);
        EXPECT_EQ(one.peak_in_flight[static_cast<size_t>(r)], std::min(M, P - r));
        // ZB-H1 defers weight-gradient passes (which free the activations) but never holds more
        // than 1F1B's first stage does.
        EXPECT_LE(simulate_pipeline(PipelineSchedule::kZBH1, {P, M, 1}, {1, 1, 1})
                      .peak_in_flight[static_cast<size_t>(r)],
                  std::min(M, P));
      }
    }
}

TEST(PipelineSchedule, BadShapesNameTheFix) {
  EXPECT_THROW(check_pipeline_shape(PipelineSchedule::kInterleaved, {4, 6, 2}), ConfigError);
  EXPECT_THROW(check_pipeline_shape(PipelineSchedule::kInterleaved, {4, 8, 1}), ConfigError);
  EXPECT_THROW(check_pipeline_shape(PipelineSchedule::k1F1B, {4, 8, 2}), ConfigError);
  EXPECT_THROW(check_pipeline_shape(PipelineSchedule::kGPipe, {0, 8, 1}), ConfigError);
  try {
    parse_pipeline_schedule("1f1f");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("1f1b"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_pipeline_schedule("Interleaved_1F1B"), PipelineSchedule::kInterleaved);
}

TEST(PipelineSchedule, SvgIsWellFormed) {
  const auto t = simulate_pipeline(PipelineSchedule::kInterleaved, {4, 8, 2}, {1, 2, 0});
  const std::string svg = timeline_svg(t, "interleaved-1f1b");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_EQ(test_support::xml_problem(svg, "svg"), "");
  // Titles are escaped.
  EXPECT_EQ(test_support::xml_problem(timeline_svg(t, "F<B & W"), "svg"), "");
  EXPECT_CONTAINS(timeline_svg(t, "F<B & W"), "F&lt;B &amp; W");
  size_t rects = 0;
  for (size_t p = svg.find("<rect"); p != std::string::npos; p = svg.find("<rect", p + 1)) ++rects;
  EXPECT_EQ(rects, t.entries.size() + 1);  // the background and one per pass
  const std::string text = format_timeline_text(t, 1);
  EXPECT_NE(text.find("stage  3"), std::string::npos);
  EXPECT_NE(format_timeline_summary(t).find("bubble"), std::string::npos);
}

}  // namespace
}  // namespace shardtrain
