// Small deterministic pseudo-random number generation, identical on every platform.
//
// SplitMix64: Steele, Lea and Flood, "Fast Splittable Pseudorandom Number Generators"
// (OOPSLA 2014); constants as in Vigna's reference implementation (prng.di.unimi.it).
#pragma once

#include <cstdint>

namespace shardtrain {

/// SplitMix64 generator. The whole state is `state`; copying it forks the stream.
struct SplitMix64 {
  uint64_t state = 0;
  /// What each draw adds to `state`: adding k·kGamma skips k draws ahead.
  static constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

  __extension__ typedef unsigned __int128 U128;  // GCC/Clang; __extension__ silences -Wpedantic

  /// Next 64 uniformly distributed bits.
  uint64_t next() {
    uint64_t z = (state += kGamma);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  /// Uniform double in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  /// Unbiased uniform integer in [0, bound) for bound > 0 (Lemire, "Fast Random Integer
  /// Generation in an Interval", ACM TOMACS 2019: multiply-shift with rejection).
  /// Returns 0 when bound == 0.
  uint64_t below(uint64_t bound) {
    if (bound == 0) return 0;
    U128 m = static_cast<U128>(next()) * bound;
    auto low = static_cast<uint64_t>(m);
    if (low < bound) {
      const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
      while (low < threshold) {
        m = static_cast<U128>(next()) * bound;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }
};

/// Mixes a seed and a stream number (e.g. an epoch) into a well-spread SplitMix64 state, so that
/// nearby (seed, stream) pairs give unrelated streams.
inline uint64_t mix_seed(uint64_t seed, uint64_t stream) {
  SplitMix64 g{seed ^ (stream * 0xD1B54A32D192ED03ull)};
  g.next();
  return g.next() ^ stream;
}

}  // namespace shardtrain
