// Fuzz target: token files (data/dataset.h read_token_file) and the vocabulary check on their ids.
#include "core/error.h"
#include "data/dataset.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardtrain;
  fuzz::MemoryFile file(data, size);
  if (!file.ok()) return 0;
  try {
    const std::vector<uint16_t> ids = read_token_file(file.path());
    check_token_ids(ids, 50257, "input", "gpt2");
  } catch (const Error&) {
  }
  return 0;
}
