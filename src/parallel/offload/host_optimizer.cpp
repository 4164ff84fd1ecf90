// The host half of an offloaded optimizer: see host_optimizer.h for the design.
#include "parallel/offload/host_optimizer.h"

#include <fmt/core.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "config/knob.h"
#include "core/error.h"
#include "core/half.h"

namespace shardtrain {

namespace {

/// n values of `dtype` (fp32 or bf16) at `src` as fp32 at `dst`, and back (bf16 rounded to
/// nearest even: a checkpoint's fp32 moments loaded into bf16 state).
void to_f32(const void* src, DType dtype, int64_t n, float* dst) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return;
  }
  const auto* h = static_cast<const uint16_t*>(src);
  for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_float(h[j]);
}

void from_f32(const float* src, int64_t n, DType dtype, void* dst) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return;
  }
  auto* h = static_cast<uint16_t*>(dst);
  for (int64_t j = 0; j < n; ++j) h[j] = float_to_bf16(src[j]);
}

}  // namespace

HostOptimizer::HostOptimizer(Backend& backend, const ParamLayout& layout,
                             std::vector<FlatRange> ranges, OptimizerHyper hyper, DType grad_dtype,
                             DType param_dtype, bool delayed_update, const SwapOptions* swap,
                             std::vector<Tensor> host_params, StagedParams staged_params,
                             DType moment_dtype)
    : backend_(backend),
      ranges_(std::move(ranges)),
      staged_(std::move(staged_params)),
      grad_dtype_(grad_dtype),
      param_dtype_(param_dtype),
      delayed_(delayed_update),
      kind_(hyper.kind),
      moment_dtype_(moment_dtype) {
  ST_ASSERT(moment_dtype == DType::kF32 || moment_dtype == DType::kBF16);
  check<ConfigError>(moment_dtype == DType::kF32 || hyper.kind == OptimizerKind::kAdamW,
                     "{} \"bf16\" needs AdamW: SGD's momentum buffer stays fp32; drop the key "
                     "or use {} adamw",
                     zero_knob(&ZeroConfig::offload_moments_dtype).label(),
                     knob_for(&TrainConfig::optimizer).name());
  ST_ASSERT(dtype_size(grad_dtype) == dtype_size(param_dtype));  // results overwrite gradients
  // The swap file pages master, m and v of AdamW together (make_strategy refuses SGD there).
  ST_ASSERT(!swap || hyper.kind == OptimizerKind::kAdamW);
  ST_ASSERT(host_params.empty() || host_params.size() == ranges_.size());
  ST_ASSERT(staged_.ranges.empty() || (staged_.ranges.size() == ranges_.size() && staged_.write));
  check<ConfigError>(staged_.ranges.empty() || !delayed_update,
                     "{} with parameters paged from NVMe ({}) is not available: drop one of them",
                     zero_knob(&ZeroConfig::offload_delayed_update).label(),
                     zero_knob(&ZeroConfig::offload_param_max_in_cpu).label());
  if (!delayed_ && param_dtype != DType::kF16 && !host_params.empty()) {
    in_params_.resize(ranges_.size());
    for (size_t i = 0; i < ranges_.size(); ++i) {
      const Tensor& t = host_params[i];
      if (t.empty() || t.device != DeviceKind::kCPU || ranges_[i].numel == 0) continue;
      ST_ASSERT(t.numel() == ranges_[i].numel && t.dtype == param_dtype);
      in_params_[i] = t;
    }
  }
  // Which ranges keep their state in memory: all without NVMe, else those that fit max_in_cpu.
  int64_t in_cpu_left = swap ? swap->max_in_cpu : 0;
  int64_t file = 0, largest = 0;
  for (size_t i = 0; i < ranges_.size(); ++i) {
    const FlatRange& r = ranges_[i];
    host_offset_.push_back(pinned_total_);
    if (!gradient_in_params(i) && !staged(i)) pinned_total_ += r.numel;
    const bool in_memory = !swap || r.numel <= in_cpu_left;
    state_offset_.push_back(in_memory ? in_memory_ : -1);
    if (in_memory) {
      in_memory_ += r.numel;
      if (swap) in_cpu_left -= r.numel;
    }
    if (swap) {
      // [master | m | v] per range on NVMe, each 4096-aligned.
      region_.push_back(in_memory ? -1 : file);
      qbytes_.push_back(in_memory ? 0 : swap_round_up(r.numel * 4));
      mbytes_.push_back(
          in_memory ? 0 : swap_round_up(r.numel * static_cast<int64_t>(dtype_size(moment_dtype))));
      file += region_bytes(i);
      largest = std::max(largest, region_bytes(i));
    }
  }
  if (file > 0) {
    check_nvme_path(swap->dir, swap_round_up(file), zero_knob(&ZeroConfig::nvme_path).label());
    swap_ = std::make_unique<SwapFile>(swap->dir, swap->rank, file, swap->aio);
    // A fresh swap file reads as zeros: m and v of a new run (the master weights come next).
    // Three staging slots of the largest range on NVMe.
    slots_.resize(3);
    for (Slot& sl : slots_) sl.buf = AlignedHostBuffer(largest);
  } else {
    region_.clear();
  }
  // master, m and v (SGD: no v) of the ranges in memory, zeroed.
  const auto msize = static_cast<int64_t>(dtype_size(moment_dtype));
  state_[0] = AlignedHostBuffer(in_memory_ * 4);
  state_[1] = AlignedHostBuffer(in_memory_ * msize);
  state_[2] = AlignedHostBuffer(hyper.second_moment_numel(in_memory_) * msize);
  grads_[0] = PinnedBuffer(backend, grad_dtype, pinned_total_);
  if (delayed_) grads_[1] = PinnedBuffer(backend, grad_dtype, pinned_total_);
  for (size_t i = 0; i < ranges_.size(); ++i) {
    const FlatRange& r = ranges_[i];
    // On NVMe the moments are handed to each step from a staging slot.
    const Tensor none(nullptr, moment_dtype, DeviceKind::kCPU, {r.numel});
    const Tensor v = hyper.kind == OptimizerKind::kSGD
                         ? Tensor(nullptr, DType::kF32, DeviceKind::kCPU, {0})
                     : on_nvme(i) ? none
                                  : state_slice(2, state_offset_[i], r.numel);
    adam_.push_back(r.numel == 0
                        ? nullptr
                        : std::make_unique<Optimizer>(
                              backend, layout, r.offset, r.numel, hyper,
                              on_nvme(i) ? none : state_slice(1, state_offset_[i], r.numel), v));
  }
  to_host_ = backend.make_copy_stream();
  to_device_ = backend.make_copy_stream();
  int64_t largest_staged = 0;
  for (size_t i = 0; i < ranges_.size(); ++i)
    if (staged(i)) largest_staged = std::max(largest_staged, ranges_[i].numel);
  if (largest_staged > 0) {
    staged_slot_ = PinnedBuffer(backend, grad_dtype, largest_staged);
    staged_copies_ = backend.make_copy_stream();
  }
  staged_src_.resize(ranges_.size());
  device_grad_.resize(ranges_.size());
  staged_read_gen_.assign(ranges_.size(), 0);
  grad_fence_.assign(ranges_.size(), 0);
  ready_gen_.assign(ranges_.size(), 0);
  ready_fence_.assign(ranges_.size(), 0);
  wanted_gen_.assign(ranges_.size(), 0);
  done_gen_.assign(ranges_.size(), 0);
  // The CPU step's threads: every core, but one left to the thread that feeds the GPU.
  const int threads = backend.kind() == DeviceKind::kCPU ? omp_get_max_threads()
                                                         : std::max(1, omp_get_max_threads() - 1);
  worker_ = std::thread([this, threads] {
    omp_set_num_threads(threads);
    worker_loop();
  });
}

HostOptimizer::~HostOptimizer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void HostOptimizer::drain() noexcept {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return tasks_.empty() && !busy_; });
}

void HostOptimizer::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_all();
}

void HostOptimizer::worker_loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_ and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
    }
    try {
      task();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_) failure_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

void HostOptimizer::rethrow_failure() {
  if (failure_) std::rethrow_exception(failure_);
}

Tensor HostOptimizer::pinned(const PinnedBuffer& buf, size_t i) const {
  return buf.slice(host_offset_[i], ranges_[i].numel);
}

Tensor HostOptimizer::gradient_home(size_t i, int buffer) const {
  return gradient_in_params(i) ? in_params_[i] : pinned(grads_[buffer], i);
}

void HostOptimizer::gradient_ready(size_t i, Tensor grad) {
  ST_ASSERT(i < ranges_.size() && grad.numel() == ranges_[i].numel && grad.dtype == grad_dtype_);
  if (ranges_[i].numel == 0) return;
  // The buffer may still be feeding the previous update's copy to the device: the compute stream
  // (and thus this copy, queued after it) waits for that first.
  wait_part(i);
  if (staged(i)) {
    // Read by the update task; the worker's copies start after the compute stream's work so far.
    staged_copies_->after_compute();
    staged_src_[i] = grad;
    return;
  }
  const int b = delayed_ ? static_cast<int>(step_ % 2) : 0;
  to_host_->after_compute();
  StepTrace* trace = trace_;
  const size_t mark = trace ? trace->mark(to_host_.get()) : 0;
  to_host_->to_host(gradient_home(i, b).data, grad.data, grad.bytes());
  grad_fence_[i] = to_host_->fence();
  last_grad_copy_ = grad_fence_[i];
  if (trace)
    trace->device_segment(TraceLane::kToHost, fmt::format("gradient of part {}", i), mark,
                          trace->mark(to_host_.get()));
  device_grad_[i] = grad;
  if (spec_.active && speculable(i) && !spec_.posted[i]) {
    // Its new parameters replace what the compute stream has read so far (the part's layers are
    // done with them: its gradient is final).
    to_device_->after_compute();
    post_update(i, -1, spec_.lr, spec_.grad_scale, spec_.targets[i], 0, spec_.gen, true,
                grad_fence_[i]);
    spec_.posted[i] = true;
  }
}

int64_t HostOptimizer::next_on_nvme(const std::vector<size_t>& order, size_t k) const {
  for (size_t j = k + 1; j < order.size(); ++j)
    if (adam_[order[j]] && on_nvme(order[j])) return static_cast<int64_t>(order[j]);
  return -1;
}

void HostOptimizer::queue_update(double lr, double grad_scale, const std::vector<size_t>& order,
                                 const std::vector<Tensor>& targets, int buffer, int64_t gen,
                                 bool to_device) {
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    // The next range on NVMe this generation updates: its state is read ahead.
    post_update(i, next_on_nvme(order, k), lr, grad_scale, targets[i], buffer, gen, to_device,
                grad_fence_[i]);
  }
}

void HostOptimizer::post_update(size_t i, int64_t next, double lr, double grad_scale,
                                const Tensor& target, int buffer, int64_t gen, bool to_device,
                                uint64_t fence, std::optional<Undo> undo) {
  if (!adam_[i]) {
    std::lock_guard<std::mutex> lock(mu_);
    ready_gen_[i] = done_gen_[i] = gen;
    return;
  }
  // Parameters kept in host memory by a GPU run (offload_param) are written in place; on the
  // CPU backend "device" memory is host memory too, but it is the model's: copied like a
  // device's, so that the delayed mode holds it back.
  const bool on_host = target.device == DeviceKind::kCPU && backend_.kind() != DeviceKind::kCPU;
  ST_ASSERT(staged(i) || (target.numel() == ranges_[i].numel && target.dtype == param_dtype_));
  ST_ASSERT(!gradient_in_params(i) || target.data == in_params_[i].data);
  ST_ASSERT(!undo || (!staged(i) && !on_nvme(i)));
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++tasks_left_;
  }
  StepTrace* trace = trace_;
  post([this, i, next, lr, grad_scale, target, on_host, buffer, gen, fence, to_device, undo,
        trace] {
    const auto t0 = std::chrono::steady_clock::now();
    // A staged range (parameters paged from NVMe) has no target: update_staged stores it.
    Tensor out;
    if (staged(i)) {
      update_staged(i, next, lr, grad_scale, gen);
    } else {
      to_host_->host_wait(fence);
      const Tensor g = gradient_home(i, buffer);
      if (undo) {
        const int64_t n = ranges_[i].numel;
        adam_[i]->undo_on_host(state_slice(0, state_offset_[i], n), g, undo->lr, undo->grad_scale);
      }
      // The bf16 result overwrites the gradient it came from (same element size), unless the
      // parameters live in host memory, which is written directly.
      out = on_host ? target : g;
      update_range(i, next, g, out, lr, grad_scale);
    }
    const auto t1 = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(t1 - t0).count();
    if (trace)
      trace->host_segment(TraceLane::kHostOptimizer,
                          fmt::format("{} of part {}", undo ? "rollback and redo" : "update", i),
                          t0, t1);
    uint64_t copied = 0;
    if (to_device && !on_host && !staged(i)) {
      const size_t mark = trace ? trace->mark(to_device_.get()) : 0;
      to_device_->to_device(target.data, out.data, out.bytes());
      copied = to_device_->fence();
      if (trace)
        trace->device_segment(TraceLane::kToDevice, fmt::format("parameters of part {}", i), mark,
                              trace->mark(to_device_.get()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    done_gen_[i] = gen;
    if (to_device) {
      ready_gen_[i] = gen;
      ready_fence_[i] = copied;
    }
    acc_seconds_ += dt;
    if (--tasks_left_ == 0) last_seconds_ = acc_seconds_;
  });
}

bool HostOptimizer::speculable(size_t i) const {
  return adam_[i] && kind_ == OptimizerKind::kAdamW && !delayed_ && !on_nvme(i) && !staged(i) &&
         !gradient_in_params(i);
}

void HostOptimizer::speculate(double lr, double grad_scale, const std::vector<Tensor>& targets) {
  ST_ASSERT(!delayed_ && targets.size() == ranges_.size());
  rethrow_failure();
  if (spec_.active) cancel_speculation();  // a step that never reached step()
  spec_ =
      Speculation{true, lr, grad_scale, targets, ++gen_, std::vector<bool>(ranges_.size(), false)};
  std::lock_guard<std::mutex> lock(mu_);
  acc_seconds_ = 0;
}

std::vector<uint64_t> HostOptimizer::recopy_speculated_gradients() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      if (failure_) return true;
      for (size_t i = 0; i < ranges_.size(); ++i)
        if (spec_.posted[i] && done_gen_[i] < spec_.gen) return false;
      return true;
    });
    rethrow_failure();
  }
  uint64_t last = 0;
  for (size_t i = 0; i < ranges_.size(); ++i)
    if (spec_.posted[i]) last = std::max(last, ready_fence_[i]);
  if (last) to_device_->host_wait(last);  // the new parameters have left the pinned buffer
  std::vector<uint64_t> fences(ranges_.size(), 0);
  to_host_->after_compute();
  for (size_t i = 0; i < ranges_.size(); ++i) {
    if (!spec_.posted[i]) continue;
    const Tensor home = gradient_home(i, 0);
    to_host_->to_host(home.data, device_grad_[i].data, home.bytes());
    fences[i] = to_host_->fence();
    last_grad_copy_ = fences[i];
  }
  return fences;
}

void HostOptimizer::cancel_speculation() {
  if (!spec_.active) return;
  spec_.active = false;
  if (std::find(spec_.posted.begin(), spec_.posted.end(), true) == spec_.posted.end()) return;
  ++rolled_back_;
  const std::vector<uint64_t> fences = recopy_speculated_gradients();
  // Each speculated range is undone, and its master weights go back to the device, which holds
  // the speculated parameters.
  const int64_t gen = ++gen_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < ranges_.size(); ++i)
      if (spec_.posted[i]) wanted_gen_[i] = gen;
  }
  const double lr = spec_.lr, scale = spec_.grad_scale;
  for (size_t i = 0; i < ranges_.size(); ++i) {
    if (!spec_.posted[i]) continue;
    const uint64_t fence = fences[i];
    const Tensor target = spec_.targets[i];
    post([this, i, fence, lr, scale, target, gen] {
      to_host_->host_wait(fence);
      const int64_t n = ranges_[i].numel;
      const Tensor master = state_slice(0, state_offset_[i], n), out = gradient_home(i, 0);
      adam_[i]->undo_on_host(master, out, lr, scale);
      from_f32(master.f32(), n, param_dtype_, out.data);
      to_device_->to_device(target.data, out.data, out.bytes());
      const uint64_t copied = to_device_->fence();
      std::lock_guard<std::mutex> lock(mu_);
      done_gen_[i] = ready_gen_[i] = gen;
      ready_fence_[i] = copied;
    });
  }
  wait_all();
}

HostOptimizer::Slot& HostOptimizer::victim(const Slot* keep) {
  for (;;) {
    Slot& v = slots_[next_victim_];
    next_victim_ = (next_victim_ + 1) % slots_.size();
    if (&v == keep) continue;
    swap_->wait(v.write);  // its state is on disk before the slot is reused
    v.write = {};
    return v;
  }
}

void HostOptimizer::prefetch(size_t i, const Slot* keep) {
  for (Slot& sl : slots_)
    if (sl.range == static_cast<int>(i)) return;
  Slot& v = victim(keep);
  v.range = static_cast<int>(i);
  v.read = swap_->read_async(region_[i], v.buf.data(), region_bytes(i));
}

HostOptimizer::Slot& HostOptimizer::page_in(size_t i, const Slot* keep) {
  prefetch(i, keep);
  for (Slot& sl : slots_) {
    if (sl.range != static_cast<int>(i)) continue;
    swap_->wait(sl.read);
    sl.read = {};
    return sl;
  }
  ST_ASSERT(false && "page_in: range not in a slot");
  return slots_[0];
}

void HostOptimizer::update_range(size_t i, int64_t next, const Tensor& grads, const Tensor& out,
                                 double lr, double grad_scale) {
  const int64_t n = ranges_[i].numel;
  if (!on_nvme(i)) {
    if (next >= 0) prefetch(static_cast<size_t>(next), nullptr);  // read while this one steps
    adam_[i]->step_on_host(state_slice(0, state_offset_[i], n), grads, out, lr, grad_scale);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  Slot& sl = page_in(i, nullptr);
  if (StepTrace* trace = trace_)
    trace->host_segment(TraceLane::kDisk, fmt::format("state of part {}", i), t0,
                        std::chrono::steady_clock::now());
  if (next >= 0) prefetch(static_cast<size_t>(next), &sl);  // read ahead of the next step
  char* base = static_cast<char*>(sl.buf.data());
  const auto view = [&](int k) {
    return Tensor(base + quantity_offset(i, k), dtype_of(k), DeviceKind::kCPU, {n});
  };
  adam_[i]->step_on_host(view(0), grads, out, lr, grad_scale, view(1), view(2));
  sl.write = swap_->write_async(region_[i], base, region_bytes(i));  // behind the next steps
}

void HostOptimizer::update_staged(size_t i, int64_t next, double lr, double grad_scale,
                                  int64_t gen) {
  const Tensor g = staged_slot_.slice(0, ranges_[i].numel);
  staged_copies_->to_host(g.data, staged_src_[i].data, g.bytes());
  staged_copies_->host_wait(staged_copies_->fence());
  {
    std::lock_guard<std::mutex> lock(mu_);
    staged_read_gen_[i] = gen;
  }
  cv_.notify_all();
  update_range(i, next, g, g, lr, grad_scale);  // the new parameters overwrite the gradient
  staged_.write(i, g.data, g.numel());
}

void HostOptimizer::release_device_gradients() {
  // A copy still reading a device gradient would otherwise see the next step's zeros (the copy
  // stream runs beside the compute stream): a redone update's copies, issued at the end of the
  // step, are the ones that can still be in flight.
  if (last_grad_copy_ == 0) return;
  to_host_->compute_waits(last_grad_copy_);
  last_grad_copy_ = 0;
}

bool HostOptimizer::ready(size_t i) const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_gen_[i] >= wanted_gen_[i];
}

void HostOptimizer::wait_staged_reads() {
  if (staged_.ranges.empty()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    if (failure_) return true;
    for (size_t i = 0; i < ranges_.size(); ++i)
      if (staged(i) && adam_[i] && staged_read_gen_[i] < wanted_gen_[i]) return false;
    return true;
  });
  rethrow_failure();
}

void HostOptimizer::apply_in_flight() {
  if (!in_flight_.active) return;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      if (failure_) return true;
      for (size_t i : in_flight_.order)
        if (done_gen_[i] < in_flight_.gen) return false;
      return true;
    });
    rethrow_failure();
  }
  // The device finished reading the old parameters (the step just computed) before they change.
  to_device_->after_compute();
  for (size_t i : in_flight_.order) {
    uint64_t fence = 0;
    if (adam_[i]) {
      const Tensor src = gradient_home(i, in_flight_.buffer);
      to_device_->to_device(in_flight_.targets[i].data, src.data, src.bytes());
      fence = to_device_->fence();
    }
    std::lock_guard<std::mutex> lock(mu_);
    ready_gen_[i] = in_flight_.gen;
    ready_fence_[i] = fence;
    wanted_gen_[i] = in_flight_.gen;
  }
  in_flight_.active = false;
}

void HostOptimizer::step(double lr, double grad_scale, const std::vector<size_t>& order,
                         const std::vector<Tensor>& targets) {
  ST_ASSERT(order.size() == ranges_.size() && targets.size() == ranges_.size());
  rethrow_failure();
  const int buffer = delayed_ ? static_cast<int>(step_ % 2) : 0;
  const int64_t gen = ++gen_;
  // Steps 1 and 2 are exact in delayed mode: step 1's update is applied at once, step 2's is
  // the first one held back.
  const bool hold_back = delayed_ && step_ >= 1;
  ++step_;
  if (spec_.active) {
    step_speculated(lr, grad_scale, order, targets, gen);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    acc_seconds_ = 0;
  }
  if (!hold_back) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i : order) wanted_gen_[i] = gen;
    }
    // Parameters land on the device in copies queued by the worker; they replace what the
    // compute stream has been reading, so the copies wait for it.
    to_device_->after_compute();
    queue_update(lr, grad_scale, order, targets, buffer, gen, true);
    return;
  }
  apply_in_flight();
  queue_update(lr, grad_scale, order, targets, buffer, gen, false);
  in_flight_ = InFlight{true, order, targets, buffer, gen};
}

void HostOptimizer::step_speculated(double lr, double grad_scale, const std::vector<size_t>& order,
                                    const std::vector<Tensor>& targets, int64_t gen) {
  spec_.active = false;
  // Validation: the update speculated is the one asked for, or the speculated ranges are
  // rolled back and redone with the values asked for (their gradients copied again).
  const bool confirmed = lr == spec_.lr && grad_scale == spec_.grad_scale;
  const bool any = std::find(spec_.posted.begin(), spec_.posted.end(), true) != spec_.posted.end();
  std::vector<uint64_t> fences;
  if (!confirmed && any) {
    ++rolled_back_;
    fences = recopy_speculated_gradients();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i : order) wanted_gen_[i] = confirmed && spec_.posted[i] ? spec_.gen : gen;
  }
  to_device_->after_compute();
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    if (spec_.posted[i]) {
      if (!confirmed)
        post_update(i, -1, lr, grad_scale, targets[i], 0, gen, true, fences[i],
                    Undo{spec_.lr, spec_.grad_scale});
      continue;
    }
    post_update(i, next_on_nvme(order, k), lr, grad_scale, targets[i], 0, gen, true,
                grad_fence_[i]);
  }
}

void HostOptimizer::set_trace(StepTrace* trace) {
  if (!trace) wait_all();  // no task records into the trace after this
  trace_ = trace;
}

void HostOptimizer::wait_part(size_t i) {
  uint64_t fence = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return failure_ || ready_gen_[i] >= wanted_gen_[i]; });
    rethrow_failure();
    fence = ready_fence_[i];
  }
  if (fence) to_device_->compute_waits(fence);
}

void HostOptimizer::wait_all() {
  apply_in_flight();  // delayed mode: a checkpoint or state read flushes the held-back update
  for (size_t i = 0; i < ranges_.size(); ++i) wait_part(i);
  uint64_t last = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint64_t f : ready_fence_) last = std::max(last, f);
  }
  if (last) to_device_->host_wait(last);
}

int HostOptimizer::quantity(StateTensor q) {
  return q == StateTensor::kParams ? 0 : q == StateTensor::kExpAvg ? 1 : 2;
}

Tensor HostOptimizer::state_slice(int k, int64_t offset, int64_t numel) {
  return host_slice(state_[k].data(), dtype_of(k), in_memory_, offset, numel);
}

void HostOptimizer::read_state(StateTensor q, size_t i, int64_t offset, int64_t numel, float* dst) {
  ST_ASSERT(offset >= 0 && offset + numel <= ranges_[i].numel);
  ST_ASSERT(q != StateTensor::kExpAvgSq || kind_ == OptimizerKind::kAdamW);  // SGD: no v
  const int k = quantity(q);
  if (!on_nvme(i)) {
    to_f32(state_slice(k, state_offset_[i] + offset, numel).data, dtype_of(k), numel, dst);
    return;
  }
  swap_->wait_all();
  AlignedHostBuffer tmp(quantity_bytes(i, k));
  swap_->wait(swap_->read_async(region_[i] + quantity_offset(i, k), tmp.data(), tmp.bytes()));
  const size_t esize = dtype_size(dtype_of(k));
  to_f32(static_cast<const char*>(tmp.data()) + static_cast<size_t>(offset) * esize, dtype_of(k),
         numel, dst);
}

void HostOptimizer::write_state(StateTensor q, size_t i, int64_t offset, int64_t numel,
                                const float* src) {
  ST_ASSERT(offset >= 0 && offset + numel <= ranges_[i].numel);
  ST_ASSERT(q != StateTensor::kExpAvgSq || kind_ == OptimizerKind::kAdamW);  // SGD: no v
  const int k = quantity(q);
  if (!on_nvme(i)) {
    from_f32(src, numel, dtype_of(k), state_slice(k, state_offset_[i] + offset, numel).data);
    return;
  }
  swap_->wait_all();
  for (Slot& sl : slots_) sl.range = -1;  // staged copies are stale now
  AlignedHostBuffer tmp(quantity_bytes(i, k));
  const int64_t at = region_[i] + quantity_offset(i, k);
  swap_->wait(swap_->read_async(at, tmp.data(), tmp.bytes()));
  const size_t esize = dtype_size(dtype_of(k));
  from_f32(src, numel, dtype_of(k),
           static_cast<char*>(tmp.data()) + static_cast<size_t>(offset) * esize);
  swap_->wait(swap_->write_async(at, tmp.data(), tmp.bytes()));
}

size_t HostOptimizer::pageable_bytes() const {
  size_t b = 0;
  for (const AlignedHostBuffer& s : state_) b += static_cast<size_t>(s.bytes());
  for (const Slot& sl : slots_) b += static_cast<size_t>(sl.buf.bytes());
  return b;
}

int64_t HostOptimizer::step_count() const {
  for (const auto& a : adam_)
    if (a) return a->step_count();
  return 0;
}

void HostOptimizer::set_step_count(int64_t t) {
  for (auto& a : adam_)
    if (a) a->set_step_count(t);
}

double HostOptimizer::last_step_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_seconds_;
}

size_t HostOptimizer::pinned_bytes() const {
  return grads_[0].bytes() + grads_[1].bytes() + staged_slot_.bytes();
}

}  // namespace shardtrain
