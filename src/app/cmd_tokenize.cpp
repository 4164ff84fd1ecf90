// `shardtrain tokenize FILE [--output OUT.bin] [--tokenizer-dir DIR]`: GPT-2 BPE ids of a file.
#include <fmt/core.h>
#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "app/commands.h"
#include "core/error.h"
#include "core/hash.h"
#include "data/bpe_tokenizer.h"
#include "data/dataset.h"

namespace shardtrain {
namespace {

struct TokenizeOptions {
  std::string file;
  std::string output;
  std::string tokenizer_dir;
};

/// Reads the exact bytes of `path`. Throws DataError naming the file.

/// Writes `ids` to stdout as decimal numbers separated by single spaces, then one "\n".
void print_ids(const std::vector<int32_t>& ids) {
  std::string buf;
  constexpr size_t kFlushBytes = 1 << 20;
  buf.reserve(kFlushBytes + 64);
  auto flush = [&buf] {
    if (!buf.empty() && std::fwrite(buf.data(), 1, buf.size(), stdout) != buf.size()) {
      throw RuntimeFailure(
          fmt::format("cannot write the token ids to standard output: {}", std::strerror(errno)));
    }
    buf.clear();
  };
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i != 0) buf.push_back(' ');
    const fmt::format_int s(ids[i]);
    buf.append(s.data(), s.size());
    if (buf.size() >= kFlushBytes) flush();
  }
  buf.push_back('\n');
  flush();
  if (std::fflush(stdout) != 0) {
    throw RuntimeFailure(
        fmt::format("cannot write the token ids to standard output: {}", std::strerror(errno)));
  }
}

void run_tokenize(const TokenizeOptions& opt) {
  const BpeTokenizer tok = opt.tokenizer_dir.empty() ? BpeTokenizer::load_default()
                                                     : BpeTokenizer::load(opt.tokenizer_dir);
  const std::string text = read_all_bytes(opt.file, "input file");
  const std::vector<int32_t> ids = encode_parallel(tok, text);
  if (opt.output.empty()) {
    print_ids(ids);
    return;
  }
  std::vector<uint16_t> packed(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > 0xFFFF) {
      throw DataError(fmt::format(
          "id {} of {} does not fit the 16-bit token file format: use a tokenizer with at most "
          "65536 entries",
          ids[i], opt.file));
    }
    packed[i] = static_cast<uint16_t>(ids[i]);
  }
  write_token_file(opt.output, packed, fnv1a64(text), tok.fingerprint());
  fmt::print(stderr, "wrote {} tokens to {}\n", packed.size(), opt.output);
}

}  // namespace

void register_tokenize_command(CLI::App& app) {
  auto opt = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize",
      "Encode a file's exact bytes with the GPT-2 tokenizer: print the ids on one line, or "
      "write a token file that --train-file/--valid-file accept");
  cmd->add_option("FILE", opt->file, "Text file to tokenize (bytes are taken as they are)")
      ->required();
  cmd->add_option("-o,--output", opt->output,
                  "Write a token file (uint16 ids with a checked header) instead of printing");
  cmd->add_option("--tokenizer-dir", opt->tokenizer_dir,
                  "Directory with encoder.json and vocab.bpe (default: the shipped GPT-2 "
                  "tokenizer, or $SHARDTRAIN_TOKENIZER_DIR)");
  cmd->callback([opt] { run_tokenize(*opt); });
}

}  // namespace shardtrain
