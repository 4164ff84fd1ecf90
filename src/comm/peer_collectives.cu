// Copy-engine collectives between the GPUs of one node (comm/peer_collectives.h).
#include <cuda.h>  // types and flags of the stream memory operations (no libcuda link: entry points)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
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
  int node;  ///< the launcher's node index (emulated nodes share a host name)
};

/// The host, node and PCI bus id of `device`.
HostId host_id(int device, int node) {
  HostId id{};
  id.node = node;
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

std::unique_ptr<PeerCollectives> PeerCollectives::create(int rank, int world, int device, int node,
                                                         const ByteAllGather& exchange) {
  // Every rank takes part in every exchange below and decides from the same data, so all agree.
  std::vector<HostId> ids(static_cast<size_t>(world));
  const HostId mine = host_id(device, node);
  exchange(&mine, sizeof mine, ids.data());
  const StreamValue32Fn write_value = driver_entry("cuStreamWriteValue32");
  const StreamValue32Fn wait_value = driver_entry("cuStreamWaitValue32");
  bool ok = world >= 2 && world <= kMaxPeers && write_value && wait_value;
  for (int q = 0; ok && q < world; ++q) {
    if (q == rank) continue;
    const HostId& id = ids[static_cast<size_t>(q)];
    int peer_device = -1, can = 0;
    ok = std::strncmp(id.host, mine.host, sizeof id.host) == 0 && id.node == mine.node &&
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

std::optional<PeerPlan> PeerCollectives::all_reduce_plan(const Tensor& t, ReduceOp op) const {
  if (!covers(t) || !can_sum(t, op)) return std::nullopt;
  return peer_all_reduce_plan(world_, rank_, static_cast<size_t>(t.numel()), dtype_size(t.dtype),
                              staging_region()->bytes);
}

std::optional<PeerPlan> PeerCollectives::reduce_scatter_plan(const Tensor& output,
                                                             const Tensor& input,
                                                             ReduceOp op) const {
  if (!covers(input) || !can_sum(input, op) || output.dtype != input.dtype ||
      input.numel() != output.numel() * world_)
    return std::nullopt;
  return peer_reduce_scatter_plan(world_, rank_, static_cast<size_t>(output.numel()),
                                  dtype_size(input.dtype), staging_region()->bytes);
}

std::optional<PeerPlan> PeerCollectives::all_gather_plan(const Tensor& output,
                                                         const Tensor& input) const {
  if (!covers(output) || output.dtype != input.dtype || output.numel() != input.numel() * world_)
    return std::nullopt;
  return peer_all_gather_plan(world_, rank_, static_cast<size_t>(input.numel()));
}

void PeerCollectives::run(const PeerPlan& plan, const Tensor& input, const Tensor& output,
                          ReduceOp op, cudaStream_t stream) {
  ST_CUDA_CHECK(cudaSetDevice(device_));
  const size_t esize = dtype_size(input.dtype);
  const float scale = op == ReduceOp::kAvg ? 1.0f / static_cast<float>(world_) : 1.0f;
  const Region* staging = staging_region();
  // This rank's address of element `offset` of array `a`.
  const auto at = [&](PeerArray a, size_t offset) {
    char* base = a == PeerArray::kInput    ? static_cast<char*>(input.data)
                 : a == PeerArray::kOutput ? static_cast<char*>(output.data)
                                           : (staging ? staging->base : nullptr);
    ST_ASSERT(base != nullptr);
    return base + offset * esize;
  };
  for (const PeerStep& s : plan) {
    switch (s.kind) {
      case PeerStep::Kind::kBarrier:
        barrier(stream);
        break;
      case PeerStep::Kind::kCopy: {
        const char* src = at(s.src, s.src_offset);
        char* dst = at(s.dst, s.dst_offset);
        if (s.peer != rank_) dst = static_cast<char*>(peer_address(dst, s.peer));
        if (dst != src) copy(dst, src, s.count * esize, stream);  // in place: nothing to copy
        break;
      }
      case PeerStep::Kind::kSum:
        launch_sum_dt(at(PeerArray::kOutput, s.dst_offset), at(PeerArray::kInput, s.src_offset),
                      at(PeerArray::kStaging, 0), s.stride, s.count, input.dtype, scale, stream);
        break;
    }
  }
}

}  // namespace shardtrain
