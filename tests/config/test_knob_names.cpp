// A knob is written in one place: no knob's name appears in the string literals of more than 3
// source files of src/ — its row, where it is used, and at most one rule that crosses sections
// (config/validate.cpp). Everywhere else a message names a knob through its row
// (knob_for(...).name(), .path, .label()), so renaming a flag or a key is a one-row change.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "config/knob.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

// The contents of the string literals of C++ source `text`, comments skipped ("...", R"(...)";
// character literals and the text of comments are not literals).
std::vector<std::string> string_literals(const std::string& text) {
  std::vector<std::string> out;
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const char c = text[i];
    if (c == '/' && i + 1 < n && text[i + 1] == '/') {
      i = text.find('\n', i);
      if (i == std::string::npos) break;
    } else if (c == '/' && i + 1 < n && text[i + 1] == '*') {
      i = text.find("*/", i + 2);
      if (i == std::string::npos) break;
      i += 2;
    } else if (c == 'R' && i + 1 < n && text[i + 1] == '"' &&
               (i == 0 ||
                !(std::isalnum(static_cast<unsigned char>(text[i - 1])) || text[i - 1] == '_'))) {
      const size_t open = text.find('(', i + 2);
      if (open == std::string::npos) break;
      const std::string close = ")" + text.substr(i + 2, open - i - 2) + "\"";
      const size_t end = text.find(close, open + 1);
      if (end == std::string::npos) break;
      out.push_back(text.substr(open + 1, end - open - 1));
      i = end + close.size();
    } else if (c == '"' || c == '\'') {
      std::string lit;
      ++i;
      while (i < n && text[i] != c && text[i] != '\n') {
        if (text[i] == '\\' && i + 1 < n) lit += text[i++];
        lit += text[i++];
      }
      if (c == '"') out.push_back(lit);
      ++i;
    } else {
      ++i;
    }
  }
  return out;
}

bool is_word(char c, bool flag) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || (flag && c == '-');
}

// Whether `name` occurs in `s` as a whole name: a flag ("--x") not inside a longer flag, a key
// not inside a longer key or after a dot ("stage" is not in "zero_optimization.stage3_x").
bool names(const std::string& s, const std::string& name) {
  const bool flag = name.rfind("--", 0) == 0;
  for (size_t at = s.find(name); at != std::string::npos; at = s.find(name, at + 1)) {
    const bool before_ok = at == 0 || !(is_word(s[at - 1], flag) || (!flag && s[at - 1] == '.'));
    const size_t end = at + name.size();
    const bool after_ok = end >= s.size() || !is_word(s[end], flag);
    if (before_ok && after_ok) return true;
  }
  return false;
}

// How sources spell a row: its flags; its JSON path and aliases in full, by their last two keys
// ("offload_optimizer.ratio"), and by the last key alone where that is a compound name
// ("stage3_prefetch_bucket_size", not "device" or "type", which are words of other texts too).
std::map<std::string, std::set<std::string>> spellings_of_rows() {
  std::map<std::string, std::set<std::string>> out;  // the row's name -> its spellings
  for (const KnobTable* table : all_knob_tables()) {
    for (const Knob& k : *table) {
      std::stringstream flags(k.flag);
      for (std::string f; std::getline(flags, f, ',');)
        if (f.rfind("--", 0) == 0) out[f].insert(f);
      std::vector<std::string> paths;
      if (!k.path.empty()) paths.push_back(k.path);
      for (const std::string& a : k.aliases)
        paths.push_back(k.section().empty() ? a : k.section() + "." + a);
      for (const std::string& p : paths) {
        std::set<std::string>& s = out[p];
        s.insert(p);
        const size_t last = p.rfind('.');
        if (last != std::string::npos) {
          const size_t before = p.rfind('.', last - 1);
          s.insert(before == std::string::npos ? p : p.substr(before + 1));
        }
        const std::string key = last == std::string::npos ? p : p.substr(last + 1);
        if (key.find('_') != std::string::npos) s.insert(key);
      }
    }
  }
  return out;
}

TEST(KnobNames, EachAppearsInAtMostThreeSourceFiles) {
  const fs::path src = fs::path(SHARDTRAIN_SOURCE_DIR) / "src";
  std::map<std::string, std::vector<std::string>> literals;  // file -> its string literals
  for (const auto& e : fs::recursive_directory_iterator(src)) {
    const std::string ext = e.path().extension().string();
    if (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh") continue;
    std::ifstream in(e.path());
    std::stringstream text;
    text << in.rdbuf();
    literals[fs::relative(e.path(), src).string()] = string_literals(text.str());
  }
  ASSERT_GT(literals.size(), 100u) << "no sources under " << src;
  const auto rows = spellings_of_rows();
  ASSERT_GT(rows.size(), 100u);
  std::string over;
  for (const auto& [name, spellings] : rows) {
    std::vector<std::string> files;
    for (const auto& [file, lits] : literals) {
      const bool found = std::any_of(lits.begin(), lits.end(), [&](const std::string& l) {
        return std::any_of(spellings.begin(), spellings.end(),
                           [&](const std::string& s) { return names(l, s); });
      });
      if (found) files.push_back(file);
    }
    if (files.size() > 3) {
      over += "\n  " + name + " in " + std::to_string(files.size()) + " files:";
      for (const std::string& f : files) over += " " + f;
    }
  }
  EXPECT_TRUE(over.empty()) << "knob names written out in more than 3 source files (name them "
                               "through their rows, knob_for(...).name() / .path / .label()):"
                            << over;
}

TEST(KnobNames, TheScanSeesLiteralsNotComments) {
  const std::string text =
      "// \"--in-a-comment\"\n/* \"--in-a-block\" */ f(\"--batch-size\", 'x', R\"(raw \"q\")\");"
      "g(\"esc \\\" --lr\");";
  const std::vector<std::string> lits = string_literals(text);
  ASSERT_EQ(lits.size(), 3u);
  EXPECT_EQ(lits[0], "--batch-size");
  EXPECT_EQ(lits[1], "raw \"q\"");
  EXPECT_TRUE(names(lits[2], "--lr"));
  EXPECT_FALSE(names("--lr-schedule", "--lr"));
  EXPECT_FALSE(names("zero_optimization.stage3_x", "stage3_x"));
  EXPECT_TRUE(names("set zero_optimization.stage to 3", "zero_optimization.stage"));
}

}  // namespace
}  // namespace shardtrain
