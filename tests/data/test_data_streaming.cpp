// Tests of src/data/token_store.*: memory-mapped token files give the same ids, samples and errors
// as read ones.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/hash.h"
#include "data/dataset.h"
#include "data/token_store.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

/// A fresh directory under the system temp directory, removed with its contents at the end.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            fmt::format("shardtrain_test_streaming_{}_{}", ::getpid(), counter++);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  fs::path operator/(const std::string& name) const { return path_ / name; }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << p;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// ---- memory-mapped token files -----------------------------------------------------------------

TEST(TokenStore, MappedFileHasTheWrittenIds) {
  TempDir dir;
  std::vector<uint16_t> ids = {0, 1, 255, 256, 50256, 65535, 15496, 995};
  std::mt19937 gen(3);
  for (int i = 0; i < 20000; ++i) ids.push_back(static_cast<uint16_t>(gen() % 50257));
  write_token_file(dir / "t.bin", ids, 5, 6);
  TokenFileHeader h;
  const TokenStore store = TokenStore::map_file(dir / "t.bin", &h);
  EXPECT_TRUE(store.is_mapped());
  EXPECT_EQ(store.to_vector(), ids);
  EXPECT_EQ(store.largest_id(), 65535);
  EXPECT_EQ(h.count, ids.size());
  EXPECT_EQ(h.source_hash, 5u);
  const TokenStore copy = store;  // shares the mapping
  EXPECT_EQ(copy.data(), store.data());
  // An owned store of the same ids behaves alike.
  const TokenStore owned(ids);
  EXPECT_FALSE(owned.is_mapped());
  EXPECT_EQ(owned.largest_id(), 65535);
  // An empty token file maps to no ids.
  write_token_file(dir / "e.bin", {}, 1, 2);
  EXPECT_TRUE(TokenStore::map_file(dir / "e.bin").empty());
}

TEST(TokenStore, PackedSamplesAreTheSameAsFromAVector) {
  TempDir dir;
  std::vector<uint16_t> ids;
  for (int i = 0; i < 10000; ++i) ids.push_back(static_cast<uint16_t>((i * 7919) % 50257));
  write_token_file(dir / "p.bin", ids, 1, 2);
  const PackedDataset mapped(TokenStore::map_file(dir / "p.bin"), 64, "mapped");
  const PackedDataset read(read_token_file(dir / "p.bin"), 64, "read");
  ASSERT_EQ(mapped.size(), read.size());
  std::vector<int32_t> t1, y1, t2, y2;
  for (int64_t i = 0; i + 3 <= mapped.size(); i += 3) {
    mapped.batch(i, 3, t1, y1);
    read.batch(i, 3, t2, y2);
    ASSERT_EQ(t1, t2);
    ASSERT_EQ(y1, y2);
  }
}

TEST(TokenStore, OutOfVocabularyMessageIsTheSame) {
  TempDir dir;
  const std::vector<uint16_t> ids = {5, 7, 52000, 65535, 3};
  write_token_file(dir / "bad.bin", ids, 1, 2);
  const TokenStore store = TokenStore::map_file(dir / "bad.bin");
  std::string from_store, from_vector;
  try {
    check_token_ids(store, 50257, "bad.bin", "gpt2");
  } catch (const DataError& e) {
    from_store = e.what();
  }
  try {
    check_token_ids(ids, 50257, "bad.bin", "gpt2");
  } catch (const DataError& e) {
    from_vector = e.what();
  }
  EXPECT_FALSE(from_store.empty());
  EXPECT_EQ(from_store, from_vector);
  EXPECT_NE(from_store.find("token id 52000 at position 2 (the largest is 65535)"),
            std::string::npos)
      << from_store;
  EXPECT_NO_THROW(check_token_ids(store, 65536, "bad.bin", "big"));
}

TEST(TokenStore, CorruptionIsDetectedWhenMapped) {
  TempDir dir;
  std::vector<uint16_t> ids(40000, 17);
  write_token_file(dir / "c.bin", ids, 1, 2);
  std::string b = read_bytes(dir / "c.bin");
  b[64 + 2 * 39999] ^= 0x01;  // the last id, in the last validation window
  write_bytes(dir / "c.bin", b);
  try {
    TokenStore::map_file(dir / "c.bin", nullptr, TokenFileRole::kCache);
    ADD_FAILURE() << "expected DataError";
  } catch (const DataError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("token cache"), std::string::npos) << msg;
    EXPECT_NE(msg.find("hash mismatch"), std::string::npos) << msg;
    EXPECT_NE(msg.find("delete it"), std::string::npos) << msg;
  }
  try {
    TokenStore::map_file(dir.path());
    ADD_FAILURE() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("no STTOKENS magic"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardtrain
