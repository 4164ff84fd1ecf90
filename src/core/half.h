// 16-bit floating-point conversions on the host (bf16 and IEEE fp16 <-> fp32).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace shardtrain {

inline float bf16_to_float(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

/// fp32 -> bf16, rounding to nearest even (NaN stays NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0)
    return std::bit_cast<float>(std::bit_cast<uint32_t>(std::ldexp(float(mant), -24)) | sign);
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

/// fp32 -> IEEE fp16, rounding to nearest even; overflow to ±inf, NaN stays NaN, subnormals
/// kept (as the F16C instruction vcvtps2ph does).
inline uint16_t float_to_fp16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // ≥ 65536: inf
  if (abs < 0x38800000u) {  // below the smallest normal 2^-14: subnormal or zero
    // value / 2^-24, rounded to nearest even (the float holds it exactly up to rounding).
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // × 2^24
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)));
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15 (in the shifted position)
  r += 0xfffu + ((r >> 13) & 1u);  // round to nearest even on the 13 dropped bits
  return static_cast<uint16_t>(sign | (r >> 13));
}

}  // namespace shardtrain
