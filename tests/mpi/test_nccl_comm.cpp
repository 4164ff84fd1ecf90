// The NCCL communicator's copy-engine collectives (comm/peer_collectives.h) against a host model
// and NCCL's own, under mpirun with one rank per GPU (tests/CMakeLists.txt runs it with 2, 3 and
// 4 ranks). Each collective runs twice on the same data: on a registered buffer (copy engines)
// and on an unregistered copy (NCCL). Every rank also keeps every rank's data on the host and
// applies each collective there as the copy-engine path computes it (comm/peer_chunks.h: chunk k
// of an all-reduce summed by rank k, its own value first and then the others in rank order, in
// fp32, rounded once). The registered buffer must equal that model bit for bit at any rank count,
// including every element outside the collectives' slices. NCCL's buffer must equal it bit for bit
// for sums over two ranks (fp32 accumulation of two values is exact before the one rounding, in
// either order) and all-gathers; otherwise (averages, W > 2: another summation order, and bf16
// NCCL rounds every partial sum) within 8·W roundings of the dtype relative to the sum of the
// magnitudes that went into each element. Counts are odd (1, 7, W ± 1, 1000003, ...), some below
// the rank count, some straddle the staging pieces, some exceed them. Without a GPU per rank, or
// without peer access between them, the tests skip.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/dist_env.h"
#include "comm/nccl_communicator.h"
#include "comm/peer_chunks.h"

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

float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

/// `x` rounded to bf16 to nearest even (__float2bfloat16_rn for finite values), as an fp32.
float round_bf16(float x) {
  uint32_t b = float_to_bits(x);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return bits_to_float(b & 0xFFFF0000u);
}

/// Every rank's buffer on the host, as fp32 values exact in the dtype (fp32 or bf16), and the
/// collectives applied to it as the copy-engine path computes them. Alongside each value, the sum
/// of the magnitudes that went into it (the scale of any summation-order rounding).
class Model {
 public:
  /// Rank q's element i: a hash of (salt, q, i) in [-2, 2), 23 bits (fp32) or 8 bits (bf16) of
  /// significand, different on every rank.
  Model(st::DType dtype, int world, size_t n, uint32_t salt)
      : bf16_(dtype == st::DType::kBF16), world_(world) {
    value_.resize(static_cast<size_t>(world));
    mag_.resize(static_cast<size_t>(world));
    for (int q = 0; q < world; ++q) {
      auto& v = value_[static_cast<size_t>(q)];
      auto& m = mag_[static_cast<size_t>(q)];
      v.resize(n);
      m.resize(n);
      for (size_t i = 0; i < n; ++i) {
        uint64_t h = (uint64_t{salt} << 40) ^ (uint64_t(q) << 32) ^ i;  // splitmix64
        h += 0x9E3779B97F4A7C15ull;
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
        h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
        h ^= h >> 31;
        float x = static_cast<float>(static_cast<int64_t>(h >> 40) - (int64_t{1} << 23)) *
                  (1.0f / static_cast<float>(1 << 22));
        if (bf16_) x = bits_to_float(float_to_bits(x) & 0xFFFF0000u);
        v[i] = x;
        m[i] = std::abs(x);
      }
    }
  }

  int world() const { return world_; }
  float value(int rank, size_t i) const { return value_[static_cast<size_t>(rank)][i]; }
  float magnitude(int rank, size_t i) const { return mag_[static_cast<size_t>(rank)][i]; }

  /// Rank `rank`'s buffer in the dtype's bytes.
  std::vector<uint8_t> bytes(int rank) const {
    const auto& v = value_[static_cast<size_t>(rank)];
    std::vector<uint8_t> out(v.size() * (bf16_ ? 2 : 4));
    for (size_t i = 0; i < v.size(); ++i) {
      const uint32_t b = float_to_bits(v[i]);
      if (bf16_) {
        const auto h = static_cast<uint16_t>(b >> 16);
        std::memcpy(out.data() + 2 * i, &h, 2);
      } else {
        std::memcpy(out.data() + 4 * i, &b, 4);
      }
    }
    return out;
  }

  /// all_reduce of elements [off, off + n): chunk k (peer_all_reduce_chunk) summed by rank k.
  void all_reduce(size_t off, size_t n, st::ReduceOp op) {
    for (int k = 0; k < world_; ++k) {
      const st::PeerRange chunk = st::peer_all_reduce_chunk(world_, n, k);
      for (size_t j = chunk.first; j < chunk.first + chunk.count; ++j) {
        const auto [v, m] = sum(k, off + j, op);
        for (int q = 0; q < world_; ++q) set(q, off + j, v, m);
      }
    }
  }

  /// reduce_scatter of input [in_off, in_off + W·n) into output [out_off, out_off + n) of every
  /// rank (in place: out_off = in_off + r·n differs per rank, given by `out_off_of`).
  template <typename OutOff>
  void reduce_scatter(OutOff out_off_of, size_t in_off, size_t n, st::ReduceOp op) {
    std::vector<std::vector<std::pair<float, float>>> result(static_cast<size_t>(world_));
    for (int r = 0; r < world_; ++r)
      for (size_t j = 0; j < n; ++j)
        result[static_cast<size_t>(r)].push_back(
            sum(r, in_off + static_cast<size_t>(r) * n + j, op));
    for (int r = 0; r < world_; ++r)
      for (size_t j = 0; j < n; ++j) {
        const auto [v, m] = result[static_cast<size_t>(r)][j];
        set(r, out_off_of(r) + j, v, m);
      }
  }

  /// all_gather of input [in_off_of(q), + n) of every rank q into [out_off, out_off + W·n).
  template <typename InOff>
  void all_gather(size_t out_off, InOff in_off_of, size_t n) {
    std::vector<std::pair<float, float>> inputs;  // every rank's input, in rank order
    for (int q = 0; q < world_; ++q)
      for (size_t j = 0; j < n; ++j)
        inputs.emplace_back(value_[static_cast<size_t>(q)][in_off_of(q) + j],
                            mag_[static_cast<size_t>(q)][in_off_of(q) + j]);
    for (int r = 0; r < world_; ++r)
      for (size_t i = 0; i < inputs.size(); ++i)
        set(r, out_off + i, inputs[i].first, inputs[i].second);
  }

 private:
  /// The copy-engine sum of element i over the ranks: rank `first`'s, then every other rank's in
  /// rank order, in fp32, scaled for kAvg and rounded once; and the sum of the magnitudes.
  std::pair<float, float> sum(int first, size_t i, st::ReduceOp op) const {
    float acc = value_[static_cast<size_t>(first)][i];
    float mag = mag_[static_cast<size_t>(first)][i];
    for (int q = 0; q < world_; ++q) {
      if (q == first) continue;
      acc += value_[static_cast<size_t>(q)][i];
      mag += mag_[static_cast<size_t>(q)][i];
    }
    if (op == st::ReduceOp::kAvg) {
      acc = acc * (1.0f / static_cast<float>(world_));
      mag /= static_cast<float>(world_);
    }
    return {bf16_ ? round_bf16(acc) : acc, mag};
  }

  void set(int rank, size_t i, float v, float m) {
    value_[static_cast<size_t>(rank)][i] = v;
    mag_[static_cast<size_t>(rank)][i] = m;
  }

  bool bf16_;
  int world_;
  std::vector<std::vector<float>> value_, mag_;  ///< [W][elements]
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
  static int64_t total(st::DType t) { return static_cast<int64_t>(kBytes / st::dtype_size(t)); }
  /// Elements of one staging piece of a sum at this rank count (comm/peer_chunks.h).
  int64_t piece(st::DType t) const {
    return static_cast<int64_t>(
        st::peer_piece_elements(world(), st::dtype_size(t), comm_->registration_staging_bytes()));
  }

  /// Every rank's data (different on every rank); this rank's goes into both buffers.
  Model fill(st::DType dtype, uint32_t salt) {
    Model m(dtype, world(), static_cast<size_t>(total(dtype)), salt);
    const std::vector<uint8_t> host = m.bytes(rank());
    ok(cudaMemcpy(registered_->data, host.data(), kBytes, cudaMemcpyHostToDevice));
    ok(cudaMemcpy(plain_->data, host.data(), kBytes, cudaMemcpyHostToDevice));
    return m;
  }

  /// Elements [offset, offset + n) of both buffers.
  st::Tensor reg(st::DType t, int64_t offset, int64_t n) const {
    return registered_->view(t).slice1d(offset, n);
  }
  st::Tensor plain(st::DType t, int64_t offset, int64_t n) const {
    return plain_->view(t).slice1d(offset, n);
  }

  /// Both buffers after the stream finished, element by element, against the model: the
  /// registered one bit for bit; NCCL's bit for bit when `nccl_exact`, else within
  /// 8·W roundings of the dtype times the sum of the magnitudes.
  void expect_model(st::DType dtype, const Model& m, bool nccl_exact) {
    ok(cudaStreamSynchronize(stream_));
    std::vector<uint8_t> a(kBytes), b(kBytes);
    ok(cudaMemcpy(a.data(), registered_->data, kBytes, cudaMemcpyDeviceToHost));
    ok(cudaMemcpy(b.data(), plain_->data, kBytes, cudaMemcpyDeviceToHost));
    const std::vector<uint8_t> want = m.bytes(rank());
    const size_t esize = st::dtype_size(dtype), n = kBytes / esize;
    const auto element = [&](const std::vector<uint8_t>& v, size_t i) {
      if (esize == 4) {
        float x;
        std::memcpy(&x, v.data() + 4 * i, 4);
        return x;
      }
      uint16_t h;
      std::memcpy(&h, v.data() + 2 * i, 2);
      return bits_to_float(static_cast<uint32_t>(h) << 16);
    };
    const auto first_difference = [&](const std::vector<uint8_t>& v) {
      if (std::memcmp(v.data(), want.data(), kBytes) == 0) return n;
      for (size_t i = 0; i < n; ++i)
        if (std::memcmp(v.data() + i * esize, want.data() + i * esize, esize) != 0) return i;
      return n;
    };
    const size_t bad_reg = first_difference(a);
    EXPECT_EQ(bad_reg, n) << "rank " << rank() << ": registered element " << bad_reg << " is "
                          << (bad_reg < n ? element(a, bad_reg) : 0.0f) << ", the model "
                          << (bad_reg < n ? element(want, bad_reg) : 0.0f);
    if (nccl_exact) {
      const size_t bad = first_difference(b);
      EXPECT_EQ(bad, n) << "rank " << rank() << ": NCCL's element " << bad << " is "
                        << (bad < n ? element(b, bad) : 0.0f) << ", the model "
                        << (bad < n ? element(want, bad) : 0.0f);
      return;
    }
    const double u = dtype == st::DType::kF32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -8);
    const double tol = 8.0 * world() * u;
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; ++i) {
      const double x = element(b, i), y = m.value(rank(), i);
      if (std::abs(x - y) > tol * m.magnitude(rank(), i) + 1e-30) {
        if (bad++ == 0) first = i;
      }
    }
    EXPECT_EQ(bad, 0u) << "rank " << rank() << ": NCCL's element " << first << " is "
                       << (first < n ? element(b, first) : 0.0f) << ", the model "
                       << (first < n ? m.value(rank(), first) : 0.0f) << " (magnitude "
                       << (first < n ? m.magnitude(rank(), first) : 0.0f) << ")";
  }

  /// Offsets of successive regions of the buffers, with odd gaps between them.
  struct Cursor {
    int64_t next, limit;
    int64_t take(int64_t n) {
      const int64_t at = next;
      next += n + 3;
      EXPECT_LE(next, limit) << "the test's regions overrun the buffer";
      return at;
    }
  };

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<st::Communicator> comm_;
  std::unique_ptr<DeviceBuffer> registered_, plain_, staging_;
  std::unique_ptr<st::BufferRegistration> registration_;
};

TEST_P(PeerCollectivesTest, AllReduceSumMatchesModelBitForBit) {
  const st::DType t = GetParam();
  const int64_t n_all = total(t), w = world(), p = piece(t);
  Model m = fill(t, 1);
  // Odd offsets and sizes (scalar tails, unaligned vectors), fewer elements than ranks, chunks
  // just over and under a staging piece, several in flight at once (some overlapping: they run in
  // order), and one larger than the staging buffer.
  const std::pair<int64_t, int64_t> slices[] = {{0, 1},
                                                {1, 5},
                                                {11, 7},
                                                {19, w - 1},
                                                {23, w + 1},
                                                {29, 2},
                                                {7, 1'000'003},
                                                {2'000'000, 4'194'304},
                                                {5, w * p + 1},
                                                {9, w * p - 1},
                                                {n_all / 4, n_all / 2 + 3},
                                                {3, n_all - 7}};
  std::vector<std::unique_ptr<st::Work>> work;
  for (const auto& [off, n] : slices) {
    ASSERT_LE(off + n, n_all);
    work.push_back(comm_->all_reduce(reg(t, off, n), st::ReduceOp::kSum));
    work.push_back(comm_->all_reduce(plain(t, off, n), st::ReduceOp::kSum));
    m.all_reduce(static_cast<size_t>(off), static_cast<size_t>(n), st::ReduceOp::kSum);
  }
  for (auto& wk : work) wk->wait();
  expect_model(t, m, w == 2);
}

TEST_P(PeerCollectivesTest, AllReduceAvgMatchesModelBitForBit) {
  const st::DType t = GetParam();
  Model m = fill(t, 2);
  const std::pair<int64_t, int64_t> slices[] = {
      {3, 3'000'001}, {3'000'100, 1}, {3'000'200, 7}, {3'000'300, world() + 1}};
  for (const auto& [off, n] : slices) {
    comm_->all_reduce(reg(t, off, n), st::ReduceOp::kAvg)->wait();
    comm_->all_reduce(plain(t, off, n), st::ReduceOp::kAvg)->wait();
    m.all_reduce(static_cast<size_t>(off), static_cast<size_t>(n), st::ReduceOp::kAvg);
  }
  expect_model(t, m, false);
}

TEST_P(PeerCollectivesTest, ReduceScatterInPlaceAndOutOfPlace) {
  const st::DType t = GetParam();
  const int64_t w = world(), r = rank(), p = piece(t);
  Model m = fill(t, 3);
  Cursor c{64, total(t)};
  // In place (as the ZeRO strategies call it): the rank's own slice receives the sum. Per-rank
  // counts over a staging piece (two pieces, the second ragged) and odd small ones.
  for (const int64_t n : {p + p / 8 + 1, int64_t{1}, int64_t{7}, w - 1, w + 1}) {
    const int64_t off = c.take(w * n);
    comm_->reduce_scatter(reg(t, off + r * n, n), reg(t, off, w * n), st::ReduceOp::kSum)->wait();
    comm_->reduce_scatter(plain(t, off + r * n, n), plain(t, off, w * n), st::ReduceOp::kSum)
        ->wait();
    m.reduce_scatter([&](int q) { return static_cast<size_t>(off + q * n); },
                     static_cast<size_t>(off), static_cast<size_t>(n), st::ReduceOp::kSum);
  }
  // Out of place; the output (not read by the peers) need not be registered.
  for (const int64_t n : {int64_t{1'000'003}, int64_t{1}, int64_t{7}, w + 1}) {
    const int64_t in_off = c.take(w * n), out_off = c.take(n);
    comm_->reduce_scatter(reg(t, out_off, n), reg(t, in_off, w * n), st::ReduceOp::kSum)->wait();
    comm_->reduce_scatter(plain(t, out_off, n), plain(t, in_off, w * n), st::ReduceOp::kSum)
        ->wait();
    m.reduce_scatter([&](int) { return static_cast<size_t>(out_off); }, static_cast<size_t>(in_off),
                     static_cast<size_t>(n), st::ReduceOp::kSum);
  }
  expect_model(t, m, w == 2);
}

TEST_P(PeerCollectivesTest, AllGatherInPlaceAndOutOfPlace) {
  const st::DType t = GetParam();
  const int64_t w = world(), r = rank();
  Model m = fill(t, 4);
  Cursor c{3, total(t)};
  for (const int64_t n : {int64_t{777'777}, int64_t{1}, int64_t{7}, w - 1, w + 1}) {
    const int64_t off = c.take(w * n);
    comm_->all_gather(reg(t, off, w * n), reg(t, off + r * n, n))->wait();
    comm_->all_gather(plain(t, off, w * n), plain(t, off + r * n, n))->wait();
    m.all_gather(
        static_cast<size_t>(off), [&](int q) { return static_cast<size_t>(off + q * n); },
        static_cast<size_t>(n));
  }
  for (const int64_t n : {int64_t{2'000'003}, int64_t{1}, int64_t{7}}) {
    const int64_t in_off = c.take(n), out_off = c.take(w * n);
    comm_->all_gather(reg(t, out_off, w * n), reg(t, in_off, n))->wait();
    comm_->all_gather(plain(t, out_off, w * n), plain(t, in_off, n))->wait();
    m.all_gather(
        static_cast<size_t>(out_off), [&](int) { return static_cast<size_t>(in_off); },
        static_cast<size_t>(n));
  }
  expect_model(t, m, true);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PeerCollectivesTest,
                         ::testing::Values(st::DType::kF32, st::DType::kBF16),
                         [](const ::testing::TestParamInfo<st::DType>& p) {
                           return p.param == st::DType::kF32 ? std::string("fp32")
                                                             : std::string("bf16");
                         });

// all_to_all is NCCL's grouped sends and receives (no copy-engine path): rank r's chunk p lands
// as rank p's chunk r, for counts below, at and above the rank count.
TEST(NcclComm, AllToAll) {
  const st::DistributedEnv env = st::read_distributed_env();
  if (env.world_size < 2 || st::cuda_device_count() < env.local_world_size)
    GTEST_SKIP() << "needs one GPU per rank";
  ok(cudaSetDevice(env.local_rank));
  auto comm = st::make_world_communicator(env, st::DeviceKind::kCUDA, nullptr);
  const int w = comm->world_size(), r = comm->rank();
  for (const int64_t c : {int64_t{1}, int64_t{w}, int64_t{1000003}}) {
    const size_t n = static_cast<size_t>(c * w);
    std::vector<int32_t> in(n), out(n);
    for (size_t i = 0; i < n; ++i) in[i] = static_cast<int32_t>(r * 7919 + static_cast<int64_t>(i));
    DeviceBuffer a(n * 4), b(n * 4);
    ok(cudaMemcpy(a.data, in.data(), n * 4, cudaMemcpyHostToDevice));
    comm->all_to_all(b.view(st::DType::kI32), a.view(st::DType::kI32))->wait();
    ok(cudaDeviceSynchronize());
    ok(cudaMemcpy(out.data(), b.data, n * 4, cudaMemcpyDeviceToHost));
    for (int q = 0; q < w; ++q)
      for (int64_t j = 0; j < c; j += std::max<int64_t>(1, c / 97))
        ASSERT_EQ(out[static_cast<size_t>(q * c + j)], q * 7919 + r * c + j)
            << "rank " << r << " chunk " << q << " element " << j << " (count " << c << ")";
  }
}

}  // namespace

#else
TEST(PeerCollectivesTest, NeedsCuda) { GTEST_SKIP() << "built without CUDA"; }
#endif
