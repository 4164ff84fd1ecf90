// Prefetcher (src/data/prefetcher.h): the slot get() returns holds the key asked for, whether it
// was prefetched or not; the slot being read is never written by the worker; errors of a
// background fill reach the caller.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "data/prefetcher.h"

namespace shardtrain {
namespace {

struct Slots {
  std::array<std::atomic<int64_t>, 2> key{};
  std::atomic<int> fills{0};
};

Prefetcher::Fill filler(Slots& s, int64_t fail_key = -1) {
  return [&s, fail_key](int64_t key, int slot) {
    if (key == fail_key) throw std::runtime_error("bad batch");
    s.key[static_cast<size_t>(slot)] = -1;  // being written
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    s.key[static_cast<size_t>(slot)] = key;
    ++s.fills;
  };
}

TEST(Prefetcher, SequentialKeysArePrefetchedIntoTheOtherSlot) {
  for (bool threaded : {true, false}) {
    Slots s;
    Prefetcher p(filler(s), threaded);
    for (int64_t k = 0; k < 20; ++k) {
      const int slot = p.get(k, k + 1 < 20 ? k + 1 : -1);
      EXPECT_EQ(s.key[static_cast<size_t>(slot)].load(), k) << "threaded " << threaded;
      std::this_thread::sleep_for(std::chrono::milliseconds(3));  // "training", as the next fills
      // The slot being read was not touched by the fill of the next key.
      EXPECT_EQ(s.key[static_cast<size_t>(slot)].load(), k) << "threaded " << threaded;
    }
    EXPECT_EQ(s.fills.load(), 20) << "each key filled once, threaded " << threaded;
    EXPECT_EQ(p.hits(), threaded ? 19 : 0);
  }
}

TEST(Prefetcher, AnUnexpectedKeyIsFilledOnTheCallersThread) {
  Slots s;
  Prefetcher p(filler(s));
  int slot = p.get(5, 6);
  EXPECT_EQ(s.key[static_cast<size_t>(slot)].load(), 5);
  slot = p.get(100, 101);  // 6 was prefetched, 100 was not: a jump (a resume, an eval)
  EXPECT_EQ(s.key[static_cast<size_t>(slot)].load(), 100);
  slot = p.get(101, -1);
  EXPECT_EQ(s.key[static_cast<size_t>(slot)].load(), 101);
  EXPECT_EQ(p.hits(), 1);
}

TEST(Prefetcher, ABackgroundFailureIsRethrownByTheNextGet) {
  Slots s;
  Prefetcher p(filler(s, /*fail_key=*/3));
  (void)p.get(2, 3);
  EXPECT_THROW((void)p.get(3, 4), std::runtime_error);
  // The prefetcher goes on: the key is filled again on demand (and fails again here).
  EXPECT_THROW((void)p.get(3, 4), std::runtime_error);
  const int slot = p.get(7, -1);
  EXPECT_EQ(s.key[static_cast<size_t>(slot)].load(), 7);
}

TEST(Prefetcher, DestructionWaitsForAFillInProgress) {
  Slots s;
  {
    Prefetcher p(filler(s));
    (void)p.get(0, 1);
  }
  EXPECT_EQ(s.fills.load(), 2);
}

}  // namespace
}  // namespace shardtrain
