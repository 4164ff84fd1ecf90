// Hierarchical reduction: the gradient sums of data parallelism and ZeRO across nodes in steps,
// so that each GPU sends 1/k of the buffer over the network instead of all of it (k = ranks per
// node; Horovod's hierarchical all-reduce, and ZeRO++'s hierarchical reduce-scatter, arXiv
// 2306.10209 §3.3 and §4).
//
// All-reduce (dp; all_reduce()):
//   1. reduce-scatter within the node: local rank l holds the node's sum of chunk l;
//   2. all-reduce of chunk l among the ranks of local rank l, one per node (the network hop);
//   3. all-gather within the node: every rank holds the sum of every chunk.
// Elements past the last multiple of k (fewer than k) are all-reduced over the world.
//
// Reduce-scatter (zero1, zero2; reduce_scatter()): the buffer [W·s] of W = n·k ranks, rank
// r = node·k + l to receive the sum of chunk r, as one reduce-scatter over the world would:
//   1. the chunks are reordered so that the n chunks {j·k + l : nodes j} lie together for each l
//      (a copy of the buffer; none with one node or one rank per node), and reduced-scattered
//      within the node: local rank l holds the node's sum of its n chunks [n·s];
//   2. reduce-scatter of those among the ranks of local rank l (the network hop, 1/k of the
//      buffer): node j's rank receives chunk j·k + l, which it copies to its own slice.
// Across nodes this sends (n−1)/n of the buffer per node, against (W−1)/W for a ring over the
// world; the all-reduce 2(n−1)/n against 2(W−1)/W.
//
// Quantized (ZeRO++'s qgZ, arXiv 2306.10209 §3.3, `zero_quantized_gradients`): step 2 sends int8
// with one fp32 scale per kQuantBlock elements (Backend::quantize_int8). All-reduce: all-gathers of
// every node's int8 chunk and scales; with several ranks per node step 3 then gathers those int8
// chunks within the node, and every rank sums every chunk itself, node by node in node order, so
// that every rank holds the same sum and no collective waits for a dequantization. Reduce-scatter:
// each of the n chunks quantized on its own and exchanged all-to-all; each rank sums the nodes'
// dequantized pieces of its chunk in node order. About a quarter (fp32) or half (bf16) of the
// bytes across nodes; the error per element is at most half a quantization step of each node's
// block.
//
// Issue order. Collectives must be issued in the same order on every rank of a communicator, and
// on GPUs, where each communicator's operations run on a stream of their own and a rank runs the
// operations that wait for one another in the order it issued them, in the same order across
// communicators too, or two ranks can each wait for an operation the other runs after its own.
// Each step has a communicator of its own (`node_scatter`, `across`, `node_gather`), on which the
// reductions' steps are issued in start order. On GPUs (Communicator::starts_after_on_device)
// all_reduce()/reduce_scatter() issue every step that only communicates at once, each ordered
// after the one before on the device (start_after), so every rank issues the same sequence; the
// steps that need the compute stream in between (quantizing, summing the nodes' int8 pieces,
// copying a piece back) are issued by progress() and waits once the step before is seen complete.
// On CPU ranks (MPI) a step is issued only when the step before is seen complete, which happens
// at different times on different ranks: a rank may then interleave the communicators differently
// from another, never the operations on one; MPI progresses them all.
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"

namespace shardtrain {

/// Where this rank sits among nodes of `ranks_per_node` consecutive ranks (the launcher numbers
/// rank = node · k + local rank): the groups a hierarchical reduction splits the world into.
struct NodeGroups {
  std::vector<int> node;    ///< the k ranks of this rank's node
  std::vector<int> across;  ///< the ranks with this local rank, one per node
  /// Throws ConfigError when `ranks_per_node` does not divide the world size.
  static NodeGroups of(int world_size, int rank, int ranks_per_node);
};

class HierarchicalReduction {
 public:
  /// Splits `world` (collective: every rank at the same point) into its node's group (twice: the
  /// reduce-scatter and the all-gather each get their own) and its cross-node group. `backend`:
  /// the buffers' (for reordering and quantizing). `quantize`: step 2 goes as int8.
  /// `members`: the job's rank numbers of `world`'s ranks, in order, when `world` is a group
  /// split from the job's (split() names global ranks); empty: `world` is the job's.
  /// Throws ConfigError when `ranks_per_node` does not divide the world size.
  HierarchicalReduction(Communicator& world, int ranks_per_node, Backend& backend,
                        bool quantize = false, const std::vector<int>& members = {});
  HierarchicalReduction(const HierarchicalReduction&) = delete;
  HierarchicalReduction& operator=(const HierarchicalReduction&) = delete;
  ~HierarchicalReduction();

  /// Starts the sum of `t` (in place, any numel, the same on every rank) over every rank of the
  /// world; `t` stays untouched by the caller until the returned Work's wait() returned. Issues
  /// step 1 now; progress() and waits issue the later steps.
  std::unique_ptr<Work> all_reduce(Tensor t);
  /// Starts the reduce-scatter of `whole` [W·s] (W = world size; the same on every rank) into
  /// `own` [s], which must be whole's slice [rank·s, (rank+1)·s) — ZeRO's in-place layout: own
  /// receives the sum over ranks of chunk `rank`; the rest of `whole` is left undefined. Both
  /// stay untouched by the caller until the returned Work's wait() returned.
  std::unique_ptr<Work> reduce_scatter(Tensor own, Tensor whole);
  /// Issues whatever step the reductions in flight are ready for (never waits). Call it often
  /// while they run (e.g. after every layer's backward) so the network hop overlaps compute.
  void progress();
  /// Ranks per node (k) and nodes.
  int ranks_per_node() const { return k_; }
  int nodes() const { return nodes_; }
  /// Bytes this rank put into the network step (step 2's inputs: the chunk of an all-reduce, the
  /// n chunks of a reduce-scatter, or their int8 and scales) since construction or the last
  /// reset_network_bytes() (a strategy resets it when a step starts); 0 with one node.
  int64_t network_bytes() const { return network_bytes_; }
  void reset_network_bytes() { network_bytes_ = 0; }

 private:
  struct Job;
  class JobWork;
  /// Starts a job: records it, issues its step 1.
  std::unique_ptr<Work> start(std::shared_ptr<Job> job);
  /// Moves job `j` on by one step if it can (every earlier job must have issued that step first);
  /// with `block`, waits for the step in flight. Returns whether it moved.
  bool advance(Job& j, bool block);
  /// Whether j's next step is issued chained after the one in flight (on the device, without
  /// waiting): a step that only communicates, on a communicator that orders on the device.
  bool chains(const Job& j) const;
  /// Drives every job up to and including `j` to completion.
  void finish(Job& j);
  /// Quantized step 2: quantizes j's chunk (all-reduce) or each of its n chunks (reduce-scatter)
  /// and exchanges every node's int8 and scales (all-gather; all-to-all).
  void issue_quantized(Job& j);
  /// After those: j's result = Σ over nodes, in node order, of the dequantized pieces.
  void sum_quantized(Job& j);

  Communicator& world_;
  Backend& backend_;
  bool quantize_ = false;
  /// The world's communicators order operations on the device (NCCL): start() issues every step
  /// that only communicates at once, each after the one before (Communicator::start_after).
  bool chained_ = false;
  int k_ = 1, nodes_ = 1, local_ = 0, node_ = 0;
  /// Steps 1, 2, 3's groups (node_scatter_ and node_gather_ null with one rank per node).
  std::unique_ptr<Communicator> node_scatter_, across_, node_gather_;
  std::deque<std::shared_ptr<Job>> jobs_;  ///< in start order; finished ones popped from the front
  int64_t network_bytes_ = 0;
};

}  // namespace shardtrain
