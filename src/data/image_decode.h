// Decoding and encoding PNG (libpng's simplified API) and JPEG (libjpeg-turbo's TurboJPEG API)
// to and from 8-bit pixels.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace shardtrain {

/// 8-bit pixels, interleaved (HWC): channels 1 (gray) or 3 (RGB).
struct DecodedImage {
  int width = 0, height = 0, channels = 0;
  std::vector<uint8_t> pixels;  ///< height · width · channels bytes, row-major
};

/// Whether a file name looks like an image this module decodes (.png, .jpg, .jpeg; any case).
bool is_image_file(const std::filesystem::path& path);

/// Decodes a PNG or JPEG file (chosen by its signature, not its name) to gray when the file is
/// gray and to RGB otherwise (alpha and palettes are flattened; 16-bit samples are reduced to
/// 8). Throws DataError naming the file when it is unreadable, empty, of another format or
/// corrupt (with the decoder's message).
DecodedImage decode_image(const std::filesystem::path& path);

/// Writes `image` as PNG (for tests and tools). Throws DataError on failure.
void write_png(const std::filesystem::path& path, const DecodedImage& image);
/// Writes `image` as JPEG of the given quality 1..100 (for tests and tools). Throws DataError.
void write_jpeg(const std::filesystem::path& path, const DecodedImage& image, int quality = 95);

}  // namespace shardtrain
