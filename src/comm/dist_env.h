// DistributedEnv: which rank of how many this process is, read from the variables its launcher
// set: `shardtrain launch` and torchrun (RANK, WORLD_SIZE, ...), OpenMPI's mpirun
// (OMPI_COMM_WORLD_*) or SLURM's srun (SLURM_PROCID, ...). docs/LAUNCHING.md lists them.
#pragma once

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"

namespace shardtrain {

struct DistributedEnv {
  int rank = 0;                           ///< global rank, 0 ≤ rank < world_size
  int world_size = 1;                     ///< number of ranks of the job
  int local_rank = 0;                     ///< rank on this node (the GPU index on GPU runs)
  int local_world_size = 1;               ///< ranks on this node
  int node_rank = 0;                      ///< index of this node
  std::string master_addr = "127.0.0.1";  ///< host of rank 0 (TCP store for GPU rendezvous)
  /// Port of shardtrain's TCP store on master_addr: MASTER_PORT, or MASTER_PORT + 1 under
  /// torchrun when its agent serves PyTorch's store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE).
  int master_port = 29500;
  /// "none" (single process), "shardtrain-launch", "torchrun" (RANK/WORLD_SIZE set by another
  /// launcher), "mpirun" (OpenMPI) or "slurm" (srun).
  std::string launcher = "none";
};

/// Looks a variable up: the value, or nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

/// The process environment as an EnvLookup.
EnvLookup process_env();

/// Reads the rank layout. Precedence, first match wins:
///  1. RANK and WORLD_SIZE (shardtrain launch, torchrun): LOCAL_RANK (default: RANK),
///     LOCAL_WORLD_SIZE (default: WORLD_SIZE), GROUP_RANK or NODE_RANK (default:
///     RANK / LOCAL_WORLD_SIZE), MASTER_ADDR, MASTER_PORT; launcher = $SHARDTRAIN_LAUNCHER or
///     "torchrun".
///  2. OMPI_COMM_WORLD_SIZE (mpirun): OMPI_COMM_WORLD_RANK, _LOCAL_RANK, _LOCAL_SIZE; node_rank
///     = (rank − local_rank) / local_size (exact for mpirun's default by-slot layout with equal
///     slots per node).
///  3. SLURM_PROCID inside an srun step (SLURM_STEP_NUM_TASKS, or SLURM_NTASKS with SLURM_STEP_ID
///     set; the body of an sbatch script is not a step and counts as a single process):
///     SLURM_LOCALID, SLURM_NODEID, local size from SLURM_STEP_TASKS_PER_NODE (else
///     SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE) taken at this node's index; master from
///     MASTER_ADDR, else the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST, else
///     SLURM_LAUNCH_NODE_IPADDR; port from MASTER_PORT, else 29500 + SLURM_JOB_ID % 1000.
///  4. Otherwise a single process (world 1).
/// MASTER_ADDR / MASTER_PORT override the defaults in every case. Throws ConfigError naming the
/// variable when one is malformed (not an integer, rank outside [0, world), port outside
/// [1, 65535]).
DistributedEnv read_distributed_env(const EnvLookup& env);

/// read_distributed_env(process_env()).
DistributedEnv read_distributed_env();

/// Expands SLURM's compressed per-node counts: "2(x3),1" → {2, 2, 2, 1}. Throws ConfigError
/// naming `what` (the variable) on malformed input.
std::vector<int> expand_slurm_counts(const std::string& value, const std::string& what);

/// The first host of a SLURM host list: "gpu[07-09,12],cpu1" → "gpu07", "node3,node4" → "node3".
/// Throws ConfigError naming `what` on malformed input.
std::string first_slurm_host(const std::string& hostlist, const std::string& what);

/// SHARDTRAIN_PEER_COLLECTIVES: unset or 1 (copy-engine collectives for registered buffers where
/// the GPUs allow, comm/peer_collectives.h) or 0 (NCCL for every collective). Inline: the NCCL
/// communicator (shardtrain_cuda) reads it too. Throws ConfigError for other values.
inline bool peer_collectives_wanted() {
  const char* v = std::getenv("SHARDTRAIN_PEER_COLLECTIVES");
  const std::string s = v ? v : "";
  check<ConfigError>(s.empty() || s == "0" || s == "1",
                     "SHARDTRAIN_PEER_COLLECTIVES='{}' must be 0 (NCCL for every collective) or 1 "
                     "(copy-engine collectives for registered buffers, the default)",
                     s);
  return s != "0";
}

/// The CUDA variables of a GPU rank of a job of several ranks, set before any CUDA call (the
/// driver reads them when it starts), each only when the user has not set it:
///  * CUDA_DEVICE_MAX_CONNECTIONS=1 when the collectives will run on NCCL's kernels (ranks on
///    several nodes, or SHARDTRAIN_PEER_COLLECTIVES=0): one hardware work queue per GPU, shared
///    by the compute and NCCL streams, made dp / zero1 / zero2 steps 3–5% faster on 2 H200s
///    (measured 2026-11-21); Megatron-LM sets the same. All ranks on one node use the
///    copy-engine collectives (comm/peer_collectives.h), whose copies and barriers would block
///    a shared queue: they keep the driver's default of 8 queues.
///  * NCCL_NVLS_ENABLE=0: NVLink SHARP multicast stays off.
/// Does nothing for a single rank or `device` "cpu". Throws ConfigError for a bad
/// SHARDTRAIN_PEER_COLLECTIVES.
void set_gpu_rank_environment(const DistributedEnv& env, const std::string& device);

/// One line describing the layout, e.g. "rank 3 of 8 (local 1 of 4, node 1) via slurm".
std::string describe(const DistributedEnv& env);

}  // namespace shardtrain
