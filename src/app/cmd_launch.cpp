// `shardtrain launch [--nproc-per-node N] [--nnodes M --node-rank R --master-addr A]
// [--hostfile FILE] -- train ...`: starts the ranks of a job, as torchrun and
// `deepspeed --num_gpus` do. docs/LAUNCHING.md describes it; in short:
//  * GPU jobs (--device cuda, or auto on a node with GPUs): N processes of this program with
//    RANK, WORLD_SIZE, LOCAL_RANK, ... set; NCCL meets through rank 0's TCP store.
//  * CPU jobs of several ranks: mpirun starts the ranks (the CPU communicator is MPI).
//  * --hostfile: one `shardtrain launch` per host (ssh; directly for this host) for GPU jobs, or
//    one mpirun over all hosts for CPU jobs.
// When a rank fails, the others are stopped and launch exits with that rank's status, or with
// --max-restarts N runs the job again (a train command resuming from its latest checkpoint).
// --nnodes MIN:MAX (torchrun's elastic node count): the launchers of the nodes meet in a store
// served by node 0's launcher (comm/rendezvous.h), run with the nodes that came, and meet again
// after a failure, going on without a node whose launcher died; with --hostfile (GPU jobs,
// --exec) a node whose ranks failed is left out of the restart while MIN nodes remain.
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "app/commands.h"
#include "app/train_command.h"
#include "comm/launch.h"
#include "comm/nccl_communicator.h"
#include "comm/rendezvous.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/process.h"

namespace shardtrain {
namespace {

struct LaunchOptions {
  LaunchPlan plan;
  std::string hostfile;
  std::string device;  ///< --device given to launch: passed on to the training command
  double grace_s = 10;
  int max_restarts = 0;         ///< --max-restarts: restarts of the whole job after a failure
  std::string nnodes = "1";     ///< --nnodes: N or MIN:MAX (parse_nnodes)
  double rdzv_last_call_s = 5;  ///< --rdzv-last-call
  double rdzv_timeout_s = 600;  ///< --rdzv-timeout
  bool watch_stdin = false;
  bool dry_run = false;
  CLI::Option* nproc = nullptr;
  CLI::Option* master_addr = nullptr;
  CLI::Option* node_rank = nullptr;
};

std::string self_exe() {
  std::error_code ec;
  const auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  check<RuntimeFailure>(!ec, "launch: cannot find this program (/proc/self/exe): {}", ec.message());
  return p.string();
}

std::string quoted(const std::vector<std::string>& words) {
  std::string s;
  for (const auto& w : words) {
    if (!s.empty()) s += " ";
    s += shell_quote(w);
  }
  return s;
}

void print_plan(const std::vector<ChildSpec>& children) {
  for (const auto& c : children) {
    std::string line;
    for (const auto& [k, v] : c.env) line += shell_quote(k + "=" + v) + " ";
    fmt::print("{}{}\n", line, quoted(c.argv));
  }
}

MonitorResult run(const std::vector<ChildSpec>& children, const LaunchOptions& o,
                  const std::string& unit, bool describe = true) {
  if (o.dry_run) {
    print_plan(children);
    return {};
  }
  MonitorOptions m;
  m.grace_s = o.grace_s;
  m.watch_stdin = o.watch_stdin;
  m.unit = unit;
  m.describe_failure = describe;
  return run_processes(children, m);
}

/// Runs a CPU job through mpirun; `hosts` empty: this node only.
MonitorResult run_mpirun(const LaunchOptions& o, const std::vector<HostSlots>& hosts) {
  const char* override_path = std::getenv("SHARDTRAIN_MPIRUN");
  const std::string mpirun = find_on_path(override_path ? override_path : "mpirun");
  check<ConfigError>(!mpirun.empty(),
                     "CPU jobs of several ranks communicate through MPI and start through mpirun, "
                     "which is not on PATH: install Open MPI (apt install openmpi-bin), or pass "
                     "{} cuda on GPU nodes",
                     knob_for(&TrainConfig::device).name());
  if (hosts.empty() && std::getenv("OMP_NUM_THREADS") == nullptr) {
    const int cores = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
    setenv("OMP_NUM_THREADS", std::to_string(std::max(1, cores / o.plan.nproc_per_node)).c_str(),
           1);
  }
  if (o.plan.comm_timeout_s > 0)
    setenv("SHARDTRAIN_COMM_TIMEOUT", fmt::format("{:g}", o.plan.comm_timeout_s).c_str(), 1);
  ChildSpec c;
  c.label = "mpirun";
  c.argv = mpirun_command(o.plan, hosts, mpirun, self_exe());
  const MonitorResult r = run({c}, o, "process", false);
  if (r.status != 0 && !o.dry_run) {
    std::fprintf(stderr,
                 "error: the job failed (mpirun exited with status %d): the messages above name "
                 "the rank that failed first (mpirun writes 'process rank N' or 'Process name: "
                 "[[job,1],N]')\n",
                 r.status);
  }
  return r;
}

/// Whether a rank's exit status says it rejected its input (2: configuration, data or checkpoint;
/// 100–127: the command line): running the job again would fail the same way.
bool is_bad_input(int status) { return status == 2 || (status >= 100 && status < 128); }

/// Runs `attempt` (the whole job) and, after a failure, again up to --max-restarts times (as
/// torchrun's --max-restarts): every rank was stopped, and a `train` command resumes from the
/// latest complete checkpoint of its output directory (restart_command). The ranks see the
/// restart's number in SHARDTRAIN_RESTART_COUNT (as TORCHELASTIC_RESTART_COUNT). A launcher
/// stopped by a signal does not restart, nor a job whose rank rejected its input: exit status 2
/// (configuration, data or checkpoint errors) or 100–127 (the command line) would come again.
/// `nodes` (optional) adapts the nodes to the failure before a restart and returns the words
/// for the message (" with 1 node(s) (was 2)").

int with_restarts(LaunchOptions& o, const std::function<MonitorResult()>& attempt,
                  const std::function<std::string(const MonitorResult&)>& nodes = {}) {
  for (int k = 1;; ++k) {
    const MonitorResult r = attempt();
    if (r.status == 0 || r.interrupted || is_bad_input(r.status) || o.dry_run || k > o.max_restarts)
      return r.status;
    std::string why;
    if (!o.plan.exec) o.plan.command = restart_command(o.plan.command, &why);
    const std::string with = nodes ? nodes(r) : "";
    std::fprintf(stderr, "launch: the job failed (status %d); restart %d of %d%s, %s\n", r.status,
                 k, o.max_restarts, with.c_str(), why.empty() ? "the same command" : why.c_str());
    std::fflush(stderr);
    setenv("SHARDTRAIN_RESTART_COUNT", std::to_string(k).c_str(), 1);
  }
}

/// One node of a job of --nnodes MIN:MAX started by hand (comm/rendezvous.h): meets the other
/// nodes' launchers, runs this node's ranks with the node rank and world size the rendezvous
/// gave, and after a failure (here or on another node) meets them again for the restart, up to
/// --max-restarts times.
int run_elastic(LaunchOptions& o) {
  LaunchPlan& plan = o.plan;
  const bool rank_given = o.node_rank->count() > 0;
  RendezvousOptions ro;
  ro.master_addr = plan.master_addr;
  ro.port = plan.master_port + 1;
  ro.host = rank_given ? plan.node_rank == 0 : is_local_address(plan.master_addr);
  ro.min_nodes = plan.min_nnodes;
  ro.max_nodes = plan.max_nnodes;
  ro.requested_rank = rank_given && plan.node_rank > 0 ? plan.node_rank : -1;
  ro.nproc = plan.nproc_per_node;
  ro.last_call_s = o.rdzv_last_call_s;
  ro.join_timeout_s = o.rdzv_timeout_s;
  ElasticRendezvous rdzv(ro);
  const std::vector<std::string> command = plan.command;
  MonitorResult last;
  int prev_nodes = 0;
  for (int round = rdzv.current_round();; ++round) {
    int status = 1;
    std::optional<RendezvousRound> got;
    try {
      got = rdzv.join(round, &status);
    } catch (const RuntimeFailure& e) {
      std::fprintf(stderr, "error: launch: %s\n", e.what());
      std::fflush(stderr);
      rdzv.leave(status != 0 ? status : 1);
      return status != 0 ? status : 1;
    }
    if (!got) {
      if (status == 0)
        std::fprintf(stderr, "launch: the job finished without this node\n");
      else
        std::fprintf(stderr, "error: launch: node 0's launcher ended the job (status %d)\n",
                     status);
      std::fflush(stderr);
      rdzv.leave(status);
      return status;
    }
    round = got->round;
    plan.nnodes = got->nnodes;
    plan.node_rank = got->node_rank;
    plan.rank_offset = got->rank_offset;
    plan.world_size = got->world_size;
    std::string why = "the same command";
    if (round > 0 && !plan.exec) plan.command = restart_command(command, &why);
    if (prev_nodes > 0)
      std::fprintf(stderr,
                   "launch: the job failed (status %d); restart %d of %d with %d node(s) "
                   "(was %d), %s\n",
                   last.status, round, o.max_restarts, got->nnodes, prev_nodes, why.c_str());
    std::fprintf(stderr,
                 "launch: rendezvous at %s (--nnodes %d:%d): this is node %d of %d, ranks %d-%d "
                 "of %d%s\n",
                 rdzv.address().c_str(), plan.min_nnodes, plan.max_nnodes, got->node_rank,
                 got->nnodes, got->rank_offset, got->rank_offset + plan.nproc_per_node - 1,
                 got->world_size, round > 0 ? fmt::format(" (restart {})", round).c_str() : "");
    std::fflush(stderr);
    if (round > 0) setenv("SHARDTRAIN_RESTART_COUNT", std::to_string(round).c_str(), 1);
    MonitorOptions m;
    m.grace_s = o.grace_s;
    m.unit = "rank";
    m.should_stop = [&rdzv, round] { return rdzv.poll(round); };
    last = run_processes(rank_processes(plan, self_exe()), m);
    if (last.status == 0) {
      const int s = rdzv.finish(round);
      rdzv.leave(s);
      return s;
    }
    // A node whose launcher was interrupted leaves; the others go on without it (as torchrun's).
    const bool final = is_bad_input(last.status) || round >= o.max_restarts;
    if (!last.stopped) rdzv.report_failure(round, last.status, last.description, final);
    if (const auto fin = rdzv.final_status(round); fin && !final) {
      rdzv.leave(*fin);
      return *fin;
    }
    if (final || last.interrupted || rdzv.store_lost()) {
      rdzv.leave(last.status);
      return last.status;
    }
    prev_nodes = got->nnodes;
  }
}

int launch(LaunchOptions& o) {
  LaunchPlan& plan = o.plan;
  std::tie(plan.min_nnodes, plan.max_nnodes) = parse_nnodes(o.nnodes);
  plan.nnodes = plan.max_nnodes;
  check<ConfigError>(!plan.command.empty(),
                     "nothing to launch: put the command after '--', e.g. `shardtrain launch "
                     "--nproc-per-node 2 -- train {} wikitext-2`",
                     knob_for(&TrainConfig::dataset).name());
  check<ConfigError>(plan.exec || plan.command[0] != "launch",
                     "`launch -- launch` nests launchers: give the training command after '--'");
  // Whether the ranks' stdout ends at a terminal is the launcher's to say: mpirun gives ranks a
  // pseudo-terminal even when its own output goes to a file, and the trainer would redraw its
  // progress bar into that file. Forwarded to every rank (SHARDTRAIN_* variables are); an outer
  // launch (--hostfile) has set it already.
  setenv("SHARDTRAIN_STDOUT_TTY", isatty(STDOUT_FILENO) ? "1" : "0", 0);
  if (!o.device.empty()) {
    const std::string flag = knob_for(&TrainConfig::device).name();
    check<ConfigError>(!plan.exec,
                       "launch {} applies to shardtrain commands, not to --exec programs: pass the "
                       "device to the program itself",
                       flag);
    const std::optional<std::string> given = given_device(plan.command);
    check<ConfigError>(!given || *given == o.device,
                       "launch {0} {1} contradicts the command's {0} {2}: give one", flag, o.device,
                       given.value_or(""));
    if (!given) plan.command.insert(plan.command.begin() + 1, {flag, o.device});
  }
  const std::string device = plan.exec ? "" : device_flag(plan.command);
  const int gpus = plan.exec || device == "cpu" ? 0 : cuda_device_count();
  const bool gpu_job = !plan.exec && (device == "cuda" || (device == "auto" && gpus > 0));

  if (!o.hostfile.empty()) {
    std::vector<HostSlots> hosts = read_hostfile(o.hostfile);
    if (o.master_addr->count() == 0) {
      plan.master_addr = hosts[0].host;
      if (is_local_host(hosts[0].host) && hosts.size() > 1) {
        char name[HOST_NAME_MAX + 1] = {};
        if (gethostname(name, sizeof name - 1) == 0) plan.master_addr = name;
      }
    }
    if (!plan.exec && !gpu_job) {
      check<ConfigError>(
          !plan.elastic(),
          "--nnodes {} with --hostfile works for GPU jobs and --exec: a CPU job runs "
          "as one mpirun over all its hosts, which cannot go on without one; give "
          "--nnodes N (or leave --nnodes out)",
          o.nnodes);
      return with_restarts(o, [&] { return run_mpirun(o, hosts); });
    }
    if (plan.elastic()) {
      check<ConfigError>(static_cast<int>(hosts.size()) >= plan.min_nnodes,
                         "hostfile {} lists {} host(s) but --nnodes {} needs at least {}: list "
                         "more hosts or lower MIN",
                         o.hostfile, hosts.size(), o.nnodes, plan.min_nnodes);
      if (static_cast<int>(hosts.size()) > plan.max_nnodes)
        hosts.resize(static_cast<size_t>(plan.max_nnodes));  // the first MAX hosts
    }
    const char* ssh_env = std::getenv("SHARDTRAIN_SSH");
    std::vector<std::string> ssh;
    std::istringstream words(ssh_env ? ssh_env : "ssh -o BatchMode=yes");
    for (std::string w; words >> w;) ssh.push_back(w);
    std::error_code ec;
    const std::string cwd = std::filesystem::current_path(ec).string();
    std::vector<ChildSpec> nodes;
    // --nnodes MIN:MAX: a node whose ranks failed is left out of the restart while at least MIN
    // remain; node 0 (the master, where rank 0 serves the store) always stays.
    const auto drop_failed = [&](const MonitorResult& r) -> std::string {
      if (!plan.elastic()) return "";
      const size_t was = hosts.size();
      for (size_t i = 1; i < nodes.size() && i < hosts.size(); ++i)
        if (nodes[i].label == r.failed && static_cast<int>(was) - 1 >= plan.min_nnodes) {
          hosts.erase(hosts.begin() + static_cast<std::ptrdiff_t>(i));
          break;
        }
      return fmt::format(" with {} node(s) (was {})", hosts.size(), was);
    };
    return with_restarts(
        o,
        [&] {
          nodes = node_processes(plan, hosts, self_exe(), cwd, ssh);
          return run(nodes, o, "node");
        },
        drop_failed);
  }

  check<ConfigError>(plan.node_rank < plan.max_nnodes, "--node-rank {} must be below --nnodes {}",
                     plan.node_rank, plan.max_nnodes);
  check<ConfigError>(plan.max_nnodes == 1 || o.master_addr->count() > 0,
                     "--nnodes {} needs --master-addr: the address of node 0 (where rank 0 runs), "
                     "reachable from every node",
                     o.nnodes);
  check<ConfigError>(!plan.elastic() || plan.master_port < 65535,
                     "--nnodes {} needs --master-port below 65535: the launchers meet at "
                     "--master-port + 1",
                     o.nnodes);
  check<ConfigError>(!plan.elastic() || plan.rank_offset < 0,
                     "--nnodes {} assigns the ranks itself: leave out --rank-offset", o.nnodes);
  if (gpu_job) {
    if (o.nproc->count() == 0) plan.nproc_per_node = std::max(1, gpus);
    check<ConfigError>(
        plan.nproc_per_node <= gpus,
        "--nproc-per-node {} asks for {} GPUs but this node has {} visible{}: {}",
        plan.nproc_per_node, plan.nproc_per_node, gpus,
        std::getenv("CUDA_VISIBLE_DEVICES")
            ? fmt::format(" (CUDA_VISIBLE_DEVICES={})", std::getenv("CUDA_VISIBLE_DEVICES"))
            : std::string(),
        gpus > 0
            ? fmt::format("pass --nproc-per-node {} or fewer, or {} cpu", gpus,
                          knob_for(&TrainConfig::device).name())
            : fmt::format("run on CPU ranks with {} cpu, or on a machine whose GPUs nvidia-smi "
                          "lists",
                          knob_for(&TrainConfig::device).name()));
  }
  check<ConfigError>(
      plan.rank_offset < 0 || plan.rank_offset + plan.nproc_per_node <= plan.total_ranks(),
      "--rank-offset {} + --nproc-per-node {} exceeds --world-size {}", plan.rank_offset,
      plan.nproc_per_node, plan.total_ranks());
  if (!plan.exec && !gpu_job && plan.total_ranks() > 1) {
    check<ConfigError>(plan.max_nnodes == 1,
                       "CPU jobs over several nodes start through mpirun: pass --hostfile (lines "
                       "'HOST slots=N') instead of --nnodes, or run mpirun / srun yourself");
    return with_restarts(o, [&] { return run_mpirun(o, {}); });
  }
  if (plan.elastic() && !o.dry_run) return run_elastic(o);  // (dry runs show MAX nodes)
  return with_restarts(o, [&] { return run(rank_processes(plan, self_exe()), o, "rank"); });
}

}  // namespace

void register_launch_command(CLI::App& app) {
  auto o = std::make_shared<LaunchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "launch",
      "start the ranks of a distributed job on this node or on several "
      "(`shardtrain launch --nproc-per-node 2 -- train ...`; see docs/LAUNCHING.md)");
  LaunchPlan& p = o->plan;
  o->nproc = cmd->add_option("--nproc-per-node,--num-gpus,--num_gpus", p.nproc_per_node,
                             "ranks on this node (default: its GPUs for GPU jobs, else 1)")
                 ->check(CLI::Range(1, 4096));
  cmd->add_option("--nnodes", o->nnodes,
                  "nodes of the job, each running its own launch: N, or MIN:MAX (as torchrun) to "
                  "run on any count of nodes from MIN to MAX, going on without a node that died "
                  "when the job restarts (default 1)");
  o->node_rank = cmd->add_option("--node-rank", p.node_rank,
                                 "index of this node, 0 ≤ R < --nnodes (default 0); with --nnodes "
                                 "MIN:MAX 0 marks node 0 (it serves the launchers' store) and the "
                                 "others are ordered by it")
                     ->check(CLI::Range(0, 65535));
  o->master_addr = cmd->add_option("--master-addr", p.master_addr,
                                   "address of node 0, where rank 0 serves the rendezvous store "
                                   "(default 127.0.0.1; with --hostfile the first host)");
  cmd->add_option("--master-port", p.master_port, "port of the rendezvous store (default 29500)")
      ->check(CLI::Range(1, 65535));
  // train's flag, under its name: passed on to the command.
  cmd->add_option(knob_for(&TrainConfig::device).name(), o->device,
                  "cpu | cuda | auto: run the ranks on CPUs (under mpirun) or one GPU each; "
                  "passed on to the command (default: the command's own, else auto)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  cmd->add_option("--hostfile", o->hostfile,
                  "hosts of a multi-node job, one 'HOST slots=N' per line (DeepSpeed's format): "
                  "GPU jobs start over ssh (SHARDTRAIN_SSH overrides 'ssh -o BatchMode=yes'), CPU "
                  "jobs through mpirun")
      ->check(CLI::ExistingFile);
  cmd->add_option("--comm-timeout", p.comm_timeout_s,
                  "seconds a collective may wait for the other ranks before the job stops with a "
                  "message naming them (default: $SHARDTRAIN_COMM_TIMEOUT or 300)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--exec", p.exec,
                "the words after -- are a program and its arguments, not a shardtrain subcommand "
                "(as torchrun --no-python); it runs once per rank with the rank variables set");
  cmd->add_option("--stop-grace", o->grace_s,
                  "seconds between SIGTERM and SIGKILL when stopping ranks (default 10)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-restarts", o->max_restarts,
                  fmt::format("restart the whole job up to N times when a rank (or a node) "
                              "fails: every rank is stopped, and a train command resumes from "
                              "the latest complete checkpoint of its {} (from the start if there "
                              "is none yet), its metrics.jsonl and TensorBoard continuing without "
                              "repeated steps (default 0, as torchrun)",
                              knob_for(&TrainConfig::output_dir).name()))
      ->check(CLI::Range(0, 1000));
  cmd->add_option("--rdzv-last-call", o->rdzv_last_call_s,
                  "with --nnodes MIN:MAX: seconds to wait for more nodes once MIN have joined, "
                  "and the silence after which a node's launcher counts as gone (default 5)")
      ->check(CLI::Range(1.0, 3600.0));
  cmd->add_option("--rdzv-timeout", o->rdzv_timeout_s,
                  "with --nnodes MIN:MAX: seconds to wait at the start for MIN nodes to join "
                  "(default 600)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--dry-run", o->dry_run, "print the commands it would run, and exit");
  // Set by a --hostfile launch for the launches it starts on each host.
  cmd->add_option("--rank-offset", p.rank_offset)->group("")->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--world-size", p.world_size)->group("")->check(CLI::Range(1, 1 << 24));
  cmd->add_flag("--watch-stdin", o->watch_stdin)->group("");
  cmd->add_option("command", p.command,
                  "the shardtrain subcommand every rank runs (after '--'; the first word that is "
                  "not a launch option starts it)")
      ->expected(-1);
  cmd->positionals_at_end();  // `launch --nproc-per-node 2 train ...` works without "--" too
  cmd->callback([o]() {
    const int status = launch(*o);
    std::fflush(stdout);
    if (status != 0) std::exit(status);
  });
}

}  // namespace shardtrain
