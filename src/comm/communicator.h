// Communicator: collectives over a group of ranks, asynchronous with work handles (PyTorch
// c10d's habit). NCCL implements it on GPU and MPI on CPU (issue 4); LocalCommunicator is the
// one-rank group every single-process run uses.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace shardtrain {

enum class ReduceOp { kSum, kAvg, kMax };

/// Handle of an operation in flight. wait() blocks until it completed (on GPU: until the
/// compute stream is ordered after it) and rethrows its failure.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool completed() = 0;
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
  virtual std::unique_ptr<Work> send(Tensor t, int peer) = 0;
  virtual std::unique_ptr<Work> recv(Tensor t, int peer) = 0;
  virtual void barrier() = 0;

  /// A communicator over `ranks` (global rank numbers; this rank must be among them). Used for
  /// the data-parallel and pipeline groups of pipeline × data parallelism.
  virtual std::unique_ptr<Communicator> split(const std::vector<int>& ranks) = 0;
};

/// The group of one rank: every collective is the identity (kAvg/kSum over one rank).
std::unique_ptr<Communicator> make_local_communicator();

}  // namespace shardtrain
