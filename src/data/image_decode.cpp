#include "data/image_decode.h"

#include <fmt/core.h>
#include <fmt/std.h>
#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <cctype>
#include <memory>

#include "core/error.h"
#include "core/strings.h"
#include "data/dataset.h"  // read_all_bytes

namespace shardtrain {
namespace {

struct TjCloser {
  void operator()(void* h) const {
    if (h) tjDestroy(h);
  }
};
using TjHandle = std::unique_ptr<void, TjCloser>;

bool is_png(const std::string& b) {
  return b.size() >= 8 && png_sig_cmp(reinterpret_cast<png_const_bytep>(b.data()), 0, 8) == 0;
}
bool is_jpeg(const std::string& b) {
  return b.size() >= 3 && static_cast<unsigned char>(b[0]) == 0xFF &&
         static_cast<unsigned char>(b[1]) == 0xD8 && static_cast<unsigned char>(b[2]) == 0xFF;
}

/// Throws DataError unless a w × h image is within the decode limits.
void check_image_size(const std::string& path, const char* format, int64_t w, int64_t h,
                      int64_t max_pixels) {
  if (w < 1 || h < 1 || w > kMaxImageSide || h > kMaxImageSide || w * h > max_pixels)
    throw DataError(fmt::format(
        "{} {} declares {}×{} pixels, beyond the {} pixels ({} a side) shardtrain decodes: the "
        "file is corrupt, or scale the image down first",
        format, path, w, h, with_commas(max_pixels), kMaxImageSide));
}

DecodedImage decode_png(const std::string& path, const std::string& bytes, int64_t max_pixels) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&img, bytes.data(), bytes.size()))
    throw DataError(fmt::format("cannot decode PNG {}: {}", path, img.message));
  struct Freer {
    png_image* img;
    ~Freer() { png_image_free(img); }
  } freer{&img};
  check_image_size(path, "PNG", img.width, img.height, max_pixels);
  const bool gray = (img.format & PNG_FORMAT_FLAG_COLOR) == 0;
  img.format = gray ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;  // alpha composited onto black
  DecodedImage out;
  out.width = static_cast<int>(img.width);
  out.height = static_cast<int>(img.height);
  out.channels = gray ? 1 : 3;
  out.pixels.resize(PNG_IMAGE_SIZE(img));
  png_color black{0, 0, 0};
  if (!png_image_finish_read(&img, &black, out.pixels.data(), 0, nullptr))
    throw DataError(fmt::format("cannot decode PNG {}: {}", path, img.message));
  return out;
}

DecodedImage decode_jpeg(const std::string& path, const std::string& bytes, int64_t max_pixels) {
  TjHandle h(tjInitDecompress());
  if (!h) throw RuntimeFailure("TurboJPEG: cannot create a decompressor");
  int w = 0, hgt = 0, subsamp = 0, colorspace = 0;
  auto* src = reinterpret_cast<const unsigned char*>(bytes.data());
  const auto n = static_cast<unsigned long>(bytes.size());
  if (tjDecompressHeader3(h.get(), src, n, &w, &hgt, &subsamp, &colorspace) != 0)
    throw DataError(fmt::format("cannot decode JPEG {}: {}", path, tjGetErrorStr2(h.get())));
  check_image_size(path, "JPEG", w, hgt, max_pixels);
  DecodedImage out;
  out.width = w;
  out.height = hgt;
  out.channels = colorspace == TJCS_GRAY ? 1 : 3;
  out.pixels.resize(static_cast<size_t>(w) * hgt * out.channels);
  const int pf = out.channels == 1 ? TJPF_GRAY : TJPF_RGB;
  if (tjDecompress2(h.get(), src, n, out.pixels.data(), w, 0, hgt, pf, TJFLAG_ACCURATEDCT) != 0) {
    const std::string why = tjGetErrorStr2(h.get());
    // libjpeg fills the rows after a premature end with grey and calls it a warning; other
    // warnings (extraneous bytes before a marker, ...) leave the pixels whole.
    if (tjGetErrorCode(h.get()) == TJERR_FATAL || why.find("Premature end") != std::string::npos)
      throw DataError(fmt::format(
          "cannot decode JPEG {}: {}{}", path, why,
          why.find("Premature end") != std::string::npos ? " (the file is truncated)" : ""));
  }
  return out;
}

}  // namespace

bool is_image_file(const std::filesystem::path& path) {
  const std::string ext = lowercase(path.extension().string());
  return ext == ".png" || ext == ".jpg" || ext == ".jpeg";
}

DecodedImage decode_image(const std::filesystem::path& path) {
  return decode_image_bytes(read_all_bytes(path, "image"), path.string());
}

DecodedImage decode_image_bytes(const std::string& bytes, const std::string& name,
                                int64_t max_pixels) {
  max_pixels = std::min(max_pixels, kMaxImagePixels);
  if (bytes.empty()) throw DataError(fmt::format("image {} is empty", name));
  if (is_png(bytes)) return decode_png(name, bytes, max_pixels);
  if (is_jpeg(bytes)) return decode_jpeg(name, bytes, max_pixels);
  throw DataError(fmt::format(
      "image {} is neither PNG nor JPEG (by its first bytes); convert it or remove it from the "
      "data directory",
      name));
}

void write_png(const std::filesystem::path& path, const DecodedImage& image) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(image.width);
  img.height = static_cast<png_uint_32>(image.height);
  img.format = image.channels == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  if (!png_image_write_to_file(&img, path.c_str(), 0, image.pixels.data(), 0, nullptr))
    throw DataError(fmt::format("cannot write PNG {}: {}", path, img.message));
}

void write_jpeg(const std::filesystem::path& path, const DecodedImage& image, int quality) {
  TjHandle h(tjInitCompress());
  if (!h) throw RuntimeFailure("TurboJPEG: cannot create a compressor");
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const int pf = image.channels == 1 ? TJPF_GRAY : TJPF_RGB;
  const int ss = image.channels == 1 ? TJSAMP_GRAY : TJSAMP_444;
  if (tjCompress2(h.get(), image.pixels.data(), image.width, 0, image.height, pf, &buf, &size, ss,
                  quality, TJFLAG_ACCURATEDCT) != 0)
    throw DataError(fmt::format("cannot encode JPEG {}: {}", path, tjGetErrorStr2(h.get())));
  std::unique_ptr<unsigned char, void (*)(unsigned char*)> owned(buf, tjFree);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw DataError(fmt::format("cannot create {}", path));
  const bool ok = std::fwrite(buf, 1, size, f) == size;
  if (std::fclose(f) != 0 || !ok) throw DataError(fmt::format("writing {} failed", path));
}

}  // namespace shardtrain
