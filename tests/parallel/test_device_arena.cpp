// DeviceArena / ArenaBuffer (src/parallel/device_arena.h): first fit, merging of freed ranges,
// the same offsets for the same calls (what lets every rank register one arena), and the
// fallback to a buffer of its own when the arena is full.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "parallel/device_arena.h"

namespace shardtrain {
namespace {

constexpr int64_t A = DeviceArena::kAlign;

int64_t offset(const DeviceArena& arena, const Tensor& t) {
  return (static_cast<const char*>(t.data) - static_cast<const char*>(arena.view().data)) / 4;
}

TEST(DeviceArena, FirstFitMergesFreedNeighbours) {
  auto be = make_cpu_backend();
  DeviceArena arena(*be, DType::kF32, 10 * A);
  EXPECT_EQ(arena.capacity(), 10 * A);
  const Tensor a = arena.take(3 * A), b = arena.take(A + 1), c = arena.take(2 * A);
  EXPECT_EQ(offset(arena, a), 0);
  EXPECT_EQ(offset(arena, b), 3 * A);
  EXPECT_EQ(b.numel(), A + 1);
  EXPECT_EQ(offset(arena, c), 5 * A);  // b rounded up to 2·A
  EXPECT_EQ(arena.in_use(), 7 * A);
  EXPECT_EQ(arena.take(4 * A).data, nullptr);  // 3·A left
  arena.give(a);
  arena.give(b);  // merges with a's range: 5·A free at 0
  const Tensor d = arena.take(5 * A);
  EXPECT_EQ(offset(arena, d), 0);
  arena.give(c);  // merges with the tail: 5·A free at 5·A
  const Tensor e = arena.take(5 * A);
  EXPECT_EQ(offset(arena, e), 5 * A);
  arena.give(d);
  arena.give(e);
  EXPECT_EQ(arena.in_use(), 0);
  EXPECT_EQ(offset(arena, arena.take(10 * A)), 0);  // one range again
}

TEST(DeviceArena, SameCallsGiveSameOffsets) {
  auto be = make_cpu_backend();
  std::vector<std::vector<int64_t>> runs;
  for (int rank = 0; rank < 2; ++rank) {
    DeviceArena arena(*be, DType::kF32, 32 * A);
    std::vector<Tensor> live;
    std::vector<int64_t> offsets;
    uint32_t lcg = 12345;  // the same pseudo-random sequence of sizes and frees on both "ranks"
    const auto next = [&lcg] { return (lcg = lcg * 1664525u + 1013904223u) >> 8; };
    for (int i = 0; i < 200; ++i) {
      if (!live.empty() && next() % 3 == 0) {  // free a piece somewhere in the middle: holes
        const size_t k = next() % live.size();
        arena.give(live[k]);
        live[k] = live.back();
        live.pop_back();
        continue;
      }
      const Tensor t = arena.take(static_cast<int64_t>(next() % (6 * A)) + 1);
      offsets.push_back(t.data ? offset(arena, t) : -1);
      if (t.data) live.push_back(t);
    }
    EXPECT_GT(std::count(offsets.begin(), offsets.end(), -1), 0);  // the arena did fill up
    EXPECT_GT(std::count_if(offsets.begin(), offsets.end(), [](int64_t o) { return o >= 0; }), 50);
    runs.push_back(offsets);
  }
  EXPECT_EQ(runs[0], runs[1]);
}

TEST(ArenaBuffer, GivesBackAndFallsBackWhenFull) {
  auto be = make_cpu_backend();
  DeviceArena arena(*be, DType::kF32, 4 * A);
  {
    ArenaBuffer x(*be, &arena, DType::kF32, 3 * A);
    EXPECT_TRUE(x.in_arena());
    EXPECT_EQ(x.numel(), 3 * A);
    ArenaBuffer y(*be, &arena, DType::kF32, 2 * A);  // no room: a zeroed buffer of its own
    EXPECT_FALSE(y.in_arena());
    EXPECT_FALSE(arena.owns(y.view()));
    EXPECT_EQ(y.numel(), 2 * A);
    std::vector<float> host(static_cast<size_t>(2 * A), 1.f);
    be->copy_to_host(host.data(), y.view().data, y.bytes());
    for (float v : host) ASSERT_EQ(v, 0.f);
    ArenaBuffer z = std::move(x);  // moves the piece, gives nothing back
    EXPECT_TRUE(z.in_arena());
    EXPECT_EQ(arena.in_use(), 3 * A);
    z = ArenaBuffer();  // reassigning gives it back
    EXPECT_EQ(arena.in_use(), 0);
    ArenaBuffer w(*be, &arena, DType::kF32, 4 * A);
    EXPECT_TRUE(w.in_arena());
  }
  EXPECT_EQ(arena.in_use(), 0);
  const ArenaBuffer empty(*be, &arena, DType::kF32, 0);  // a layer without parameters
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.view().numel(), 0);
  EXPECT_FALSE(empty.in_arena());
  EXPECT_EQ(arena.in_use(), 0);
  ArenaBuffer none(*be, nullptr, DType::kF32, 8);  // no arena: a buffer of its own
  EXPECT_FALSE(none.in_arena());
  EXPECT_EQ(none.numel(), 8);
}

}  // namespace
}  // namespace shardtrain
