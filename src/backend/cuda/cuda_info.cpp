// `shardtrain env`'s CUDA lines (backend/backend.h, cuda_info).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <fmt/core.h>
#include <nccl.h>

#include <cctype>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"

#ifndef SHARDTRAIN_CUDA_ARCHS
#define SHARDTRAIN_CUDA_ARCHS "unknown"
#endif

namespace shardtrain {
namespace {

std::string cuda_version(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

/// The architectures compiled in (CMAKE_CUDA_ARCHITECTURES, e.g. "90a-real,90-virtual").
struct Arch {
  int cc = 0;          ///< e.g. 90
  bool exact = false;  ///< "a" features: runs only on that very architecture
  bool real = true;    ///< machine code; false: PTX, compiled by the driver for cc ≥ this
};

std::vector<Arch> compiled_archs() {
  std::vector<Arch> out;
  std::stringstream in(SHARDTRAIN_CUDA_ARCHS);
  std::string item;
  while (std::getline(in, item, ',')) {
    Arch a;
    size_t i = 0;
    while (i < item.size() && std::isdigit(static_cast<unsigned char>(item[i]))) ++i;
    if (i == 0) continue;
    a.cc = std::stoi(item.substr(0, i));
    a.exact = i < item.size() && item[i] == 'a';
    const bool real = item.find("-real") != std::string::npos;
    const bool virt = item.find("-virtual") != std::string::npos;
    if (virt) {
      a.real = false;
      out.push_back(a);
    } else if (real) {
      out.push_back(a);
    } else {  // plain "90": both machine code and PTX
      out.push_back(a);
      a.real = false;
      out.push_back(a);
    }
  }
  return out;
}

/// Whether code for `archs` runs on a GPU of compute capability `cc` (major·10 + minor).
std::string runs_on(const std::vector<Arch>& archs, int cc) {
  for (const Arch& a : archs)
    if (a.real && a.cc == cc) return "yes (machine code)";
  for (const Arch& a : archs)
    if (!a.real && !a.exact && a.cc <= cc) return "yes (PTX, compiled by the driver at start-up)";
  return "NO: rebuild with -DCMAKE_CUDA_ARCHITECTURES=" + std::to_string(cc) +
         " (this build has " SHARDTRAIN_CUDA_ARCHS ")";
}

}  // namespace

std::vector<InfoLine> cuda_info() {
  std::vector<InfoLine> out;
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  const cudaError_t driver_err = cudaDriverGetVersion(&driver);
  out.push_back({"CUDA runtime",
                 cuda_version(runtime) + " (built with " + cuda_version(CUDART_VERSION) + ")"});
  out.push_back(
      {"CUDA driver",
       driver_err != cudaSuccess || driver == 0
           ? std::string("none found (no NVIDIA driver on this machine)")
           : cuda_version(driver) + (driver < runtime ? ": OLDER than the runtime, update the "
                                                        "driver"
                                                      : "")});
  int major = 0, minor = 0, patch = 0;
  cublasGetProperty(MAJOR_VERSION, &major);
  cublasGetProperty(MINOR_VERSION, &minor);
  cublasGetProperty(PATCH_LEVEL, &patch);
  const size_t lt = cublasLtGetVersion();
  out.push_back({"cuBLAS", fmt::format("{}.{}.{} (cuBLASLt {}.{}.{})", major, minor, patch,
                                       lt / 10000, (lt % 10000) / 100, lt % 100)});
  const size_t cudnn = cudnnGetVersion();
  out.push_back(
      {"cuDNN", fmt::format("{}.{}.{}", cudnn / 10000, (cudnn % 10000) / 100, cudnn % 100)});
  int nccl = 0;
  ncclGetVersion(&nccl);
  out.push_back({"NCCL", fmt::format("{}.{}.{}", nccl / 10000, (nccl % 10000) / 100, nccl % 100)});
  out.push_back({"GPU architectures compiled in", SHARDTRAIN_CUDA_ARCHS});
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  cudaGetLastError();  // clear "no device"
  if (count == 0) out.push_back({"GPUs", "none seen (CUDA_VISIBLE_DEVICES, the driver)"});
  const std::vector<Arch> archs = compiled_archs();
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
    const int cc = p.major * 10 + p.minor;
    out.push_back(
        {fmt::format("GPU {}", d),
         fmt::format("{}, compute capability {}.{}, {:.1f} GiB; this build runs on it: {}", p.name,
                     p.major, p.minor,
                     static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024 * 1024),
                     runs_on(archs, cc))});
  }
  return out;
}

}  // namespace shardtrain
