// Chunking and offsets of the copy-engine collectives (comm/peer_collectives.h) as pure host
// functions: for a world size, a rank, an element count and the staging size, the steps that rank
// takes — barriers, copies of which slice into which peer's array at which element offsets, and
// sums of the staged pieces. PeerCollectives (comm/peer_collectives.cu) runs a plan as it is,
// only turning offsets into addresses; the CPU tests (tests/comm/test_peer_chunks.cpp) replay the
// plans of every rank on host arrays. Plain C++, no CUDA. Header-only on purpose: shardtrain_cuda,
// which runs the plans, links before shardtrain_lib and must not need its symbols (as
// comm/comm_support.h).
//
// Every world size ≥ 2 and every element count has a plan: counts not divisible by the world size
// or the piece size (the last chunk or piece is shorter), counts below the world size (the later
// chunks are empty and their ranks only send), and 0 (barriers only). Shapes without a plan —
// the NCCL communicator sends those collectives to NCCL instead — are sums whose staging share per
// sender holds no whole 16-byte vector (never with kPeerStagingBytes and at most 8 ranks), and
// world < 2 or a rank outside [0, world). Whether a plan exists never depends on the rank, so all
// ranks take the same path.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace shardtrain {

/// The arrays a plan addresses on every rank. Offsets and counts are in elements of them.
enum class PeerArray : uint8_t {
  kInput,    ///< all_reduce: the tensor [n]; reduce_scatter: input [W·n]; all_gather: input [n]
  kOutput,   ///< all_reduce: the tensor (the same memory as kInput); reduce_scatter: output [n];
             ///< all_gather: output [W·n]
  kStaging,  ///< the registration's staging: W − 1 slots of peer_piece_elements(), one per sender
};

/// One step of a rank's plan; a rank runs its steps in order on one stream.
struct PeerStep {
  enum class Kind : uint8_t {
    /// Every rank signals every other rank and waits for all of them. Every rank's plan of one
    /// collective has the same number of barriers.
    kBarrier,
    /// `count` elements of this rank's `src` at `src_offset` into rank `peer`'s `dst` at
    /// `dst_offset` (peer == this rank: a local copy, nothing to do when both are the same
    /// memory).
    kCopy,
    /// For i < count: output[dst_offset + i] = (input[src_offset + i] + Σ_{k < W−1}
    /// staging[k·stride + i]) · scale, accumulated in fp32 in that order. Staging slot k holds
    /// what the k-th other rank in rank order pushed.
    kSum,
  };
  Kind kind = Kind::kBarrier;
  int peer = -1;                          ///< kCopy: the receiving rank
  PeerArray src = PeerArray::kInput;      ///< kCopy: the array read (this rank's)
  PeerArray dst = PeerArray::kOutput;     ///< kCopy: the array written (rank `peer`'s)
  size_t src_offset = 0, dst_offset = 0;  ///< elements
  size_t count = 0;                       ///< elements, > 0 for kCopy and kSum
  size_t stride = 0;                      ///< kSum: elements between staging slots
};

/// The steps of one rank for one collective, in order.
using PeerPlan = std::vector<PeerStep>;

/// Elements of `element_bytes` bytes in one staging slot (a piece of a sum): the staging's share
/// of each of the W − 1 senders, rounded down to whole 16-byte vectors so that every piece keeps
/// the sum kernel's vector path. 0 when world < 2 or a share holds no whole vector (then sums
/// cannot go the copy-engine way).
inline size_t peer_piece_elements(int world, size_t element_bytes, size_t staging_bytes) {
  if (world < 2 || element_bytes == 0) return 0;
  return staging_bytes / static_cast<size_t>(world - 1) / 16 * 16 / element_bytes;
}

namespace peer_detail {

/// Elements of an all-reduce's chunks (the last ones shorter or empty): ⌈n / world⌉ rounded up to
/// 64, so that chunks start on whole 16-byte vectors relative to the tensor.
inline size_t chunk_elements(int world, size_t n) {
  const size_t w = static_cast<size_t>(world);
  return ((n + w - 1) / w + 63) / 64 * 64;
}

}  // namespace peer_detail

/// Elements [first, first + count) of an array.
struct PeerRange {
  size_t first = 0, count = 0;
};

/// Chunk k ∈ [0, world) of an all-reduce over n elements, which rank k sums and sends to the
/// others: c = ⌈n / world⌉ rounded up to 64 elements, chunk k = [k·c, (k + 1)·c) ∩ [0, n). The
/// chunks are contiguous and in rank order; the last ones are empty when n < (world − 1)·c.
inline PeerRange peer_all_reduce_chunk(int world, size_t n, int k) {
  const size_t c = peer_detail::chunk_elements(world, n);
  const size_t first = std::min(n, static_cast<size_t>(k) * c);
  return {first, std::min(n, first + c) - first};
}

namespace peer_detail {

inline PeerStep barrier() { return PeerStep{}; }

/// Reduce-scatter by pushes, in pieces of the staging (`piece` elements; `nominal` elements, the
/// same on every rank, decide their count): every rank copies its `count(q)` elements at
/// `send(q)` into rank q's staging slot for this rank, then sums its own `n_own` elements at
/// `own` with what it received into output at `out`.
template <typename Send, typename Count>
void push_and_sum(PeerPlan& plan, int world, int rank, size_t out, size_t own, size_t n_own,
                  Send send, Count count, size_t nominal, size_t piece) {
  const size_t pieces = std::max<size_t>(1, (nominal + piece - 1) / piece);
  for (size_t k = 0; k < pieces; ++k) {
    const size_t begin = k * piece;
    plan.push_back(barrier());  // data ready (first piece) / the receivers' staging is free
    for (int q = 0; q < world; ++q) {
      if (q == rank) continue;
      const size_t total = count(q);
      if (begin >= total) continue;
      const size_t slot = static_cast<size_t>(rank < q ? rank : rank - 1);
      PeerStep s;
      s.kind = PeerStep::Kind::kCopy;
      s.peer = q;
      s.src = PeerArray::kInput;
      s.dst = PeerArray::kStaging;
      s.src_offset = send(q) + begin;
      s.dst_offset = slot * piece;
      s.count = std::min(piece, total - begin);
      plan.push_back(s);
    }
    plan.push_back(barrier());  // every push into this rank's staging has landed
    if (begin < n_own) {
      PeerStep s;
      s.kind = PeerStep::Kind::kSum;
      s.src_offset = own + begin;
      s.dst_offset = out + begin;
      s.count = std::min(piece, n_own - begin);
      s.stride = piece;
      plan.push_back(s);
    }
  }
}

}  // namespace peer_detail

/// Rank `rank`'s plan of a sum all-reduce of n elements of `element_bytes` bytes, in place
/// (kInput and kOutput are the tensor): a reduce-scatter of chunk k into rank k
/// (peer_all_reduce_chunk) in staging pieces, then every rank pushes its reduced chunk into every
/// peer's tensor. nullopt when the shape cannot go this way: world < 2, rank outside
/// [0, world), or a staging share below one 16-byte vector (peer_piece_elements() == 0). The
/// answer depends only on world, element_bytes and staging_bytes, so it is the same on every rank.
inline std::optional<PeerPlan> peer_all_reduce_plan(int world, int rank, size_t n,
                                                    size_t element_bytes, size_t staging_bytes) {
  const size_t piece = peer_piece_elements(world, element_bytes, staging_bytes);
  if (piece == 0 || rank < 0 || rank >= world) return std::nullopt;
  const size_t c = peer_detail::chunk_elements(world, n);
  const PeerRange mine = peer_all_reduce_chunk(world, n, rank);
  PeerPlan plan;
  peer_detail::push_and_sum(
      plan, world, rank, mine.first, mine.first, mine.count,
      [&](int q) { return peer_all_reduce_chunk(world, n, q).first; },
      [&](int q) { return peer_all_reduce_chunk(world, n, q).count; }, c, piece);
  for (int q = 0; q < world; ++q) {
    if (q == rank || mine.count == 0) continue;
    PeerStep s;
    s.kind = PeerStep::Kind::kCopy;
    s.peer = q;
    s.src = PeerArray::kOutput;
    s.dst = PeerArray::kOutput;
    s.src_offset = mine.first;
    s.dst_offset = mine.first;
    s.count = mine.count;
    plan.push_back(s);
  }
  plan.push_back(peer_detail::barrier());  // every peer's chunk has landed here
  return plan;
}

/// Rank `rank`'s plan of a sum reduce-scatter: input [world·n], output [n] (rank r's output is
/// the sum of every rank's input slice r). nullopt as for peer_all_reduce_plan().
inline std::optional<PeerPlan> peer_reduce_scatter_plan(int world, int rank, size_t n,
                                                        size_t element_bytes,
                                                        size_t staging_bytes) {
  const size_t piece = peer_piece_elements(world, element_bytes, staging_bytes);
  if (piece == 0 || rank < 0 || rank >= world) return std::nullopt;
  PeerPlan plan;
  peer_detail::push_and_sum(
      plan, world, rank, 0, static_cast<size_t>(rank) * n, n,
      [&](int q) { return static_cast<size_t>(q) * n; }, [&](int) { return n; }, n, piece);
  return plan;
}

/// Rank `rank`'s plan of an all-gather: input [n], output [world·n] (slice q: rank q's input).
/// The input may be the output's slice `rank` (in place). nullopt when world < 2 or rank is
/// outside [0, world).
inline std::optional<PeerPlan> peer_all_gather_plan(int world, int rank, size_t n) {
  if (world < 2 || rank < 0 || rank >= world) return std::nullopt;
  const size_t mine = static_cast<size_t>(rank) * n;
  PeerPlan plan;
  plan.push_back(peer_detail::barrier());  // nothing reads the output slices being written
  if (n > 0) {
    PeerStep s;  // the own slice first: the pushes read it
    s.kind = PeerStep::Kind::kCopy;
    s.peer = rank;
    s.src = PeerArray::kInput;
    s.dst = PeerArray::kOutput;
    s.src_offset = 0;
    s.dst_offset = mine;
    s.count = n;
    plan.push_back(s);
    for (int q = 0; q < world; ++q) {
      if (q == rank) continue;
      s.peer = q;
      s.src = PeerArray::kOutput;
      s.src_offset = mine;
      plan.push_back(s);
    }
  }
  plan.push_back(peer_detail::barrier());  // every peer's slice has landed here
  return plan;
}

}  // namespace shardtrain
