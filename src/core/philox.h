// Counter-based random numbers for dropout, identical on host and device.
//
// Philox4x32-10: Salmon, Moraes, Dror and Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3"
// (SC'11), §4.2. A bijection of a 128-bit counter under a 64-bit key: element i of a tensor
// draws from counter i (no state, no sequence), so any thread of any kernel — or the CPU
// reference — regenerates the same bits for the same (key, counter). Constants as in the paper
// and Random123; the known-answer vectors of Random123 are checked by tests/backend/test_gradcheck.cpp.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ST_HD __host__ __device__ __forceinline__
#else
#define ST_HD inline
#endif
// `#pragma unroll` for the device pass only (host compilers warn about the unknown pragma).
#if defined(__CUDA_ARCH__)
#define ST_UNROLL _Pragma("unroll")
#else
#define ST_UNROLL
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
/// The attention-probability dropout decides with 8 bits instead (AttnDropout8 below).
struct Dropout {
  float p = 0;          ///< drop probability in [0, 1)
  uint64_t seed = 0;    ///< key: the micro-batch's dropout seed (StepContext::dropout_seed)
  uint32_t stream = 0;  ///< free counter word (0 in the model)
  uint32_t site = 0;    ///< which dropout of the model (see dropout_site in model/gpt2.h)
  /// When set, the seed lives in device memory here and replaces `seed` (a replayed CUDA graph
  /// keeps its kernel arguments, so a per-micro-batch seed cannot be one). Read by the kernels
  /// that take it — dropout_backward, add with dropout and ImageOps::sample_scale — once per
  /// thread through with_device_seed(); null on the CPU and in GPT-2's attention.
  const uint64_t* device_seed = nullptr;

  ST_HD bool active() const { return p > 0.0f; }
  /// This mask with `seed` read from device_seed when that is set (device code).
  ST_HD Dropout with_device_seed() const {
    Dropout d = *this;
    if (device_seed != nullptr) {
      d.seed = *device_seed;
      d.device_seed = nullptr;
    }
    return d;
  }
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

/// Attention-probability dropout with 8-bit decisions (FlashAttention-2's scheme: Dao, arXiv
/// 2307.08691, whose kernels compare 8-bit random values with p_dropout_in_uint8_t). One Philox
/// call decides 16 elements: element `index` of P reads byte (index & 3) of 32-bit lane
/// ((index >> 2) & 3) of Philox4x32-10(counter = (index>>4 low, index>>4 high, site, stream),
/// key = seed) and is kept iff that byte ≥ threshold8() = round(p·256) (at most 255). The
/// effective drop probability is therefore p rounded to a multiple of 1/256,
/// p_effective = threshold8()/256 (0.1 → 26/256 = 0.1015625), and kept elements are scaled by
/// 1/(1 − p_effective) (scale8()), so the expectation is exact. Used by the attention dropout only
/// (the CPU reference, the materialized and the flash CUDA kernels, so their masks agree); the
/// embedding and residual dropouts keep the exact 32-bit decision of Dropout::keep.
struct AttnDropout8 {
  /// round(p·256), clamped to 255.
  ST_HD static uint32_t threshold(const Dropout& d) {
    const float t = d.p * 256.0f + 0.5f;
    return t >= 255.0f ? 255u : static_cast<uint32_t>(t);
  }
  /// The drop probability actually applied: threshold/256.
  ST_HD static float p_effective(const Dropout& d) {
    return static_cast<float>(threshold(d)) * (1.0f / 256.0f);
  }
  /// The scale of kept elements, 1/(1 − p_effective) = 256/(256 − threshold).
  ST_HD static float scale(const Dropout& d) {
    return 256.0f / static_cast<float>(256u - threshold(d));
  }
  /// The 128 random bits of elements [16·(index>>4), 16·(index>>4) + 16).
  ST_HD static Philox4x32 bits16(const Dropout& d, uint64_t index) {
    const uint64_t group = index >> 4;
    return philox4x32_10(Philox4x32{{static_cast<uint32_t>(group),
                                     static_cast<uint32_t>(group >> 32), d.site, d.stream}},
                         static_cast<uint32_t>(d.seed), static_cast<uint32_t>(d.seed >> 32));
  }
  /// Keep bits of the 16 elements of r's group: bit i for element 16·group + i.
  ST_HD static uint32_t mask16(const Philox4x32& r, uint32_t thresh) {
    uint32_t m = 0;
    ST_UNROLL
    for (int w = 0; w < 4; ++w) {
      ST_UNROLL
      for (int b = 0; b < 4; ++b)
        m |= static_cast<uint32_t>(((r.v[w] >> (8 * b)) & 0xFFu) >= thresh) << (4 * w + b);
    }
    return m;
  }
  /// Keep bits of elements index16 .. index16 + 15 (index16 a multiple of 16: one Philox call).
  ST_HD static uint32_t keep_mask16(const Dropout& d, uint64_t index16, uint32_t thresh) {
    return mask16(bits16(d, index16), thresh);
  }
  /// Whether element `index` is kept, given threshold(d).
  ST_HD static bool keep(const Dropout& d, uint64_t index, uint32_t thresh) {
    const uint32_t word = philox_lane(bits16(d, index), index >> 2);
    return ((word >> (8 * (index & 3))) & 0xFFu) >= thresh;
  }
};

/// The attention dropout's effective probability for a configured p (AttnDropout8::p_effective).
ST_HD float attn_pdrop_effective(float p) {
  Dropout d;
  d.p = p;
  return AttnDropout8::p_effective(d);
}

/// x[k] = x[k] · multiplier of element base + k, k < K: one Philox call per group of four.
/// `thresh` = d.threshold(), `keep_scale` = d.scale().
template <int K>
ST_HD void dropout_chunk(float* x, const Dropout& d, uint32_t thresh, float keep_scale,
                         uint64_t base) {
  Philox4x32 r = d.bits4(base);
  ST_UNROLL
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
