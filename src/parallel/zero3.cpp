#include "parallel/zero3.h"

namespace shardtrain {

std::unique_ptr<Strategy> make_zero3_strategy(const StrategyOptions&, Backend&, Communicator&) {
  throw ConfigError("zero3: under construction");
}

}  // namespace shardtrain
