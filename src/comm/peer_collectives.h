// Copy-engine collectives between the GPUs of one node, for the NCCL communicator
// (comm/nccl_communicator_cuda.cpp). CUDA-only; compiled into shardtrain_cuda.
//
// Why: NCCL moves data with kernels that hold SMs (up to 32 CTAs on Hopper NVLink) for the whole
// collective, taking them from the GEMMs the collectives overlap. Here data moves by the GPUs' copy
// engines (DMA: cudaMemcpyAsync between peers mapped through CUDA IPC), which take no SMs; only the
// element-wise sums run as kernels, in short bursts over the whole GPU. The design follows
// PyTorch's low-contention SymmetricMemory collectives (pytorch/pytorch#130583). On 2×H200
// (gpt2-medium, micro-batch 4 × 512, measured 2026-11-21) it raised per-GPU throughput over NCCL
// for dp (237 k against 231 k tokens/s), zero1 (240 k / 237 k) and zero2 (238 k / 233 k; 247 k with
// 12.5 M-element buckets, which NCCL made slower: 218 k). Lessons measured on the way: pulling
// (reading the peer across NVLink) and pushing moved the same ~100 GB/s while the sum kernel had
// 32 blocks — the sum was the bound; with 2 blocks per SM an all-gather pushes ~375 GB/s; copies
// split over several streams gained nothing; the copies and barriers need the driver's several
// hardware queues (with CUDA_DEVICE_MAX_CONNECTIONS=1 they blocked the compute: 194 k tokens/s).
//
// Buffers: every rank registers its buffers (same sizes, same order on every rank), and a
// collective's tensors must lie at the same offset of the same registered buffer on every rank
// (NCCL's NCCL_WIN_COLL_SYMMETRIC contract). The strategies' flat buffers satisfy it: their
// layouts are identical on every rank.
//
// Algorithms (the chunks, pieces and offsets of each step come from the pure host plans of
// comm/peer_chunks.h; this file turns their offsets into addresses and runs them). Data moves by
// pushes (the sender's copy engine writes into the peer's buffer or staging). "barrier" = every
// rank signals every other rank's flag and waits for theirs, a sequence number per barrier, by
// stream memory operations (cuStreamWriteValue32 with its system-wide fence, cuStreamWaitValue32:
// run by the GPU's front end, no SM):
//   reduce_scatter  per staging-sized piece: barrier (data ready, staging free); push slice q to
//                   rank q's staging slot for this rank; barrier (pushes landed); sum own slice r
//                   and the staged slices into the output.
//   all_reduce      reduce-scatter of chunk k into rank k as above (chunk k = elements
//                   [k·c, min(n, (k+1)·c)), c = ⌈n/W⌉ rounded up to 64 elements); push chunk r
//                   into every peer's chunk r; barrier.
//   all_gather      barrier; push own slice into every peer's slice r; barrier.
// Sums accumulate in fp32, the own value first and then the peers' in rank order, so for W = 2
// the result equals NCCL's bit for bit; for W > 2 it differs from NCCL's (another order, and
// bf16/fp16 NCCL rounds every partial sum) by summation-order rounding. Every rank holds the same
// result of an all-reduce (rank k's sum of chunk k, copied).
#pragma once

#include <cuda.h>  // CUresult, CUstream: the stream memory operations
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "comm/peer_chunks.h"
#include "core/tensor.h"

namespace shardtrain {

/// All-gather of `bytes` bytes from every rank: `all` receives W·bytes in rank order. Blocking.
using ByteAllGather = std::function<void(const void* mine, size_t bytes, void* all)>;

class PeerCollectives {
 public:
  /// cuStreamWriteValue32 / cuStreamWaitValue32, reached through cudaGetDriverEntryPointByVersion.
  using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

  /// Collective over the W ranks. Returns null (on every rank alike) when W > 8, the ranks are
  /// not all on one node — one host name and one `node` index (the launcher's GROUP_RANK: nodes
  /// emulated on one host are nodes too) — some GPU cannot access another's memory
  /// (cudaDeviceCanAccessPeer), or the driver lacks the stream memory operations. A barrier waits
  /// without a deadline: the communicator's watchdog ends the process when a peer never arrives.
  /// Throws RuntimeFailure when CUDA fails.
  static std::unique_ptr<PeerCollectives> create(int rank, int world, int device, int node,
                                                 const ByteAllGather& exchange);
  ~PeerCollectives();
  PeerCollectives(const PeerCollectives&) = delete;
  PeerCollectives& operator=(const PeerCollectives&) = delete;

  /// Maps every peer's copy of `buffers` (each the start of a cudaMalloc allocation; the same
  /// count and byte sizes on every rank) and takes `staging` (device memory of this rank, at
  /// least kPeerStagingBytes) for the sums. Collective. Returns a key for release(), or -1 on
  /// every rank when some rank could not map a peer's memory (then nothing is registered).
  int register_buffers(const std::vector<Tensor>& buffers, Tensor staging,
                       const ByteAllGather& exchange);
  /// Drops the registration `key` (local; closes the peer mappings).
  void release(int key);

  /// Whether `t` lies inside a registered buffer.
  bool covers(const Tensor& t) const;

  /// The plans of the collectives this way, or nullopt when the collective must go to NCCL. Every
  /// rank gets the same answer: it depends on whether the tensor the peers write into lies in a
  /// registered buffer (at the same offset on every rank, by the registration contract), the
  /// dtype, element count and `op`, the world size and the staging size — never on the rank.
  ///   all_reduce      `t` [n] registered; fp32/bf16/fp16; kSum or kAvg.
  ///   reduce_scatter  `input` [W·n] registered (the peers write into the staging); output [n]
  ///                   anywhere on this GPU, or input's slice r; fp32/bf16/fp16; kSum or kAvg.
  ///   all_gather      `output` [W·n] registered; input [n] anywhere on this GPU, or output's
  ///                   slice r; any dtype.
  /// Sums also need a registration's staging to hold a 16-byte vector per peer
  /// (peer_piece_elements() > 0; always true of kPeerStagingBytes with W ≤ 8).
  std::optional<PeerPlan> all_reduce_plan(const Tensor& t, ReduceOp op) const;
  std::optional<PeerPlan> reduce_scatter_plan(const Tensor& output, const Tensor& input,
                                              ReduceOp op) const;
  std::optional<PeerPlan> all_gather_plan(const Tensor& output, const Tensor& input) const;

  /// Enqueues `plan` (from the *_plan() function of the same tensors and op) on `stream`:
  /// kInput/kOutput address `input`/`output` (all_reduce: both the tensor), kStaging the latest
  /// registration's staging; kAvg sums are scaled by 1/W. Throws RuntimeFailure when CUDA fails.
  void run(const PeerPlan& plan, const Tensor& input, const Tensor& output, ReduceOp op,
           cudaStream_t stream);

 private:
  PeerCollectives(int rank, int world, int device);
  struct Region;
  struct Mapping;
  /// The registered region holding [p, p + bytes), or null.
  const Region* find(const void* p, size_t bytes) const;
  /// Peer `q`'s address of local address `p` (inside a registered region).
  void* peer_address(const void* p, int q) const;
  void barrier(cudaStream_t stream);
  /// A copy between this GPU and a peer (copy engine), on `stream`.
  void copy(void* dst, const void* src, size_t bytes, cudaStream_t stream);
  /// The staging region of the latest registration (peers push into it), or null.
  const Region* staging_region() const;
  /// Whether sums of `t` (its dtype, `op`) can go this way: fp32/bf16/fp16, kSum or kAvg, and
  /// buffers are registered (their staging receives the peers' data).
  bool can_sum(const Tensor& t, ReduceOp op) const;
  /// out[0, n) ← (own[0, n) + Σ over senders of their staged [0, n)) · scale.
  void launch_sum_dt(void* out, const void* own, const void* staged, size_t stride, size_t n,
                     DType dt, float scale, cudaStream_t stream);

  int rank_, world_, device_;
  uint64_t seq_ = 0;
  void* flags_ = nullptr;                  ///< [8] uint64 signals the peers write, this GPU
  int sum_blocks_ = 264;                   ///< blocks of the sum kernel: 2 per SM
  StreamValue32Fn write_value_ = nullptr;  ///< the driver's cuStreamWriteValue32
  StreamValue32Fn wait_value_ = nullptr;   ///< the driver's cuStreamWaitValue32
  std::vector<void*> peer_flags_;          ///< [W] the peers' signal arrays, mapped (own: null)
  std::vector<std::unique_ptr<Mapping>> mappings_;
  int next_key_ = 0;
};

}  // namespace shardtrain
