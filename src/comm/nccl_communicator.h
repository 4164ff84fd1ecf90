// The NCCL communicator (comm/nccl_communicator_cuda.cpp, built with the CUDA backend) and the GPU
// count the launcher checks. Builds without CUDA get stand-ins (comm/world.cpp): the factory
// throws and the count is 0.
#pragma once

#include <memory>

#include "comm/comm_support.h"
#include "comm/communicator.h"
#include "comm/dist_env.h"

namespace shardtrain {

/// NCCL communicator over the world of `env` for CUDA tensors (fp32, bf16, fp16, int32) on GPU
/// env.local_rank, which it makes current. Each operation runs on the communicator's own stream
/// after the work enqueued so far on `cuda_stream` (a cudaStream_t; null: the legacy default
/// stream) and Work::wait() makes that stream wait for it, so communication overlaps compute.
/// `bootstrap` carries the NCCL unique id from rank 0 (and the progress board for timeout
/// reports). Sets NCCL_NVLS_ENABLE=0 unless the variable is set (NVLink SHARP multicast stays
/// off). A background thread stops the process (exit status 1, a message naming the operation
/// and the ranks that did not join it) when an operation is not done within options.timeout_s or
/// NCCL reports an asynchronous error. On one node whose GPUs can access each other's memory,
/// collectives on registered buffers use copy engines (comm/peer_collectives.h;
/// SHARDTRAIN_PEER_COLLECTIVES=0 keeps NCCL for all).
/// Throws ConfigError when env.local_rank has no GPU, RuntimeFailure when CUDA or NCCL fail or
/// when shardtrain was built without CUDA.
std::unique_ptr<Communicator> make_nccl_communicator(const DistributedEnv& env, void* cuda_stream,
                                                     const CommOptions& options,
                                                     std::shared_ptr<Bootstrap> bootstrap);

/// GPUs visible to this process (cudaGetDeviceCount; honours CUDA_VISIBLE_DEVICES); 0 when CUDA
/// is unavailable or shardtrain was built without it.
int cuda_device_count();

}  // namespace shardtrain
