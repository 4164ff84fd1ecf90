// "Install anywhere": `cmake --install` to a temporary prefix, the prefix moved elsewhere, and the
// installed program finds its data (GPT-2 tokenizer, WikiText-2) relative to itself — not in the
// build tree, whose paths are not compiled into it — and runs a short training job.
// $SHARDTRAIN_DATA_DIR overrides the lookup for the data sets and the tokenizer alike; without any
// data the error names where the program looked and the fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "test_support.h"

namespace fs = std::filesystem;
using shardtrain::test_support::CommandResult;
using shardtrain::test_support::make_temp_dir;
using shardtrain::test_support::run_command;

namespace {

// `cd DIR && env -u ... BINARY ARGS 2>&1`: the variables that would redirect the lookup unset.
CommandResult run_in(const fs::path& dir, const fs::path& binary, const std::string& args,
                     const std::string& env = "") {
  return run_command(fmt::format(
      "cd '{}' && env -u SHARDTRAIN_DATA_DIR -u SHARDTRAIN_TOKENIZER_DIR {} '{}' {} 2>&1",
      dir.string(), env, binary.string(), args));
}

class Install : public ::testing::Test {
 protected:
  // One install per test program: to a temporary prefix, then moved, so that nothing can depend
  // on the prefix it was installed to.
  static void SetUpTestSuite() {
    // Canonical: the program reports paths from /proc/self/exe.
    root_ = new fs::path(fs::canonical(make_temp_dir("shardtrain_install")));
    const fs::path staged = *root_ / "staged";
    const CommandResult r =
        run_command(fmt::format("'{}' --install '{}' --prefix '{}' 2>&1", SHARDTRAIN_CMAKE,
                                SHARDTRAIN_BUILD_DIR, staged.string()));
    install_output_ = new std::string(r.output);
    install_status_ = r.status;
    fs::create_directories(*root_ / "moved");
    if (r.status == 0) fs::rename(staged, prefix());
    fs::create_directories(*root_ / "elsewhere");
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(*root_, ec);
    delete root_;
    delete install_output_;
  }
  void SetUp() override { ASSERT_EQ(install_status_, 0) << *install_output_; }

  static fs::path prefix() { return *root_ / "moved" / "prefix"; }
  static fs::path binary() { return prefix() / "bin" / "shardtrain"; }
  static fs::path elsewhere() { return *root_ / "elsewhere"; }

  static fs::path* root_;
  static std::string* install_output_;
  static int install_status_;
};
fs::path* Install::root_ = nullptr;
std::string* Install::install_output_ = nullptr;
int Install::install_status_ = -1;

TEST_F(Install, LaysOutProgramAndData) {
  EXPECT_TRUE(fs::is_regular_file(binary()));
  const fs::path data = prefix() / "share" / "shardtrain" / "data";
  for (const char* f :
       {"gpt2-tokenizer/encoder.json", "gpt2-tokenizer/vocab.bpe", "wikitext-2/wiki.train.tokens",
        "wikitext-2/wiki.valid.tokens", "wikitext-2/LICENSE.md"})
    EXPECT_TRUE(fs::is_regular_file(data / f)) << data / f;
}

TEST_F(Install, NoBuildMachinePathCompiledIn) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "a sanitizer build keeps the source paths of UBSan's diagnostics (GCC does not "
                  "map them with -ffile-prefix-map); the release build is checked";
#endif
  std::ifstream in(binary(), std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(bytes.empty());
  for (const std::string& path :
       {std::string(SHARDTRAIN_SOURCE_DIR) + "/src/", std::string(SHARDTRAIN_BUILD_DIR) + "/data"})
    EXPECT_EQ(bytes.find(path), std::string::npos) << path << " is in " << binary();
}

TEST_F(Install, FindsItsOwnDataAndTrains) {
  const CommandResult where = run_in(elsewhere(), binary(), "data-dir");
  ASSERT_EQ(where.status, 0) << where.output;
  const fs::path data = prefix() / "share" / "shardtrain" / "data";
  EXPECT_EQ(where.output.substr(0, where.output.find('\n')), data.string()) << where.output;
  EXPECT_CONTAINS(where.output, "installed tree");

  const fs::path out = *root_ / "run";
  const CommandResult r = run_in(
      elsewhere(), binary(),
      fmt::format("train --model gpt2-tiny --dataset wikitext-2 --max-steps 2 --batch-size 2 "
                  "--max-length 32 --eval-samples 8 --device cpu --no-save --output-dir '{}'",
                  out.string()));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find(SHARDTRAIN_BUILD_DIR), std::string::npos) << r.output;
}

TEST_F(Install, DataDirVariableOverridesDataAndTokenizer) {
  const fs::path custom = *root_ / "custom";
  const fs::path installed = prefix() / "share" / "shardtrain" / "data";
  fs::create_directories(custom / "wikitext-2");
  fs::copy(installed / "gpt2-tokenizer", custom / "gpt2-tokenizer");
  // A small "WikiText-2": its validation split as the training text.
  fs::copy_file(installed / "wikitext-2" / "wiki.valid.tokens",
                custom / "wikitext-2" / "wiki.train.tokens");
  fs::copy_file(installed / "wikitext-2" / "wiki.test.tokens",
                custom / "wikitext-2" / "wiki.valid.tokens");
  const std::string env = fmt::format("SHARDTRAIN_DATA_DIR='{}'", custom.string());

  const CommandResult where = run_in(elsewhere(), binary(), "data-dir", env);
  ASSERT_EQ(where.status, 0) << where.output;
  EXPECT_EQ(where.output.substr(0, where.output.find('\n')), custom.string()) << where.output;
  EXPECT_CONTAINS(where.output, "SHARDTRAIN_DATA_DIR");

  const fs::path out = *root_ / "run_custom";
  const std::string train = fmt::format(
      "train --model gpt2-tiny --dataset wikitext-2 --max-steps 2 --batch-size 2 --max-length 32 "
      "--eval-samples 8 --device cpu --no-save --output-dir '{}'",
      out.string());
  const CommandResult r = run_in(elsewhere(), binary(), train, env);
  EXPECT_EQ(r.status, 0) << r.output;

  // The tokenizer comes from the same directory: without it there, training stops and says so.
  fs::remove_all(custom / "gpt2-tokenizer");
  const CommandResult no_tok = run_in(elsewhere(), binary(), train, env);
  EXPECT_EQ(no_tok.status, 2) << no_tok.output;
  EXPECT_CONTAINS(no_tok.output, (custom / "gpt2-tokenizer").string());
  EXPECT_CONTAINS(no_tok.output, "SHARDTRAIN_DATA_DIR");
}

TEST_F(Install, MissingDataNamesWhereItLookedAndTheFix) {
  // The program alone, without its share/ tree.
  const fs::path lonely = *root_ / "lonely";
  fs::create_directories(lonely / "bin");
  fs::copy_file(binary(), lonely / "bin" / "shardtrain");
  const fs::path bin = lonely / "bin" / "shardtrain";
  for (const std::string& args :
       {std::string("data-dir"),
        fmt::format("train --model gpt2-tiny --dataset wikitext-2 --max-steps 1 --device cpu "
                    "--no-save --output-dir '{}'",
                    (*root_ / "run_lonely").string())}) {
    const CommandResult r = run_in(elsewhere(), bin, args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    EXPECT_CONTAINS(r.output, (lonely / "share" / "shardtrain" / "data").string());
    EXPECT_CONTAINS(r.output, (lonely / "bin" / "data").string());
    EXPECT_CONTAINS(r.output, "$SHARDTRAIN_DATA_DIR (unset)");
    EXPECT_CONTAINS(r.output, "cmake --install");
    EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  }
}

}  // namespace
