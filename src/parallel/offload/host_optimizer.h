// The host half of an offloaded optimizer (ZeRO-Offload: Ren et al., "ZeRO-Offload:
// Democratizing Billion-Scale Model Training", arXiv 2101.06840, §4): the fp32 master weights and
// AdamW moments of the elements a rank steps on the CPU, and the CPU step itself.
//
//   device grad (bf16) ──copy stream──▶ pinned grad buffer ──CPU AdamW (worker thread, OpenMP,
//   AVX-512/AVX2, fused bf16 in/out)──▶ pinned bf16 params (in place) ──copy stream──▶ device
//
// Ranges. The strategy hands over one flat-layout range per ZeRO part (its owned slice, or the
// offloaded tail of it when offload_optimizer.ratio < 1). Their gradients leave the device as soon
// as the strategy declares them final (gradient_ready: an async device → host copy on a copy stream
// of its own, ordered after the compute stream), during backward where the strategy can.
//
// Step. step() queues one update task per range on a worker thread, in the order given (the
// strategy passes forward order, so that the first layers of the next forward are updated first)
// and returns at once. Each task waits for its gradient copy, runs the CPU AdamW over the range —
// reading the bf16 gradients and writing the bf16 parameters into the same pinned buffer — and
// queues the host → device copy of the result. The strategy calls wait_part(i) before anything
// reads range i's parameters on the device (the next forward's layer, an all-gather): the host
// waits until the task has queued its copy, then the compute stream waits for the copy. The CPU
// step thus overlaps the start of the next forward, and the copies overlap both.
//
// Delayed update (opt-in, ZeRO-Offload §4.3 "one-step delayed parameter update", DPU): from the
// second step on, step(s) first applies update s−1 (which ran on the CPU while the GPU computed
// step s) and then starts update s, which the device sees only at step s+1. The device thus
// computes step s+1 on the parameters of step s−1: with W_s the master weights after s updates and
// g_s the gradient of step s, W_s = W_{s−1} − η·adamw(g_s) with g_s = ∇f(W_{s−2}) for s ≥ 3 (steps
// 1 and 2 are exact: g_1 = ∇f(W_0), g_2 = ∇f(W_1)). Gradients alternate between two pinned buffers
// so that step s+1's copies do not overwrite the gradients update s is reading.
//
// State lives in pageable host memory (fp32 master, m, v: 12 bytes per element; 8 with bf16
// moments, cpu_adamw_bf16_moments), or in a swap file on NVMe for the ranges beyond
// SwapOptions::max_in_cpu elements (ZeRO-Infinity). The pinned buffers hold 2 bytes (bf16/fp16)
// per element, twice in delayed mode.
//
// Speculative update (on by default; SuperOffload's speculation then validation, Lian et al.,
// arXiv 2509.21271, §4.3). The update of a step needs the global gradient norm (clipping), which
// is known only after the whole backward; so step() could start no part before backward ended,
// and a host AdamW longer than the next forward stays on the critical path. Told the likely
// update before the last micro-step (speculate(lr, grad_scale): the unclipped scale), the
// optimizer instead queues each range's update the moment its gradient is handed over
// (gradient_ready), during backward, in backward order; with a layer-major backward
// (Model::head_and_backward_layer_major) the first parts are final after a fraction of it, and
// the host step runs beside the rest. step() validates: called with the same lr and grad_scale
// (no clipping), the work is done — the same arithmetic, bit for bit; called with others, each
// speculated range is rolled back (Optimizer::undo_on_host: the update solved backwards, exact to
// fp32 rounding), its gradient copied again from the device (the update overwrote the pinned
// copy) and stepped with the right values. cancel_speculation() rolls back without a new step
// (a skipped step). Ranges on NVMe, staged ranges, gradients in the parameters' place and SGD are
// not speculated: they are queued by step() as before. Not with the delayed update.
//
// Gradients in the parameters' place. When a range's parameters live in host memory themselves
// (zero3's offload_param: `host_params`), its gradient is copied into them and the update reads
// it there and overwrites it with the new parameters: the parameters are not read between the
// end of backward and the update (the fp32 master weights are the truth), so the range needs no
// pinned gradient buffer, and offloading parameters and optimizer costs 2 bytes of pinned memory
// per element instead of 4. Not with the delayed update (the next forward reads the parameters
// while the gradients wait) or fp16 (a skipped step would leave gradients in the parameters).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "memory/host_buffer.h"
#include "memory/param_layout.h"
#include "monitor/step_trace.h"
#include "optim/adamw.h"
#include "parallel/offload/nvme_swap.h"
#include "parallel/strategy.h"

namespace shardtrain {

/// Where the host state of an offloaded optimizer is paged to NVMe (ZeRO-Infinity, Rajbhandari
/// et al., arXiv 2104.07857, §5): one swap file per rank under `dir`
/// (parallel/offload/nvme_swap.h).
struct SwapOptions {
  std::string dir;  ///< nvme_path
  int rank = 0;
  AioConfig aio;
  /// offload_optimizer.max_in_cpu: elements whose state stays in host memory (12 bytes each);
  /// ranges are kept in memory in order while they fit (first fit), the others go to the file.
  int64_t max_in_cpu = 0;
};

/// Ranges whose parameters are paged from NVMe (zero3's offload_param.max_in_cpu: param_swap.h).
/// Such a range has no host memory of its own: its gradient stays on the device until its update
/// task copies it into a staging buffer, and the task hands the new parameters to `write` instead
/// of a target. Not with the delayed update.
struct StagedParams {
  std::vector<bool> ranges;  ///< per range; empty: none
  /// Called on the worker thread with the range and its new parameters ([numel], param dtype);
  /// returns once they are stored.
  std::function<void(size_t range, const void* params, int64_t numel)> write;
};

class HostOptimizer {
 public:
  /// Host state for `ranges` (flat-layout element ranges, one per strategy part, any may be
  /// empty) with the optimizer of `hyper` (AdamW or SGD; weight decay masked by `layout`).
  /// Gradients arrive in `grad_dtype`; parameters return in `param_dtype` (the compute dtype).
  /// Throws RuntimeFailure when the host memory cannot be had (see Backend::allocate_pinned). With
  /// `swap` set, the fp32 master weights, m and v live in a swap file instead (read ahead of each
  /// range's CPU step, written behind it, three staging slots in host memory); ConfigError when
  /// swap->dir is missing, unwritable or too small. `host_params`: empty, or per range the
  /// range's parameters ([numel], param dtype) when they live in host memory — its gradient then
  /// lands there and step() must target them (see "Gradients in the parameters' place"); ignored
  /// with the delayed update or fp16. `moment_dtype`: kF32, or kBF16 (AdamW only: m and v in
  /// bf16, rounded stochastically; read_state/write_state still move fp32).
  HostOptimizer(Backend& backend, const ParamLayout& layout, std::vector<FlatRange> ranges,
                OptimizerHyper hyper, DType grad_dtype, DType param_dtype, bool delayed_update,
                const SwapOptions* swap = nullptr, std::vector<Tensor> host_params = {},
                StagedParams staged_params = {}, DType moment_dtype = DType::kF32);
  ~HostOptimizer();
  HostOptimizer(const HostOptimizer&) = delete;
  HostOptimizer& operator=(const HostOptimizer&) = delete;

  size_t num_parts() const { return ranges_.size(); }
  const FlatRange& range(size_t i) const { return ranges_[i]; }

  /// Range i's gradient of this step is final in `grad` (device, grad dtype, [range(i).numel])
  /// in compute-stream order: queues its copy to the host. At most once per range and step.
  void gradient_ready(size_t i, Tensor grad);
  /// Queues the update of every range with gradients × `grad_scale` at learning rate `lr`,
  /// ranges in `order` (each once); range i's new parameters go to `targets[i]` ([numel], param
  /// dtype): device memory (copied there), or host memory (written directly, e.g. parameters
  /// offloaded to pinned memory). Every range's gradient must have been handed over. Returns at
  /// once (delayed mode: after applying the previous update, see the file comment).
  void step(double lr, double grad_scale, const std::vector<size_t>& order,
            const std::vector<Tensor>& targets);
  /// Speculation (see the file comment): from now until step(), each speculable range's update
  /// with (lr, grad_scale) is queued as soon as its gradient is handed over, its new parameters
  /// going to `targets[i]` (device memory, as step()'s targets). Not in delayed mode.
  void speculate(double lr, double grad_scale, const std::vector<Tensor>& targets);
  /// Rolls back the speculated updates of this step (no step() follows). Blocks until they are
  /// done. Rethrows a worker failure.
  void cancel_speculation();
  /// Steps whose speculated updates were rolled back and redone (or cancelled), since set-up.
  int64_t rolled_back_steps() const { return rolled_back_; }
  /// Records the copies, the CPU AdamW of each range and the waits for NVMe into `trace` from
  /// now on (Strategy::set_trace); nullptr: waits for every queued update, then stops.
  void set_trace(StepTrace* trace);
  /// Blocks until range i's latest update has been queued for the device, then orders the
  /// compute stream after its copy. Rethrows a failure of the worker.
  void wait_part(size_t i);
  /// Whether range i's latest update is done (non-blocking; what wait_part waits for).
  bool ready(size_t i) const;
  /// Blocks until every staged range's gradient of the last step has been copied off the device
  /// (before anything overwrites the gradients there). Rethrows a worker failure.
  void wait_staged_reads();
  /// Makes the compute stream's next work wait until the device gradients handed over so far
  /// (gradient_ready, and those copied again for a redone update) are read off the device: call
  /// before anything overwrites them (the next step's zero_grad). The host does not wait.
  void release_device_gradients();
  bool staged(size_t i) const { return !staged_.ranges.empty() && staged_.ranges[i]; }
  /// Every queued update done and copied (waits on the host). Rethrows a worker failure.
  void wait_all();
  /// Blocks until no task is queued or running, dropping their errors: for the owner's destructor,
  /// before the memory the tasks write (the model's parameters) is freed. Never throws.
  void drain() noexcept;

  /// Copies quantity `q` of elements [offset, offset + numel) of range i to `dst` (fp32), or sets
  /// them from `src`; blocking (reads the swap file). Call wait_all() first.
  void read_state(StateTensor q, size_t i, int64_t offset, int64_t numel, float* dst);
  void write_state(StateTensor q, size_t i, int64_t offset, int64_t numel, const float* src);
  int64_t step_count() const;
  void set_step_count(int64_t t);
  bool delayed() const { return delayed_; }

  /// Host seconds the CPU AdamW took for the last completed step (all ranges), or 0 before one.
  double last_step_seconds() const;
  size_t pinned_bytes() const;
  size_t pageable_bytes() const;
  /// Bytes of the swap file (0 without NVMe).
  size_t nvme_bytes() const { return swap_ ? static_cast<size_t>(swap_->bytes()) : 0; }
  /// Whether range i's state lives in the swap file (false: host memory).
  bool on_nvme(size_t i) const { return !region_.empty() && region_[i] >= 0; }
  /// Whether range i's gradient lands in its host parameters (no pinned gradient buffer).
  bool gradient_in_params(size_t i) const { return !in_params_.empty() && !in_params_[i].empty(); }
  /// The swap file (null without NVMe), for its counters and whether it runs O_DIRECT.
  const SwapFile* swap_file() const { return swap_.get(); }

 private:
  void post(std::function<void()> task);
  void worker_loop();
  void rethrow_failure();
  /// The update of range i (worker thread): pages its state in when on NVMe, steps it, writes
  /// it behind; `next`: the next range on NVMe this generation updates (read ahead), or -1.
  void update_range(size_t i, int64_t next, const Tensor& grads, const Tensor& out, double lr,
                    double grad_scale);
  /// Queues the update tasks of generation `gen` on gradient buffer `buffer`; `to_device`:
  /// each task also queues the copy of its result to its device target and marks it ready.
  void queue_update(double lr, double grad_scale, const std::vector<size_t>& order,
                    const std::vector<Tensor>& targets, int buffer, int64_t gen, bool to_device);
  /// The first range after order[k] that is updated and whose state is on NVMe (read ahead while
  /// order[k] steps), or -1.
  int64_t next_on_nvme(const std::vector<size_t>& order, size_t k) const;
  /// What an update task first undoes: the speculated update with these values.
  struct Undo {
    double lr = 0, grad_scale = 0;
  };
  /// Queues range i's update task (see queue_update); `fence`: its gradient copy on to_host_;
  /// `undo`: roll the range's last update back first (after the gradient copy it was made with
  /// has been copied again).
  void post_update(size_t i, int64_t next, double lr, double grad_scale, const Tensor& target,
                   int buffer, int64_t gen, bool to_device, uint64_t fence,
                   std::optional<Undo> undo = std::nullopt);
  /// step() after speculate(): validates the speculated updates (see the file comment) and
  /// queues the rest, generation `gen`.
  void step_speculated(double lr, double grad_scale, const std::vector<size_t>& order,
                       const std::vector<Tensor>& targets, int64_t gen);
  /// Whether range i's update may be speculated (see the file comment).
  bool speculable(size_t i) const;
  /// Waits until every speculated range's update is done and its copy to the device has left
  /// the pinned buffer; then copies each one's gradient to the host again (blocking) and
  /// returns the fences per range (0: not speculated).
  std::vector<uint64_t> recopy_speculated_gradients();
  /// Delayed mode: waits for the update in flight and queues its copies to the device.
  void apply_in_flight();
  /// Range i's slice of pinned buffer `buf`.
  Tensor pinned(const PinnedBuffer& buf, size_t i) const;

  Backend& backend_;
  std::vector<FlatRange> ranges_;
  std::vector<int64_t> host_offset_;   ///< start of range i in the pinned gradient buffers
  std::vector<int64_t> state_offset_;  ///< start of range i in state_ (ranges in memory)
  std::vector<Tensor> in_params_;      ///< per range: its host parameters holding its gradient
  StagedParams staged_;
  std::vector<Tensor> staged_src_;             ///< per staged range: its device gradient this step
  std::vector<int64_t> staged_read_gen_;       ///< per range: generation whose gradient was read
  PinnedBuffer staged_slot_;                   ///< the staged range being updated (worker only)
  std::unique_ptr<CopyStream> staged_copies_;  ///< its device → host copies (worker only)
  /// The staged update of range i (worker thread): gradient off the device, step, write.
  void update_staged(size_t i, int64_t next, double lr, double grad_scale, int64_t gen);
  /// Where range i's gradient lands: its host parameters, or its slice of grads_[buffer].
  Tensor gradient_home(size_t i, int buffer) const;
  DType grad_dtype_, param_dtype_;
  bool delayed_;
  /// fp32 master weights, m and v [in_memory_] (state_[quantity(q)]) of the ranges in memory.
  AlignedHostBuffer state_[3];
  OptimizerKind kind_;        ///< AdamW or SGD (no v: state_[2] is empty)
  int64_t in_memory_ = 0;     ///< Σ numel of the ranges whose state is in memory
  int64_t pinned_total_ = 0;  ///< Σ numel of the ranges with a pinned gradient buffer
  static int quantity(StateTensor q);
  DType moment_dtype_ = DType::kF32;  ///< m and v: kF32 or kBF16
  DType dtype_of(int k) const { return k == 0 ? DType::kF32 : moment_dtype_; }
  /// Elements [offset, offset + numel) of state_[k] as a host tensor (dtype_of(k)).
  Tensor state_slice(int k, int64_t offset, int64_t numel);
  PinnedBuffer grads_[2];  ///< grad dtype [Σ numel]; [1] only in delayed mode
  std::vector<std::unique_ptr<Optimizer>> adam_;  ///< per range (null for empty ranges)

  // NVMe: range i's [master | m | v] at file offset region_[i] (-1: in memory), the master
  // qbytes_[i] long and each moment mbytes_[i] (4096-aligned); used by the worker thread only,
  // except in read_state / write_state.
  struct Slot {
    AlignedHostBuffer buf;  ///< 3 quantities of the largest range
    int range = -1;         ///< range held (read issued), or -1
    SwapTicket read, write;
  };
  /// The slot holding range i with its read complete (reads it, evicting the oldest other slot).
  Slot& page_in(size_t i, const Slot* keep);
  /// Starts reading range i into a slot other than `keep` unless it is held already.
  void prefetch(size_t i, const Slot* keep);
  Slot& victim(const Slot* keep);
  std::unique_ptr<SwapFile> swap_;
  std::vector<int64_t> region_, qbytes_, mbytes_;
  /// Where quantity k of range i starts in its region, and its bytes there.
  int64_t quantity_offset(size_t i, int k) const {
    return k == 0 ? 0 : qbytes_[i] + (k - 1) * mbytes_[i];
  }
  int64_t quantity_bytes(size_t i, int k) const { return k == 0 ? qbytes_[i] : mbytes_[i]; }
  int64_t region_bytes(size_t i) const { return qbytes_[i] + 2 * mbytes_[i]; }
  std::vector<Slot> slots_;
  size_t next_victim_ = 0;
  std::unique_ptr<CopyStream> to_host_, to_device_;

  int64_t step_ = 0;                  ///< step() calls so far (chooses the gradient buffer)
  std::vector<uint64_t> grad_fence_;  ///< per range: its gradient copy of this step
  /// The latest device → host gradient copy not yet known read before the gradients change
  /// (release_device_gradients; caller's thread only).
  uint64_t last_grad_copy_ = 0;

  // Worker state (guarded by mu_).
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  bool busy_ = false;  ///< the worker is running a task
  std::exception_ptr failure_;
  /// Per range: update generation queued for the device (and its copy fence); the strategy waits
  /// for `wanted_` (the generation the device must see).
  std::vector<int64_t> ready_gen_;
  std::vector<uint64_t> ready_fence_;
  std::vector<int64_t> wanted_gen_;
  double last_seconds_ = 0;
  double acc_seconds_ = 0;  ///< CPU AdamW seconds of the generation being computed
  size_t tasks_left_ = 0;   ///< its update tasks not yet done
  int64_t gen_ = 0;         ///< update generations queued
  std::thread worker_;

  // Delayed mode: the update queued last (applied at the next step()).
  struct InFlight {
    bool active = false;
    std::vector<size_t> order;
    std::vector<Tensor> targets;
    int buffer = 0;
    int64_t gen = 0;
  } in_flight_;
  std::vector<int64_t> done_gen_;  ///< per range: update generation computed (delayed mode)

  // Speculation (main thread only, but posted tasks read copies).
  struct Speculation {
    bool active = false;
    double lr = 0, grad_scale = 0;
    std::vector<Tensor> targets;
    int64_t gen = 0;
    std::vector<bool> posted;  ///< per range: its update was queued
  } spec_;
  std::vector<Tensor> device_grad_;  ///< per range: the device gradient handed over this step
  std::atomic<StepTrace*> trace_{nullptr};  ///< set_trace (tasks capture it when posted)
  int64_t rolled_back_ = 0;
};

}  // namespace shardtrain
