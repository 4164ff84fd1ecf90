#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "config/config.h"
#include "core/error.h"
#include "optim/cpu_adamw.h"

namespace shardtrain {

Optimizer::Optimizer(Backend& backend, const ParamLayout& layout, int64_t offset, int64_t numel,
                     OptimizerHyper hyper)
    : Optimizer(backend, layout, offset, numel, hyper, Tensor(), Tensor()) {}

Optimizer::Optimizer(Backend& backend, const ParamLayout& layout, int64_t offset, int64_t numel,
                     OptimizerHyper hyper, Tensor exp_avg, Tensor exp_avg_sq)
    : backend_(backend), offset_(offset), numel_(numel), hyper_(hyper) {
  ST_ASSERT(!hyper_.nesterov || hyper_.momentum > 0.0);
  // A tensor with a shape but no data: the caller hands the state to each step_on_host.
  if (exp_avg.empty() && exp_avg.ndim == 0) {
    owned_m_ = FlatBuffer(backend, DType::kF32, numel);
    owned_v_ = FlatBuffer(backend, DType::kF32, hyper_.second_moment_numel(numel));
    exp_avg = owned_m_.view();
    exp_avg_sq = owned_v_.view();
  }
  // bf16 moments: host state of the CPU AdamW only (step_on_host).
  const bool host_bf16 = exp_avg.dtype == DType::kBF16 && exp_avg_sq.dtype == DType::kBF16 &&
                         exp_avg.device == DeviceKind::kCPU && hyper_.kind == OptimizerKind::kAdamW;
  ST_ASSERT(exp_avg.numel() == numel && exp_avg_sq.numel() == hyper_.second_moment_numel(numel) &&
            ((exp_avg.dtype == DType::kF32 && exp_avg_sq.dtype == DType::kF32) || host_bf16));
  m_ = exp_avg;
  v_ = exp_avg_sq;
  // Cut [offset, offset+numel) into runs of equal decay; padding between tensors is "no decay"
  // (it is zero and stays zero either way).
  const int64_t end = offset + numel;
  int64_t pos = offset;
  auto push = [&](int64_t b, int64_t e, bool decay) {
    if (e <= b) return;
    if (!segments_.empty() && segments_.back().decay == decay &&
        segments_.back().begin + segments_.back().count == b - offset)
      segments_.back().count += e - b;
    else
      segments_.push_back({b - offset, e - b, decay});
  };
  for (const ParamTensor* t : layout.tensors()) {
    const int64_t b = std::max(t->offset, offset), e = std::min(t->offset + t->numel, end);
    if (e <= b) continue;
    push(pos, b, false);
    push(b, e, t->weight_decay);
    pos = e;
  }
  push(pos, end, false);
}

Backend::AdamWArgs Optimizer::next_args(double lr, double grad_scale) {
  ++t_;
  return args_at(t_, lr, grad_scale);
}

Backend::AdamWArgs Optimizer::args_at(int64_t t, double lr, double grad_scale) const {
  Backend::AdamWArgs a{};
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(hyper_.beta1);
  a.beta2 = static_cast<float>(hyper_.beta2);
  a.eps = static_cast<float>(hyper_.eps);
  a.grad_scale = static_cast<float>(grad_scale);
  a.bias_correction1 = static_cast<float>(1.0 - std::pow(hyper_.beta1, static_cast<double>(t)));
  a.bias_correction2 = static_cast<float>(1.0 - std::pow(hyper_.beta2, static_cast<double>(t)));
  return a;
}

Backend::SgdArgs Optimizer::sgd_args(double lr, double grad_scale) const {
  Backend::SgdArgs a{};
  a.lr = static_cast<float>(lr);
  a.momentum = static_cast<float>(hyper_.momentum);
  a.grad_scale = static_cast<float>(grad_scale);
  a.nesterov = hyper_.nesterov;
  a.first_step = t_ == 1;  // torch.optim.SGD: buf = g on the first step
  return a;
}

void Optimizer::step(Tensor master, Tensor grads, Tensor params_out, double lr, double grad_scale) {
  auto part = [&](const Tensor& t, const Segment& s) {
    return t.empty() ? Tensor() : t.slice1d(s.begin, s.count);
  };
  if (hyper_.kind == OptimizerKind::kSGD) {
    next_args(lr, grad_scale);  // counts the step
    Backend::SgdArgs a = sgd_args(lr, grad_scale);
    for (const Segment& s : segments_) {
      a.weight_decay = s.decay ? static_cast<float>(hyper_.weight_decay) : 0.0f;
      backend_.sgd(part(master, s), part(grads, s), part(m_, s), part(params_out, s), a);
    }
    return;
  }
  Backend::AdamWArgs a = next_args(lr, grad_scale);
  a.weight_decay = static_cast<float>(hyper_.weight_decay);
  backend_.adamw_runs(master, grads, m_, v_, params_out, segments_, a);
}

void Optimizer::step_on_host(Tensor master, Tensor grads, Tensor params_out, double lr,
                             double grad_scale, Tensor exp_avg, Tensor exp_avg_sq) {
  if (exp_avg.empty()) {
    exp_avg = m_;
    exp_avg_sq = v_;
  }
  ST_ASSERT(master.device == DeviceKind::kCPU && grads.device == DeviceKind::kCPU &&
            exp_avg.device == DeviceKind::kCPU && master.numel() == numel_ &&
            grads.numel() == numel_ && exp_avg.numel() == numel_);
  if (hyper_.kind == OptimizerKind::kSGD) {
    next_args(lr, grad_scale);  // counts the step
    Backend::SgdArgs a = sgd_args(lr, grad_scale);
    for (const Segment& s : segments_) {
      a.weight_decay = s.decay ? static_cast<float>(hyper_.weight_decay) : 0.0f;
      const size_t gsz = dtype_size(grads.dtype);
      void* out = params_out.empty() ? nullptr
                                     : static_cast<char*>(params_out.data) +
                                           s.begin * dtype_size(params_out.dtype);
      cpu_sgd(master.f32() + s.begin, static_cast<const char*>(grads.data) + s.begin * gsz,
              grads.dtype, exp_avg.f32() + s.begin, out,
              params_out.empty() ? DType::kF32 : params_out.dtype, s.count, a);
    }
    return;
  }
  static const CpuSimd simd = best_cpu_simd();
  Backend::AdamWArgs a = next_args(lr, grad_scale);
  for (const Segment& s : segments_) {
    a.weight_decay = s.decay ? static_cast<float>(hyper_.weight_decay) : 0.0f;
    const size_t gsz = dtype_size(grads.dtype);
    void* out = params_out.empty()
                    ? nullptr
                    : static_cast<char*>(params_out.data) + s.begin * dtype_size(params_out.dtype);
    const void* g = static_cast<const char*>(grads.data) + s.begin * gsz;
    const DType odt = params_out.empty() ? DType::kF32 : params_out.dtype;
    if (exp_avg.dtype == DType::kBF16) {
      ST_ASSERT(exp_avg_sq.dtype == DType::kBF16);
      const StochasticRounding sr{static_cast<uint64_t>(offset_ + s.begin),
                                  static_cast<uint32_t>(t_)};
      cpu_adamw_bf16_moments(
          master.f32() + s.begin, g, grads.dtype, static_cast<uint16_t*>(exp_avg.data) + s.begin,
          static_cast<uint16_t*>(exp_avg_sq.data) + s.begin, out, odt, s.count, a, sr, simd);
    } else {
      cpu_adamw(master.f32() + s.begin, g, grads.dtype, exp_avg.f32() + s.begin,
                exp_avg_sq.f32() + s.begin, out, odt, s.count, a, simd);
    }
  }
}

void Optimizer::undo_on_host(Tensor master, Tensor grads, double lr, double grad_scale,
                             Tensor exp_avg, Tensor exp_avg_sq) {
  if (exp_avg.empty()) {
    exp_avg = m_;
    exp_avg_sq = v_;
  }
  ST_ASSERT(hyper_.kind == OptimizerKind::kAdamW && t_ >= 1);
  ST_ASSERT(master.device == DeviceKind::kCPU && grads.device == DeviceKind::kCPU &&
            exp_avg.device == DeviceKind::kCPU && master.numel() == numel_ &&
            grads.numel() == numel_ && exp_avg.numel() == numel_);
  Backend::AdamWArgs a = args_at(t_, lr, grad_scale);
  const size_t gsz = dtype_size(grads.dtype), msz = dtype_size(exp_avg.dtype);
  for (const Segment& s : segments_) {
    a.weight_decay = s.decay ? static_cast<float>(hyper_.weight_decay) : 0.0f;
    cpu_adamw_undo(master.f32() + s.begin, static_cast<const char*>(grads.data) + s.begin * gsz,
                   grads.dtype, static_cast<char*>(exp_avg.data) + s.begin * msz,
                   static_cast<char*>(exp_avg_sq.data) + s.begin * msz, exp_avg.dtype, s.count, a);
  }
  --t_;
}

double learning_rate(int64_t step, double lr, int64_t warmup, int64_t total, LrSchedule schedule,
                     double min_ratio, double warmup_min_ratio) {
  if (warmup > 0 && step < warmup) {
    const double frac = static_cast<double>(step + 1) / static_cast<double>(warmup);
    return lr * (warmup_min_ratio + (1.0 - warmup_min_ratio) * frac);
  }
  const LrSchedule kind = schedule;
  if (kind == LrSchedule::kConstant || total <= warmup) return lr;
  const double progress = std::clamp(
      static_cast<double>(step - warmup) / static_cast<double>(total - warmup), 0.0, 1.0);
  const double min_lr = lr * min_ratio;
  if (kind == LrSchedule::kLinear) return lr - (lr - min_lr) * progress;
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace shardtrain
