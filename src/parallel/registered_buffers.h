// The strategies' flat buffers registered with the communicator for its faster collective path
// (Communicator::register_buffers: copy-engine transfers between the GPUs of one node), together
// with the staging memory that path needs. The staging comes from the strategy's backend, so it
// counts in the allocator's statistics (allocated / peak bytes) like every other buffer.
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "core/tensor.h"
#include "memory/flat_buffer.h"

namespace shardtrain {

class RegisteredBuffers {
 public:
  RegisteredBuffers() = default;
  /// Collective over `comm` (every rank passes buffers of the same sizes in the same order). Holds
  /// nothing when the communicator has no such path (CPU, one rank, GPUs on several nodes).
  /// Throws RuntimeFailure (out of memory, transport failure).
  RegisteredBuffers(Communicator& comm, Backend& backend, const std::vector<Tensor>& buffers) {
    const size_t bytes = comm.registration_staging_bytes();
    if (bytes == 0) return;
    staging_ = FlatBuffer(backend, DType::kU16, static_cast<int64_t>((bytes + 1) / 2));
    registration_ = comm.register_buffers(buffers, staging_.view());
    if (!registration_) staging_ = FlatBuffer();
  }

  /// Whether collectives on the buffers take the faster path.
  bool active() const { return registration_ != nullptr; }

 private:
  FlatBuffer staging_;
  // Declared after staging_: deregisters before the staging is freed.
  std::unique_ptr<BufferRegistration> registration_;
};

}  // namespace shardtrain
