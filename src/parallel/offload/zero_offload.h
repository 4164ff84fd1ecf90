// Offload as a policy handed to the ZeRO strategies (as torchtitan's FSDP takes its
// CPUOffloadPolicy): OffloadPolicy says what leaves the GPU and how, resolved once from the plan
// and zero_optimization by make_strategy; ZeroOffload is the optimizer half a ZeRO strategy hands
// to the host with it (ZeRO-Offload: Ren et al., arXiv 2101.06840, §4; ZeRO-Infinity:
// Rajbhandari et al., arXiv 2104.07857, §5), and owned_state_split says which owned elements stay
// on the device. The strategies (parallel/zero_base.h, zero.cpp, zero3.cpp) read the policy, never
// the offload keys of the sections.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "memory/param_layout.h"
#include "parallel/buckets.h"
#include "parallel/offload/host_optimizer.h"
#include "parallel/strategy.h"

namespace shardtrain {

/// What a ZeRO strategy offloads, and how.
struct OffloadPolicy {
  // ---- the optimizer state (offload_optimizer) ----
  OffloadDevice optimizer = OffloadDevice::kNone;  ///< none, cpu (ZeRO-Offload), nvme (Infinity)
  /// Fraction of the owned optimizer state stepped on the host (offload_optimizer.ratio), in
  /// [0, 1]; the rest stays on the GPU.
  double ratio = 1.0;
  /// ZeRO-Offload §4.3's one-step delayed parameter update (the host step overlaps the next step).
  bool delayed_update = false;
  /// Start each part's host update during backward, validated by step()
  /// (HostOptimizer::speculate): stages 1-2 without the delayed update only.
  bool speculative_update = false;
  DType moment_dtype = DType::kF32;  ///< host AdamW m and v: kF32, or kBF16 (8 bytes per element)
  /// Swap files under nvme_path (nvme): elements whose state stays in host memory.
  int64_t optimizer_max_in_cpu = 0;
  // ---- the parameters, stage 3 (offload_param) ----
  OffloadDevice params = OffloadDevice::kNone;  ///< none, cpu (pinned host memory), nvme
  int64_t param_max_in_cpu = -1;  ///< nvme: parameter elements kept in host memory; -1 = all
  int param_buffer_count = 0;     ///< nvme: staging buffers of paged layers
  // ---- the swap files ----
  std::string nvme_path;
  AioConfig aio;

  bool optimizer_offloaded() const { return optimizer != OffloadDevice::kNone; }
  bool params_offloaded() const { return params != OffloadDevice::kNone; }
};

/// The policy of a plan and its zero_optimization and aio sections.
OffloadPolicy offload_policy(const StrategyOptions& options);

/// Which owned elements of each part are stepped on the device (owned_state_split).
struct OwnedStateSplit {
  std::vector<size_t> forward_order;  ///< parts by first layer
  /// Per part: its owned elements [0, on_device[i]) are stepped on the device, the rest on the
  /// host.
  std::vector<int64_t> on_device;
  /// Per part: the start of its device-stepped elements in the device state buffers (master,
  /// m, v). Without offload the buffers are laid out like the slices, padding included.
  std::vector<int64_t> device_offset;
  int64_t device_state_numel = 0;  ///< elements of the device state buffers
};

/// Splits each owned slice of `parts` between the device and the host: the fraction
/// `host_fraction` (offload_optimizer.ratio; 0 without offload) of all owned elements goes to the
/// host, from the parts that come LAST in forward order, so that the device-stepped parts are the
/// ones the next forward needs first. Device cuts fall on 64-element boundaries. Pure.
OwnedStateSplit owned_state_split(const std::vector<BucketPartition>& parts, bool offloaded,
                                  double host_fraction);

/// The host-stepped half of a ZeRO strategy's optimizer: a HostOptimizer over the host-stepped
/// tail of each part, and the per-step bookkeeping around it — which parts' gradients have left
/// for the host this step, and which parts' updates the device has not seen yet.
class ZeroOffload {
 public:
  /// The host state of `host_ranges` (per part: its host-stepped flat-layout range), as
  /// HostOptimizer's constructor (its errors); `in_host` and `staged` as its host_params and
  /// staged_params; `dtype` the compute dtype; `rank` names the swap file.
  ZeroOffload(const OffloadPolicy& policy, Backend& backend, const ParamLayout& layout,
              std::vector<FlatRange> host_ranges, const OptimizerHyper& hyper, DType dtype,
              int rank, std::vector<Tensor> in_host, StagedParams staged);

  HostOptimizer& host() { return *host_; }
  const HostOptimizer& host() const { return *host_; }
  const FlatRange& range(size_t i) const { return host_->range(i); }

  /// Part `i`'s reduced gradient of this step is final: its host-stepped tail `grad_tail`
  /// ([range(i).numel], compute dtype, on the device) leaves for the host, once per step (later
  /// calls of the step do nothing).
  void gradient_ready(size_t i, const Tensor& grad_tail);

  /// Queues the host update of every part in `order` into `targets` (per part, where its
  /// host-stepped parameters land); from now each part's update is pending until take_update.
  void step(double lr, double grad_scale, const std::vector<size_t>& order,
            const std::vector<Tensor>& targets);
  /// Whether part `i`'s latest update has reached its parameters (non-blocking).
  bool landed(size_t i) const { return pending_.empty() || !pending_[i] || host_->ready(i); }
  /// If part `i`'s update is pending: waits until it has reached its parameters, marks it seen
  /// and returns true (the caller then publishes the part); else false.
  bool take_update(size_t i);
  /// Before the strategy overwrites its gradients (zero_grad): every copy reading them off the
  /// device is done first — the staged ranges' (the host waits: HostOptimizer::wait_staged_reads)
  /// and the others' (the compute stream waits: HostOptimizer::release_device_gradients).
  void before_gradients_change() {
    host_->wait_staged_reads();
    host_->release_device_gradients();
  }
  /// Forgets the pending updates (a load replaced the parameters).
  void forget_pending() { pending_.clear(); }

  /// The part holding the host-stepped flat elements [offset, offset + numel) and their offset
  /// in its range, or {-1, 0} when they are stepped on the device.
  std::pair<int, int64_t> range_holding(int64_t offset, int64_t numel) const;

  /// Host memory of the optimizer half, plus a stage's own offloaded parameters.
  HostMemory memory(size_t extra_pinned, size_t extra_nvme) const {
    return {host_->pinned_bytes() + extra_pinned, host_->pageable_bytes(),
            host_->nvme_bytes() + extra_nvme};
  }

 private:
  std::unique_ptr<HostOptimizer> host_;
  std::vector<bool> sent_;     ///< per part: gradient handed to the host this step
  std::vector<bool> pending_;  ///< per part: updated, not yet seen by the device
};

}  // namespace shardtrain
