// Tests of src/data/dataset.*: token files, token caches, parallel tokenization, packed samples,
// the distributed sampler and data set resolution.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/hash.h"
#include "core/rng.h"
#include "data/bpe_tokenizer.h"
#include "data/data_dir.h"
#include "data/dataset.h"
#include "test_support.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

using test_support::gpt2_tokenizer;
using test_support::read_bytes;
using test_support::TempDir;
using test_support::write_bytes;

std::vector<uint16_t> to_u16(const std::vector<int32_t>& ids) {
  std::vector<uint16_t> out;
  for (int32_t id : ids) out.push_back(static_cast<uint16_t>(id));
  return out;
}

/// Runs `f` and returns the message of the E it throws (fails the test when nothing is thrown).
template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return {};
}

fs::path wiki_valid() {
  return fs::path(SHARDTRAIN_TEST_DATA_DIR) / "wikitext-2" / "wiki.valid.tokens";
}

// ---- token files -----------------------------------------------------------------------------

std::vector<uint16_t> sample_ids() {
  std::vector<uint16_t> ids = {0, 1, 255, 256, 50256, 65535, 15496, 995};
  std::mt19937 gen(7);
  for (int i = 0; i < 1000; ++i) ids.push_back(static_cast<uint16_t>(gen() % 50257));
  return ids;
}

TEST(TokenFile, RoundTripKeepsIdsAndHeader) {
  TempDir dir;
  const auto ids = sample_ids();
  const fs::path p = dir / "a.bin";
  write_token_file(p, ids, 0x1122334455667788ull, 0xAABBCCDDEEFF0011ull);
  EXPECT_TRUE(is_token_file(p));
  TokenFileHeader h;
  EXPECT_EQ(read_token_file(p, &h), ids);
  EXPECT_EQ(h.count, ids.size());
  EXPECT_EQ(h.source_hash, 0x1122334455667788ull);
  EXPECT_EQ(h.tokenizer_hash, 0xAABBCCDDEEFF0011ull);
  // Nothing but the file itself is left behind (the temporary was renamed).
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

TEST(TokenFile, EmptyRoundTrip) {
  TempDir dir;
  write_token_file(dir / "e.bin", {}, 1, 2);
  EXPECT_TRUE(read_token_file(dir / "e.bin").empty());
}

TEST(TokenFile, LayoutIsLittleEndianWith64ByteHeader) {
  TempDir dir;
  const std::vector<uint16_t> ids = {0x0102, 0xA0B0};
  write_token_file(dir / "l.bin", ids, 0x0807060504030201ull, 0x1817161514131211ull);
  const std::string b = read_bytes(dir / "l.bin");
  ASSERT_EQ(b.size(), 64u + 4u);
  auto u8 = [&](size_t i) { return static_cast<unsigned char>(b[i]); };
  EXPECT_EQ(b.substr(0, 8), "STTOKENS");
  EXPECT_EQ(u8(8), 1);   // version
  EXPECT_EQ(u8(12), 2);  // bytes per id
  EXPECT_EQ(u8(16), 2);  // count
  EXPECT_EQ(u8(24), 0x01);
  EXPECT_EQ(u8(31), 0x08);
  EXPECT_EQ(u8(32), 0x11);
  for (size_t i = 48; i < 64; ++i) EXPECT_EQ(u8(i), 0) << i;
  EXPECT_EQ(u8(64), 0x02);
  EXPECT_EQ(u8(65), 0x01);
  EXPECT_EQ(u8(66), 0xB0);
  EXPECT_EQ(u8(67), 0xA0);
  uint64_t stored = 0;
  for (int i = 0; i < 8; ++i) stored |= static_cast<uint64_t>(u8(40 + i)) << (8 * i);
  EXPECT_EQ(stored, fnv1a64(b.data() + 64, 4));
}

TEST(TokenFile, FlippedIdByteIsDetected) {
  TempDir dir;
  const fs::path p = dir / "f.bin";
  write_token_file(p, sample_ids(), 1, 2);
  std::string b = read_bytes(p);
  b[64 + 101] ^= 0x10;
  write_bytes(p, b);
  const std::string msg = error_of<DataError>([&] { read_token_file(p); });
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("hash mismatch"), std::string::npos) << msg;
  EXPECT_NE(msg.find("shardtrain tokenize"), std::string::npos) << msg;
}

TEST(TokenFile, CorruptHeaderIsDetected) {
  TempDir dir;
  const fs::path p = dir / "h.bin";
  write_token_file(p, sample_ids(), 1, 2);
  const std::string good = read_bytes(p);
  for (size_t byte : {8u, 12u, 16u, 40u}) {
    std::string b = good;
    b[byte] ^= 0x01;
    write_bytes(p, b);
    EXPECT_THROW(read_token_file(p), DataError) << "byte " << byte;
  }
}

TEST(TokenFile, TruncationIsDetected) {
  TempDir dir;
  const fs::path p = dir / "t.bin";
  write_token_file(p, sample_ids(), 1, 2);
  const std::string good = read_bytes(p);
  for (size_t keep : {good.size() - 1, good.size() - 2, size_t{70}, size_t{64}, size_t{30}}) {
    write_bytes(p, good.substr(0, keep));
    const std::string msg = error_of<DataError>([&] { read_token_file(p); });
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("truncated"), std::string::npos) << keep << ": " << msg;
  }
  // Trailing garbage is as wrong as missing bytes.
  write_bytes(p, good + "xx");
  EXPECT_THROW(read_token_file(p), DataError);
}

TEST(TokenFile, MissingOrForeignFilesAreRejected) {
  TempDir dir;
  EXPECT_FALSE(is_token_file(dir / "missing.bin"));
  const std::string msg = error_of<DataError>([&] { read_token_file(dir / "missing.bin"); });
  EXPECT_NE(msg.find("missing.bin"), std::string::npos) << msg;
  write_bytes(dir / "text.txt", "hello world\n");
  EXPECT_FALSE(is_token_file(dir / "text.txt"));
  EXPECT_THROW(read_token_file(dir / "text.txt"), DataError);
}

// ---- tokenization and caches
// ---------------------------------------------------------------------

struct LogCapture {
  std::vector<std::string> lines;
  std::function<void(const std::string&)> fn() {
    return [this](const std::string& s) { lines.push_back(s); };
  }
  int count(const std::string& needle) const {
    return static_cast<int>(std::count_if(lines.begin(), lines.end(), [&](const std::string& l) {
      return l.find(needle) != std::string::npos;
    }));
  }
};

const char* kSmallText =
    " = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : <unk> Chronicles ( Japanese : "
    "戦場のヴァルキュリア3 ) is a tactical role @-@ playing video game .\n\nIt's 2011's game, "
    "they'll say.<|endoftext|> The end.  \n";

TEST(LoadTokens, TokenizesOnceThenUsesTheCache) {
  TempDir dir;
  const fs::path text = dir / "small.txt";
  write_bytes(text, kSmallText);
  const fs::path cache = dir / "cache";
  LogCapture log1;
  const auto ids1 = load_tokens(text, gpt2_tokenizer(), cache, log1.fn());
  EXPECT_EQ(ids1, to_u16(gpt2_tokenizer().encode(kSmallText)));
  EXPECT_EQ(log1.count("tokenizing"), 1);
  EXPECT_EQ(log1.count("using cached tokens"), 0);

  // The cache file is named after the stem and both hashes.
  const fs::path expected =
      cache / fmt::format("small.{:016x}.{:016x}.tokens.bin", fnv1a64(std::string(kSmallText)),
                          gpt2_tokenizer().fingerprint());
  ASSERT_TRUE(fs::exists(expected)) << expected;
  TokenFileHeader h;
  EXPECT_EQ(read_token_file(expected, &h), ids1);
  EXPECT_EQ(h.source_hash, fnv1a64(std::string(kSmallText)));
  EXPECT_EQ(h.tokenizer_hash, gpt2_tokenizer().fingerprint());

  LogCapture log2;
  const auto ids2 = load_tokens(text, gpt2_tokenizer(), cache, log2.fn());
  EXPECT_EQ(ids2, ids1);
  EXPECT_EQ(log2.count("tokenizing"), 0);
  EXPECT_EQ(log2.count("using cached tokens"), 1);
}

TEST(LoadTokens, ChangedTextInvalidatesTheCache) {
  TempDir dir;
  const fs::path text = dir / "small.txt";
  const fs::path cache = dir / "cache";
  write_bytes(text, "first version\n");
  const auto a = load_tokens(text, gpt2_tokenizer(), cache);
  write_bytes(text, "second version, longer\n");
  LogCapture log;
  const auto b = load_tokens(text, gpt2_tokenizer(), cache, log.fn());
  EXPECT_EQ(log.count("tokenizing"), 1);
  EXPECT_EQ(b, to_u16(gpt2_tokenizer().encode("second version, longer\n")));
  EXPECT_NE(a, b);
  // Going back to the first text finds its cache again.
  write_bytes(text, "first version\n");
  LogCapture log3;
  EXPECT_EQ(load_tokens(text, gpt2_tokenizer(), cache, log3.fn()), a);
  EXPECT_EQ(log3.count("using cached tokens"), 1);
}

TEST(LoadTokens, CorruptCacheIsRebuilt) {
  TempDir dir;
  const fs::path text = dir / "small.txt";
  const fs::path cache = dir / "cache";
  write_bytes(text, kSmallText);
  const auto good = load_tokens(text, gpt2_tokenizer(), cache);
  ASSERT_EQ(std::distance(fs::directory_iterator(cache), fs::directory_iterator()), 1);
  const fs::path cache_file = fs::directory_iterator(cache)->path();
  std::string b = read_bytes(cache_file);
  b[b.size() - 1] ^= 0x55;
  write_bytes(cache_file, b);
  LogCapture log;
  EXPECT_EQ(load_tokens(text, gpt2_tokenizer(), cache, log.fn()), good);
  EXPECT_EQ(log.count("corrupt"), 1);
  EXPECT_EQ(log.count("tokenizing"), 1);
  EXPECT_EQ(read_token_file(cache_file), good);  // rewritten
}

TEST(LoadTokens, UnwritableCacheDirOnlyWarns) {
  TempDir dir;
  const fs::path text = dir / "small.txt";
  write_bytes(text, kSmallText);
  write_bytes(dir / "plainfile", "x");
  LogCapture log;
  // A cache directory below a regular file cannot be created, even by root.
  const auto ids = load_tokens(text, gpt2_tokenizer(), dir / "plainfile" / "cache", log.fn());
  EXPECT_EQ(ids, to_u16(gpt2_tokenizer().encode(kSmallText)));
  EXPECT_EQ(log.count("warning"), 1);
}

TEST(LoadTokens, ReadsTokenFilesDirectly) {
  TempDir dir;
  const auto ids = sample_ids();
  write_token_file(dir / "t.bin", ids, 3, 4);
  EXPECT_EQ(load_tokens(dir / "t.bin", gpt2_tokenizer(), dir / "cache"), ids);
  EXPECT_FALSE(fs::exists(dir / "cache"));
}

TEST(LoadTokens, MissingTextFileNamesIt) {
  TempDir dir;
  const std::string msg =
      error_of<DataError>([&] { load_tokens(dir / "nope.txt", gpt2_tokenizer(), dir / "cache"); });
  EXPECT_NE(msg.find((dir / "nope.txt").string()), std::string::npos) << msg;
}

TEST(LoadTokens, EmptyCacheDirDisablesCaching) {
  TempDir dir;
  write_bytes(dir / "s.txt", kSmallText);
  LogCapture log;
  EXPECT_EQ(load_tokens(dir / "s.txt", gpt2_tokenizer(), fs::path(), log.fn()),
            to_u16(gpt2_tokenizer().encode(kSmallText)));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

/// Asserts that cutting `text` at its cut points and encoding the pieces gives encode(text).
void expect_chunked_equals_single_pass(const std::string& text, size_t chunk, size_t min_cuts = 1) {
  const auto cuts = tokenization_cut_points(text, chunk);
  ASSERT_GE(cuts.size(), min_cuts);
  for (size_t i = 0; i < cuts.size(); ++i) {
    ASSERT_GT(cuts[i], 0u);
    ASSERT_LT(cuts[i], text.size());
    if (i > 0) {
      ASSERT_GT(cuts[i], cuts[i - 1]);
    }
  }
  const auto whole = gpt2_tokenizer().encode(text);
  const auto chunked = encode_parallel(gpt2_tokenizer(), text, chunk);
  ASSERT_EQ(chunked.size(), whole.size());
  EXPECT_TRUE(chunked == whole);
}

TEST(ParallelTokenization, EqualsSinglePassOnWikiTextValid) {
  ASSERT_TRUE(fs::exists(wiki_valid())) << wiki_valid();
  const std::string text = read_bytes(wiki_valid());
  ASSERT_EQ(text.size(), 1121681u);
  expect_chunked_equals_single_pass(text, 64 * 1024, 10);
  // Many small pieces: a cut at nearly every line.
  const auto whole = gpt2_tokenizer().encode(text);
  const auto cuts = tokenization_cut_points(text, 1);
  EXPECT_GT(cuts.size(), 100000u);
  EXPECT_TRUE(encode_parallel(gpt2_tokenizer(), text, 1) == whole);
  // load_tokens (default piece size) gives the same ids.
  EXPECT_EQ(load_tokens(wiki_valid(), gpt2_tokenizer(), fs::path()), to_u16(whole));
}

TEST(ParallelTokenization, EqualsSinglePassOnTinyShakespeare) {
  fs::path p = "/work/shared/data/tinyshakespeare/input.txt";
  if (const char* env = std::getenv("SHARDTRAIN_TEST_SHAKESPEARE")) p = env;
  if (!fs::exists(p)) GTEST_SKIP() << p << " is not available here";
  const std::string text = read_bytes(p);
  expect_chunked_equals_single_pass(text, 32 * 1024, 10);
  EXPECT_TRUE(encode_parallel(gpt2_tokenizer(), text, 1) == gpt2_tokenizer().encode(text));
}

TEST(ParallelTokenization, EqualsSinglePassOnAdversarialText) {
  // Fragments chosen around the pre-tokenizer's edge cases: whitespace runs of every kind,
  // contractions, digits, punctuation, non-ASCII letters and spaces, and the special token.
  // clang-format off
  const std::vector<std::string> frags = {
      " ", "  ", "\n", "\n\n", "\r\n", "\t", " \n", "a", "Hello", "world", "123", "4", "'s", "'ll",
      "'", "=", "@-@", ".", ",", "!?", "(", "<", "<|endoftext|>", "<unk>", "é", "日本",
      "\xC2\xA0", "\xE2\x80\x83", "\xE3\x80\x80", "\xC2\x85", "\r", "\x0B", "\x0C", "x"};
  // clang-format on
  std::mt19937 gen(12345);
  size_t total_cuts = 0;
  for (int round = 0; round < 300; ++round) {
    std::string text;
    const int n = 1 + static_cast<int>(gen() % 200);
    for (int i = 0; i < n; ++i) text += frags[gen() % frags.size()];
    const size_t chunk = 1 + gen() % 16;
    const auto cuts = tokenization_cut_points(text, chunk);
    total_cuts += cuts.size();
    const auto whole = gpt2_tokenizer().encode(text);
    ASSERT_TRUE(encode_parallel(gpt2_tokenizer(), text, chunk) == whole) << "text: " << text;
    // Each cut on its own splits the ids exactly.
    for (size_t c : cuts) {
      auto left = gpt2_tokenizer().encode(std::string_view(text).substr(0, c));
      const auto right = gpt2_tokenizer().encode(std::string_view(text).substr(c));
      left.insert(left.end(), right.begin(), right.end());
      ASSERT_TRUE(left == whole) << "cut at " << c << " of: " << text;
    }
  }
  EXPECT_GT(total_cuts, 1000u);  // the cut rule was exercised
}

TEST(ParallelTokenization, InvalidUtf8IsNotCut) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line \xFF\xFE of bytes\n next";
  EXPECT_TRUE(tokenization_cut_points(text, 16).empty());
  EXPECT_TRUE(encode_parallel(gpt2_tokenizer(), text, 16) == gpt2_tokenizer().encode(text));
}

// ---- packed samples
// ------------------------------------------------------------------------------

std::vector<uint16_t> iota_tokens(size_t n) {
  std::vector<uint16_t> t(n);
  std::iota(t.begin(), t.end(), uint16_t{0});
  return t;
}

TEST(PackedDataset, CutsNonOverlappingSamplesAndDropsTheTail) {
  PackedDataset ds(iota_tokens(23), 4, "toy");  // samples of 5 tokens: 4 full, 3 tokens dropped
  EXPECT_EQ(ds.size(), 4);
  EXPECT_EQ(ds.available(), 4);
  EXPECT_EQ(ds.max_length(), 4);
  EXPECT_EQ(ds.num_tokens(), 23);
  std::vector<int32_t> out(5);
  for (int64_t i = 0; i < ds.size(); ++i) {
    ds.sample(i, out.data());
    for (int k = 0; k < 5; ++k) EXPECT_EQ(out[k], i * 5 + k);
  }
}

TEST(PackedDataset, LimitKeepsThePrefixAndRejectsTooMany) {
  PackedDataset ds(iota_tokens(2106 * 129 + 50), 128, "wiki.train.tokens");
  EXPECT_EQ(ds.size(), 2106);
  ds.limit(10);
  EXPECT_EQ(ds.size(), 10);
  std::vector<int32_t> out(129);
  ds.sample(9, out.data());
  EXPECT_EQ(out[0], 9 * 129);
  ds.limit(-1);
  EXPECT_EQ(ds.size(), 2106);
  ds.limit(2106);
  EXPECT_EQ(ds.size(), 2106);
  const std::string msg = error_of<ConfigError>([&] { ds.limit(5000); });
  EXPECT_EQ(msg,
            "--num-samples 5000 exceeds the 2106 samples of 129 tokens in wiki.train.tokens; "
            "lower it or use -1 for all");
  EXPECT_THROW(ds.limit(0), ConfigError);
}

TEST(PackedDataset, TooSmallCorpusIsAnError) {
  EXPECT_THROW(PackedDataset(iota_tokens(128), 128), ConfigError);
  EXPECT_NO_THROW(PackedDataset(iota_tokens(129), 128));
  EXPECT_THROW(PackedDataset(iota_tokens(100), 0), ConfigError);
}

// ---- sampler
// -------------------------------------------------------------------------------------

TEST(SplitMix64, MatchesTheReferenceSequence) {
  SplitMix64 g{0};
  EXPECT_EQ(g.next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(g.next(), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(g.next(), 0x06C45D188009454Full);
  SplitMix64 u{42};
  for (int i = 0; i < 1000; ++i) {
    const double x = u.uniform();
    EXPECT_GE(x, 0.0);
    EXPECT_LT(x, 1.0);
  }
}

TEST(SplitMix64, BelowIsInRangeAndCoversIt) {
  SplitMix64 g{99};
  std::vector<int> hist(7);
  for (int i = 0; i < 7000; ++i) {
    const uint64_t v = g.below(7);
    ASSERT_LT(v, 7u);
    ++hist[v];
  }
  for (int c : hist) EXPECT_NEAR(c, 1000, 150);
  EXPECT_EQ(g.below(1), 0u);
}

/// The whole permutation of `epoch` for `n` samples, read through a one-step sampler.
std::vector<int64_t> full_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  DistributedSampler s(n, n, 1, 0, 1, seed);
  return s.micro_batch_indices(epoch, 0, 0);
}

TEST(DistributedSampler, EpochOrderIsASeededPermutation) {
  const auto p0 = full_permutation(1000, 7, 0);
  std::vector<int64_t> sorted = p0;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> ident(1000);
  std::iota(ident.begin(), ident.end(), int64_t{0});
  EXPECT_EQ(sorted, ident);
  EXPECT_NE(p0, ident);
  EXPECT_EQ(full_permutation(1000, 7, 0), p0);  // same seed, same epoch → same order
  EXPECT_NE(full_permutation(1000, 7, 1), p0);  // next epoch → new order
  EXPECT_NE(full_permutation(1000, 8, 0), p0);  // other seed → other order
  DistributedSampler plain(1000, 1000, 1, 0, 1, 7, /*shuffle=*/false);
  EXPECT_EQ(plain.micro_batch_indices(3, 0, 0), ident);
}

TEST(DistributedSampler, RanksSplitEachGlobalBatchExactly) {
  const int64_t n = 103, micro = 3, accum = 2;
  const int world = 4;
  const uint64_t seed = 1234;
  std::vector<DistributedSampler> ranks;
  for (int r = 0; r < world; ++r) ranks.emplace_back(n, micro, accum, r, world, seed);
  EXPECT_EQ(ranks[0].global_batch(), 24);
  EXPECT_EQ(ranks[0].steps_per_epoch(), 4);
  // One rank with the same global batch (more accumulation) sees the same samples per step.
  DistributedSampler single(n, micro, accum * world, 0, 1, seed);
  ASSERT_EQ(single.global_batch(), 24);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::set<int64_t> seen_in_epoch;
    for (int64_t step = 0; step < 4; ++step) {
      std::multiset<int64_t> from_ranks, from_single;
      for (int r = 0; r < world; ++r) {
        for (int64_t k = 0; k < accum; ++k) {
          const auto idx = ranks[static_cast<size_t>(r)].micro_batch_indices(epoch, step, k);
          ASSERT_EQ(static_cast<int64_t>(idx.size()), micro);
          from_ranks.insert(idx.begin(), idx.end());
        }
      }
      for (int64_t k = 0; k < accum * world; ++k) {
        const auto idx = single.micro_batch_indices(epoch, step, k);
        from_single.insert(idx.begin(), idx.end());
      }
      EXPECT_EQ(from_ranks, from_single);
      EXPECT_EQ(std::set<int64_t>(from_ranks.begin(), from_ranks.end()).size(), 24u);  // disjoint
      for (int64_t i : from_ranks) {
        EXPECT_TRUE(i >= 0 && i < n);
        EXPECT_TRUE(seen_in_epoch.insert(i).second) << "sample " << i << " twice in an epoch";
      }
    }
    EXPECT_EQ(seen_in_epoch.size(), 96u);
  }
}

TEST(DistributedSampler, RejectsTooFewSamplesAndBadArguments) {
  const std::string msg =
      error_of<ConfigError>([] { DistributedSampler(10, 3, 2, 0, 2, 1); });  // global batch 12
  EXPECT_NE(msg.find("10 samples"), std::string::npos) << msg;
  EXPECT_NE(msg.find("global batch 12"), std::string::npos) << msg;
  EXPECT_THROW(DistributedSampler(100, 1, 1, 2, 2, 1), ConfigError);   // rank ≥ world
  EXPECT_THROW(DistributedSampler(100, 1, 1, -1, 2, 1), ConfigError);  // negative rank
  EXPECT_THROW(DistributedSampler(100, 0, 1, 0, 1, 1), ConfigError);   // micro batch 0
  EXPECT_THROW(DistributedSampler(100, 1, 0, 0, 1, 1), ConfigError);   // accumulation 0
  EXPECT_THROW(DistributedSampler(100, 1, 1, 0, 0, 1), ConfigError);   // world 0
  DistributedSampler s(100, 2, 2, 0, 1, 1);
  EXPECT_EQ(s.steps_per_epoch(), 25);
  EXPECT_THROW(s.micro_batch_indices(0, 25, 0), Error);
  EXPECT_THROW(s.micro_batch_indices(0, 0, 2), Error);
}

// ---- data sets
// -----------------------------------------------------------------------------------

TEST(ResolveDataset, WikiTextAndAliases) {
  TempDir dir;
  fs::create_directories(dir / "wikitext-2");
  write_bytes(dir / "wikitext-2" / "wiki.train.tokens", "train\n");
  write_bytes(dir / "wikitext-2" / "wiki.valid.tokens", "valid\n");
  for (const char* name : {"wikitext-2", "wikitext2", "wikitext-2-v1"}) {
    const DatasetFiles f = resolve_dataset(name, "", "", dir.path().string());
    EXPECT_EQ(f.name, "wikitext-2");
    EXPECT_EQ(f.train, dir / "wikitext-2" / "wiki.train.tokens");
    EXPECT_EQ(f.valid, dir / "wikitext-2" / "wiki.valid.tokens");
  }
}

TEST(ResolveDataset, ShippedWikiTextIsFound) {
  const DatasetFiles f = resolve_dataset("wikitext-2", "", "", "");
  EXPECT_TRUE(fs::exists(f.train)) << f.train;
  EXPECT_TRUE(fs::exists(f.valid)) << f.valid;
}

TEST(ResolveDataset, Errors) {
  TempDir dir;
  std::string msg = error_of<ConfigError>([] { resolve_dataset("", "", "", ""); });
  EXPECT_EQ(msg, "no training data: pass --dataset wikitext-2 or --train-file FILE");
  msg = error_of<ConfigError>([] { resolve_dataset("imagenet", "", "", ""); });
  EXPECT_NE(msg.find("imagenet"), std::string::npos) << msg;
  EXPECT_NE(msg.find("wikitext-2"), std::string::npos) << msg;
  msg = error_of<DataError>([&] { resolve_dataset("wikitext-2", "", "", dir.path().string()); });
  EXPECT_NE(msg.find((dir / "wikitext-2" / "wiki.train.tokens").string()), std::string::npos)
      << msg;
  msg = error_of<DataError>([&] { resolve_dataset("", (dir / "x.txt").string(), "", ""); });
  EXPECT_NE(msg.find((dir / "x.txt").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("--train-file"), std::string::npos) << msg;
  write_bytes(dir / "x.txt", "x");
  msg = error_of<DataError>(
      [&] { resolve_dataset("", (dir / "x.txt").string(), (dir / "v.txt").string(), ""); });
  EXPECT_NE(msg.find("v.txt"), std::string::npos) << msg;
}

TEST(ResolveDataset, UserFiles) {
  TempDir dir;
  write_bytes(dir / "train.txt", "x");
  DatasetFiles f = resolve_dataset("", (dir / "train.txt").string(), "", "");
  EXPECT_EQ(f.name, "train.txt");
  EXPECT_EQ(f.train, dir / "train.txt");
  EXPECT_TRUE(f.valid.empty());
  write_bytes(dir / "valid.txt", "y");
  f = resolve_dataset("", (dir / "train.txt").string(), (dir / "valid.txt").string(), "");
  EXPECT_EQ(f.valid, dir / "valid.txt");
}

TEST(DefaultDirs, EnvironmentOverrides) {
  const char* old_data = std::getenv("SHARDTRAIN_DATA_DIR");
  const std::string saved_data = old_data ? old_data : "";
  ::setenv("SHARDTRAIN_DATA_DIR", "/some/data", 1);
  EXPECT_EQ(default_data_dir(), fs::path("/some/data"));
  ::unsetenv("SHARDTRAIN_DATA_DIR");
  // Without it: found relative to this program (<build>/tests/../data), not compiled in.
  EXPECT_TRUE(fs::equivalent(default_data_dir(), fs::path(SHARDTRAIN_TEST_DATA_DIR)))
      << default_data_dir();
  EXPECT_EQ(find_data_dir().how, "the build tree, next to the executable");
  if (old_data) ::setenv("SHARDTRAIN_DATA_DIR", saved_data.c_str(), 1);

  const char* old_cache = std::getenv("SHARDTRAIN_CACHE_DIR");
  const std::string saved_cache = old_cache ? old_cache : "";
  ::setenv("SHARDTRAIN_CACHE_DIR", "/some/cache", 1);
  EXPECT_EQ(default_cache_dir(), fs::path("/some/cache"));
  ::unsetenv("SHARDTRAIN_CACHE_DIR");
  EXPECT_FALSE(default_cache_dir().empty());
  if (old_cache) ::setenv("SHARDTRAIN_CACHE_DIR", saved_cache.c_str(), 1);
}

// ---- the tokenize command
// --------------------------------------------------------------------------

/// Runs `cmd` through the shell and returns its standard output; `status` gets the exit status.
std::string run_command(const std::string& cmd, int* status) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return {};
  std::string out;
  char buf[65536];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, got);
  *status = ::pclose(p);
  return out;
}

TEST(TokenizeCommand, PrintsTheIdsOfEncode) {
  if (!fs::exists(SHARDTRAIN_BINARY)) GTEST_SKIP() << SHARDTRAIN_BINARY << " is not built";
  TempDir dir;
  write_bytes(dir / "in.txt", kSmallText);
  int status = -1;
  const std::string out = run_command(
      fmt::format("'{}' tokenize '{}'", SHARDTRAIN_BINARY, (dir / "in.txt").string()), &status);
  ASSERT_EQ(status, 0);
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.back(), '\n');
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
  std::istringstream ss(out);
  std::vector<int32_t> ids;
  for (int32_t id; ss >> id;) ids.push_back(id);
  EXPECT_EQ(ids, gpt2_tokenizer().encode(kSmallText));

  // --output writes a token file with both hashes.
  const std::string summary =
      run_command(fmt::format("'{}' tokenize '{}' --output '{}' 2>&1", SHARDTRAIN_BINARY,
                              (dir / "in.txt").string(), (dir / "out.bin").string()),
                  &status);
  ASSERT_EQ(status, 0) << summary;
  EXPECT_NE(summary.find("wrote " + std::to_string(ids.size()) + " tokens"), std::string::npos)
      << summary;
  TokenFileHeader h;
  EXPECT_EQ(read_token_file(dir / "out.bin", &h), to_u16(ids));
  EXPECT_EQ(h.source_hash, fnv1a64(std::string(kSmallText)));
  EXPECT_EQ(h.tokenizer_hash, gpt2_tokenizer().fingerprint());
}

}  // namespace
}  // namespace shardtrain
