#include "comm/rendezvous.h"

#include <fmt/core.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>
#include <tuple>

#include "comm/tcp_store.h"
#include "core/error.h"

namespace shardtrain {
namespace {

// Keys in the launchers' store:
//   rdzv/launchers           counter: the last launcher id given out (ids start at 1)
//   rdzv/beat/ID             counter: launcher ID's heartbeat
//   rdzv/left/ID             launcher ID has exited
//   rdzv/round               the round node 0 is closing or running (late joiners start there)
//   rdzv/finished            node 0's launcher ended the job with this status
//   rdzv/rR/count            counter: entries of round R
//   rdzv/rR/entry/I          the I-th entry: "ID HOST(0|1) REQUESTED_RANK NPROC NAME"
//   rdzv/rR/result           "OK ID:NPROC:NAME ..." in node order, or "FAIL STATUS MESSAGE"
//   rdzv/rR/stop             "STATUS REASON": the job of round R is to stop (first failure)
//   rdzv/rR/nstop            counter: failures reported in round R
//   rdzv/rR/final            STATUS: the job is not to restart after round R
//   rdzv/rR/done/ID          launcher ID's ranks of round R succeeded

constexpr double kBeatInterval = 0.5;  // seconds
constexpr double kPollInterval = 0.2;  // seconds between poll()'s store queries

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

std::string round_key(int round, const std::string& what) {
  return fmt::format("rdzv/r{}/{}", round, what);
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}

/// "OK ID:NPROC:NAME ..." → the nodes in order (id, nproc, name).
struct Member {
  int id = 0;
  int nproc = 1;
  std::string name;
};

std::vector<Member> parse_members(const std::string& result) {
  std::vector<Member> out;
  std::istringstream in(result.substr(3));
  for (std::string w; in >> w;) {
    const size_t a = w.find(':');
    const size_t b = w.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    out.push_back({std::atoi(w.substr(0, a).c_str()), std::atoi(w.substr(a + 1, b - a - 1).c_str()),
                   w.substr(b + 1)});
  }
  return out;
}

/// A round that node 0 declared failed (its message says why).
struct RoundFailed : RuntimeFailure {
  using RuntimeFailure::RuntimeFailure;
};

/// "STATUS REST" → {STATUS, REST}.
std::pair<int, std::string> split_status(const std::string& s) {
  const size_t sp = s.find(' ');
  return {std::atoi(s.substr(0, sp).c_str()), sp == std::string::npos ? "" : s.substr(sp + 1)};
}

}  // namespace

bool is_local_address(const std::string& host) {
  if (is_local_host(host)) return true;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) return false;
  bool local = false;
  for (addrinfo* a = res; a != nullptr && !local; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    local = ::bind(fd, a->ai_addr, a->ai_addrlen) == 0;  // port 0 (getaddrinfo without service)
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return local;
}

ElasticRendezvous::ElasticRendezvous(const RendezvousOptions& options)
    : options_(options), address_(fmt::format("{}:{}", options.master_addr, options.port)) {
  if (options_.host) {
    server_ = std::make_unique<TcpStoreServer>("", options_.port);
    client_ = std::make_unique<TcpStoreClient>("127.0.0.1", options_.port, 10);
  } else {
    client_ = std::make_unique<TcpStoreClient>(options_.master_addr, options_.port,
                                               options_.join_timeout_s);
  }
  id_ = static_cast<int>(client_->add("rdzv/launchers", 1));
  client_->add(fmt::format("rdzv/beat/{}", id_), 1);
  const std::string host = options_.host ? "127.0.0.1" : options_.master_addr;
  beat_thread_ = std::thread([this, host] {
    try {
      TcpStoreClient beat(host, options_.port, 10);
      const std::string key = fmt::format("rdzv/beat/{}", id_);
      while (!stop_beat_) {
        beat.add(key, 1);
        for (double t = 0; t < kBeatInterval && !stop_beat_; t += 0.05) sleep_s(0.05);
      }
    } catch (const Error&) {
      lost_ = true;
    }
  });
}

ElasticRendezvous::~ElasticRendezvous() {
  leave(1);
  stop_beat_ = true;
  if (beat_thread_.joinable()) beat_thread_.join();
}

void ElasticRendezvous::leave(int status) {
  if (left_) return;
  left_ = true;
  if (lost_) return;
  try {
    client_->set(fmt::format("rdzv/left/{}", id_), "1");
    if (!options_.host) return;
    client_->set("rdzv/finished", std::to_string(status));
    // The others read "finished" before the store goes: wait (2 s at most) until every live
    // launcher has left.
    const double until = now_s() + 2;
    while (now_s() < until) {
      update_beats();
      const int registered = static_cast<int>(client_->add("rdzv/launchers", 0));
      bool waiting = false;
      for (int id = 1; id <= registered; ++id) waiting = waiting || (id != id_ && live(id));
      if (!waiting) break;
      sleep_s(0.05);
    }
  } catch (const Error&) {
    lost_ = true;
  }
}

int ElasticRendezvous::current_round() {
  if (options_.host) return 0;
  try {
    const auto v = client_->check("rdzv/round");
    return v ? std::atoi(v->c_str()) : 0;
  } catch (const Error&) {
    lost_ = true;
    return 0;
  }
}

void ElasticRendezvous::update_beats() {
  const double t = now_s();
  const int registered = static_cast<int>(client_->add("rdzv/launchers", 0));
  for (int id = 1; id <= registered; ++id) {
    if (id == id_ || gone_.count(id)) continue;
    if (client_->check(fmt::format("rdzv/left/{}", id))) {
      gone_.insert(id);
      continue;
    }
    const int64_t v = client_->add(fmt::format("rdzv/beat/{}", id), 0);
    Beat& b = beats_[id];
    if (v != b.value) {
      b.value = v;
      b.changed = t;
    }
  }
}

bool ElasticRendezvous::live(int id) {
  if (id == id_) return true;
  if (gone_.count(id)) return false;
  const auto it = beats_.find(id);
  return it != beats_.end() && now_s() - it->second.changed <= options_.last_call_s;
}

std::vector<ElasticRendezvous::Entry> ElasticRendezvous::entries(int round) {
  auto& cache = entries_[round];
  const int n = static_cast<int>(client_->add(round_key(round, "count"), 0));
  for (int i = 0; i < n; ++i) {
    if (cache.count(i)) continue;
    const auto v = client_->check(round_key(round, fmt::format("entry/{}", i)));
    if (!v) continue;  // added, not written yet
    std::istringstream in(*v);
    Entry e;
    int host = 0;
    in >> e.id >> host >> e.requested >> e.nproc >> e.name;
    e.host = host != 0;
    e.index = i;
    cache[i] = e;
  }
  std::vector<Entry> out;
  for (const auto& [i, e] : cache) out.push_back(e);
  return out;
}

std::optional<RendezvousRound> ElasticRendezvous::join(int round, int* status) {
  stop_.reset();
  last_poll_ = -1;
  try {
    check<RuntimeFailure>(!lost_, "lost");
    return join_round(round, status);
  } catch (const RoundFailed& e) {
    throw RuntimeFailure(e.what());
  } catch (const Error&) {
    lost_ = true;
    if (status) *status = 1;
    throw RuntimeFailure(fmt::format(
        "lost the rendezvous store at {} (node 0's launcher exited or died; it must run for the "
        "whole job)",
        address_));
  }
}

std::optional<RendezvousRound> ElasticRendezvous::join_round(int round, int* status) {
  const int index = static_cast<int>(client_->add(round_key(round, "count"), 1)) - 1;
  client_->set(round_key(round, fmt::format("entry/{}", index)),
               fmt::format("{} {} {} {} {}", id_, options_.host ? 1 : 0, options_.requested_rank,
                           options_.nproc, host_name()));
  if (options_.host) close_round(round, status);
  return await_result(round, status);
}

void ElasticRendezvous::close_round(int round, int* status) {
  client_->set("rdzv/round", std::to_string(round));
  const int lo = options_.min_nodes, hi = options_.max_nodes;
  const double start = now_s();
  double min_at = -1;
  const auto fail = [&](int code, const std::string& message) {
    client_->set(round_key(round, "result"), fmt::format("FAIL {} {}", code, message));
  };
  for (;;) {
    if (round > 0) {
      if (const auto fin = client_->check(round_key(round - 1, "final"))) {
        fail(std::atoi(fin->c_str()),
             fmt::format("a node asked not to restart the job (status {})", *fin));
        return;
      }
    }
    update_beats();
    std::vector<Entry> joined;
    std::set<int> ids;
    for (const Entry& e : entries(round))
      if (live(e.id) && ids.insert(e.id).second) joined.push_back(e);
    const int n = static_cast<int>(joined.size());
    const double t = now_s();
    bool close = n >= hi;
    if (!close && round == 0) {
      if (n >= lo && min_at < 0) min_at = t;
      if (n < lo) min_at = -1;
      close = min_at >= 0 && t - min_at >= options_.last_call_s;
      if (!close && t - start >= options_.join_timeout_s) {
        if (status) *status = 1;
        fail(1, fmt::format("only {} node(s) joined within --rdzv-timeout {:g} s; --nnodes {}:{} "
                            "needs at least {}",
                            n, options_.join_timeout_s, lo, hi, lo));
        return;
      }
    } else if (!close) {
      // A restart: wait for every launcher still alive (a dead one is gone after
      // --rdzv-last-call seconds without a heartbeat), then run with those that came.
      const int registered = static_cast<int>(client_->add("rdzv/launchers", 0));
      bool pending = false;
      for (int id = 1; id <= registered; ++id) pending = pending || (live(id) && !ids.count(id));
      if (!pending || t - start >= options_.join_timeout_s) {
        if (n >= lo) {
          close = true;
        } else {
          fail(1, fmt::format("only {} node(s) came back for restart {} (a node whose launcher is "
                              "silent for --rdzv-last-call {:g} s is not waited for); --nnodes "
                              "{}:{} needs at least {}",
                              n, round, options_.last_call_s, lo, hi, lo));
          return;
        }
      }
    }
    if (close) {
      std::sort(joined.begin(), joined.end(), [](const Entry& a, const Entry& b) {
        const auto key = [](const Entry& e) {
          return std::tuple(e.host ? 0 : 1, e.requested < 0 ? INT_MAX : e.requested, e.index);
        };
        return key(a) < key(b);
      });
      if (static_cast<int>(joined.size()) > hi) joined.resize(static_cast<size_t>(hi));
      std::string result = "OK";
      for (const Entry& e : joined) result += fmt::format(" {}:{}:{}", e.id, e.nproc, e.name);
      client_->set(round_key(round, "result"), result);
      return;
    }
    sleep_s(0.05);
  }
}

std::optional<RendezvousRound> ElasticRendezvous::await_result(int round, int* status) {
  for (;;) {
    check<RuntimeFailure>(!lost_, "lost");
    if (const auto fin = client_->check("rdzv/finished")) {
      if (status) *status = std::atoi(fin->c_str());
      return std::nullopt;
    }
    if (const auto result = client_->check(round_key(round, "result"))) {
      if (result->rfind("FAIL ", 0) == 0) {
        const auto [code, message] = split_status(result->substr(5));
        if (status) *status = code;
        throw RoundFailed(message);
      }
      const std::vector<Member> members = parse_members(*result);
      members_[round].clear();
      RendezvousRound r;
      r.round = round;
      r.nnodes = static_cast<int>(members.size());
      r.node_rank = -1;
      int ranks = 0;
      for (size_t i = 0; i < members.size(); ++i) {
        members_[round].push_back(
            {members[i].id, false, -1, members[i].nproc, static_cast<int>(i), members[i].name});
        if (members[i].id == id_) {
          r.node_rank = static_cast<int>(i);
          r.rank_offset = ranks;
        }
        ranks += members[i].nproc;
      }
      r.world_size = ranks;
      if (r.node_rank >= 0) return r;
      std::fprintf(stderr,
                   "launch: round %d of the rendezvous at %s runs with %d node(s) (the most "
                   "--nnodes allows) without this one; waiting for the next round\n",
                   round, address_.c_str(), r.nnodes);
      std::fflush(stderr);
      return join_round(round + 1, status);
    }
    sleep_s(0.05);
  }
}

std::optional<StopRequest> ElasticRendezvous::poll(int round) {
  if (stop_) return stop_;
  const double t = now_s();
  if (t - last_poll_ < kPollInterval) return std::nullopt;
  last_poll_ = t;
  const std::string lost_reason = fmt::format(
      "lost the rendezvous store at {} (node 0's launcher exited or died; it must run for the "
      "whole job)",
      address_);
  if (lost_) return stop_ = StopRequest{1, lost_reason};
  try {
    if (const auto v = client_->check(round_key(round, "stop"))) {
      const auto [code, reason] = split_status(*v);
      return stop_ = StopRequest{code, reason};
    }
    if (!options_.host) return std::nullopt;
    update_beats();
    for (const Entry& m : members_[round]) {
      if (m.id == id_ || live(m.id) ||
          client_->check(round_key(round, fmt::format("done/{}", m.id))))
        continue;
      const std::string reason =
          gone_.count(m.id)
              ? fmt::format("node {} ({}): its launcher exited", m.index, m.name)
              : fmt::format(
                    "node {} ({}): its launcher stopped answering for {:g} s (it died, or "
                    "its node is down or unreachable)",
                    m.index, m.name, options_.last_call_s);
      report(round, 1, reason, false, false);
      return stop_ = StopRequest{1, reason};
    }
  } catch (const Error&) {
    lost_ = true;
    return stop_ = StopRequest{1, lost_reason};
  }
  return std::nullopt;
}

void ElasticRendezvous::report_failure(int round, int status, const std::string& reason,
                                       bool final) {
  report(round, status, reason, final, true);
}

void ElasticRendezvous::report(int round, int status, const std::string& reason, bool final,
                               bool prefix) {
  if (lost_) return;
  std::string what = reason;
  if (prefix) {
    for (const Entry& m : members_[round])
      if (m.id == id_) what = fmt::format("node {} ({}): {}", m.index, m.name, reason);
  }
  try {
    if (final) client_->set(round_key(round, "final"), std::to_string(status));
    if (client_->add(round_key(round, "nstop"), 1) == 1)
      client_->set(round_key(round, "stop"), fmt::format("{} {}", status, what));
  } catch (const Error&) {
    lost_ = true;
  }
}

std::optional<int> ElasticRendezvous::final_status(int round) {
  if (lost_) return std::nullopt;
  try {
    if (const auto v = client_->check(round_key(round, "final"))) return std::atoi(v->c_str());
  } catch (const Error&) {
    lost_ = true;
  }
  return std::nullopt;
}

int ElasticRendezvous::finish(int round) {
  try {
    client_->set(round_key(round, fmt::format("done/{}", id_)), "0");
    if (!options_.host) return 0;
    for (;;) {
      last_poll_ = -1;
      if (const auto stop = poll(round)) {
        std::fprintf(stderr, "error: launch: this node's ranks finished, but %s\n",
                     stop->reason.c_str());
        std::fflush(stderr);
        return stop->status != 0 ? stop->status : 1;
      }
      bool all = true;
      for (const Entry& m : members_[round])
        all =
            all && (m.id == id_ || client_->check(round_key(round, fmt::format("done/{}", m.id))));
      if (all) return 0;
      sleep_s(0.05);
    }
  } catch (const Error&) {
    lost_ = true;
    return options_.host ? 1 : 0;
  }
}

}  // namespace shardtrain
