#include "parallel/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <deque>

#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

PipelineAction F(int m, int c = 0) { return {ActionType::kForward, m, c}; }
PipelineAction BW(int m, int c = 0) { return {ActionType::kBackward, m, c}; }

/// PipeDream-Flush (1F1B): rank r runs P-1-r warm-up forwards, then alternates one forward and
/// one backward, then the remaining backwards (arXiv 2104.04473 §2.2.1, Figure 4 top).
std::vector<PipelineAction> one_f_one_b(const PipelineShape& s, int r) {
  const int M = s.micro_batches, warmup = std::min(s.stages - 1 - r, M);
  std::vector<PipelineAction> out;
  for (int m = 0; m < warmup; ++m) out.push_back(F(m));
  for (int i = 0; i < M - warmup; ++i) {
    out.push_back(F(warmup + i));
    out.push_back(BW(i));
  }
  for (int i = M - warmup; i < M; ++i) out.push_back(BW(i));
  return out;
}

/// PipeDream-2BW (arXiv 2006.09503 §3): 1F1B's order run without a flush between steps. With
/// `fill`, the warm-up forwards; then for each of the step's M backwards, first the forward w
/// places ahead of it — in a step that does not drain, the last w of those are the look-ahead
/// forwards of the next step's micro-batches 0..w−1 (numbered M..M+w−1).
std::vector<PipelineAction> two_bw(const PipelineShape& s, int r) {
  const int M = s.micro_batches, w = two_bw_lookahead(s, r);
  std::vector<PipelineAction> out;
  if (s.fill)
    for (int m = 0; m < w; ++m) out.push_back(F(m));
  for (int i = 0; i < M; ++i) {
    if (i + w < M || !s.drain) out.push_back(F(i + w));
    out.push_back(BW(i));
  }
  return out;
}

/// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241 §3): 1F1B's order of
/// forwards and input-gradient passes B (the backward split: B is on the critical path to the
/// previous stage, W — the weight gradient — is needed only by the optimizer step), with every W
/// placed where its rank would otherwise wait. The placement is decided the way the paper's
/// heuristic scheduler does it, by a list-scheduling pass with unit op times: at each point a rank
/// runs its next F/B if that pass's input has arrived; if not, and a W is pending, it runs the
/// oldest W; a forward that would make a rank hold more than P micro-batches' activations (1F1B's
/// peak, on its first stage; a micro-batch's activations are freed by its W) first runs a pending
/// W. Remaining Ws run at the end. With F = B = W the bubble is (P−1)(F+B−W) against 1F1B's
/// (P−1)(F+B+W) (tested).
std::vector<std::vector<PipelineAction>> zb_h1_all(const PipelineShape& s) {
  const int P = s.stages, M = s.micro_batches;
  struct Rank {
    std::vector<PipelineAction> base;  // 1F1B order, B = input-gradient pass
    size_t next = 0;
    std::deque<int> pending_w;
    int held = 0;  // micro-batches forwarded whose W has not run
    double free_at = 0;
    std::vector<PipelineAction> out;
  };
  std::vector<Rank> ranks(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    for (PipelineAction a : one_f_one_b(s, r)) {
      if (a.type == ActionType::kBackward) a.type = ActionType::kBackwardInput;
      ranks[static_cast<size_t>(r)].base.push_back(a);
    }
  }
  // End times of passes: forward[r][m], input_grad[r][m] (negative: not scheduled yet).
  std::vector<std::vector<double>> fwd(static_cast<size_t>(P),
                                       std::vector<double>(static_cast<size_t>(M), -1));
  auto bwd = fwd;
  const auto dep_end = [&](int r, const PipelineAction& a) -> double {
    if (a.type == ActionType::kForward)
      return r == 0 ? 0.0 : fwd[static_cast<size_t>(r) - 1][static_cast<size_t>(a.micro_batch)];
    return r == P - 1 ? fwd[static_cast<size_t>(r)][static_cast<size_t>(a.micro_batch)]
                      : bwd[static_cast<size_t>(r) + 1][static_cast<size_t>(a.micro_batch)];
  };
  const auto run_w = [&](Rank& x) {
    x.out.push_back({ActionType::kBackwardWeight, x.pending_w.front(), 0});
    x.pending_w.pop_front();
    --x.held;
    x.free_at += 1;
  };
  for (;;) {
    bool done = true;
    for (const Rank& x : ranks) done = done && x.next >= x.base.size();
    if (done) break;
    bool progressed = false;
    // Try ranks in order of free time until one can act.
    std::vector<int> order(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) order[static_cast<size_t>(r)] = r;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return ranks[static_cast<size_t>(a)].free_at < ranks[static_cast<size_t>(b)].free_at;
    });
    for (int r : order) {
      Rank& x = ranks[static_cast<size_t>(r)];
      if (x.next >= x.base.size()) continue;
      const PipelineAction& a = x.base[x.next];
      if (a.type == ActionType::kForward && x.held >= P && !x.pending_w.empty()) {
        run_w(x);
        progressed = true;
        break;
      }
      const double dep = dep_end(r, a);
      if (dep >= 0 && dep <= x.free_at) {
        x.out.push_back(a);
        x.free_at += 1;
        if (a.type == ActionType::kForward) {
          fwd[static_cast<size_t>(r)][static_cast<size_t>(a.micro_batch)] = x.free_at;
          ++x.held;
        } else {
          bwd[static_cast<size_t>(r)][static_cast<size_t>(a.micro_batch)] = x.free_at;
          x.pending_w.push_back(a.micro_batch);
        }
        ++x.next;
        progressed = true;
        break;
      }
      if (!x.pending_w.empty()) {  // the input is not there yet: fill the wait with a W
        run_w(x);
        progressed = true;
        break;
      }
      if (dep >= 0) {  // scheduled on another rank: wait for it
        x.free_at = dep;
        progressed = true;
        break;
      }
    }
    ST_ASSERT(progressed && "zb-h1 placement pass stalled");
  }
  std::vector<std::vector<PipelineAction>> out;
  for (Rank& x : ranks) {
    while (!x.pending_w.empty()) run_w(x);
    out.push_back(std::move(x.out));
  }
  return out;
}

/// Interleaved 1F1B (arXiv 2104.04473 §2.2.2): the M·V micro-steps of a rank visit its chunks in
/// groups of P micro-batches: forward micro-step k runs chunk (k mod P·V) / P on micro-batch
/// (k div P·V)·P + k mod P; backward micro-steps visit the chunks in reverse. Warm-up: (P-1-r)·2
/// + (V-1)·P forwards (Megatron-LM's schedules.py).
std::vector<PipelineAction> interleaved(const PipelineShape& s, int r) {
  const int P = s.stages, V = s.virtual_stages, total = s.micro_batches * V;
  const auto micro_batch = [&](int k) { return (k / (P * V)) * P + k % P; };
  const auto chunk = [&](int k, bool forward) {
    const int c = (k % (P * V)) / P;
    return forward ? c : V - 1 - c;
  };
  const int warmup = std::min((P - 1 - r) * 2 + (V - 1) * P, total);
  std::vector<PipelineAction> out;
  for (int k = 0; k < warmup; ++k) out.push_back(F(micro_batch(k), chunk(k, true)));
  for (int k = 0; k < total - warmup; ++k) {
    const int f = warmup + k;
    out.push_back(F(micro_batch(f), chunk(f, true)));
    out.push_back(BW(micro_batch(k), chunk(k, false)));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(BW(micro_batch(k), chunk(k, false)));
  return out;
}

}  // namespace

std::vector<PipelineAction> pipeline_compute_actions(PipelineSchedule schedule,
                                                     const PipelineShape& s, int rank) {
  check_pipeline_shape(schedule, s);
  ST_ASSERT(rank >= 0 && rank < s.stages);
  switch (schedule) {
    case PipelineSchedule::kGPipe: {
      std::vector<PipelineAction> out;
      for (int m = 0; m < s.micro_batches; ++m) out.push_back(F(m));
      for (int m = 0; m < s.micro_batches; ++m) out.push_back(BW(m));
      return out;
    }
    case PipelineSchedule::k1F1B:
      return one_f_one_b(s, rank);
    case PipelineSchedule::k2BW:
      return two_bw(s, rank);
    case PipelineSchedule::kInterleaved:
      return interleaved(s, rank);
    case PipelineSchedule::kZBH1:
      return zb_h1_all(s)[static_cast<size_t>(rank)];
  }
  return {};
}

std::vector<PipelineAction> with_transfers(const std::vector<PipelineAction>& compute,
                                           const PipelineShape& s, int rank) {
  const int last = s.stages * s.virtual_stages - 1;
  // 2bw without fill: the first forward's input arrived at the end of the step before.
  const int received = s.fill ? -1 : two_bw_lookahead(s, rank);
  std::vector<PipelineAction> out;
  for (const PipelineAction& a : compute) {
    const int v = virtual_stage(s, rank, a.chunk);
    switch (a.type) {
      case ActionType::kForward:
        if (v > 0 && a.micro_batch != received)
          out.push_back({ActionType::kRecvActivation, a.micro_batch, a.chunk});
        out.push_back(a);
        if (v < last) out.push_back({ActionType::kSendActivation, a.micro_batch, a.chunk});
        break;
      case ActionType::kBackward:
      case ActionType::kBackwardInput:
        if (v < last) out.push_back({ActionType::kRecvGradient, a.micro_batch, a.chunk});
        out.push_back(a);
        if (v > 0) out.push_back({ActionType::kSendGradient, a.micro_batch, a.chunk});
        break;
      default:
        out.push_back(a);
    }
  }
  // 2bw without drain: the input of the next step's first forward here (the previous rank's last
  // look-ahead forward) is received within this step.
  if (!s.drain && rank > 0)
    out.push_back({ActionType::kRecvActivation, s.micro_batches + two_bw_lookahead(s, rank), 0});
  return out;
}

}  // namespace shardtrain
