#include "comm/launch.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/process.h"
#include "core/strings.h"

extern char** environ;

namespace shardtrain {
namespace {

using Clock = std::chrono::steady_clock;

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

/// Variables a job's processes on other nodes should see as on this one.
bool forwarded(const std::string& name) {
  for (const char* prefix : {"NCCL_", "SHARDTRAIN_", "OMP_", "OPENBLAS_", "UCX_"})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

std::vector<std::pair<std::string, std::string>> forwarded_env() {
  std::vector<std::pair<std::string, std::string>> out;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    const std::string name = kv.substr(0, eq);
    if (forwarded(name) && name.rfind("SHARDTRAIN_LAUNCHER", 0) != 0)
      out.emplace_back(name, kv.substr(eq + 1));
  }
  return out;
}

/// The argv of a rank: the program itself (exec) or `self_exe` + the shardtrain subcommand.
std::vector<std::string> rank_argv(const LaunchPlan& plan, const std::string& self_exe) {
  std::vector<std::string> argv;
  if (!plan.exec) argv.push_back(self_exe);
  argv.insert(argv.end(), plan.command.begin(), plan.command.end());
  return argv;
}

}  // namespace

std::pair<int, int> parse_nnodes(const std::string& value) {
  const auto number = [&](const std::string& part) {
    const std::string t = trim(part);
    const bool digits =
        !t.empty() && t.size() <= 6 && t.find_first_not_of("0123456789") == std::string::npos;
    const int n = digits ? std::atoi(t.c_str()) : -1;
    check<ConfigError>(n >= 1 && n <= 65536,
                       "--nnodes '{}': expected N or MIN:MAX, whole numbers with 1 ≤ MIN ≤ MAX ≤ "
                       "65536 (e.g. --nnodes 2, or --nnodes 1:4 to run on 1 to 4 nodes)",
                       value);
    return n;
  };
  const size_t colon = value.find(':');
  if (colon == std::string::npos) {
    const int n = number(value);
    return {n, n};
  }
  const int lo = number(value.substr(0, colon));
  const int hi = number(value.substr(colon + 1));
  check<ConfigError>(lo <= hi,
                     "--nnodes '{}': MIN {} is above MAX {}: give --nnodes MIN:MAX with MIN ≤ MAX "
                     "(e.g. --nnodes {}:{})",
                     value, lo, hi, hi, lo);
  return {lo, hi};
}

std::vector<ChildSpec> rank_processes(const LaunchPlan& plan, const std::string& self_exe) {
  const int local = plan.nproc_per_node;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<ChildSpec> out;
  for (int l = 0; l < local; ++l) {
    const int rank = plan.first_rank() + l;
    ChildSpec c;
    c.label = fmt::format("rank {}", rank);
    c.argv = rank_argv(plan, self_exe);
    c.env = {{"RANK", std::to_string(rank)},
             {"WORLD_SIZE", std::to_string(plan.total_ranks())},
             {"LOCAL_RANK", std::to_string(l)},
             {"LOCAL_WORLD_SIZE", std::to_string(local)},
             {"GROUP_RANK", std::to_string(plan.node_rank)},
             {"NODE_RANK", std::to_string(plan.node_rank)},
             {"MASTER_ADDR", plan.master_addr},
             {"MASTER_PORT", std::to_string(plan.master_port)},
             {"SHARDTRAIN_LAUNCHER", "shardtrain-launch"}};
    if (std::getenv("NCCL_NVLS_ENABLE") == nullptr) c.env.emplace_back("NCCL_NVLS_ENABLE", "0");
    if (std::getenv("OMP_NUM_THREADS") == nullptr)
      c.env.emplace_back("OMP_NUM_THREADS", std::to_string(std::max(1, cores / local)));
    if (plan.comm_timeout_s > 0)
      c.env.emplace_back("SHARDTRAIN_COMM_TIMEOUT", fmt::format("{:g}", plan.comm_timeout_s));
    out.push_back(std::move(c));
  }
  return out;
}

std::vector<std::string> mpirun_command(const LaunchPlan& plan, const std::vector<HostSlots>& hosts,
                                        const std::string& mpirun, const std::string& self_exe) {
  std::vector<std::string> argv = {mpirun};
  if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
  // Ranks run OpenMP threads: binding each to one core (mpirun's default for ≤ 2 ranks) would
  // put all of a rank's threads on that core.
  argv.insert(argv.end(), {"--bind-to", "none"});
  int total = plan.nproc_per_node;
  if (hosts.empty()) {
    argv.push_back("--oversubscribe");
  } else {
    std::string list;
    total = 0;
    for (const auto& h : hosts) {
      if (!list.empty()) list += ",";
      list += fmt::format("{}:{}", h.host, h.slots);
      total += h.slots;
    }
    argv.insert(argv.end(), {"-H", list});
  }
  argv.insert(argv.end(), {"-np", std::to_string(total)});
  std::vector<std::string> names;
  for (const auto& [name, value] : forwarded_env()) names.push_back(name);
  if (plan.comm_timeout_s > 0) names.push_back("SHARDTRAIN_COMM_TIMEOUT");
  if (std::getenv("OMP_NUM_THREADS") == nullptr && hosts.empty())
    names.push_back("OMP_NUM_THREADS");
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  for (const auto& n : names) argv.insert(argv.end(), {"-x", n});
  const auto rest = rank_argv(plan, self_exe);
  argv.insert(argv.end(), rest.begin(), rest.end());
  return argv;
}

bool is_local_host(const std::string& host) {
  if (host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0) return true;
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return false;
  const std::string me = name;
  return host == me || host == me.substr(0, me.find('.'));
}

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789_-./=:,+@%") == std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::vector<ChildSpec> node_processes(const LaunchPlan& plan, const std::vector<HostSlots>& hosts,
                                      const std::string& self_exe, const std::string& cwd,
                                      const std::vector<std::string>& ssh) {
  int world = 0;
  for (const auto& h : hosts) world += h.slots;
  std::vector<ChildSpec> out;
  int offset = 0;
  for (size_t i = 0; i < hosts.size(); ++i) {
    const HostSlots& h = hosts[i];
    std::vector<std::string> args = {self_exe,           "launch",
                                     "--nproc-per-node", std::to_string(h.slots),
                                     "--nnodes",         std::to_string(hosts.size()),
                                     "--node-rank",      std::to_string(i),
                                     "--rank-offset",    std::to_string(offset),
                                     "--world-size",     std::to_string(world),
                                     "--master-addr",    plan.master_addr,
                                     "--master-port",    std::to_string(plan.master_port),
                                     "--watch-stdin"};
    if (plan.comm_timeout_s > 0)
      args.insert(args.end(), {"--comm-timeout", fmt::format("{:g}", plan.comm_timeout_s)});
    if (plan.exec) args.push_back("--exec");
    args.push_back("--");
    args.insert(args.end(), plan.command.begin(), plan.command.end());
    ChildSpec c;
    c.label = fmt::format("node {} ({})", i, h.host);
    c.stdin_pipe = true;
    if (is_local_host(h.host)) {
      c.argv = std::move(args);
    } else {
      std::string remote = fmt::format("cd {} && exec env", shell_quote(cwd));
      for (const auto& [name, value] : forwarded_env())
        remote += fmt::format(" {}", shell_quote(name + "=" + value));
      for (const auto& a : args) remote += fmt::format(" {}", shell_quote(a));
      c.argv = ssh;
      c.argv.push_back(h.host);
      c.argv.push_back(remote);
    }
    out.push_back(std::move(c));
    offset += h.slots;
  }
  return out;
}

// ---- the monitor ----------------------------------------------------------------------------

namespace {

volatile sig_atomic_t g_signal = 0;

void on_signal(int sig) { g_signal = sig; }

struct Running {
  pid_t pid = -1;
  int stdin_fd = -1;  ///< write end of the stdin pipe
  bool alive = false;
};

/// "exited with status 1", "was killed by signal 9 (Killed)".
std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status),
                       strsignal(WTERMSIG(status)));
  return "stopped";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

/// Builds "NAME=VALUE" strings: the launcher's environment with `overrides` applied.
std::vector<std::string> child_environment(
    const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::map<std::string, std::string> env;
  std::vector<std::string> order;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    if (env.emplace(kv.substr(0, eq), kv.substr(eq + 1)).second) order.push_back(kv.substr(0, eq));
  }
  for (const auto& [k, v] : overrides) {
    if (env.find(k) == env.end()) order.push_back(k);
    env[k] = v;
  }
  std::vector<std::string> out;
  for (const auto& k : order) out.push_back(k + "=" + env[k]);
  return out;
}

/// Sends `sig` to every live process group, waits up to `grace_s` for them to exit, then
/// SIGKILLs the rest; reaps them all. Returns how many were running.
int stop_all(std::vector<Running>& procs, int sig, double grace_s) {
  int n = 0;
  for (auto& p : procs)
    if (p.alive) {
      ++n;
      if (::killpg(p.pid, sig) != 0) ::kill(p.pid, sig);
    }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(grace_s));
  for (;;) {
    bool any = false;
    for (auto& p : procs) {
      if (!p.alive) continue;
      int st = 0;
      if (::waitpid(p.pid, &st, WNOHANG) == p.pid) {
        p.alive = false;
        ::killpg(p.pid, SIGKILL);  // leftovers of its process group (e.g. a shell's children)
      } else {
        any = true;
      }
    }
    if (!any) break;
    if (Clock::now() >= deadline) {
      for (auto& p : procs) {
        if (!p.alive) continue;
        if (::killpg(p.pid, SIGKILL) != 0) ::kill(p.pid, SIGKILL);
        int st = 0;
        ::waitpid(p.pid, &st, 0);
        p.alive = false;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return n;
}

}  // namespace

MonitorResult run_processes(const std::vector<ChildSpec>& children, const MonitorOptions& options) {
  MonitorResult result;
  g_signal = 0;
  struct sigaction sa {
  }, old_int{}, old_term{}, old_hup{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  ::sigaction(SIGHUP, &sa, &old_hup);
  std::vector<Running> procs(children.size());
  const pid_t launcher = ::getpid();

  for (size_t i = 0; i < children.size(); ++i) {
    const ChildSpec& c = children[i];
    // Everything the child needs is built before fork (no allocation after it).
    const std::vector<std::string> env = child_environment(c.env);
    std::vector<char*> envp, argv;
    for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    for (const auto& a : c.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    int fds[2] = {-1, -1};
    if (c.stdin_pipe && ::pipe2(fds, O_CLOEXEC) != 0) {
      stop_all(procs, SIGTERM, options.grace_s);
      throw RuntimeFailure(fmt::format("launch: pipe() failed: {}", std::strerror(errno)));
    }
    const std::string exec_error = fmt::format("error: launch: cannot run {}", c.argv[0]);
    const pid_t pid = ::fork();
    if (pid < 0) {
      stop_all(procs, SIGTERM, options.grace_s);
      throw RuntimeFailure(fmt::format("launch: fork() failed: {}", std::strerror(errno)));
    }
    if (pid == 0) {
      ::setpgid(0, 0);  // its own process group: stopping it stops its children too
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // the launcher died: stop
      if (::getppid() != launcher) ::_exit(1);
      if (fds[0] >= 0) ::dup2(fds[0], 0);  // dup2 clears O_CLOEXEC on the copy
      ::execvpe(argv[0], argv.data(), envp.data());
      const char* why = std::strerror(errno);
      if (::write(2, exec_error.data(), exec_error.size()) < 0 || ::write(2, ": ", 2) < 0 ||
          ::write(2, why, std::strlen(why)) < 0 || ::write(2, "\n", 1) < 0)
        ::_exit(127);
      ::_exit(127);
    }
    ::setpgid(pid, pid);
    if (fds[0] >= 0) ::close(fds[0]);
    procs[i] = {pid, fds[1], true};
  }

  size_t alive = procs.size();
  while (alive > 0) {
    if (g_signal != 0) {
      const int sig = g_signal;
      const int n = stop_all(procs, sig, options.grace_s);
      result.status = 128 + sig;
      result.interrupted = true;
      result.description = fmt::format("launch was interrupted by signal {} ({}); stopped {} {}{}",
                                       sig, strsignal(sig), n, options.unit, n == 1 ? "" : "s");
      break;
    }
    if (options.should_stop) {
      if (const std::optional<StopRequest> req = options.should_stop()) {
        const int n = stop_all(procs, SIGTERM, options.grace_s);
        result.status = req->status;
        result.stopped = true;
        result.description =
            fmt::format("{}; stopped {} {}{}", req->reason, n, options.unit, n == 1 ? "" : "s");
        break;
      }
    }
    if (options.watch_stdin) {
      pollfd p{0, POLLIN, 0};
      if (::poll(&p, 1, 0) == 1) {
        char buf[256];
        const ssize_t k = (p.revents & (POLLIN | POLLHUP)) ? ::read(0, buf, sizeof buf) : 1;
        if (k == 0 || (p.revents & (POLLERR | POLLNVAL))) {
          const int n = stop_all(procs, SIGTERM, options.grace_s);
          result.status = 1;
          result.interrupted = true;
          result.description = fmt::format(
              "the node that started this launch went away (its ssh session ended); stopped {} "
              "{}{}",
              n, options.unit, n == 1 ? "" : "s");
          break;
        }
      }
    }
    bool reaped = false;
    for (size_t i = 0; i < procs.size(); ++i) {
      Running& p = procs[i];
      if (!p.alive) continue;
      int st = 0;
      if (::waitpid(p.pid, &st, WNOHANG) != p.pid) continue;
      reaped = true;
      p.alive = false;
      --alive;
      ::killpg(p.pid, SIGKILL);  // nothing of a finished rank may linger
      if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
      // The first failure: stop the others.
      const int n = stop_all(procs, SIGTERM, options.grace_s);
      alive = 0;
      result.status = exit_code_of(st);
      result.failed = children[i].label;
      const std::string others =
          n == 0 ? fmt::format("no other {} was running", options.unit)
                 : fmt::format("stopped the other {} {}{}", n, options.unit, n == 1 ? "" : "s");
      result.description =
          fmt::format("{} (pid {}) {}; {}", children[i].label, p.pid, describe_status(st), others);
      break;
    }
    if (!reaped && alive > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& p : procs)
    if (p.stdin_fd >= 0) ::close(p.stdin_fd);
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  ::sigaction(SIGHUP, &old_hup, nullptr);
  if (!result.description.empty() && options.describe_failure) {
    std::fprintf(stderr, "error: %s\n", result.description.c_str());
    std::fflush(stderr);
  }
  return result;
}

}  // namespace shardtrain
