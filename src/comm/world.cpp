// make_world_communicator(): the communicator of the whole job, from the launcher's variables.
//  * CPU: MPI (mpirun, srun, or `shardtrain launch`, which runs mpirun for CPU jobs).
//  * GPU: NCCL, its unique id broadcast through MPI under mpirun, else through the TCP store that
//    rank 0 serves at MASTER_ADDR:MASTER_PORT (shardtrain launch, torchrun, srun).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <fmt/core.h>
#include <mpi.h>

#include <cstring>
#include <memory>
#include <string>

#include "comm/comm_support.h"
#include "comm/communicator.h"
#include "comm/dist_env.h"
#include "comm/nccl_communicator.h"
#include "comm/tcp_store.h"
#include "core/error.h"

namespace shardtrain {
namespace {

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

/// Progress board on the TCP store; every failure is swallowed (it is a diagnostic aid).
class StoreBoard final : public ProgressBoard {
 public:
  StoreBoard(const std::string& host, int port) {
    try {
      client_ = std::make_unique<TcpStoreClient>(host, port, 10.0);
    } catch (const Error&) {
    }
  }
  void publish(const std::string& key, const std::string& value) override {
    if (!client_) return;
    try {
      client_->set(key, value);
    } catch (const Error&) {
      client_.reset();
    }
  }
  std::optional<std::string> read(const std::string& key) override {
    if (!client_) return std::nullopt;
    try {
      return client_->check(key);
    } catch (const Error&) {
      client_.reset();
      return std::nullopt;
    }
  }

 private:
  std::unique_ptr<TcpStoreClient> client_;
};

/// Rank 0 serves the store; every rank (rank 0 too) talks to it as a client.
class StoreBootstrap final : public Bootstrap {
 public:
  StoreBootstrap(const DistributedEnv& env, double timeout_s) : env_(env), timeout_s_(timeout_s) {
    if (env.rank == 0)
      server_ = std::make_unique<TcpStoreServer>(is_loopback(env.master_addr) ? "127.0.0.1" : "",
                                                 env.master_port);
    client_ = std::make_unique<TcpStoreClient>(env.master_addr, env.master_port, timeout_s);
  }

  void broadcast(void* data, size_t bytes, int root) override {
    const std::string key = fmt::format("bootstrap/broadcast/{}", next_++);
    if (env_.rank == root) {
      client_->set(key, std::string(static_cast<const char*>(data), bytes));
      return;
    }
    std::string v;
    try {
      v = client_->get(key, timeout_s_);
    } catch (const RuntimeFailure& e) {
      throw RuntimeFailure(
          fmt::format("rank {}: no startup data from rank {} within {:g} s: rank "
                      "{} is stuck or dead ({})",
                      env_.rank, root, timeout_s_, root, e.what()));
    }
    check<RuntimeFailure>(v.size() == bytes, "bootstrap: expected {} bytes from rank {}, got {}",
                          bytes, root, v.size());
    std::memcpy(data, v.data(), bytes);
  }

  std::unique_ptr<ProgressBoard> connect_board() override {
    return std::make_unique<StoreBoard>(env_.master_addr, env_.master_port);
  }

 private:
  DistributedEnv env_;
  double timeout_s_;
  std::unique_ptr<TcpStoreServer> server_;
  std::unique_ptr<TcpStoreClient> client_;
  int next_ = 0;
};

/// MPI_Bcast over MPI_COMM_WORLD (under mpirun); no progress board (MPI is main-thread only).
class MpiBootstrap final : public Bootstrap {
 public:
  MpiBootstrap(int rank, double timeout_s) : rank_(rank), timeout_s_(timeout_s) {}
  void broadcast(void* data, size_t bytes, int root) override {
    Watchdog dog(timeout_s_, fmt::format("rank {}: startup broadcast from rank {} did not complete "
                                         "within {:g} s: a rank is stuck or dead",
                                         rank_, root, timeout_s_));
    const int rc = MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD);
    check<RuntimeFailure>(rc == MPI_SUCCESS, "MPI_Bcast of the NCCL id failed (error {})", rc);
  }
  std::unique_ptr<ProgressBoard> connect_board() override { return nullptr; }

 private:
  int rank_;
  double timeout_s_;
};

}  // namespace

std::unique_ptr<Communicator> make_world_communicator(const DistributedEnv& env, DeviceKind device,
                                                      void* cuda_stream,
                                                      const CommOptions& options) {
  check<ConfigError>(options.timeout_s > 0, "the communication timeout must be > 0 s, got {:g}",
                     options.timeout_s);
  if (env.world_size == 1) return make_local_communicator();
  if (device == DeviceKind::kCPU) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    check<ConfigError>(
        initialized || env.launcher == "mpirun" || env.launcher == "slurm",
        "{} ranks were started by {} (WORLD_SIZE={}), but CPU ranks communicate through MPI: start "
        "them with `shardtrain launch` (it runs mpirun for CPU ranks), mpirun, or srun "
        "--mpi=pmix",
        env.world_size, env.launcher, env.world_size);
    auto comm = make_mpi_communicator(options);
    check<ConfigError>(comm->world_size() == env.world_size && comm->rank() == env.rank,
                       "MPI sees rank {} of {} but the {} variables say rank {} of {}: under srun "
                       "pass --mpi=pmix (or the MPI plugin of your site) so that MPI sees every "
                       "task",
                       comm->rank(), comm->world_size(), env.launcher, env.rank, env.world_size);
    return comm;
  }
  std::shared_ptr<Bootstrap> bootstrap;
  if (env.launcher == "mpirun") {
    init_mpi();
    bootstrap = std::make_shared<MpiBootstrap>(env.rank, options.timeout_s);
  } else {
    bootstrap = std::make_shared<StoreBootstrap>(env, options.timeout_s);
  }
  return make_nccl_communicator(env, cuda_stream, options, std::move(bootstrap));
}

#ifndef SHARDTRAIN_WITH_CUDA
std::unique_ptr<Communicator> make_nccl_communicator(const DistributedEnv& env, void*,
                                                     const CommOptions&,
                                                     std::shared_ptr<Bootstrap>) {
  throw DeviceUnavailable(fmt::format(  // the command line adds the CPU as the other remedy
      "rank {}: GPU ranks communicate through NCCL, but this shardtrain was built without CUDA: "
      "rebuild with the CUDA toolkit (see README)",
      env.rank));
}

int cuda_device_count() { return 0; }
#endif

}  // namespace shardtrain
