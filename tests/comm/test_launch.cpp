// `shardtrain launch` and multi-rank training as a user meets them, on CPU: ranks get their
// variables, a failed or killed rank stops the job with a message naming it, a rank that hangs
// makes the others stop within the communication timeout with a message naming it (under the
// launcher and under a plain mpirun), and asking for absent GPUs fails clearly. Every test is
// bounded well under a minute.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "app/error_report.h"
#include "comm/launch.h"
#include "core/error.h"
#include "test_support.h"

namespace fs = std::filesystem;

#ifndef SHARDTRAIN_MPIEXEC
#define SHARDTRAIN_MPIEXEC "mpirun"
#endif

namespace {

struct Result : shardtrain::test_support::CommandResult {
  double seconds = 0;
};

Result run_shell(const std::string& cmd) {
  const auto t0 = std::chrono::steady_clock::now();
  Result r{shardtrain::test_support::run_command(cmd + " 2>&1")};
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

/// `shardtrain ARGS` with OMP_NUM_THREADS=1 and extra `env` arguments ("-u X A=1 B=2").
Result run(const std::string& args, const std::string& env = "") {
  return run_shell("env " + env + " OMP_NUM_THREADS=1 " + SHARDTRAIN_BINARY + " " + args);
}

fs::path temp_dir(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("shardtrain_launch_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

/// A short CPU training command (gpt2-micro, 3 steps of 2 × 32 tokens) writing under `dir`.
std::string train_args(const fs::path& dir) {
  return std::string("train --model gpt2-micro --device cpu --train-file ") +
         SHARDTRAIN_TEST_DATA_DIR +
         "/wikitext-2/wiki.valid.tokens --num-samples 64 --max-length 32 --batch-size 2 "
         "--max-steps 3 --cache-dir " +
         (dir / "cache").string() + " --output-dir " + (dir / "out").string();
}

size_t count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = haystack.find(needle); pos != std::string::npos;
       pos = haystack.find(needle, pos + 1))
    ++n;
  return n;
}

}  // namespace

// ---- the launcher's own process handling (--exec: any program) ---------------------------------

TEST(Launch, RanksGetTheirVariables) {
  const Result r =
      run("launch --nproc-per-node 3 --master-port 29777 --comm-timeout 45 --exec -- sh -c 'echo "
          "\"r=$RANK/$WORLD_SIZE l=$LOCAL_RANK/$LOCAL_WORLD_SIZE n=$GROUP_RANK "
          "m=$MASTER_ADDR:$MASTER_PORT t=$SHARDTRAIN_COMM_TIMEOUT\"'",
          "-u NCCL_NVLS_ENABLE");
  ASSERT_EQ(r.status, 0) << r.output;
  for (int i = 0; i < 3; ++i)
    EXPECT_NE(r.output.find("r=" + std::to_string(i) + "/3 l=" + std::to_string(i) +
                            "/3 n=0 m=127.0.0.1:29777 t=45"),
              std::string::npos)
        << r.output;
  const Result nvls =
      run("launch --exec -- sh -c 'echo nvls=$NCCL_NVLS_ENABLE'", "-u NCCL_NVLS_ENABLE");
  EXPECT_NE(nvls.output.find("nvls=0"), std::string::npos) << nvls.output;
}

TEST(Launch, SecondNodeOfTwo) {
  const Result r = run(
      "launch --nproc-per-node 2 --nnodes 2 --node-rank 1 --master-addr 10.1.2.3 --exec -- sh -c "
      "'echo r=$RANK/$WORLD_SIZE l=$LOCAL_RANK n=$GROUP_RANK m=$MASTER_ADDR'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("r=2/4 l=0 n=1 m=10.1.2.3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("r=3/4 l=1 n=1 m=10.1.2.3"), std::string::npos) << r.output;
  const Result no_master = run("launch --nnodes 2 --exec -- true");
  EXPECT_EQ(no_master.status, 2) << no_master.output;
  EXPECT_NE(no_master.output.find("--nnodes 2 needs --master-addr"), std::string::npos)
      << no_master.output;
}

TEST(Launch, FailedRankStopsTheOthers) {
  const Result r = run(
      "launch --nproc-per-node 4 --exec -- sh -c 'if [ \"$RANK\" = 3 ]; then sleep 0.5; exit 7; "
      "fi; exec sleep 60'");
  EXPECT_EQ(r.status, 7) << r.output;
  EXPECT_NE(r.output.find("error: rank 3 (pid "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(") exited with status 7; stopped the other 3 ranks"), std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 15) << r.output;
}

TEST(Launch, KilledRankStopsTheOthers) {
  const Result r = run(
      "launch --nproc-per-node 2 --exec -- sh -c 'if [ \"$RANK\" = 1 ]; then sleep 0.5; kill -9 "
      "$$; fi; exec sleep 60'");
  EXPECT_EQ(r.status, 128 + 9) << r.output;
  EXPECT_NE(r.output.find("error: rank 1 (pid "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was killed by signal 9"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("stopped the other 1 rank"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 15) << r.output;
}

TEST(Launch, RankIgnoringSigtermIsKilledAfterTheGrace) {
  const Result r =
      run("launch --nproc-per-node 2 --stop-grace 1 --exec -- sh -c 'if [ \"$RANK\" = 0 ]; then "
          "sleep 0.5; exit 1; fi; trap \"\" TERM; while true; do sleep 0.1; done'");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("error: rank 0 (pid "), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 15) << r.output;
}

TEST(Launch, SignalsAreForwardedToTheRanks) {
  const Result r =
      run_shell(std::string("timeout --preserve-status -s TERM 1 env OMP_NUM_THREADS=1 ") +
                SHARDTRAIN_BINARY + " launch --nproc-per-node 2 --exec -- sleep 60");
  EXPECT_EQ(r.status, 128 + 15) << r.output;
  EXPECT_NE(r.output.find("launch was interrupted by signal 15"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("stopped 2 ranks"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 15) << r.output;
}

TEST(Launch, NodeLaunchStopsWhenItsSshSessionEnds) {
  // A --hostfile launch watches the stdin of each node's launch: EOF means the session is gone.
  const Result r = run_shell(std::string("sleep 0.5 | env OMP_NUM_THREADS=1 ") + SHARDTRAIN_BINARY +
                             " launch --watch-stdin --nproc-per-node 2 --exec -- sleep 60");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("the node that started this launch went away"), std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 15) << r.output;
}

TEST(Launch, HostfileStartsOneLaunchPerHost) {
  const fs::path dir = temp_dir("hostfile");
  {
    std::ofstream f(dir / "hosts");
    f << "# both are this machine, so no ssh is needed\nlocalhost slots=2\n127.0.0.1 slots=1\n";
  }
  const Result r = run("launch --hostfile " + (dir / "hosts").string() +
                       " --exec -- sh -c 'echo r=$RANK/$WORLD_SIZE l=$LOCAL_RANK/$LOCAL_WORLD_SIZE "
                       "n=$GROUP_RANK'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("r=0/3 l=0/2 n=0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("r=1/3 l=1/2 n=0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("r=2/3 l=0/1 n=1"), std::string::npos) << r.output;

  // A failing rank on the second host stops the first host's launch too.
  const Result f = run("launch --hostfile " + (dir / "hosts").string() +
                       " --exec -- sh -c 'if [ \"$RANK\" = 2 ]; then sleep 0.5; exit 4; fi; exec "
                       "sleep 60'");
  EXPECT_EQ(f.status, 4) << f.output;
  EXPECT_NE(f.output.find("error: rank 2 (pid "), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("error: node 1 (127.0.0.1) (pid "), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("stopped the other 1 node"), std::string::npos) << f.output;
  EXPECT_LT(f.seconds, 20) << f.output;

  {
    std::ofstream bad(dir / "bad");
    bad << "localhost slots=2\nnode7 slots:4\n";
  }
  const Result b = run("launch --hostfile " + (dir / "bad").string() + " --exec -- true");
  EXPECT_EQ(b.status, 2) << b.output;
  EXPECT_NE(b.output.find("line 2: 'node7 slots:4'"), std::string::npos) << b.output;
  fs::remove_all(dir);
}

TEST(Launch, DryRunShowsMpirunForCpuJobs) {
  const Result r = run("launch --nproc-per-node 2 --dry-run -- train --device cpu --max-steps 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("mpirun"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--bind-to none"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("-np 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train --device cpu --max-steps 1"), std::string::npos) << r.output;
}

TEST(Launch, BadRequestsFailClearly) {
  Result r = run("launch --nproc-per-node 2");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("nothing to launch"), std::string::npos) << r.output;
  // This machine has no GPU (or fewer than 4096): asking for them names both counts.
  r = run("launch --nproc-per-node 4096 -- train --device cuda");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--nproc-per-node 4096 asks for 4096 GPUs but this node has"),
            std::string::npos)
      << r.output;
  // Never "pass --nproc-per-node 0 or fewer" on a machine without GPUs.
  EXPECT_EQ(r.output.find("--nproc-per-node 0 or fewer"), std::string::npos) << r.output;
  r = run("launch --node-rank 2 --nnodes 2 --master-addr h --exec -- true");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--node-rank 2 must be below --nnodes 2"), std::string::npos) << r.output;
  r = run("launch --nnodes 2 --node-rank 0 --master-addr h -- train --device cpu");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--hostfile"), std::string::npos) << r.output;
}

// ---- elastic node counts (--nnodes MIN:MAX) -------------------------------------------------

TEST(Launch, NnodesTakesACountOrMinMax) {
  namespace st = shardtrain;
  EXPECT_EQ(st::parse_nnodes("2"), std::make_pair(2, 2));
  EXPECT_EQ(st::parse_nnodes("1:4"), std::make_pair(1, 4));
  EXPECT_EQ(st::parse_nnodes("3:3"), std::make_pair(3, 3));
  EXPECT_THROW_MSG(st::parse_nnodes("3:2"), st::ConfigError, "MIN 3 is above MAX 2");
  for (const char* bad : {"0:2", "a:b", "0", "", "1:", ":2", "1:2:3", "-1:2", "1:70000"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW_MSG(st::parse_nnodes(bad), st::ConfigError, "expected N or MIN:MAX");
  }
  // On the command line: a configuration error (status 2) naming the flag and the fix.
  Result r = run("launch --nnodes 3:2 --master-addr h --exec -- true");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--nnodes '3:2': MIN 3 is above MAX 2: give --nnodes MIN:MAX with MIN ≤ "
                          "MAX (e.g. --nnodes 2:3)"),
            std::string::npos)
      << r.output;
  r = run("launch --nnodes a:b --master-addr h --exec -- true");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--nnodes 'a:b': expected N or MIN:MAX"), std::string::npos) << r.output;
  r = run("launch --nnodes 1:2 --exec -- true");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--nnodes 1:2 needs --master-addr"), std::string::npos) << r.output;
  // CPU jobs over several nodes run as one mpirun: no elastic node count there.
  r = run("launch --nnodes 1:2 --master-addr h -- train --device cpu");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--hostfile"), std::string::npos) << r.output;
  const fs::path dir = temp_dir("nnodes_parse");
  std::ofstream(dir / "hosts") << "localhost slots=1\n127.0.0.1 slots=1\n";
  r = run("launch --hostfile " + (dir / "hosts").string() +
          " --nnodes 1:2 --dry-run -- train --device cpu");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--nnodes 1:2 with --hostfile works for GPU jobs and --exec"),
            std::string::npos)
      << r.output;
  r = run("launch --hostfile " + (dir / "hosts").string() + " --nnodes 3:4 --exec -- true");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("lists 2 host(s) but --nnodes 3:4 needs at least 3"), std::string::npos)
      << r.output;
  fs::remove_all(dir);
}

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::string s;
  std::getline(in, s);
  return s;
}

/// Two node launchers of `--nnodes NNODES` on this machine (--exec, one rank each); once both
/// ranks run, node 1's launcher is killed (SIGKILL). Every rank writes its WORLD_SIZE to
/// DIR/ws.RESTART.RANK; ranks of the first attempt then sleep, those of a restart exit 0. Returns
/// node 0's output, with "node0_status=S" at its end (node 0's launcher gets SIGTERM after 45 s).
Result elastic_run(const fs::path& dir, const std::string& nnodes, int port) {
  const std::string program =
      "sh -c 'echo $WORLD_SIZE > " + dir.string() +
      "/ws.${SHARDTRAIN_RESTART_COUNT:-0}.$RANK; if [ \"${SHARDTRAIN_RESTART_COUNT:-0}\" = 0 ]; "
      "then exec sleep 60; fi'";
  const std::string launch = std::string("env OMP_NUM_THREADS=1 ") + SHARDTRAIN_BINARY +
                             " launch --nnodes " + nnodes +
                             " --master-addr 127.0.0.1 --master-port " + std::to_string(port) +
                             " --max-restarts 1 --rdzv-last-call 2 --stop-grace 2 --exec";
  const std::string d = dir.string();
  const std::string script =
      launch + " --node-rank 1 -- " + program + " > " + d + "/node1.log 2>&1 &\nN1=$!\n" +
      "timeout 45 " + launch + " --node-rank 0 -- " + program + " > " + d +
      "/node0.log 2>&1 &\nN0=$!\n" + "for i in $(seq 200); do [ -f " + d + "/ws.0.0 ] && [ -f " +
      d + "/ws.0.1 ] && break; sleep 0.1; done\n" + "kill -9 $N1\nwait $N0; S=$?\n" + "cat " + d +
      "/node0.log; echo node0_status=$S\n";
  std::ofstream(dir / "run.sh") << script;
  return run_shell("sh " + (dir / "run.sh").string());
}

}  // namespace

// torchrun's elastic node count: two node launchers of `--nnodes 1:2` start the job with world
// size 2; node 1's launcher dies mid-run; node 0's launcher notices (its heartbeat stops for
// --rdzv-last-call seconds), stops its ranks, meets again without node 1 and restarts the job
// alone: world size 1, and it finishes. With `--nnodes 2:3` one node is too few: launch stops
// with a message naming how many came back and MIN.
TEST(Launch, ElasticNodesRestartWithoutADeadNode) {
  const fs::path dir = temp_dir("elastic");
  const int port = 31000 + static_cast<int>(::getpid() % 2000) * 2;
  Result r = elastic_run(dir, "1:2", port);
  EXPECT_NE(r.output.find("node0_status=0"), std::string::npos) << r.output;
  EXPECT_EQ(read_text(dir / "ws.0.0"), "2") << r.output;
  EXPECT_EQ(read_text(dir / "ws.0.1"), "2") << r.output;
  EXPECT_EQ(read_text(dir / "ws.1.0"), "1") << "the restart's world size\n" << r.output;
  EXPECT_FALSE(fs::exists(dir / "ws.1.1")) << r.output;
  EXPECT_NE(r.output.find("node 1 ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("its launcher stopped answering for 2 s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restart 1 of 1 with 1 node(s) (was 2)"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 40) << r.output;

  fs::remove_all(dir);
  fs::create_directories(dir);
  r = elastic_run(dir, "2:3", port + 4);
  EXPECT_EQ(r.output.find("node0_status=0"), std::string::npos) << r.output;
  EXPECT_EQ(read_text(dir / "ws.0.0"), "2") << r.output;
  EXPECT_NE(r.output.find("only 1 node(s) came back for restart 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--nnodes 2:3 needs at least 2"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "ws.1.0")) << r.output;
  EXPECT_LT(r.seconds, 40) << r.output;
  fs::remove_all(dir);
}

// With --hostfile (GPU jobs and --exec) and --nnodes MIN:MAX, a node whose rank failed is left out
// of the restart while MIN nodes remain.
TEST(Launch, ElasticHostfileDropsTheFailedNode) {
  const fs::path dir = temp_dir("elastic_hostfile");
  std::ofstream(dir / "hosts") << "localhost slots=1\n127.0.0.1 slots=1\n";
  const Result r =
      run("launch --hostfile " + (dir / "hosts").string() +
          " --nnodes 1:2 --max-restarts 1 --exec -- sh -c 'echo \"ws=$WORLD_SIZE r=$RANK "
          "c=${SHARDTRAIN_RESTART_COUNT:-0}\"; if [ \"$RANK\" = 1 ]; then exit 4; fi'");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("ws=2 r=1 c=0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restart 1 of 1 with 1 node(s) (was 2)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ws=1 r=0 c=1"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("r=1 c=1"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// ---- CPU training with several ranks ---------------------------------------------------------

TEST(LaunchTrain, TwoRanksTrainThroughMpirun) {
  const fs::path dir = temp_dir("train2");
  const Result r = run("launch --nproc-per-node 2 -- " + train_args(dir));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("× 2 ranks"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, "done | 3 steps"), 1u) << "only rank 0 prints\n" << r.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-000003" / "manifest.json"));
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-000003" / "rank-00001-of-00002.safetensors"));
  fs::remove_all(dir);
}

/// What a training run wrote to metrics.jsonl: the loss of every step (--log-interval 1) and the
/// last validation.
struct RunLog {
  std::vector<double> losses;
  double val_loss = std::nan("");
  int64_t val_samples = -1;
};

RunLog read_run_log(const fs::path& metrics) {
  RunLog log;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto rec = nlohmann::json::parse(line);
    if (rec.contains("loss") && rec.contains("grad_norm"))
      log.losses.push_back(rec["loss"].get<double>());
    if (rec.contains("val_samples")) {
      log.val_loss = rec["val_loss"].get<double>();
      log.val_samples = rec["val_samples"].get<int64_t>();
    }
  }
  return log;
}

double rel_diff(double a, double b) { return std::fabs(a - b) / std::max(1e-12, std::fabs(b)); }

// What multi-rank runs report is the global batch's: 1, 2 and 4 ranks with the same global batch
// (4 samples: micro-batches of 4, 2 and 1) log the same training loss at every step, and the same
// validation loss over all 37 validation samples (37 does not divide by 2 or 4: every sample is
// counted once), within 1e-5 relative.
TEST(LaunchTrain, RanksLogTheGlobalLossAndTheWholeValidation) {
  const fs::path dir = temp_dir("global_loss");
  const std::string data = std::string(SHARDTRAIN_TEST_DATA_DIR) + "/wikitext-2/";
  const std::string common =
      "train --model gpt2-micro --device cpu --train-file " + data + "wiki.valid.tokens" +
      " --valid-file " + data + "wiki.test.tokens --eval-samples 37 --num-samples 64 " +
      "--max-length 32 --train-batch-size 4 --max-steps 4 --log-interval 1 --no-save " +
      "--cache-dir " + (dir / "cache").string();
  std::vector<RunLog> logs;
  for (int ranks : {1, 2, 4}) {
    const fs::path out = dir / ("out" + std::to_string(ranks));
    const Result r = run("launch --nproc-per-node " + std::to_string(ranks) + " -- " + common +
                         " --output-dir " + out.string());
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("| 37 samples in"), std::string::npos) << r.output;
    logs.push_back(read_run_log(out / "metrics.jsonl"));
  }
  const RunLog& one = logs[0];
  ASSERT_EQ(one.losses.size(), 4u);
  ASSERT_EQ(one.val_samples, 37);
  for (size_t i = 1; i < logs.size(); ++i) {
    const int ranks = i == 1 ? 2 : 4;
    ASSERT_EQ(logs[i].losses.size(), one.losses.size()) << ranks << " ranks";
    for (size_t s = 0; s < one.losses.size(); ++s)
      EXPECT_LE(rel_diff(logs[i].losses[s], one.losses[s]), 1e-5)
          << ranks << " ranks, step " << s + 1 << ": " << logs[i].losses[s] << " vs "
          << one.losses[s];
    EXPECT_EQ(logs[i].val_samples, 37) << ranks << " ranks";
    EXPECT_LE(rel_diff(logs[i].val_loss, one.val_loss), 1e-5)
        << ranks << " ranks: " << logs[i].val_loss << " vs " << one.val_loss;
  }
  fs::remove_all(dir);
}

// Elastic restarts (`launch --max-restarts`, torchrun's flag): rank 1 is killed once, in step 3
// (after the checkpoint of step 2) or in step 1 (before any checkpoint); the launcher stops rank 0,
// restarts the job — resuming from the latest checkpoint, or from the start — and it ends with
// the uninterrupted run's losses, every step in metrics.jsonl once. A job that fails on its input
// is not restarted.
TEST(LaunchTrain, MaxRestartsResumeFromTheLatestCheckpoint) {
  const fs::path dir = temp_dir("restarts");
  const std::string common =
      std::string("train --model gpt2-micro --device cpu --train-file ") +
      SHARDTRAIN_TEST_DATA_DIR +
      "/wikitext-2/wiki.valid.tokens --num-samples 128 --max-length 32 --batch-size 2 "
      "--max-steps 6 --save-interval 2 --log-interval 1 --cache-dir " +
      (dir / "cache").string() + " --output-dir " + (dir / "out").string();
  const auto steps_of = [](const fs::path& metrics) {
    std::vector<int64_t> steps;
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) {
      const auto rec = nlohmann::json::parse(line);
      if (rec.contains("loss") && rec.contains("grad_norm")) steps.push_back(rec["step"]);
    }
    return steps;
  };
  const Result plain = run("launch --nproc-per-node 2 -- " + common);
  ASSERT_EQ(plain.status, 0) << plain.output;
  const RunLog want = read_run_log(dir / "out" / "metrics.jsonl");
  ASSERT_EQ(want.losses.size(), 6u);
  const std::vector<int64_t> all_steps = {1, 2, 3, 4, 5, 6};
  // Fault 24: rank 1's 24th collective, in step 3; fault 12: in step 1 (2 ranks, gpt2-micro, dp).
  for (const auto& [op, from] : {std::pair{24, std::string("from the latest checkpoint of")},
                                 std::pair{12, std::string("from the start")}}) {
    fs::remove_all(dir / "out");
    fs::remove(dir / "fired");
    const Result r =
        run("launch --nproc-per-node 2 --max-restarts 1 -- " + common,
            "SHARDTRAIN_TEST_KILL_RANK=1 SHARDTRAIN_TEST_FAULT_OP=" + std::to_string(op) +
                " SHARDTRAIN_TEST_FAULT_ONCE=" + (dir / "fired").string());
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_TRUE(fs::exists(dir / "fired")) << "the fault did not fire\n" << r.output;
    EXPECT_NE(r.output.find("restart 1 of 1, " + from), std::string::npos) << r.output;
    if (op == 24) {
      EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    }
    EXPECT_EQ(steps_of(dir / "out" / "metrics.jsonl"), all_steps) << r.output;
    const RunLog got = read_run_log(dir / "out" / "metrics.jsonl");
    ASSERT_EQ(got.losses.size(), want.losses.size());
    for (size_t i = 0; i < want.losses.size(); ++i)
      EXPECT_LE(rel_diff(got.losses[i], want.losses[i]), 1e-6)
          << "fault " << op << ", step " << i + 1;
  }
  // Without --max-restarts the job fails; a rank that rejects its input is not restarted.
  fs::remove(dir / "fired");
  Result r = run("launch --nproc-per-node 2 -- " + common,
                 "SHARDTRAIN_TEST_KILL_RANK=1 SHARDTRAIN_TEST_FAULT_OP=24 "
                 "SHARDTRAIN_TEST_FAULT_ONCE=" +
                     (dir / "fired").string());
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("launch: the job failed"), std::string::npos) << r.output;
  r = run("launch --nproc-per-node 2 --max-restarts 3 -- " + common + " --lr -1");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("launch: the job failed"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// mpirun gives ranks a pseudo-terminal as stdout whatever its own stdout is; the progress bar
// must follow the launcher's stdout instead: none in a file, and (the control) there when the
// launcher says its stdout is a terminal.
TEST(LaunchTrain, NoProgressBarWhenStdoutIsAFile) {
  const fs::path dir = temp_dir("bar");
  const std::string cmd = std::string(SHARDTRAIN_BINARY) + " launch --nproc-per-node 2 -- " +
                          train_args(dir) + " --no-save > " + (dir / "log.txt").string();
  const auto file_text = [&] {
    std::ifstream in(dir / "log.txt");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  Result r = run_shell("env OMP_NUM_THREADS=1 " + cmd);
  ASSERT_EQ(r.status, 0) << r.output;
  std::string text = file_text();
  EXPECT_NE(text.find("done | 3 steps"), std::string::npos) << text;
  EXPECT_EQ(text.find('\r'), std::string::npos) << "progress bar redraws in the file:\n" << text;
  EXPECT_EQ(text.find("tok/s"), std::string::npos) << text;

  r = run_shell("env OMP_NUM_THREADS=1 SHARDTRAIN_STDOUT_TTY=1 " + cmd);
  ASSERT_EQ(r.status, 0) << r.output;
  text = file_text();
  EXPECT_NE(text.find("\r["), std::string::npos) << "the control run drew no bar:\n" << text;
  fs::remove_all(dir);
}

TEST(LaunchTrain, RanksWithoutMpiFailClearly) {
  const fs::path dir = temp_dir("nompi");
  // Variables as torchrun sets them, but no mpirun behind them: CPU ranks need MPI.
  const Result r = run(train_args(dir), "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("error: rank 0: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("CPU ranks communicate through MPI"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// ---- failures: (a) a rank hangs, (b) a rank exits or dies -----------------------------------

TEST(LaunchFailure, HangingRankIsNamedUnderTheLauncher) {
  const fs::path dir = temp_dir("hang_launch");
  const Result r = run("launch --nproc-per-node 2 --comm-timeout 3 -- " + train_args(dir),
                       "SHARDTRAIN_TEST_HANG_RANK=1");
  EXPECT_NE(r.status, 0) << r.output;
  // dp's first collective: the tied-embedding exchange checks that every rank hands over as many
  // embedding rows (parallel/tied_embedding_grad.h).
  EXPECT_NE(r.output.find("error: rank 0: all_gather #1 did not complete within 3 s: rank 1 has "
                          "not joined it (it is stuck or dead)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("error: the job failed"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
  fs::remove_all(dir);
}

TEST(LaunchFailure, RankHangingInAPipelineTransferIsNamed) {
  const fs::path dir = temp_dir("hang_p2p");
  // Rank 1 (the last stage) hangs before its third send/recv: rank 0 waits for an activation
  // gradient that never comes, and its timeout names rank 1.
  const Result r = run("launch --nproc-per-node 2 --comm-timeout 3 -- " + train_args(dir) +
                           " --strategy pipeline --pipeline-stages 2 "
                           "--gradient-accumulation-steps 4",
                       "SHARDTRAIN_TEST_HANG_RANK=1 SHARDTRAIN_TEST_FAULT_P2P=3");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("from rank 1 did not complete within 3 s: rank 1 has not joined it"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("error: the job failed"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
  fs::remove_all(dir);
}

TEST(LaunchFailure, RankHangingInAGradientReduceScatterIsNamed) {
  const fs::path dir = temp_dir("hang_reduce_scatter");
  // Rank 1 hangs before zero2's third gradient reduce-scatter (SHARDTRAIN_TEST_FAULT_NAME counts
  // only collectives of that kind): rank 0's reduce-scatter times out naming rank 1.
  const Result r =
      run("launch --nproc-per-node 2 --comm-timeout 3 -- " + train_args(dir) + " --strategy zero2",
          "SHARDTRAIN_TEST_HANG_RANK=1 SHARDTRAIN_TEST_FAULT_NAME=reduce_scatter "
          "SHARDTRAIN_TEST_FAULT_OP=3");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("reduce_scatter #"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 has not joined it"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
  fs::remove_all(dir);
}

TEST(LaunchFailure, HangingRankIsNamedUnderMpirun) {
  const fs::path dir = temp_dir("hang_mpirun");
  const Result r =
      run_shell(std::string("env OMP_NUM_THREADS=1 SHARDTRAIN_TEST_HANG_RANK=0 ") +
                SHARDTRAIN_MPIEXEC + " --oversubscribe --allow-run-as-root --bind-to none -np 3 " +
                SHARDTRAIN_BINARY + " " + train_args(dir) + " --comm-timeout 3");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("did not complete within 3 s: rank 0 has not joined it (it is stuck or "
                          "dead)"),
            std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
  fs::remove_all(dir);
}

TEST(LaunchFailure, ExitingRankStopsTheJobUnderTheLauncher) {
  const fs::path dir = temp_dir("exit_launch");
  const Result r =
      run("launch --nproc-per-node 2 -- " + train_args(dir), "SHARDTRAIN_TEST_EXIT_RANK=1");
  EXPECT_EQ(r.status, 3) << r.output;
  // mpirun names the process by its rank: "Process name: [[job,1],1]", exit code 3.
  EXPECT_NE(r.output.find(",1],1]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("error: the job failed (mpirun exited with status 3)"), std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
  fs::remove_all(dir);
}

TEST(LaunchFailure, KilledRankStopsTheJobUnderMpirun) {
  const fs::path dir = temp_dir("kill_mpirun");
  const Result r =
      run_shell(std::string("env OMP_NUM_THREADS=1 SHARDTRAIN_TEST_KILL_RANK=1 ") +
                SHARDTRAIN_MPIEXEC + " --oversubscribe --allow-run-as-root --bind-to none -np 2 " +
                SHARDTRAIN_BINARY + " " + train_args(dir));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("process rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("signal 9"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
  fs::remove_all(dir);
}

TEST(LaunchFailure, RankErrorsNameTheRank) {
  const fs::path dir = temp_dir("rank_error");
  // A missing data file fails on every rank, each naming itself; the job stops.
  std::string args = train_args(dir);
  args.replace(args.find("--train-file ") + 13, 0, "/nonexistent");
  const Result r = run("launch --nproc-per-node 2 -- " + args);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("error: rank "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("/nonexistent"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
  fs::remove_all(dir);
}

// ---- one error, once -----------------------------------------------------------------------

// An error of a job is reported once: rank 0 at once, every other rank only after a grace period
// (5 s, below half the communication timeout) in which a launcher that saw rank 0 fail stops it.
TEST(ErrorReport, RankZeroAtOnceOthersAfterTheGrace) {
  using shardtrain::plan_error_report;
  // A single process: no rank, no wait.
  auto r = plan_error_report("error: ", "bad flag", true, 0, 1, 5);
  EXPECT_EQ(r.text, "error: bad flag\n");
  EXPECT_EQ(r.delay_s, 0);
  r = plan_error_report("error: ", "bad flag", false, 0, 1, 5);
  EXPECT_EQ(r.text, "error: bad flag\n");
  // The same on every rank: rank 0 without a rank; others name theirs after the grace.
  r = plan_error_report("error: ", "bad flag", true, 0, 4, 5);
  EXPECT_EQ(r.text, "error: bad flag\n");
  EXPECT_EQ(r.delay_s, 0);
  r = plan_error_report("error: ", "bad flag", true, 3, 4, 5);
  EXPECT_EQ(r.text, "error: rank 3: bad flag\n");
  EXPECT_EQ(r.delay_s, 5);
  // This rank's own: named on every rank.
  r = plan_error_report("error: ", "no file", false, 0, 4, 5);
  EXPECT_EQ(r.text, "error: rank 0: no file\n");
  EXPECT_EQ(r.delay_s, 0);
  r = plan_error_report("error: ", "no file", false, 2, 4, 1.5);
  EXPECT_EQ(r.text, "error: rank 2: no file\n");
  EXPECT_EQ(r.delay_s, 1.5);
  // A message naming its rank already gets no second one; CLI11's text comes without a lead
  // and keeps its own line ends.
  r = plan_error_report("error: ", "rank 1: all_reduce #3 did not complete", false, 1, 2, 5);
  EXPECT_EQ(r.text, "error: rank 1: all_reduce #3 did not complete\n");
  r = plan_error_report("error: ", "ranked: x", false, 1, 2, 5);
  EXPECT_EQ(r.text, "error: rank 1: ranked: x\n");
  r = plan_error_report("", "Unknown flag\nRun with --help\n", true, 0, 2, 5);
  EXPECT_EQ(r.text, "Unknown flag\nRun with --help\n");
}

namespace {

/// A DeepSpeed config whose batch sizes do not add up on 4 ranks: 4 ≠ 2 × 1 × 4.
fs::path bad_batch_json(const fs::path& dir) {
  const fs::path p = dir / "ds.json";
  std::ofstream(p) << R"({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                          "gradient_accumulation_steps": 1})";
  return p;
}

const std::string kBatchError =
    "batch sizes do not add up: train_batch_size 4 != train_micro_batch_size_per_gpu 2 × "
    "gradient_accumulation_steps 1 × world size 4 = 8: set train_batch_size to 8, or "
    "train_micro_batch_size_per_gpu to 1 (flags: --train-batch-size, --batch-size, "
    "--gradient-accumulation-steps)";

/// Whether `line` is a whole line of `output`.
bool has_line(const std::string& output, const std::string& line) {
  return ("\n" + output).find("\n" + line + "\n") != std::string::npos;
}

}  // namespace

// Every rank validates the same flags and JSON and fails the same way: the message appears once,
// as a whole line of its own, naming no rank.
TEST(LaunchFailure, SameErrorOnEveryRankIsPrintedOnce) {
  const fs::path dir = temp_dir("same_error");
  std::string args = train_args(dir);
  args.replace(args.find("--batch-size 2"), 14,
               "--deepspeed_config " + bad_batch_json(dir).string());
  Result r = run("launch --nproc-per-node 4 -- " + args);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_EQ(count(r.output, "batch sizes do not add up"), 1u) << r.output;
  EXPECT_TRUE(has_line(r.output, "error: " + kBatchError)) << r.output;
  EXPECT_EQ(count(r.output, "error: rank "), 0u) << r.output;

  // A bad flag: CLI11's message, once.
  r = run("launch --nproc-per-node 4 -- " + train_args(dir) + " --no-such-flag");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_EQ(count(r.output, "--no-such-flag"), 1u) << r.output;

  // Missing data on every rank: once, rank 0's (a data file may be missing on some ranks only,
  // so it names the rank).
  args = train_args(dir);
  args.replace(args.find("--train-file ") + 13, 0, "/nonexistent");
  r = run("launch --nproc-per-node 4 -- " + args);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_EQ(count(r.output, "not found: check --train-file"), 1u) << r.output;
  EXPECT_EQ(count(r.output, "error: rank 0: /nonexistent"), 1u) << r.output;
  fs::remove_all(dir);
}

// Errors that only some ranks raise still appear, naming the rank, also those that every rank
// would raise the same way from the same flags (here rank 2 alone is given other flags: mpirun's
// MPMD form). Rank 0 does not fail, so rank 2 prints after its grace.
TEST(LaunchFailure, RankSpecificErrorNamesItsRank) {
  const fs::path dir = temp_dir("rank2_error");
  const std::string good = train_args(dir) + " --no-save";
  std::string missing = good;
  missing.replace(missing.find("--train-file ") + 13, 0, "/nonexistent");
  std::string bad_json = good;
  bad_json.replace(bad_json.find("--batch-size 2"), 14,
                   "--deepspeed_config " + bad_batch_json(dir).string());
  const std::string bin = SHARDTRAIN_BINARY;
  for (const std::string& rank2 : {missing, bad_json}) {
    const Result r =
        run_shell(std::string("env OMP_NUM_THREADS=1 ") + SHARDTRAIN_MPIEXEC +
                  " --oversubscribe --allow-run-as-root --bind-to none -np 2 " + bin + " " + good +
                  " : -np 1 " + bin + " " + rank2 + " : -np 1 " + bin + " " + good);
    EXPECT_NE(r.status, 0) << r.output;
    const std::string line =
        rank2 == missing ? "error: rank 2: /nonexistent" : "error: rank 2: " + kBatchError;
    EXPECT_EQ(count(r.output, "error: "), 1u) << r.output;
    EXPECT_EQ(count(r.output, line), 1u) << r.output;
    EXPECT_LT(r.seconds, 60) << r.output;
  }
  fs::remove_all(dir);
}
