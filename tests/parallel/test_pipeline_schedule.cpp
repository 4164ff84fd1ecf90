// Pipeline schedules (parallel/pipeline/schedule.h) and their simulator: the properties the
// papers state, for many shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

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

// PipeDream-2BW without a flush (arXiv 2006.09503 §3): consecutive steps run every pass of every
// micro-batch once on every rank, a forward before its backward, the look-ahead forwards of step
// k being step k + 1's first; a step that fills and drains is 1F1B; and a steady step idles less
// than 1F1B's flushed one.
TEST(PipelineSchedule, TwoBWWithoutFlush) {
  for (int P : {2, 3, 4}) {
    for (int M : {P, 8}) {
      const PipelineShape flushed{P, M, 1};
      for (int r = 0; r < P; ++r)
        EXPECT_EQ(pipeline_compute_actions(PipelineSchedule::k2BW, flushed, r),
                  pipeline_compute_actions(PipelineSchedule::k1F1B, flushed, r));
      constexpr int kSteps = 3;
      for (int r = 0; r < P; ++r) {
        std::map<std::pair<int, int>, int> seen;  // (type, global micro-batch) -> position
        int pos = 0;
        for (int k = 0; k < kSteps; ++k) {
          const PipelineShape s{P, M, 1, k == 0, k + 1 == kSteps};
          for (const PipelineAction& a : pipeline_compute_actions(PipelineSchedule::k2BW, s, r)) {
            const int m = k * M + a.micro_batch;
            EXPECT_TRUE(seen.emplace(std::pair{static_cast<int>(a.type), m}, pos++).second)
                << "twice: rank " << r << " micro-batch " << m;
          }
        }
        for (int m = 0; m < kSteps * M; ++m) {
          const auto f = seen.find({static_cast<int>(ActionType::kForward), m});
          const auto b = seen.find({static_cast<int>(ActionType::kBackward), m});
          ASSERT_TRUE(f != seen.end() && b != seen.end()) << "rank " << r << " micro-batch " << m;
          EXPECT_LT(f->second, b->second);
        }
        EXPECT_EQ(seen.size(), static_cast<size_t>(2 * kSteps * M));
      }
      // Backward twice the forward: a steady step idles (P−1)·B at the start of the earlier
      // stages' backwards, against (P−1)·(F+B) for the flushed 1F1B step.
      const PipelineOpTimes t{1, 1, 1};
      const double one = simulate_pipeline(PipelineSchedule::k1F1B, flushed, t).bubble_fraction();
      const PipelineTimeline steady =
          simulate_pipeline(PipelineSchedule::k2BW, {P, M, 1, false, false}, t);
      EXPECT_LT(steady.bubble_fraction(), one) << P << " " << M;
      EXPECT_NEAR(steady.makespan, 3.0 * M + 2.0 * (P - 1), 1e-9) << P << " " << M;
      // Each rank holds its look-ahead forwards on top of 1F1B's in-flight micro-batches.
      for (int r = 0; r < P; ++r)
        EXPECT_LE(steady.peak_in_flight[static_cast<size_t>(r)], P - r) << P << " " << M;
    }
  }
  EXPECT_THROW(check_pipeline_shape(PipelineSchedule::k1F1B, {2, 4, 1, false, true}), ConfigError);
  EXPECT_THROW(check_pipeline_shape(PipelineSchedule::k2BW, {4, 3, 1, true, false}), ConfigError);
}

// Per-virtual-stage op times all equal to `times`: exactly the single-times simulation.
TEST(PipelineSchedule, PerStageTimesEqualToOneTimesSimulateTheSame) {
  const PipelineOpTimes times{1, 1.5, 0.5};
  for (PipelineSchedule s : kAll)
    for (const PipelineShape& shape : shapes_for(s)) {
      const PipelineTimeline one = simulate_pipeline(s, shape, times);
      const PipelineTimeline each =
          simulate_pipeline(s, shape,
                            std::vector<PipelineOpTimes>(
                                static_cast<size_t>(shape.stages * shape.virtual_stages), times));
      ASSERT_EQ(each.entries.size(), one.entries.size()) << to_string(s);
      for (size_t i = 0; i < one.entries.size(); ++i) {
        EXPECT_EQ(each.entries[i].rank, one.entries[i].rank);
        EXPECT_EQ(each.entries[i].action, one.entries[i].action);
        EXPECT_EQ(each.entries[i].start, one.entries[i].start);
        EXPECT_EQ(each.entries[i].end, one.entries[i].end);
      }
      EXPECT_EQ(each.makespan, one.makespan);
      EXPECT_EQ(each.busy, one.busy);
      EXPECT_EQ(each.peak_in_flight, one.peak_in_flight);
    }
  // The wrong number of op times is named.
  try {
    simulate_pipeline(PipelineSchedule::kInterleaved, {4, 8, 2}, std::vector<PipelineOpTimes>(4));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_CONTAINS(e.what(), "4 op times given for 8 virtual stages");
  }
}

// Unbalanced stages: stages 0..P−2 take F and B (the fused backward) per micro-batch, the last
// k·F and k·B, k ≥ 1 (GPT-2's last stage holds the LM head). The last stage is the bottleneck
// and, once its first input arrives, never waits, in GPipe as in 1F1B:
//   - its first forward can start after the P−1 forwards upstream: (P−1)·F;
//   - it then computes M·k·(F+B) without a gap (GPipe: upstream forwards arrive every F ≤ k·F;
//     1F1B: stage P−2 sends the forward of micro-batch m+1 at most B+F after receiving the
//     gradient of m−1, while the last stage spends k·(F+B) ≥ F+B on F(m), B(m) in between);
//   - the last gradient then crosses the P−1 stages upstream: (P−1)·B (each stage finished its
//     previous backward long before, the last stage's being k·(F+B) ≥ B apart).
// So makespan = (P−1)(F+B) + M·k·(F+B), busy = M(F+B)(P−1+k) over all stages, and
//   bubble = 1 − M(P−1+k) / (P·(P−1+M·k))
// (k = 1: (P−1)/(M+P−1), the balanced formula). P = 4, M = 8, k = 3: 1 − 48/108 = 55.6%.
TEST(PipelineSchedule, UnbalancedLastStageBubble) {
  const double F = 1, B = 2;
  for (const double k : {1.0, 3.0, 4.5})
    for (int P = 2; P <= 5; ++P)
      for (int M = 1; M <= 12; ++M) {
        std::vector<PipelineOpTimes> times(static_cast<size_t>(P), PipelineOpTimes{F, B, 0});
        times.back() = {k * F, k * B, 0};
        const double makespan = (P - 1) * (F + B) + M * k * (F + B);
        const double bubble = 1.0 - M * (P - 1 + k) / (P * (P - 1 + M * k));
        for (PipelineSchedule s : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
          const PipelineTimeline t = simulate_pipeline(s, {P, M, 1}, times);
          EXPECT_NEAR(t.makespan, makespan, 1e-9) << to_string(s) << " P " << P << " M " << M;
          EXPECT_NEAR(t.bubble_fraction(), bubble, 1e-12)
              << to_string(s) << " P " << P << " M " << M << " k " << k;
          EXPECT_NEAR(t.utilization(P - 1), M * k * (F + B) / makespan, 1e-12);
        }
      }
  // The example in the comment, and the mean op times' (wrong) prediction for it: averaging the
  // stages to F = 1.5, B = 3 predicts the balanced 27.3%.
  std::vector<PipelineOpTimes> times(4, PipelineOpTimes{1, 2, 0});
  times.back() = {3, 6, 0};
  EXPECT_NEAR(simulate_pipeline(PipelineSchedule::k1F1B, {4, 8, 1}, times).bubble_fraction(),
              1 - 48.0 / 108, 1e-12);
  EXPECT_NEAR(simulate_pipeline(PipelineSchedule::k1F1B, {4, 8, 1}, {1.5, 3, 0}).bubble_fraction(),
              3.0 / 11, 1e-12);
}

// with_transfers on every rank: each receive pairs with exactly one send of the neighbouring
// virtual stage (activations from v−1, gradients from v+1), and comes before the pass it feeds.
TEST(PipelineSchedule, TransfersPairUp) {
  for (PipelineSchedule s : kAll)
    for (const PipelineShape& shape : shapes_for(s)) {
      const int P = shape.stages, V = shape.virtual_stages;
      SCOPED_TRACE(fmt::format("{} P {} M {} V {}", to_string(s), P, shape.micro_batches, V));
      // (micro-batch, receiving virtual stage) → how many receives / sends.
      std::map<std::pair<int, int>, int> recv_act, send_act, recv_grad, send_grad;
      for (int r = 0; r < P; ++r) {
        const auto all = with_transfers(pipeline_compute_actions(s, shape, r), shape, r);
        std::set<std::pair<int, int>> got_act, got_grad;  // received so far: (m, v)
        for (const PipelineAction& a : all) {
          const int v = virtual_stage(shape, r, a.chunk);
          ASSERT_GE(a.chunk, 0);
          ASSERT_LT(a.chunk, V);
          const std::pair<int, int> key{a.micro_batch, v};
          switch (a.type) {
            case ActionType::kRecvActivation:
              EXPECT_GT(v, 0);
              ++recv_act[key];
              got_act.insert(key);
              break;
            case ActionType::kSendActivation:  // to v+1 = the rank (v+1) mod P
              ++send_act[{a.micro_batch, v + 1}];
              break;
            case ActionType::kRecvGradient:
              EXPECT_LT(v, P * V - 1);
              ++recv_grad[key];
              got_grad.insert(key);
              break;
            case ActionType::kSendGradient:  // to v−1
              ++send_grad[{a.micro_batch, v - 1}];
              break;
            case ActionType::kForward:
              if (v > 0) {
                EXPECT_TRUE(got_act.count(key)) << "F" << a.micro_batch << " of v " << v;
              }
              break;
            case ActionType::kBackward:
            case ActionType::kBackwardInput:
              if (v < P * V - 1) {
                EXPECT_TRUE(got_grad.count(key)) << "B" << a.micro_batch << " of v " << v;
              }
              break;
            default:
              break;
          }
        }
      }
      // Every receive has exactly one send and every send exactly one receive, for every
      // micro-batch at every virtual stage boundary.
      EXPECT_EQ(recv_act, send_act);
      EXPECT_EQ(recv_grad, send_grad);
      for (int m = 0; m < shape.micro_batches; ++m)
        for (int v = 0; v < P * V; ++v) {
          const int want_act = v > 0 ? 1 : 0, want_grad = v < P * V - 1 ? 1 : 0;
          const auto count = [&](const std::map<std::pair<int, int>, int>& c) {
            const auto it = c.find({m, v});
            return it == c.end() ? 0 : it->second;
          };
          EXPECT_EQ(count(recv_act), want_act) << "m " << m << " v " << v;
          EXPECT_EQ(count(send_act), want_act) << "m " << m << " v " << v;
          EXPECT_EQ(count(recv_grad), want_grad) << "m " << m << " v " << v;
          EXPECT_EQ(count(send_grad), want_grad) << "m " << m << " v " << v;
        }
    }
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
