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

/// The largest image decoded: at most kMaxImageSide pixels a side and kMaxImagePixels pixels
/// (2^28: 16384 × 16384, 768 MiB as RGB), checked from the header before any pixel memory is
/// allocated.
inline constexpr int kMaxImageSide = 1 << 15;
inline constexpr int64_t kMaxImagePixels = int64_t{1} << 28;

/// Decodes a PNG or JPEG file (chosen by its signature, not its name) to gray when the file is
/// gray and to RGB otherwise (alpha and palettes are flattened; 16-bit samples are reduced to
/// 8). Throws DataError naming the file when it is unreadable, not a regular file, empty, of
/// another format, larger than the limits above, truncated (a JPEG whose data ends early, which
/// libjpeg would fill with grey) or corrupt (with the decoder's message).
DecodedImage decode_image(const std::filesystem::path& path);

/// decode_image() of a file's bytes already in memory; `name` names it in messages. `max_pixels`
/// (at most kMaxImagePixels) lowers the pixel limit.
DecodedImage decode_image_bytes(const std::string& bytes, const std::string& name,
                                int64_t max_pixels = kMaxImagePixels);

/// Writes `image` as PNG (for tests and tools). Throws DataError on failure.
void write_png(const std::filesystem::path& path, const DecodedImage& image);
/// Writes `image` as JPEG of the given quality 1..100 (for tests and tools). Throws DataError.
void write_jpeg(const std::filesystem::path& path, const DecodedImage& image, int quality = 95);

}  // namespace shardtrain
