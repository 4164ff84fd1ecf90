// Fuzz target: PNG and JPEG decoding (data/image_decode.h), with a smaller pixel limit than
// training's so that each input decodes quickly.
#include "core/error.h"
#include "data/image_decode.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardtrain;
  try {
    const DecodedImage img =
        decode_image_bytes(std::string(fuzz::bytes(data, size)), "input", int64_t{1} << 22);
    if (img.pixels.size() != static_cast<size_t>(img.width) * img.height * img.channels)
      __builtin_trap();
  } catch (const Error&) {
  }
  return 0;
}
