// Fuzz target: the safetensors header parser (checkpoint/safetensors.h), on a whole file's bytes,
// and then every tensor's range read back through the file reader.
#include <vector>

#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardtrain;
  try {
    const SafetensorsHeader h = parse_safetensors_header(fuzz::bytes(data, size), size, "input");
    // The header's promises hold: each tensor lies inside the data.
    for (const auto& [name, e] : h.entries)
      if (h.data_start + e.offset + e.bytes > size) __builtin_trap();
    fuzz::MemoryFile file(data, size);
    if (!file.ok()) return 0;
    const SafetensorsFile st(file.path());
    std::vector<char> buffer;
    for (const auto& [name, e] : st.entries()) {
      buffer.resize(e.bytes);
      st.read(name, buffer.data());
    }
  } catch (const Error&) {
  }
  return 0;
}
