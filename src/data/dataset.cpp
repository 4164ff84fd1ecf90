// Token files, token caches, packed samples and the distributed sampler (see dataset.h).
#include "data/dataset.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <numeric>
#include <system_error>

#include "core/error.h"
#include "core/file_input.h"
#include "core/hash.h"
#include "core/rng.h"
#include "core/strings.h"
#include "data/bpe_tokenizer.h"
#include "data/data_dir.h"

namespace shardtrain {
namespace fs = std::filesystem;

namespace {

std::string errno_text(int err) { return std::strerror(err); }

void log_line(const std::function<void(const std::string&)>& log, const std::string& msg) {
  if (log) log(msg);
}

std::string megabytes(size_t bytes) { return fmt::format("{:.1f} MB", bytes / 1e6); }

/// Strict UTF-8 check (RFC 3629: no overlong forms, surrogates or code points above U+10FFFF).
bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
        (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) {
      return false;
    }
    i += len;
  }
  return true;
}

}  // namespace

// ---- token files -------------------------------------------------------------------------------

void write_token_file(const fs::path& path, const std::vector<uint16_t>& ids, uint64_t source_hash,
                      uint64_t tokenizer_hash) {
  TokenFileWriter writer(path, source_hash, tokenizer_hash);
  writer.append(ids);
  writer.finish();
}

std::string read_all_bytes(const fs::path& path, const char* what) {
  if (const std::string problem = regular_file_problem(path);
      !problem.empty() && problem != "not found") {
    throw DataError(fmt::format("{} {} {}", what, path.string(), problem));
  }
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    if (err == ENOENT) {
      throw DataError(fmt::format("{} {} not found: check the path", what, path.string()));
    }
    throw DataError(fmt::format("cannot open {} {}: {}", what, path.string(), errno_text(err)));
  }
  std::string data;
  std::array<char, 1 << 16> buf;
  size_t got = 0;
  while ((got = std::fread(buf.data(), 1, buf.size(), f)) > 0) data.append(buf.data(), got);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) {
    throw DataError(fmt::format("cannot read {} {}: {}", what, path.string(), errno_text(err)));
  }
  return data;
}

std::vector<uint16_t> read_token_file(const fs::path& path, TokenFileHeader* header) {
  return TokenStore::map_file(path, header, TokenFileRole::kUser).to_vector();
}

// ---- tokenization ------------------------------------------------------------------------------

bool is_cut_point(std::string_view text, size_t p) {
  if (p == 0 || p + 1 >= text.size()) return false;
  const char c = text[p];
  const char next = text[p + 1];
  return (c == ' ' || c == '\n') && next >= 0x21 && next <= 0x7E && next != '<';
}

std::vector<size_t> tokenization_cut_points(std::string_view text, size_t target_chunk_bytes) {
  std::vector<size_t> cuts;
  if (target_chunk_bytes == 0) target_chunk_bytes = 1;
  if (text.size() <= target_chunk_bytes || !is_valid_utf8(text)) return cuts;
  size_t pos = target_chunk_bytes;
  while (pos < text.size()) {
    size_t p = pos;
    while (p < text.size() && !is_cut_point(text, p)) ++p;
    if (p >= text.size()) break;
    cuts.push_back(p);
    pos = p + target_chunk_bytes;
  }
  return cuts;
}

std::vector<int32_t> encode_parallel(const BpeTokenizer& tok, std::string_view text,
                                     size_t target_chunk_bytes) {
  const std::vector<size_t> cuts = tokenization_cut_points(text, target_chunk_bytes);
  if (cuts.empty()) return tok.encode(text);
  std::vector<size_t> bounds;
  bounds.reserve(cuts.size() + 2);
  bounds.push_back(0);
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(text.size());
  const auto pieces = static_cast<int64_t>(bounds.size() - 1);

  std::vector<std::vector<int32_t>> parts(static_cast<size_t>(pieces));
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < pieces; ++i) {
    try {
      const size_t b = bounds[static_cast<size_t>(i)];
      const size_t e = bounds[static_cast<size_t>(i) + 1];
      parts[static_cast<size_t>(i)] = tok.encode(text.substr(b, e - b));
    } catch (...) {
#pragma omp critical(shardtrain_encode_parallel_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);

  size_t total = 0;
  for (const auto& p : parts) total += p.size();
  std::vector<int32_t> ids;
  ids.reserve(total);
  for (auto& p : parts) {
    ids.insert(ids.end(), p.begin(), p.end());
    std::vector<int32_t>().swap(p);
  }
  return ids;
}

namespace {

/// `path` for log lines: inside the shipped data directory as "<data>/wikitext-2/...", so logs
/// (and the README's example output) show no machine's paths; elsewhere as given.
std::string shown_path(const fs::path& path) {
  std::error_code ec;
  const DataDirLookup where = find_data_dir();
  if (where.dir.empty()) return path.string();
  const fs::path rel = fs::relative(path, where.dir, ec);
  if (ec || rel.empty() || *rel.begin() == "..") return path.string();
  return (fs::path("<data>") / rel).string();
}

}  // namespace

namespace {

[[noreturn]] void throw_id_out_of_range(std::span<const uint16_t> ids, uint16_t largest,
                                        int64_t vocab_size, const std::string& name,
                                        const std::string& model) {
  const auto first =
      std::find_if(ids.begin(), ids.end(), [&](uint16_t id) { return id >= vocab_size; });
  throw DataError(fmt::format(
      "{} holds token id {} at position {} (the largest is {}), but {}'s vocabulary has {} ids "
      "(0 to {}): the file was made with another tokenizer (one with added tokens?). Re-tokenize "
      "the text with `shardtrain tokenize`, or train a model with a larger vocab_size (a "
      "config.json with \"vocab_size\": {})",
      name, *first, with_commas(first - ids.begin()), largest, model, vocab_size, vocab_size - 1,
      int64_t{largest} + 1));
}

}  // namespace

void check_token_ids(const std::vector<uint16_t>& ids, int64_t vocab_size, const std::string& name,
                     const std::string& model) {
  if (vocab_size > 0xFFFF) return;  // every uint16 id has a row
  uint16_t largest = 0;
  for (const uint16_t id : ids) largest = std::max(largest, id);  // vectorized: no early exit
  if (largest < vocab_size) return;
  throw_id_out_of_range(ids, largest, vocab_size, name, model);
}

void check_token_ids(const TokenStore& ids, int64_t vocab_size, const std::string& name,
                     const std::string& model) {
  if (vocab_size > 0xFFFF || ids.largest_id() < vocab_size) return;
  throw_id_out_of_range(ids.span(), ids.largest_id(), vocab_size, name, model);
}

std::vector<uint16_t> load_tokens(const fs::path& path, const BpeTokenizer& tok,
                                  const fs::path& cache_dir,
                                  const std::function<void(const std::string&)>& log) {
  return load_token_store(path, tok, cache_dir, log).to_vector();
}

TokenStore load_token_store(const fs::path& path, const BpeTokenizer& tok,
                            const fs::path& cache_dir,
                            const std::function<void(const std::string&)>& log) {
  if (is_token_file(path)) {
    TokenStore ids = TokenStore::map_file(path, nullptr, TokenFileRole::kUser);
    log_line(log, fmt::format("read {} tokens from token file {}", ids.size(), path.string()));
    return ids;
  }
  const std::string text = read_all_bytes(path, "text file");
  const uint64_t source_hash = fnv1a64(text);
  const uint64_t tokenizer_hash = tok.fingerprint();

  fs::path cache;
  if (!cache_dir.empty()) {
    cache = cache_dir / fmt::format("{}.{:016x}.{:016x}.tokens.bin", path.stem().string(),
                                    source_hash, tokenizer_hash);
    std::error_code ec;
    if (fs::exists(cache, ec)) {
      try {
        TokenFileHeader hdr;
        TokenStore ids = TokenStore::map_file(cache, &hdr, TokenFileRole::kCache);
        if (hdr.source_hash == source_hash && hdr.tokenizer_hash == tokenizer_hash) {
          log_line(log,
                   fmt::format("using cached tokens {} ({} tokens)", cache.string(), ids.size()));
          return ids;
        }
        log_line(log, fmt::format("token cache {} does not match {} (stale header): rebuilding it",
                                  cache.string(), path.string()));
      } catch (const DataError& e) {
        log_line(log, fmt::format("warning: {}; rebuilding it", e.what()));
      }
    }
  }

  log_line(log, fmt::format("tokenizing {} ({}) ...", shown_path(path), megabytes(text.size())));
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> raw = encode_parallel(tok, text);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<uint16_t> ids(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] < 0 || raw[i] > 0xFFFF) {
      throw DataError(fmt::format(
          "tokenizing {} gave id {}, which does not fit the 16-bit token format: the tokenizer "
          "vocabulary must have at most 65536 entries",
          path.string(), raw[i]));
    }
    ids[i] = static_cast<uint16_t>(raw[i]);
  }
  log_line(log, fmt::format("{} tokens in {:.2f} s ({:.1f} MB/s)", ids.size(), secs,
                            secs > 0 ? text.size() / 1e6 / secs : 0.0));

  if (!cache.empty()) {
    std::error_code ec;
    fs::create_directories(cache_dir, ec);
    if (ec) {
      log_line(log, fmt::format("warning: cannot create token cache directory {} ({}): "
                                "continuing without a cache",
                                cache_dir.string(), ec.message()));
    } else {
      try {
        write_token_file(cache, ids, source_hash, tokenizer_hash);
      } catch (const DataError& e) {
        log_line(log, fmt::format("warning: {}: continuing without a cache", e.what()));
      }
    }
  }
  return TokenStore(std::move(ids));
}

fs::path default_cache_dir() {
  if (std::string v = getenv_str("SHARDTRAIN_CACHE_DIR"); !v.empty()) return fs::path(v);
  if (std::string v = getenv_str("XDG_CACHE_HOME"); !v.empty()) {
    return fs::path(v) / "shardtrain";
  }
  if (std::string v = getenv_str("HOME"); !v.empty()) {
    return fs::path(v) / ".cache" / "shardtrain";
  }
  std::error_code ec;
  fs::path tmp = fs::temp_directory_path(ec);
  if (ec) tmp = "/tmp";
  return tmp / "shardtrain-cache";
}

// ---- data sets ---------------------------------------------------------------------------------

DatasetFiles resolve_dataset(const std::string& dataset, const std::string& train_file,
                             const std::string& valid_file, const std::string& data_dir) {
  DatasetFiles files;
  auto require_file = [](const fs::path& p, const std::string& fix) {
    const std::string problem = regular_file_problem(p);
    if (problem == "not found") throw DataError(fmt::format("{} not found: {}", p.string(), fix));
    if (!problem.empty())
      throw DataError(fmt::format("{} {}: pass a text file or a token file (shardtrain tokenize)",
                                  p.string(), problem));
  };
  if (!dataset.empty()) {
    if (!train_file.empty()) {
      throw ConfigError(
          fmt::format("both --dataset {} and --train-file {} given: pass only one of them", dataset,
                      train_file));
    }
    const std::string lower = lowercase(dataset);
    if (lower != "wikitext-2" && lower != "wikitext2" && lower != "wikitext-2-v1") {
      throw ConfigError(
          fmt::format("unknown data set '{}': known data sets are wikitext-2 (aliases wikitext2, "
                      "wikitext-2-v1); or pass your own text with --train-file FILE",
                      dataset));
    }
    const fs::path root =
        (data_dir.empty() ? default_data_dir() : fs::path(data_dir)) / "wikitext-2";
    const std::string fix =
        data_dir.empty()
            ? fmt::format(
                  "WikiText-2 is missing from shardtrain's data directory ({}); point "
                  "--data-dir at a directory holding wikitext-2/wiki.train.tokens and "
                  "wiki.valid.tokens",
                  data_dir_hint())
            : std::string(
                  "--data-dir must hold wikitext-2/wiki.train.tokens and "
                  "wiki.valid.tokens (WikiText-2 is unpacked from "
                  "data/wikitext-2/wikitext-2-v1.tar.xz when cmake configures the build)");
    files.name = "wikitext-2";
    files.train = root / "wiki.train.tokens";
    files.valid = valid_file.empty() ? root / "wiki.valid.tokens" : fs::path(valid_file);
    require_file(files.train, fix);
    require_file(files.valid, valid_file.empty() ? fix : "check --valid-file");
    return files;
  }
  if (train_file.empty()) {
    throw ConfigError("no training data: pass --dataset wikitext-2 or --train-file FILE");
  }
  files.train = fs::path(train_file);
  files.name = files.train.filename().string();
  require_file(files.train, "check --train-file");
  if (!valid_file.empty()) {
    files.valid = fs::path(valid_file);
    require_file(files.valid, "check --valid-file");
  }
  return files;
}

// ---- packed samples ----------------------------------------------------------------------------

PackedDataset::PackedDataset(TokenStore tokens, int64_t max_length, std::string name)
    : tokens_(std::move(tokens)), name_(std::move(name)), max_length_(max_length), num_samples_(0) {
  if (max_length_ < 1) {
    throw ConfigError(fmt::format("--max-length must be at least 1, got {}", max_length_));
  }
  num_samples_ = available();
  if (num_samples_ == 0) {
    throw ConfigError(fmt::format(
        "{} has {} tokens, fewer than one sample of {} tokens (--max-length {} + 1): lower "
        "--max-length or use a larger corpus",
        name_, tokens_.size(), max_length_ + 1, max_length_));
  }
}

void PackedDataset::limit(int64_t n) {
  if (n < 0) {
    num_samples_ = available();
    return;
  }
  const int64_t avail = available();
  if (n == 0) {
    throw ConfigError(fmt::format(
        "--num-samples 0 leaves no data in {}; use a positive number or -1 for all", name_));
  }
  if (n > avail) {
    throw ConfigError(fmt::format(
        "--num-samples {} exceeds the {} samples of {} tokens in {}; lower it or use -1 for all", n,
        avail, max_length_ + 1, name_));
  }
  num_samples_ = n;
}

void PackedDataset::sample(int64_t i, int32_t* out) const {
  ST_ASSERT(i >= 0 && i < num_samples_);
  const size_t len = static_cast<size_t>(max_length_ + 1);
  const uint16_t* src = tokens_.data() + static_cast<size_t>(i) * len;
  for (size_t k = 0; k < len; ++k) out[k] = static_cast<int32_t>(src[k]);
}

void PackedDataset::batch(int64_t first, int64_t count, std::vector<int32_t>& tokens,
                          std::vector<int32_t>& targets) const {
  const int64_t T = max_length_;
  std::vector<int32_t> buf(static_cast<size_t>(T + 1));
  tokens.resize(static_cast<size_t>(count * T));
  targets.resize(static_cast<size_t>(count * T));
  for (int64_t i = 0; i < count; ++i) {
    sample(first + i, buf.data());
    std::copy(buf.begin(), buf.end() - 1, tokens.begin() + i * T);
    std::copy(buf.begin() + 1, buf.end(), targets.begin() + i * T);
  }
}

// ---- distributed sampler -----------------------------------------------------------------------

DistributedSampler::DistributedSampler(int64_t num_samples, int64_t micro_batch,
                                       int64_t accumulation_steps, int rank, int world_size,
                                       uint64_t seed, bool shuffle)
    : num_samples_(num_samples),
      micro_batch_(micro_batch),
      accumulation_steps_(accumulation_steps),
      rank_(rank),
      world_size_(world_size),
      seed_(seed),
      shuffle_(shuffle),
      global_batch_(0),
      steps_per_epoch_(0) {
  check<ConfigError>(num_samples >= 0, "number of samples must be ≥ 0, got {}", num_samples);
  check<ConfigError>(micro_batch >= 1, "micro batch size must be ≥ 1, got {}", micro_batch);
  check<ConfigError>(accumulation_steps >= 1, "gradient accumulation steps must be ≥ 1, got {}",
                     accumulation_steps);
  check<ConfigError>(world_size >= 1, "world size must be ≥ 1, got {}", world_size);
  check<ConfigError>(rank >= 0 && rank < world_size, "rank {} is outside [0, {}) for world size {}",
                     rank, world_size, world_size);
  global_batch_ = micro_batch * accumulation_steps * world_size;
  steps_per_epoch_ = num_samples / global_batch_;
  if (steps_per_epoch_ == 0) {
    throw ConfigError(fmt::format(
        "too few samples for one optimizer step: {} samples < global batch {} (micro batch {} × "
        "gradient accumulation {} × {} ranks); lower the batch size or the accumulation steps, "
        "use fewer ranks, or use more samples (--num-samples -1, a smaller --max-length)",
        num_samples, global_batch_, micro_batch, accumulation_steps, world_size));
  }
}

const std::vector<int64_t>& DistributedSampler::permutation(int64_t epoch) const {
  if (epoch == cached_epoch_) return cached_perm_;
  cached_perm_.resize(static_cast<size_t>(num_samples_));
  std::iota(cached_perm_.begin(), cached_perm_.end(), int64_t{0});
  if (shuffle_) {
    SplitMix64 rng{mix_seed(seed_, static_cast<uint64_t>(epoch))};
    for (size_t i = cached_perm_.size(); i > 1; --i) {
      const size_t j = static_cast<size_t>(rng.below(i));
      std::swap(cached_perm_[i - 1], cached_perm_[j]);
    }
  }
  cached_epoch_ = epoch;
  return cached_perm_;
}

std::vector<int64_t> DistributedSampler::micro_batch_indices(int64_t epoch, int64_t step,
                                                             int64_t micro_step) const {
  check(epoch >= 0, "sampler: epoch must be ≥ 0, got {}", epoch);
  check(step >= 0 && step < steps_per_epoch_, "sampler: step {} is outside [0, {})", step,
        steps_per_epoch_);
  check(micro_step >= 0 && micro_step < accumulation_steps_,
        "sampler: micro step {} is outside [0, {})", micro_step, accumulation_steps_);
  const std::vector<int64_t>& perm = permutation(epoch);
  const int64_t begin = step * global_batch_ + (micro_step * world_size_ + rank_) * micro_batch_;
  return std::vector<int64_t>(perm.begin() + begin, perm.begin() + begin + micro_batch_);
}

}  // namespace shardtrain
