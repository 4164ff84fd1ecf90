// Communicator: collectives over a group of ranks, asynchronous with work handles (PyTorch
// c10d's habit). NCCL implements it on GPU (comm/nccl_communicator_cuda.cpp) and MPI on CPU
// (comm/mpi_communicator.cpp); LocalCommunicator is the one-rank group every single-process run
// uses. make_world_communicator() picks one from the environment the launcher set
// (docs/LAUNCHING.md).
//
// Contract shared by the implementations:
//  * Collectives are issued in the same order on every rank of a group (as in MPI and NCCL).
//  * Tensors must stay alive and untouched until the operation completed (after wait()); destroying
//    a Work does not cancel its operation.
//  * wait() never hangs silently: when the operation does not complete within
//    CommOptions::timeout_s seconds, the waiting rank names the ranks that did not join it and
//    stops the job (or throws CommTimeoutError, see CommOptions::abort_on_timeout).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace shardtrain {

struct DistributedEnv;  // comm/dist_env.h

enum class ReduceOp { kSum, kAvg, kMax };

/// Handle of an operation in flight. wait() blocks until it completed (on GPU: until the
/// compute stream is ordered after it) and rethrows its failure.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool completed() = 0;
};

/// Staging bytes of the NCCL communicator's copy-engine collectives (registration_staging_bytes()
/// when they are available): the sums over W ranks run in pieces of 32 MiB / (W − 1).
inline constexpr size_t kPeerStagingBytes = size_t{32} << 20;

/// Buffers registered with a communicator (Communicator::register_buffers); destroying it
/// deregisters them. Destroy it before the buffers and after the last operation on them.
class BufferRegistration {
 public:
  virtual ~BufferRegistration() = default;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// "local", "mpi", "nccl".
  virtual std::string backend_name() const = 0;

  /// In place over `t` on every rank.
  virtual std::unique_ptr<Work> all_reduce(Tensor t, ReduceOp op) = 0;
  /// `input` [world·n] on every rank; rank r receives the reduction of chunk r in `output` [n].
  virtual std::unique_ptr<Work> reduce_scatter(Tensor output, Tensor input, ReduceOp op) = 0;
  /// `input` [n] from each rank, concatenated in rank order into `output` [world·n].
  virtual std::unique_ptr<Work> all_gather(Tensor output, Tensor input) = 0;
  virtual std::unique_ptr<Work> broadcast(Tensor t, int root) = 0;
  /// `input` [world·n]: chunk r goes to rank r, which receives it as chunk `rank()` of its
  /// `output` [world·n] (MPI_Alltoall; grouped sends and receives on NCCL). `output` and `input`
  /// must not overlap. Throws RuntimeFailure for mismatched sizes or dtypes.
  virtual std::unique_ptr<Work> all_to_all(Tensor output, Tensor input) = 0;
  virtual std::unique_ptr<Work> send(Tensor t, int peer) = 0;
  virtual std::unique_ptr<Work> recv(Tensor t, int peer) = 0;
  virtual void barrier() = 0;

  /// Whether start_after() orders this communicator's operations after another communicator's on
  /// the device (GPU communicators: stream order), so that a chain of collectives over several
  /// communicators can be issued at once, in the same order on every rank. False: a caller must
  /// see (Work::completed) or wait for the first before issuing the next.
  virtual bool starts_after_on_device() const { return false; }
  /// Every operation issued here from now on starts after `w` (an operation of a communicator of
  /// the same device) completed, without the compute stream waiting for it. Throws
  /// RuntimeFailure where starts_after_on_device() is false or `w` is of another kind.
  virtual void start_after(Work& /*w*/) {
    throw RuntimeFailure("start_after: this communicator orders operations only on the host");
  }

  /// A communicator over `ranks` (global rank numbers; this rank must be among them). Used for
  /// the data-parallel and pipeline groups of pipeline × data parallelism. Collective over this
  /// communicator: every rank calls it at the same point, each passing the group it belongs to,
  /// and the groups partition the ranks (NCCL's ncclCommSplit needs every rank). The new group's
  /// rank r is ranks[r]. Throws ConfigError for bad lists (duplicates, out of range, this rank
  /// missing).
  virtual std::unique_ptr<Communicator> split(const std::vector<int>& ranks) = 0;

  /// Bytes of device memory register_buffers() takes as staging, or 0 when this communicator has
  /// no faster path for registered buffers (CPU and single-rank communicators; NCCL groups whose
  /// GPUs are on several nodes or cannot access each other's memory;
  /// SHARDTRAIN_PEER_COLLECTIVES=0).
  virtual size_t registration_staging_bytes() const { return 0; }

  /// Registers `buffers` (whole allocations: the strategies' flat buffers) so that collectives on
  /// tensors inside them take the communicator's faster path; on GPU ranks of one node that is
  /// copy-engine transfers between the GPUs (comm/peer_collectives.h), which leave the SMs to the
  /// compute the collectives overlap. `staging`: device memory of registration_staging_bytes()
  /// bytes, kept until the registration is destroyed. Collective: every rank registers buffers of
  /// the same sizes in the same order, and afterwards passes tensors at the same offsets of them
  /// to each collective (in-place all_gather/reduce_scatter: the rank's own slice). Returns null
  /// when the faster path is unavailable; collectives then go the usual way. Throws
  /// RuntimeFailure when the transport fails.
  virtual std::unique_ptr<BufferRegistration> register_buffers(
      const std::vector<Tensor>& /*buffers*/, Tensor /*staging*/) {
    return nullptr;
  }

  /// GPU communicators: the CUDA stream (a cudaStream_t) the caller computes on. Each operation
  /// starts after the work enqueued there so far, and Work::wait() orders later work there after
  /// the operation. Until it is set, the legacy default stream is used, which orders against every
  /// blocking stream of the device. CPU communicators ignore it.
  virtual void set_compute_stream(void* /*cuda_stream*/) {}
};

/// How communicators wait.
struct CommOptions {
  /// Seconds a wait() may block before the job is stopped (> 0). Default: $SHARDTRAIN_COMM_TIMEOUT
  /// or 300 (see comm_timeout_seconds()).
  double timeout_s = 300;
  /// On a timeout: true prints "error: rank R: OP #N did not complete within T s: rank Q has not
  /// joined it (...)" to stderr and aborts the whole job (MPI_Abort, or exit status 1 on GPU,
  /// whereupon the launcher stops the other ranks); false throws CommTimeoutError instead (tests).
  /// After a CommTimeoutError the Work stays valid: waiting on it again waits for another
  /// timeout_s.
  bool abort_on_timeout = true;
};

/// A collective or point-to-point operation did not complete within CommOptions::timeout_s.
/// The message names the operation and the ranks that did not join it.
class CommTimeoutError : public RuntimeFailure {
 public:
  using RuntimeFailure::RuntimeFailure;
};

/// The communication timeout in seconds: `flag_value` when > 0 (e.g. --comm-timeout), else
/// $SHARDTRAIN_COMM_TIMEOUT when set, else 300. Throws ConfigError when the variable is not a
/// number > 0.
double comm_timeout_seconds(double flag_value = 0);

/// The group of one rank: every collective is the identity (kAvg/kSum over one rank).
std::unique_ptr<Communicator> make_local_communicator();

/// The MPI communicator over MPI_COMM_WORLD, for CPU tensors (fp32, bf16, fp16, int32; kAvg needs a
/// floating dtype). Initializes MPI (init_mpi()) when the caller has not. Throws RuntimeFailure
/// when MPI fails.
std::unique_ptr<Communicator> make_mpi_communicator(const CommOptions& options = {});

/// Initializes MPI with at least MPI_THREAD_FUNNELED (only the main thread calls MPI; OpenMP
/// threads never do) unless it is initialized already. Throws RuntimeFailure when MPI cannot give
/// that thread level.
void init_mpi();

/// Finalizes MPI when init_mpi() initialized it (destroy the MPI communicators first); a no-op
/// otherwise, and after a reported timeout. Call it once after a successful run, not on error
/// paths: MPI_Finalize waits for every rank. If it does not return within `timeout_s` seconds the
/// process exits with status 1 and a message naming the wait.
void finalize_mpi(double timeout_s = 60);

/// The communicator of the whole job described by `env` (comm/dist_env.h):
///  * world_size 1: the local communicator;
///  * `device` kCPU: MPI (the ranks must have been started by mpirun, srun or `shardtrain
///    launch`, which uses mpirun for CPU runs);
///  * `device` kCUDA: NCCL on GPU env.local_rank, ordered after `cuda_stream` (may be null; see
///    Communicator::set_compute_stream), with the NCCL id shared through MPI under mpirun and
///    through the TCP store at MASTER_ADDR:MASTER_PORT otherwise.
/// Throws ConfigError when the environment and the transport disagree (e.g. WORLD_SIZE 4 but MPI
/// sees 1 process) and RuntimeFailure when the transport fails.
std::unique_ptr<Communicator> make_world_communicator(const DistributedEnv& env, DeviceKind device,
                                                      void* cuda_stream,
                                                      const CommOptions& options = {});

}  // namespace shardtrain
