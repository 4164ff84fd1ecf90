// The C++ twin of tests/fixtures/make_image_fixtures.py's `fill`: deterministic values for every
// state-dict tensor of an image model, so the parity fixtures need not store weights.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain::test_support {

inline double fixture_name_hash(const std::string& name) {
  int64_t h = 0;
  for (unsigned char b : name) h = (h * 131 + b) % 1000003;
  return static_cast<double>(h) / 1000003.0;
}

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// Values of state-dict tensor `name` of `shape` (row-major), as the fixture script fills them.
inline std::vector<float> fixture_fill(const std::string& name, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const double h = fixture_name_hash(name);
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) {
    const double x = static_cast<double>(k + 1) * 0.6180339887498949 + h;
    const double u = (x - std::floor(x)) - 0.5;
    double v;
    if (ends_with(name, "running_var")) {
      v = 1.0 + 0.4 * u;
    } else if (ends_with(name, "running_mean")) {
      v = 0.2 * u;
    } else if (shape.size() >= 2) {
      const double fan_in = static_cast<double>(n / shape[0]);
      v = u * 2.0 * std::sqrt(3.0 / fan_in);
    } else if (ends_with(name, "weight")) {
      v = 1.0 + 0.2 * u;
    } else {
      v = 0.2 * u;
    }
    out[static_cast<size_t>(k)] = static_cast<float>(v);
  }
  return out;
}

}  // namespace shardtrain::test_support
