// bench_host_limits: the limits of the machine that ZeRO-Offload / ZeRO-Infinity run
// against, printed as one JSON object on stdout (progress on stderr):
//   stream    host memory bandwidth: STREAM copy (c = a) and triad (a = b + s·c) on fp64 arrays
//             far larger than the last-level cache, OpenMP threads (OMP_NUM_THREADS), best of
//             --reps; bytes counted as STREAM does (copy 2 × 8, triad 3 × 8 bytes per element)
//   pcie      pinned host ↔ device cudaMemcpyAsync, each direction alone and both at once (two
//             streams), best of --copy-reps; pageable cudaMemcpy too (CUDA build only)
//   cpu_adamw shardtrain's CPU AdamW (src/optim/cpu_adamw.h) on a shard of --adamw-elements:
//             bf16 gradients in, bf16 parameters out (what the offload strategy runs; 4+4+4+2
//             bytes read and written per element = 28) and fp32 gradients without a bf16 copy
//             (what PyTorch's CPU AdamW does: 4+4+4+4 read, 4+4+4 written = 28); params/s, bytes/s
//             and the fraction of the triad bandwidth
//   disk      with --disk-path DIR: O_DIRECT sequential write then read of a --disk-mib file in
//             --disk-block-kib blocks (as `dd oflag=direct` / `iflag=direct`), one thread and
//             --disk-jobs threads at once; falls back to buffered I/O (marked) where O_DIRECT is
//             refused (tmpfs)
// Built from the same source twice: by nvcc as bench_host_limits when the CUDA backend is built
// (SHARDTRAIN_BENCH_CUDA=1), else as C++ with the GPU part compiled out.
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "core/tensor.h"
#include "optim/cpu_adamw.h"

#if !defined(SHARDTRAIN_BENCH_CUDA)
#if defined(__CUDACC__)
#define SHARDTRAIN_BENCH_CUDA 1
#else
#define SHARDTRAIN_BENCH_CUDA 0
#endif
#endif
#if SHARDTRAIN_BENCH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;
double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

struct Options {
  int64_t stream_mib = 1024;  // per array
  int reps = 5;
  int64_t copy_mib = 512;
  int copy_reps = 10;
  int device = 0;
  bool skip_gpu = false;
  int64_t adamw_elements = 200'000'000;
  int adamw_reps = 5;
  std::string simd = "auto";
  std::string disk_path;
  int64_t disk_mib = 4096;
  int64_t disk_block_kib = 1024;
  int disk_jobs = 4;
};

// A tiny JSON writer: objects of numbers, strings, booleans and nested objects.
class Json {
 public:
  Json& num(const std::string& k, double v) {
    if (!std::isfinite(v)) return raw(k, "null");
    char b[64];
    std::snprintf(b, sizeof b, "%.6g", v);
    return raw(k, b);
  }
  Json& integer(const std::string& k, int64_t v) { return raw(k, std::to_string(v)); }
  Json& boolean(const std::string& k, bool v) { return raw(k, v ? "true" : "false"); }
  Json& str(const std::string& k, const std::string& v) {
    std::string q = "\"";
    for (char c : v) {
      if (c == '"' || c == '\\') q += '\\';
      if (static_cast<unsigned char>(c) < 0x20) continue;
      q += c;
    }
    return raw(k, q + "\"");
  }
  Json& obj(const std::string& k, const Json& o) { return raw(k, o.text()); }
  std::string text() const { return "{" + body_ + "}"; }

 private:
  Json& raw(const std::string& k, const std::string& v) {
    if (!body_.empty()) body_ += ", ";
    body_ += "\"" + k + "\": " + v;
    return *this;
  }
  std::string body_;
};

void note(const char* fmt, const std::string& a = "", double x = 0, double y = 0) {
  std::fprintf(stderr, fmt, a.c_str(), x, y);
  std::fflush(stderr);
}

// ---- STREAM -------------------------------------------------------------------------------------
Json run_stream(const Options& o, double* triad_bytes_per_s) {
  const int64_t n = o.stream_mib * (int64_t{1} << 20) / static_cast<int64_t>(sizeof(double));
  const size_t bytes = static_cast<size_t>(n) * sizeof(double);
  auto* a = static_cast<double*>(std::aligned_alloc(4096, bytes));
  auto* b = static_cast<double*>(std::aligned_alloc(4096, bytes));
  auto* c = static_cast<double*>(std::aligned_alloc(4096, bytes));
  Json j;
  if (!a || !b || !c) {
    std::free(a), std::free(b), std::free(c);
    *triad_bytes_per_s = 0;
    return j.str("error", "cannot allocate 3 arrays of " + std::to_string(o.stream_mib) + " MiB");
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] = 1.0, b[i] = 2.0, c[i] = 0.5;  // first touch, per thread
  const double s = 3.0;
  double best_copy = 1e30, best_triad = 1e30;
  for (int r = 0; r < o.reps; ++r) {
    double t0 = now_s();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) c[i] = a[i];
    best_copy = std::min(best_copy, now_s() - t0);
    t0 = now_s();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    best_triad = std::min(best_triad, now_s() - t0);
  }
  double check = 0;
  for (int64_t i = 0; i < n; i += 4096) check += a[i];
  std::free(a), std::free(b), std::free(c);
  const double copy_bps = 2.0 * static_cast<double>(bytes) / best_copy;
  const double triad_bps = 3.0 * static_cast<double>(bytes) / best_triad;
  *triad_bytes_per_s = triad_bps;
  note("stream%s: copy %.1f GB/s, triad %.1f GB/s\n", "", copy_bps / 1e9, triad_bps / 1e9);
  return j.str("dtype", "fp64")
      .integer("array_bytes", static_cast<int64_t>(bytes))
      .integer("elements", n)
      .integer("reps", o.reps)
      .integer("threads", omp_get_max_threads())
      .num("copy_best_s", best_copy)
      .num("triad_best_s", best_triad)
      .num("copy_bytes_per_s", copy_bps)
      .num("triad_bytes_per_s", triad_bps)
      .num("copy_GBps", copy_bps / 1e9)
      .num("triad_GBps", triad_bps / 1e9)
      .str("counting", "copy 2 x 8 B, triad 3 x 8 B per element (no write-allocate), best of reps")
      .num("checksum", check);
}

// ---- pinned host <-> device copies
// ----------------------------------------------------------------
#if SHARDTRAIN_BENCH_CUDA
#define CK(x)                                                                    \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess)                                                       \
      throw std::runtime_error(std::string(#x) + ": " + cudaGetErrorString(e_)); \
  } while (0)

Json run_pcie(const Options& o) {
  Json j;
  try {
    CK(cudaSetDevice(o.device));
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, o.device));
    const size_t bytes = static_cast<size_t>(o.copy_mib) << 20;
    void *h1 = nullptr, *h2 = nullptr, *d1 = nullptr, *d2 = nullptr;
    CK(cudaMallocHost(&h1, bytes));
    CK(cudaMallocHost(&h2, bytes));
    CK(cudaMalloc(&d1, bytes));
    CK(cudaMalloc(&d2, bytes));
    std::memset(h1, 1, bytes);
    std::memset(h2, 2, bytes);
    cudaStream_t s1, s2;
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t e0, e1, e2;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventCreate(&e2));
    const auto timed = [&](const std::function<void()>& issue, bool both) {
      float best = 1e30f;
      for (int r = 0; r < o.copy_reps + 1; ++r) {  // the first one untimed
        CK(cudaEventRecord(e0, s1));
        CK(cudaStreamWaitEvent(s2, e0, 0));
        issue();
        CK(cudaEventRecord(e1, s1));
        CK(cudaEventRecord(e2, s2));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventSynchronize(e2));
        float ms1 = 0, ms2 = 0;
        CK(cudaEventElapsedTime(&ms1, e0, e1));
        CK(cudaEventElapsedTime(&ms2, e0, e2));
        if (r > 0) best = std::min(best, both ? std::max(ms1, ms2) : ms1);
      }
      return best * 1e-3;
    };
    const double h2d =
        timed([&] { CK(cudaMemcpyAsync(d1, h1, bytes, cudaMemcpyHostToDevice, s1)); }, false);
    const double d2h =
        timed([&] { CK(cudaMemcpyAsync(h1, d1, bytes, cudaMemcpyDeviceToHost, s1)); }, false);
    const double bidir = timed(
        [&] {
          CK(cudaMemcpyAsync(d1, h1, bytes, cudaMemcpyHostToDevice, s1));
          CK(cudaMemcpyAsync(h2, d2, bytes, cudaMemcpyDeviceToHost, s2));
        },
        true);
    // pageable (malloc'd) host memory, synchronous copies, best of reps
    std::vector<char> pageable(bytes, 3);
    double pg_h2d = 1e30, pg_d2h = 1e30;
    for (int r = 0; r < std::max(2, o.copy_reps / 2) + 1; ++r) {
      double t0 = now_s();
      CK(cudaMemcpy(d1, pageable.data(), bytes, cudaMemcpyHostToDevice));
      if (r > 0) pg_h2d = std::min(pg_h2d, now_s() - t0);
      t0 = now_s();
      CK(cudaMemcpy(pageable.data(), d1, bytes, cudaMemcpyDeviceToHost));
      if (r > 0) pg_d2h = std::min(pg_d2h, now_s() - t0);
    }
    const double b = static_cast<double>(bytes);
    note("pcie%s: pinned H2D %.1f GB/s, D2H %.1f GB/s", "", b / h2d / 1e9, b / d2h / 1e9);
    note("%s, both at once %.1f GB/s; pageable H2D %.1f GB/s\n", "", 2 * b / bidir / 1e9,
         b / pg_h2d / 1e9);
    j.boolean("available", true)
        .str("gpu", prop.name)
        .integer("device", o.device)
        .integer("bytes", static_cast<int64_t>(bytes))
        .integer("reps", o.copy_reps)
        .num("h2d_bytes_per_s", b / h2d)
        .num("d2h_bytes_per_s", b / d2h)
        .num("bidir_bytes_per_s", 2 * b / bidir)
        .num("h2d_GBps", b / h2d / 1e9)
        .num("d2h_GBps", b / d2h / 1e9)
        .num("bidir_GBps", 2 * b / bidir / 1e9)
        .num("pageable_h2d_GBps", b / pg_h2d / 1e9)
        .num("pageable_d2h_GBps", b / pg_d2h / 1e9)
        .str("counting",
             "pinned cudaMemcpyAsync best of reps; bidir = both directions on two streams, "
             "bytes of both over the longer");
    cudaEventDestroy(e0), cudaEventDestroy(e1), cudaEventDestroy(e2);
    cudaStreamDestroy(s1), cudaStreamDestroy(s2);
    cudaFreeHost(h1), cudaFreeHost(h2), cudaFree(d1), cudaFree(d2);
  } catch (const std::exception& e) {
    note("pcie: %s\n", e.what());
    return Json().boolean("available", false).str("error", e.what());
  }
  return j;
}
#else
Json run_pcie(const Options&) {
  return Json().boolean("available", false).str("error", "built without CUDA (CPU-only variant)");
}
#endif

// ---- shardtrain's CPU AdamW
// ---------------------------------------------------------------------------
Json run_adamw(const Options& o, double triad_bps) {
  using namespace shardtrain;
  Json j;
  const int64_t n = o.adamw_elements;
  CpuSimd simd = best_cpu_simd();
  if (o.simd == "scalar") simd = CpuSimd::kScalar;
  if (o.simd == "avx2" && simd != CpuSimd::kScalar) simd = CpuSimd::kAvx2;
  if (o.simd == "avx512" && simd != CpuSimd::kAvx512) {
    return j.str("error", "--adamw-simd avx512: this CPU's widest path is " + to_string(simd));
  }
  const size_t nf = static_cast<size_t>(n) * 4, nh = static_cast<size_t>(n) * 2;
  auto* master = static_cast<float*>(std::aligned_alloc(4096, (nf + 4095) / 4096 * 4096));
  auto* m = static_cast<float*>(std::aligned_alloc(4096, (nf + 4095) / 4096 * 4096));
  auto* v = static_cast<float*>(std::aligned_alloc(4096, (nf + 4095) / 4096 * 4096));
  auto* g32 = static_cast<float*>(std::aligned_alloc(4096, (nf + 4095) / 4096 * 4096));
  auto* g16 = static_cast<uint16_t*>(std::aligned_alloc(4096, (nh + 4095) / 4096 * 4096));
  auto* p16 = static_cast<uint16_t*>(std::aligned_alloc(4096, (nh + 4095) / 4096 * 4096));
  if (!master || !m || !v || !g32 || !g16 || !p16) {
    std::free(master), std::free(m), std::free(v), std::free(g32), std::free(g16), std::free(p16);
    return j.str("error", "cannot allocate the shard (" + std::to_string(n) + " elements, " +
                              std::to_string((4 * nf + 2 * nh) >> 20) + " MiB)");
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {  // first touch by the threads that update each chunk
    master[i] = 0.01f * static_cast<float>((i * 7919) % 1000 - 500) / 500.0f;
    m[i] = v[i] = 0.0f;
    g32[i] = 1e-3f * static_cast<float>((i * 104729) % 2000 - 1000) / 1000.0f;
    uint32_t bits;
    std::memcpy(&bits, &g32[i], 4);
    g16[i] = static_cast<uint16_t>(bits >> 16);
    p16[i] = 0;
  }
  Backend::AdamWArgs args{};
  args.lr = 1e-4f, args.beta1 = 0.9f, args.beta2 = 0.999f, args.eps = 1e-8f;
  args.weight_decay = 0.01f, args.grad_scale = 1.0f;
  const auto measure = [&](bool bf16) {
    double best = 1e30, sum = 0;
    for (int r = 0; r <= o.adamw_reps; ++r) {  // step 1 untimed (page faults, caches)
      const float t = static_cast<float>(r + 1);
      args.bias_correction1 = 1.0f - std::pow(args.beta1, t);
      args.bias_correction2 = 1.0f - std::pow(args.beta2, t);
      const double t0 = now_s();
      if (bf16) {
        cpu_adamw(master, g16, DType::kBF16, m, v, p16, DType::kBF16, n, args, simd);
      } else {
        cpu_adamw(master, g32, DType::kF32, m, v, nullptr, DType::kF32, n, args, simd);
      }
      const double dt = now_s() - t0;
      if (r > 0) best = std::min(best, dt), sum += dt;
    }
    const double mean = sum / o.adamw_reps;
    const double bps = 28.0 * static_cast<double>(n) / best;
    note("cpu_adamw%s: %.3f s per step (best), %.0f M params/s", bf16 ? " bf16" : " fp32", best,
         static_cast<double>(n) / best / 1e6);
    note("%s, %.1f GB/s = %.0f%% of triad\n", "", bps / 1e9,
         triad_bps > 0 ? 100 * bps / triad_bps : 0);
    return Json()
        .num("best_s", best)
        .num("mean_s", mean)
        .num("params_per_s", static_cast<double>(n) / best)
        .num("bytes_per_s", bps)
        .num("GBps", bps / 1e9)
        .num("fraction_of_triad", triad_bps > 0 ? bps / triad_bps : NAN);
  };
  const Json bf16 = measure(true);
  const Json fp32 = measure(false);
  std::free(master), std::free(m), std::free(v), std::free(g32), std::free(g16), std::free(p16);
  return j.integer("elements", n)
      .str("simd", to_string(simd))
      .integer("threads", omp_get_max_threads())
      .integer("reps", o.adamw_reps)
      .integer("bytes_per_element", 28)
      .obj("bf16_grads_bf16_params", bf16)
      .obj("fp32_grads_no_copy", fp32)
      .str(
          "counting",
          "bf16: reads master, m, v 4+4+4 and grad 2, writes master, m, v 4+4+4 and params 2; "
          "fp32: reads 4+4+4+4, writes 4+4+4; best of reps after one untimed step; the fraction of "
          "the triad can exceed 1: the triad's store into a[] costs a write-allocate read that "
          "STREAM does not count, AdamW's in-place updates have none");
}

// ---- disk (direct I/O) --------------------------------------------------------------------------
Json run_disk(const Options& o) {
  Json j;
  const std::string file = o.disk_path + "/bench_host_limits." + std::to_string(getpid()) + ".bin";
  const size_t block = static_cast<size_t>(o.disk_block_kib) << 10;
  const int64_t blocks = std::max<int64_t>(1, (o.disk_mib << 20) / static_cast<int64_t>(block));
  const double total = static_cast<double>(blocks) * static_cast<double>(block);
  bool direct = true;
  int fd = ::open(file.c_str(), O_CREAT | O_TRUNC | O_RDWR | O_DIRECT, 0600);
  if (fd < 0) {
    direct = false;
    fd = ::open(file.c_str(), O_CREAT | O_TRUNC | O_RDWR, 0600);
  }
  if (fd < 0) return j.str("error", "cannot create " + file + ": " + std::strerror(errno));
  ::close(fd);
  // jobs threads, each on its own contiguous range of the file, pwrite/pread of `block` bytes
  const auto pass = [&](bool write, int jobs) -> double {
    const int flags = (write ? O_WRONLY : O_RDONLY) | (direct ? O_DIRECT : 0);
    std::vector<std::thread> threads;
    std::vector<int> failed(static_cast<size_t>(jobs), 0);
    const double t0 = now_s();
    for (int t = 0; t < jobs; ++t) {
      threads.emplace_back([&, t] {
        void* buf = std::aligned_alloc(4096, block);
        std::memset(buf, 0x5a, block);
        const int f = ::open(file.c_str(), flags);
        if (f < 0 || !buf) {
          failed[static_cast<size_t>(t)] = 1;
          std::free(buf);
          return;
        }
        const int64_t lo = blocks * t / jobs, hi = blocks * (t + 1) / jobs;
        for (int64_t b = lo; b < hi; ++b) {
          const off_t off = static_cast<off_t>(b) * static_cast<off_t>(block);
          const ssize_t k = write ? ::pwrite(f, buf, block, off) : ::pread(f, buf, block, off);
          if (k != static_cast<ssize_t>(block)) {
            failed[static_cast<size_t>(t)] = 1;
            break;
          }
        }
        if (write && ::fsync(f) != 0) failed[static_cast<size_t>(t)] = 1;
        ::close(f);
        std::free(buf);
      });
    }
    for (auto& th : threads) th.join();
    const double dt = now_s() - t0;
    for (int x : failed)
      if (x) return -1;
    return dt;
  };
  const double w1 = pass(true, 1), r1 = pass(false, 1);
  const double wn = pass(true, o.disk_jobs), rn = pass(false, o.disk_jobs);
  ::unlink(file.c_str());
  if (w1 < 0 || r1 < 0 || wn < 0 || rn < 0) {
    return j.str("error", "I/O failed on " + file + (direct ? " (O_DIRECT)" : ""));
  }
  note("disk %s: write %.2f GB/s, read %.2f GB/s", o.disk_path, total / w1 / 1e9, total / r1 / 1e9);
  note("%s (one thread); %.2f / %.2f GB/s (jobs)\n", "", total / wn / 1e9, total / rn / 1e9);
  return j.str("path", o.disk_path)
      .boolean("direct", direct)
      .integer("bytes", static_cast<int64_t>(total))
      .integer("block_bytes", static_cast<int64_t>(block))
      .integer("jobs", o.disk_jobs)
      .num("write_GBps", total / w1 / 1e9)
      .num("read_GBps", total / r1 / 1e9)
      .num("write_jobs_GBps", total / wn / 1e9)
      .num("read_jobs_GBps", total / rn / 1e9)
      .str("counting", direct ? "O_DIRECT sequential pwrite (+fsync) then pread, one pass each"
                              : "buffered I/O (O_DIRECT refused here): the read is from the page "
                                "cache, not the disk");
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--stream-mib 1024] [--reps 5] [--copy-mib 512] [--copy-reps 10]\n"
               "  [--device 0] [--skip-gpu] [--adamw-elements 200000000] [--adamw-reps 5]\n"
               "  [--adamw-simd auto|scalar|avx2|avx512] [--disk-path DIR] [--disk-mib 4096]\n"
               "  [--disk-block-kib 1024] [--disk-jobs 4]\n"
               "Threads: OMP_NUM_THREADS. Prints one JSON object on stdout.\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const auto next = [&]() -> const char* {
      if (i + 1 >= argc) std::exit(usage(argv[0]));
      return argv[++i];
    };
    if (k == "--stream-mib")
      o.stream_mib = std::atoll(next());
    else if (k == "--reps")
      o.reps = std::atoi(next());
    else if (k == "--copy-mib")
      o.copy_mib = std::atoll(next());
    else if (k == "--copy-reps")
      o.copy_reps = std::atoi(next());
    else if (k == "--device")
      o.device = std::atoi(next());
    else if (k == "--skip-gpu")
      o.skip_gpu = true;
    else if (k == "--adamw-elements")
      o.adamw_elements = std::atoll(next());
    else if (k == "--adamw-reps")
      o.adamw_reps = std::atoi(next());
    else if (k == "--adamw-simd")
      o.simd = next();
    else if (k == "--disk-path")
      o.disk_path = next();
    else if (k == "--disk-mib")
      o.disk_mib = std::atoll(next());
    else if (k == "--disk-block-kib")
      o.disk_block_kib = std::atoll(next());
    else if (k == "--disk-jobs")
      o.disk_jobs = std::atoi(next());
    else
      return usage(argv[0]);
  }
  if (o.stream_mib < 1 || o.reps < 1 || o.copy_mib < 1 || o.copy_reps < 1 || o.adamw_elements < 1 ||
      o.adamw_reps < 1 || o.disk_mib < 1 || o.disk_block_kib < 4 || o.disk_jobs < 1) {
    return usage(argv[0]);
  }
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  Json out;
  out.str("tool", "bench_host_limits")
      .str("host", host)
      .boolean("cuda_build", SHARDTRAIN_BENCH_CUDA != 0)
      .integer("omp_threads", omp_get_max_threads())
      .integer("hardware_threads", static_cast<int64_t>(std::thread::hardware_concurrency()))
      .str("cpu_simd", shardtrain::to_string(shardtrain::best_cpu_simd()));
  const double t0 = now_s();
  double triad = 0;
  out.obj("stream", run_stream(o, &triad));
  out.obj("pcie",
          o.skip_gpu ? Json().boolean("available", false).str("error", "--skip-gpu") : run_pcie(o));
  out.obj("cpu_adamw", run_adamw(o, triad));
  if (!o.disk_path.empty()) out.obj("disk", run_disk(o));
  out.num("wall_s", now_s() - t0);
  std::printf("%s\n", out.text().c_str());
  return 0;
}
