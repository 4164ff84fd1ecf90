// Small non-cryptographic hashing for cache keys and checkpoint integrity checks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace shardtrain {

/// FNV-1a, 64-bit (Fowler–Noll–Vo). `seed` chains several buffers into one hash.
inline uint64_t fnv1a64(const void* data, size_t bytes, uint64_t seed = 14695981039346656037ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

inline uint64_t fnv1a64(std::string_view s, uint64_t seed = 14695981039346656037ull) {
  return fnv1a64(s.data(), s.size(), seed);
}

}  // namespace shardtrain
