// Strategy: how parameters, gradients and optimizer state are placed and kept consistent across
// data-parallel ranks. A strategy owns the flat buffers, binds the model to them, watches the
// model through LayerHooks (to overlap gradient reduction with backward, or to gather a layer's
// parameters before it runs) and performs the optimizer step on what its rank owns. The model
// never knows which strategy runs it (torchtitan's habit: parallelism applied to a plain model).
//
// Strategies: dp (parallel/data_parallel.cpp), zero1 and zero2 (parallel/zero.cpp), zero3
// (parallel/zero3.cpp), each optionally with its optimizer offloaded to the host
// (parallel/offload/host_optimizer.h); pipeline (parallel/pipeline/pipeline_parallel.h) runs one of
// those across the replicas of each stage.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "model/gpt2.h"
#include "monitor/step_trace.h"
#include "optim/adamw.h"

namespace shardtrain {

/// What a strategy is told (not the whole TrainConfig): its plan, the optimizer (AdamW or SGD)
/// and its hyper-parameters, and the sections of the configuration it reads as they are —
/// zero_optimization (buckets, overlap, stage 3's limits, offload, hybrid sharding; ZeroConfig
/// documents each key) and aio. The plan is `plan`: a strategy never reads zero.stage or the
/// offload devices of `zero`, which validate() resolved into it.
struct StrategyOptions {
  ParallelPlan plan;
  OptimizerHyper optimizer;
  ZeroConfig zero;
  /// NVMe offload: DeepSpeed's aio settings of the swap files (under zero.nvme_path).
  AioConfig aio;
  /// dp across nodes: > 0 sums gradients hierarchically over nodes of this many consecutive
  /// ranks (parallel/hierarchical_reduction.h); 0: one all-reduce over all ranks.
  int hierarchical_ranks_per_node = 0;

  /// The host-stepped AdamW moments' dtype: kF32, or kBF16 (zero.offload_moments_dtype "bf16").
  DType moment_dtype() const {
    return zero.offload_moments_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  }
};

/// Host memory a rank holds for offloaded state (bytes).
struct HostMemory {
  size_t pinned = 0;    ///< page-locked transfer buffers (gradients, offloaded parameters)
  size_t pageable = 0;  ///< fp32 master weights and AdamW moments stepped on the CPU
  size_t nvme = 0;      ///< bytes of the swap file under nvme_path
};

/// One of the fp32 quantities a checkpoint holds per element of the flat layout.
enum class StateTensor { kParams, kExpAvg, kExpAvgSq };

/// The elements [offset, offset + numel) of the flat layout.
struct FlatRange {
  int64_t offset = 0;
  int64_t numel = 0;
};

/// Host copies of the full training state, in the flat layout (numel = layout.numel()).
struct FullState {
  std::vector<float> params;      ///< fp32 master weights
  std::vector<float> exp_avg;     ///< AdamW m, or SGD's momentum buffer
  std::vector<float> exp_avg_sq;  ///< AdamW v; empty for SGD
  int64_t optimizer_steps = 0;
  OptimizerKind optimizer = OptimizerKind::kAdamW;  ///< whose state exp_avg/exp_avg_sq hold
};

class Strategy : public LayerHooks {
 public:
  ~Strategy() override = default;
  virtual std::string name() const = 0;

  /// Allocates the buffers this rank holds, binds `model` to them and loads `init_params`
  /// (host fp32, layout.numel() elements, identical on every rank), or leaves every parameter 0
  /// when `init_params` is empty (a checkpoint is loaded next: no rank then holds a full copy).
  virtual void setup(Model& model, const std::vector<float>& init_params) = 0;
  /// Writes the initial fp32 parameters of flat elements [offset, offset + numel) into
  /// out[0, numel) (e.g. init_layout_range).
  using ParameterSource = std::function<void(int64_t offset, int64_t numel, float* out)>;
  /// setup() with the parameters drawn range by range from `source`: the ZeRO strategies ask
  /// only for what this rank owns, in pieces, so no rank holds the whole model on the host
  /// (a 12B model's fp32 copy is 49 GB). This default draws the whole model and calls setup().
  virtual void setup_from(Model& model, const ParameterSource& source);
  /// Starts an optimizer step: zeroes the gradients this rank accumulates into.
  virtual void zero_grad() = 0;
  /// Declares which micro-batch of the accumulation window runs next (0-based of `count`):
  /// gradient communication happens during the last one's backward.
  virtual void begin_micro_step(int64_t index, int64_t count) = 0;
  /// Waits for the gradient reductions of the last micro-step. After it, the gradients this
  /// rank owns hold the SUM over ranks and micro-steps of ∂(mean loss per micro-batch)/∂θ.
  virtual void finish_gradients() = 0;
  /// Global L2 norm of the gradients as they stand (after finish_gradients), times `scale`.
  virtual double grad_norm(double scale) = 0;
  /// The optimizer (AdamW or SGD) on this rank's part with gradients multiplied by `grad_scale`,
  /// then makes the updated parameters visible to the model on every rank.
  virtual void step(double lr, double grad_scale) = 0;

  /// Whether the model may run a step's first forwards layer-major (Model::forward_layer_major):
  /// this strategy's hooks act per layer, not per micro-batch, in forward.
  virtual bool allows_layer_major_forward() const { return false; }
  /// Whether the model may run a whole step's backward layer-major
  /// (Model::head_and_backward_layer_major) as one last micro-step: the hooks act per layer in
  /// backward, and a layer's gradient is final at its after_backward of the last micro-step.
  virtual bool allows_layer_major_backward() const { return false; }

  /// Told before the last micro-step's backward: step() will most likely be called with `lr`
  /// and `grad_scale` (the mean-gradient scale, no clipping). A strategy whose optimizer runs on
  /// the host may start each part's update as soon as its gradient is final, during backward,
  /// and redo the parts in step() if it is called with other values (the norm called for
  /// clipping): speculation then validation (SuperOffload, Lian et al., arXiv 2509.21271, §4.3).
  /// The default ignores it.
  virtual void expect_update(double /*lr*/, double /*grad_scale*/) {}
  /// step() will not be called this step (an fp16 overflow skipped it, or the gradients are
  /// not finite): undoes what expect_update started. The default does nothing.
  virtual void cancel_expected_update() {}
  /// Steps whose update expect_update started had to be rolled back (and redone), so far.
  virtual int64_t rolled_back_updates() const { return 0; }
  /// Records what the strategy's host side does (copies, the host optimizer, the disk) into
  /// `trace` (monitor/step_trace.h) from now on; nullptr stops, after waiting for the host work
  /// recorded so far. The default records nothing.
  virtual void set_trace(StepTrace* /*trace*/) {}

  /// Collects the full state on every rank (collective: every rank must call it).
  virtual FullState gather_state() = 0;
  /// Loads a full state (host, every rank passes the same) into this rank's buffers.
  virtual void load_state(const FullState& state) = 0;

  /// Bytes of parameters, gradients and optimizer state this rank holds.
  virtual size_t model_state_bytes() const = 0;

  // ---- sharded checkpoints (checkpoint/sharded_checkpoint.h): no rank materializes the full state
  // ----

  /// The flat-layout ranges whose state this rank writes into a checkpoint: ascending, disjoint,
  /// and over all ranks of the group they cover [0, layout.numel()) exactly once (ZeRO: the owned
  /// slices; replicated strategies: an even split).
  virtual std::vector<FlatRange> save_ranges() const = 0;
  /// Copies quantity `q` of the flat elements [offset, offset + numel), which lie inside one
  /// range of save_ranges(), to `host` (fp32). Not collective.
  virtual void read_state(StateTensor q, int64_t offset, int64_t numel, float* host) = 0;
  /// The flat-layout ranges this rank needs on load (ZeRO: its owned slices; replicated
  /// strategies: everything), ascending and disjoint.
  virtual std::vector<FlatRange> load_ranges() const = 0;
  /// Sets quantity `q` of the flat elements [offset, offset + numel), which lie inside one range
  /// of load_ranges(), from `host` (fp32). Not collective.
  virtual void write_state(StateTensor q, int64_t offset, int64_t numel, const float* host) = 0;
  /// After every write_state of a load: makes the parameters visible to the model (compute-dtype
  /// copies, all-gathers) and sets AdamW's step count. Collective.
  virtual void finish_load(int64_t optimizer_steps) = 0;
  /// Optimizer steps taken (AdamW's bias correction, SGD's first step), as saved in checkpoints.
  virtual int64_t optimizer_steps() const = 0;
  /// The optimizer this strategy steps with (AdamW: exp_avg and exp_avg_sq; SGD: exp_avg only,
  /// kExpAvgSq must not be read or written).
  virtual OptimizerKind optimizer_kind() const = 0;

  /// Bytes of parameters all-gathered by this rank during the last optimizer step (ZeRO-3's
  /// per-layer gathers and every strategy's after-step all-gathers); 0 for dp.
  virtual int64_t gathered_bytes_last_step() const { return 0; }
  /// Bytes of the buffers this rank all-reduced across nodes during the last optimizer step, for
  /// the strategies that know which of their collectives cross nodes (dp's hierarchical
  /// all-reduce, zero3's hybrid sharding); 0 otherwise.
  virtual int64_t cross_node_bytes_last_step() const { return 0; }
  /// The most bytes this rank has held at once, since setup, in buffers that exist only while
  /// a layer runs: ZeRO-3's gathered parameters and per-layer gradient buffers; 0 for others.
  virtual size_t peak_transient_bytes() const { return 0; }
  /// Host memory held for offloaded state (zero without offload).
  virtual HostMemory host_memory() const { return {}; }
  /// Host seconds of the last completed CPU optimizer step (0 without offload).
  virtual double host_step_seconds() const { return 0; }
  /// The whole buffer of compute-dtype parameters the model is bound to, when this rank holds
  /// all of them (dp, zero1, zero2; current: waits as wait_for_parameters()); empty otherwise
  /// (zero3). PipeDream-2BW versions it.
  virtual Tensor compute_parameters() { return {}; }
  /// Orders work enqueued after this call after the arrival of the parameters the last step()
  /// updated. zero1/zero2 all-gather them overlapped with the next forward, whose before_forward
  /// hooks wait layer by layer; whoever reads parameters outside a forward calls this first.
  virtual void wait_for_parameters() {}
};

/// Builds the strategy that runs `options.plan` (zero stage 0: dp, 1/2: zero.h, 3: zero3.h;
/// each with the optimizer, and at stage 3 the parameters, offloaded as the plan says). Throws
/// ConfigError for a plan it cannot run (offload below stage 1, a bad offload ratio, SGD with
/// NVMe) or of several pipeline stages (make_pipeline_strategy's).
std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options, Backend& backend,
                                        Communicator& comm);

/// Throws CheckpointError when optimizer state saved by `saved` is loaded into a run of
/// `configured` (AdamW's m/v cannot seed SGD's momentum buffer, nor the reverse).
void check_state_kind(OptimizerKind saved, OptimizerKind configured);

/// [0, numel) split into `world` contiguous pieces of equal size (the first numel % world one
/// element longer): piece `rank` (empty when numel < world). What replicated strategies save.
std::vector<FlatRange> even_split(int64_t numel, int world, int rank);

}  // namespace shardtrain
