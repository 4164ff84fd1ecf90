// An ImageFolder data set as a user brings one: class subfolders of PNG and JPEG files load with
// their class names, counts, labels and pixels (PNG exactly, JPEG within its loss), the held-out
// split is stratified, `shardtrain train --data-dir` trains the cnn on it, and bad input (no
// classes, an image that does not decode, mixed sizes, an unknown model, images too small for
// the network) stops with an error that names the problem and the fix.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "data/image_dataset.h"
#include "data/image_decode.h"
#include "test_support.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;
using Result = test_support::CommandResult;

constexpr int kSize = 16;

/// A smooth RGB image (JPEG keeps it within a few levels), different for every `seed`.
DecodedImage smooth(int seed, int w = kSize, int h = kSize) {
  DecodedImage d{w, h, 3, {}};
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c)
        d.pixels.push_back(static_cast<uint8_t>(20 + x * 6 + y * 3 + c * 20 + seed % 40));
  return d;
}

struct Folder {
  fs::path root;
  // Per class, in label order: the images as written and whether each is a JPEG.
  std::map<std::string, std::vector<std::pair<DecodedImage, bool>>> written;
  ~Folder() { fs::remove_all(root.parent_path()); }
};

/// bird: 10 PNG, cat: 20 JPEG, dog: 6 PNG and 6 JPEG (classes of different sizes).
void make_folder(Folder& f) {
  f.root = test_support::make_temp_dir("image_folder") / "animals";
  int seed = 0;
  auto add = [&](const std::string& cls, int count, bool jpeg_every_other, bool jpeg) {
    fs::create_directories(f.root / cls);
    for (int i = 0; i < count; ++i) {
      const bool as_jpeg = jpeg_every_other ? i % 2 == 1 : jpeg;
      const DecodedImage img = smooth(seed++);
      char name[32];
      std::snprintf(name, sizeof name, "img_%02d.%s", i, as_jpeg ? "jpg" : "png");
      if (as_jpeg)
        write_jpeg(f.root / cls / name, img, 95);
      else
        write_png(f.root / cls / name, img);
      f.written[cls].push_back({img, as_jpeg});
    }
  };
  add("bird", 10, false, false);
  add("cat", 20, false, true);
  add("dog", 12, true, false);
}

TEST(ImageFolderData, ClassesLabelsPixelsAndStratifiedSplit) {
  Folder f;
  make_folder(f);
  ImageSet set = load_image_folder(f.root);
  EXPECT_EQ(set.classes, (std::vector<std::string>{"bird", "cat", "dog"}));
  ASSERT_EQ(set.size(), 42);
  EXPECT_EQ(set.channels, 3);
  EXPECT_EQ(set.height, kSize);
  EXPECT_EQ(set.width, kSize);
  int64_t i = 0;
  const int64_t plane = kSize * kSize;
  for (size_t label = 0; label < set.classes.size(); ++label) {
    for (const auto& [img, jpeg] : f.written[set.classes[label]]) {
      SCOPED_TRACE(set.classes[label] + " image " + std::to_string(i));
      ASSERT_LT(i, set.size());
      EXPECT_EQ(set.labels[static_cast<size_t>(i)], static_cast<int32_t>(label));
      // The set is planar (C, H, W); the written image interleaved (H, W, C).
      int max_err = 0;
      double sum_err = 0;
      for (int c = 0; c < 3; ++c)
        for (int64_t p = 0; p < plane; ++p) {
          const int got = set.image(i)[c * plane + p];
          const int want = img.pixels[static_cast<size_t>(p * 3 + c)];
          max_err = std::max(max_err, std::abs(got - want));
          sum_err += std::abs(got - want);
        }
      if (jpeg) {
        EXPECT_LE(max_err, 12);
        EXPECT_LT(sum_err / (3.0 * plane), 3.0);
      } else {
        EXPECT_EQ(max_err, 0) << "PNG is lossless";
      }
      ++i;
    }
  }
  EXPECT_EQ(i, set.size());

  // A quarter held out of every class: 10 → 3 (2.5 rounds half away from zero), 20 → 5, 12 → 3.
  const ImageSet before = set;
  ImageSet held = split_held_out(set, 0.25, 11);
  std::map<int32_t, int> train_count, held_count;
  for (int32_t l : set.labels) ++train_count[l];
  for (int32_t l : held.labels) ++held_count[l];
  EXPECT_EQ(held_count, (std::map<int32_t, int>{{0, 3}, {1, 5}, {2, 3}}));
  EXPECT_EQ(train_count, (std::map<int32_t, int>{{0, 7}, {1, 15}, {2, 9}}));
  EXPECT_EQ(held.classes, before.classes);
  EXPECT_EQ(held.image_bytes(), before.image_bytes());
  // Every image lands on exactly one side, unchanged.
  std::multiset<std::string> all, split;  // each image's bytes
  for (int64_t k = 0; k < before.size(); ++k)
    all.emplace(reinterpret_cast<const char*>(before.image(k)),
                static_cast<size_t>(before.image_bytes()));
  for (const ImageSet* s : {&set, &held})
    for (int64_t k = 0; k < s->size(); ++k)
      split.emplace(reinterpret_cast<const char*>(s->image(k)),
                    static_cast<size_t>(s->image_bytes()));
  EXPECT_EQ(all, split);
  // Deterministic for a seed.
  ImageSet again = before;
  const ImageSet held_again = split_held_out(again, 0.25, 11);
  EXPECT_EQ(held_again.labels, held.labels);
  EXPECT_EQ(held_again.pixels, held.pixels);
}

Result train(const std::string& args) {
  return test_support::run_shardtrain("train --device cpu --no-save " + args);
}

void expect_error(const std::string& args, const std::vector<std::string>& needles) {
  const Result r = train(args);
  EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
  for (const std::string& needle : needles)
    EXPECT_NE(r.output.find(needle), std::string::npos) << "args: " << args << "\n" << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
}

// `shardtrain train --data-dir` trains the cnn on the folder: 3 classes, 10% held out.
TEST(ImageFolderTrain, CnnTrainsOnTheFolder) {
  Folder f;
  make_folder(f);
  const fs::path out = f.root.parent_path() / "out";
  const Result r =
      train("--model cnn --data-dir " + f.root.string() +
            " --batch-size 8 --max-steps 4 --log-interval 1 --output-dir " + out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("38 training images 3×16×16, 3 classes, 4 held-out images"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("done | 4 steps"), std::string::npos) << r.output;
  std::ifstream in(out / "metrics.jsonl");
  int steps = 0;
  int64_t val_samples = -1;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss") && j.contains("images_per_s")) ++steps;
    if (j.contains("val_samples")) val_samples = j["val_samples"];
  }
  EXPECT_EQ(steps, 4);
  EXPECT_EQ(val_samples, 4);
}

TEST(ImageFolderTrain, BadInputIsExplained) {
  const fs::path dir = test_support::make_temp_dir("image_folder_bad");
  // A directory of images but no class subfolders.
  fs::create_directories(dir / "flat");
  write_png(dir / "flat" / "a.png", smooth(1));
  expect_error("--model cnn --data-dir " + (dir / "flat").string(),
               {"has no class subfolders", "one subfolder per class"});
  // Class subfolders without images.
  fs::create_directories(dir / "hollow" / "cls");
  expect_error("--model cnn --data-dir " + (dir / "hollow").string(),
               {"no .png/.jpg/.jpeg images"});

  // An image that does not decode, and an empty one: named, with the fix.
  const fs::path good = dir / "good";
  for (const char* cls : {"a", "b"}) {
    fs::create_directories(good / cls);
    for (int i = 0; i < 6; ++i)
      write_png(good / cls / (std::to_string(i) + ".png"), smooth(i + (cls[0] - 'a') * 7));
  }
  std::ofstream(good / "b" / "broken.png") << "this is not a PNG";
  expect_error("--model cnn --data-dir " + good.string(), {"broken.png", "remove or replace it"});
  fs::remove(good / "b" / "broken.png");
  // An image this user may not read (not testable as root, who reads any file).
  write_png(good / "b" / "locked.png", smooth(9));
  fs::permissions(good / "b" / "locked.png", fs::perms::none);
  if (!std::ifstream(good / "b" / "locked.png").is_open())
    expect_error("--model cnn --data-dir " + good.string(),
                 {"cannot open image", "locked.png", "remove or replace it"});
  fs::remove(good / "b" / "locked.png");
  // Too few images for the 10% held out: how many make one.
  const fs::path few = dir / "few";
  for (const char* cls : {"a", "b"}) {
    fs::create_directories(few / cls);
    for (int i = 0; i < 4; ++i) write_png(few / cls / (std::to_string(i) + ".png"), smooth(i));
  }
  expect_error("--model cnn --data-dir " + few.string(),
               {"8 for training and 0 held out", "at least one class needs 5 or more"});
  std::ofstream(good / "a" / "empty.jpg").flush();
  expect_error("--model cnn --data-dir " + good.string(), {"empty.jpg", "is empty"});
  fs::remove(good / "a" / "empty.jpg");

  // Images of different sizes: --image-size is the fix, and with it the set trains.
  write_png(good / "a" / "wide.png", smooth(3, 24, kSize));
  expect_error("--model cnn --data-dir " + good.string(),
               {"images differ in size", "wide.png", "--image-size N"});
  const Result resized =
      train("--model cnn --data-dir " + good.string() +
            " --image-size 16 --batch-size 4 --max-steps 1 --output-dir " + (dir / "out").string());
  EXPECT_EQ(resized.status, 0) << resized.output;
  fs::remove(good / "a" / "wide.png");

  // A model that does not exist: the nearest name, alone and inside an ensemble.
  expect_error("--model mobilenetv2 --data-dir " + good.string(),
               {"unknown model", "did you mean 'mobilenet_v2'?"});
  expect_error("--model ensemble:cnn,efficientnet_b1 --data-dir " + good.string(),
               {"unknown image model 'efficientnet_b1'", "did you mean 'efficientnet_b0'?"});

  // 16×16 images through vgg11_bn's five 2×2 poolings: too small, with the size that fits.
  expect_error(
      "--model vgg11_bn --data-dir " + good.string(),
      {"3×16×16", "too small", "'vgg11_bn' takes images of 32×32 pixels or more: --image-size 32"});
  fs::remove_all(dir);
}

}  // namespace
}  // namespace shardtrain
