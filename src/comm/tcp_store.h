// A small TCP key-value store (torch.distributed.TCPStore's role): rank 0 runs the server at
// MASTER_ADDR:MASTER_PORT, every rank connects a client. It carries the NCCL unique id at startup
// when MPI is not there, and each rank's collective counts for the timeout report.
//
// Protocol (one request, one response, over one connection): request = u8 command, u32 key
// length, key, u32 value length, value; response = u8 status (0 found/ok, 1 missing), u32 length,
// data. Integers little-endian. Commands: SET, CHECK (get without waiting), ADD (int64 counter).
// The server holds everything in memory and trusts its clients: run it on a private network.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace shardtrain {

class TcpStoreServer {
 public:
  /// Listens on `bind_host`:`port` and serves on a background thread. `bind_host` "" or
  /// "0.0.0.0" listens on every interface; `port` 0 picks a free port (see port()). Throws
  /// RuntimeFailure naming the address when it cannot listen (e.g. the port is in use).
  TcpStoreServer(const std::string& bind_host, int port);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  /// The port it listens on.
  int port() const { return port_; }

 private:
  void serve();

  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  int port_ = 0;
  std::thread thread_;
};

/// One connection to a TcpStoreServer. Not thread-safe: use one client per thread.
class TcpStoreClient {
 public:
  /// Connects to `host`:`port`, retrying while the server is not up yet, for at most `timeout_s`
  /// seconds. Throws RuntimeFailure naming the address when it cannot connect in time.
  TcpStoreClient(const std::string& host, int port, double timeout_s);
  ~TcpStoreClient();
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  /// Sets `key` to `value` (overwrites). Throws RuntimeFailure when the server is unreachable.
  void set(const std::string& key, const std::string& value);
  /// The value of `key`, or nullopt when it is not set. Throws RuntimeFailure when unreachable.
  std::optional<std::string> check(const std::string& key);
  /// Waits until `key` is set and returns its value, polling every 10 ms. Throws RuntimeFailure
  /// naming the key and the address when it is not set within `timeout_s` seconds.
  std::string get(const std::string& key, double timeout_s);
  /// Waits until every key of `keys` is set (see get()).
  void wait(const std::vector<std::string>& keys, double timeout_s);
  /// Adds `delta` to the int64 counter `key` (0 when unset) and returns the new value.
  int64_t add(const std::string& key, int64_t delta);

  const std::string& address() const { return address_; }

 private:
  /// Sends one request and reads its response; returns {status, data}.
  std::pair<uint8_t, std::string> request(uint8_t command, const std::string& key,
                                          const std::string& value);

  int fd_ = -1;
  std::string address_;  ///< "host:port"
};

}  // namespace shardtrain
