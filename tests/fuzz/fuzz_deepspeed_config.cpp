// Fuzz target: the DeepSpeed JSON reader (config/config.h apply_deepspeed_config), then the
// validation every run goes through.
#include "config/config.h"
#include "core/error.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardtrain;
  fuzz::MemoryFile file(data, size);
  if (!file.ok()) return 0;
  try {
    TrainConfig cfg;
    std::vector<std::string> ignored;
    apply_deepspeed_config(file.path(), cfg, {}, ignored);
    validate(cfg, 1024);
  } catch (const Error&) {
  }
  return 0;
}
