// The optimizer over one contiguous range of the flat buffers (the whole model, or a ZeRO shard):
//
//  * AdamW: Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (arXiv 1711.05101),
//    Algorithm 2, with Adam's bias correction (Kingma & Ba, arXiv 1412.6980, Algorithm 1);
//    state exp_avg (m) and exp_avg_sq (v), fp32.
//  * SGD: torch.optim.SGD with dampening 0 (PyTorch docs), momentum and Nesterov momentum
//    (Sutskever et al., ICML 2013) and coupled L2 weight decay (Backend::sgd); state the momentum
//    buffer in the exp_avg slot, fp32; exp_avg_sq is not allocated (numel 0).
//
// Weight decay applies to the tensors the layout marks (2-D weights), not to biases or LayerNorm
// parameters.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "config/config.h"
#include "memory/flat_buffer.h"
#include "memory/param_layout.h"

namespace shardtrain {

/// The optimizer's hyper-parameters: which update, and its constants (the others are unused).
struct OptimizerHyper {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  ///< AdamW
  double weight_decay = 0.01;  ///< AdamW: decoupled; SGD: coupled L2 (g += wd·p)
  OptimizerKind kind = OptimizerKind::kAdamW;
  double momentum = 0.0;  ///< SGD μ (0: plain SGD; the buffer is kept but not used)
  bool nesterov = false;  ///< SGD Nesterov momentum (needs μ > 0)

  /// Elements of exp_avg_sq per element of the range: 1 for AdamW, 0 for SGD.
  int64_t second_moment_numel(int64_t numel) const {
    return kind == OptimizerKind::kAdamW ? numel : 0;
  }
};
/// The name the strategies and host optimizer have always used.
using AdamWHyper = OptimizerHyper;

/// AdamW or SGD (hyper.kind) over a range of the flat layout. The historical name AdamW is kept
/// as an alias (below): the class holds AdamW's m/v or SGD's momentum buffer in the same slots.
class Optimizer {
 public:
  /// Optimizer state for elements [offset, offset + numel) of the flat layout, fp32, allocated
  /// on `backend`: exp_avg [numel] (AdamW m, SGD momentum buffer) and exp_avg_sq
  /// [hyper.second_moment_numel(numel)] (AdamW v; none for SGD). The fp32 master weights are
  /// owned by the caller (they alias the parameters when those are fp32).
  Optimizer(Backend& backend, const ParamLayout& layout, int64_t offset, int64_t numel,
            OptimizerHyper hyper);
  /// The same over caller-owned state: `exp_avg` fp32 [numel] and `exp_avg_sq` fp32
  /// [hyper.second_moment_numel(numel)] (zeroed), e.g. slices of one buffer shared by the
  /// optimizers of several ZeRO slices (one allocation instead of one per slice, each rounded up
  /// by the device allocator). Tensors of shape [numel] without data: no state is kept; every
  /// step_on_host is given it (NVMe paging, AdamW only).
  Optimizer(Backend& backend, const ParamLayout& layout, int64_t offset, int64_t numel,
            OptimizerHyper hyper, Tensor exp_avg, Tensor exp_avg_sq);

  /// One update: master [numel] fp32, grads [numel] (grad dtype); `grad_scale` multiplies the
  /// gradients first (gradient averaging, clipping and loss-scale removal folded into one
  /// factor). `params_out`, when non-empty, receives the updated weights in its dtype.
  void step(Tensor master, Tensor grads, Tensor params_out, double lr, double grad_scale);

  /// The same update over host memory with the CPU AdamW / SGD (optim/cpu_adamw.h: threaded,
  /// fused with the conversions): master fp32, grads bf16/fp16/fp32, params_out (may be empty) in
  /// its dtype, all host tensors [numel]. m and v are the object's own state unless `exp_avg` /
  /// `exp_avg_sq` are given (host fp32 [numel]: state paged in from NVMe). Moments in bf16 (host
  /// tensors, AdamW) are stepped by cpu_adamw_bf16_moments, rounded stochastically with the
  /// bits of (flat index, step).
  void step_on_host(Tensor master, Tensor grads, Tensor params_out, double lr, double grad_scale,
                    Tensor exp_avg = {}, Tensor exp_avg_sq = {});

  /// Undoes the last step_on_host (AdamW only) given the same grads, lr and grad_scale: restores
  /// master, m and v to fp32 rounding (cpu_adamw_undo) and the step count. `exp_avg` /
  /// `exp_avg_sq` as for step_on_host.
  void undo_on_host(Tensor master, Tensor grads, double lr, double grad_scale, Tensor exp_avg = {},
                    Tensor exp_avg_sq = {});

  int64_t step_count() const { return t_; }
  void set_step_count(int64_t t) { t_ = t; }
  /// m (AdamW) or the momentum buffer (SGD), fp32 [numel]; v, fp32 [numel] (AdamW) or
  /// [0] (SGD).
  const Tensor& exp_avg() const { return m_; }
  const Tensor& exp_avg_sq() const { return v_; }
  int64_t offset() const { return offset_; }
  int64_t numel() const { return numel_; }
  const OptimizerHyper& hyper() const { return hyper_; }
  OptimizerKind kind() const { return hyper_.kind; }

 private:
  /// A run of equal weight decay, [begin, begin + count) relative to offset_ (as
  /// Backend::adamw_runs takes it).
  using Segment = Backend::AdamWRun;
  /// Counts the step and returns its arguments (weight decay set per segment by the caller).
  Backend::AdamWArgs next_args(double lr, double grad_scale);
  /// The arguments of step t (1-based) without counting it.
  Backend::AdamWArgs args_at(int64_t t, double lr, double grad_scale) const;
  /// SGD's arguments for the step just counted (t_ already incremented).
  Backend::SgdArgs sgd_args(double lr, double grad_scale) const;

  Backend& backend_;
  int64_t offset_, numel_;
  OptimizerHyper hyper_;
  std::vector<Segment> segments_;
  FlatBuffer owned_m_, owned_v_;  ///< empty when the caller owns the state
  Tensor m_, v_;
  int64_t t_ = 0;
};
using AdamW = Optimizer;

/// Learning rate at optimizer step `step` (0-based): linear warmup over `warmup` steps from
/// warmup_min_ratio·lr towards lr (step s gets the value at (s+1)/warmup of the way, so step
/// warmup-1 reaches lr), then constant, linear or cosine decay to min_ratio·lr at `total` steps
/// (cosine: Loshchilov & Hutter, SGDR, arXiv 1608.03983, eq. 5).
double learning_rate(int64_t step, double lr, int64_t warmup, int64_t total, LrSchedule schedule,
                     double min_ratio, double warmup_min_ratio = 0.0);

}  // namespace shardtrain
