// Copy-engine collectives between the GPUs of one node (comm/peer_collectives.h).
#include <cuda.h>  // types and flags of the stream memory operations (no libcuda link: entry points)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>

#include "backend/cuda/cuda_common.h"  // bf16/fp16 <-> fp32 in kernels
#include "comm/peer_collectives.h"
#include "core/error.h"

namespace shardtrain {
namespace {

constexpr int kMaxPeers = 8;

/// out[i] = (own[i] + Σ_k staged[k·stride + i]) · scale for i < n, accumulated in fp32 in the
/// order own, staged[0], staged[1], ... Vectors of 16 bytes when every pointer and the stride
/// allow (`vec`), else one element at a time.
template <typename T>
__global__ void sum_kernel(T* out, const T* own, const T* staged, size_t stride, int npeers,
                           size_t n, float scale, bool vec) {
  constexpr int kV = 16 / sizeof(T);
  const size_t threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nv = vec ? n / kV : 0;
  for (size_t v = tid; v < nv; v += threads) {
    float acc[kV];
    const uint4 a = reinterpret_cast<const uint4*>(own)[v];
    const T* av = reinterpret_cast<const T*>(&a);
#pragma unroll
    for (int j = 0; j < kV; ++j) acc[j] = cuda::to_float(av[j]);
    for (int k = 0; k < npeers; ++k) {
      const uint4 b = reinterpret_cast<const uint4*>(staged + k * stride)[v];
      const T* bv = reinterpret_cast<const T*>(&b);
#pragma unroll
      for (int j = 0; j < kV; ++j) acc[j] += cuda::to_float(bv[j]);
    }
    uint4 o;
    T* ov = reinterpret_cast<T*>(&o);
#pragma unroll
    for (int j = 0; j < kV; ++j)
      ov[j] = cuda::from_float<T>(scale == 1.0f ? acc[j] : acc[j] * scale);
    reinterpret_cast<uint4*>(out)[v] = o;
  }
  // The elements after the last whole vector (all of them without `vec`).
  for (size_t i = nv * kV + tid; i < n; i += threads) {
    float acc = cuda::to_float(own[i]);
    for (int k = 0; k < npeers; ++k) acc += cuda::to_float(staged[k * stride + i]);
    out[i] = cuda::from_float<T>(scale == 1.0f ? acc : acc * scale);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
void launch_sum(void* out, const void* own, const void* staged, size_t stride, int npeers, size_t n,
                float scale, int max_blocks, cudaStream_t stream) {
  const bool vec =
      aligned16(out) && aligned16(own) && aligned16(staged) && (stride * sizeof(T)) % 16 == 0;
  const size_t work = vec ? n / (16 / sizeof(T)) + 1 : n;
  // Enough blocks to reach memory bandwidth: a short burst over the whole GPU disturbs the
  // overlapped compute less than a long trickle (with 32 blocks the sum, not the copy, bounded
  // the reduce-scatter at ~100 GB/s).
  const int blocks = static_cast<int>(std::min<size_t>(max_blocks, (work + 255) / 256));
  sum_kernel<T><<<std::max(blocks, 1), 256, 0, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(own), static_cast<const T*>(staged), stride,
      npeers, n, scale, vec);
  ST_CUDA_LAUNCH_CHECK();
}

/// The driver's cuStreamWriteValue32 / cuStreamWaitValue32 through the runtime (no link against
/// libcuda, which the GPU-less build machines lack); null when unavailable.
PeerCollectives::StreamValue32Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<PeerCollectives::StreamValue32Fn>(fn);
}

CUdeviceptr device_ptr(const void* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
}

struct HostId {
  char host[64];
  char bus[32];
};

/// The host and PCI bus id of `device`.
HostId host_id(int device) {
  HostId id{};
  gethostname(id.host, sizeof id.host - 1);
  ST_CUDA_CHECK(cudaDeviceGetPCIBusId(id.bus, sizeof id.bus, device));
  return id;
}

/// Whether every rank reported `ok`.
bool all_agree(bool ok, int world, const ByteAllGather& exchange) {
  const int mine = ok ? 1 : 0;
  std::vector<int> all(static_cast<size_t>(world));
  exchange(&mine, sizeof mine, all.data());
  return std::all_of(all.begin(), all.end(), [](int v) { return v == 1; });
}

}  // namespace

struct PeerCollectives::Region {
  char* base = nullptr;
  size_t bytes = 0;
  std::vector<char*> peer;  ///< [W] the peers' copies, mapped (own: base)
};

struct PeerCollectives::Mapping {
  int key = 0;
  std::vector<Region> regions;
  std::vector<void*> opened;  ///< cudaIpcOpenMemHandle results, closed in release()
};

PeerCollectives::PeerCollectives(int rank, int world, int device)
    : rank_(rank), world_(world), device_(device) {}

std::unique_ptr<PeerCollectives> PeerCollectives::create(int rank, int world, int device,
                                                         const ByteAllGather& exchange) {
  // Every rank takes part in every exchange below and decides from the same data, so all agree.
  std::vector<HostId> ids(static_cast<size_t>(world));
  const HostId mine = host_id(device);
  exchange(&mine, sizeof mine, ids.data());
  const StreamValue32Fn write_value = driver_entry("cuStreamWriteValue32");
  const StreamValue32Fn wait_value = driver_entry("cuStreamWaitValue32");
  bool ok = world >= 2 && world <= kMaxPeers && write_value && wait_value;
  for (int q = 0; ok && q < world; ++q) {
    if (q == rank) continue;
    const HostId& id = ids[static_cast<size_t>(q)];
    int peer_device = -1, can = 0;
    ok = std::strncmp(id.host, mine.host, sizeof id.host) == 0 &&
         cudaDeviceGetByPCIBusId(&peer_device, id.bus) == cudaSuccess &&
         cudaDeviceCanAccessPeer(&can, device, peer_device) == cudaSuccess && can == 1;
    (void)cudaGetLastError();
  }
  if (!all_agree(ok, world, exchange)) return nullptr;
  std::unique_ptr<PeerCollectives> pc(new PeerCollectives(rank, world, device));
  pc->write_value_ = write_value;
  pc->wait_value_ = wait_value;
  ST_CUDA_CHECK(cudaSetDevice(device));
  ST_CUDA_CHECK(cudaMalloc(&pc->flags_, kMaxPeers * sizeof(uint64_t)));
  ST_CUDA_CHECK(cudaMemset(pc->flags_, 0, kMaxPeers * sizeof(uint64_t)));
  ST_CUDA_CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t h{};
  ST_CUDA_CHECK(cudaIpcGetMemHandle(&h, pc->flags_));
  std::vector<cudaIpcMemHandle_t> all(static_cast<size_t>(world));
  exchange(&h, sizeof h, all.data());
  pc->peer_flags_.assign(static_cast<size_t>(world), nullptr);
  bool opened = true;
  for (int q = 0; q < world; ++q) {
    if (q == rank) continue;
    void* p = nullptr;
    if (cudaIpcOpenMemHandle(&p, all[static_cast<size_t>(q)], cudaIpcMemLazyEnablePeerAccess) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      opened = false;
      continue;
    }
    pc->peer_flags_[static_cast<size_t>(q)] = p;
  }
  if (!all_agree(opened, world, exchange)) return nullptr;  // the destructor closes what opened
  int sms = 0;
  ST_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  pc->sum_blocks_ = std::max(1, 2 * sms);
  return pc;
}

PeerCollectives::~PeerCollectives() {
  cudaSetDevice(device_);
  while (!mappings_.empty()) release(mappings_.back()->key);
  for (void* p : peer_flags_)
    if (p) cudaIpcCloseMemHandle(p);
  if (flags_) cudaFree(flags_);
}

int PeerCollectives::register_buffers(const std::vector<Tensor>& buffers, Tensor staging,
                                      const ByteAllGather& exchange) {
  ST_CUDA_CHECK(cudaSetDevice(device_));
  struct Entry {
    cudaIpcMemHandle_t handle;
    uint64_t bytes;
  };
  auto m = std::make_unique<Mapping>();
  m->key = next_key_++;
  bool ok = staging.bytes() >= kPeerStagingBytes;
  std::vector<Tensor> all_buffers = buffers;
  all_buffers.push_back(staging);  // the last region: the peers push into it
  for (const Tensor& b : all_buffers) {
    Entry e{};
    e.bytes = b.bytes();
    if (ok && cudaIpcGetMemHandle(&e.handle, b.data) != cudaSuccess) {
      (void)cudaGetLastError();
      ok = false;
    }
    std::vector<Entry> all(static_cast<size_t>(world_));
    exchange(&e, sizeof e, all.data());
    Region r;
    r.base = static_cast<char*>(b.data);
    r.bytes = b.bytes();
    r.peer.assign(static_cast<size_t>(world_), nullptr);
    r.peer[static_cast<size_t>(rank_)] = r.base;
    for (int q = 0; q < world_; ++q) {
      if (q == rank_ || !ok) continue;
      const Entry& pe = all[static_cast<size_t>(q)];
      void* p = nullptr;
      if (pe.bytes != e.bytes ||
          cudaIpcOpenMemHandle(&p, pe.handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
        (void)cudaGetLastError();
        ok = false;
        continue;
      }
      m->opened.push_back(p);
      r.peer[static_cast<size_t>(q)] = static_cast<char*>(p);
    }
    m->regions.push_back(std::move(r));
  }
  const int key = m->key;
  mappings_.push_back(std::move(m));
  if (!all_agree(ok, world_, exchange)) {
    release(key);
    return -1;
  }
  return key;
}

void PeerCollectives::release(int key) {
  for (auto it = mappings_.begin(); it != mappings_.end(); ++it) {
    if ((*it)->key != key) continue;
    cudaSetDevice(device_);
    for (void* p : (*it)->opened) cudaIpcCloseMemHandle(p);
    mappings_.erase(it);
    return;
  }
}

const PeerCollectives::Region* PeerCollectives::find(const void* p, size_t bytes) const {
  const char* c = static_cast<const char*>(p);
  for (const auto& m : mappings_)
    for (const Region& r : m->regions)
      if (c >= r.base && c + bytes <= r.base + r.bytes) return &r;
  return nullptr;
}

const PeerCollectives::Region* PeerCollectives::staging_region() const {
  return mappings_.empty() ? nullptr : &mappings_.back()->regions.back();
}

bool PeerCollectives::covers(const Tensor& t) const {
  return t.device == DeviceKind::kCUDA && t.data != nullptr && find(t.data, t.bytes()) != nullptr;
}

bool PeerCollectives::can_sum(const Tensor& t, ReduceOp op) const {
  return t.device == DeviceKind::kCUDA && staging_region() != nullptr && op != ReduceOp::kMax &&
         (t.dtype == DType::kF32 || t.dtype == DType::kBF16 || t.dtype == DType::kF16);
}

void* PeerCollectives::peer_address(const void* p, int q) const {
  const char* c = static_cast<const char*>(p);
  const Region* r = find(p, 1);
  ST_ASSERT(r != nullptr);
  return r->peer[static_cast<size_t>(q)] + (c - r->base);
}

void PeerCollectives::barrier(cudaStream_t stream) {
  // Stream memory operations: the GPU's front end writes and waits, no SM is taken. The write is
  // preceded by a system-wide fence (CU_STREAM_WRITE_VALUE_DEFAULT), so a peer that sees the flag
  // sees this rank's earlier writes. 32-bit flags: GEQ compares modulo 2^32.
  const auto seq = static_cast<cuuint32_t>(++seq_);
  const auto cs = reinterpret_cast<CUstream>(stream);
  for (int q = 0; q < world_; ++q) {
    if (q == rank_) continue;
    auto* slot = static_cast<uint64_t*>(peer_flags_[static_cast<size_t>(q)]) + rank_;
    if (write_value_(cs, device_ptr(slot), seq, CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS)
      throw RuntimeFailure("CUDA: cuStreamWriteValue32 (peer barrier) failed");
  }
  for (int q = 0; q < world_; ++q) {
    if (q == rank_) continue;
    auto* slot = static_cast<uint64_t*>(flags_) + q;
    if (wait_value_(cs, device_ptr(slot), seq, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
      throw RuntimeFailure("CUDA: cuStreamWaitValue32 (peer barrier) failed");
  }
}

void PeerCollectives::copy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
}

void PeerCollectives::launch_sum_dt(void* out, const void* own, const void* staged, size_t stride,
                                    size_t n, DType dt, float scale, cudaStream_t stream) {
  const int npeers = world_ - 1;
  switch (dt) {
    case DType::kF32:
      launch_sum<float>(out, own, staged, stride, npeers, n, scale, sum_blocks_, stream);
      break;
    case DType::kBF16:
      launch_sum<__nv_bfloat16>(out, own, staged, stride, npeers, n, scale, sum_blocks_, stream);
      break;
    case DType::kF16:
      launch_sum<__half>(out, own, staged, stride, npeers, n, scale, sum_blocks_, stream);
      break;
    default:
      ST_ASSERT(false);
  }
}

void PeerCollectives::push_and_sum(void* out, const void* own, size_t n_own,
                                   const std::function<const char*(int)>& send,
                                   const std::function<size_t(int)>& count, size_t nominal,
                                   DType dt, float scale, cudaStream_t stream) {
  const Region& st = *staging_region();
  const size_t esize = dtype_size(dt);
  const size_t npeers = static_cast<size_t>(world_ - 1);
  // Pieces of whole 16-byte vectors so every piece keeps the vector path; one slot per sender.
  const size_t piece = (st.bytes / npeers) / 16 * 16 / esize;
  const size_t pieces = std::max<size_t>(1, (nominal + piece - 1) / piece);  // same on every rank
  for (size_t k = 0; k < pieces; ++k) {
    const size_t begin = k * piece;
    // Every rank's data is ready (first piece) / every receiver has summed the previous piece,
    // so its staging is free.
    barrier(stream);
    for (int q = 0; q < world_; ++q) {
      if (q == rank_) continue;
      const size_t total = count(q);
      if (begin >= total) continue;
      const size_t slot = static_cast<size_t>(rank_ < q ? rank_ : rank_ - 1);
      copy(st.peer[static_cast<size_t>(q)] + slot * piece * esize, send(q) + begin * esize,
           std::min(piece, total - begin) * esize, stream);
    }
    barrier(stream);  // every push into this rank's staging has landed
    if (begin < n_own)
      launch_sum_dt(static_cast<char*>(out) + begin * esize,
                    static_cast<const char*>(own) + begin * esize, st.base, piece,
                    std::min(piece, n_own - begin), dt, scale, stream);
  }
}

void PeerCollectives::all_reduce(const Tensor& t, ReduceOp op, cudaStream_t stream) {
  ST_CUDA_CHECK(cudaSetDevice(device_));
  const size_t n = static_cast<size_t>(t.numel()), esize = dtype_size(t.dtype);
  const size_t w = static_cast<size_t>(world_);
  const size_t c = ((n + w - 1) / w + 63) / 64 * 64;
  const auto first = [&](int k) { return std::min(n, static_cast<size_t>(k) * c); };
  const auto count = [&](int k) { return std::min(n, first(k) + c) - first(k); };
  const float scale = op == ReduceOp::kAvg ? 1.0f / static_cast<float>(world_) : 1.0f;
  char* data = static_cast<char*>(t.data);
  char* mine = data + first(rank_) * esize;
  // Reduce-scatter: every rank pushes its chunk q to rank q, which sums it into its own chunk.
  push_and_sum(
      mine, mine, count(rank_), [&](int q) { return data + first(q) * esize; }, count, c, t.dtype,
      scale, stream);
  // All-gather: push the reduced chunk into every peer's copy. The peers finished reading their
  // chunk `rank_` (their pushes above landed before the last barrier).
  for (int q = 0; q < world_; ++q)
    if (q != rank_ && count(rank_) > 0)
      copy(peer_address(mine, q), mine, count(rank_) * esize, stream);
  barrier(stream);  // every peer's chunk has landed here
}

void PeerCollectives::reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op,
                                     cudaStream_t stream) {
  ST_CUDA_CHECK(cudaSetDevice(device_));
  const size_t n = static_cast<size_t>(output.numel()), esize = dtype_size(input.dtype);
  const float scale = op == ReduceOp::kAvg ? 1.0f / static_cast<float>(world_) : 1.0f;
  const char* in = static_cast<const char*>(input.data);
  push_and_sum(
      output.data, in + static_cast<size_t>(rank_) * n * esize, n,
      [&](int q) { return in + static_cast<size_t>(q) * n * esize; }, [&](int) { return n; }, n,
      input.dtype, scale, stream);
}

void PeerCollectives::all_gather(const Tensor& output, const Tensor& input, cudaStream_t stream) {
  ST_CUDA_CHECK(cudaSetDevice(device_));
  const size_t bytes = input.bytes();
  char* slice = static_cast<char*>(output.data) + static_cast<size_t>(rank_) * bytes;
  barrier(stream);  // every rank reached it: nothing reads the output slices being written
  if (slice != input.data && bytes > 0)
    ST_CUDA_CHECK(cudaMemcpyAsync(slice, input.data, bytes, cudaMemcpyDeviceToDevice, stream));
  for (int q = 0; q < world_; ++q)
    if (q != rank_ && bytes > 0) copy(peer_address(slice, q), slice, bytes, stream);
  barrier(stream);  // every peer's slice has landed here
}

}  // namespace shardtrain
