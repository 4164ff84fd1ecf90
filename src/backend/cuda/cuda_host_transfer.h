// Pinned host memory and the copy stream of the CUDA backend (cuda_host_transfer.cu).
#pragma once

#include <memory>

#include "backend/cuda/cuda_common.h"
#include "backend/host_transfer.h"

namespace shardtrain::cuda {

/// A CopyStream on a new non-blocking stream of `device`, ordered against `compute` by events.
std::unique_ptr<CopyStream> make_copy_stream(int device, cudaStream_t compute);

/// A DeviceTimeline of timing events recorded on `compute` or on a CopyStream made by
/// make_copy_stream, measured against an event recorded on `compute` at start().
std::unique_ptr<DeviceTimeline> make_device_timeline(int device, cudaStream_t compute);

/// cudaHostAlloc of `bytes` (portable pinned memory). Throws RuntimeFailure with the request,
/// `held` (pinned bytes this process holds), the host's available memory and the fixes.
void* pinned_allocate(int device, size_t bytes, size_t held);
void pinned_free(int device, void* p) noexcept;

}  // namespace shardtrain::cuda
