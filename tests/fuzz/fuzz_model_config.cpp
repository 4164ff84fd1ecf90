// Fuzz target: Hugging Face style GPT-2 config.json (model/gpt2_config.h parse_gpt2_config).
#include <string>

#include "core/error.h"
#include "fuzz_support.h"
#include "model/gpt2_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardtrain;
  try {
    const GPT2Config c = parse_gpt2_config(std::string(fuzz::bytes(data, size)), "input", "fuzz");
    validate_gpt2_shape(c, "parsed");  // what parsing accepts, the model code can build
    (void)c.num_parameters();
  } catch (const Error&) {
  }
  return 0;
}
