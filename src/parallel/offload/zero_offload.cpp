// The offload policy of a plan, the device/host split of the owned optimizer state, and the
// host half of a ZeRO strategy's optimizer (parallel/offload/zero_offload.h).
#include "parallel/offload/zero_offload.h"

#include <algorithm>
#include <cmath>

namespace shardtrain {

OffloadPolicy offload_policy(const StrategyOptions& options) {
  const ParallelPlan& plan = options.plan;
  const ZeroConfig& z = options.zero;
  OffloadPolicy p;
  p.optimizer = plan.optimizer_offload;
  p.ratio = plan.optimizer_offload_ratio;
  p.delayed_update = z.offload_delayed_update;
  // Stage 3 keeps the update after backward: its gathers may still read a part's shard after the
  // part's gradient is final (persistent parameters). The delayed update has its own overlap.
  p.speculative_update =
      z.offload_speculative_update && !z.offload_delayed_update && plan.zero_stage < 3;
  p.moment_dtype = options.moment_dtype();
  p.optimizer_max_in_cpu = z.offload_optimizer_max_in_cpu;
  p.params = plan.param_offload;
  p.param_max_in_cpu = z.offload_param_max_in_cpu;
  p.param_buffer_count = z.offload_param_buffer_count;
  p.nvme_path = z.nvme_path;
  p.aio = options.aio;
  return p;
}

OwnedStateSplit owned_state_split(const std::vector<BucketPartition>& parts, bool offloaded,
                                  double host_fraction) {
  const size_t n = parts.size();
  OwnedStateSplit s;
  s.forward_order.resize(n);
  for (size_t i = 0; i < n; ++i) s.forward_order[i] = i;
  std::sort(s.forward_order.begin(), s.forward_order.end(), [&](size_t a, size_t b) {
    return parts[a].bucket.first_layer < parts[b].bucket.first_layer;
  });
  s.on_device.assign(n, 0);
  s.device_offset.assign(n, 0);
  int64_t owned = 0;
  for (const BucketPartition& p : parts) owned += p.owned_numel;
  int64_t budget =
      offloaded
          ? static_cast<int64_t>(std::llround((1.0 - host_fraction) * static_cast<double>(owned)))
          : owned;
  for (size_t i : s.forward_order) {
    const int64_t want = parts[i].owned_numel;
    int64_t g = std::min(want, budget);
    if (g < want) g = g / 64 * 64;
    s.on_device[i] = g;
    budget -= g;
  }
  for (size_t i = 0; i < n; ++i) {
    s.device_offset[i] = offloaded ? s.device_state_numel : parts[i].shard_offset;
    s.device_state_numel += offloaded ? s.on_device[i] : parts[i].shard;
  }
  return s;
}

ZeroOffload::ZeroOffload(const OffloadPolicy& policy, Backend& backend, const ParamLayout& layout,
                         std::vector<FlatRange> host_ranges, const OptimizerHyper& hyper,
                         DType dtype, int rank, std::vector<Tensor> in_host, StagedParams staged) {
  const size_t parts = host_ranges.size();
  const SwapOptions swap{policy.nvme_path, rank, policy.aio, policy.optimizer_max_in_cpu};
  host_ = std::make_unique<HostOptimizer>(
      backend, layout, std::move(host_ranges), hyper, dtype, dtype, policy.delayed_update,
      policy.optimizer == OffloadDevice::kNvme ? &swap : nullptr, std::move(in_host),
      std::move(staged), policy.moment_dtype);
  sent_.assign(parts, false);
}

void ZeroOffload::gradient_ready(size_t i, const Tensor& grad_tail) {
  if (sent_[i]) return;
  sent_[i] = true;
  host_->gradient_ready(i, grad_tail);
}

void ZeroOffload::step(double lr, double grad_scale, const std::vector<size_t>& order,
                       const std::vector<Tensor>& targets) {
  host_->step(lr, grad_scale, order, targets);
  pending_.assign(sent_.size(), true);
  sent_.assign(sent_.size(), false);
}

bool ZeroOffload::take_update(size_t i) {
  if (pending_.empty() || !pending_[i]) return false;
  pending_[i] = false;
  host_->wait_part(i);
  return true;
}

std::pair<int, int64_t> ZeroOffload::range_holding(int64_t offset, int64_t numel) const {
  for (size_t i = 0; i < host_->num_parts(); ++i) {
    const FlatRange& r = host_->range(i);
    if (r.numel > 0 && offset >= r.offset && offset + numel <= r.offset + r.numel)
      return {static_cast<int>(i), offset - r.offset};
  }
  return {-1, 0};
}

}  // namespace shardtrain
