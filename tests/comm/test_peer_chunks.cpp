// The copy-engine collectives' plans (comm/peer_chunks.h) without GPUs. For world sizes 2..8,
// awkward element counts (0, 1, W ± 1, primes, counts that straddle the chunks and the staging
// pieces) and staging sizes small enough to make many pieces, every rank's plan is replayed on host
// arrays — its own buffer and staging as std::vectors, copies into the peers' arrays, sums of the
// staged slots — barrier by barrier, and the results must equal the reference sums and
// concatenations exactly. The replay also checks that every step stays inside its arrays, that
// every output element is written exactly once, that the ranks' plans have the same number of
// barriers (or the GPUs would wait forever) and that between two barriers no rank writes memory
// another rank reads or writes (a race on the GPUs). The production staging (kPeerStagingBytes)
// makes pieces of millions of elements: those plans are checked by their ranges only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"  // kPeerStagingBytes
#include "comm/peer_chunks.h"

namespace st = shardtrain;

namespace {

using Kind = st::PeerStep::Kind;

enum class Op { kAllReduce, kReduceScatter, kAllGather };

/// One collective: `n` is all_reduce's element count, or the per-rank count of reduce_scatter's
/// output and all_gather's input.
struct Shape {
  Op op = Op::kAllReduce;
  int world = 2;
  size_t n = 0;
  size_t esize = 4;          ///< bytes per element
  size_t staging_bytes = 0;  ///< the registration's staging
  bool in_place = false;     ///< reduce_scatter: output = input slice r; all_gather: input = output
                             ///< slice r

  std::string str() const {
    std::ostringstream s;
    s << (op == Op::kAllReduce       ? "all_reduce"
          : op == Op::kReduceScatter ? "reduce_scatter"
                                     : "all_gather")
      << (in_place ? " (in place)" : "") << " W=" << world << " n=" << n << " esize=" << esize
      << " staging=" << staging_bytes << " B (piece "
      << st::peer_piece_elements(world, esize, staging_bytes) << ")";
    return s.str();
  }
};

std::optional<st::PeerPlan> plan_of(const Shape& s, int rank) {
  switch (s.op) {
    case Op::kAllReduce:
      return st::peer_all_reduce_plan(s.world, rank, s.n, s.esize, s.staging_bytes);
    case Op::kReduceScatter:
      return st::peer_reduce_scatter_plan(s.world, rank, s.n, s.esize, s.staging_bytes);
    case Op::kAllGather:
      return st::peer_all_gather_plan(s.world, rank, s.n);
  }
  return std::nullopt;
}

/// Where a rank's input and output lie in its one buffer (they overlap when in place).
struct Layout {
  size_t in_first = 0, in_count = 0, out_first = 0, out_count = 0, buffer = 0;
};

Layout layout_of(const Shape& s, int rank) {
  const size_t w = static_cast<size_t>(s.world), n = s.n, r = static_cast<size_t>(rank);
  switch (s.op) {
    case Op::kAllReduce:
      return {0, n, 0, n, n};
    case Op::kReduceScatter:
      return s.in_place ? Layout{0, w * n, r * n, n, w * n} : Layout{0, w * n, w * n, n, w * n + n};
    case Op::kAllGather:
      return s.in_place ? Layout{r * n, n, 0, w * n, w * n} : Layout{w * n, n, 0, w * n, w * n + n};
  }
  return {};
}

/// Memory spaces of a rank.
enum Space { kBuffer = 0, kStagingSpace = 1 };

/// An array of a rank resolved to its space and extent.
struct Extent {
  Space space;
  size_t first, count;
};

Extent extent_of(const Shape& s, const Layout& l, st::PeerArray a) {
  switch (a) {
    case st::PeerArray::kInput:
      return {kBuffer, l.in_first, l.in_count};
    case st::PeerArray::kOutput:
      return {kBuffer, l.out_first, l.out_count};
    case st::PeerArray::kStaging:
      return {kStagingSpace, 0, s.staging_bytes / s.esize};
  }
  return {kBuffer, 0, 0};
}

bool inside(size_t offset, size_t count, size_t size) {
  return offset <= size && count <= size - offset;
}

/// The plans of every rank, checked by their ranges alone (any staging size): each step inside
/// its arrays, copies and sums of at least one element, sums only in reductions, the same number
/// of barriers on every rank, and every rank's output covered exactly once by the sums and copies
/// that write it. Returns the plans (empty when some check failed).
std::vector<st::PeerPlan> checked_plans(const Shape& s) {
  const int w = s.world;
  std::vector<st::PeerPlan> plans;
  for (int r = 0; r < w; ++r) {
    auto p = plan_of(s, r);
    if (!p) {
      ADD_FAILURE() << s.str() << ": no plan for rank " << r;
      return {};
    }
    plans.push_back(std::move(*p));
  }
  // Output ranges written on each rank: (first, count) relative to the output.
  std::vector<std::vector<std::pair<size_t, size_t>>> written(static_cast<size_t>(w));
  std::vector<size_t> barriers(static_cast<size_t>(w), 0);
  bool ok = true;
  for (int r = 0; r < w; ++r) {
    const Layout mine = layout_of(s, r);
    for (size_t i = 0; i < plans[static_cast<size_t>(r)].size() && ok; ++i) {
      const st::PeerStep& step = plans[static_cast<size_t>(r)][i];
      const auto where = [&] {
        return s.str() + ": rank " + std::to_string(r) + " step " + std::to_string(i);
      };
      if (step.kind == Kind::kBarrier) {
        ++barriers[static_cast<size_t>(r)];
        continue;
      }
      if (step.count == 0) {
        ADD_FAILURE() << where() << ": empty copy or sum";
        ok = false;
        break;
      }
      if (step.kind == Kind::kCopy) {
        if (step.peer < 0 || step.peer >= w) {
          ADD_FAILURE() << where() << ": copy to rank " << step.peer;
          ok = false;
          break;
        }
        const Extent src = extent_of(s, mine, step.src);
        const Extent dst = extent_of(s, layout_of(s, step.peer), step.dst);
        if (!inside(step.src_offset, step.count, src.count) ||
            !inside(step.dst_offset, step.count, dst.count)) {
          ADD_FAILURE() << where() << ": copy of " << step.count << " from " << step.src_offset
                        << " (of " << src.count << ") to " << step.dst_offset << " (of "
                        << dst.count << ") of rank " << step.peer << " is out of bounds";
          ok = false;
          break;
        }
        if (step.dst == st::PeerArray::kOutput)
          written[static_cast<size_t>(step.peer)].push_back({step.dst_offset, step.count});
      } else {
        const Extent in = extent_of(s, mine, st::PeerArray::kInput);
        const Extent out = extent_of(s, mine, st::PeerArray::kOutput);
        const size_t staging = s.staging_bytes / s.esize;
        const size_t slots = static_cast<size_t>(w - 1);
        if (s.op == Op::kAllGather || !inside(step.src_offset, step.count, in.count) ||
            !inside(step.dst_offset, step.count, out.count) || step.stride < step.count ||
            !inside((slots - 1) * step.stride, step.count, staging)) {
          ADD_FAILURE() << where() << ": sum of " << step.count << " from " << step.src_offset
                        << " (of " << in.count << ") into " << step.dst_offset << " (of "
                        << out.count << "), staging slots every " << step.stride << " (of "
                        << staging << ") is out of bounds";
          ok = false;
          break;
        }
        written[static_cast<size_t>(r)].push_back({step.dst_offset, step.count});
      }
    }
  }
  for (int r = 1; r < w && ok; ++r)
    if (barriers[static_cast<size_t>(r)] != barriers[0]) {
      ADD_FAILURE() << s.str() << ": rank " << r << " has " << barriers[static_cast<size_t>(r)]
                    << " barriers, rank 0 " << barriers[0];
      ok = false;
    }
  for (int r = 0; r < w && ok; ++r) {
    auto& ranges = written[static_cast<size_t>(r)];
    std::sort(ranges.begin(), ranges.end());
    size_t next = 0;
    for (const auto& [first, count] : ranges) {
      if (first != next) {
        ADD_FAILURE() << s.str() << ": rank " << r << "'s output "
                      << (first < next ? "is written twice at " : "is never written at ")
                      << std::min(first, next);
        ok = false;
        break;
      }
      next = first + count;
    }
    if (ok && next != layout_of(s, r).out_count) {
      ADD_FAILURE() << s.str() << ": rank " << r << "'s output is never written at " << next;
      ok = false;
    }
  }
  if (!ok) return {};
  return plans;
}

/// Who read and wrote a location since the current epoch (the steps between two barriers)
/// began: one bit per rank.
struct Access {
  size_t epoch = SIZE_MAX;
  uint32_t readers = 0, writers = 0;
};

/// Replays the plans of every rank on host arrays (int64 values: sums are exact in any order)
/// and checks the results against the reference.
void replay(const Shape& s, uint32_t seed) {
  SCOPED_TRACE(s.str());
  const std::vector<st::PeerPlan> plans = checked_plans(s);
  if (plans.empty()) return;
  const int w = s.world;
  const size_t W = static_cast<size_t>(w);
  const size_t staging = s.staging_bytes / s.esize;
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> value(-(int64_t{1} << 40), int64_t{1} << 40);
  // mem[r][space]: rank r's buffer and staging; the staging starts with garbage.
  std::vector<std::vector<std::vector<int64_t>>> mem(W);
  std::vector<std::vector<std::vector<Access>>> access(W);
  for (size_t r = 0; r < W; ++r) {
    mem[r].resize(2);
    mem[r][kBuffer].resize(layout_of(s, static_cast<int>(r)).buffer);
    mem[r][kStagingSpace].resize(staging);
    for (auto& space : mem[r])
      for (auto& v : space) v = value(gen);
    access[r].resize(2);
    access[r][kBuffer].resize(mem[r][kBuffer].size());
    access[r][kStagingSpace].resize(staging);
  }
  const auto initial = mem;

  // Each rank's plan split at its barriers into epochs (checked_plans: the same count).
  std::vector<std::vector<std::vector<const st::PeerStep*>>> epochs(W);
  for (size_t r = 0; r < W; ++r) {
    epochs[r].emplace_back();
    for (const st::PeerStep& step : plans[r]) {
      if (step.kind == Kind::kBarrier) {
        epochs[r].emplace_back();
      } else {
        epochs[r].back().push_back(&step);
      }
    }
  }
  std::string race;
  const auto touch = [&](size_t epoch, int actor, size_t owner, Space space, size_t first,
                         size_t count, bool write) {
    const uint32_t me = 1u << actor;
    for (size_t i = first; i < first + count && race.empty(); ++i) {
      Access& a = access[owner][space][i];
      if (a.epoch != epoch) a = Access{epoch, 0, 0};
      const uint32_t others = (write ? a.readers | a.writers : a.writers) & ~me;
      if (others != 0) {
        race = "epoch " + std::to_string(epoch) + ": rank " + std::to_string(actor) +
               (write ? " writes " : " reads ") +
               (space == kBuffer ? "the buffer" : "the staging") + " of rank " +
               std::to_string(owner) + " at " + std::to_string(i) + " while another rank (mask " +
               std::to_string(others) + ") " + (a.writers & ~me ? "writes" : "reads") + " it";
      }
      (write ? a.writers : a.readers) |= me;
    }
  };
  for (size_t e = 0; e < epochs[0].size() && race.empty(); ++e) {
    for (int r = 0; r < w; ++r) {
      const size_t R = static_cast<size_t>(r);
      const Layout mine = layout_of(s, r);
      for (const st::PeerStep* step : epochs[R][e]) {
        if (step->kind == Kind::kCopy) {
          const size_t P = static_cast<size_t>(step->peer);
          const Extent src = extent_of(s, mine, step->src);
          const Extent dst = extent_of(s, layout_of(s, step->peer), step->dst);
          const size_t from = src.first + step->src_offset, to = dst.first + step->dst_offset;
          if (P == R && src.space == dst.space && from == to) continue;  // the same memory
          ASSERT_FALSE(P == R && src.space == dst.space && from < to + step->count &&
                       to < from + step->count)
              << "rank " << r << " copies between overlapping ranges";
          touch(e, r, R, src.space, from, step->count, false);
          touch(e, r, P, dst.space, to, step->count, true);
          std::copy_n(mem[R][src.space].begin() + static_cast<ptrdiff_t>(from), step->count,
                      mem[P][dst.space].begin() + static_cast<ptrdiff_t>(to));
        } else {
          const size_t own = mine.in_first + step->src_offset;
          const size_t out = mine.out_first + step->dst_offset;
          touch(e, r, R, kBuffer, own, step->count, false);
          for (size_t k = 0; k + 1 < W; ++k)
            touch(e, r, R, kStagingSpace, k * step->stride, step->count, false);
          touch(e, r, R, kBuffer, out, step->count, true);
          std::vector<int64_t> sum(step->count);
          for (size_t i = 0; i < step->count; ++i) {
            sum[i] = mem[R][kBuffer][own + i];
            for (size_t k = 0; k + 1 < W; ++k)
              sum[i] += mem[R][kStagingSpace][k * step->stride + i];
          }
          std::copy(sum.begin(), sum.end(), mem[R][kBuffer].begin() + static_cast<ptrdiff_t>(out));
        }
      }
    }
  }
  ASSERT_TRUE(race.empty()) << race;

  // The reference: each rank's buffer with its output replaced by the exact result.
  for (int r = 0; r < w; ++r) {
    const size_t R = static_cast<size_t>(r);
    const Layout mine = layout_of(s, r);
    std::vector<int64_t> expected = initial[R][kBuffer];
    for (size_t j = 0; j < mine.out_count; ++j) {
      int64_t v = 0;
      switch (s.op) {
        case Op::kAllReduce:
          for (size_t q = 0; q < W; ++q) v += initial[q][kBuffer][j];
          break;
        case Op::kReduceScatter:
          for (size_t q = 0; q < W; ++q) v += initial[q][kBuffer][R * s.n + j];
          break;
        case Op::kAllGather: {
          const int q = static_cast<int>(j / s.n);
          v = initial[static_cast<size_t>(q)][kBuffer][layout_of(s, q).in_first + j % s.n];
          break;
        }
      }
      expected[mine.out_first + j] = v;
    }
    const std::vector<int64_t>& got = mem[R][kBuffer];
    const auto diff = std::mismatch(got.begin(), got.end(), expected.begin());
    ASSERT_TRUE(diff.first == got.end())
        << "rank " << r << ": buffer element " << (diff.first - got.begin()) << " is "
        << *diff.first << ", expected " << *diff.second << " (output at " << mine.out_first << ", "
        << mine.out_count << " elements)";
  }
}

/// Element counts for world size w and piece size p (elements per staging slot): the small and
/// odd ones, primes, and those around the all-reduce's 64-element chunk rounding and the pieces.
std::vector<size_t> counts(int w, size_t p, size_t limit) {
  const size_t W = static_cast<size_t>(w);
  std::set<size_t> c = {0,  1,   2,   3,   5,   7,   13,  31,   61,    63, 64,
                        65, 127, 128, 129, 257, 641, 997, 1009, W - 1, W,  W + 1};
  for (size_t chunk : {size_t{64}, 64 * W, 128 * W})
    for (size_t d : {chunk - 1, chunk, chunk + 1, chunk * W - 1, chunk * W + 1}) c.insert(d);
  for (size_t k : {size_t{1}, size_t{2}, size_t{3}, W, 2 * W, 3 * W + 1})
    for (size_t d : {k * p - 1, k * p, k * p + 1}) c.insert(d);
  c.insert(64 * ((p + 63) / 64) * W + 1);  // an all-reduce chunk just over one piece
  std::vector<size_t> out;
  for (size_t n : c)
    if (n <= limit) out.push_back(n);
  return out;
}

/// Small staging sizes for world size w: one 16-byte vector per sender, and three vectors with
/// bytes over that the rounding drops.
std::vector<size_t> small_stagings(int w) {
  const size_t senders = static_cast<size_t>(w - 1);
  return {16 * senders, 48 * senders + 15 * senders + 7};
}

TEST(PeerChunks, ReplayAllReduceMatchesTheExactSum) {
  for (int w = 2; w <= 8; ++w)
    for (size_t esize : {size_t{2}, size_t{4}})
      for (size_t staging : small_stagings(w))
        for (size_t n : counts(w, st::peer_piece_elements(w, esize, staging), 6000)) {
          replay({Op::kAllReduce, w, n, esize, staging, false}, static_cast<uint32_t>(n + 17 * w));
          if (::testing::Test::HasFatalFailure()) return;
        }
}

TEST(PeerChunks, ReplayReduceScatterMatchesTheExactSum) {
  for (int w = 2; w <= 8; ++w)
    for (size_t esize : {size_t{2}, size_t{4}})
      for (size_t staging : small_stagings(w))
        for (size_t n : counts(w, st::peer_piece_elements(w, esize, staging), 1500))
          for (bool in_place : {false, true}) {
            replay({Op::kReduceScatter, w, n, esize, staging, in_place},
                   static_cast<uint32_t>(3 * n + w));
            if (::testing::Test::HasFatalFailure()) return;
          }
}

TEST(PeerChunks, ReplayAllGatherMatchesTheConcatenation) {
  for (int w = 2; w <= 8; ++w)
    for (size_t n : counts(w, 4, 1500))
      for (bool in_place : {false, true}) {
        replay({Op::kAllGather, w, n, 1, 0, in_place}, static_cast<uint32_t>(5 * n + w));
        if (::testing::Test::HasFatalFailure()) return;
      }
}

TEST(PeerChunks, ProductionStagingPlansStayInBoundsAndCoverTheOutput) {
  // Pieces of millions of elements (32 MiB over W − 1 senders): ranges only, no replay.
  for (int w = 2; w <= 8; ++w)
    for (size_t esize : {size_t{2}, size_t{4}}) {
      const size_t p = st::peer_piece_elements(w, esize, st::kPeerStagingBytes);
      ASSERT_GT(p, 0u);
      EXPECT_EQ(p * esize % 16, 0u);
      EXPECT_LE(p * esize * static_cast<size_t>(w - 1), st::kPeerStagingBytes);
      for (size_t n : counts(w, p, size_t{1} << 40)) {
        checked_plans({Op::kAllReduce, w, n, esize, st::kPeerStagingBytes, false});
        for (bool in_place : {false, true})
          checked_plans({Op::kReduceScatter, w, n, esize, st::kPeerStagingBytes, in_place});
        if (::testing::Test::HasFailure()) return;
      }
      for (size_t n : {size_t{1'000'003}, size_t{9'000'001}, size_t{50'331'645}}) {
        checked_plans({Op::kAllReduce, w, n, esize, st::kPeerStagingBytes, false});
        checked_plans({Op::kReduceScatter, w, n, esize, st::kPeerStagingBytes, true});
      }
    }
}

TEST(PeerChunks, AllReduceChunksTileTheTensorInRankOrder) {
  for (int w = 2; w <= 8; ++w)
    for (size_t n : counts(w, 1000, 100'000)) {
      size_t next = 0;
      for (int k = 0; k < w; ++k) {
        const st::PeerRange c = st::peer_all_reduce_chunk(w, n, k);
        EXPECT_EQ(c.first, next) << "W=" << w << " n=" << n << " chunk " << k;
        next = c.first + c.count;
      }
      EXPECT_EQ(next, n) << "W=" << w;
    }
}

TEST(PeerChunks, UnsupportedShapesHaveNoPlanOnAnyRank) {
  for (int w = 2; w <= 8; ++w)
    for (size_t esize : {size_t{2}, size_t{4}}) {
      const size_t too_small = 16 * static_cast<size_t>(w - 1) - 1;  // no whole vector per sender
      EXPECT_EQ(st::peer_piece_elements(w, esize, too_small), 0u);
      for (int r = 0; r < w; ++r) {
        EXPECT_FALSE(st::peer_all_reduce_plan(w, r, 100, esize, too_small).has_value());
        EXPECT_FALSE(st::peer_reduce_scatter_plan(w, r, 100, esize, too_small).has_value());
        EXPECT_TRUE(st::peer_all_gather_plan(w, r, 100).has_value());  // needs no staging
        EXPECT_TRUE(st::peer_all_reduce_plan(w, r, 100, esize, too_small + 1).has_value());
      }
      EXPECT_FALSE(st::peer_all_reduce_plan(w, w, 100, esize, st::kPeerStagingBytes));
      EXPECT_FALSE(st::peer_all_reduce_plan(w, -1, 100, esize, st::kPeerStagingBytes));
      EXPECT_FALSE(st::peer_all_gather_plan(w, w, 100));
    }
  EXPECT_FALSE(st::peer_all_reduce_plan(1, 0, 100, 4, st::kPeerStagingBytes));
  EXPECT_FALSE(st::peer_reduce_scatter_plan(1, 0, 100, 4, st::kPeerStagingBytes));
  EXPECT_FALSE(st::peer_all_gather_plan(1, 0, 100));
}

}  // namespace
