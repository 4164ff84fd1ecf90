// GPT-2 byte-level BPE tokenizer.
//
// Algorithm source: OpenAI's gpt-2/src/encoder.py (https://github.com/openai/gpt-2), which
// implements the byte-level BPE of Radford et al., "Language Models are Unsupervised Multitask
// Learners" (2019), §2.2 "Input Representation":
//   1. the text is split into pieces by GPT-2's pre-tokenization regex
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (here with PCRE2, JIT-compiled; \s is spelled out as Unicode White_Space, the set that
//      Python's `regex` module uses, because PCRE2 10.42's \s also matches U+180E);
//   2. each piece's UTF-8 bytes are the initial symbols (encoder.json spells them through
//      bytes_to_unicode(); they are translated back to raw bytes once, at load time);
//   3. repeatedly, the adjacent pair with the lowest merge rank in vocab.bpe is found and every
//      occurrence of it is merged, left to right, until no adjacent pair has a rank.
// \p{L} and \p{N} come from the system PCRE2's Unicode tables (Unicode 14 in PCRE2 10.42); letters
// and digits assigned later are punctuation to it, the only known divergence from encoder.py.
// Invalid UTF-8 never matches the regex (PCRE2_MATCH_INVALID_UTF); each run of bytes between
// matches is encoded as its own piece, so decode() still returns the exact input bytes.
#include "data/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "core/error.h"
#include "core/json_input.h"
#include "core/hash.h"
#include "data/data_dir.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kEndOfTextText = "<|endoftext|>";

/// GPT-2's pre-tokenization regex for PCRE2 (UTF + UCP). \s is spelled out as Unicode
/// White_Space, exactly the characters Python's `regex` \s matches (OpenAI's encoder.py runs on
/// `regex`): PCRE2 10.42's \s also matches U+180E.
std::string gpt2_pattern() {
  const std::string ws =
      R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F})"
      R"(\x{205F}\x{3000})";
  return R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^)" + ws + R"(\p{L}\p{N}]+|[)" + ws +
         R"(]+(?![^)" + ws + R"(])|[)" + ws + "]+";
}

constexpr const char* kFilesHint =
    "it should be OpenAI's GPT-2 tokenizer (encoder.json and vocab.bpe from the gpt-2 release, "
    "or Hugging Face gpt2's vocab.json and merges.txt renamed to those names)";

/// OpenAI's bytes_to_unicode(): byte -> code point. Printable Latin-1 bytes map to themselves;
/// the other 68 bytes map to 256, 257, ... in byte order.
std::array<uint32_t, 256> bytes_to_unicode() {
  std::array<uint32_t, 256> map{};
  uint32_t n = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    map[b] = printable ? b : 256 + n++;
  }
  return map;
}

/// Decodes one UTF-8 code point at s[i]; returns false on malformed input.
bool next_code_point(std::string_view s, size_t& i, uint32_t& cp) {
  const auto c0 = static_cast<unsigned char>(s[i]);
  int extra = 0;
  if (c0 < 0x80) {
    cp = c0;
  } else if ((c0 & 0xE0) == 0xC0) {
    cp = c0 & 0x1F;
    extra = 1;
  } else if ((c0 & 0xF0) == 0xE0) {
    cp = c0 & 0x0F;
    extra = 2;
  } else if ((c0 & 0xF8) == 0xF0) {
    cp = c0 & 0x07;
    extra = 3;
  } else {
    return false;
  }
  if (i + extra >= s.size()) return false;
  for (int k = 1; k <= extra; ++k) {
    const auto c = static_cast<unsigned char>(s[i + k]);
    if ((c & 0xC0) != 0x80) return false;
    cp = (cp << 6) | (c & 0x3F);
  }
  i += 1 + extra;
  return true;
}

std::string read_file(const fs::path& path, const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    throw DataError(fmt::format(
        "GPT-2 tokenizer directory {} does not exist; point it (or $SHARDTRAIN_TOKENIZER_DIR) at "
        "a directory holding encoder.json and vocab.bpe: {}",
        dir.string(), kFilesHint));
  }
  if (!fs::is_regular_file(path, ec)) {
    throw DataError(
        fmt::format("GPT-2 tokenizer file {} is missing; {}", path.string(), kFilesHint));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream buf;
  if (in) buf << in.rdbuf();
  if (!in || in.bad()) {
    throw DataError(fmt::format("cannot read GPT-2 tokenizer file {}; check its permissions ({})",
                                path.string(), kFilesHint));
  }
  return std::move(buf).str();
}

/// Merge table: (left id, right id) -> (rank, merged id), open addressing.
class PairTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0;
    int32_t merged = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    slots_.assign(cap, Entry{});
    mask_ = cap - 1;
  }
  /// Inserts or overwrites (a later duplicate line wins, as in encoder.py's dict()).
  void assign(int32_t a, int32_t b, int32_t rank, int32_t merged) {
    Entry& e = slot(key(a, b));
    e.key = key(a, b);
    e.rank = rank;
    e.merged = merged;
  }
  const Entry* find(int32_t a, int32_t b) const {
    const uint64_t k = key(a, b);
    for (size_t i = hash(k);; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.key == k) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }
  const std::vector<Entry>& slots() const { return slots_; }

 private:
  static uint64_t key(int32_t a, int32_t b) {
    return (uint64_t{static_cast<uint32_t>(a)} << 32) | static_cast<uint32_t>(b);
  }
  size_t hash(uint64_t k) const {
    return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> 40) & mask_;
  }
  Entry& slot(uint64_t k) {
    for (size_t i = hash(k);; i = (i + 1) & mask_) {
      Entry& e = slots_[i];
      if (e.key == k || e.key == kEmpty) return e;
    }
  }
  std::vector<Entry> slots_;
  size_t mask_ = 0;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

/// Per-thread cache of piece -> ids, tagged with the fingerprint of the tokenizer that filled it
/// (tokenizers loaded from identical files share it; any other tokenizer clears it).
struct WordCache {
  uint64_t owner = 0;
  bool owned = false;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
};
constexpr size_t kMaxCachedPieceBytes = 64;
constexpr size_t kMaxCacheEntries = size_t{1} << 17;
/// Words longer than this use the heap-based merge loop (when it is provably equivalent).
constexpr size_t kHeapMergeMinSymbols = 48;

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};

}  // namespace

struct BpeTokenizer::Impl {
  std::vector<std::string> token_bytes;  // id -> raw bytes
  std::array<int32_t, 256> byte_id{};    // byte -> id of the one-byte token
  PairTable merges;
  // True when every merge's rank is larger than the ranks of the merges that produce its two
  // halves. Then merging pairs one at a time in (rank, position) order gives exactly
  // encoder.py's result, and long words can use a heap instead of the quadratic loop.
  bool ranks_ordered = false;
  int32_t eot_id = -1;
  std::unique_ptr<pcre2_code, CodeDeleter> re;
  bool jit = false;
  uint64_t fingerprint = 0;

  template <typename F>
  void split(std::string_view text, F&& on_piece) const;
  void encode_ordinary(std::string_view text, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out, WordCache& cache) const;
  void bpe(std::vector<int32_t>& word) const;
  void bpe_quadratic(std::vector<int32_t>& word) const;
  void bpe_heap(std::vector<int32_t>& word) const;
};

// ---- pre-tokenization ----------------------------------------------------------------------

template <typename F>
void BpeTokenizer::Impl::split(std::string_view text, F&& on_piece) const {
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> md(
      pcre2_match_data_create_from_pattern(re.get(), nullptr));
  if (!md) throw RuntimeFailure("out of memory allocating PCRE2 match data for the tokenizer");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t n = text.size();
  size_t pos = 0;
  while (pos < n) {
    int rc = jit ? pcre2_jit_match(re.get(), subject, n, pos, 0, md.get(), nullptr)
                 : PCRE2_ERROR_JIT_BADOPTION;
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {
      // No JIT, or its stack ran out (huge runs): the interpreter keeps its frames on the heap.
      rc = pcre2_match(re.get(), subject, n, pos, PCRE2_NO_JIT, md.get(), nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) {
      on_piece(text.substr(pos));  // trailing bytes the pattern cannot match (invalid UTF-8)
      return;
    }
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof(msg));
      throw RuntimeFailure(fmt::format("PCRE2 failed while pre-tokenizing text at byte {}: {}", pos,
                                       reinterpret_cast<const char*>(msg)));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    const size_t start = ov[0];
    const size_t end = ov[1];
    if (start > pos) on_piece(text.substr(pos, start - pos));  // invalid UTF-8 between matches
    if (end > start) {
      on_piece(text.substr(start, end - start));
      pos = end;
    } else {  // cannot happen (every alternative consumes a character); never loop forever
      on_piece(text.substr(start, 1));
      pos = start + 1;
    }
  }
}

// ---- BPE -----------------------------------------------------------------------------------

void BpeTokenizer::Impl::bpe(std::vector<int32_t>& word) const {
  if (word.size() >= kHeapMergeMinSymbols && ranks_ordered) {
    bpe_heap(word);
  } else {
    bpe_quadratic(word);
  }
}

// encoder.py's loop: find the lowest-ranked adjacent pair, merge all its occurrences left to
// right in one pass, repeat.
void BpeTokenizer::Impl::bpe_quadratic(std::vector<int32_t>& word) const {
  while (word.size() > 1) {
    int32_t best_rank = INT32_MAX;
    int32_t first = 0, second = 0, merged = 0;
    size_t at = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      const PairTable::Entry* e = merges.find(word[i], word[i + 1]);
      if (e != nullptr && e->rank < best_rank) {
        best_rank = e->rank;
        first = word[i];
        second = word[i + 1];
        merged = e->merged;
        at = i;
      }
    }
    if (best_rank == INT32_MAX) return;
    size_t out = at;
    for (size_t i = at; i < word.size();) {
      if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
        word[out++] = merged;
        i += 2;
      } else {
        word[out++] = word[i++];
      }
    }
    word.resize(out);
  }
}

// Same result as bpe_quadratic() when ranks_ordered holds (merges form in rank order, and a
// pass of equal-ranked merges runs leftmost first), in O(n log n).
void BpeTokenizer::Impl::bpe_heap(std::vector<int32_t>& word) const {
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t left;
    int32_t right;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  const auto n = static_cast<int32_t>(word.size());
  std::vector<int32_t> next(n), prev(n);
  for (int32_t i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  std::vector<Candidate> storage;
  storage.reserve(static_cast<size_t>(n));
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap(std::greater<>{},
                                                                              std::move(storage));
  auto push = [&](int32_t left_pos) {
    const int32_t right_pos = next[left_pos];
    if (right_pos < 0) return;
    const PairTable::Entry* e = merges.find(word[left_pos], word[right_pos]);
    if (e != nullptr) heap.push({e->rank, left_pos, word[left_pos], word[right_pos]});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  std::vector<bool> alive(n, true);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    // Stale candidates: a symbol's id only ever grows to a longer string starting at the same
    // byte, so matching ids mean the pair is still there.
    const int32_t right_pos = next[c.pos];
    if (!alive[c.pos] || right_pos < 0 || word[c.pos] != c.left || word[right_pos] != c.right) {
      continue;
    }
    word[c.pos] = merges.find(c.left, c.right)->merged;
    alive[right_pos] = false;
    next[c.pos] = next[right_pos];
    if (next[c.pos] >= 0) prev[next[c.pos]] = c.pos;
    if (prev[c.pos] >= 0) push(prev[c.pos]);
    push(c.pos);
  }
  size_t out = 0;
  for (int32_t i = 0; i >= 0; i = next[i]) word[out++] = word[i];
  word.resize(out);
}

void BpeTokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& out,
                                      WordCache& cache) const {
  if (piece.size() == 1) {
    out.push_back(byte_id[static_cast<unsigned char>(piece[0])]);
    return;
  }
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    auto it = cache.map.find(piece);
    if (it != cache.map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> word(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) word[i] = byte_id[static_cast<unsigned char>(piece[i])];
  bpe(word);
  out.insert(out.end(), word.begin(), word.end());
  if (cacheable) {
    if (cache.map.size() >= kMaxCacheEntries) cache.map.clear();
    cache.map.emplace(std::string(piece), std::move(word));
  }
}

void BpeTokenizer::Impl::encode_ordinary(std::string_view text, std::vector<int32_t>& out) const {
  thread_local WordCache cache;
  if (!cache.owned || cache.owner != fingerprint) {
    cache.map.clear();
    cache.owner = fingerprint;
    cache.owned = true;
  }
  split(text, [&](std::string_view piece) { encode_piece(piece, out, cache); });
}

// ---- loading -------------------------------------------------------------------------------

BpeTokenizer BpeTokenizer::load(const fs::path& dir) {
  const fs::path encoder_path = dir / "encoder.json";
  const fs::path merges_path = dir / "vocab.bpe";
  const std::string encoder_text = read_file(encoder_path, dir);
  const std::string merges_text = read_file(merges_path, dir);

  auto impl = std::make_unique<Impl>();
  impl->fingerprint = fnv1a64(merges_text, fnv1a64(encoder_text));

  // encoder.json: {"token spelled through bytes_to_unicode": id, ...}, ids exactly 0..n-1.
  JsonInputResult parsed = parse_json_input(encoder_text);
  if (!parsed.error.empty()) {
    throw DataError(fmt::format("GPT-2 tokenizer file {} is not valid JSON ({}); {}",
                                encoder_path.string(), parsed.error, kFilesHint));
  }
  const nlohmann::json encoder = std::move(parsed.value);
  if (!encoder.is_object() || encoder.empty()) {
    throw DataError(fmt::format(
        "GPT-2 tokenizer file {} must be a non-empty JSON object mapping token strings to ids; {}",
        encoder_path.string(), kFilesHint));
  }
  std::array<int32_t, 324> unicode_to_byte;
  unicode_to_byte.fill(-1);
  const std::array<uint32_t, 256> b2u = bytes_to_unicode();
  for (int b = 0; b < 256; ++b) unicode_to_byte[b2u[b]] = b;

  const size_t vocab = encoder.size();
  if (vocab > static_cast<size_t>(INT32_MAX)) {
    throw DataError(fmt::format("GPT-2 tokenizer file {} has too many entries ({}); {}",
                                encoder_path.string(), vocab, kFilesHint));
  }
  impl->token_bytes.assign(vocab, std::string());
  std::vector<bool> seen(vocab, false);
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> bytes_to_id;
  bytes_to_id.reserve(vocab);
  for (const auto& [key, value] : encoder.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
        value.get<int64_t>() >= static_cast<int64_t>(vocab) || seen[value.get<size_t>()]) {
      throw DataError(fmt::format(
          "GPT-2 tokenizer file {}: token {} has id {}, but ids must be distinct integers in "
          "[0, {}); {}",
          encoder_path.string(), nlohmann::json(key).dump(), value.dump(), vocab, kFilesHint));
    }
    const auto id = value.get<int32_t>();
    seen[id] = true;
    std::string bytes;
    for (size_t i = 0; i < key.size();) {
      uint32_t cp = 0;
      if (!next_code_point(key, i, cp) || cp >= unicode_to_byte.size() || unicode_to_byte[cp] < 0) {
        throw DataError(
            fmt::format("GPT-2 tokenizer file {}: token {} (id {}) is not spelled with GPT-2's "
                        "bytes_to_unicode() alphabet; {}",
                        encoder_path.string(), nlohmann::json(key).dump(), id, kFilesHint));
      }
      bytes.push_back(static_cast<char>(unicode_to_byte[cp]));
    }
    if (bytes.empty()) {
      throw DataError(fmt::format("GPT-2 tokenizer file {}: id {} has an empty token; {}",
                                  encoder_path.string(), id, kFilesHint));
    }
    if (!bytes_to_id.emplace(bytes, id).second) {
      throw DataError(fmt::format("GPT-2 tokenizer file {}: token {} appears twice; {}",
                                  encoder_path.string(), nlohmann::json(key).dump(), kFilesHint));
    }
    impl->token_bytes[id] = std::move(bytes);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_to_id.end()) {
      throw DataError(fmt::format(
          "GPT-2 tokenizer file {} lacks the one-byte token for byte 0x{:02X}; a byte-level BPE "
          "vocabulary has all 256; {}",
          encoder_path.string(), b, kFilesHint));
    }
    impl->byte_id[b] = it->second;
  }
  if (auto it = bytes_to_id.find(kEndOfTextText); it != bytes_to_id.end()) {
    impl->eot_id = it->second;
  }

  // vocab.bpe: "#version: 0.2", then one merge "left right" per line, in rank order.
  struct Merge {
    int32_t left, right, merged;
  };
  std::vector<Merge> merge_list;
  merge_list.reserve(50000);
  auto spelled_id = [&](std::string_view spelled, size_t line_no) {
    std::string bytes;
    for (size_t i = 0; i < spelled.size();) {
      uint32_t cp = 0;
      if (!next_code_point(spelled, i, cp) || cp >= unicode_to_byte.size() ||
          unicode_to_byte[cp] < 0) {
        bytes.clear();
        break;
      }
      bytes.push_back(static_cast<char>(unicode_to_byte[cp]));
    }
    auto it = bytes.empty() ? bytes_to_id.end() : bytes_to_id.find(bytes);
    if (it == bytes_to_id.end()) {
      throw DataError(fmt::format(
          "GPT-2 tokenizer file {} line {}: \"{}\" is not a token of {}; the two files do not "
          "belong together ({})",
          merges_path.string(), line_no, spelled, encoder_path.string(), kFilesHint));
    }
    return it->second;
  };
  size_t line_no = 0;
  for (size_t start = 0; start < merges_text.size();) {
    size_t end = merges_text.find('\n', start);
    if (end == std::string::npos) end = merges_text.size();
    std::string_view line(merges_text.data() + start, end - start);
    start = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.starts_with("#version"))) continue;
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string_view::npos) {
      throw DataError(fmt::format(
          "GPT-2 tokenizer file {} line {}: expected a merge \"left right\", got \"{}\"; {}",
          merges_path.string(), line_no, line, kFilesHint));
    }
    const int32_t left = spelled_id(line.substr(0, space), line_no);
    const int32_t right = spelled_id(line.substr(space + 1), line_no);
    auto it = bytes_to_id.find(impl->token_bytes[left] + impl->token_bytes[right]);
    if (it == bytes_to_id.end()) {
      throw DataError(fmt::format(
          "GPT-2 tokenizer file {} line {}: the merge \"{}\" makes a token that {} lacks; the two "
          "files do not belong together ({})",
          merges_path.string(), line_no, line, encoder_path.string(), kFilesHint));
    }
    merge_list.push_back({left, right, it->second});
  }
  if (merge_list.empty()) {
    throw DataError(fmt::format("GPT-2 tokenizer file {} holds no merges; {}", merges_path.string(),
                                kFilesHint));
  }
  if (merge_list.size() > static_cast<size_t>(INT32_MAX - 1)) {
    throw DataError(fmt::format("GPT-2 tokenizer file {} has too many merges; {}",
                                merges_path.string(), kFilesHint));
  }
  impl->merges.reserve(merge_list.size());
  for (size_t r = 0; r < merge_list.size(); ++r) {
    const Merge& m = merge_list[r];
    impl->merges.assign(m.left, m.right, static_cast<int32_t>(r), m.merged);
  }
  // ranks_ordered: every merge outranks (comes after) all merges that produce its halves.
  std::vector<int32_t> produced_at(vocab, -1);
  for (const PairTable::Entry& e : impl->merges.slots()) {
    if (e.key != PairTable::kEmpty) produced_at[e.merged] = std::max(produced_at[e.merged], e.rank);
  }
  impl->ranks_ordered = true;
  for (const PairTable::Entry& e : impl->merges.slots()) {
    if (e.key == PairTable::kEmpty) continue;
    const auto left = static_cast<int32_t>(e.key >> 32);
    const auto right = static_cast<int32_t>(e.key & 0xFFFFFFFFu);
    if (produced_at[left] >= e.rank || produced_at[right] >= e.rank) impl->ranks_ordered = false;
  }

  int err = 0;
  PCRE2_SIZE err_offset = 0;
  const std::string pattern = gpt2_pattern();
  impl->re.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                               PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &err_offset,
                               nullptr));
  if (!impl->re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    throw RuntimeFailure(fmt::format(
        "PCRE2 cannot compile GPT-2's pre-tokenization pattern (offset {}): {}; shardtrain needs "
        "PCRE2 10.34 or newer built with Unicode support",
        err_offset, reinterpret_cast<const char*>(msg)));
  }
  impl->jit = pcre2_jit_compile(impl->re.get(), PCRE2_JIT_COMPLETE) == 0;
  return BpeTokenizer(std::move(impl));
}

BpeTokenizer BpeTokenizer::load_default() {
  if (const char* env = std::getenv("SHARDTRAIN_TOKENIZER_DIR"); env != nullptr && *env != 0) {
    try {
      return load(env);
    } catch (const DataError& e) {
      throw DataError(
          fmt::format("{} (the directory comes from $SHARDTRAIN_TOKENIZER_DIR={})", e.what(), env));
    }
  }
  const fs::path dir = default_data_dir() / "gpt2-tokenizer";  // throws, naming where it looked
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw DataError(fmt::format(
        "the GPT-2 tokenizer is not in shardtrain's data directory ({} does not exist; {}); or "
        "set SHARDTRAIN_TOKENIZER_DIR to a directory holding encoder.json and vocab.bpe",
        dir.string(), data_dir_hint()));
  }
  return load(dir);
}

// ---- the public interface --------------------------------------------------------------------

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  if (impl_->eot_id < 0) {
    impl_->encode_ordinary(text, out);
    return out;
  }
  for (;;) {
    const size_t at = text.find(kEndOfTextText);
    impl_->encode_ordinary(text.substr(0, at), out);
    if (at == std::string_view::npos) break;
    out.push_back(impl_->eot_id);
    text.remove_prefix(at + kEndOfTextText.size());
  }
  return out;
}

std::vector<int32_t> BpeTokenizer::encode_ordinary(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  impl_->encode_ordinary(text, out);
  return out;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size() * 4);
  const auto n = static_cast<int64_t>(impl_->token_bytes.size());
  for (const int32_t id : ids) {
    if (id < 0 || id >= n) {
      throw DataError(fmt::format(
          "token id {} is outside the GPT-2 vocabulary [0, {}); the ids are corrupt or were made "
          "by a different tokenizer",
          id, n));
    }
    out += impl_->token_bytes[id];
  }
  return out;
}

int32_t BpeTokenizer::vocab_size() const { return static_cast<int32_t>(impl_->token_bytes.size()); }

uint64_t BpeTokenizer::fingerprint() const { return impl_->fingerprint; }

}  // namespace shardtrain
