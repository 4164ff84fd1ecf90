// Streaming parallel tokenization of text files (see tokenize_stream.h).
#include "data/tokenize_stream.h"

#include <fmt/core.h>
#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string_view>
#include <system_error>

#include "core/error.h"
#include "core/file_input.h"
#include "core/hash.h"
#include "data/bpe_tokenizer.h"
#include "data/dataset.h"

namespace shardtrain {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kSeparator = "<|endoftext|>";
constexpr int kPiecesPerThread = 4;

/// Encodes `pieces` in parallel (one OpenMP task per piece) and hands their ids to `sink` in
/// order.
void encode_batch(const BpeTokenizer& tok, const std::vector<std::string>& pieces, int threads,
                  const std::function<void(std::span<const int32_t>)>& sink,
                  StreamTokenizeStats& stats) {
  std::vector<std::vector<int32_t>> ids(pieces.size());
  std::exception_ptr error;
  const auto n = static_cast<int64_t>(pieces.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n > 1)
  for (int64_t i = 0; i < n; ++i) {
    try {
      ids[static_cast<size_t>(i)] = tok.encode(pieces[static_cast<size_t>(i)]);
    } catch (...) {
#pragma omp critical(shardtrain_encode_batch_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  for (const auto& part : ids) {
    stats.tokens += part.size();
    if (!part.empty()) sink(part);
  }
}

/// Cuts a byte stream into pieces at cut points (is_cut_point) about `target` bytes apart.
class Chunker {
 public:
  Chunker(size_t target, size_t batch, std::function<void(std::vector<std::string>&)> on_batch)
      : target_(std::max<size_t>(target, 1)), batch_(batch), on_batch_(std::move(on_batch)) {}

  void feed(std::string_view bytes) {
    buf_.append(bytes);
    for (;;) {
      // A cut needs the byte after it: look at positions p with p + 1 < size.
      size_t p = std::max(scan_, target_);
      while (p + 1 < buf_.size() && !is_cut_point(buf_, p)) ++p;
      if (p + 1 >= buf_.size()) {
        scan_ = std::max(scan_, p);  // no cut yet: resume the scan here next time
        return;
      }
      pieces_.push_back(buf_.substr(0, p));
      buf_.erase(0, p);
      scan_ = 0;
      if (pieces_.size() >= batch_) flush();
    }
  }

  /// Hands over the rest: the last piece and any batched ones.
  void finish() {
    if (!buf_.empty()) pieces_.push_back(std::move(buf_));
    buf_.clear();
    flush();
  }

 private:
  void flush() {
    if (pieces_.empty()) return;
    on_batch_(pieces_);
    pieces_.clear();
  }

  size_t target_, batch_;
  std::function<void(std::vector<std::string>&)> on_batch_;
  std::string buf_;  ///< bytes from the start of the current piece
  size_t scan_ = 0;  ///< positions of buf_ below this are known not to be cut points
  std::vector<std::string> pieces_;
};

/// Reads `path` `block` bytes at a time into `feed`.
void stream_file(const fs::path& path, size_t block,
                 const std::function<void(std::string_view)>& feed) {
  if (const std::string problem = regular_file_problem(path);
      !problem.empty() && problem != "not found") {
    throw DataError(fmt::format("input file {} {}", path.string(), problem));
  }
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    if (err == ENOENT) {
      throw DataError(fmt::format("input file {} not found: check the path", path.string()));
    }
    throw DataError(
        fmt::format("cannot open input file {}: {}", path.string(), std::strerror(err)));
  }
  struct Closer {
    std::FILE* f;
    ~Closer() { std::fclose(f); }
  } closer{f};
  std::vector<char> buf(std::max<size_t>(block, 1));
  size_t got = 0;
  while ((got = std::fread(buf.data(), 1, buf.size(), f)) > 0) {
    feed(std::string_view(buf.data(), got));
  }
  if (std::ferror(f) != 0) {
    throw DataError(
        fmt::format("cannot read input file {}: {}", path.string(), std::strerror(errno)));
  }
}

}  // namespace

std::vector<fs::path> tokenize_inputs(const std::vector<std::string>& args) {
  std::vector<fs::path> files;
  for (const std::string& arg : args) {
    const fs::path p(arg);
    std::error_code ec;
    if (!fs::is_directory(p, ec)) {
      files.push_back(p);  // missing files and devices are reported when read, by name
      continue;
    }
    std::vector<fs::path> inside;
    for (const auto& entry : fs::directory_iterator(p, ec)) {
      const std::string name = entry.path().filename().string();
      std::error_code ec2;
      if (!name.empty() && name[0] != '.' && entry.is_regular_file(ec2)) {
        inside.push_back(entry.path());
      }
    }
    if (ec) {
      throw DataError(fmt::format("cannot list input directory {}: {}", arg, ec.message()));
    }
    if (inside.empty()) {
      throw DataError(fmt::format(
          "input directory {} holds no regular file (names starting with '.' and "
          "subdirectories are skipped): name the text files or a directory that holds them",
          arg));
    }
    std::sort(inside.begin(), inside.end(), [](const fs::path& a, const fs::path& b) {
      return a.filename().string() < b.filename().string();
    });
    files.insert(files.end(), inside.begin(), inside.end());
  }
  return files;
}

StreamTokenizeStats encode_files_streaming(
    const BpeTokenizer& tok, const std::vector<fs::path>& files,
    const std::function<void(std::span<const int32_t>)>& sink, size_t piece_bytes, int threads) {
  StreamTokenizeStats stats;
  uint64_t hash = fnv1a64(nullptr, 0);
  const int team = threads > 0 ? threads : omp_get_max_threads();
  const size_t batch = static_cast<size_t>(std::max(team, 1)) * kPiecesPerThread;
  Chunker chunker(piece_bytes, batch, [&](std::vector<std::string>& pieces) {
    encode_batch(tok, pieces, team, sink, stats);
  });
  auto feed = [&](std::string_view bytes) {
    hash = fnv1a64(bytes.data(), bytes.size(), hash);
    stats.bytes += bytes.size();
    chunker.feed(bytes);
  };
  for (size_t i = 0; i < files.size(); ++i) {
    if (i > 0) feed(kSeparator);
    stream_file(files[i], piece_bytes, feed);
  }
  chunker.finish();
  stats.source_hash = hash;
  return stats;
}

}  // namespace shardtrain
