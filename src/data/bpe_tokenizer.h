// GPT-2 byte-level BPE tokenizer (OpenAI encoder.json + vocab.bpe).
//
// Algorithm: Radford et al., "Language Models are Unsupervised Multitask Learners" (2019), §2.2,
// as implemented by OpenAI's gpt-2/src/encoder.py: text is split by GPT-2's pre-tokenization
// regex (Unicode-property classes, PCRE2), each piece's UTF-8 bytes are mapped to printable
// unicode by bytes_to_unicode(), and BPE merges are applied by rank. Ids match OpenAI's and
// Hugging Face's GPT2Tokenizer exactly (tests/fixtures/tokenizer_cases.json), except for letters
// and digits newer than the system PCRE2's Unicode tables (Unicode 15+ for PCRE2 10.42), which
// the regex sees as punctuation.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace shardtrain {

class BpeTokenizer {
 public:
  /// The id of "<|endoftext|>" in GPT-2's vocabulary.
  static constexpr int32_t kEndOfText = 50256;

  /// Loads `dir/encoder.json` and `dir/vocab.bpe`.
  /// Throws DataError naming the file when one is missing, unreadable or malformed.
  static BpeTokenizer load(const std::filesystem::path& dir);

  /// The tokenizer shipped with shardtrain (data/gpt2-tokenizer in the build tree), or the
  /// directory named by $SHARDTRAIN_TOKENIZER_DIR. Throws DataError when it cannot be found.
  static BpeTokenizer load_default();

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  /// Encodes the exact bytes of `text` (no newline normalization). A literal
  /// "<|endoftext|>" in the text becomes kEndOfText (as Hugging Face's GPT2Tokenizer does).
  /// Invalid UTF-8 is never rejected: each run of bytes the regex cannot match is encoded as its
  /// own piece, so decode() returns the input exactly. Thread-safe (the word cache is per thread).
  std::vector<int32_t> encode(std::string_view text) const;

  /// Like encode(), but "<|endoftext|>" is ordinary text (tiktoken's encode_ordinary).
  std::vector<int32_t> encode_ordinary(std::string_view text) const;

  /// Concatenates the byte strings of `ids`. Throws DataError for an id outside [0, vocab_size).
  std::string decode(std::span<const int32_t> ids) const;

  /// 50257 for GPT-2.
  int32_t vocab_size() const;

  /// 64-bit hash of encoder.json and vocab.bpe contents: token caches are keyed by it.
  uint64_t fingerprint() const;

 private:
  struct Impl;
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardtrain
