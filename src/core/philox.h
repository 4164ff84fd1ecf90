// Counter-based random numbers for dropout, identical on host and device.
//
// Philox4x32-10: Salmon, Moraes, Dror and Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3"
// (SC'11), §4.2. A bijection of a 128-bit counter under a 64-bit key: element i of a tensor
// draws from counter i (no state, no sequence), so any thread of any kernel — or the CPU
// reference — regenerates the same bits for the same (key, counter). Constants as in the paper
// and Random123; the known-answer vectors of Random123 are checked by tests/test_gradcheck.cpp.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ST_HD __host__ __device__ __forceinline__
#else
#define ST_HD inline
#endif

namespace shardtrain {

struct Philox4x32 {
  uint32_t v[4];
};

/// Lane i & 3 of r (selects instead of a dynamic index, which would put r in local memory on GPU).
ST_HD uint32_t philox_lane(const Philox4x32& r, uint64_t i) {
  const unsigned l = static_cast<unsigned>(i & 3);
  return l == 0 ? r.v[0] : l == 1 ? r.v[1] : l == 2 ? r.v[2] : r.v[3];
}

/// Philox4x32 with 10 rounds of counter `ctr` under key (k0, k1).
ST_HD Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kM0) * ctr.v[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * ctr.v[2];
    const auto hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const auto hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    ctr = Philox4x32{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
  }
  return ctr;
}

/// Inverted dropout (Srivastava et al., JMLR 15 (2014); the "inverted" scaling of PyTorch and
/// Hugging Face): y = x·m/(1-p) with m ~ Bernoulli(1-p). A POD passed by value to kernels.
/// Active iff p > 0. Element `index` of a tensor is dropped iff the 32-bit lane (index & 3) of
/// Philox4x32-10(counter = (index>>2 low, index>>2 high, site, stream), key = seed) is below
/// threshold() = round(p·2^32). CPU and GPU evaluate the same function, so their masks agree.
struct Dropout {
  float p = 0;          ///< drop probability in [0, 1)
  uint64_t seed = 0;    ///< key: the micro-batch's dropout seed (StepContext::dropout_seed)
  uint32_t stream = 0;  ///< free counter word (0 in the model)
  uint32_t site = 0;    ///< which dropout of the model (see dropout_site in model/gpt2.h)

  ST_HD bool active() const { return p > 0.0f; }
  /// round(p·2^32), clamped to 2^32-1.
  ST_HD uint32_t threshold() const {
    const double t = static_cast<double>(p) * 4294967296.0 + 0.5;
    return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
  }
  /// The scale of kept elements, 1/(1-p).
  ST_HD float scale() const { return 1.0f / (1.0f - p); }
  /// The four 32-bit draws of elements [4·(index>>2), 4·(index>>2)+4).
  ST_HD Philox4x32 bits4(uint64_t index) const {
    const uint64_t group = index >> 2;
    return philox4x32_10(Philox4x32{{static_cast<uint32_t>(group),
                                     static_cast<uint32_t>(group >> 32), site, stream}},
                         static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  }
  /// Whether element `index` is kept, given threshold().
  ST_HD bool keep(uint64_t index, uint32_t thresh) const {
    return philox_lane(bits4(index), index) >= thresh;
  }
  /// The multiplier of element `index`: scale() when kept, 0 when dropped.
  ST_HD float factor(uint64_t index) const { return keep(index, threshold()) ? scale() : 0.0f; }
};

/// x[k] = x[k] · multiplier of element base + k, k < K: one Philox call per group of four.
/// `thresh` = d.threshold(), `keep_scale` = d.scale().
template <int K>
ST_HD void dropout_chunk(float* x, const Dropout& d, uint32_t thresh, float keep_scale,
                         uint64_t base) {
  Philox4x32 r = d.bits4(base);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint64_t idx = base + static_cast<uint64_t>(k);
    if (k > 0 && (idx & 3) == 0) r = d.bits4(idx);
    x[k] = philox_lane(r, idx) >= thresh ? x[k] * keep_scale : 0.0f;
  }
}

/// dropout_keep as in the design: whether element `index` survives a dropout of threshold
/// `threshold` = round(p·2^32) under (key, stream, site).
ST_HD bool dropout_keep(uint64_t key, uint32_t stream, uint32_t site, uint64_t index,
                        uint32_t threshold) {
  Dropout d;
  d.seed = key;
  d.stream = stream;
  d.site = site;
  return d.keep(index, threshold);
}

}  // namespace shardtrain
