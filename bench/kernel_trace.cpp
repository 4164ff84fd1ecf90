// kernel_trace: a CUDA injection library that sums the device time of every kernel, memset and
// memcpy a program runs, through CUPTI's activity API — a stand-in for `nsys stats
// --report cuda_gpu_kern_sum` on the GPU image, which has no Nsight Systems.
//
// Usage (no change to the traced program):
//     CUDA_INJECTION64_PATH=/path/libkernel_trace.so KERNEL_TRACE_OUT=kern.tsv ./shardtrain ...
// The driver loads the library at the program's first CUDA call and calls InitializeInjection();
// at exit the library writes KERNEL_TRACE_OUT (default kernel_trace.tsv): one line per distinct
// activity, sorted by total device time —
//     total_ms  calls  mean_us  kind  name
// (kind: kernel, memset or memcpy; kernel names demangled by CUPTI's record). KERNEL_TRACE_SKIP=N
// leaves out the first N activities (e.g. the first steps' cuDNN algorithm searches), counted in
// completion order. Device times overlap when kernels run concurrently; the header line gives the
// span from the first counted activity's start to the last one's end, so the sum of the rows
// against the span shows how busy the device was.
#include <cupti.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Sum {
  uint64_t ns = 0;
  uint64_t calls = 0;
};

std::mutex g_mu;
std::map<std::pair<std::string, std::string>, Sum> g_sums;  // (kind, name) -> totals
uint64_t g_seen = 0, g_skip = 0, g_first = UINT64_MAX, g_last = 0;
constexpr size_t kBufferBytes = size_t{8} << 20;

void add(const char* kind, const char* name, uint64_t start, uint64_t end) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_seen++ < g_skip) return;
  Sum& s = g_sums[{kind, name ? name : "?"}];
  s.ns += end - start;
  ++s.calls;
  g_first = std::min(g_first, start);
  g_last = std::max(g_last, end);
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        add("kernel", k->name, k->start, k->end);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        add("memset", "memset", m->start, m->end);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        static const char* kinds[] = {"unknown", "HtoD", "DtoH", "HtoA", "AtoH", "AtoA",
                                      "AtoD",    "DtoA", "DtoD", "HtoH", "PtoP"};
        const unsigned kind = m->copyKind < 11 ? m->copyKind : 0;
        add("memcpy", kinds[kind], m->start, m->end);
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

void write_report() {
  cuptiActivityFlushAll(1);
  const char* path = std::getenv("KERNEL_TRACE_OUT");
  FILE* f = std::fopen(path && *path ? path : "kernel_trace.tsv", "w");
  if (!f) return;
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::pair<std::pair<std::string, std::string>, Sum>> rows(g_sums.begin(),
                                                                        g_sums.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
  uint64_t total = 0;
  for (const auto& r : rows) total += r.second.ns;
  std::fprintf(f, "# activities %llu (first %llu skipped), summed device time %.3f ms, span %.3f ms\n",
               static_cast<unsigned long long>(g_seen), static_cast<unsigned long long>(g_skip),
               total / 1e6, g_last > g_first ? (g_last - g_first) / 1e6 : 0.0);
  std::fprintf(f, "total_ms\tcalls\tmean_us\tkind\tname\n");
  for (const auto& [key, s] : rows)
    std::fprintf(f, "%.3f\t%llu\t%.2f\t%s\t%s\n", s.ns / 1e6,
                 static_cast<unsigned long long>(s.calls), s.ns / 1e3 / static_cast<double>(s.calls),
                 key.first.c_str(), key.second.c_str());
  std::fclose(f);
}

}  // namespace

/// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library. Returns 1 on success.
extern "C" int InitializeInjection() {
  if (const char* s = std::getenv("KERNEL_TRACE_SKIP")) g_skip = std::strtoull(s, nullptr, 10);
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) return 0;
  for (CUpti_ActivityKind k : {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMSET,
                               CUPTI_ACTIVITY_KIND_MEMCPY})
    if (cuptiActivityEnable(k) != CUPTI_SUCCESS) return 0;
  std::atexit(write_report);
  return 1;
}
