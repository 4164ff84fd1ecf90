// The error report of a process of a job (app/error_report.h).
#include "app/error_report.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <thread>

#include "comm/dist_env.h"

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

}  // namespace

ErrorReport plan_error_report(std::string_view lead, std::string_view message,
                              bool same_on_every_rank, int rank, int world, double grace_s) {
  ErrorReport r;
  r.text = std::string(lead);
  if (world > 1 && !(rank == 0 && same_on_every_rank) && !names_its_rank(message))
    r.text += "rank " + std::to_string(rank) + ": ";
  r.text += message;
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
