// Hierarchical all-reduce: the gradient sum of data parallelism across nodes in three steps, so
// that each GPU sends 1/k of the buffer over the network instead of all of it (k = ranks per
// node; Horovod's hierarchical all-reduce, and the first two steps of ZeRO++'s hpZ/qgZ reduction,
// arXiv 2306.10209 §4):
//   1. reduce-scatter within the node: local rank l holds the node's sum of chunk l;
//   2. all-reduce of chunk l among the ranks of local rank l, one per node (the network hop);
//   3. all-gather within the node: every rank holds the sum of every chunk.
// Elements past the last multiple of k (fewer than k) are all-reduced over the world.
//
// Quantized (ZeRO++'s qgZ, arXiv 2306.10209 §3.3, `zero_quantized_gradients`): step 2 sends the
// chunk as int8 with one fp32 scale per kQuantBlock elements (Backend::quantize_int8) — all-gathers
// of every node's int8 chunk and scales — and each rank sums the nodes' dequantized chunks in node
// order, so every rank gets the same sum, from about a quarter (fp32) or half (bf16) of the bytes
// across nodes. The error per element is at most half a quantization step of each node's block.
//
// Issue order. Collectives must be issued in the same order on every rank of a communicator.
// start() issues step 1 (and the remainder) where the caller is — a backward hook, the same point
// on every rank — but steps 2 and 3 are issued later, when step 1 (2) of that reduction is seen to
// have completed, which happens at different times on different ranks. So each step has its own
// communicator (`node_scatter`, `across`, `node_gather`), on which the reductions' steps are
// issued in start() order, and nothing else: a rank may interleave the three communicators
// differently from another, never the operations on one.
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"

namespace shardtrain {

/// Where this rank sits among nodes of `ranks_per_node` consecutive ranks (the launcher numbers
/// rank = node · k + local rank): the groups a hierarchical all-reduce splits the world into.
struct NodeGroups {
  std::vector<int> node;    ///< the k ranks of this rank's node
  std::vector<int> across;  ///< the ranks with this local rank, one per node
  /// Throws ConfigError when `ranks_per_node` does not divide the world size.
  static NodeGroups of(int world_size, int rank, int ranks_per_node);
};

class HierarchicalAllReduce {
 public:
  /// Splits `world` (collective: every rank at the same point) into its node's group (twice: the
  /// reduce-scatter and the all-gather each get their own) and its cross-node group. `quantize`:
  /// the backend of the buffers, to send step 2 as int8 (null: in the buffers' dtype).
  /// `members`: the job's rank numbers of `world`'s ranks, in order, when `world` is a group
  /// split from the job's (split() names global ranks); empty: `world` is the job's.
  HierarchicalAllReduce(Communicator& world, int ranks_per_node, Backend* quantize = nullptr,
                        const std::vector<int>& members = {});
  HierarchicalAllReduce(const HierarchicalAllReduce&) = delete;
  HierarchicalAllReduce& operator=(const HierarchicalAllReduce&) = delete;
  ~HierarchicalAllReduce();

  /// Starts the sum of `t` (in place, any numel, the same on every rank) over every rank of the
  /// world; `t` stays untouched by the caller until the returned Work's wait() returned. Issues
  /// step 1 now; progress() and waits issue the later steps.
  std::unique_ptr<Work> start(Tensor t);
  /// Issues whatever step the reductions in flight are ready for (never waits). Call it often
  /// while they run (e.g. after every layer's backward) so the network hop overlaps compute.
  void progress();
  /// Ranks per node (k) and nodes.
  int ranks_per_node() const { return k_; }
  int nodes() const { return nodes_; }
  /// Bytes this rank sent over the network (step 2's all-reduce inputs) since construction.
  int64_t network_bytes() const { return network_bytes_; }

 private:
  struct Job;
  class JobWork;
  /// Moves job `j` (and every earlier one, which must issue first) on by one step if it can;
  /// with `block`, waits for the step in flight. Returns whether it moved.
  bool advance(Job& j, bool block);
  /// Drives every job up to and including `j` to completion.
  void finish(Job& j);
  /// Quantized step 2: quantizes j's chunk and all-gathers every node's int8 chunk and scales.
  void issue_quantized(Job& j);
  /// After those: j's chunk = Σ over nodes, in node order, of the dequantized chunks.
  void sum_quantized(Job& j);

  Communicator& world_;
  Backend* quantize_ = nullptr;
  int k_ = 1, nodes_ = 1, local_ = 0;
  /// Steps 1, 2, 3's groups (node_scatter_ and node_gather_ null with one rank per node).
  std::unique_ptr<Communicator> node_scatter_, across_, node_gather_;
  std::deque<std::shared_ptr<Job>>
      jobs_;  ///< in start() order; finished ones popped from the front
  int64_t network_bytes_ = 0;
};

}  // namespace shardtrain
