// Tests of the NVMe swap of ZeRO-Infinity: swap files (round trips over the I/O thread pool,
// concurrent transfers, errors, removal, the buffered fallback) and the nvme_path checks.
#include <fcntl.h>
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "parallel/offload/nvme_swap.h"
#include "test_support.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * 1024;
const std::string kKey = "zero_optimization.offload_optimizer.nvme_path";

/// The message of the E that `f` throws ("" and a test failure if none).
template <typename E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

/// Fills `b` with bytes from a generator seeded with `seed`.
void fill(AlignedHostBuffer& b, uint32_t seed) {
  std::mt19937 gen(seed);
  auto* p = static_cast<unsigned char*>(b.data());
  for (int64_t i = 0; i < b.bytes(); ++i) p[i] = static_cast<unsigned char>(gen());
}

bool same_bytes(const AlignedHostBuffer& a, const AlignedHostBuffer& b) {
  return a.bytes() == b.bytes() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.bytes())) == 0;
}

int64_t free_space(const std::string& dir) {
  struct statvfs st {};
  EXPECT_EQ(::statvfs(dir.c_str(), &st), 0);
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

/// Whether `dir`'s filesystem does O_DIRECT I/O (open and one aligned write).
bool supports_direct(const std::string& dir) {
  const std::string probe = (fs::path(dir) / fmt::format(".direct-probe-{}", ::getpid())).string();
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  bool ok = fd >= 0;
  if (ok) {
    AlignedHostBuffer block(4096);
    ok = ::pwrite(fd, block.data(), 4096, 0) == 4096;
    ::close(fd);
  }
  ::unlink(probe.c_str());
  return ok;
}

/// Sets an environment variable for the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.empty()) {
      ::unsetenv(name_.c_str());
    } else {
      ::setenv(name_.c_str(), old_.c_str(), 1);
    }
  }

 private:
  std::string name_;
  std::string old_;
};

class NvmeSwapTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = shardtrain::test_support::make_temp_dir("shardtrain_test_nvme"); }
  void TearDown() override {
    std::error_code ec;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(dir_, ec);
  }

  std::string dir() const { return dir_.string(); }

  /// Files left in the test's directory.
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename());
    return out;
  }

  /// Writes two regions through `f` at once, reads them back at once and compares.
  static void round_trip(SwapFile& f, int64_t region) {
    AlignedHostBuffer a(region), b(region), a_back(region), b_back(region);
    ASSERT_EQ(a.bytes(), region);
    fill(a, 1);
    fill(b, 2);
    const SwapTicket wa = f.write_async(0, a.data(), region);
    const SwapTicket wb = f.write_async(region, b.data(), region);
    f.wait(wa);
    f.wait(wb);
    const SwapTicket ra = f.read_async(0, a_back.data(), region);
    const SwapTicket rb = f.read_async(region, b_back.data(), region);
    f.wait(rb);
    f.wait(ra);
    EXPECT_TRUE(same_bytes(a, a_back));
    EXPECT_TRUE(same_bytes(b, b_back));
  }

  fs::path dir_;
};

// ---- round trips ------------------------------------------------------------------------------

class SwapRoundTrip : public NvmeSwapTest,
                      public ::testing::WithParamInterface<std::tuple<int, int>> {};

TEST_P(SwapRoundTrip, ManyBlocksByteExact) {
  AioConfig aio;
  aio.block_size = 64 * kKiB;
  aio.thread_count = std::get<0>(GetParam());
  aio.queue_depth = std::get<1>(GetParam());
  // Not a multiple of the block size: the last request of each transfer is shorter.
  const int64_t region = 6 * kMiB + 3 * 4096;
  SwapFile f(dir(), 3, 2 * region, aio);
  EXPECT_EQ(fs::path(f.path()).parent_path(), dir_);
  EXPECT_EQ(fs::path(f.path()).filename(), fmt::format("shardtrain-swap-rank3-{}.bin", ::getpid()));
  EXPECT_EQ(f.bytes(), 2 * region);
  EXPECT_EQ(f.file_size(), 2 * region);
  EXPECT_TRUE(files().empty());  // nameless: nothing in the directory even while it is open
  EXPECT_EQ(f.direct(), supports_direct(dir()));
  EXPECT_EQ(f.aio().thread_count, aio.thread_count);
  round_trip(f, region);
  EXPECT_EQ(f.bytes_written(), 2 * region);
  EXPECT_EQ(f.bytes_read(), 2 * region);
  EXPECT_GE(f.peak_in_flight(), 1);
  EXPECT_LE(f.peak_in_flight(), std::min(aio.thread_count, aio.queue_depth));
}

INSTANTIATE_TEST_SUITE_P(ThreadsAndQueueDepth, SwapRoundTrip,
                         ::testing::Combine(::testing::Values(1, 4), ::testing::Values(1, 8)),
                         [](const auto& param_info) {
                           return fmt::format("threads{}_depth{}", std::get<0>(param_info.param),
                                              std::get<1>(param_info.param));
                         });

TEST_F(NvmeSwapTest, ConcurrentTicketsCompleteInAnyOrder) {
  AioConfig aio;
  aio.block_size = 16 * kKiB;
  aio.thread_count = 4;
  aio.queue_depth = 8;
  constexpr int kRegions = 16;
  const int64_t region = 256 * kKiB;
  SwapFile f(dir(), 0, kRegions * region, aio);
  std::vector<AlignedHostBuffer> out, in;
  std::vector<SwapTicket> tickets;
  for (int i = 0; i < kRegions; ++i) {
    out.emplace_back(region);
    in.emplace_back(region);
    fill(out.back(), static_cast<uint32_t>(100 + i));
    tickets.push_back(f.write_async(i * region, out.back().data(), region));
  }
  while (!std::all_of(tickets.begin(), tickets.end(), [&](SwapTicket t) { return f.done(t); })) {
    std::this_thread::yield();
  }
  for (int i = kRegions - 1; i >= 0; --i) f.wait(tickets[static_cast<std::size_t>(i)]);
  f.wait(tickets[0]);  // waited for already: returns at once
  for (int i = 0; i < kRegions; ++i) f.read_async(i * region, in[i].data(), region);
  f.wait_all();
  for (int i = 0; i < kRegions; ++i) EXPECT_TRUE(same_bytes(out[i], in[i])) << "region " << i;
  EXPECT_EQ(f.bytes_written(), kRegions * region);
  EXPECT_EQ(f.bytes_read(), kRegions * region);
  EXPECT_LE(f.peak_in_flight(), 4);

  // A transfer of nothing is done at once.
  const SwapTicket none = f.write_async(0, out[0].data(), 0);
  EXPECT_TRUE(f.done(none));
  f.wait(none);
}

TEST_F(NvmeSwapTest, QueueDepthBoundsRequestsInFlight) {
  AioConfig aio;
  aio.block_size = 4096;
  aio.thread_count = 8;
  aio.queue_depth = 2;
  const int64_t region = 2 * kMiB;  // 512 requests
  SwapFile f(dir(), 0, region, aio);
  AlignedHostBuffer out(region), in(region);
  fill(out, 5);
  f.wait(f.write_async(0, out.data(), region));
  f.wait(f.read_async(0, in.data(), region));
  EXPECT_TRUE(same_bytes(out, in));
  EXPECT_GE(f.peak_in_flight(), 1);
  EXPECT_LE(f.peak_in_flight(), 2);
}

TEST_F(NvmeSwapTest, TransfersFromSeveralThreads) {
  AioConfig aio;
  aio.block_size = 32 * kKiB;
  aio.thread_count = 2;
  aio.queue_depth = 3;
  constexpr int kThreads = 4;
  const int64_t region = 512 * kKiB;
  SwapFile f(dir(), 1, kThreads * region, aio);
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      AlignedHostBuffer out(region), in(region);
      for (int round = 0; round < 5; ++round) {
        fill(out, static_cast<uint32_t>(t * 100 + round));
        f.wait(f.write_async(t * region, out.data(), region));
        f.wait(f.read_async(t * region, in.data(), region));
        if (!same_bytes(out, in)) ++mismatches;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// ---- the file -----------------------------------------------------------------------------------

TEST_F(NvmeSwapTest, TheFileHasNoNameAndTheDestructorWaitsForItsWrites) {
  std::string path;
  {
    AioConfig aio;
    aio.block_size = 4096;
    aio.queue_depth = 1;
    AlignedHostBuffer data(2 * kMiB);  // outlives the file, which waits for the write
    fill(data, 9);
    SwapFile f(dir(), 7, 2 * kMiB, aio);
    path = f.path();
    EXPECT_FALSE(fs::exists(path));  // nameless from the start: no exit can leave it behind
    EXPECT_TRUE(files().empty());
    EXPECT_EQ(f.file_size(), 2 * kMiB);
    f.write_async(0, data.data(), data.bytes());  // still in flight when the file goes
  }
  EXPECT_TRUE(files().empty());
}

TEST_F(NvmeSwapTest, NothingIsLeftWhenTheProcessIsKilled) {
  // A child opens a swap file and is killed with SIGKILL while it holds it.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    SwapFile f(dir(), 0, 4 * kMiB, AioConfig{});
    ::kill(::getpid(), SIGKILL);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_TRUE(files().empty());
}

TEST_F(NvmeSwapTest, SizeIsRoundedUpToTheAlignment) {
  EXPECT_EQ(swap_alignment(), 4096);
  EXPECT_EQ(swap_round_up(0), 0);
  EXPECT_EQ(swap_round_up(1), 4096);
  EXPECT_EQ(swap_round_up(8192), 8192);
  SwapFile f(dir(), 0, 1, AioConfig{});
  EXPECT_EQ(f.bytes(), 4096);
  EXPECT_EQ(f.file_size(), 4096);
  SwapFile empty(dir(), 1, 0, AioConfig{});
  EXPECT_EQ(empty.bytes(), 4096);
}

TEST_F(NvmeSwapTest, AlignedHostBufferIsAlignedZeroedAndMovable) {
  AlignedHostBuffer a(5000);
  EXPECT_EQ(a.bytes(), 8192);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % 4096, 0u);
  const auto* p = static_cast<const unsigned char*>(a.data());
  EXPECT_TRUE(std::all_of(p, p + a.bytes(), [](unsigned char c) { return c == 0; }));
  void* data = a.data();
  AlignedHostBuffer b(std::move(a));
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.bytes(), 8192);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(a.bytes(), 0);
  AlignedHostBuffer c;
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(AlignedHostBuffer().bytes(), 0);
}

TEST_F(NvmeSwapTest, MisalignedOrOutOfRangeTransfersAreBugs) {
  SwapFile f(dir(), 0, 64 * kKiB, AioConfig{});
  AlignedHostBuffer buf(64 * kKiB);
  auto* p = static_cast<char*>(buf.data());
  EXPECT_CONTAINS(error_of<Error>([&] { f.write_async(100, p, 4096); }), "multiples of 4096");
  EXPECT_CONTAINS(error_of<Error>([&] { f.write_async(0, p, 100); }), "multiples of 4096");
  EXPECT_CONTAINS(error_of<Error>([&] { f.read_async(0, p + 8, 4096); }), "multiples of 4096");
  EXPECT_CONTAINS(error_of<Error>([&] { f.read_async(60 * kKiB, p, 8192); }), "outside the file");
  EXPECT_CONTAINS(error_of<Error>([&] { f.read_async(-4096, p, 4096); }), "outside the file");
}

TEST_F(NvmeSwapTest, InvalidAioSettingsNameTheKey) {
  AioConfig aio;
  aio.block_size = 1000;
  EXPECT_CONTAINS(error_of<ConfigError>([&] { SwapFile(dir(), 0, 4096, aio); }),
                  "aio.block_size 1000");
  aio = AioConfig{};
  aio.queue_depth = 0;
  EXPECT_CONTAINS(error_of<ConfigError>([&] { SwapFile(dir(), 0, 4096, aio); }),
                  "aio.queue_depth 0");
  aio = AioConfig{};
  aio.thread_count = 0;
  EXPECT_CONTAINS(error_of<ConfigError>([&] { SwapFile(dir(), 0, 4096, aio); }),
                  "aio.thread_count 0");
  EXPECT_TRUE(files().empty());
}

TEST_F(NvmeSwapTest, IoErrorNamesFileOffsetBytesAndErrno) {
  AioConfig aio;
  aio.block_size = 8192;
  aio.thread_count = 2;
  SwapFile f(dir(), 0, 64 * kKiB, aio);
  // Reading into read-only memory fails with EFAULT ("Bad address").
  void* ro = ::mmap(nullptr, 32 * kKiB, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(ro, MAP_FAILED);
  const std::string msg =
      error_of<RuntimeFailure>([&] { f.wait(f.read_async(16 * kKiB, ro, 32 * kKiB)); });
  EXPECT_CONTAINS(msg, f.path());
  EXPECT_CONTAINS(msg, "cannot read");
  EXPECT_CONTAINS(msg, "32768 bytes at offset 16384");
  EXPECT_CONTAINS(msg, std::strerror(EFAULT));
  // wait_all reports a failure not yet waited for, once.
  f.read_async(0, ro, 32 * kKiB);
  EXPECT_CONTAINS(error_of<RuntimeFailure>([&] { f.wait_all(); }), "offset 0");
  f.wait_all();
  ::munmap(ro, 32 * kKiB);
  // The file still works.
  round_trip(f, 32 * kKiB);
}

// ---- direct I/O and its fallback ------------------------------------------------------------

TEST_F(NvmeSwapTest, BufferedFallbackWhereDirectIoIsRefused) {
  // tmpfs refused O_DIRECT before Linux 6.6; look for a filesystem here that refuses it.
  std::string refusing;
  for (const std::string& candidate : {std::string("/dev/shm"), dir()}) {
    if (fs::is_directory(candidate) && ::access(candidate.c_str(), W_OK) == 0 &&
        !supports_direct(candidate)) {
      refusing = candidate;
      break;
    }
  }
  if (refusing.empty()) {
    GTEST_SKIP() << "every filesystem tried (/dev/shm, " << dir()
                 << ") supports O_DIRECT; BufferedIoOnRequest covers the buffered path";
  }
  std::string path;
  {
    SwapFile f(refusing, 0, 2 * kMiB, AioConfig{});
    path = f.path();
    EXPECT_FALSE(f.direct());
    round_trip(f, kMiB);
  }
  EXPECT_FALSE(fs::exists(path));
}

TEST_F(NvmeSwapTest, BufferedIoOnRequest) {
  ScopedEnv env("SHARDTRAIN_SWAP_DIRECT", "0");
  AioConfig aio;
  aio.block_size = 128 * kKiB;
  aio.thread_count = 3;
  SwapFile f(dir(), 0, 4 * kMiB, aio);
  EXPECT_FALSE(f.direct());
  round_trip(f, 2 * kMiB);
}

TEST_F(NvmeSwapTest, DirectIoWhereSupported) {
  if (!supports_direct(dir())) GTEST_SKIP() << dir() << " does not support O_DIRECT";
  SwapFile f(dir(), 0, kMiB, AioConfig{});
  EXPECT_TRUE(f.direct());
  round_trip(f, kMiB / 2);
}

// ---- space --------------------------------------------------------------------------------------

TEST_F(NvmeSwapTest, SwapFileOnAFullFilesystemStatesTheNumbers) {
  const int64_t need = free_space(dir()) + 1024 * kMiB;
  const std::string msg = error_of<RuntimeFailure>([&] { SwapFile(dir(), 0, need, AioConfig{}); });
  EXPECT_CONTAINS(msg, "not enough free space");
  EXPECT_CONTAINS(msg, dir());
  EXPECT_CONTAINS(msg, fmt::format("({} bytes)", swap_round_up(need)));
  EXPECT_CONTAINS(msg, "GiB");
  EXPECT_CONTAINS(msg, "choose an nvme_path with more");
  EXPECT_TRUE(files().empty());
}

// ---- check_nvme_path ------------------------------------------------------------------------

TEST_F(NvmeSwapTest, CheckPathAcceptsAWritableDirectoryAndLeavesNothing) {
  check_nvme_path(dir(), 4096, kKey);
  EXPECT_TRUE(files().empty());
}

TEST_F(NvmeSwapTest, CheckPathMissingDirectory) {
  const std::string missing = (dir_ / "no-such-dir").string();
  const std::string msg = error_of<ConfigError>([&] { check_nvme_path(missing, kMiB, kKey); });
  EXPECT_CONTAINS(msg, kKey);
  EXPECT_CONTAINS(msg, missing);
  EXPECT_CONTAINS(msg, "does not exist");
  EXPECT_CONTAINS(msg, "mkdir -p");
  EXPECT_CONTAINS(msg, "1.0 MiB (1048576 bytes)");
  EXPECT_CONTAINS(error_of<ConfigError>([&] { check_nvme_path("", kMiB, kKey); }),
                  kKey + " is empty");
}

TEST_F(NvmeSwapTest, CheckPathFileInsteadOfDirectory) {
  const std::string file = (dir_ / "a-file").string();
  { std::ofstream(file) << "x"; }
  const std::string msg = error_of<ConfigError>([&] { check_nvme_path(file, kMiB, kKey); });
  EXPECT_CONTAINS(msg, kKey);
  EXPECT_CONTAINS(msg, file);
  EXPECT_CONTAINS(msg, "is not a directory");
}

TEST_F(NvmeSwapTest, CheckPathUnwritableDirectory) {
  const fs::path ro = dir_ / "read-only";
  fs::create_directories(ro);
  ASSERT_EQ(::chmod(ro.c_str(), 0500), 0);
  // Root is not held back by permissions: probe whether this process can write anyway.
  const std::string probe = (ro / "probe").string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT, 0600);
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
    ASSERT_EQ(::geteuid(), 0u) << "a 0500 directory is writable by a user other than root";
    GTEST_SKIP() << "running as root: permissions are not enforced (see "
                    "CheckPathUnwritableEvenForRoot)";
  }
  const std::string msg = error_of<ConfigError>([&] { check_nvme_path(ro.string(), kMiB, kKey); });
  EXPECT_CONTAINS(msg, kKey);
  EXPECT_CONTAINS(msg, ro.string());
  EXPECT_CONTAINS(msg, "is not writable");
  EXPECT_CONTAINS(msg, "fix its permissions");
}

TEST_F(NvmeSwapTest, CheckPathUnwritableEvenForRoot) {
  // /proc takes no new files, even from root: the create/delete probe finds it.
  const std::string probe = "/proc/shardtrain-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT, 0600);
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
    GTEST_SKIP() << "/proc takes new files here";
  }
  const std::string msg = error_of<ConfigError>([&] { check_nvme_path("/proc", kMiB, kKey); });
  EXPECT_CONTAINS(msg, kKey);
  EXPECT_CONTAINS(msg, "'/proc' is not writable");
}

TEST_F(NvmeSwapTest, CheckPathTooLittleSpaceStatesTheNumbers) {
  const int64_t need = free_space(dir()) + 1024 * kMiB;
  const std::string msg = error_of<ConfigError>([&] { check_nvme_path(dir(), need, kKey); });
  EXPECT_CONTAINS(msg, kKey);
  EXPECT_CONTAINS(msg, dir());
  EXPECT_CONTAINS(msg, "too little free space");
  EXPECT_CONTAINS(msg, fmt::format("({} bytes)", need));
  EXPECT_CONTAINS(msg, "GiB");
  EXPECT_CONTAINS(msg, "choose a path with more space");
  EXPECT_TRUE(files().empty());
}

}  // namespace
}  // namespace shardtrain
