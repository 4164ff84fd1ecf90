// Tests of the image data path: IDX files (plain and gzip), PNG/JPEG decoding, ImageFolder
// directories and their errors, resizing, the held-out split and the batch transform.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include "backend/backend.h"
#include "backend/image_ops.h"
#include "core/error.h"
#include "data/idx_file.h"
#include "data/image_dataset.h"
#include "data/image_decode.h"
#include "test_support.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

using test_support::make_temp_dir;

std::string read_all_bytes_for_test(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
void write_text_for_test(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary) << bytes;
}

struct Dir {
  fs::path path = make_temp_dir("image_data");
  ~Dir() { fs::remove_all(path); }
};

DecodedImage pattern(int w, int h, int channels, int seed) {
  DecodedImage d{w, h, channels, {}};
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < channels; ++c)
        d.pixels.push_back(static_cast<uint8_t>((x * 37 + y * 11 + c * 71 + seed * 13) % 256));
  return d;
}

TEST(Idx, RoundTripsPlainAndGzip) {
  Dir dir;
  IdxArray a{{3, 2, 4}, {}};
  for (int i = 0; i < 24; ++i) a.data.push_back(static_cast<uint8_t>(i * 7));
  for (const char* name : {"x-idx3-ubyte", "x-idx3-ubyte.gz"}) {
    write_idx(dir.path / name, a);
    const IdxArray b = read_idx(dir.path / name);
    EXPECT_EQ(b.dims, a.dims) << name;
    EXPECT_EQ(b.data, a.data) << name;
  }
  // The gzip file really is compressed (gzip magic 1f 8b), the plain one is not.
  EXPECT_EQ(read_all_bytes_for_test(dir.path / "x-idx3-ubyte.gz").substr(0, 2), "\x1f\x8b");
  EXPECT_EQ(read_all_bytes_for_test(dir.path / "x-idx3-ubyte").substr(0, 4),
            std::string("\0\0\x08\x03", 4));
}

TEST(Idx, RejectsBadFilesNamingThem) {
  Dir dir;
  const fs::path bad = dir.path / "bad-idx1-ubyte";
  write_text_for_test(bad, "PK\x03\x04 not idx");
  EXPECT_THROW_MSG(read_idx(bad), DataError, "not an IDX file");
  write_text_for_test(bad, std::string("\0\0\x0d\x01\0\0\0\x01", 8));
  EXPECT_THROW_MSG(read_idx(bad), DataError, "type 0x0d");
  write_text_for_test(bad, std::string("\0\0\x08\x01\0\0\0\x09\x01\x02", 10));
  EXPECT_THROW_MSG(read_idx(bad), DataError, "truncated");
  EXPECT_THROW_MSG(read_idx(dir.path / "missing"), DataError, "does not exist");
}

TEST(FashionMnist, LoadsIdxPairAndChecksCounts) {
  Dir dir;
  IdxArray images{{5, 28, 28}, std::vector<uint8_t>(5 * 28 * 28, 9)};
  IdxArray labels{{5}, {0, 3, 9, 1, 2}};
  write_idx(dir.path / "t10k-images-idx3-ubyte.gz", images);
  write_idx(dir.path / "t10k-labels-idx1-ubyte", labels);  // plain and .gz mixed
  const ImageSet set = load_fashion_mnist(dir.path, /*train=*/false);
  EXPECT_EQ(set.size(), 5);
  EXPECT_EQ(set.channels, 1);
  EXPECT_EQ(set.height, 28);
  EXPECT_EQ(set.labels, (std::vector<int32_t>{0, 3, 9, 1, 2}));
  EXPECT_EQ(set.classes.size(), 10u);
  EXPECT_THROW_MSG(load_fashion_mnist(dir.path, /*train=*/true), DataError,
                   "train-images-idx3-ubyte");
  write_idx(dir.path / "t10k-labels-idx1-ubyte", IdxArray{{4}, {0, 1, 2, 3}});
  EXPECT_THROW_MSG(load_fashion_mnist(dir.path, false), DataError, "4 labels");
  write_idx(dir.path / "t10k-labels-idx1-ubyte", IdxArray{{5}, {0, 1, 2, 3, 12}});
  EXPECT_THROW_MSG(load_fashion_mnist(dir.path, false), DataError, "label 12");
}

TEST(FashionMnist, RealFilesWhenInstalled) {
  fs::path dir;
  try {
    dir = find_fashion_mnist_dir();
  } catch (const DataError&) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  const ImageSet test = load_fashion_mnist(dir, false);
  ASSERT_EQ(test.size(), 10000);
  std::map<int32_t, int> counts;
  for (int32_t l : test.labels) ++counts[l];
  for (int c = 0; c < 10; ++c) EXPECT_EQ(counts[c], 1000) << "class " << c;  // balanced test set
}

TEST(ImageDecode, PngAndJpegRoundTrip) {
  Dir dir;
  const DecodedImage rgb = pattern(13, 7, 3, 1), gray = pattern(5, 9, 1, 2);
  write_png(dir.path / "a.png", rgb);
  write_png(dir.path / "g.png", gray);
  EXPECT_EQ(decode_image(dir.path / "a.png").pixels, rgb.pixels);  // lossless
  const DecodedImage g = decode_image(dir.path / "g.png");
  EXPECT_EQ(g.channels, 1);
  EXPECT_EQ(g.pixels, gray.pixels);
  // A flat JPEG decodes to (nearly) its colour; the size and channels are exact.
  DecodedImage flat{16, 8, 3, std::vector<uint8_t>(16 * 8 * 3, 0)};
  for (size_t i = 0; i < flat.pixels.size(); ++i) flat.pixels[i] = i % 3 == 0 ? 200 : 40;
  write_jpeg(dir.path / "f.jpg", flat);
  const DecodedImage j = decode_image(dir.path / "f.jpg");
  ASSERT_EQ(j.width, 16);
  ASSERT_EQ(j.height, 8);
  ASSERT_EQ(j.channels, 3);
  for (size_t i = 0; i < j.pixels.size(); ++i) EXPECT_NEAR(j.pixels[i], flat.pixels[i], 3) << i;
  // The format comes from the bytes, not the name: a PNG named .jpg decodes.
  fs::copy_file(dir.path / "a.png", dir.path / "named.jpg");
  EXPECT_EQ(decode_image(dir.path / "named.jpg").pixels, rgb.pixels);
  write_text_for_test(dir.path / "junk.png", "not an image at all");
  EXPECT_THROW_MSG(decode_image(dir.path / "junk.png"), DataError, "neither PNG nor JPEG");
  write_text_for_test(dir.path / "cut.png",
                      read_all_bytes_for_test(dir.path / "a.png").substr(0, 40));
  EXPECT_THROW_MSG(decode_image(dir.path / "cut.png"), DataError, "cannot decode PNG");
}

TEST(ImageFolder, LoadsClassesInOrderAndResizes) {
  Dir dir;
  const fs::path root = dir.path / "set";
  for (const char* cls : {"zebra", "ant", "moth"}) fs::create_directories(root / cls);
  write_png(root / "zebra" / "1.png", pattern(8, 6, 3, 1));
  write_png(root / "zebra" / "0.png", pattern(8, 6, 3, 2));
  write_png(root / "ant" / "x.png", pattern(8, 6, 1, 3));  // gray among RGB: replicated
  write_jpeg(root / "moth" / "m.jpeg", pattern(8, 6, 3, 4));
  write_text_for_test(root / "moth" / "notes.txt", "ignored");
  const ImageSet set = load_image_folder(root);
  EXPECT_EQ(set.classes, (std::vector<std::string>{"ant", "moth", "zebra"}));
  EXPECT_EQ(set.labels, (std::vector<int32_t>{0, 1, 2, 2}));
  EXPECT_EQ(set.channels, 3);
  EXPECT_EQ(set.height, 6);
  EXPECT_EQ(set.width, 8);
  // Gray replicated into the three planes; zebra/0.png (sorted first) is the third image.
  const DecodedImage ant = pattern(8, 6, 1, 3), z0 = pattern(8, 6, 3, 2);
  for (int c = 0; c < 3; ++c)
    for (int p = 0; p < 48; ++p) {
      EXPECT_EQ(set.image(0)[c * 48 + p], ant.pixels[static_cast<size_t>(p)]);
      EXPECT_EQ(set.image(2)[c * 48 + p], z0.pixels[static_cast<size_t>(p * 3 + c)]);
    }
  const ImageSet resized = load_image_folder(root, 12, 16);
  EXPECT_EQ(resized.height, 12);
  EXPECT_EQ(resized.width, 16);
  EXPECT_EQ(resized.size(), 4);
}

TEST(ImageFolder, BadDirectoriesGiveClearErrors) {
  Dir dir;
  EXPECT_THROW_MSG(load_image_folder(dir.path / "nope"), DataError, "does not exist");
  fs::create_directories(dir.path / "flat");
  write_png(dir.path / "flat" / "a.png", pattern(4, 4, 3, 0));
  EXPECT_THROW_MSG(load_image_folder(dir.path / "flat"), DataError, "no class subfolders");
  fs::create_directories(dir.path / "empty" / "cls");
  EXPECT_THROW_MSG(load_image_folder(dir.path / "empty"), DataError, "no .png/.jpg/.jpeg images");
  const fs::path mixed = dir.path / "mixed";
  fs::create_directories(mixed / "a");
  write_png(mixed / "a" / "1.png", pattern(4, 4, 3, 0));
  write_png(mixed / "a" / "2.png", pattern(5, 4, 3, 0));
  EXPECT_THROW_MSG(load_image_folder(mixed), DataError, "--image-size");
  EXPECT_EQ(load_image_folder(mixed, 4, 4).size(), 2);
  write_text_for_test(mixed / "a" / "3.png", "garbage");
  EXPECT_THROW_MSG(load_image_folder(mixed, 4, 4), DataError, "3.png");
}

TEST(ImageSetOps, ResizeMatchesBilinearOnARamp) {
  ImageSet set;
  set.name = "ramp";
  set.channels = 1;
  set.height = 2;
  set.width = 4;
  set.pixels = {0, 40, 80, 120, 0, 40, 80, 120};
  set.labels = {0};
  set.classes = {"a"};
  resize_images(set, 2, 8);
  // Half-pixel centres: output x maps to (x + 0.5)/2 - 0.5; edges clamp.
  EXPECT_EQ(set.pixels, (std::vector<uint8_t>{0, 10, 30, 50, 70, 90, 110, 120, 0, 10, 30, 50, 70,
                                              90, 110, 120}));
}

TEST(ImageSetOps, HeldOutSplitIsStratifiedAndDeterministic) {
  ImageSet set;
  set.name = "s";
  set.channels = 1;
  set.height = set.width = 1;
  for (int i = 0; i < 200; ++i) {
    set.pixels.push_back(static_cast<uint8_t>(i));
    set.labels.push_back(i % 4);
  }
  set.classes = {"a", "b", "c", "d"};
  ImageSet a = set, b = set;
  const ImageSet ha = split_held_out(a, 0.1, 7), hb = split_held_out(b, 0.1, 7);
  EXPECT_EQ(ha.pixels, hb.pixels);
  EXPECT_EQ(ha.size(), 20);
  EXPECT_EQ(a.size(), 180);
  std::map<int32_t, int> per_class;
  for (int32_t l : ha.labels) ++per_class[l];
  for (int c = 0; c < 4; ++c) EXPECT_EQ(per_class[c], 5);
  std::set<uint8_t> all(a.pixels.begin(), a.pixels.end());
  for (uint8_t p : ha.pixels) EXPECT_EQ(all.count(p), 0u) << "sample in both sides";
  EXPECT_THROW_MSG(split_held_out(a, 1.5, 7), ConfigError, "(0, 1)");
}

TEST(ImageSetOps, BatchNormalizesAugmentsDeterministically) {
  ImageSet set;
  set.name = "s";
  set.channels = 1;
  set.height = 4;
  set.width = 4;
  for (int i = 0; i < 3; ++i)
    for (int p = 0; p < 16; ++p) set.pixels.push_back(static_cast<uint8_t>(p * 10 + i));
  set.labels = {2, 0, 1};
  set.classes = {"a", "b", "c"};
  ImageTransform t{.channels = 3,
                   .crop_padding = 0,
                   .horizontal_flip = false,
                   .mean = {0.5f, 0.5f, 0.5f},
                   .stdev = {0.25f, 0.5f, 1.0f}};
  const int64_t idx[] = {2, 0};
  std::vector<float> img(2 * 3 * 16);
  std::vector<int32_t> lab(2);
  make_image_batch(set, t, idx, 2, /*train=*/true, 1, 0, img.data(), lab.data());
  EXPECT_EQ(lab, (std::vector<int32_t>{1, 2}));
  for (int c = 0; c < 3; ++c)
    for (int p = 0; p < 16; ++p)
      EXPECT_NEAR(img[static_cast<size_t>(c * 16 + p)],
                  ((p * 10 + 2) / 255.0f - 0.5f) / t.stdev[static_cast<size_t>(c)], 1e-5f);
  // Crop + flip: deterministic per (seed, epoch, sample), differs across epochs, never in eval.
  t.crop_padding = 2;
  t.horizontal_flip = true;
  std::vector<float> a(img.size()), b(img.size()), e(img.size());
  make_image_batch(set, t, idx, 2, true, 1, 0, a.data(), lab.data());
  make_image_batch(set, t, idx, 2, true, 1, 0, b.data(), lab.data());
  EXPECT_EQ(a, b);
  bool differs = false;
  for (int epoch = 1; epoch < 8 && !differs; ++epoch) {
    make_image_batch(set, t, idx, 2, true, 1, epoch, b.data(), lab.data());
    differs = a != b;
  }
  EXPECT_TRUE(differs);
  make_image_batch(set, t, idx, 2, /*train=*/false, 1, 3, e.data(), lab.data());
  EXPECT_EQ(e, img);
  // A sample's augmentation does not depend on its batch position.
  const int64_t one[] = {0};
  std::vector<float> single(3 * 16);
  make_image_batch(set, t, one, 1, true, 1, 0, single.data(), lab.data());
  EXPECT_TRUE(std::equal(single.begin(), single.end(), a.begin() + 3 * 16));
  t.channels = 1;
  EXPECT_THROW_MSG(make_image_batch(set, t, idx, 2, true, 1, 0, img.data(), lab.data()),
                   ConfigError, "1 means");
}

// make_pixel_batch's crop and flip against the per-pixel definition: output (y, x) is input
// (y + dy, (flip ? W−1−x : x) + dx), black outside; exactly one (dy, dx, flip) explains each
// sample (its pixels are distinct and not 0). Then the host normalization (make_image_batch) and
// the CPU op's (ImageOps::image_from_pixels) agree.
TEST(ImageSetOps, PixelBatchCropsAndFlipsAsDefinedAndNormalizesLikeTheOp) {
  constexpr int64_t H = 5, W = 6, N = 12, pad = 2;
  ImageSet set;
  set.name = "s";
  set.channels = 1;
  set.height = H;
  set.width = W;
  for (int i = 0; i < N; ++i)
    for (int p = 0; p < H * W; ++p) set.pixels.push_back(static_cast<uint8_t>(1 + p + 2 * i));
  for (int i = 0; i < N; ++i) set.labels.push_back(i % 3);
  set.classes = {"a", "b", "c"};
  ImageTransform t{.channels = 3,
                   .crop_padding = pad,
                   .horizontal_flip = true,
                   .mean = {0.4f, 0.5f, 0.6f},
                   .stdev = {0.2f, 0.3f, 0.4f}};
  std::vector<int64_t> idx(N);
  std::iota(idx.begin(), idx.end(), 0);
  std::vector<uint8_t> px(static_cast<size_t>(N * 3 * H * W));
  std::vector<int32_t> lab(N);
  std::set<std::tuple<int64_t, int64_t, bool>> seen;
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    make_pixel_batch(set, t, idx.data(), N, true, 9, epoch, px.data(), lab.data());
    for (int64_t b = 0; b < N; ++b) {
      const uint8_t* in = set.image(b);
      int matches = 0;
      for (int64_t dy = -pad; dy <= pad; ++dy)
        for (int64_t dx = -pad; dx <= pad; ++dx)
          for (bool flip : {false, true}) {
            bool all = true;
            for (int64_t c = 0; c < 3 && all; ++c)
              for (int64_t y = 0; y < H && all; ++y)
                for (int64_t x = 0; x < W && all; ++x) {
                  const int64_t sy = y + dy, sx = (flip ? W - 1 - x : x) + dx;
                  const uint8_t want = sy >= 0 && sy < H && sx >= 0 && sx < W ? in[sy * W + sx] : 0;
                  all = px[static_cast<size_t>(((b * 3 + c) * H + y) * W + x)] == want;
                }
            if (all) {
              ++matches;
              seen.insert({dy, dx, flip});
            }
          }
      EXPECT_EQ(matches, 1) << "sample " << b << " epoch " << epoch;
      EXPECT_EQ(lab[static_cast<size_t>(b)], set.labels[static_cast<size_t>(b)]);
    }
  }
  EXPECT_GT(seen.size(), 10u) << "crops and flips vary across samples and epochs";
  // Normalization: on the host, and by the CPU backend's op from the same pixels.
  std::vector<float> host(px.size()), op(px.size());
  make_image_batch(set, t, idx.data(), N, true, 9, 3, host.data(), lab.data());
  auto be = make_cpu_backend();
  std::vector<float> affine = t.affine();
  be->image_ops()->image_from_pixels(Tensor(op.data(), DType::kF32, DeviceKind::kCPU, {N, 3, H, W}),
                                     Tensor(px.data(), DType::kU8, DeviceKind::kCPU, {N, 3, H, W}),
                                     Tensor(affine.data(), DType::kF32, DeviceKind::kCPU, {2, 3}));
  for (size_t i = 0; i < host.size(); ++i) {
    ASSERT_EQ(host[i], op[i]) << i;
    const size_t c = i / (H * W) % 3;
    ASSERT_NEAR(host[i], (px[i] / 255.0f - t.mean[c]) / t.stdev[c], 1e-5f) << i;
  }
}

}  // namespace
}  // namespace shardtrain
