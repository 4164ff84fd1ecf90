// When ZeRO-3 gathers, keeps and releases each layer's parameters during one micro-step: the
// rules of the strategy (zero3.cpp) as a pure function of the layout and the stage-3 options, so
// that the memory estimator (memory_estimator.cpp) predicts the same gathered bytes the strategy
// holds.
//
// A micro-step is a pass of 2n positions over the n layers: forward of layer p (p < n), then
// backward of layer 2n-1-p. Position p needs the units ParamLayout::uses(layer) — the layer and
// the layers it reads (tied weights). Units are layers; "resident" units (persistent, or a single
// rank) are never gathered.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "memory/param_layout.h"

namespace shardtrain {

/// The stage-3 settings the schedule follows (elements; DeepSpeed's stage3_* keys).
struct Zero3Limits {
  int64_t prefetch_bucket_size = 50'000'000;
  int64_t max_live_parameters = 1'000'000'000;
  int64_t max_reuse_distance = 1'000'000'000;
  bool overlap_comm = true;  ///< false: no prefetch
};

class Zero3Schedule {
 public:
  Zero3Schedule() = default;
  /// `padded[l]`: elements of layer l's gathered buffer; `resident[l]`: never gathered.
  Zero3Schedule(const ParamLayout& layout, std::vector<int64_t> padded,
                std::vector<bool> is_resident, Zero3Limits limits)
      : n_(layout.num_layers()),
        padded_(std::move(padded)),
        resident_(std::move(is_resident)),
        limits_(limits),
        uses_(static_cast<size_t>(2 * n_)),
        positions_(static_cast<size_t>(n_)),
        prefix_(static_cast<size_t>(2 * n_) + 1, 0) {
    for (int p = 0; p < num_positions(); ++p) {
      uses_[static_cast<size_t>(p)] = layout.uses(layer_at(p));
      int64_t need = 0;
      for (int u : uses(p)) {
        positions_[static_cast<size_t>(u)].push_back(p);
        if (!resident(u)) need += padded_of(u);
      }
      prefix_[static_cast<size_t>(p) + 1] = prefix_[static_cast<size_t>(p)] + need;
    }
  }

  int num_positions() const { return 2 * n_; }
  int forward_pos(int layer) const { return layer; }
  int backward_pos(int layer) const { return 2 * n_ - 1 - layer; }
  int layer_at(int p) const { return p < n_ ? p : 2 * n_ - 1 - p; }
  /// The units position `p` needs gathered (its layer first).
  const std::vector<int>& uses(int p) const { return uses_[static_cast<size_t>(p)]; }
  bool resident(int u) const { return resident_[static_cast<size_t>(u)]; }
  int64_t padded_of(int u) const { return padded_[static_cast<size_t>(u)]; }

  /// The units to start gathering after position `p`'s own: those positions p+1, p+2, ... need,
  /// in order, until prefetch_bucket_size elements ahead are covered (counting those already
  /// gathered), stopping before one would take the live elements past max_live_parameters.
  /// `gathered(u)`: whether unit u is gathered (or being gathered) now; `live`: their elements.
  std::vector<int> prefetch(int p, const std::function<bool(int)>& gathered, int64_t live) const {
    std::vector<int> out;
    if (!limits_.overlap_comm || limits_.prefetch_bucket_size <= 0) return out;
    int64_t budget = limits_.prefetch_bucket_size;
    for (int q = p + 1; q < num_positions(); ++q) {
      for (int u : uses(q)) {
        if (resident(u)) continue;
        if (!gathered(u) && std::find(out.begin(), out.end(), u) == out.end()) {
          if (live + padded_of(u) > limits_.max_live_parameters) return out;
          out.push_back(u);
          live += padded_of(u);
        }
        budget -= padded_of(u);
        if (budget <= 0) return out;
      }
    }
    return out;
  }

  /// Whether unit `u` (gathered, used at position `p`) stays gathered after `p`: it is used
  /// again in this pass, within max_reuse_distance gathered elements, and the live elements
  /// `live` are within max_live_parameters.
  bool keep_after(int u, int p, int64_t live) const {
    const auto& pos = positions_[static_cast<size_t>(u)];
    const auto next = std::upper_bound(pos.begin(), pos.end(), p);
    if (next == pos.end() || live > limits_.max_live_parameters) return false;
    return prefix_[static_cast<size_t>(*next)] - prefix_[static_cast<size_t>(p) + 1] <=
           limits_.max_reuse_distance;
  }

 private:
  int n_ = 0;
  std::vector<int64_t> padded_;
  std::vector<bool> resident_;
  Zero3Limits limits_;
  std::vector<std::vector<int>> uses_;       ///< per position
  std::vector<std::vector<int>> positions_;  ///< per unit: the positions using it, ascending
  std::vector<int64_t> prefix_;              ///< gathered elements needed before each position
};

/// Peaks of one simulated training micro-step under `schedule` (elements).
struct Zero3PassPeak {
  int64_t gathered = 0;   ///< most parameter elements gathered at once
  int64_t gradients = 0;  ///< most full-gradient buffer elements at once (several ranks)
  int64_t total = 0;      ///< most of both together
};

/// Replays one micro-step (forward then backward) as Zero3 runs it — gather before use and
/// prefetch, release after use, per-unit gradient buffers from each unit's first writer to its
/// reduction, at most `reductions_in_flight` reductions pending — and returns the peaks. With
/// `world` 1 gradients accumulate in the shard and no gradient buffer is counted.
inline Zero3PassPeak simulate_zero3_pass(const ParamLayout& layout, const Zero3Schedule& s,
                                         int world, size_t reductions_in_flight) {
  const int n = layout.num_layers();
  std::vector<bool> gathered(static_cast<size_t>(n), false), grad(static_cast<size_t>(n), false);
  std::vector<int> pending;
  int64_t live = 0, grads = 0;
  Zero3PassPeak peak;
  const auto note = [&] {
    peak.gathered = std::max(peak.gathered, live);
    peak.gradients = std::max(peak.gradients, grads);
    peak.total = std::max(peak.total, live + grads);
  };
  const auto gather = [&](int u) {
    if (s.resident(u) || gathered[static_cast<size_t>(u)]) return;
    gathered[static_cast<size_t>(u)] = true;
    live += s.padded_of(u);
  };
  const auto complete_front = [&] {
    grads -= s.padded_of(pending.front());
    pending.erase(pending.begin());
  };
  for (int p = 0; p < s.num_positions(); ++p) {
    const int layer = s.layer_at(p);
    const bool backward = p >= n;
    if (backward && world > 1) {
      for (int u : s.uses(p)) {
        if (grad[static_cast<size_t>(u)]) continue;
        while (std::find(pending.begin(), pending.end(), u) != pending.end()) complete_front();
        grad[static_cast<size_t>(u)] = true;
        grads += s.padded_of(u);
      }
    }
    for (int u : s.uses(p)) gather(u);
    for (int u : s.prefetch(
             p, [&](int u) { return gathered[static_cast<size_t>(u)]; }, live))
      gather(u);
    note();
    if (backward && world > 1) {
      for (int u : s.uses(p)) {
        if (layout.users(u).front() != layer) continue;
        grad[static_cast<size_t>(u)] = false;
        while (pending.size() >= reductions_in_flight) complete_front();
        pending.push_back(u);
      }
    }
    for (int u : s.uses(p)) {
      if (s.resident(u) || !gathered[static_cast<size_t>(u)]) continue;
      if (!s.keep_after(u, p, live)) {
        gathered[static_cast<size_t>(u)] = false;
        live -= s.padded_of(u);
      }
    }
  }
  return peak;
}

/// Elements of the arena Zero3 carves its gathered units and gradient buffers from on several
/// ranks (parallel/device_arena.h, before the arena's rounding): the replay's peak of both
/// together plus the largest unit, slack against fragmentation; 0 when nothing is ever gathered.
inline int64_t zero3_arena_elements(const ParamLayout& layout, const Zero3Schedule& s, int world,
                                    size_t reductions_in_flight) {
  const int64_t peak = simulate_zero3_pass(layout, s, world, reductions_in_flight).total;
  if (peak == 0) return 0;
  int64_t largest = 0;
  for (int u = 0; u < layout.num_layers(); ++u) largest = std::max(largest, s.padded_of(u));
  return peak + largest;
}

}  // namespace shardtrain
