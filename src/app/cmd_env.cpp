// `shardtrain env` (DeepSpeed's ds_report): what this build was compiled with and what the machine
// gives it — the compiler, the CPU optimizer's vector path, OpenMP and OpenBLAS threads, MPI, and
// on the CUDA side the runtime and driver, cuBLAS, cuDNN, NCCL, the GPU architectures compiled in
// and whether each GPU seen can run them (backend/backend.h, cuda_info). Check it before a first
// GPU run.
#define OMPI_SKIP_MPICXX 1
#include <fmt/core.h>
#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "app/commands.h"
#include "backend/backend.h"
#include "optim/cpu_adamw.h"

extern "C" {
// OpenBLAS's own queries (the library shardtrain links, cmake: BLAS).
char* openblas_get_config(void);
int openblas_get_num_threads(void);
}

namespace shardtrain {
namespace {

std::vector<InfoLine> host_info() {
  std::vector<InfoLine> out;
  out.push_back({"shardtrain", SHARDTRAIN_VERSION});
  out.push_back({"compiler", fmt::format("g++ {}, C++{}", __VERSION__, __cplusplus / 100 % 100)});
  out.push_back(
      {"CPU", fmt::format("{} hardware threads; CPU AdamW path {}",
                          std::thread::hardware_concurrency(), to_string(best_cpu_simd()))});
  out.push_back({"OpenMP", fmt::format("{} threads (OMP_NUM_THREADS)", omp_get_max_threads())});
  out.push_back({"OpenBLAS",
                 fmt::format("{}; {} threads", openblas_get_config(), openblas_get_num_threads())});
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  MPI_Get_library_version(mpi, &length);  // callable before MPI_Init
  std::string mpi_text(mpi, static_cast<size_t>(std::max(0, length)));
  mpi_text = mpi_text.substr(0, mpi_text.find_first_of("\n,"));
  out.push_back({"MPI", mpi_text});
  return out;
}

}  // namespace

void register_env_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "env",
      "print what this build was compiled with (CUDA, cuBLAS, cuDNN, NCCL, GPU architectures, "
      "MPI, OpenBLAS) and whether the GPUs seen can run it (DeepSpeed's ds_report)");
  cmd->callback([] {
    std::vector<InfoLine> lines = host_info();
    for (InfoLine& l : cuda_info()) lines.push_back(std::move(l));
    size_t width = 0;
    for (const InfoLine& l : lines) width = std::max(width, l.name.size());
    for (const InfoLine& l : lines) fmt::print("{:<{}}  {}\n", l.name, width, l.value);
  });
}

}  // namespace shardtrain
