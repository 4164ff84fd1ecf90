// Helpers the MPI test programs share.
#pragma once

#define OMPI_SKIP_MPICXX 1
#include <fmt/core.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

namespace shardtrain::test_support {

/// One temporary directory for the whole job: `prefix` and rank 0's pid under the system's temp
/// directory, broadcast to every rank (collective over MPI_COMM_WORLD). Not created here.
inline std::filesystem::path job_temp_dir(const std::string& prefix) {
  char name[256] = {};
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    const std::string d =
        (std::filesystem::temp_directory_path() / fmt::format("{}_{}", prefix, ::getpid()))
            .string();
    std::snprintf(name, sizeof name, "%s", d.c_str());
  }
  MPI_Bcast(name, sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
  return name;
}

}  // namespace shardtrain::test_support
