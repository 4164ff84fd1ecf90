// `shardtrain tokenize FILE|DIR... [--output OUT.bin] [--tokenizer-dir DIR] [--threads N]`: GPT-2
// BPE ids of text files, streamed in bounded memory on all cores (data/tokenize_stream.h).
#include <fmt/core.h>
#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "app/commands.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/hash.h"
#include "data/bpe_tokenizer.h"
#include "data/dataset.h"
#include "data/tokenize_stream.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

struct TokenizeOptions {
  std::vector<std::string> inputs;
  std::string output;
  std::string tokenizer_dir;
  int threads = 0;
  size_t piece_bytes = 1 << 20;
};

/// Writes ids to stdout as decimal numbers separated by single spaces, as they arrive; finish()
/// ends the line.
class IdPrinter {
 public:
  IdPrinter() { buf_.reserve(kFlushBytes + 64); }
  void add(std::span<const int32_t> ids) {
    for (const int32_t id : ids) {
      if (!first_) buf_.push_back(' ');
      first_ = false;
      const fmt::format_int s(id);
      buf_.append(s.data(), s.size());
      if (buf_.size() >= kFlushBytes) flush();
    }
  }
  void finish() {
    buf_.push_back('\n');
    flush();
    if (std::fflush(stdout) != 0) fail();
  }

 private:
  static constexpr size_t kFlushBytes = 1 << 20;
  [[noreturn]] static void fail() {
    throw RuntimeFailure(
        fmt::format("cannot write the token ids to standard output: {}", std::strerror(errno)));
  }
  void flush() {
    if (!buf_.empty() && std::fwrite(buf_.data(), 1, buf_.size(), stdout) != buf_.size()) fail();
    buf_.clear();
  }
  std::string buf_;
  bool first_ = true;
};

void run_tokenize(const TokenizeOptions& opt) {
  if (opt.threads < 0) {
    throw ConfigError(
        fmt::format("--threads {} is negative: pass a thread count ≥ 1, or 0 for "
                    "all cores",
                    opt.threads));
  }
  const std::vector<fs::path> files = tokenize_inputs(opt.inputs);
  if (!opt.output.empty()) {
    std::error_code ec;
    for (const fs::path& f : files) {
      if (fs::equivalent(f, opt.output, ec)) {
        throw ConfigError(
            fmt::format("--output {} is also an input file: write the token file "
                        "outside the files and directories you tokenize",
                        opt.output));
      }
    }
  }
  const BpeTokenizer tok = opt.tokenizer_dir.empty() ? BpeTokenizer::load_default()
                                                     : BpeTokenizer::load(opt.tokenizer_dir);
  const std::string shown =
      files.size() == 1 ? files[0].string() : fmt::format("{} input files", files.size());
  if (opt.output.empty()) {
    IdPrinter printer;
    encode_files_streaming(
        tok, files, [&](std::span<const int32_t> ids) { printer.add(ids); }, opt.piece_bytes,
        opt.threads);
    printer.finish();
    return;
  }
  TokenFileWriter writer(opt.output, 0, tok.fingerprint());
  std::vector<uint16_t> packed;
  const StreamTokenizeStats stats = encode_files_streaming(
      tok, files,
      [&](std::span<const int32_t> ids) {
        packed.resize(ids.size());
        for (size_t i = 0; i < ids.size(); ++i) {
          if (ids[i] < 0 || ids[i] > 0xFFFF) {
            throw DataError(fmt::format(
                "id {} of {} does not fit the 16-bit token file format: use a tokenizer with at "
                "most 65536 entries",
                ids[i], shown));
          }
          packed[i] = static_cast<uint16_t>(ids[i]);
        }
        writer.append(packed);
      },
      opt.piece_bytes, opt.threads);
  writer.set_source_hash(stats.source_hash);
  writer.finish();
  fmt::print(stderr, "wrote {} tokens to {}\n", writer.count(), opt.output);
}

}  // namespace

void register_tokenize_command(CLI::App& app) {
  auto opt = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize", fmt::format("Encode text files' exact bytes with the GPT-2 tokenizer (streamed, "
                              "on all cores): print the ids on one line, or write a token file "
                              "that {}/{} accept",
                              knob_for(&TrainConfig::train_file).name(),
                              knob_for(&TrainConfig::valid_file).name()));
  cmd->add_option("FILE", opt->inputs,
                  "Text files or directories to tokenize (bytes are taken as they are). A "
                  "directory stands for the regular files directly inside it, sorted by name "
                  "(names starting with '.' skipped). Several files are joined with "
                  "<|endoftext|> (id 50256) between them")
      ->required();
  cmd->add_option("-o,--output", opt->output,
                  "Write a token file (uint16 ids with a checked header) instead of printing");
  cmd->add_option("--tokenizer-dir", opt->tokenizer_dir,
                  "Directory with encoder.json and vocab.bpe (default: the shipped GPT-2 "
                  "tokenizer, or $SHARDTRAIN_TOKENIZER_DIR)");
  cmd->add_option("--threads", opt->threads,
                  "Threads that encode (default 0: all cores, or $OMP_NUM_THREADS); the ids do "
                  "not depend on it");
  cmd->add_option("--piece-bytes", opt->piece_bytes,
                  "Approximate bytes of text per parallel piece (default 1048576); memory is "
                  "about 4 × threads × this; the ids do not depend on it")
      ->check(CLI::Range(size_t{1}, size_t{1} << 30));
  cmd->callback([opt] { run_tokenize(*opt); });
}

}  // namespace shardtrain
