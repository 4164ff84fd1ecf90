// The MPI communicator under mpirun (tests/CMakeLists.txt runs this program with 2 and 4 ranks):
// every collective against values computed by hand, send/recv, groups, overlapping operations,
// and the timeout that names a rank which does not join a collective.
//
// Every rank runs every test in the same order (collectives must match). Rank 0 prints the usual
// GoogleTest report; the other ranks print only their failures, prefixed with their rank. The
// exit status is the worst over all ranks.
#define OMPI_SKIP_MPICXX 1
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"

namespace st = shardtrain;

namespace {

st::Tensor f32(std::vector<float>& v) {
  return st::Tensor(v.data(), st::DType::kF32, st::DeviceKind::kCPU,
                    {static_cast<int64_t>(v.size())});
}
st::Tensor i32(std::vector<int32_t>& v) {
  return st::Tensor(v.data(), st::DType::kI32, st::DeviceKind::kCPU,
                    {static_cast<int64_t>(v.size())});
}
st::Tensor u16(std::vector<uint16_t>& v, st::DType t) {
  return st::Tensor(v.data(), t, st::DeviceKind::kCPU, {static_cast<int64_t>(v.size())});
}

// Small integers are exact in bf16 and fp16; these conversions only need those.
uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
uint16_t to_f16_int(int v) {  // exact for |v| < 2048
  if (v == 0) return 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  int a = v < 0 ? -v : v, e = 0;
  while ((a >> e) > 1) ++e;
  const uint16_t mant = static_cast<uint16_t>(((a << 10) >> e) & 0x3ff);
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | mant);
}

class MpiComm : public ::testing::Test {
 protected:
  void SetUp() override { comm = st::make_mpi_communicator(); }
  int rank() const { return comm->rank(); }
  int size() const { return comm->world_size(); }
  std::unique_ptr<st::Communicator> comm;
};

TEST_F(MpiComm, RankAndSize) {
  int r = -1, n = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  EXPECT_EQ(rank(), r);
  EXPECT_EQ(size(), n);
  EXPECT_EQ(comm->backend_name(), "mpi");
}

TEST_F(MpiComm, AllReduceSumAvgMax) {
  const int n = size(), r = rank();
  std::vector<float> a = {1.0f * r, 2.0f, -1.0f * r, 0.5f};
  comm->all_reduce(f32(a), st::ReduceOp::kSum)->wait();
  const float rank_sum = n * (n - 1) / 2.0f;
  EXPECT_FLOAT_EQ(a[0], rank_sum);
  EXPECT_FLOAT_EQ(a[1], 2.0f * n);
  EXPECT_FLOAT_EQ(a[2], -rank_sum);
  EXPECT_FLOAT_EQ(a[3], 0.5f * n);

  std::vector<float> b = {1.0f * r, 4.0f};
  comm->all_reduce(f32(b), st::ReduceOp::kAvg)->wait();
  EXPECT_FLOAT_EQ(b[0], rank_sum / n);
  EXPECT_FLOAT_EQ(b[1], 4.0f);

  std::vector<float> c = {1.0f * r, -1.0f * r};
  comm->all_reduce(f32(c), st::ReduceOp::kMax)->wait();
  EXPECT_FLOAT_EQ(c[0], n - 1.0f);
  EXPECT_FLOAT_EQ(c[1], 0.0f);

  std::vector<int32_t> d = {r, 10, -r};
  comm->all_reduce(i32(d), st::ReduceOp::kSum)->wait();
  EXPECT_EQ(d[0], n * (n - 1) / 2);
  EXPECT_EQ(d[1], 10 * n);
  std::vector<int32_t> e = {r, -r};
  comm->all_reduce(i32(e), st::ReduceOp::kMax)->wait();
  EXPECT_EQ(e[0], n - 1);
  EXPECT_EQ(e[1], 0);
  EXPECT_THROW(comm->all_reduce(i32(e), st::ReduceOp::kAvg), st::RuntimeFailure);
}

TEST_F(MpiComm, AllReduce16BitFloats) {
  const int n = size(), r = rank();
  std::vector<uint16_t> b = {to_bf16(1.0f * r), to_bf16(3.0f), to_bf16(-2.0f)};
  comm->all_reduce(u16(b, st::DType::kBF16), st::ReduceOp::kSum)->wait();
  EXPECT_FLOAT_EQ(from_bf16(b[0]), n * (n - 1) / 2.0f);
  EXPECT_FLOAT_EQ(from_bf16(b[1]), 3.0f * n);
  EXPECT_FLOAT_EQ(from_bf16(b[2]), -2.0f * n);

  std::vector<uint16_t> m = {to_bf16(1.0f * r)};
  comm->all_reduce(u16(m, st::DType::kBF16), st::ReduceOp::kMax)->wait();
  EXPECT_FLOAT_EQ(from_bf16(m[0]), n - 1.0f);

  std::vector<uint16_t> h = {to_f16_int(r), to_f16_int(-3), to_f16_int(8)};
  comm->all_reduce(u16(h, st::DType::kF16), st::ReduceOp::kSum)->wait();
  EXPECT_EQ(h[0], to_f16_int(n * (n - 1) / 2));
  EXPECT_EQ(h[1], to_f16_int(-3 * n));
  EXPECT_EQ(h[2], to_f16_int(8 * n));

  std::vector<uint16_t> avg = {to_f16_int(4 * n)};
  comm->all_reduce(u16(avg, st::DType::kF16), st::ReduceOp::kAvg)->wait();
  EXPECT_EQ(avg[0], to_f16_int(4 * n));
}

TEST_F(MpiComm, ReduceScatter) {
  const int n = size(), r = rank();
  const int chunk = 3;
  // input[j] = r + j on rank r: chunk i of the sum holds Σ_r (r + j).
  std::vector<float> in(static_cast<size_t>(n * chunk)), out(chunk);
  for (int j = 0; j < n * chunk; ++j) in[static_cast<size_t>(j)] = static_cast<float>(r + j);
  comm->reduce_scatter(f32(out), f32(in), st::ReduceOp::kSum)->wait();
  for (int k = 0; k < chunk; ++k) {
    const int j = r * chunk + k;
    EXPECT_FLOAT_EQ(out[static_cast<size_t>(k)], n * (n - 1) / 2.0f + static_cast<float>(n * j));
  }
  // In place: the output is the first chunk of the input.
  std::vector<float> buf(static_cast<size_t>(n * chunk));
  for (int j = 0; j < n * chunk; ++j) buf[static_cast<size_t>(j)] = static_cast<float>(j);
  st::Tensor whole = f32(buf);
  comm->reduce_scatter(whole.slice1d(0, chunk), whole, st::ReduceOp::kAvg)->wait();
  for (int k = 0; k < chunk; ++k)
    EXPECT_FLOAT_EQ(buf[static_cast<size_t>(k)], static_cast<float>(r * chunk + k));
  // Sizes must divide: [n*chunk + 1] does not.
  std::vector<float> odd(static_cast<size_t>(n * chunk + 1));
  EXPECT_THROW(comm->reduce_scatter(f32(out), f32(odd), st::ReduceOp::kSum), st::RuntimeFailure);
}

TEST_F(MpiComm, AllGather) {
  const int n = size(), r = rank();
  std::vector<int32_t> in = {r, 100 + r}, out(static_cast<size_t>(2 * n), -1);
  comm->all_gather(i32(out), i32(in))->wait();
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(out[static_cast<size_t>(2 * i)], i);
    EXPECT_EQ(out[static_cast<size_t>(2 * i + 1)], 100 + i);
  }
  // In place: this rank's shard already sits at its place in the output (ZeRO's layout).
  std::vector<float> buf(static_cast<size_t>(2 * n), -1.0f);
  buf[static_cast<size_t>(2 * r)] = 1.0f * r;
  buf[static_cast<size_t>(2 * r + 1)] = -1.0f * r;
  st::Tensor whole = f32(buf);
  comm->all_gather(whole, whole.slice1d(2 * r, 2))->wait();
  for (int i = 0; i < n; ++i) {
    EXPECT_FLOAT_EQ(buf[static_cast<size_t>(2 * i)], 1.0f * i);
    EXPECT_FLOAT_EQ(buf[static_cast<size_t>(2 * i + 1)], -1.0f * i);
  }
  // Uneven shards are not supported: the output must be world × input.
  std::vector<int32_t> short_out(static_cast<size_t>(2 * n - 1));
  EXPECT_THROW(comm->all_gather(i32(short_out), i32(in)), st::RuntimeFailure);
}

TEST_F(MpiComm, AllToAll) {
  const int n = size(), r = rank();
  // Rank r sends 100·r + 10·p + j to rank p (j < 2); rank p receives it as its chunk r.
  std::vector<int32_t> in(static_cast<size_t>(2 * n)), out(static_cast<size_t>(2 * n), -1);
  for (int p = 0; p < n; ++p)
    for (int j = 0; j < 2; ++j) in[static_cast<size_t>(2 * p + j)] = 100 * r + 10 * p + j;
  comm->all_to_all(i32(out), i32(in))->wait();
  for (int q = 0; q < n; ++q)
    for (int j = 0; j < 2; ++j)
      EXPECT_EQ(out[static_cast<size_t>(2 * q + j)], 100 * q + 10 * r + j);
  // Sizes must split into world-size chunks, and the buffers must be distinct.
  std::vector<int32_t> odd(static_cast<size_t>(2 * n + 1)), odd_out(odd.size());
  if (n > 1) {
    EXPECT_THROW(comm->all_to_all(i32(odd_out), i32(odd)), st::RuntimeFailure);
  }
  EXPECT_THROW(comm->all_to_all(i32(in), i32(in)), st::RuntimeFailure);
}

TEST_F(MpiComm, Broadcast) {
  const int root = size() - 1;
  std::vector<float> v = {1.0f * rank(), 2.0f * rank()};
  comm->broadcast(f32(v), root)->wait();
  EXPECT_FLOAT_EQ(v[0], 1.0f * root);
  EXPECT_FLOAT_EQ(v[1], 2.0f * root);
  EXPECT_THROW(comm->broadcast(f32(v), size()), st::ConfigError);
}

TEST_F(MpiComm, SendRecvRing) {
  const int n = size(), r = rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  std::vector<float> out = {1.0f * r, 10.0f * r}, in(2, -1.0f);
  auto rw = comm->recv(f32(in), prev);
  auto sw = comm->send(f32(out), next);
  sw->wait();
  rw->wait();
  EXPECT_FLOAT_EQ(in[0], 1.0f * prev);
  EXPECT_FLOAT_EQ(in[1], 10.0f * prev);
  EXPECT_THROW(comm->send(f32(out), r), st::ConfigError);
}

TEST_F(MpiComm, SplitIntoGroups) {
  const int n = size(), r = rank();
  // Even and odd ranks (with 2 ranks: two groups of one).
  std::vector<int> group;
  for (int i = r % 2; i < n; i += 2) group.push_back(i);
  auto sub = comm->split(group);
  ASSERT_EQ(sub->world_size(), static_cast<int>(group.size()));
  EXPECT_EQ(group[static_cast<size_t>(sub->rank())], r);
  std::vector<float> v = {1.0f * r};
  sub->all_reduce(f32(v), st::ReduceOp::kSum)->wait();
  float expect = 0;
  for (int g : group) expect += static_cast<float>(g);
  EXPECT_FLOAT_EQ(v[0], expect);
  sub->barrier();
  // A group without this rank, or with a rank twice, is refused before any communication.
  std::vector<int> without;
  for (int i = 0; i < n; ++i)
    if (i != r) without.push_back(i);
  EXPECT_THROW(comm->split(without), st::ConfigError);
  EXPECT_THROW(comm->split({r, r}), st::ConfigError);
}

TEST_F(MpiComm, AsyncOverlapWaitInReverseOrder) {
  const int n = size(), r = rank();
  std::vector<float> a(1000, 1.0f * r), b(10, 2.0f);
  auto wa = comm->all_reduce(f32(a), st::ReduceOp::kSum);
  auto wb = comm->all_reduce(f32(b), st::ReduceOp::kAvg);
  wb->wait();
  wa->wait();
  EXPECT_TRUE(wa->completed());
  EXPECT_TRUE(wb->completed());
  EXPECT_FLOAT_EQ(a[999], n * (n - 1) / 2.0f);
  EXPECT_FLOAT_EQ(b[0], 2.0f);
  // completed() polls without blocking and turns true eventually.
  std::vector<float> c = {1.0f};
  auto wc = comm->all_reduce(f32(c), st::ReduceOp::kSum);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!wc->completed() && std::chrono::steady_clock::now() < until) {
  }
  EXPECT_TRUE(wc->completed());
  EXPECT_FLOAT_EQ(c[0], 1.0f * n);
  comm->barrier();
}

TEST(MpiCommTimeout, NamesTheRankThatDoesNotJoin) {
  st::CommOptions opt;
  opt.timeout_s = 1;
  opt.abort_on_timeout = false;
  auto comm = st::make_mpi_communicator(opt);
  const int n = comm->world_size(), r = comm->rank();
  std::vector<float> v = {1.0f};
  const auto t0 = std::chrono::steady_clock::now();
  if (r == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(4));  // outside MPI: no answers
    comm->all_reduce(f32(v), st::ReduceOp::kSum)->wait();
  } else {
    auto w = comm->all_reduce(f32(v), st::ReduceOp::kSum);
    try {
      w->wait();
      ADD_FAILURE() << "rank " << r << ": the all_reduce completed without rank 1";
    } catch (const st::CommTimeoutError& e) {
      const std::string msg = e.what();
      EXPECT_NE(
          msg.find("rank " + std::to_string(r) + ": all_reduce #1 did not complete within 1 s"),
          std::string::npos)
          << msg;
      EXPECT_NE(msg.find("rank 1 has not joined it (it is stuck or dead)"), std::string::npos)
          << msg;
      for (int other = 0; other < n; ++other) {  // the ranks that wait answered
        if (other != 1 && other != r) {
          EXPECT_EQ(msg.find("rank " + std::to_string(other) + " ha"), std::string::npos) << msg;
        }
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_LT(s, 3.9) << "timeout 1 s + grace 1 s, well before rank 1 wakes at 4 s";
    }
    // The Work stays valid: waiting again waits another timeout, until rank 1 joins (at 4 s).
    for (int attempt = 0;; ++attempt) {
      try {
        w->wait();
        break;
      } catch (const st::CommTimeoutError& e) {
        ASSERT_LT(attempt, 10) << e.what();
      }
    }
  }
  EXPECT_FLOAT_EQ(v[0], 1.0f * n);
}

TEST(MpiCommTimeout, NamesWhatAnAnsweringRankWaitsFor) {
  st::CommOptions opt;
  opt.timeout_s = 1;
  opt.abort_on_timeout = false;
  auto a = st::make_mpi_communicator(opt);
  auto b = st::make_mpi_communicator(opt);
  auto sync = st::make_mpi_communicator();
  const int n = a->world_size(), r = a->rank();
  std::vector<float> va = {1.0f}, vb = {2.0f};
  // Rank 1 issues its collectives in the other order: everyone times out, and the others learn
  // from rank 1's answer what it waits for.
  std::unique_ptr<st::Work> first = r == 1 ? b->all_reduce(f32(vb), st::ReduceOp::kSum)
                                           : a->all_reduce(f32(va), st::ReduceOp::kSum);
  try {
    first->wait();
    ADD_FAILURE() << "rank " << r << ": completed although rank 1 waits elsewhere";
  } catch (const st::CommTimeoutError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("all_reduce #1 did not complete within 1 s: "), std::string::npos) << msg;
    if (r != 1) {
      // Rank 1 answers with what it waits for: its all_reduce on `b`, or already the barrier.
      EXPECT_NE(msg.find("rank 1 has not joined it (it is waiting for "), std::string::npos) << msg;
    }
    EXPECT_EQ(msg.find("stuck or dead"), std::string::npos) << msg;
  }
  // Nobody joins the other order before every rank has handled its timeout.
  sync->barrier();
  std::unique_ptr<st::Work> second = r == 1 ? a->all_reduce(f32(va), st::ReduceOp::kSum)
                                            : b->all_reduce(f32(vb), st::ReduceOp::kSum);
  second->wait();
  first->wait();
  EXPECT_FLOAT_EQ(va[0], 1.0f * n);
  EXPECT_FLOAT_EQ(vb[0], 2.0f * n);
}

}  // namespace

// main(): tests/mpi/mpi_gtest_main.cpp
