// The NCCL communicator's copy-engine collectives (comm/peer_collectives.h) against NCCL's own,
// under mpirun with one rank per GPU (tests/CMakeLists.txt runs it with 2 ranks). Each
// collective runs twice on the same random data: on a registered buffer (copy engines) and on an
// unregistered copy (NCCL). Sums over two ranks must match bit for bit (fp32 accumulation of two
// values is exact before the one rounding, in either order); averages within one rounding.
// Without a GPU per rank, or without peer access between them, the tests skip.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "comm/communicator.h"
#include "comm/dist_env.h"
#include "comm/nccl_communicator.h"

#ifdef SHARDTRAIN_WITH_CUDA
#include <cuda_runtime.h>

namespace st = shardtrain;

namespace {

void ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

/// Device buffer of `bytes`, freed on destruction.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t size) : bytes(size) {
    EXPECT_EQ(cudaMalloc(&data, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(data, 0, bytes), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  st::Tensor view(st::DType t) const {
    return st::Tensor(data, t, st::DeviceKind::kCUDA,
                      {static_cast<int64_t>(bytes / st::dtype_size(t))});
  }
  void* data = nullptr;
  size_t bytes;
};

class PeerCollectivesTest : public ::testing::TestWithParam<st::DType> {
 protected:
  static constexpr size_t kBytes = size_t{96} << 20;  // more than the staging: pieces

  void SetUp() override {
    const st::DistributedEnv env = st::read_distributed_env();
    if (env.world_size < 2 || st::cuda_device_count() < env.local_world_size)
      GTEST_SKIP() << "needs one GPU per rank (" << env.local_world_size << " ranks, "
                   << st::cuda_device_count() << " GPUs)";
    ok(cudaSetDevice(env.local_rank));
    ok(cudaStreamCreate(&stream_));
    comm_ = st::make_world_communicator(env, st::DeviceKind::kCUDA, stream_);
    if (comm_->registration_staging_bytes() == 0)
      GTEST_SKIP() << "the GPUs cannot access each other's memory: no copy-engine path";
    registered_ = std::make_unique<DeviceBuffer>(kBytes);
    plain_ = std::make_unique<DeviceBuffer>(kBytes);
    staging_ = std::make_unique<DeviceBuffer>(comm_->registration_staging_bytes());
    registration_ = comm_->register_buffers({registered_->view(st::DType::kU16)},
                                            staging_->view(st::DType::kU16));
    ASSERT_NE(registration_, nullptr) << "peer access reported but registration failed";
  }

  void TearDown() override {
    if (stream_) cudaStreamSynchronize(stream_);
    registration_.reset();
    comm_.reset();
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const { return comm_->rank(); }
  int world() const { return comm_->world_size(); }

  /// Fills both buffers with the same random values of `dtype` (different on every rank).
  void fill(st::DType dtype, uint32_t salt) {
    std::mt19937 gen(1234u + 977u * static_cast<uint32_t>(rank()) + salt);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<uint8_t> host(kBytes);
    if (dtype == st::DType::kF32) {
      auto* f = reinterpret_cast<float*>(host.data());
      for (size_t i = 0; i < kBytes / 4; ++i) f[i] = dist(gen);
    } else {  // bf16: the top half of an fp32
      auto* h = reinterpret_cast<uint16_t*>(host.data());
      for (size_t i = 0; i < kBytes / 2; ++i) {
        const float v = dist(gen);
        uint32_t b;
        std::memcpy(&b, &v, 4);
        h[i] = static_cast<uint16_t>(b >> 16);
      }
    }
    ok(cudaMemcpy(registered_->data, host.data(), kBytes, cudaMemcpyHostToDevice));
    ok(cudaMemcpy(plain_->data, host.data(), kBytes, cudaMemcpyHostToDevice));
  }

  /// Elements [offset, offset + n) of both buffers.
  st::Tensor reg(st::DType t, int64_t offset, int64_t n) const {
    return registered_->view(t).slice1d(offset, n);
  }
  st::Tensor plain(st::DType t, int64_t offset, int64_t n) const {
    return plain_->view(t).slice1d(offset, n);
  }

  /// Both buffers after the stream finished, element by element: bitwise, or within `rel`.
  void expect_same(st::DType dtype, double rel) {
    ok(cudaStreamSynchronize(stream_));
    std::vector<uint8_t> a(kBytes), b(kBytes);
    ok(cudaMemcpy(a.data(), registered_->data, kBytes, cudaMemcpyDeviceToHost));
    ok(cudaMemcpy(b.data(), plain_->data, kBytes, cudaMemcpyDeviceToHost));
    if (rel == 0) {
      size_t first = kBytes;
      for (size_t i = 0; i < kBytes; ++i)
        if (a[i] != b[i]) {
          first = i;
          break;
        }
      EXPECT_EQ(first, kBytes) << "rank " << rank() << ": first differing byte " << first;
      return;
    }
    const size_t n = kBytes / st::dtype_size(dtype);
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      float x, y;
      if (dtype == st::DType::kF32) {
        std::memcpy(&x, a.data() + 4 * i, 4);
        std::memcpy(&y, b.data() + 4 * i, 4);
      } else {
        uint32_t u = static_cast<uint32_t>(reinterpret_cast<uint16_t*>(a.data())[i]) << 16;
        uint32_t v = static_cast<uint32_t>(reinterpret_cast<uint16_t*>(b.data())[i]) << 16;
        std::memcpy(&x, &u, 4);
        std::memcpy(&y, &v, 4);
      }
      if (std::abs(x - y) > rel * std::max(std::abs(x), std::abs(y)) + 1e-30) ++bad;
    }
    EXPECT_EQ(bad, 0u) << "rank " << rank();
  }

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<st::Communicator> comm_;
  std::unique_ptr<DeviceBuffer> registered_, plain_, staging_;
  std::unique_ptr<st::BufferRegistration> registration_;
};

TEST_P(PeerCollectivesTest, AllReduceSumMatchesNcclBitForBit) {
  const st::DType t = GetParam();
  const int64_t total = static_cast<int64_t>(kBytes / st::dtype_size(t));
  fill(t, 1);
  // Odd offsets and sizes (scalar tails, unaligned vectors), several in flight at once, and one
  // larger than the staging buffer.
  const std::pair<int64_t, int64_t> slices[] = {
      {0, 1},        {1, 5}, {7, 1'000'003}, {2'000'000, 4'194'304}, {total / 4, total / 2 + 3},
      {3, total - 7}};
  std::vector<std::unique_ptr<st::Work>> work;
  for (const auto& [off, n] : slices) {
    work.push_back(comm_->all_reduce(reg(t, off, n), st::ReduceOp::kSum));
    work.push_back(comm_->all_reduce(plain(t, off, n), st::ReduceOp::kSum));
  }
  for (auto& w : work) w->wait();
  expect_same(t, 0);
}

TEST_P(PeerCollectivesTest, AllReduceAvgWithinOneRounding) {
  const st::DType t = GetParam();
  fill(t, 2);
  comm_->all_reduce(reg(t, 3, 3'000'001), st::ReduceOp::kAvg)->wait();
  comm_->all_reduce(plain(t, 3, 3'000'001), st::ReduceOp::kAvg)->wait();
  expect_same(t, t == st::DType::kF32 ? 1e-6 : 1e-2);
}

TEST_P(PeerCollectivesTest, ReduceScatterInPlaceAndOutOfPlace) {
  const st::DType t = GetParam();
  const int64_t w = world(), r = rank();
  fill(t, 3);
  // In place: the rank's own slice receives the sum (as the ZeRO strategies call it).
  const int64_t n = 9'000'001, off = 64;  // per-rank slice above the staging: pieces
  comm_->reduce_scatter(reg(t, off + r * n, n), reg(t, off, w * n), st::ReduceOp::kSum)->wait();
  comm_->reduce_scatter(plain(t, off + r * n, n), plain(t, off, w * n), st::ReduceOp::kSum)->wait();
  // Out of place; the output (not read by the peers) need not be registered.
  const int64_t m = 3'000'001, in_off = off + w * n + 5, out_off = 100;
  comm_->reduce_scatter(reg(t, out_off, m), reg(t, in_off, w * m), st::ReduceOp::kSum)->wait();
  comm_->reduce_scatter(plain(t, out_off, m), plain(t, in_off, w * m), st::ReduceOp::kSum)->wait();
  expect_same(t, 0);
}

TEST_P(PeerCollectivesTest, AllGatherInPlaceAndOutOfPlace) {
  const st::DType t = GetParam();
  const int64_t w = world(), r = rank();
  fill(t, 4);
  const int64_t n = 777'777, off = 3;
  comm_->all_gather(reg(t, off, w * n), reg(t, off + r * n, n))->wait();
  comm_->all_gather(plain(t, off, w * n), plain(t, off + r * n, n))->wait();
  const int64_t m = 2'000'003, in_off = 4'000'000, out_off = 10'000'000;
  comm_->all_gather(reg(t, out_off, w * m), reg(t, in_off, m))->wait();
  comm_->all_gather(plain(t, out_off, w * m), plain(t, in_off, m))->wait();
  expect_same(t, 0);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PeerCollectivesTest,
                         ::testing::Values(st::DType::kF32, st::DType::kBF16),
                         [](const ::testing::TestParamInfo<st::DType>& p) {
                           return p.param == st::DType::kF32 ? std::string("fp32")
                                                             : std::string("bf16");
                         });

}  // namespace

#else
TEST(PeerCollectivesTest, NeedsCuda) { GTEST_SKIP() << "built without CUDA"; }
#endif
