// Fuzz target: IDX files, plain or gzip-compressed (data/idx_file.h).
#include "core/error.h"
#include "data/idx_file.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardtrain;
  fuzz::MemoryFile file(data, size);
  if (!file.ok()) return 0;
  try {
    const IdxArray a = read_idx(file.path());
    uint64_t total = 1;
    for (const int64_t d : a.dims) total *= static_cast<uint64_t>(d);
    if (total != a.data.size()) __builtin_trap();  // the dimensions describe the data read
  } catch (const Error&) {
  }
  return 0;
}
