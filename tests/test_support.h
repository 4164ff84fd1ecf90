// Helpers shared by the test programs: running a command (the shardtrain binary), fresh
// temporary directories and an XML well-formedness check (for the SVG pictures).
#pragma once

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "data/bpe_tokenizer.h"

/// Expects `needle` inside the string `haystack`, printing both when it is not.
#define EXPECT_CONTAINS(haystack, needle)                          \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "expected to find \"" << (needle) << "\" in:\n  " << (haystack)

/// Expects `stmt` to throw an exception of type `type` whose message contains `needle`.
#define EXPECT_THROW_MSG(stmt, type, needle)               \
  do {                                                     \
    bool thrown_ = false;                                  \
    try {                                                  \
      stmt;                                                \
    } catch (const type& e_) {                             \
      thrown_ = true;                                      \
      EXPECT_CONTAINS(e_.what(), needle);                  \
    }                                                      \
    EXPECT_TRUE(thrown_) << #stmt " did not throw " #type; \
  } while (0)

namespace shardtrain::test_support {

/// A fresh directory under the system temp directory (named after the process and the running
/// test), removed with its contents at the end.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("shardtrain_test_{}_{}_{}_{}", ::getpid(),
                        info ? info->test_suite_name() : "x", info ? info->name() : "x", counter++);
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

/// The whole content of file `p` ("" when it cannot be read).
inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// The GPT-2 BPE tokenizer of the build's data (loaded once per test program).
inline const BpeTokenizer& gpt2_tokenizer() {
  static const BpeTokenizer tok = BpeTokenizer::load_default();
  return tok;
}

/// Writes `bytes` to `p` (replacing it); fails the test when the write fails.
inline void write_bytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << p;
}

struct CommandResult {
  int status = -1;
  std::string output;  ///< stdout and stderr together
};

/// Runs `cmd` through the shell, collecting its output and exit status.
inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

#ifdef SHARDTRAIN_BINARY
/// `shardtrain ARGS` with stderr joined to stdout.
inline CommandResult run_shardtrain(const std::string& args) {
  return run_command(std::string(SHARDTRAIN_BINARY) + " " + args + " 2>&1");
}
#endif

/// A new empty directory under the system's temporary directory, unique per process and call.
inline std::filesystem::path make_temp_dir(const std::string& prefix) {
  static std::atomic<int> counter{0};
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    fmt::format("{}_{}_{}", prefix, ::getpid(), counter++);
  std::filesystem::create_directories(dir);
  return dir;
}

/// Why `xml` is not a well-formed XML document with root element `root` ("" when it is): every
/// start tag closed in order (or self-closing), attribute values quoted, no raw '<' or stray '&' in
/// text, nothing but whitespace and comments around the root. Enough for the SVG this project
/// writes; not a validating parser (no DTDs, CDATA or entity definitions).
inline std::string xml_problem(const std::string& xml, const std::string& root) {
  std::vector<std::string> open;
  bool root_done = false;
  size_t i = 0;
  const auto name_at = [&](size_t p) {
    size_t e = p;
    while (e < xml.size() && (std::isalnum(static_cast<unsigned char>(xml[e])) || xml[e] == '-' ||
                              xml[e] == '_' || xml[e] == ':' || xml[e] == '.'))
      ++e;
    return xml.substr(p, e - p);
  };
  while (i < xml.size()) {
    if (xml[i] != '<') {
      if (xml[i] == '&') {
        const size_t semi = xml.find(';', i);
        const std::string ent = semi == std::string::npos ? "" : xml.substr(i, semi - i + 1);
        if (ent != "&lt;" && ent != "&gt;" && ent != "&amp;" && ent != "&quot;" &&
            ent != "&apos;" && ent.rfind("&#", 0) != 0)
          return fmt::format("stray '&' at offset {}", i);
      }
      if (open.empty() && !std::isspace(static_cast<unsigned char>(xml[i])))
        return fmt::format("text outside the root element at offset {}", i);
      ++i;
      continue;
    }
    if (xml.compare(i, 4, "<!--") == 0 || xml.compare(i, 2, "<?") == 0) {
      const bool comment = xml[i + 1] == '!';
      const size_t e = xml.find(comment ? "-->" : "?>", i);
      if (e == std::string::npos) return fmt::format("unterminated comment at offset {}", i);
      i = e + (comment ? 3 : 2);
      continue;
    }
    const bool closing = i + 1 < xml.size() && xml[i + 1] == '/';
    const std::string name = name_at(i + (closing ? 2 : 1));
    if (name.empty()) return fmt::format("'<' without a tag name at offset {}", i);
    size_t p = i + (closing ? 2 : 1) + name.size();
    char quote = 0;  // skip to the tag's '>', outside quoted attribute values
    for (; p < xml.size() && (quote || xml[p] != '>'); ++p) {
      if (quote && xml[p] == quote)
        quote = 0;
      else if (!quote && (xml[p] == '"' || xml[p] == '\''))
        quote = xml[p];
      else if (!quote && xml[p] == '<')
        return fmt::format("'<' inside the tag <{}> at offset {}", name, p);
    }
    if (p >= xml.size()) return fmt::format("unterminated tag <{}> at offset {}", name, i);
    const bool self_closing = !closing && xml[p - 1] == '/';
    if (closing) {
      if (open.empty() || open.back() != name)
        return fmt::format("</{}> at offset {} closes {}", name, i,
                           open.empty() ? "nothing" : "<" + open.back() + ">");
      open.pop_back();
      if (open.empty()) root_done = true;
    } else {
      if (open.empty() && (root_done || name != root))
        return fmt::format("element <{}> at offset {} where the one root <{}> belongs", name, i,
                           root);
      if (!self_closing)
        open.push_back(name);
      else if (open.empty())
        root_done = true;
    }
    i = p + 1;
  }
  if (!open.empty()) return fmt::format("<{}> is never closed", open.back());
  if (!root_done) return fmt::format("no <{}> root element", root);
  return "";
}

}  // namespace shardtrain::test_support
