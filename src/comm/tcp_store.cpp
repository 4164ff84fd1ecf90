#include "comm/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>

#include "core/error.h"

namespace shardtrain {
namespace {

using Clock = std::chrono::steady_clock;

enum Command : uint8_t { kSet = 1, kCheck = 2, kAdd = 3 };
constexpr uint8_t kOk = 0;
constexpr uint8_t kMissing = 1;
constexpr uint32_t kMaxKey = 4096;
constexpr uint32_t kMaxValue = 64u << 20;

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}

uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

/// Writes all of `data`; false when the peer is gone.
bool write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t k = ::send(fd, data, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    data += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

/// Reads exactly `n` bytes; false on EOF, error or the socket's receive timeout.
bool read_all(int fd, char* data, size_t n) {
  while (n > 0) {
    const ssize_t k = ::recv(fd, data, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    data += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

std::string response(uint8_t status, const std::string& data) {
  std::string out(1, static_cast<char>(status));
  put_u32(out, static_cast<uint32_t>(data.size()));
  return out + data;
}

int64_t parse_i64(const std::string& s) {
  int64_t v = 0;
  for (size_t i = 0; i < 8 && i < s.size(); ++i)
    v |= static_cast<int64_t>(static_cast<unsigned char>(s[i])) << (8 * i);
  return v;
}

std::string encode_i64(int64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i)
    s.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xffu));
  return s;
}

}  // namespace

// ---- server -----------------------------------------------------------------------------------

TcpStoreServer::TcpStoreServer(const std::string& bind_host, int port) {
  const std::string where = fmt::format("{}:{}", bind_host.empty() ? "*" : bind_host, port);
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  check<RuntimeFailure>(listen_fd_ >= 0, "TCP store: socket() failed: {}", std::strerror(errno));
  const int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  if (!bind_host.empty() && bind_host != "0.0.0.0") {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    const int rc = ::getaddrinfo(bind_host.c_str(), nullptr, &hints, &res);
    if (rc != 0 || res == nullptr) {
      ::close(listen_fd_);
      throw RuntimeFailure(
          fmt::format("TCP store: cannot resolve '{}': {}", bind_host, ::gai_strerror(rc)));
    }
    addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
    ::freeaddrinfo(res);
  }
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listen_fd_, 1024) != 0) {
    const int err = errno;
    ::close(listen_fd_);
    throw RuntimeFailure(fmt::format(
        "TCP store: cannot listen on {}: {}{}", where, std::strerror(err),
        err == EADDRINUSE ? " (another job uses this port: pick another --master-port / "
                            "MASTER_PORT)"
                          : ""));
  }
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  if (::pipe2(wake_pipe_, O_CLOEXEC) != 0) {
    ::close(listen_fd_);
    throw RuntimeFailure(fmt::format("TCP store: pipe() failed: {}", std::strerror(errno)));
  }
  thread_ = std::thread([this] { serve(); });
}

TcpStoreServer::~TcpStoreServer() {
  const char c = 0;
  if (::write(wake_pipe_[1], &c, 1) < 0) {
    // the thread also stops when the pipe closes
  }
  if (thread_.joinable()) thread_.join();
  ::close(wake_pipe_[0]);
  ::close(wake_pipe_[1]);
  ::close(listen_fd_);
}

void TcpStoreServer::serve() {
  std::map<std::string, std::string> data;
  struct Client {
    int fd;
    std::string in;
  };
  std::vector<Client> clients;
  for (;;) {
    std::vector<pollfd> fds;
    fds.push_back({wake_pipe_[0], POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (const auto& c : clients) fds.push_back({c.fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents) break;
    if (fds[1].revents & POLLIN) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        clients.push_back({fd, {}});
      }
    }
    std::vector<int> dead;
    for (size_t i = 0; i + 2 < fds.size(); ++i) {
      if (!fds[i + 2].revents) continue;
      Client& c = clients[i];
      char buf[65536];
      const ssize_t k = ::recv(c.fd, buf, sizeof buf, 0);
      if (k <= 0) {
        if (k < 0 && errno == EINTR) continue;
        dead.push_back(c.fd);
        continue;
      }
      c.in.append(buf, static_cast<size_t>(k));
      // Serve every complete request in the buffer.
      bool ok = true;
      while (ok && c.in.size() >= 5) {
        const uint32_t klen = get_u32(c.in.data() + 1);
        if (klen > kMaxKey) {
          ok = false;
          break;
        }
        if (c.in.size() < 9 + klen) break;
        const uint32_t vlen = get_u32(c.in.data() + 5 + klen);
        if (vlen > kMaxValue) {
          ok = false;
          break;
        }
        if (c.in.size() < 9 + klen + vlen) break;
        const auto cmd = static_cast<uint8_t>(c.in[0]);
        std::string key = c.in.substr(5, klen);
        std::string value = c.in.substr(9 + klen, vlen);
        c.in.erase(0, 9 + klen + vlen);
        std::string out;
        if (cmd == kSet) {
          data[key] = std::move(value);
          out = response(kOk, "");
        } else if (cmd == kCheck) {
          const auto it = data.find(key);
          out = it == data.end() ? response(kMissing, "") : response(kOk, it->second);
        } else if (cmd == kAdd) {
          const auto it = data.find(key);
          const int64_t v = (it == data.end() ? 0 : parse_i64(it->second)) + parse_i64(value);
          data[key] = encode_i64(v);
          out = response(kOk, encode_i64(v));
        } else {
          ok = false;
          break;
        }
        ok = write_all(c.fd, out.data(), out.size());
      }
      if (!ok) dead.push_back(c.fd);
    }
    for (int fd : dead) {
      ::close(fd);
      std::erase_if(clients, [fd](const Client& c) { return c.fd == fd; });
    }
  }
  for (const auto& c : clients) ::close(c.fd);
}

// ---- client -----------------------------------------------------------------------------------

namespace {

/// One connection attempt to any address of host:port with a connect timeout; -1 on failure.
int try_connect(const std::string& host, int port, double timeout_s, std::string& error) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    error = ::gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int r = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      r = ::poll(&p, 1, static_cast<int>(std::max(1.0, timeout_s * 1000))) == 1 ? 0 : -1;
      int err = r == 0 ? 0 : ETIMEDOUT;
      socklen_t len = sizeof err;
      if (r == 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        errno = err;
        r = -1;
      }
    }
    if (r != 0) {
      error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd >= 0) {
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    timeval tv{30, 0};  // a server that stops answering fails requests after 30 s
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  return fd;
}

}  // namespace

TcpStoreClient::TcpStoreClient(const std::string& host, int port, double timeout_s)
    : address_(fmt::format("{}:{}", host, port)) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  std::string error;
  for (;;) {
    const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    fd_ = try_connect(host, port, std::max(0.05, std::min(left, 5.0)), error);
    if (fd_ >= 0) return;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  throw RuntimeFailure(fmt::format(
      "cannot reach the rendezvous store at {} within {:g} s ({}): is rank 0 running, and are "
      "MASTER_ADDR / MASTER_PORT (--master-addr / --master-port) its address?",
      address_, timeout_s, error));
}

TcpStoreClient::~TcpStoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

std::pair<uint8_t, std::string> TcpStoreClient::request(uint8_t command, const std::string& key,
                                                        const std::string& value) {
  shardtrain::check<RuntimeFailure>(key.size() <= kMaxKey && value.size() <= kMaxValue,
                                    "TCP store: key or value too large ({} and {} bytes)",
                                    key.size(), value.size());
  shardtrain::check<RuntimeFailure>(fd_ >= 0, "TCP store at {}: the connection was lost earlier",
                                    address_);
  std::string out(1, static_cast<char>(command));
  put_u32(out, static_cast<uint32_t>(key.size()));
  out += key;
  put_u32(out, static_cast<uint32_t>(value.size()));
  out += value;
  char head[5];
  if (!write_all(fd_, out.data(), out.size()) || !read_all(fd_, head, sizeof head)) {
    ::close(fd_);
    fd_ = -1;
    throw RuntimeFailure(
        fmt::format("TCP store at {}: connection lost (rank 0 exited or is stuck)", address_));
  }
  std::string data(get_u32(head + 1), '\0');
  if (!read_all(fd_, data.data(), data.size())) {
    ::close(fd_);
    fd_ = -1;
    throw RuntimeFailure(fmt::format("TCP store at {}: connection lost", address_));
  }
  return {static_cast<uint8_t>(head[0]), std::move(data)};
}

void TcpStoreClient::set(const std::string& key, const std::string& value) {
  request(kSet, key, value);
}

std::optional<std::string> TcpStoreClient::check(const std::string& key) {
  auto [status, data] = request(kCheck, key, "");
  if (status != kOk) return std::nullopt;
  return data;
}

std::string TcpStoreClient::get(const std::string& key, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  for (;;) {
    if (auto v = check(key)) return *v;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  throw RuntimeFailure(fmt::format("key '{}' was not set in the store at {} within {:g} s", key,
                                   address_, timeout_s));
}

void TcpStoreClient::wait(const std::vector<std::string>& keys, double timeout_s) {
  const auto start = Clock::now();
  for (const auto& k : keys) {
    const double left = timeout_s - std::chrono::duration<double>(Clock::now() - start).count();
    get(k, std::max(0.0, left));
  }
}

int64_t TcpStoreClient::add(const std::string& key, int64_t delta) {
  return parse_i64(request(kAdd, key, encode_i64(delta)).second);
}

}  // namespace shardtrain
