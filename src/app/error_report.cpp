// The error report of a process of a job (app/error_report.h).
#include "app/error_report.h"

#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <thread>

#include "comm/dist_env.h"
#include "config/knob.h"
#include "core/error.h"

namespace shardtrain {
namespace {

double g_grace_s = 5;

/// Whether `message` begins with "rank N: " (it names its rank itself, as the communicators'
/// timeout messages do).
bool names_its_rank(std::string_view message) {
  constexpr std::string_view kRank = "rank ";
  if (message.substr(0, kRank.size()) != kRank) return false;
  size_t i = kRank.size();
  const size_t digits = i;
  while (i < message.size() && std::isdigit(static_cast<unsigned char>(message[i]))) ++i;
  return i > digits && message.substr(i, 2) == ": ";
}

struct RankOfJob {
  int rank = 0, world = 1;
};

RankOfJob rank_of_job() {
  try {
    const DistributedEnv env = read_distributed_env();
    return {env.rank, env.world_size};
  } catch (...) {
    return {};  // malformed variables: report as a single process
  }
}

/// `message` fit for a terminal and a log: control bytes other than line ends escaped (\xNN),
/// and each line cut to kMaxLine bytes with its length said: the last guard for input that
/// reached a message unbounded.
std::string bounded_message(std::string_view message) {
  constexpr size_t kMaxLine = 4096;
  std::string out;
  size_t line = 0;
  for (size_t i = 0; i < message.size(); ++i) {
    const auto c = static_cast<unsigned char>(message[i]);
    if (c == '\n') {
      out.push_back('\n');
      line = 0;
      continue;
    }
    if (line == kMaxLine) {
      const size_t end = message.find('\n', i);
      const size_t rest = (end == std::string_view::npos ? message.size() : end) - i;
      out += "... (" + std::to_string(kMaxLine + rest) + " bytes)";
      i += rest - 1;
      line = kMaxLine + 1;
      continue;
    }
    if (line > kMaxLine) continue;
    if (c < 0x20 || c == 0x7F) {
      static constexpr char kHex[] = "0123456789abcdef";
      out.push_back('\\');
      if (c == '\t') {
        out.push_back('t');
      } else {
        out.push_back('x');
        out.push_back(kHex[c >> 4]);
        out.push_back(kHex[c & 15]);
      }
    } else {
      out.push_back(static_cast<char>(c));
    }
    ++line;
  }
  return out;
}

}  // namespace

ErrorReport plan_error_report(std::string_view lead, std::string_view message,
                              bool same_on_every_rank, int rank, int world, double grace_s) {
  ErrorReport r;
  r.text = std::string(lead);
  if (world > 1 && !(rank == 0 && same_on_every_rank) && !names_its_rank(message))
    r.text += "rank " + std::to_string(rank) + ": ";
  r.text += bounded_message(message);
  if (r.text.empty() || r.text.back() != '\n') r.text += '\n';
  r.delay_s = world > 1 && rank != 0 ? std::max(0.0, grace_s) : 0.0;
  return r;
}

void set_error_report_grace(double seconds) { g_grace_s = std::max(0.0, seconds); }

double error_report_grace_s() { return g_grace_s; }

void report_fatal_error(std::string_view lead, std::string_view message, bool same_on_every_rank) {
  try {
    const RankOfJob job = rank_of_job();
    const ErrorReport r =
        plan_error_report(lead, message, same_on_every_rank, job.rank, job.world, g_grace_s);
    // A launcher that saw rank 0 fail stops this process during the wait (SIGTERM).
    if (r.delay_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(r.delay_s));
    write_to_stderr(r.text);
  } catch (...) {
    write_to_stderr("error: (the error could not be reported)\n");
  }
}

std::string memory_remedy(Memory memory) {
  const std::string batch = knob_for(&TrainConfig::micro_batch_size).name();
  const std::string max_length = knob_for(&TrainConfig::max_length).name();
  switch (memory) {
    case Memory::kGpu:
      return fmt::format(
          "Fix: lower {} or {}, enable {}, or use a ZeRO strategy ({} zero2/zero3) or offload",
          batch, max_length, knob_for(&TrainConfig::activation_checkpointing).name(),
          knob_for(&TrainConfig::strategy_name).name());
    case Memory::kHost:
      return fmt::format("use a smaller model, {} or {} (or check {} and the images' sizes)", batch,
                         max_length, knob_for(&TrainConfig::image_size).name());
    case Memory::kPinnedHost:
      return fmt::format("or offload less ({} < 1, more ranks), or to NVMe ({} \"nvme\")",
                         zero_knob(&ZeroConfig::offload_ratio).label(),
                         zero_knob(&ZeroConfig::offload_optimizer_device).path);
  }
  return {};
}

namespace {

// The message of an OutOfMemory (or std::bad_alloc) with the remedy after it, or the message
// alone if the remedy cannot be built (no memory left even for that).
std::string with_remedy(const std::string& what, Memory memory) {
  try {
    const char* joint = memory == Memory::kGpu ? "." : memory == Memory::kHost ? ";" : ",";
    return fmt::format("{}{} {}", what, joint, memory_remedy(memory));
  } catch (...) {
    return what;
  }
}

}  // namespace

FatalError classify_exception(const std::exception_ptr& e) {
  FatalError f;
  try {
    std::rethrow_exception(e);
  } catch (const ConfigError& x) {
    f = {2, x.what(), x.same_on_every_rank()};
  } catch (const DataError& x) {
    f = {2, x.what(), x.same_on_every_rank()};
  } catch (const CheckpointError& x) {
    f = {2, x.what(), x.same_on_every_rank()};
  } catch (const OutOfMemory& x) {
    f = {1, with_remedy(x.what(), x.memory()), x.same_on_every_rank()};
  } catch (const DeviceUnavailable& x) {
    f = {1, fmt::format("{}, or use {} cpu", x.what(), knob_for(&TrainConfig::device).name()),
         x.same_on_every_rank()};
  } catch (const Error& x) {
    f = {1, x.what(), x.same_on_every_rank()};
  } catch (const std::bad_alloc&) {
    f = {1, with_remedy("out of host memory", Memory::kHost), false};
  } catch (const std::exception& x) {
    f = {1, x.what(), false};
  } catch (...) {
    f = {1, "an unknown exception (a bug in shardtrain: please report it)", false};
  }
  return f;
}

namespace {

[[noreturn]] void on_terminate() {
  static std::atomic<bool> entered{false};
  if (entered.exchange(true)) std::abort();  // a second thread, or the handler itself failed
  const std::exception_ptr e = std::current_exception();
  if (!e) {
    write_to_stderr(
        "error: std::terminate was called without an exception (a bug in shardtrain: please "
        "report it)\n");
    std::abort();
  }
  const FatalError f = classify_exception(e);
  std::fflush(stdout);
  report_fatal_error("error: ", f.message, f.same_on_every_rank);
  std::_Exit(f.status);
}

}  // namespace

void install_terminate_handler() { std::set_terminate(on_terminate); }

bool is_first_rank() {
  const RankOfJob job = rank_of_job();
  return job.world <= 1 || job.rank == 0;
}

void write_to_stderr(std::string_view text) {
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // nowhere to report it
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace shardtrain
