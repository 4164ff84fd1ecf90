// Fuzz target: checkpoint manifests (checkpoint/manifest.h), with and without the checksum check
// (a fuzzer seldom writes a valid checksum: without it the validation behind it is reached).
#include "checkpoint/manifest.h"
#include "core/error.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardtrain;
  for (const bool verify : {true, false}) {
    try {
      const CheckpointInfo info = parse_checkpoint_manifest(fuzz::bytes(data, size), "ck", verify);
      // A GPT-2 shape that passed can be built: heads divide the width.
      if (!info.image && info.model.n_embd % info.model.n_head != 0) __builtin_trap();
    } catch (const Error&) {
    }
  }
  return 0;
}
