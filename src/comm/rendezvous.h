// The rendezvous of `shardtrain launch --nnodes MIN:MAX` (torchrun's elastic node count): the
// launchers of a job, one per node, meet in a TCP store served by node 0's launcher at
// master-addr:master-port + 1, agree on which nodes run the job and in what order, watch each
// other while it runs, and meet again after a failure. docs/LAUNCHING.md describes the behaviour.
//
// Rounds are numbered 0, 1, 2, ... (round k runs the job's k-th restart). In each round every
// launcher joins; node 0's launcher (the store host, the coordinator) closes the round when MAX
// nodes joined, or — round 0 — when at least MIN joined and --rdzv-last-call seconds passed
// since the MIN-th joined, or — later rounds — when every live launcher has joined. A launcher
// that does not beat (every 0.5 s, from a thread of its own) for --rdzv-last-call seconds is
// gone: not waited for, and, while the job runs, a reason to stop it everywhere.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/launch.h"

namespace shardtrain {

class TcpStoreServer;
class TcpStoreClient;

struct RendezvousOptions {
  std::string master_addr = "127.0.0.1";  ///< address of node 0 (the store host)
  int port = 29501;                       ///< port of the launchers' store (master-port + 1)
  bool host = false;                      ///< this launcher serves the store: it is node 0
  int min_nodes = 1;
  int max_nodes = 1;
  int requested_rank = -1;  ///< --node-rank given to a non-host launcher (an order hint); -1: none
  int nproc = 1;            ///< ranks this node runs
  double last_call_s = 5;   ///< seconds (see the file comment)
  double join_timeout_s = 600;  ///< seconds round 0 waits for MIN nodes; clients wait to connect
};

/// What a closed round gave this launcher.
struct RendezvousRound {
  int round = 0;
  int node_rank = 0;
  int nnodes = 1;
  int rank_offset = 0;  ///< global rank of this node's local rank 0
  int world_size = 1;   ///< ranks of all nodes of the round
};

/// One launcher's side of the rendezvous. Not thread-safe (one per launcher, used from its main
/// thread); the heartbeat runs on a thread of its own with its own connection.
class ElasticRendezvous {
 public:
  /// Serves the store (when options.host) and connects to it, registers this launcher and
  /// starts its heartbeat. Throws RuntimeFailure when the store cannot be served (the port is in
  /// use) or reached within options.join_timeout_s seconds.
  explicit ElasticRendezvous(const RendezvousOptions& options);
  /// leave(1) unless called before; stops the heartbeat (and the host's store).
  ~ElasticRendezvous();
  ElasticRendezvous(const ElasticRendezvous&) = delete;
  ElasticRendezvous& operator=(const ElasticRendezvous&) = delete;

  /// The round a launcher starting now joins (0, or the one in progress for a late joiner).
  int current_round();

  /// Joins round `round` and waits until it closes. A launcher left out of it (more than MAX
  /// nodes came) waits for the next round, and so on: the round it runs in is in the result.
  /// Returns nullopt when the job ended meanwhile without this node. Throws RuntimeFailure when
  /// the round failed — fewer than MIN nodes came (the message names how many came and MIN), a
  /// node of the previous round asked not to restart (its status in `status`), or round 0 saw
  /// fewer than MIN nodes within options.join_timeout_s — or when the store was lost.
  std::optional<RendezvousRound> join(int round, int* status);

  /// Polled while the ranks of round `round` run: a request to stop them, when another node's
  /// ranks failed, a node's launcher went silent (the host checks), or the store was lost.
  /// Throttled: asks the store at most every 200 ms. Never throws.
  std::optional<StopRequest> poll(int round);

  /// Tells the other launchers that this node's ranks of round `round` failed with `status`
  /// (`reason` names what failed); with `final` the job is not to be restarted. Never throws.
  void report_failure(int round, int status, const std::string& reason, bool final);

  /// The status a node asked the job to end with instead of restarting after round `round`
  /// (its ranks rejected their input, or it ran out of restarts), if any. Never throws.
  std::optional<int> final_status(int round);

  /// This node's ranks of round `round` all succeeded. The host then waits until every other
  /// node of the round is done too and returns 0, or the failure status of one that failed or
  /// went silent (printing why); other launchers return 0 at once.
  int finish(int round);

  /// Tells the others this launcher is leaving; the host also ends the job with `status` for
  /// launchers waiting for a round (they exit with it) and waits up to 2 s for the other live
  /// launchers to leave before its store goes. Only the first call counts. Never throws.
  void leave(int status);

  /// Whether the connection to the store was lost (node 0's launcher exited or died).
  bool store_lost() const { return lost_; }
  /// "host:port" of the store.
  const std::string& address() const { return address_; }

 private:
  struct Entry {
    int id = 0;
    bool host = false;
    int requested = -1;
    int nproc = 1;
    int index = 0;  ///< join order
    std::string name;
  };
  struct Beat {
    int64_t value = -1;
    double changed = 0;  ///< seconds (steady clock) of the last change seen
  };

  std::optional<RendezvousRound> join_round(int round, int* status);
  void close_round(int round, int* status);
  void report(int round, int status, const std::string& reason, bool final, bool prefix);
  bool live(int id);
  void update_beats();
  std::vector<Entry> entries(int round);
  std::optional<RendezvousRound> await_result(int round, int* status);

  RendezvousOptions options_;
  std::unique_ptr<TcpStoreServer> server_;
  std::unique_ptr<TcpStoreClient> client_;
  std::string address_;
  int id_ = 0;
  std::atomic<bool> lost_{false};
  std::atomic<bool> stop_beat_{false};
  std::thread beat_thread_;
  std::map<int, Beat> beats_;
  std::set<int> gone_;                           ///< launchers that have left
  std::map<int, std::map<int, Entry>> entries_;  ///< per round: entries read, by join index
  std::map<int, std::vector<Entry>> members_;    ///< per round: the nodes that run it, in order
  double last_poll_ = -1;
  std::optional<StopRequest> stop_;  ///< the request poll() returned (returned again after)
  bool left_ = false;
};

/// Whether `host` is an address of this machine (it resolves to an address a socket here can
/// bind to): where `launch --nnodes MIN:MAX` without --node-rank serves the store.
bool is_local_address(const std::string& host);

}  // namespace shardtrain
