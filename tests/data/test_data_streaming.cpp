// Tests of src/data/token_store.* and src/data/tokenize_stream.*: memory-mapped token files give
// the same ids, samples and errors as read ones; streamed parallel tokenization gives exactly the
// single-pass ids, on WikiText-2 and on adversarial inputs, whatever the piece size and threads.
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
#include "data/bpe_tokenizer.h"
#include "data/dataset.h"
#include "data/token_store.h"
#include "data/tokenize_stream.h"
#include "test_support.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

using test_support::gpt2_tokenizer;
using test_support::read_bytes;
using test_support::TempDir;
using test_support::write_bytes;

fs::path wiki(const char* split) {
  return fs::path(SHARDTRAIN_TEST_DATA_DIR) / "wikitext-2" / fmt::format("wiki.{}.tokens", split);
}

/// The streamed ids of `files` (all sink calls joined).
std::vector<int32_t> streamed(const std::vector<fs::path>& files, size_t piece, int threads,
                              StreamTokenizeStats* stats = nullptr) {
  std::vector<int32_t> out;
  const StreamTokenizeStats s = encode_files_streaming(
      gpt2_tokenizer(), files,
      [&](std::span<const int32_t> ids) { out.insert(out.end(), ids.begin(), ids.end()); }, piece,
      threads);
  if (stats != nullptr) *stats = s;
  return out;
}

/// Asserts that streaming `text` (one file) gives encode(text) for several piece sizes and both
/// thread counts.
void expect_stream_equals_single_pass(const std::string& text, std::vector<size_t> pieces) {
  TempDir dir;
  write_bytes(dir / "in.txt", text);
  const std::vector<int32_t> whole = gpt2_tokenizer().encode(text);
  for (const size_t piece : pieces) {
    for (const int threads : {1, 2}) {
      StreamTokenizeStats stats;
      const auto ids = streamed({dir / "in.txt"}, piece, threads, &stats);
      ASSERT_EQ(ids.size(), whole.size()) << "piece " << piece << ", threads " << threads;
      ASSERT_TRUE(ids == whole) << "piece " << piece << ", threads " << threads;
      EXPECT_EQ(stats.bytes, text.size());
      EXPECT_EQ(stats.tokens, whole.size());
      EXPECT_EQ(stats.source_hash, fnv1a64(text));
    }
  }
}

// ---- streamed tokenization ---------------------------------------------------------------------

TEST(StreamTokenize, EqualsSinglePassOnWikiTextValid) {
  ASSERT_TRUE(fs::exists(wiki("valid"))) << wiki("valid");
  expect_stream_equals_single_pass(read_bytes(wiki("valid")), {1 << 20, 64 * 1024, 4096});
}

TEST(StreamTokenize, EqualsSinglePassOnWikiTextTrain) {
  ASSERT_TRUE(fs::exists(wiki("train"))) << wiki("train");
  expect_stream_equals_single_pass(read_bytes(wiki("train")), {1 << 20, 4096});
}

TEST(StreamTokenize, ChunkBoundaryInsideMultiByteCharacters) {
  // 2-, 3- and 4-byte characters next to spaces, newlines and ASCII: every piece size below 8
  // puts read boundaries inside characters.
  std::string text;
  for (int i = 0; i < 300; ++i) {
    text += "é 戦場のヴァルキュリア 𝔘𝔫𝔦 x ü\n日本 a";
    text += (i % 7 == 0) ? "\n\n" : " ";
  }
  expect_stream_equals_single_pass(text, {1, 2, 3, 5, 7, 64});
}

TEST(StreamTokenize, ChunkBoundaryInsideLongRunsOfSpaces) {
  std::string text;
  for (int i = 0; i < 20; ++i) {
    text += "word" + std::string(static_cast<size_t>(1000 + 37 * i), ' ') + "next\n";
    text += std::string(static_cast<size_t>(300 + i), '\n') + " x  y   z";
  }
  expect_stream_equals_single_pass(text, {1, 10, 100, 1000, 4096});
}

TEST(StreamTokenize, NoNewlinesAtAll) {
  std::string words;
  for (int i = 0; i < 5000; ++i) words += fmt::format("w{} is, ", i);
  expect_stream_equals_single_pass(words, {7, 16, 333});
  // And no cut point at all: one piece, held whole.
  expect_stream_equals_single_pass(std::string(50000, 'a') + "戦場" + std::string(3000, 'b'),
                                   {1, 100});
}

TEST(StreamTokenize, InvalidUtf8AndSpecialTokens) {
  std::mt19937 gen(11);
  const std::string alphabet = "ab <|>\n\xC3\xA9\xE6\x88\xA6\xFF\x80\xC0 endoftext'sX.";
  std::string text;
  for (int i = 0; i < 20000; ++i) text += alphabet[gen() % alphabet.size()];
  for (int i = 0; i < 50; ++i) text += " a<|endoftext|> b <|endoftext|>c\n<|endoftext|>";
  expect_stream_equals_single_pass(text, {1, 3, 17, 256});
}

TEST(StreamTokenize, EmptyFiles) {
  TempDir dir;
  write_bytes(dir / "empty.txt", "");
  write_bytes(dir / "a.txt", "Hello world.\n");
  StreamTokenizeStats stats;
  EXPECT_TRUE(streamed({dir / "empty.txt"}, 4, 2, &stats).empty());
  EXPECT_EQ(stats.bytes, 0u);
  EXPECT_EQ(stats.source_hash, fnv1a64(std::string()));
  // Empty files still separate: two empty documents are one end-of-text id.
  EXPECT_EQ(streamed({dir / "empty.txt", dir / "empty.txt"}, 4, 2),
            std::vector<int32_t>{BpeTokenizer::kEndOfText});
  const auto ids = streamed({dir / "empty.txt", dir / "a.txt", dir / "empty.txt"}, 4, 2);
  EXPECT_EQ(ids, gpt2_tokenizer().encode("<|endoftext|>Hello world.\n<|endoftext|>"));
}

TEST(StreamTokenize, SeveralFilesAreJoinedByEndOfText) {
  TempDir dir;
  const std::string a = "First document.\nIt ends without a newline", b = " Second: 戦場 é",
                    c = "<|endoftext|> third";
  write_bytes(dir / "a.txt", a);
  write_bytes(dir / "b.txt", b);
  write_bytes(dir / "c.txt", c);
  const std::string joined = a + "<|endoftext|>" + b + "<|endoftext|>" + c;
  StreamTokenizeStats stats;
  const auto ids = streamed({dir / "a.txt", dir / "b.txt", dir / "c.txt"}, 3, 2, &stats);
  EXPECT_EQ(ids, gpt2_tokenizer().encode(joined));
  EXPECT_EQ(stats.source_hash, fnv1a64(joined));
  // The same as each file alone, joined by id 50256.
  std::vector<int32_t> each = gpt2_tokenizer().encode(a);
  for (const std::string* t : {&b, &c}) {
    each.push_back(BpeTokenizer::kEndOfText);
    const auto more = gpt2_tokenizer().encode(*t);
    each.insert(each.end(), more.begin(), more.end());
  }
  EXPECT_EQ(ids, each);
}

TEST(StreamTokenize, DirectoriesGiveTheirFilesSortedByName) {
  TempDir dir;
  fs::create_directories(dir / "corpus" / "sub");
  write_bytes(dir / "corpus" / "b.txt", "b");
  write_bytes(dir / "corpus" / "a.txt", "a");
  write_bytes(dir / "corpus" / "C.txt", "C");
  write_bytes(dir / "corpus" / ".hidden", "h");
  write_bytes(dir / "corpus" / "sub" / "x.txt", "x");
  const auto files =
      tokenize_inputs({(dir / "corpus").string(), (dir / "corpus" / "a.txt").string()});
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(files[0].filename(), "C.txt");
  EXPECT_EQ(files[1].filename(), "a.txt");
  EXPECT_EQ(files[2].filename(), "b.txt");
  EXPECT_EQ(files[3].filename(), "a.txt");
  fs::create_directories(dir / "nothing");
  try {
    tokenize_inputs({(dir / "nothing").string()});
    ADD_FAILURE() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("holds no regular file"), std::string::npos) << e.what();
  }
  try {
    streamed({dir / "missing.txt"}, 16, 1);
    ADD_FAILURE() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("missing.txt not found"), std::string::npos) << e.what();
  }
}

std::string run_command(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t got = 0;
  while ((got = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, got);
  *status = ::pclose(p);
  return out;
}

TEST(StreamTokenize, CommandOutputIsByteIdenticalForAnyThreadCount) {
  TempDir dir;
  const fs::path in = wiki("valid");
  // Today's single-pass token file: encode() of the whole text.
  std::vector<uint16_t> ids;
  for (const int32_t id : gpt2_tokenizer().encode(read_bytes(in)))
    ids.push_back(static_cast<uint16_t>(id));
  write_token_file(dir / "ref.bin", ids, fnv1a64(read_bytes(in)), gpt2_tokenizer().fingerprint());
  const std::string ref = read_bytes(dir / "ref.bin");
  for (const char* args : {"--threads 1", "--threads 2", "--threads 2 --piece-bytes 1000"}) {
    int status = -1;
    const std::string log =
        run_command(fmt::format("'{}' tokenize '{}' {} --output '{}' 2>&1", SHARDTRAIN_BINARY,
                                in.string(), args, (dir / "out.bin").string()),
                    &status);
    ASSERT_EQ(status, 0) << log;
    EXPECT_TRUE(read_bytes(dir / "out.bin") == ref) << args;
  }
  // Printing streams the same ids, one line.
  write_bytes(dir / "small.txt", "Hello world.\n\nA second line, é.");
  int status = -1;
  const std::string printed =
      run_command(fmt::format("'{}' tokenize '{}' --piece-bytes 3", SHARDTRAIN_BINARY,
                              (dir / "small.txt").string()),
                  &status);
  ASSERT_EQ(status, 0);
  std::string expected;
  for (const int32_t id : gpt2_tokenizer().encode("Hello world.\n\nA second line, é.")) {
    expected += (expected.empty() ? "" : " ") + std::to_string(id);
  }
  EXPECT_EQ(printed, expected + "\n");
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
