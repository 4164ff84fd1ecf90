// shardtrain: the command-line program. Thin: parses, then calls the library.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>

#include "app/commands.h"
#include "app/error_report.h"
#include "core/error.h"

namespace {

// Debian's OpenBLAS 0.3.21 picks its kernels from the CPU model number, and falls back to its
// slowest (SSE3 "Prescott") kernels on CPUs newer than its table — 4× slower sgemm on a
// Sapphire Rapids VM. The kernel choice is made when the library loads, before main(), so when
// the user has not chosen one we pick it from the CPU's features and re-execute ourselves once.
void select_openblas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const char* core = nullptr;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    core = "SkylakeX";
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    core = "Haswell";
  if (core == nullptr) return;
  setenv("OPENBLAS_CORETYPE", core, 1);
  execv("/proc/self/exe", argv);  // returns only on failure: carry on with the default kernels
}

}  // namespace

int main(int argc, char** argv) {
  select_openblas_kernels(argv);
  shardtrain::install_terminate_handler();
  CLI::App app{
      "shardtrain — train GPT-2-family models on CPUs and GPUs with data parallelism, "
      "ZeRO and pipeline parallelism"};
  app.set_version_flag("--version", std::string("shardtrain ") + SHARDTRAIN_VERSION);
  app.require_subcommand(1);
  shardtrain::register_all_commands(app);
  // Errors end the program here, reported by report_fatal_error (app/error_report.h): one
  // write() per message, and in a job of several ranks an error every rank raises the same way
  // once (by rank 0), while one that differs by rank names its rank.
  using shardtrain::report_fatal_error;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Every rank parses the same command line: a parse error is the same on every rank.
    std::ostringstream out, err;
    const int status = app.exit(e, out, err);
    if (!out.str().empty() && shardtrain::is_first_rank()) {  // --help, --version
      std::fputs(out.str().c_str(), stdout);
      std::fflush(stdout);
    }
    if (!err.str().empty()) report_fatal_error("", err.str(), true);
    return status;
  } catch (...) {
    const shardtrain::FatalError f = shardtrain::classify_exception(std::current_exception());
    report_fatal_error("error: ", f.message, f.same_on_every_rank);
    return f.status;
  }
  return 0;
}
