// Sums on the CPU (Backend::sum / sum_squares) in fp64: fixed chunks, independent of the thread
// count, summed in chunk order, so the result is bit-identical at any thread count.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace shardtrain::cpu {
namespace {

template <typename F>
double ordered_sum(int64_t n, F term) {
  // Fixed chunking (independent of the thread count) summed in chunk order: deterministic.
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double s = 0.0;
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) s += term(i);
    part[static_cast<size_t>(c)] = s;
  }
  double total = 0.0;
  for (double p : part) total += p;
  return total;
}

}  // namespace

double sum_squares(Tensor x) {
  const float* p = x.f32();
  return ordered_sum(x.numel(), [p](int64_t i) {
    const double v = p[i];
    return v * v;
  });
}
double sum(Tensor x) {
  const float* p = x.f32();
  return ordered_sum(x.numel(), [p](int64_t i) { return static_cast<double>(p[i]); });
}

}  // namespace shardtrain::cpu
