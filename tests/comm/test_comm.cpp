// Distributed plumbing that needs no MPI job: the rank layout read from launcher variables
// (torchrun, SLURM, Open MPI), hostfiles, the TCP store on loopback, the communication timeout
// setting, and the command lines `shardtrain launch` builds. The communicators themselves are
// tested under mpirun (tests/mpi/test_mpi_comm.cpp).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/dist_env.h"
#include "comm/launch.h"
#include "comm/tcp_store.h"
#include "core/error.h"
#include "core/process.h"

namespace st = shardtrain;

namespace {

st::EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    const auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

/// Expects ConfigError whose message contains `needle`.
template <typename F>
void expect_config_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no ConfigError; expected one mentioning '" << needle << "'";
  } catch (const st::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

// ---- DistributedEnv ----------------------------------------------------------------------------

TEST(DistEnv, SingleProcessWithoutVariables) {
  const st::DistributedEnv e = st::read_distributed_env(env_of({}));
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.launcher, "none");
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(DistEnv, GpuRanksGetOneWorkQueueOnlyForNcclKernels) {
  const auto get = [](const char* v) { return std::string(std::getenv(v) ? std::getenv(v) : ""); };
  const std::string saved_queues = get("CUDA_DEVICE_MAX_CONNECTIONS");
  const std::string saved_nvls = get("NCCL_NVLS_ENABLE");
  const std::string saved_peer = get("SHARDTRAIN_PEER_COLLECTIVES");
  const auto layout = [](int world, int local) {
    st::DistributedEnv e;
    e.world_size = world;
    e.local_world_size = local;
    return e;
  };
  unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
  unsetenv("NCCL_NVLS_ENABLE");
  unsetenv("SHARDTRAIN_PEER_COLLECTIVES");
  st::set_gpu_rank_environment(layout(1, 1), "cuda");  // one rank: nothing to overlap
  EXPECT_EQ(get("CUDA_DEVICE_MAX_CONNECTIONS"), "");
  EXPECT_EQ(get("NCCL_NVLS_ENABLE"), "");
  st::set_gpu_rank_environment(layout(2, 2), "cpu");  // MPI ranks: no GPU
  EXPECT_EQ(get("CUDA_DEVICE_MAX_CONNECTIONS"), "");
  st::set_gpu_rank_environment(layout(2, 2), "auto");  // one node: copy engines, default queues
  EXPECT_EQ(get("CUDA_DEVICE_MAX_CONNECTIONS"), "");
  EXPECT_EQ(get("NCCL_NVLS_ENABLE"), "0");
  st::set_gpu_rank_environment(layout(4, 2), "cuda");  // two nodes: NCCL kernels, one queue
  EXPECT_EQ(get("CUDA_DEVICE_MAX_CONNECTIONS"), "1");
  unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
  setenv("SHARDTRAIN_PEER_COLLECTIVES", "0", 1);  // one node, NCCL chosen: one queue
  st::set_gpu_rank_environment(layout(2, 2), "cuda");
  EXPECT_EQ(get("CUDA_DEVICE_MAX_CONNECTIONS"), "1");
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8", 1);  // the user's value stays
  st::set_gpu_rank_environment(layout(4, 4), "cuda");
  EXPECT_EQ(get("CUDA_DEVICE_MAX_CONNECTIONS"), "8");
  setenv("SHARDTRAIN_PEER_COLLECTIVES", "yes", 1);  // named, not guessed
  EXPECT_THROW(st::set_gpu_rank_environment(layout(2, 2), "cuda"), st::ConfigError);
  for (auto [var, value] : {std::pair{"CUDA_DEVICE_MAX_CONNECTIONS", saved_queues},
                            std::pair{"NCCL_NVLS_ENABLE", saved_nvls},
                            std::pair{"SHARDTRAIN_PEER_COLLECTIVES", saved_peer}}) {
    if (value.empty()) {
      unsetenv(var);
    } else {
      setenv(var, value.c_str(), 1);
    }
  }
}

TEST(DistEnv, TorchrunVariables) {
  const st::DistributedEnv e = st::read_distributed_env(env_of({{"RANK", "5"},
                                                                {"WORLD_SIZE", "8"},
                                                                {"LOCAL_RANK", "1"},
                                                                {"LOCAL_WORLD_SIZE", "4"},
                                                                {"GROUP_RANK", "1"},
                                                                {"MASTER_ADDR", "node0"},
                                                                {"MASTER_PORT", "12345"}}));
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 12345);
  EXPECT_EQ(e.launcher, "torchrun");
  // torchrun's agent holds MASTER_PORT for PyTorch's store: ours moves to the next port.
  const st::DistributedEnv agent =
      st::read_distributed_env(env_of({{"RANK", "0"},
                                       {"WORLD_SIZE", "2"},
                                       {"MASTER_PORT", "29500"},
                                       {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  EXPECT_EQ(agent.master_port, 29501);

  // shardtrain launch names itself; missing local variables default from the global ones.
  const st::DistributedEnv l = st::read_distributed_env(
      env_of({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"SHARDTRAIN_LAUNCHER", "shardtrain-launch"}}));
  EXPECT_EQ(l.launcher, "shardtrain-launch");
  EXPECT_EQ(l.local_rank, 3);
  EXPECT_EQ(l.local_world_size, 4);
  EXPECT_EQ(l.node_rank, 0);
}

TEST(DistEnv, OpenMpiVariables) {
  const st::DistributedEnv e =
      st::read_distributed_env(env_of({{"OMPI_COMM_WORLD_RANK", "6"},
                                       {"OMPI_COMM_WORLD_SIZE", "8"},
                                       {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.launcher, "mpirun");
  // RANK / WORLD_SIZE win over mpirun's (a launcher that sets both knows best).
  const st::DistributedEnv t = st::read_distributed_env(env_of({{"RANK", "1"},
                                                                {"WORLD_SIZE", "2"},
                                                                {"OMPI_COMM_WORLD_RANK", "0"},
                                                                {"OMPI_COMM_WORLD_SIZE", "1"}}));
  EXPECT_EQ(t.world_size, 2);
  EXPECT_EQ(t.launcher, "torchrun");
}

TEST(DistEnv, SlurmStepVariables) {
  const st::DistributedEnv e =
      st::read_distributed_env(env_of({{"SLURM_PROCID", "9"},
                                       {"SLURM_STEP_NUM_TASKS", "12"},
                                       {"SLURM_NTASKS", "12"},
                                       {"SLURM_LOCALID", "1"},
                                       {"SLURM_NODEID", "2"},
                                       {"SLURM_STEP_TASKS_PER_NODE", "4(x2),4"},
                                       {"SLURM_STEP_NODELIST", "gpu[07-09]"},
                                       {"SLURM_JOB_ID", "123456"}}));
  EXPECT_EQ(e.rank, 9);
  EXPECT_EQ(e.world_size, 12);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 2);
  EXPECT_EQ(e.master_addr, "gpu07");
  EXPECT_EQ(e.master_port, 29500 + 456);
  EXPECT_EQ(e.launcher, "slurm");

  // Uneven tasks per node; the launch node's address when no node list is there; MASTER_* win.
  const st::DistributedEnv u =
      st::read_distributed_env(env_of({{"SLURM_PROCID", "4"},
                                       {"SLURM_NTASKS", "5"},
                                       {"SLURM_STEP_ID", "0"},
                                       {"SLURM_LOCALID", "0"},
                                       {"SLURM_NODEID", "1"},
                                       {"SLURM_TASKS_PER_NODE", "4,1"},
                                       {"SLURM_LAUNCH_NODE_IPADDR", "10.0.0.7"}}));
  EXPECT_EQ(u.world_size, 5);
  EXPECT_EQ(u.local_world_size, 1);
  EXPECT_EQ(u.master_addr, "10.0.0.7");
  const st::DistributedEnv m = st::read_distributed_env(env_of({{"SLURM_PROCID", "0"},
                                                                {"SLURM_STEP_NUM_TASKS", "2"},
                                                                {"MASTER_ADDR", "head"},
                                                                {"MASTER_PORT", "4000"},
                                                                {"SLURM_JOB_NODELIST", "n1,n2"}}));
  EXPECT_EQ(m.master_addr, "head");
  EXPECT_EQ(m.master_port, 4000);
}

TEST(DistEnv, SbatchBodyIsNotAStep) {
  // The batch script itself sees SLURM_NTASKS of the allocation but is one process.
  const st::DistributedEnv e = st::read_distributed_env(
      env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_JOB_ID", "7"}}));
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.launcher, "none");
}

TEST(DistEnv, MalformedVariablesNameTheVariable) {
  expect_config_error(
      [] {
        st::read_distributed_env(env_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}));
      },
      "RANK='x'");
  expect_config_error(
      [] {
        st::read_distributed_env(env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}));
      },
      "RANK='2': expected an integer in [0, 1]");
  expect_config_error(
      [] {
        st::read_distributed_env(
            env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "0"}}));
      },
      "MASTER_PORT='0'");
  expect_config_error(
      [] {
        st::read_distributed_env(env_of({{"SLURM_PROCID", "0"},
                                         {"SLURM_STEP_NUM_TASKS", "2"},
                                         {"SLURM_STEP_TASKS_PER_NODE", "2(y3)"}}));
      },
      "SLURM_STEP_TASKS_PER_NODE='2(y3)'");
}

TEST(DistEnv, SlurmHelpers) {
  EXPECT_EQ(st::expand_slurm_counts("4", "X"), (std::vector<int>{4}));
  EXPECT_EQ(st::expand_slurm_counts("2(x3),1", "X"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_THROW(st::expand_slurm_counts("", "X"), st::ConfigError);
  EXPECT_THROW(st::expand_slurm_counts("0", "X"), st::ConfigError);
  EXPECT_EQ(st::first_slurm_host("node3", "X"), "node3");
  EXPECT_EQ(st::first_slurm_host("node3,node4", "X"), "node3");
  EXPECT_EQ(st::first_slurm_host("gpu[07-09,12],cpu1", "X"), "gpu07");
  EXPECT_EQ(st::first_slurm_host("rack[2,5]-n[1-4]", "X"), "rack2-n[1-4]");  // first bracket only
  EXPECT_THROW(st::first_slurm_host("gpu[07-09", "X"), st::ConfigError);
  EXPECT_THROW(st::first_slurm_host("gpu[]", "X"), st::ConfigError);
}

TEST(CommTimeout, FlagThenVariableThenDefault) {
  unsetenv("SHARDTRAIN_COMM_TIMEOUT");
  EXPECT_DOUBLE_EQ(st::comm_timeout_seconds(), 300);
  EXPECT_DOUBLE_EQ(st::comm_timeout_seconds(12.5), 12.5);
  setenv("SHARDTRAIN_COMM_TIMEOUT", "30", 1);
  EXPECT_DOUBLE_EQ(st::comm_timeout_seconds(), 30);
  EXPECT_DOUBLE_EQ(st::comm_timeout_seconds(5), 5);
  setenv("SHARDTRAIN_COMM_TIMEOUT", "soon", 1);
  expect_config_error([] { st::comm_timeout_seconds(); }, "SHARDTRAIN_COMM_TIMEOUT='soon'");
  unsetenv("SHARDTRAIN_COMM_TIMEOUT");
}

TEST(WorldCommunicator, OneRankIsLocal) {
  st::DistributedEnv e;
  auto comm = st::make_world_communicator(e, st::DeviceKind::kCPU, nullptr);
  EXPECT_EQ(comm->backend_name(), "local");
  EXPECT_EQ(comm->world_size(), 1);
}

TEST(WorldCommunicator, CpuRanksWithoutMpiLauncherFailClearly) {
  st::DistributedEnv e;
  e.rank = 0;
  e.world_size = 2;
  e.launcher = "torchrun";
  expect_config_error([&] { st::make_world_communicator(e, st::DeviceKind::kCPU, nullptr); },
                      "CPU ranks communicate through MPI");
}

// ---- hostfiles ---------------------------------------------------------------------------------

TEST(Hostfile, DeepSpeedFormat) {
  const auto hosts = st::parse_hostfile(
      "# two nodes\n"
      "worker-1 slots=8\n"
      "\n"
      "   worker-2    slots=4   # the small one\n",
      "hf");
  ASSERT_EQ(hosts.size(), 2u);
  EXPECT_EQ(hosts[0].host, "worker-1");
  EXPECT_EQ(hosts[0].slots, 8);
  EXPECT_EQ(hosts[0].line, 2);
  EXPECT_EQ(hosts[1].host, "worker-2");
  EXPECT_EQ(hosts[1].slots, 4);
  EXPECT_EQ(hosts[1].line, 4);
}

TEST(Hostfile, BadLinesAreNamed) {
  expect_config_error([] { st::parse_hostfile("a slots=2\nb slot=4\n", "hf"); },
                      "hostfile hf line 2: 'b slot=4'");
  expect_config_error([] { st::parse_hostfile("a slots=0\n", "hf"); }, "line 1: 'a slots=0'");
  expect_config_error([] { st::parse_hostfile("a\n", "hf"); }, "line 1: 'a'");
  expect_config_error([] { st::parse_hostfile("a slots=2 extra\n", "hf"); }, "line 1");
  expect_config_error([] { st::parse_hostfile("a slots=x\n", "hf"); }, "line 1");
  expect_config_error([] { st::parse_hostfile("a slots=2\n\na slots=3\n", "hf"); },
                      "line 3: host 'a' is listed again (first on line 1)");
  expect_config_error([] { st::parse_hostfile("# nothing\n\n", "hf"); }, "lists no host");
  expect_config_error([] { st::read_hostfile("/nonexistent/hostfile"); },
                      "cannot open hostfile '/nonexistent/hostfile': no such file");
  expect_config_error([] { st::read_hostfile("/dev/zero"); }, "not a regular file");
}

TEST(Hostfile, AHostIsNeverAnOptionOfSshOrMpirun) {
  expect_config_error([] { st::parse_hostfile("-oProxyCommand=x slots=1\n", "hf"); },
                      "hostfile hf line 1: host '-oProxyCommand=x' is not a host name or address");
  expect_config_error([] { st::parse_hostfile(std::string("no\0de slots=1\n", 15), "hf"); },
                      "'no\\0de'");
  expect_config_error([] { st::parse_hostfile("a;rm slots=1\n", "hf"); }, "not a host name");
  const auto hosts = st::parse_hostfile("[fe80::1] slots=2\nalice@node-3 slots=1\n", "hf");
  ASSERT_EQ(hosts.size(), 2u);
  EXPECT_EQ(hosts[0].host, "[fe80::1]");
}

// ---- launch command lines ----------------------------------------------------------------------

TEST(LaunchPlan, RankProcessesCarryTheLayout) {
  st::LaunchPlan p;
  p.nproc_per_node = 2;
  p.nnodes = 3;
  p.node_rank = 1;
  p.master_addr = "head";
  p.master_port = 4242;
  p.comm_timeout_s = 30;
  p.command = {"train", "--device", "cuda"};
  const auto procs = st::rank_processes(p, "/bin/shardtrain");
  ASSERT_EQ(procs.size(), 2u);
  std::map<std::string, std::string> env(procs[1].env.begin(), procs[1].env.end());
  EXPECT_EQ(procs[1].label, "rank 3");
  EXPECT_EQ(env["RANK"], "3");
  EXPECT_EQ(env["WORLD_SIZE"], "6");
  EXPECT_EQ(env["LOCAL_RANK"], "1");
  EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
  EXPECT_EQ(env["GROUP_RANK"], "1");
  EXPECT_EQ(env["MASTER_ADDR"], "head");
  EXPECT_EQ(env["MASTER_PORT"], "4242");
  EXPECT_EQ(env["SHARDTRAIN_COMM_TIMEOUT"], "30");
  EXPECT_EQ(env["SHARDTRAIN_LAUNCHER"], "shardtrain-launch");
  EXPECT_EQ(procs[1].argv,
            (std::vector<std::string>{"/bin/shardtrain", "train", "--device", "cuda"}));
  if (getenv("NCCL_NVLS_ENABLE") == nullptr) {
    EXPECT_EQ(env["NCCL_NVLS_ENABLE"], "0");
  }
  // --exec: the program itself; an explicit offset and world size (uneven hostfiles).
  p.exec = true;
  p.command = {"env"};
  p.rank_offset = 8;
  p.world_size = 12;
  const auto e = st::rank_processes(p, "/bin/shardtrain");
  std::map<std::string, std::string> env0(e[0].env.begin(), e[0].env.end());
  EXPECT_EQ(e[0].argv, (std::vector<std::string>{"env"}));
  EXPECT_EQ(env0["RANK"], "8");
  EXPECT_EQ(env0["WORLD_SIZE"], "12");
}

TEST(LaunchPlan, MpirunCommand) {
  st::LaunchPlan p;
  p.nproc_per_node = 4;
  p.command = {"train", "--device", "cpu"};
  const auto one = st::mpirun_command(p, {}, "/usr/bin/mpirun", "/x/shardtrain");
  const std::string line = [&] {
    std::string s;
    for (const auto& w : one) s += w + " ";
    return s;
  }();
  EXPECT_NE(line.find("--bind-to none"), std::string::npos) << line;
  EXPECT_NE(line.find("--oversubscribe"), std::string::npos) << line;
  EXPECT_NE(line.find("-np 4 "), std::string::npos) << line;
  EXPECT_NE(line.find("/x/shardtrain train --device cpu"), std::string::npos) << line;
  const auto many = st::mpirun_command(p, {{"a", 2, 1}, {"b", 3, 2}}, "/usr/bin/mpirun", "/x/s");
  std::string l2;
  for (const auto& w : many) l2 += w + " ";
  EXPECT_NE(l2.find("-H a:2,b:3 -np 5 "), std::string::npos) << l2;
  EXPECT_EQ(l2.find("--oversubscribe"), std::string::npos) << l2;
}

TEST(LaunchPlan, NodeProcessesOverSsh) {
  st::LaunchPlan p;
  p.master_addr = "gpu1";
  p.master_port = 29600;
  p.comm_timeout_s = 60;
  p.command = {"train", "--dataset", "wikitext-2", "--output-dir", "my out"};
  const auto nodes = st::node_processes(p, {{"gpu1", 8, 1}, {"gpu2", 4, 2}}, "/opt/st/shardtrain",
                                        "/home/u/run", {"ssh", "-o", "BatchMode=yes"});
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[1].label, "node 1 (gpu2)");
  EXPECT_TRUE(nodes[1].stdin_pipe);
  ASSERT_EQ(nodes[1].argv.size(), 5u);
  EXPECT_EQ(nodes[1].argv[3], "gpu2");
  const std::string& remote = nodes[1].argv[4];
  EXPECT_EQ(remote.rfind("cd /home/u/run && exec env", 0), 0u) << remote;
  EXPECT_NE(remote.find("/opt/st/shardtrain launch --nproc-per-node 4 --nnodes 2 --node-rank 1 "
                        "--rank-offset 8 --world-size 12 --master-addr gpu1 --master-port 29600 "
                        "--watch-stdin --comm-timeout 60 -- train --dataset wikitext-2 "
                        "--output-dir 'my out'"),
            std::string::npos)
      << remote;
  // This host runs its launch directly, without ssh.
  const auto local = st::node_processes(p, {{"localhost", 2, 1}}, "/x/s", "/tmp", {"ssh"});
  EXPECT_EQ(local[0].argv[0], "/x/s");
  EXPECT_EQ(local[0].argv[1], "launch");
}

TEST(LaunchPlan, Helpers) {
  EXPECT_EQ(st::shell_quote("plain-word_1.txt"), "plain-word_1.txt");
  EXPECT_EQ(st::shell_quote("two words"), "'two words'");
  EXPECT_EQ(st::shell_quote("it's"), "'it'\\''s'");
  EXPECT_EQ(st::shell_quote(""), "''");
  EXPECT_TRUE(st::is_local_host("localhost"));
  EXPECT_TRUE(st::is_local_host("127.0.0.1"));
  EXPECT_FALSE(st::is_local_host("surely-not-this-host.example"));
  EXPECT_FALSE(st::find_on_path("sh").empty());
  EXPECT_TRUE(st::find_on_path("no-such-program-xyz").empty());
}

// ---- TCP store ---------------------------------------------------------------------------------

TEST(TcpStore, SetGetWaitAddOnLoopback) {
  st::TcpStoreServer server("127.0.0.1", 0);
  ASSERT_GT(server.port(), 0);
  st::TcpStoreClient a("127.0.0.1", server.port(), 5);
  st::TcpStoreClient b("localhost", server.port(), 5);
  EXPECT_FALSE(a.check("k").has_value());
  a.set("k", std::string("v\0w", 3));
  EXPECT_EQ(b.get("k", 1), std::string("v\0w", 3));
  a.set("k", "new");
  EXPECT_EQ(b.check("k").value(), "new");
  EXPECT_EQ(a.add("n", 5), 5);
  EXPECT_EQ(b.add("n", -2), 3);
  // get() waits for a key another client sets later.
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    st::TcpStoreClient c("127.0.0.1", server.port(), 5);
    c.set("later", "here");
  });
  EXPECT_EQ(a.get("later", 5), "here");
  late.join();
  b.wait({"k", "n", "later"}, 1);
  // A large value travels whole.
  const std::string big(3 << 20, 'x');
  a.set("big", big);
  EXPECT_EQ(b.get("big", 1), big);
}

TEST(TcpStore, TimeoutsNameKeyAndAddress) {
  st::TcpStoreServer server("127.0.0.1", 0);
  st::TcpStoreClient a("127.0.0.1", server.port(), 5);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    a.get("never", 0.3);
    ADD_FAILURE() << "get() of a missing key returned";
  } catch (const st::RuntimeFailure& e) {
    EXPECT_NE(std::string(e.what()).find("key 'never' was not set"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(server.port())), std::string::npos);
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
  EXPECT_THROW(a.wait({"never"}, 0.1), st::RuntimeFailure);
}

TEST(TcpStore, ClientRetriesUntilTheServerListens) {
  // Find a free port, then start the server on it after the client began trying.
  int port = 0;
  {
    st::TcpStoreServer probe("127.0.0.1", 0);
    port = probe.port();
  }
  std::unique_ptr<st::TcpStoreServer> server;
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    server = std::make_unique<st::TcpStoreServer>("127.0.0.1", port);
  });
  st::TcpStoreClient c("127.0.0.1", port, 10);
  later.join();
  c.set("a", "1");
  EXPECT_EQ(c.check("a").value(), "1");
}

TEST(TcpStore, UnreachableAndBusyFailClearly) {
  int port = 0;
  {
    st::TcpStoreServer probe("127.0.0.1", 0);
    port = probe.port();
  }
  try {
    st::TcpStoreClient c("127.0.0.1", port, 0.3);
    ADD_FAILURE() << "connected to a port nobody listens on";
  } catch (const st::RuntimeFailure& e) {
    EXPECT_NE(std::string(e.what()).find("cannot reach the rendezvous store at 127.0.0.1:"),
              std::string::npos)
        << e.what();
  }
  st::TcpStoreServer first("127.0.0.1", 0);
  try {
    st::TcpStoreServer second("127.0.0.1", first.port());
    ADD_FAILURE() << "two servers on one port";
  } catch (const st::RuntimeFailure& e) {
    EXPECT_NE(std::string(e.what()).find("--master-port"), std::string::npos) << e.what();
  }
}

TEST(TcpStore, ServerSurvivesAClientThatVanishes) {
  st::TcpStoreServer server("127.0.0.1", 0);
  {
    st::TcpStoreClient gone("127.0.0.1", server.port(), 5);
    gone.set("x", "1");
  }
  st::TcpStoreClient c("127.0.0.1", server.port(), 5);
  EXPECT_EQ(c.check("x").value(), "1");
}
