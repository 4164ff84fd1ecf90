#include "parallel/pipeline/partition.h"

#include <algorithm>
#include <limits>

#include "config/config.h"
#include "config/knob.h"
#include "core/error.h"

namespace shardtrain {

PartitionMethod parse_partition_method(const std::string& name) {
  check_partition_method(name);  // the config's list and its error (closest name suggested)
  if (name == "uniform") return PartitionMethod::kUniform;
  if (name == "time") return PartitionMethod::kTime;
  return PartitionMethod::kParameters;
}

std::string to_string(PartitionMethod m) {
  switch (m) {
    case PartitionMethod::kUniform:
      return "uniform";
    case PartitionMethod::kParameters:
      return "parameters";
    case PartitionMethod::kTime:
      return "time";
  }
  return "?";
}

std::vector<LayerSpan> partition_layers(const std::vector<double>& costs, int parts) {
  const int L = static_cast<int>(costs.size()) - 2;  // blocks
  check<ConfigError>(parts >= 1 && parts <= L,
                     "more stages than layers: {} virtual stage{} for {} transformer block{}; each "
                     "stage needs at least one block: lower {} (× {}) to at most {}",
                     parts, parts == 1 ? "" : "s", L, L == 1 ? "" : "s",
                     knob_for(&TrainConfig::pipeline, &PipelineConfig::stages).name(),
                     knob_for(&TrainConfig::pipeline, &PipelineConfig::virtual_stages).name(), L);
  // Block b's cost, the embedding folded into block 0 and the head into block L-1.
  std::vector<double> w(static_cast<size_t>(L));
  for (int b = 0; b < L; ++b) w[static_cast<size_t>(b)] = costs[static_cast<size_t>(b) + 1];
  w.front() += costs.front();
  w.back() += costs.back();
  std::vector<double> prefix(static_cast<size_t>(L) + 1, 0.0);
  for (int b = 0; b < L; ++b)
    prefix[static_cast<size_t>(b) + 1] = prefix[static_cast<size_t>(b)] + w[static_cast<size_t>(b)];
  const auto sum = [&](int a, int b) {
    return prefix[static_cast<size_t>(b)] - prefix[static_cast<size_t>(a)];
  };
  // best[k][b]: the smallest largest-span cost cutting blocks [0, b) into k spans; ties go to the
  // later cut (earlier stages no heavier), so equal costs give the uniform split.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const auto K = static_cast<size_t>(parts), N = static_cast<size_t>(L);
  std::vector<std::vector<double>> best(K + 1, std::vector<double>(N + 1, kInf));
  std::vector<std::vector<int>> cut(K + 1, std::vector<int>(N + 1, 0));
  best[0][0] = 0;
  for (size_t k = 1; k <= K; ++k) {
    for (size_t b = k; b <= N; ++b) {
      for (size_t a = k - 1; a < b; ++a) {
        const double c = std::max(best[k - 1][a], sum(static_cast<int>(a), static_cast<int>(b)));
        if (c <= best[k][b] * (1 + 1e-12)) {
          best[k][b] = c;
          cut[k][b] = static_cast<int>(a);
        }
      }
    }
  }
  std::vector<LayerSpan> spans(K);
  int b = L;
  for (size_t k = K; k >= 1; --k) {
    const int a = cut[k][static_cast<size_t>(b)];
    spans[k - 1] = LayerSpan{a + 1, b + 1};  // blocks [a, b) are whole-model layers a+1..b
    b = a;
  }
  spans.front().first = 0;    // with the embedding
  spans.back().last = L + 2;  // with the head
  return spans;
}

std::vector<int> stage_layer_ids(const std::vector<LayerSpan>& spans, int stages, int rank) {
  std::vector<int> ids;
  for (size_t v = static_cast<size_t>(rank); v < spans.size(); v += static_cast<size_t>(stages))
    for (int l = spans[v].first; l < spans[v].last; ++l) ids.push_back(l);
  return ids;
}

}  // namespace shardtrain
