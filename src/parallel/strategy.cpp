// What every strategy shares: setup from a parameter source and the check that a checkpoint's
// optimizer state fits the run's optimizer. make_strategy: parallel/make_strategy.cpp.
#include "parallel/strategy.h"

#include <algorithm>

#include "config/knob.h"
#include "core/error.h"

namespace shardtrain {

void Strategy::setup_from(Model& model, const ParameterSource& source) {
  std::vector<float> init(static_cast<size_t>(model.layout().numel()));
  source(0, model.layout().numel(), init.data());
  setup(model, init);
}

void check_state_kind(OptimizerKind saved, OptimizerKind configured) {
  check<CheckpointError>(
      saved == configured,
      "the checkpoint holds {0} optimizer state but this run uses {1} {2}: its state cannot be "
      "resumed into another optimizer; resume with {1} {0}, or start from its weights only "
      "({3}, without the optimizer state)",
      to_string(saved), knob_for(&TrainConfig::optimizer).name(), to_string(configured),
      knob_for(&TrainConfig::init_from).name());
}

std::vector<FlatRange> even_split(int64_t numel, int world, int rank) {
  const int64_t base = numel / world, extra = numel % world;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  const int64_t count = base + (rank < extra ? 1 : 0);
  if (count == 0) return {};
  return {FlatRange{begin, count}};
}

}  // namespace shardtrain
