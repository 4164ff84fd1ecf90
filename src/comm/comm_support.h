// Pieces shared by the MPI and NCCL communicators. Header-only on purpose: the CUDA library
// (shardtrain_cuda, which holds the NCCL communicator) links before shardtrain_lib and must not
// need its symbols; it reaches the TCP store and MPI only through the Bootstrap interface.
#pragma once

#include <fmt/core.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace shardtrain {

/// A shared key-value board for progress reports: each rank publishes how far it got, and a rank
/// whose operation timed out reads the others' to name the laggards. One object per thread.
class ProgressBoard {
 public:
  virtual ~ProgressBoard() = default;
  /// Best effort: failures are ignored (the board is a diagnostic aid).
  virtual void publish(const std::string& key, const std::string& value) = 0;
  /// The value of `key`, or nullopt when absent or the board is unreachable.
  virtual std::optional<std::string> read(const std::string& key) = 0;
};

/// Startup exchange among the ranks of the world (the NCCL unique id) and the progress board.
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  /// Copies `bytes` bytes at `data` on world rank `root` to `data` on every rank. Collective over
  /// the world. Throws RuntimeFailure when the other ranks do not arrive in time.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  /// A new connection to the progress board for the calling thread, or nullptr when there is none.
  virtual std::unique_ptr<ProgressBoard> connect_board() = 0;
};

/// "1 rank", "3 ranks".
inline std::string count_ranks(size_t n, const char* unit = "rank") {
  return fmt::format("{} {}{}", n, unit, n == 1 ? "" : "s");
}

/// "rank 1", "ranks 1, 3 and 4".
inline std::string name_ranks(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += i + 1 == ranks.size() ? " and " : ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

/// "[0, 2, 4]".
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s + "]";
}

/// Fault injection for the failure tests (docs/LAUNCHING.md, "Testing failures"): before its
/// collective number $SHARDTRAIN_TEST_FAULT_OP (1-based, default 1) on any communicator, the rank
/// whose world rank is $SHARDTRAIN_TEST_HANG_RANK sleeps $SHARDTRAIN_TEST_HANG_SECONDS (default
/// 3600) without communicating, $SHARDTRAIN_TEST_EXIT_RANK exits with status 3, and
/// $SHARDTRAIN_TEST_KILL_RANK kills itself with SIGKILL. With $SHARDTRAIN_TEST_FAULT_P2P = N set,
/// the fault comes before the rank's N-th point-to-point operation (send or recv, 1-based: a
/// pipeline transfer) instead of a collective; with $SHARDTRAIN_TEST_FAULT_NAME = OP (e.g.
/// reduce_scatter, all_reduce) it comes before the communicator's FAULT_OP-th collective of that
/// kind (a gradient reduction rather than whichever collective has that number). With
/// $SHARDTRAIN_TEST_FAULT_ONCE = FILE the fault fires only while FILE does not exist, and creates
/// it (a job restarted by `launch --max-restarts` then runs through). Unset variables inject
/// nothing.
class FaultInjection {
 public:
  /// Reads the variables for the process of world rank `world_rank`.
  static FaultInjection from_env(int world_rank) {
    FaultInjection f;
    auto num = [](const char* name, long long fallback) {
      const char* v = std::getenv(name);
      return v && *v ? std::atoll(v) : fallback;
    };
    f.op_ = num("SHARDTRAIN_TEST_FAULT_OP", 1);
    f.p2p_op_ = num("SHARDTRAIN_TEST_FAULT_P2P", 0);
    if (const char* name = std::getenv("SHARDTRAIN_TEST_FAULT_NAME")) f.name_ = name;
    f.hang_s_ = static_cast<double>(num("SHARDTRAIN_TEST_HANG_SECONDS", 3600));
    if (num("SHARDTRAIN_TEST_HANG_RANK", -1) == world_rank) f.kind_ = kHang;
    if (num("SHARDTRAIN_TEST_EXIT_RANK", -1) == world_rank) f.kind_ = kExit;
    if (num("SHARDTRAIN_TEST_KILL_RANK", -1) == world_rank) f.kind_ = kKill;
    if (const char* once = std::getenv("SHARDTRAIN_TEST_FAULT_ONCE")) f.once_ = once;
    return f;
  }
  /// Called before collective number `seq` (1-based) named `op` is issued.
  void before_collective(int64_t seq, const char* op) {
    if (p2p_op_ != 0) return;
    if (name_.empty()) {
      if (seq == op_) inject(seq, op);
    } else if (name_ == op && ++named_ == op_) {
      inject(seq, op);
    }
  }
  /// Called before point-to-point operation number `seq` (1-based, sends and receives counted
  /// together) named `op` ("send", "recv") is issued.
  void before_p2p(int64_t seq, const char* op) const {
    if (p2p_op_ > 0 && seq == p2p_op_) inject(seq, op);
  }

 private:
  void inject(int64_t seq, const char* op) const {
    if (kind_ == kNone) return;
    if (!once_.empty()) {  // at most once per job, whatever restarts it: the file says it fired
      if (std::FILE* f = std::fopen(once_.c_str(), "r")) {
        std::fclose(f);
        return;
      }
      if (std::FILE* f = std::fopen(once_.c_str(), "w")) std::fclose(f);
    }
    if (kind_ == kHang) {
      std::this_thread::sleep_for(std::chrono::duration<double>(hang_s_));
    } else if (kind_ == kExit) {
      std::fprintf(stderr, "test fault: exiting with status 3 before %s #%lld\n", op,
                   static_cast<long long>(seq));
      std::fflush(stderr);
      std::_Exit(3);
    } else {
      ::kill(::getpid(), SIGKILL);
    }
  }

  enum Kind { kNone, kHang, kExit, kKill };
  Kind kind_ = kNone;
  long long op_ = 1;
  long long p2p_op_ = 0;  ///< > 0: fault before this point-to-point operation instead
  std::string name_;      ///< non-empty: count only collectives of this kind
  std::string once_;      ///< non-empty: inject only if this file does not exist (then create it)
  long long named_ = 0;   ///< collectives of kind name_ issued so far
  double hang_s_ = 3600;
};

/// Bounds a blocking call that has no timeout of its own (MPI_Comm_create_group, MPI_Finalize,
/// ncclCommInitRank): unless destroyed within `seconds`, prints "error: <message>" to stderr and
/// ends the process with exit status 1 (the launcher or mpirun then stops the other ranks).
class Watchdog {
 public:
  Watchdog(double seconds, std::string message) : message_(std::move(message)) {
    thread_ = std::thread([this, seconds]() {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) {
        std::fprintf(stderr, "error: %s\n", message_.c_str());
        std::fflush(stderr);
        std::_Exit(1);
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::string message_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace shardtrain
