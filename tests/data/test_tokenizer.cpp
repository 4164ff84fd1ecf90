// Tests of the GPT-2 BPE tokenizer against ids from independent references (OpenAI's
// encoder.py and Hugging Face tokenizers, see tools/make_tokenizer_fixture.py).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/hash.h"
#include "data/bpe_tokenizer.h"

namespace fs = std::filesystem;
using shardtrain::BpeTokenizer;
using shardtrain::DataError;

namespace {

const fs::path kTokenizerDir = fs::path(SHARDTRAIN_SOURCE_DIR) / "data" / "gpt2-tokenizer";
const fs::path kFixture = fs::path(SHARDTRAIN_TEST_FIXTURES) / "tokenizer_cases.json";

const BpeTokenizer& gpt2() {
  static const BpeTokenizer tok = BpeTokenizer::load(kTokenizerDir);
  return tok;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_all(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out << bytes;
}

/// A fresh directory under the system temp dir, removed at scope exit.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = fs::temp_directory_path() /
            ("shardtrain_tok_test_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

/// Sets (or unsets, for nullptr) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

/// Expects `fn` to throw DataError whose message contains every string in `needles`.
template <typename F>
void expect_data_error(F&& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected DataError";
  } catch (const DataError& e) {
    const std::string msg = e.what();
    for (const std::string& n : needles) {
      EXPECT_NE(msg.find(n), std::string::npos) << "message lacks \"" << n << "\": " << msg;
    }
  }
}

std::string decode(const BpeTokenizer& tok, const std::vector<int32_t>& ids) {
  return tok.decode(ids);
}

}  // namespace

TEST(Tokenizer, KnownSentence) {
  const std::vector<int32_t> expected = {15496, 995, 11,    428,  318,  402, 11571,
                                         12,    17,  11241, 1634, 1332, 13};
  const std::string text = "Hello world, this is GPT-2 tokenization test.";
  EXPECT_EQ(gpt2().encode(text), expected);
  EXPECT_EQ(gpt2().encode_ordinary(text), expected);
  EXPECT_EQ(decode(gpt2(), expected), text);
  EXPECT_EQ(gpt2().vocab_size(), 50257);
}

TEST(Tokenizer, MatchesReferenceFixture) {
  const nlohmann::json doc = nlohmann::json::parse(read_all(kFixture));
  const auto& cases = doc.at("cases");
  ASSERT_GE(cases.size(), 30u) << kFixture;
  size_t checked = 0;
  for (const auto& c : cases) {
    const auto name = c.at("name").get<std::string>();
    const auto text = c.at("text").get<std::string>();
    const auto want = c.at("encode").get<std::vector<int32_t>>();
    const auto want_ordinary = c.at("encode_ordinary").get<std::vector<int32_t>>();
    SCOPED_TRACE("fixture case " + name);
    const std::vector<int32_t> got = gpt2().encode(text);
    EXPECT_EQ(got, want);
    EXPECT_EQ(gpt2().encode_ordinary(text), want_ordinary);
    EXPECT_EQ(decode(gpt2(), got), text);
    EXPECT_EQ(decode(gpt2(), gpt2().encode_ordinary(text)), text);
    ++checked;
  }
  EXPECT_EQ(checked, cases.size());
  EXPECT_EQ(doc.at("known").at("ids").get<std::vector<int32_t>>(),
            gpt2().encode(doc.at("known").at("text").get<std::string>()));
}

TEST(Tokenizer, EmptyText) {
  EXPECT_TRUE(gpt2().encode("").empty());
  EXPECT_TRUE(gpt2().encode_ordinary("").empty());
  EXPECT_EQ(gpt2().decode({}), "");
}

TEST(Tokenizer, EndOfText) {
  EXPECT_EQ(gpt2().encode("<|endoftext|>"), std::vector<int32_t>{BpeTokenizer::kEndOfText});
  EXPECT_EQ(decode(gpt2(), {BpeTokenizer::kEndOfText}), "<|endoftext|>");
  const std::vector<int32_t> ordinary = gpt2().encode_ordinary("<|endoftext|>");
  EXPECT_GT(ordinary.size(), 1u);
  for (int32_t id : ordinary) EXPECT_NE(id, BpeTokenizer::kEndOfText);
  EXPECT_EQ(decode(gpt2(), ordinary), "<|endoftext|>");

  // The text around the special token is encoded as if it were separate documents.
  const std::string a = "The end.\n";
  const std::string b = " Next story";
  std::vector<int32_t> want = gpt2().encode(a);
  want.push_back(BpeTokenizer::kEndOfText);
  for (int32_t id : gpt2().encode(b)) want.push_back(id);
  EXPECT_EQ(gpt2().encode(a + "<|endoftext|>" + b), want);
}

TEST(Tokenizer, InvalidUtf8RoundTrips) {
  std::vector<std::string> inputs = {
      std::string("\xff\xfe abc"),
      std::string("abc\x80"),
      std::string("\xed\xa0\x80 surrogate"),
      std::string("overlong \xc0\xaf slash"),
      std::string("truncated \xe2\x82"),
      std::string("caf\xc3"),
      std::string("\xf4\x90\x80\x80 beyond U+10FFFF"),
      std::string("mixed \xe6\x97\xa5\xff\xe6\x9c\xac \xfe\xfe\xfe words"),
      std::string(" \xff  \n\xfe\t"),
  };
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes.push_back(static_cast<char>(b));
  inputs.push_back(all_bytes);
  std::mt19937 rng(1234);
  for (int i = 0; i < 50; ++i) {
    std::string s(1 + rng() % 300, '\0');
    for (char& ch : s) ch = static_cast<char>(rng() % 256);
    inputs.push_back(s);
  }
  for (const std::string& text : inputs) {
    const std::vector<int32_t> ids = gpt2().encode(text);
    EXPECT_EQ(decode(gpt2(), ids), text);
    for (int32_t id : ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, gpt2().vocab_size());
    }
  }
  // Valid text after invalid bytes is still tokenized as usual.
  const std::vector<int32_t> tail = gpt2().encode(" Hello world");
  const std::vector<int32_t> ids = gpt2().encode("\xff Hello world");
  ASSERT_GE(ids.size(), tail.size());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), ids.end() - tail.size()));
}

TEST(Tokenizer, LongRunsRoundTrip) {
  for (const std::string& text : {std::string(200000, 'a'), std::string(100000, '\n') + "x",
                                  std::string(100000, '='), std::string(50000, '7')}) {
    const std::vector<int32_t> ids = gpt2().encode(text);
    EXPECT_LT(ids.size(), text.size());  // merges happened
    EXPECT_EQ(decode(gpt2(), ids), text);
  }
  // GPT-2 has no merge of two spaces: a run of spaces is one id (220) per space, as in the
  // fixture's long_spaces case.
  const std::vector<int32_t> spaces = gpt2().encode(std::string(1 << 20, ' '));
  EXPECT_EQ(spaces, std::vector<int32_t>(1 << 20, 220));
  // A long run of spaces before a word: all but the last space form one piece.
  const std::vector<int32_t> ids = gpt2().encode(std::string(1000, ' ') + "word");
  EXPECT_EQ(ids.back(), gpt2().encode(" word").back());
}

TEST(Tokenizer, DecodeRejectsOutOfRangeIds) {
  expect_data_error([] { gpt2().decode(std::vector<int32_t>{15496, -1}); }, {"-1", "50257"});
  expect_data_error([] { gpt2().decode(std::vector<int32_t>{50257}); }, {"50257"});
}

TEST(Tokenizer, ThreadSafe) {
  const nlohmann::json doc = nlohmann::json::parse(read_all(kFixture));
  std::vector<std::string> texts;
  for (const auto& c : doc.at("cases")) texts.push_back(c.at("text").get<std::string>());
  std::vector<std::vector<int32_t>> want;
  for (const std::string& t : texts) want.push_back(gpt2().encode(t));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < texts.size(); ++i) {
          const size_t k = (i + static_cast<size_t>(t) * 7 + round) % texts.size();
          if (gpt2().encode(texts[k]) != want[k]) ++mismatches[t];
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

TEST(Tokenizer, Fingerprint) {
  const std::string enc = read_all(kTokenizerDir / "encoder.json");
  const std::string bpe = read_all(kTokenizerDir / "vocab.bpe");
  EXPECT_EQ(gpt2().fingerprint(), shardtrain::fnv1a64(bpe, shardtrain::fnv1a64(enc)));
  EXPECT_EQ(BpeTokenizer::load(kTokenizerDir).fingerprint(), gpt2().fingerprint());
}

TEST(Tokenizer, DifferentMergesGiveDifferentIdsOnOneThread) {
  // A tokenizer with only the first 300 merges: it must neither use nor pollute the other's
  // per-thread word cache.
  TempDir dir;
  fs::copy_file(kTokenizerDir / "encoder.json", dir.path() / "encoder.json");
  const std::string bpe = read_all(kTokenizerDir / "vocab.bpe");
  size_t cut = 0;
  for (int line = 0; line < 301; ++line) cut = bpe.find('\n', cut) + 1;
  write_all(dir.path() / "vocab.bpe", bpe.substr(0, cut));
  const BpeTokenizer small = BpeTokenizer::load(dir.path());
  EXPECT_NE(small.fingerprint(), gpt2().fingerprint());

  const std::string text = "Hello world, this is GPT-2 tokenization test.";
  const std::vector<int32_t> full_ids = gpt2().encode(text);
  for (int round = 0; round < 3; ++round) {
    const std::vector<int32_t> small_ids = small.encode(text);
    EXPECT_GT(small_ids.size(), full_ids.size());
    EXPECT_EQ(small.decode(small_ids), text);
    EXPECT_EQ(gpt2().encode(text), full_ids);
  }
}

TEST(Tokenizer, MissingDirectory) {
  TempDir dir;
  const fs::path missing = dir.path() / "no-such-tokenizer";
  expect_data_error([&] { BpeTokenizer::load(missing); },
                    {missing.string(), "encoder.json", "vocab.bpe"});
}

TEST(Tokenizer, MissingFile) {
  TempDir dir;
  fs::copy_file(kTokenizerDir / "encoder.json", dir.path() / "encoder.json");
  expect_data_error([&] { BpeTokenizer::load(dir.path()); },
                    {(dir.path() / "vocab.bpe").string(), "missing", "merges.txt"});
}

TEST(Tokenizer, CorruptEncoderJson) {
  TempDir dir;
  fs::copy_file(kTokenizerDir / "vocab.bpe", dir.path() / "vocab.bpe");
  const fs::path enc = dir.path() / "encoder.json";

  write_all(enc, read_all(kTokenizerDir / "encoder.json").substr(0, 5000));  // truncated
  expect_data_error([&] { BpeTokenizer::load(dir.path()); }, {enc.string(), "not valid JSON"});

  write_all(enc, "[1, 2, 3]");
  expect_data_error([&] { BpeTokenizer::load(dir.path()); }, {enc.string(), "JSON object"});

  write_all(enc, R"({"a": "zero", "b": 1})");
  expect_data_error([&] { BpeTokenizer::load(dir.path()); }, {enc.string(), "\"a\""});

  write_all(enc, R"({"a": 0, "b": 0})");
  expect_data_error([&] { BpeTokenizer::load(dir.path()); }, {enc.string(), "distinct"});

  // Valid JSON, but a vocabulary without the byte-level alphabet.
  write_all(enc, R"({"a": 0, "b": 1})");
  expect_data_error([&] { BpeTokenizer::load(dir.path()); }, {enc.string(), "byte"});
}

TEST(Tokenizer, CorruptMerges) {
  TempDir dir;
  fs::copy_file(kTokenizerDir / "encoder.json", dir.path() / "encoder.json");
  const fs::path bpe = dir.path() / "vocab.bpe";

  write_all(bpe, "#version: 0.2\n\xc4\xa0 t\nnot-a-merge\n");
  expect_data_error([&] { BpeTokenizer::load(dir.path()); }, {bpe.string(), "line 3"});

  write_all(bpe, "#version: 0.2\nzzzzzzzzzzzzzzzzqq t\n");
  expect_data_error([&] { BpeTokenizer::load(dir.path()); }, {bpe.string(), "line 2", "zzzz"});

  write_all(bpe, "#version: 0.2\n");
  expect_data_error([&] { BpeTokenizer::load(dir.path()); }, {bpe.string(), "no merges"});
}

TEST(Tokenizer, LoadDefault) {
  {
    ScopedEnv env("SHARDTRAIN_TOKENIZER_DIR", kTokenizerDir.c_str());
    EXPECT_EQ(BpeTokenizer::load_default().fingerprint(), gpt2().fingerprint());
  }
  {
    TempDir dir;
    const std::string missing = (dir.path() / "nowhere").string();
    ScopedEnv env("SHARDTRAIN_TOKENIZER_DIR", missing.c_str());
    expect_data_error([] { BpeTokenizer::load_default(); }, {missing, "SHARDTRAIN_TOKENIZER_DIR"});
  }
  {
    // Without the variable: the build's copy of data/gpt2-tokenizer (identical bytes).
    ScopedEnv env("SHARDTRAIN_TOKENIZER_DIR", nullptr);
    EXPECT_EQ(BpeTokenizer::load_default().fingerprint(), gpt2().fingerprint());
  }
}
