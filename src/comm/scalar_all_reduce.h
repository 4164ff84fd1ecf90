// A few host doubles reduced over the ranks of a communicator: the training loss, validation
// sums, the ZeRO gradient norm, per-rank peaks for the logs.
#pragma once

#include <span>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "memory/flat_buffer.h"

namespace shardtrain {

/// Sums a few host doubles over the ranks of a communicator, cheaply and precisely.
/// Communicators reduce backend tensors, so the values travel through a tiny fp32 device buffer:
/// each as two fp32 words (hi + lo: about 48 bits), all-gathered, and summed on the host in double
/// in rank order — the same result on every rank, independent of how MPI/NCCL order a reduction.
/// On one rank the values are returned unchanged and nothing is communicated or allocated.
class ScalarAllReduce {
 public:
  /// Room for up to `capacity` values per call.
  ScalarAllReduce(Backend& backend, Communicator& comm, int capacity);
  /// Replaces every value by its sum over the ranks. Collective: every rank calls it with the
  /// same number of values (≤ capacity). Waits for the result (one small device sync on GPU).
  void sum(std::span<double> values);
  /// Every rank's `values`: result[r · n + i] is value i of rank r (n = values.size()), each
  /// exact to about 48 bits. Collective, as sum().
  std::vector<double> gather(std::span<const double> values);

 private:
  Backend& backend_;
  Communicator& comm_;
  int capacity_;
  FlatBuffer buf_;  ///< [2·capacity] this rank's words, then [world · 2·capacity] gathered
  std::vector<float> host_;
};

}  // namespace shardtrain
