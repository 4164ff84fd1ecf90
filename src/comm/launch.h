// The pieces of `shardtrain launch` (app/cmd_launch.cpp): hostfiles, the command lines it runs
// (rank processes, mpirun, ssh) and the monitor that starts processes and stops them all when one
// fails. docs/LAUNCHING.md describes the behaviour.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/hostfile.h"

namespace shardtrain {

/// Parses the value of `--nnodes`: "N" (a fixed count) or "MIN:MAX" (torchrun's elastic node
/// count: the job runs on any count of nodes in [MIN, MAX]), with 1 ≤ MIN ≤ MAX ≤ 65536. Returns
/// {MIN, MAX} ({N, N} for "N"). Throws ConfigError naming the flag, the value and the form
/// expected (e.g. for "3:2", "0:2", "a:b").
std::pair<int, int> parse_nnodes(const std::string& value);

/// What one `shardtrain launch` (on one node) starts.
struct LaunchPlan {
  int nproc_per_node = 1;
  int nnodes = 1;      ///< nodes of the job (elastic jobs: of the current round)
  int min_nnodes = 1;  ///< --nnodes MIN:MAX; both equal nnodes for a fixed count
  int max_nnodes = 1;
  int node_rank = 0;
  int rank_offset = -1;  ///< global rank of this node's local rank 0; -1: node_rank × nproc
  int world_size = -1;   ///< -1: nnodes × nproc_per_node
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double comm_timeout_s = 0;         ///< > 0: exported as SHARDTRAIN_COMM_TIMEOUT
  std::vector<std::string> command;  ///< what follows `--`
  bool exec = false;                 ///< command is a program, not a shardtrain subcommand

  int first_rank() const { return rank_offset >= 0 ? rank_offset : node_rank * nproc_per_node; }
  int total_ranks() const { return world_size > 0 ? world_size : nnodes * nproc_per_node; }
  /// Whether the node count may change (--nnodes MIN:MAX with MIN < MAX).
  bool elastic() const { return min_nnodes < max_nnodes; }
};

/// A process to start and watch.
struct ChildSpec {
  std::string label;  ///< "rank 3", "node 1 (gpu7)", "mpirun"
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;  ///< set on top of the launcher's
  bool stdin_pipe = false;  ///< stdin is a pipe the launcher holds open while it runs
};

/// The processes of one node in spawn mode: `plan.nproc_per_node` copies of `self_exe` (or of
/// the program when plan.exec) with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
/// NODE_RANK, MASTER_ADDR, MASTER_PORT, SHARDTRAIN_LAUNCHER=shardtrain-launch, NCCL_NVLS_ENABLE=0
/// (unless set), OMP_NUM_THREADS (unless set: the cores divided among the local ranks) and
/// SHARDTRAIN_COMM_TIMEOUT (when plan.comm_timeout_s > 0).
std::vector<ChildSpec> rank_processes(const LaunchPlan& plan, const std::string& self_exe);

/// The mpirun command line of a CPU job: every rank runs `self_exe` + plan.command; `hosts`
/// empty: plan.nproc_per_node ranks on this node (oversubscribing allowed); else "-H host:slots"
/// for each. Forwards NCCL_*, SHARDTRAIN_*, OMP_*, OPENBLAS_* variables with -x.
std::vector<std::string> mpirun_command(const LaunchPlan& plan, const std::vector<HostSlots>& hosts,
                                        const std::string& mpirun, const std::string& self_exe);

/// One process per host of a GPU job: `shardtrain launch` on that host (through ssh, or directly
/// for this host: localhost, 127.x or this host's name) with its node rank, rank offset and the
/// world size, in directory `cwd`. `ssh` is the ssh command split into words.
std::vector<ChildSpec> node_processes(const LaunchPlan& plan, const std::vector<HostSlots>& hosts,
                                      const std::string& self_exe, const std::string& cwd,
                                      const std::vector<std::string>& ssh);

/// Whether `host` names this machine.
bool is_local_host(const std::string& host);

/// `s` quoted for a POSIX shell ('...' with embedded quotes escaped); plain words stay as they are.
std::string shell_quote(const std::string& s);

/// A request from outside the monitor to stop every process (e.g. another node's ranks failed).
struct StopRequest {
  int status = 1;      ///< the exit status the launcher reports for it
  std::string reason;  ///< "node 1 (gpu7): rank 3 (pid 41234) exited with status 1"
};

struct MonitorOptions {
  double grace_s = 10;           ///< seconds between SIGTERM and SIGKILL when stopping processes
  bool watch_stdin = false;      ///< stop everything when stdin reaches EOF (the ssh session ended)
  std::string unit = "rank";     ///< what a process is, for messages ("rank", "node")
  bool describe_failure = true;  ///< print the "error: rank 3 (pid …) exited …" line
  /// Called about every 20 ms while the processes run: a request stops them all (as a failure,
  /// with the request's status). Must not throw.
  std::function<std::optional<StopRequest>()> should_stop;
};

struct MonitorResult {
  int status = 0;           ///< the exit status for the launcher: 0, the failed one's, 128+signal
  std::string failed;       ///< label of the first process that failed ("" when none)
  std::string description;  ///< "rank 3 (pid 123) exited with status 1; stopped the other 3 ranks"
  /// Stopped by a signal to the launcher or by the loss of its starting node (not a failure of
  /// the job itself: `launch --max-restarts` does not restart it).
  bool interrupted = false;
  /// Stopped on options.should_stop's request (`status` is the request's).
  bool stopped = false;
};

/// Starts `children` and waits for them. When one exits with a non-zero status or is killed, the
/// others get SIGTERM (their whole process groups), then SIGKILL after options.grace_s, and the
/// result describes the first failure (printed as "error: ..." on stderr when describe_failure).
/// SIGINT, SIGTERM and SIGHUP received by the launcher are forwarded the same way. Throws
/// RuntimeFailure when a process cannot be started (fork or pipe failure; a program that cannot
/// be executed exits with status 127 and a message).
MonitorResult run_processes(const std::vector<ChildSpec>& children, const MonitorOptions& options);

}  // namespace shardtrain
