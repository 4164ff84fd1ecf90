// Token files, token caches, packed language-modeling samples and the distributed sampler.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "data/token_store.h"

namespace shardtrain {

class BpeTokenizer;

// ---- token files ---------------------------------------------------------------------------
//
// The format (64-byte header + little-endian uint16 ids), TokenFileHeader and TokenStore (a
// memory-mapped, validated view of a token file) are in data/token_store.h.

/// Writes ids atomically (temporary file + rename). Throws DataError on I/O failure or an id
/// that does not fit in uint16.
void write_token_file(const std::filesystem::path& path, const std::vector<uint16_t>& ids,
                      uint64_t source_hash, uint64_t tokenizer_hash);

/// Reads the exact bytes of `path` (no newline translation). `what` names the file's role in
/// messages ("text file"). Throws DataError naming the file when it is missing, a directory or
/// unreadable.
std::string read_all_bytes(const std::filesystem::path& path, const char* what);

/// Reads and verifies a token file into a vector (2 bytes per id, a private copy: training maps
/// the file instead, load_token_store()). Throws DataError naming the file when it is missing,
/// truncated, corrupt or not a token file.
std::vector<uint16_t> read_token_file(const std::filesystem::path& path,
                                      TokenFileHeader* header = nullptr);

/// Throws DataError unless every id of `ids` is below `vocab_size`, the model's vocabulary
/// (an embedding row exists for it). `name` names the file, `model` the model, in the message,
/// which gives the first id out of range and its position. One pass over the ids (about 1 ms per
/// 10 million tokens).
void check_token_ids(const std::vector<uint16_t>& ids, int64_t vocab_size, const std::string& name,
                     const std::string& model);

/// check_token_ids() for a TokenStore: the same check and message, from the largest id its
/// validation pass recorded (no pass over the ids unless one is out of range).
void check_token_ids(const TokenStore& ids, int64_t vocab_size, const std::string& name,
                     const std::string& model);

/// Tokenizes the exact bytes of the text file `path`, reusing the cached token file in
/// `cache_dir` while the text's hash and the tokenizer's fingerprint are unchanged (the cache
/// is rewritten otherwise). A token file given as `path` is read directly. `log` receives
/// one-line progress messages ("tokenizing ...", "using cached tokens ..."). Throws DataError.
/// Returns a private copy of the ids (2 bytes per id); training uses load_token_store().
std::vector<uint16_t> load_tokens(const std::filesystem::path& path, const BpeTokenizer& tok,
                                  const std::filesystem::path& cache_dir,
                                  const std::function<void(const std::string&)>& log = {});

/// load_tokens() without the copy: a token file, or a valid cache of the text, is memory-mapped
/// read-only and shared (TokenStore::map_file: every rank of a node that maps it shares the page
/// cache's one copy, and a rank's resident set holds only the pages of the samples it reads).
/// Text that had to be tokenized is returned in memory (2 bytes per id) after the cache is
/// written. Same ids, messages and errors as load_tokens().
TokenStore load_token_store(const std::filesystem::path& path, const BpeTokenizer& tok,
                            const std::filesystem::path& cache_dir,
                            const std::function<void(const std::string&)>& log = {});

/// Byte offsets 0 < p1 < p2 < ... < text.size(), roughly `target_chunk_bytes` apart, at which
/// `text` can be cut so that encoding the pieces separately and concatenating the ids gives
/// exactly BpeTokenizer::encode(text). A cut is made only right before a ' ' or '\n' that is
/// followed by a printable ASCII character other than '<': GPT-2's pre-tokenizer always starts a
/// new piece there, and the piece before it ends the same way at the end of the string (its
/// `\s+(?!\S)` match stops before the last whitespace character in both cases). Returns no cut
/// points for text that is not valid UTF-8 (then it is encoded in one piece).
std::vector<size_t> tokenization_cut_points(std::string_view text, size_t target_chunk_bytes);

/// True when `text` may be cut right before byte `p` by the rule of tokenization_cut_points():
/// 0 < p, p + 1 < text.size(), text[p] is ' ' or '\n' and text[p + 1] is printable ASCII other
/// than '<'. Only the two bytes at p matter, so a stream can be cut as it is read.
bool is_cut_point(std::string_view text, size_t p);

/// Encodes `text` with `tok.encode` (identical result), cutting it at tokenization_cut_points()
/// and encoding the pieces in parallel with OpenMP. `target_chunk_bytes` is the approximate piece
/// size in bytes.
std::vector<int32_t> encode_parallel(const BpeTokenizer& tok, std::string_view text,
                                     size_t target_chunk_bytes = 256 * 1024);

/// The default cache directory: $SHARDTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/shardtrain, else
/// ~/.cache/shardtrain.
std::filesystem::path default_cache_dir();

// ---- data sets -----------------------------------------------------------------------------

struct DatasetFiles {
  std::string name;             ///< "wikitext-2" or the train file's name
  std::filesystem::path train;  ///< text or token file
  std::filesystem::path valid;  ///< may be empty: no validation
};

/// Resolves a named data set ("wikitext-2": wiki.train.tokens / wiki.valid.tokens under
/// `data_dir`/wikitext-2, default the copy shipped with shardtrain) or user files.
/// Throws ConfigError for an unknown name (listing the known ones) or when neither a data set
/// nor a train file is given; DataError when a file is missing (naming it and the fix).
DatasetFiles resolve_dataset(const std::string& dataset, const std::string& train_file,
                             const std::string& valid_file, const std::string& data_dir);

// ---- packed samples --------------------------------------------------------------------------

/// A corpus cut into non-overlapping samples of `sample_len` = max_length + 1 tokens (inputs are
/// tokens [0, T), targets [1, T+1)). The tail shorter than a sample is dropped. The ids are a
/// TokenStore: for a mapped token file, sample i reads only bytes [2·i·(T+1), 2·(i+1)·(T+1)) of
/// the ids, so a rank touches only the pages of the samples its sampler gives it.
class PackedDataset {
 public:
  /// `max_length` ≥ 1 is T; `name` names the corpus in error messages. Throws ConfigError when
  /// the corpus holds fewer than T + 1 tokens (not one sample) or max_length < 1.
  PackedDataset(TokenStore tokens, int64_t max_length, std::string name = "the data set");
  /// Keeps only the first `n` samples (DeepSpeed tutorials' num_samples); n < 0 keeps all.
  /// Throws ConfigError when n exceeds the available samples (stating both numbers).
  void limit(int64_t n);
  int64_t size() const { return num_samples_; }
  int64_t max_length() const { return max_length_; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  /// Samples the corpus holds before any limit().
  int64_t available() const { return num_tokens() / (max_length_ + 1); }
  const std::string& name() const { return name_; }
  /// Writes sample `i`'s T+1 tokens as int32 to `out`.
  void sample(int64_t i, int32_t* out) const;
  /// Samples [first, first + count) as model input: `tokens` and next-token `targets`, int32
  /// [count · T] each, row-major (resized here).
  void batch(int64_t first, int64_t count, std::vector<int32_t>& tokens,
             std::vector<int32_t>& targets) const;

 private:
  TokenStore tokens_;
  std::string name_;
  int64_t max_length_;
  int64_t num_samples_;
};

// ---- distributed sampler ---------------------------------------------------------------------

/// Splits each epoch's permutation of the samples into global batches and gives each
/// data-parallel rank its own micro-batches of every global batch (like PyTorch's
/// DistributedSampler, drop_last=True). The permutation of epoch e is a Fisher–Yates shuffle
/// driven by SplitMix64 seeded with (seed, e): identical on every platform and rank, so the
/// data position (epoch, step) is the whole sampler state. One sampler must not be used from
/// several threads at once (it caches the current epoch's permutation).
class DistributedSampler {
 public:
  /// Global batch = micro_batch × accumulation_steps × world_size samples. Throws ConfigError
  /// for a non-positive micro batch, accumulation or world size, a rank outside
  /// [0, world_size), or fewer samples than one global batch.
  DistributedSampler(int64_t num_samples, int64_t micro_batch, int64_t accumulation_steps, int rank,
                     int world_size, uint64_t seed, bool shuffle = true);

  /// Optimizer steps per epoch = floor(num_samples / global_batch). Throws ConfigError from the
  /// constructor when this is 0 (too few samples for one global batch).
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t global_batch() const { return global_batch_; }

  /// Sample indices of this rank's micro-batch `micro_step` (0 ≤ micro_step < accumulation) of
  /// optimizer step `step` (0 ≤ step < steps_per_epoch) in `epoch`: micro_batch indices.
  std::vector<int64_t> micro_batch_indices(int64_t epoch, int64_t step, int64_t micro_step) const;

 private:
  const std::vector<int64_t>& permutation(int64_t epoch) const;
  int64_t num_samples_, micro_batch_, accumulation_steps_;
  int rank_, world_size_;
  uint64_t seed_;
  bool shuffle_;
  int64_t global_batch_, steps_per_epoch_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_perm_;
};

}  // namespace shardtrain
