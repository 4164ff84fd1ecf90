// Data files as untrusted input: token ids beyond the model's vocabulary, IDX dimensions whose
// product overflows, images that claim more pixels than exist or end early, devices and
// directories where a file is expected.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/dataset.h"
#include "data/idx_file.h"
#include "data/image_decode.h"
#include "test_support.h"

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {

TEST(TokenIds, EveryIdMustHaveAnEmbeddingRow) {
  EXPECT_NO_THROW(check_token_ids({0, 1, 50256}, 50257, "t.bin", "gpt2"));
  EXPECT_THROW_MSG(check_token_ids({5, 52000, 65535}, 50257, "t.bin", "gpt2"), DataError,
                   "t.bin holds token id 52000 at position 1 (the largest is 65535), but gpt2's "
                   "vocabulary has 50257 ids");
  EXPECT_THROW_MSG(check_token_ids({50257}, 50257, "t.bin", "gpt2"), DataError,
                   "\"vocab_size\": 50258");
  EXPECT_NO_THROW(check_token_ids({65535}, 65536, "t.bin", "big"));
}

TEST(TokenFiles, DirectoriesAndDevicesAreSaidAsSuch) {
  const fs::path dir = test_support::make_temp_dir("tok_dir");
  EXPECT_THROW_MSG(resolve_dataset("", dir.string(), "", ""), DataError, "is a directory");
  EXPECT_THROW_MSG(resolve_dataset("", "/dev/zero", "", ""), DataError, "not a regular file");
  EXPECT_THROW_MSG(read_all_bytes("/dev/zero", "text file"), DataError, "not a regular file");
  fs::remove_all(dir);
}

void write_bytes(const fs::path& p, const std::vector<unsigned char>& b) {
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

TEST(Idx, DimensionsWhoseProductWrapsAreRefused) {
  const fs::path dir = test_support::make_temp_dir("idx_wrap");
  // 4 × 2^31 × 2^31 = 2^64: zero in 64 bits, which the old size guard let through.
  write_bytes(dir / "wrap", {0, 0, 8, 3, 0, 0, 0, 4, 0x80, 0, 0, 0, 0x80, 0, 0, 0, 1, 2, 3});
  EXPECT_THROW_MSG(read_idx(dir / "wrap"), DataError, "too many to be real");
  // A plain file is checked against its size before anything is read.
  write_bytes(dir / "short", {0, 0, 8, 1, 0, 0, 0, 9, 1, 2});
  EXPECT_THROW_MSG(read_idx(dir / "short"), DataError, "truncated");
  write_bytes(dir / "long", {0, 0, 8, 1, 0, 0, 0, 1, 1, 2});
  EXPECT_THROW_MSG(read_idx(dir / "long"), DataError, "extra bytes");
  write_bytes(dir / "ok", {0, 0, 8, 2, 0, 0, 0, 1, 0, 0, 0, 2, 7, 9});
  const IdxArray a = read_idx(dir / "ok");
  EXPECT_EQ(a.dims, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(a.data, (std::vector<uint8_t>{7, 9}));
  fs::remove_all(dir);
}

std::string read_fixture(const std::string& name) {
  std::ifstream in(std::string(SHARDTRAIN_SOURCE_DIR) + "/tests/fuzz/corpus/image/" + name,
                   std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(Images, HeadersClaimingTooManyPixelsAreRefusedBeforeAllocation) {
  const std::string jpeg = read_fixture("RGB_sub2.jpg");
  ASSERT_GT(jpeg.size(), 100u);
  EXPECT_EQ(decode_image_bytes(jpeg, "ok.jpg").width, 16);
  // Rewrite the SOF0 frame's height and width (after FF C0, length, precision) to 65000.
  std::string big = jpeg;
  const size_t sof = big.find("\xff\xc0");
  ASSERT_NE(sof, std::string::npos);
  for (size_t at : {sof + 5, sof + 7}) {
    big[at] = static_cast<char>(0xFD);
    big[at + 1] = static_cast<char>(0xE8);
  }
  EXPECT_THROW_MSG(decode_image_bytes(big, "big.jpg"), DataError,
                   "JPEG big.jpg declares 65000×65000 pixels");
  // PNG: IHDR width and height (bytes 16..23).
  std::string png = read_fixture("RGB.png");
  for (int i = 16; i < 24; ++i) png[static_cast<size_t>(i)] = i % 4 == 1 ? 0x01 : 0;
  EXPECT_THROW(decode_image_bytes(png, "big.png"), DataError);
}

TEST(Images, ATruncatedJpegIsRefusedNotFilledWithGrey) {
  const std::string jpeg = read_fixture("RGB_sub2.jpg");
  EXPECT_THROW_MSG(decode_image_bytes(jpeg.substr(0, jpeg.size() - 6), "cut.jpg"), DataError,
                   "cut.jpg: Premature end of JPEG file (the file is truncated)");
}

}  // namespace
