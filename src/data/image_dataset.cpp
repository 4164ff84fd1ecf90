#include "data/image_dataset.h"

#include <fmt/core.h>
#include <fmt/std.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>

#include "core/error.h"
#include "core/rng.h"
#include "core/strings.h"
#include "data/data_dir.h"
#include "data/dataset.h"
#include "data/idx_file.h"
#include "data/image_decode.h"

namespace shardtrain {
namespace fs = std::filesystem;
namespace {

/// `dir`/name or `dir`/name.gz, whichever exists (empty path when neither).
fs::path idx_path(const fs::path& dir, const std::string& name) {
  std::error_code ec;
  if (fs::is_regular_file(dir / name, ec)) return dir / name;
  if (fs::is_regular_file(dir / (name + ".gz"), ec)) return dir / (name + ".gz");
  return {};
}

/// Throws DataError unless `count` images of C×H×W bytes fit in this machine's memory (and in
/// 64 bits): --image-size 3000 on 60,000 images asks for 1.6 TB.
void check_image_set_fits(int64_t count, int64_t C, int64_t H, int64_t W, const std::string& name) {
  check<ConfigError>(H > 0 && W > 0 && H <= kMaxImageSide && W <= kMaxImageSide,
                     "image size {}×{} is not valid: each side must be in [1, {}]", H, W,
                     kMaxImageSide);
  const double bytes = static_cast<double>(count) * static_cast<double>(C) *
                       static_cast<double>(H) * static_cast<double>(W);
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  const double memory = pages > 0 && page > 0 ? static_cast<double>(pages) * page : 0;
  if (memory > 0 && bytes > memory)
    throw DataError(fmt::format(
        "{}: {} images of {}×{}×{} pixels need {} in memory, more than this machine's {}: "
        "lower --image-size (or use fewer images)",
        name, with_commas(count), C, H, W, human_bytes(bytes), human_bytes(memory)));
}

/// Bilinear resize of one plane (half-pixel centres, edge clamped).
void resize_plane(const uint8_t* src, int64_t sh, int64_t sw, uint8_t* dst, int64_t dh,
                  int64_t dw) {
  const double sy = static_cast<double>(sh) / static_cast<double>(dh);
  const double sx = static_cast<double>(sw) / static_cast<double>(dw);
  for (int64_t y = 0; y < dh; ++y) {
    const double fy = std::max(0.0, (static_cast<double>(y) + 0.5) * sy - 0.5);
    const auto y0 = std::min<int64_t>(static_cast<int64_t>(fy), sh - 1);
    const int64_t y1 = std::min<int64_t>(y0 + 1, sh - 1);
    const double wy = fy - static_cast<double>(y0);
    for (int64_t x = 0; x < dw; ++x) {
      const double fx = std::max(0.0, (static_cast<double>(x) + 0.5) * sx - 0.5);
      const auto x0 = std::min<int64_t>(static_cast<int64_t>(fx), sw - 1);
      const int64_t x1 = std::min<int64_t>(x0 + 1, sw - 1);
      const double wx = fx - static_cast<double>(x0);
      const double top = src[y0 * sw + x0] * (1 - wx) + src[y0 * sw + x1] * wx;
      const double bot = src[y1 * sw + x0] * (1 - wx) + src[y1 * sw + x1] * wx;
      const double v = top * (1 - wy) + bot * wy;
      dst[y * dw + x] = static_cast<uint8_t>(std::clamp(std::lround(v), 0L, 255L));
    }
  }
}

}  // namespace

const std::vector<std::string>& fashion_mnist_classes() {
  static const std::vector<std::string> names = {"T-shirt/top", "Trouser",   "Pullover", "Dress",
                                                 "Coat",        "Sandal",    "Shirt",    "Sneaker",
                                                 "Bag",         "Ankle boot"};
  return names;
}

fs::path find_fashion_mnist_dir() {
  std::vector<fs::path> candidates;
  if (const char* env = std::getenv("SHARDTRAIN_DATA_DIR"); env && *env)
    candidates.push_back(fs::path(env) / "fashion-mnist");
  if (const DataDirLookup found = find_data_dir();
      !found.dir.empty() &&
      (candidates.empty() || candidates.back() != found.dir / "fashion-mnist"))
    candidates.push_back(found.dir / "fashion-mnist");
  candidates.emplace_back("/usr/share/datasets/fashion-mnist");
  for (const fs::path& c : candidates)
    if (!idx_path(c, "train-images-idx3-ubyte").empty()) return c;
  std::string looked;
  for (const fs::path& c : candidates) looked += (looked.empty() ? "" : ", ") + c.string();
  throw DataError(fmt::format(
      "Fashion-MNIST not found (looked in {}); install Debian's package with `apt-get install "
      "dataset-fashion-mnist`, or pass --data-dir DIR with its four IDX files "
      "(train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, "
      "t10k-labels-idx1-ubyte.gz)",
      looked));
}

ImageSet load_fashion_mnist(const fs::path& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const fs::path images_file = idx_path(dir, prefix + "-images-idx3-ubyte");
  const fs::path labels_file = idx_path(dir, prefix + "-labels-idx1-ubyte");
  for (const auto& [file, name] : {std::pair{images_file, prefix + "-images-idx3-ubyte"},
                                   std::pair{labels_file, prefix + "-labels-idx1-ubyte"}})
    if (file.empty())
      throw DataError(fmt::format(
          "Fashion-MNIST file {} (or .gz) is missing from {}; install `dataset-fashion-mnist` "
          "or copy the four IDX files there",
          name, dir));
  IdxArray images = read_idx(images_file);
  IdxArray labels = read_idx(labels_file);
  if (images.dims.size() != 3)
    throw DataError(fmt::format("{} has {} dimensions; images need 3 (N, rows, columns)",
                                images_file, images.dims.size()));
  if (labels.dims.size() != 1 || labels.dims[0] != images.dims[0])
    throw DataError(fmt::format("{} holds {} labels but {} holds {} images", labels_file,
                                labels.dims[0], images_file, images.dims[0]));
  ImageSet set;
  set.name = fmt::format("fashion-mnist {}", train ? "train" : "test");
  set.channels = 1;
  set.height = images.dims[1];
  set.width = images.dims[2];
  set.pixels = std::move(images.data);
  set.classes = fashion_mnist_classes();
  set.labels.reserve(labels.data.size());
  for (uint8_t l : labels.data) {
    if (l >= set.classes.size())
      throw DataError(
          fmt::format("{} holds label {}; Fashion-MNIST has 10 classes (0..9)", labels_file, l));
    set.labels.push_back(l);
  }
  return set;
}

ImageSet load_image_folder(const fs::path& root, int64_t height, int64_t width) {
  std::error_code ec;
  if (!fs::is_directory(root, ec))
    throw DataError(fmt::format("image directory {} does not exist or is not a directory", root));
  std::vector<fs::path> class_dirs;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && e.path().filename().string().front() != '.')
      class_dirs.push_back(e.path());
  std::sort(class_dirs.begin(), class_dirs.end());
  if (class_dirs.empty())
    throw DataError(fmt::format(
        "image directory {} has no class subfolders; lay it out as {}/<class name>/<image>.png "
        "(one subfolder per class, as torchvision's ImageFolder)",
        root, root.filename()));
  struct Item {
    fs::path file;
    int32_t label;
  };
  std::vector<Item> items;
  ImageSet set;
  set.name = root.string();
  for (size_t c = 0; c < class_dirs.size(); ++c) {
    set.classes.push_back(class_dirs[c].filename().string());
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(class_dirs[c]))
      if (e.is_regular_file() && is_image_file(e.path())) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (auto& f : files) items.push_back({std::move(f), static_cast<int32_t>(c)});
  }
  if (items.empty())
    throw DataError(fmt::format(
        "image directory {} has {} class subfolders but no .png/.jpg/.jpeg images in them", root,
        class_dirs.size()));
  std::vector<DecodedImage> decoded(items.size());
  // No exception may leave an OpenMP region: each is kept and the first rethrown after it
  // (std::bad_alloc included, which main() reports as out of host memory).
  std::vector<std::exception_ptr> failures(items.size());
#pragma omp parallel for schedule(dynamic, 16)
  for (size_t i = 0; i < items.size(); ++i) {
    try {
      decoded[i] = decode_image(items[i].file);
    } catch (...) {
      failures[i] = std::current_exception();
    }
  }
  for (const std::exception_ptr& f : failures) {
    if (!f) continue;
    try {
      std::rethrow_exception(f);
    } catch (const DataError& e) {
      throw DataError(std::string(e.what()) + " (remove or replace it; every image must decode)");
    }
  }
  const bool any_color = std::any_of(decoded.begin(), decoded.end(),
                                     [](const DecodedImage& d) { return d.channels == 3; });
  const bool resize = height > 0 && width > 0;
  set.channels = any_color ? 3 : 1;
  set.height = resize ? height : decoded[0].height;
  set.width = resize ? width : decoded[0].width;
  if (!resize)
    for (size_t i = 1; i < decoded.size(); ++i)
      if (decoded[i].height != decoded[0].height || decoded[i].width != decoded[0].width)
        throw DataError(
            fmt::format("images differ in size: {} is {}×{} but {} is {}×{} (width × height); pass "
                        "--image-size N to resize every image to N×N",
                        items[0].file, decoded[0].width, decoded[0].height, items[i].file,
                        decoded[i].width, decoded[i].height));
  const int64_t C = set.channels, H = set.height, W = set.width;
  check_image_set_fits(static_cast<int64_t>(items.size()), C, H, W, set.name);
  set.pixels.resize(items.size() * static_cast<size_t>(C * H * W));
  set.labels.resize(items.size());
#pragma omp parallel for schedule(dynamic, 16)
  for (size_t i = 0; i < items.size(); ++i) {
    const DecodedImage& d = decoded[i];
    std::vector<uint8_t> plane(static_cast<size_t>(d.height) * d.width);
    uint8_t* dst = set.pixels.data() + i * static_cast<size_t>(C * H * W);
    for (int64_t c = 0; c < C; ++c) {
      const int sc = d.channels == 1 ? 0 : static_cast<int>(c);
      for (size_t p = 0; p < plane.size(); ++p)
        plane[p] = d.pixels[p * static_cast<size_t>(d.channels) + static_cast<size_t>(sc)];
      if (d.height == H && d.width == W)
        std::copy(plane.begin(), plane.end(), dst + c * H * W);
      else
        resize_plane(plane.data(), d.height, d.width, dst + c * H * W, H, W);
    }
    set.labels[i] = items[i].label;
  }
  return set;
}

void resize_images(ImageSet& set, int64_t height, int64_t width) {
  if (set.height == height && set.width == width) return;
  check<ConfigError>(height > 0 && width > 0, "image size must be positive, not {}×{}", height,
                     width);
  check_image_set_fits(set.size(), set.channels, height, width, set.name);
  const int64_t planes = set.size() * set.channels;
  std::vector<uint8_t> out(static_cast<size_t>(planes * height * width));
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < planes; ++p)
    resize_plane(set.pixels.data() + p * set.height * set.width, set.height, set.width,
                 out.data() + p * height * width, height, width);
  set.pixels = std::move(out);
  set.height = height;
  set.width = width;
}

ImageSet synthetic_images(int64_t count, int64_t channels, int64_t height, int64_t width,
                          int64_t classes, uint64_t seed) {
  check<ConfigError>(count > 0 && channels > 0 && height > 0 && width > 0 && classes > 0,
                     "synthetic images: {} images of {}×{}×{} in {} classes is not a data set",
                     count, channels, height, width, classes);
  ImageSet set;
  set.name = "synthetic";
  set.channels = channels;
  set.height = height;
  set.width = width;
  for (int64_t k = 0; k < classes; ++k) set.classes.push_back(fmt::format("class{}", k));
  SplitMix64 rng{mix_seed(seed, 0x53594e54)};  // "SYNT"
  set.labels.resize(static_cast<size_t>(count));
  for (auto& l : set.labels) l = static_cast<int32_t>(rng.below(static_cast<uint64_t>(classes)));
  set.pixels.resize(static_cast<size_t>(count * set.image_bytes()));
  for (size_t i = 0; i < set.pixels.size(); i += 8) {
    const uint64_t r = rng.next();
    for (size_t b = 0; b < 8 && i + b < set.pixels.size(); ++b)
      set.pixels[i + b] = static_cast<uint8_t>(r >> (8 * b));
  }
  return set;
}

ImageSet split_held_out(ImageSet& set, double fraction, uint64_t seed) {
  check<ConfigError>(fraction > 0 && fraction < 1,
                     "the held-out fraction must be in (0, 1), not {}", fraction);
  std::map<int32_t, std::vector<int64_t>> by_class;
  for (int64_t i = 0; i < set.size(); ++i)
    by_class[set.labels[static_cast<size_t>(i)]].push_back(i);
  std::vector<char> held(static_cast<size_t>(set.size()), 0);
  SplitMix64 rng{mix_seed(seed, 0x48454c44)};  // "HELD"
  for (auto& [label, idx] : by_class) {
    for (size_t i = idx.size(); i > 1; --i) std::swap(idx[i - 1], idx[rng.below(i)]);
    const auto n = static_cast<size_t>(std::llround(fraction * static_cast<double>(idx.size())));
    for (size_t i = 0; i < n; ++i) held[static_cast<size_t>(idx[i])] = 1;
  }
  ImageSet train = set, out = set;
  train.pixels.clear();
  train.labels.clear();
  out.pixels.clear();
  out.labels.clear();
  out.name = set.name + " (held out)";
  const int64_t ib = set.image_bytes();
  for (int64_t i = 0; i < set.size(); ++i) {
    ImageSet& dst = held[static_cast<size_t>(i)] ? out : train;
    dst.pixels.insert(dst.pixels.end(), set.image(i), set.image(i) + ib);
    dst.labels.push_back(set.labels[static_cast<size_t>(i)]);
  }
  // The smallest class that holds out one image (its count × fraction rounds to 1).
  const auto per_class = static_cast<int64_t>(std::ceil(0.5 / fraction - 1e-9));
  check<ConfigError>(train.size() > 0 && out.size() > 0,
                     "a held-out fraction of {} of {}'s {} images leaves {} for training and {} "
                     "held out; both need at least one: {}",
                     fraction, set.name, set.size(), train.size(), out.size(),
                     out.size() == 0
                         ? fmt::format("add images (the split is per class, so at least one "
                                       "class needs {} or more)",
                                       per_class)
                         : std::string("use a smaller held-out fraction, or add images"));
  set = std::move(train);
  return out;
}

void channel_statistics(const ImageSet& set, std::vector<float>& mean, std::vector<float>& stdev) {
  const int64_t C = set.channels, HW = set.height * set.width;
  mean.assign(static_cast<size_t>(C), 0.0f);
  stdev.assign(static_cast<size_t>(C), 1.0f);
  for (int64_t c = 0; c < C; ++c) {
    double s = 0, s2 = 0;
#pragma omp parallel for reduction(+ : s, s2) schedule(static)
    for (int64_t i = 0; i < set.size(); ++i) {
      const uint8_t* p = set.image(i) + c * HW;
      uint64_t a = 0, a2 = 0;
      for (int64_t k = 0; k < HW; ++k) {
        a += p[k];
        a2 += static_cast<uint64_t>(p[k]) * p[k];
      }
      s += static_cast<double>(a);
      s2 += static_cast<double>(a2);
    }
    const double n = static_cast<double>(set.size() * HW) * 1.0;
    const double m = s / n / 255.0;
    const double var = std::max(0.0, s2 / n / (255.0 * 255.0) - m * m);
    mean[static_cast<size_t>(c)] = static_cast<float>(m);
    stdev[static_cast<size_t>(c)] = static_cast<float>(var > 0 ? std::sqrt(var) : 1.0);
  }
}

std::vector<float> ImageTransform::affine() const {
  const auto C = static_cast<size_t>(channels);
  check<ConfigError>(mean.size() == C && stdev.size() == C,
                     "normalization needs {} means and standard deviations, got {} and {}", C,
                     mean.size(), stdev.size());
  std::vector<float> a(2 * C);
  for (size_t c = 0; c < C; ++c) {
    a[c] = 1.0f / (255.0f * stdev[c]);
    a[C + c] = -mean[c] / stdev[c];
  }
  return a;
}

void make_pixel_batch(const ImageSet& set, const ImageTransform& t, const int64_t* indices,
                      int64_t count, bool train, uint64_t seed, int64_t epoch, uint8_t* pixels,
                      int32_t* labels) {
  const int64_t C = t.channels, H = set.height, W = set.width;
  if (C != set.channels && !(set.channels == 1 && C == 3))
    throw ConfigError(fmt::format(
        "the model takes {}-channel images but {} has {} channels; only gray to RGB is converted",
        C, set.name, set.channels));
  const int pad = train ? t.crop_padding : 0;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < count; ++b) {
    const int64_t i = indices[b];
    int64_t dy = 0, dx = 0;
    bool flip = false;
    if (train && (pad > 0 || t.horizontal_flip)) {
      SplitMix64 rng{
          mix_seed(mix_seed(seed, static_cast<uint64_t>(epoch)), static_cast<uint64_t>(i))};
      if (pad > 0) {
        dy = static_cast<int64_t>(rng.below(2 * static_cast<uint64_t>(pad) + 1)) - pad;
        dx = static_cast<int64_t>(rng.below(2 * static_cast<uint64_t>(pad) + 1)) - pad;
      }
      if (t.horizontal_flip) flip = (rng.next() >> 63) != 0;
    }
    const uint8_t* src = set.image(i);
    uint8_t* dst = pixels + b * C * H * W;
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t* plane = src + (set.channels == 1 ? 0 : c) * H * W;
      uint8_t* out = dst + c * H * W;
      for (int64_t y = 0; y < H; ++y) {
        const int64_t sy = y + dy;
        uint8_t* row = out + y * W;
        if (sy < 0 || sy >= H) {  // padding rows are black
          std::memset(row, 0, static_cast<size_t>(W));
          continue;
        }
        const uint8_t* in = plane + sy * W;
        if (!flip) {  // a shifted copy of the row, black where it leaves the image
          const int64_t x0 = std::max<int64_t>(0, -dx), x1 = std::min<int64_t>(W, W - dx);
          std::memset(row, 0, static_cast<size_t>(W));
          if (x1 > x0) std::memcpy(row + x0, in + x0 + dx, static_cast<size_t>(x1 - x0));
        } else {
          for (int64_t x = 0; x < W; ++x) {
            const int64_t sx = W - 1 - x + dx;
            row[x] = sx >= 0 && sx < W ? in[sx] : uint8_t{0};
          }
        }
      }
    }
    labels[b] = set.labels[static_cast<size_t>(i)];
  }
}

void make_image_batch(const ImageSet& set, const ImageTransform& t, const int64_t* indices,
                      int64_t count, bool train, uint64_t seed, int64_t epoch, float* images,
                      int32_t* labels) {
  const std::vector<float> a = t.affine();
  const int64_t C = t.channels, HW = set.height * set.width;
  std::vector<uint8_t> pixels(static_cast<size_t>(count * C * HW));
  make_pixel_batch(set, t, indices, count, train, seed, epoch, pixels.data(), labels);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < count; ++b)
    for (int64_t c = 0; c < C; ++c) {
      const float scale = a[static_cast<size_t>(c)], shift = a[static_cast<size_t>(C + c)];
      const size_t base = static_cast<size_t>((b * C + c) * HW);
      for (int64_t k = 0; k < HW; ++k)
        images[base + static_cast<size_t>(k)] =
            static_cast<float>(pixels[base + static_cast<size_t>(k)]) * scale + shift;
    }
}

}  // namespace shardtrain
