// Helpers shared by the test programs: running a command (the shardtrain binary) and fresh
// temporary directories.
#pragma once

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <string>

/// Expects `needle` inside the string `haystack`, printing both when it is not.
#define EXPECT_CONTAINS(haystack, needle)                          \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "expected to find \"" << (needle) << "\" in:\n  " << (haystack)

namespace shardtrain::test_support {

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

}  // namespace shardtrain::test_support
