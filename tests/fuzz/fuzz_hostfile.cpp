// Fuzz target: hostfiles (comm/hostfile.h parse_hostfile).
#include <string>

#include "comm/hostfile.h"
#include "core/error.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardtrain;
  try {
    for (const HostSlots& h : parse_hostfile(std::string(fuzz::bytes(data, size)), "input"))
      if (h.host.empty() || h.host[0] == '-' || h.slots < 1) __builtin_trap();
  } catch (const Error&) {
  }
  return 0;
}
