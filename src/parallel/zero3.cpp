// ZeRO stage 3: the strategy `zero3` (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
// Training Trillion Parameter Models", arXiv 1910.02054, §5.3 P_os+g+p; DeepSpeed's stage-3
// parameter coordinator for the prefetch / release rules).
//
// Units and partition. Every layer of the layout is a unit of its own (a "bucket" of one layer,
// parallel/buckets.h), padded to a multiple of world·16 elements and split into one equal slice
// per rank: rank r owns slice r of every unit — its compute-dtype parameters, its gradient
// shard, its fp32 master weights and AdamW m/v (zero_base.h). That is ZeRO's 16Ψ/N bytes.
// A unit with fewer parameters than stage3_param_persistence_threshold stays resident
// (replicated, full, as in stage 2: its updated slices are all-gathered after each step); on a
// single rank every unit is resident, since its slice is the whole unit, and nothing is gathered.
//
// The schedule of one training micro-step is known in advance: forward runs layers 0..n-1 and
// backward n-1..0, and layer l needs the units ParamLayout::uses(l) — itself and the layers it
// reads (the LM head reads the embedding's wte). Position p of the pass (forward of layer p,
// then backward of layer 2n-1-p) thus needs a known set of units. Around each position:
//   before: wait for the units it needs (all-gathering any not yet gathered into a piece of
//           the shared DeviceArena, or a buffer of their own when it has no room), then prefetch —
//           start the all-gathers of the units the next positions need, in order, until
//           stage3_prefetch_bucket_size elements ahead are covered or stage3_max_live_parameters
//           elements would be exceeded. The all-gathers run on the communicator's stream (NCCL;
//           MPI's nonblocking collectives on CPU) while the current layer computes. Backward also
//           takes a zeroed full gradient buffer for each unit it writes first (the head for the
//           embedding: tied gradients are accumulated into ONE buffer and reduced once).
//   after:  a unit whose next use lies more than stage3_max_reuse_distance elements of gathered
//           parameters ahead (or nowhere in this pass, or that would keep more than
//           stage3_max_live_parameters alive) is released; backward reduce-scatters the gradient
//           buffer of each unit whose last writer just ran (the unit itself) in place, and adds
//           the rank's reduced slice into its gradient shard when the reduction has completed
//           (at most two reductions in flight; the last ones complete when the pass ends),
//           then frees the buffer.
// These rules live in parallel/zero3_schedule.h as pure functions, which the memory estimator
// replays (simulate_zero3_pass) to predict the bytes gathered at the peak.
// A new forward pass starts by releasing whatever is still gathered (an evaluation forward
// prefetches for a backward that does not come); the optimizer step releases every gathered
// copy (they are stale) and updates each owned slice in place.
#include "parallel/zero3.h"

#include <cstring>
#include <deque>

#include "config/knob.h"
#include "memory/host_buffer.h"
#include "parallel/device_arena.h"
#include "parallel/hierarchical_reduction.h"
#include "parallel/offload/param_swap.h"
#include "parallel/zero3_schedule.h"
#include "parallel/zero_base.h"

namespace shardtrain {
namespace {

/// Hybrid sharding's groups (ZeRO++ hpZ, arXiv 2306.10209 §3.2; FSDP2's HSDP): ZeRO-3 runs over
/// `shard` (this rank's group of consecutive ranks); `replica` holds the ranks with the same
/// place in the other groups, over which the gradient shards are summed.
struct HybridGroups {
  std::unique_ptr<Communicator> shard, replica;
  /// zero_quantized_gradients: the cross-group sums in int8 (a hierarchical all-reduce over the
  /// replica group with one rank per "node": its quantized cross-node step alone).
  std::unique_ptr<HierarchicalReduction> quantized;
};

class Zero3 final : public ZeroStrategy {
 public:
  Zero3(const StrategyOptions& options, const OffloadPolicy& offload, Backend& backend,
        Communicator& comm, std::shared_ptr<HybridGroups> hybrid)
      : ZeroStrategy(options, offload, backend, hybrid ? *hybrid->shard : comm),
        hybrid_(std::move(hybrid)) {
    if (hybrid_) saves_state_ = hybrid_->replica->rank() == 0;
  }
  /// Waits for the collectives still writing into the units' buffers (a prefetch for a backward
  /// that never came, e.g. after an evaluation forward) before the buffers go: one left in flight
  /// would land in freed memory.
  ~Zero3() override {
    // The optimizer's last update tasks write into this strategy's parameters: let them finish
    // before the arena that holds them goes.
    if (offload_) offload_->host().drain();
    try {
      drain_reductions();
      for (auto& w : replica_reductions_) w->wait();
      release_all();  // waits for each gathered unit's all-gather still in flight
    } catch (const std::exception&) {
      // A rank failed: the job is stopping (the communicator stopped the others).
    }
  }
  std::string name() const override { return "zero3"; }

  void zero_grad() override {
    // The offloaded optimizer's copies (and the update tasks of parameters paged from NVMe) read
    // the gradients off the device: done before they are zeroed below.
    if (offload_) offload_->before_gradients_change();
    drain_reductions();
    start_cross_node_count();
    if (hybrid_ && hybrid_->quantized) hybrid_->quantized->reset_network_bytes();
    gathered_bytes_ = 0;
    backend_.fill_zero(grad_shard_.view());
  }

  void begin_micro_step(int64_t index, int64_t count) override { last_micro_ = index + 1 == count; }

  /// Its gathers and releases follow the positions of one micro-step (zero3_schedule.h).
  bool allows_layer_major_forward() const override { return false; }
  bool allows_layer_major_backward() const override { return false; }
  void before_forward(int layer) override {
    if (layer == 0) release_all();
    enter_pos(layer);
  }
  void after_forward(int layer) override { leave_pos(layer); }

  void before_backward(int layer) override {
    for (int u : model_->layout().uses(layer)) acquire_grad(u);
    enter_pos(schedule_.backward_pos(layer));
  }

  void after_backward(int layer) override {
    for (int u : model_->layout().uses(layer))
      if (model_->layout().users(u).front() == layer) reduce_grad(u);
    leave_pos(schedule_.backward_pos(layer));
    progress_reductions();
    // The pass is over: its last reductions complete now, not during the next micro-step's
    // forward (their buffers would stay alive through it).
    if (layer == 0) drain_reductions();
  }

  void finish_gradients() override {
    drain_reductions();
    for (auto& w : replica_reductions_) w->wait();
    replica_reductions_.clear();
    offload_remaining_gradients();
  }

  size_t peak_transient_bytes() const override { return peak_transient_bytes_; }
  int64_t cross_node_bytes_last_step() const override {
    if (!hybrid_) return ZeroStrategy::cross_node_bytes_last_step();
    if (hybrid_->replica->world_size() == 1) return 0;
    if (hybrid_->quantized) return hybrid_->quantized->network_bytes();
    return static_cast<int64_t>(grad_shard_.bytes());
  }

  double grad_norm(double scale) override {
    // One pass over the whole gradient shard: padding elements hold zero gradients.
    return std::sqrt(sum_over_ranks(backend_.sum_squares(grad_shard_.view()))) * scale;
  }

 protected:
  std::vector<GradBucket> make_buckets(const ParamLayout& layout) const override {
    return build_grad_buckets(layout, 1);  // every layer a unit of its own
  }

  void allocate_params() override {
    const ParamLayout& layout = model_->layout();
    const int n = layout.num_layers();
    units_.clear();
    units_.resize(static_cast<size_t>(n));
    int64_t resident = 0, sharded = 0;
    // offload_param "nvme" with max_in_cpu: the partitioned slices past it are paged from a swap
    // file (first fit, in layer order) instead of living in pinned host memory.
    const bool paging = policy_.params == OffloadDevice::kNvme && policy_.param_max_in_cpu >= 0;
    int64_t in_cpu_left = policy_.param_max_in_cpu;
    std::vector<int64_t> paged_numel(static_cast<size_t>(n), 0);
    for (int l = 0; l < n; ++l) {
      Unit& u = units_[static_cast<size_t>(l)];
      const BucketPartition& p = parts_[static_cast<size_t>(part_of(l))];
      int64_t params = 0;  // real parameters of the layer (alignment padding not counted)
      for (const ParamTensor& t : layout.layers()[static_cast<size_t>(l)].tensors)
        params += t.numel;
      // Offloaded parameters stream in per layer even on one rank.
      u.resident = (world_ == 1 && !params_offloaded()) ||
                   params < opt_.zero.stage3_param_persistence_threshold;
      if (paging && !u.resident) {
        if (p.shard > in_cpu_left) {
          paged_numel[static_cast<size_t>(l)] = p.shard;
          continue;
        }
        in_cpu_left -= p.shard;
      }
      u.offset = u.resident ? resident : sharded;
      (u.resident ? resident : sharded) += u.resident ? p.padded : p.shard;
    }
    resident_ = FlatBuffer(backend_, dtype_, resident);
    if (params_offloaded()) {
      // offload_param: the rank's slices in pinned host memory (those not paged), copied to the
      // device per layer.
      if (std::any_of(paged_numel.begin(), paged_numel.end(), [](int64_t x) { return x > 0; })) {
        check<ConfigError>(policy_.optimizer_offloaded() && policy_.ratio == 1.0,
                           "parameters paged from NVMe ({0}) need the whole optimizer offloaded "
                           "({1} \"cpu\" or \"nvme\", {2} 1): set them, or raise {0}",
                           zero_knob(&ZeroConfig::offload_param_max_in_cpu).label(),
                           zero_knob(&ZeroConfig::offload_optimizer_device).path,
                           zero_knob(&ZeroConfig::offload_ratio).label());
        param_swap_ =
            std::make_unique<ParamSwap>(backend_, policy_.nvme_path, rank_, policy_.aio, dtype_,
                                        std::move(paged_numel), policy_.param_buffer_count);
      }
      host_shards_ = PinnedBuffer(backend_, dtype_, sharded);
      if (sharded > 0) std::memset(host_shards_.data(), 0, host_shards_.bytes());
      copies_ = backend_.make_copy_stream();
    } else {
      sharded_ = FlatBuffer(backend_, dtype_, sharded);
    }
    std::vector<int64_t> padded(static_cast<size_t>(n));
    std::vector<bool> is_resident(static_cast<size_t>(n));
    for (int l = 0; l < n; ++l) {
      padded[static_cast<size_t>(l)] = partition(l).padded;
      is_resident[static_cast<size_t>(l)] = unit(l).resident;
    }
    schedule_ =
        Zero3Schedule(layout, std::move(padded), std::move(is_resident), zero3_limits(opt_));
  }

  std::vector<Tensor> param_buffers() const override {
    if (resident_.numel() == 0) return {};
    return {resident_.view()};
  }
  size_t param_bytes() const override { return resident_.bytes() + sharded_.bytes(); }
  size_t extra_pinned_bytes() const override {
    return host_shards_.bytes() + (param_swap_ ? param_swap_->pinned_bytes() : 0);
  }
  size_t extra_nvme_bytes() const override { return param_swap_ ? param_swap_->nvme_bytes() : 0; }
  bool params_paged(size_t i) const override { return paged(parts_[i].bucket.first_layer); }
  void write_paged_params(size_t i, const void* params, int64_t numel) override {
    param_swap_->write(parts_[i].bucket.first_layer, params, numel);
  }
  void set_host_params(size_t i, Tensor master) override {
    if (!params_paged(i)) return ZeroStrategy::set_host_params(i, master);
    std::vector<char> tmp(static_cast<size_t>(master.numel()) * dtype_size(dtype_));
    write_host_params(Tensor(tmp.data(), dtype_, DeviceKind::kCPU, {master.numel()}), master);
    param_swap_->write(parts_[i].bucket.first_layer, tmp.data(), master.numel());
  }

  Tensor own_params(size_t i) const override {
    const BucketPartition& p = parts_[i];
    const Unit& u = unit(p.bucket.first_layer);
    if (u.resident)
      return resident_.slice(u.offset + static_cast<int64_t>(rank_) * p.shard, p.shard);
    if (paged(p.bucket.first_layer))
      return Tensor(nullptr, dtype_, DeviceKind::kCPU, {p.shard});  // no memory of its own
    if (params_offloaded()) return host_shards_.slice(u.offset, p.shard);
    return sharded_.slice(u.offset, p.shard);
  }

  Tensor host_params(size_t i) const override {
    const int layer = parts_[i].bucket.first_layer;
    if (!params_offloaded() || unit(layer).resident || paged(layer)) return {};
    return own_params(i);
  }

  Tensor gather_target(size_t i) const override {
    const BucketPartition& p = parts_[i];
    const Unit& u = unit(p.bucket.first_layer);
    if (!u.resident || world_ == 1) return {};
    return resident_.slice(u.offset, p.padded);
  }

  void before_update() override {
    drain_reductions();
    release_all();
    // The host shards change next: no copy to the device may still be reading them.
    if (copies_ && last_copy_) copies_->host_wait(last_copy_);
    if (param_swap_) param_swap_->drop_all();  // staged copies are stale from now on
  }

  void allocate_gradients() override {
    grad_shard_ = FlatBuffer(backend_, dtype_, shard_numel_);
    // Gathered units and full gradient buffers come from one arena the communicator registers
    // (gradient_buffers()), so that their collectives take the copy engines (device_arena.h). Its
    // size: the schedule's peak of both together, which the memory estimator replays too, plus
    // the largest unit against fragmentation; a piece that still finds no room is allocated on
    // its own (and its collective goes through NCCL).
    arena_ = DeviceArena();
    if (world_ > 1) {
      const int64_t n =
          zero3_arena_elements(model_->layout(), schedule_, world_, kZero3ReductionsInFlight);
      if (n > 0) arena_ = DeviceArena(backend_, dtype_, n);
    }
  }
  std::vector<Tensor> gradient_buffers() const override {
    if (arena_.capacity() == 0) return {};
    return {arena_.view()};
  }
  Tensor grad_shard(size_t i) const override {
    return grad_shard_.slice(parts_[i].shard_offset, parts_[i].owned_numel);
  }
  size_t gradient_bytes() const override { return grad_shard_.bytes(); }

  void bind_layers() override {
    for (int l = 0; l < model_->num_layers(); ++l) {
      Unit& u = units_[static_cast<size_t>(l)];
      const BucketPartition& p = partition(l);
      u.params = u.resident ? resident_.slice(u.offset, p.padded) : Tensor();
      // One rank: gradients accumulate straight into the shard (which is the whole unit).
      u.grads = world_ == 1 ? grad_shard_.slice(p.shard_offset, p.padded) : Tensor();
      bind(l);
    }
  }

 private:
  /// One layer's state on this rank.
  struct Unit {
    bool resident = false;  ///< full parameters always present (persistent, or one rank)
    int64_t offset = 0;     ///< in resident_ (padded unit) or sharded_ (this rank's slice)
    ArenaBuffer gathered;   ///< partitioned unit: its full parameters [padded] while gathered
    std::unique_ptr<Work> gathering;  ///< the all-gather into `gathered`, until waited for
    ArenaBuffer grad;                 ///< several ranks: the full gradient [padded] in backward
    bool grad_live = false;           ///< `grads` holds this backward's gradient buffer
    bool reducing = false;            ///< `grad` is being reduce-scattered
    Tensor params, grads;             ///< what the layer is bound to now (may be empty)
  };

  /// A reduce-scatter in flight: unit `layer`'s gradient buffer, its result in `own`.
  struct Reduction {
    int layer;
    Tensor own;
    std::unique_ptr<Work> work;
    bool last_micro;  ///< of the step's last micro-step: the unit's shard is then complete
  };

  Unit& unit(int layer) { return units_[static_cast<size_t>(layer)]; }
  const Unit& unit(int layer) const { return units_[static_cast<size_t>(layer)]; }
  const BucketPartition& partition(int layer) const {
    return parts_[static_cast<size_t>(part_of(layer))];
  }
  void bind(int layer) {
    const LayerRange& r = model_->layout().layers()[static_cast<size_t>(layer)];
    const Unit& u = unit(layer);
    model_->bind_layer(layer, r, u.params.empty() ? Tensor() : u.params.slice1d(0, r.numel),
                       u.grads.empty() ? Tensor() : u.grads.slice1d(0, r.numel));
  }

  /// Before position `p` runs: its units gathered and bound, the next ones prefetched.
  void enter_pos(int p) {
    const auto& uses = schedule_.uses(p);
    // Offloaded optimizer: the units' updates must have landed (and resident ones been gathered).
    // Resident units are all-gathered by step() (launch_gather) while the next forward starts:
    // that all-gather must be complete before a layer reads them. (Without this wait the forward
    // read whatever part of the other ranks' slices MPI had delivered: on 2 CPU ranks of a
    // 16-core machine zero3 then drifted from one rank by 7e-4 after 4 steps.)
    for (int u : uses) {
      ensure_published(static_cast<size_t>(part_of(u)));
      wait_gather(static_cast<size_t>(part_of(u)));
    }
    for (int u : uses) start_gather(u);
    for (int u : schedule_.prefetch(
             p, [&](int u) { return unit(u).gathered.numel() > 0; }, live_numel_))
      start_gather(u);
    if (param_swap_) read_ahead(p);
    for (int u : uses) {
      Unit& x = unit(u);
      if (x.gathering) {
        x.gathering->wait();
        x.gathering.reset();
      }
      bind(u);
    }
  }

  /// Paged parameters: starts reading the units the next positions use (as many as the staging
  /// buffers hold) whose latest update has been written.
  void read_ahead(int p) {
    const int last = std::min(schedule_.num_positions(), p + policy_.param_buffer_count);
    for (int q = p + 1; q < last; ++q)
      for (int u : schedule_.uses(q)) {
        const Unit& x = unit(u);
        if (paged(u) && x.gathered.numel() == 0 && update_landed(static_cast<size_t>(part_of(u))))
          param_swap_->prefetch(u);
      }
  }

  /// After position `p` ran: release what is not needed again soon.
  void leave_pos(int p) {
    for (int u : schedule_.uses(p)) {
      const Unit& x = unit(u);
      if (x.resident || x.gathered.numel() == 0) continue;
      if (!schedule_.keep_after(u, p, live_numel_)) release(u);
    }
  }

  /// Issues the all-gather of unit `layer` into a buffer of its own (no-op when gathered or
  /// resident).
  void start_gather(int layer) {
    Unit& x = unit(layer);
    if (x.resident || x.gathered.numel() > 0) return;
    ensure_published(static_cast<size_t>(part_of(layer)));
    const BucketPartition& p = partition(layer);
    x.gathered = ArenaBuffer(backend_, &arena_, dtype_, p.padded);  // fully overwritten below
    const Tensor own = own_params(static_cast<size_t>(part_of(layer)));
    if (params_offloaded()) {
      // The slice comes from host memory (paged in from NVMe first) on the copy stream (ordered
      // after the compute stream's work so far, which may still read the piece's previous user),
      // then the all-gather runs in place.
      Tensor slot = x.gathered.slice(static_cast<int64_t>(rank_) * p.shard, p.shard);
      const bool from_nvme = paged(layer);
      const Tensor src = from_nvme ? param_swap_->acquire(layer) : own;
      copies_->after_compute();
      copies_->to_device(slot.data, src.data, src.bytes());
      last_copy_ = copies_->fence();
      copies_->compute_waits(last_copy_);
      if (from_nvme) param_swap_->release(layer, *copies_, last_copy_);
      if (world_ > 1) x.gathering = comm_.all_gather(x.gathered.view(), slot);
    } else {
      x.gathering = comm_.all_gather(x.gathered.view(), own);
    }
    x.params = x.gathered.view();
    live_numel_ += p.padded;
    note_peak();
    gathered_bytes_ += static_cast<int64_t>(x.gathered.bytes());
  }

  void release(int layer) {
    Unit& x = unit(layer);
    if (x.gathering) {  // prefetched, never used: the buffer is still being written
      x.gathering->wait();
      x.gathering.reset();
    }
    live_numel_ -= x.gathered.numel();
    x.gathered = ArenaBuffer();
    x.params = Tensor();
  }

  /// Releases every gathered unit (one per layer once set up; none before: safe to destroy).
  void release_all() {
    for (size_t l = 0; l < units_.size(); ++l)
      if (units_[l].gathered.numel() > 0) release(static_cast<int>(l));
  }

  /// Gives unit `layer` a zeroed full gradient buffer for this backward (several ranks).
  void acquire_grad(int layer) {
    Unit& x = unit(layer);
    if (x.grad_live) return;
    x.grad_live = true;
    if (world_ == 1) return;  // bound to the shard once and for all
    // The previous micro-step's reduction of this unit must have left its buffer.
    while (x.reducing) complete_reduction();
    x.grad = ArenaBuffer(backend_, &arena_, dtype_, partition(layer).padded);
    if (x.grad.in_arena()) backend_.fill_zero(x.grad.view());  // backward accumulates into it
    grad_numel_ += x.grad.numel();
    note_peak();
    x.grads = x.grad.view();
  }

  /// Unit `layer`'s gradients of this micro-step are complete: reduce-scatter them in place.
  void reduce_grad(int layer) {
    Unit& x = unit(layer);
    ST_ASSERT(x.grad_live);
    x.grad_live = false;
    if (world_ == 1) return;
    const BucketPartition& p = partition(layer);
    Tensor own = x.grad.slice(static_cast<int64_t>(rank_) * p.shard, p.shard);
    while (reductions_.size() >= kZero3ReductionsInFlight) complete_reduction();
    reductions_.push_back({layer, own, reduce_scatter_gradients(own, x.grad.view()), last_micro_});
    x.reducing = true;
    if (!opt_.zero.overlap_comm) complete_reduction();
  }

  /// Waits for the oldest reduce-scatter, adds its slice into the gradient shard, frees the
  /// unit's gradient buffer.
  void complete_reduction() {
    Reduction& r = reductions_.front();
    r.work->wait();
    const BucketPartition& p = partition(r.layer);
    Tensor dst = grad_shard_.slice(p.shard_offset, p.shard);
    backend_.add(dst, dst, r.own);
    // Hybrid sharding: the unit's shard holds the group's sum of the whole step; add the other
    // groups' while backward goes on (in unit order, the same on every rank of the group).
    if (hybrid_ && r.last_micro)
      replica_reductions_.push_back(hybrid_->quantized
                                        ? hybrid_->quantized->all_reduce(dst)
                                        : hybrid_->replica->all_reduce(dst, ReduceOp::kSum));
    if (hybrid_ && hybrid_->quantized) hybrid_->quantized->progress();
    Unit& x = unit(r.layer);
    grad_numel_ -= x.grad.numel();
    x.grad = ArenaBuffer();
    x.grads = Tensor();
    x.reducing = false;
    reductions_.pop_front();
  }

  void note_peak() {
    peak_transient_bytes_ = std::max(
        peak_transient_bytes_, static_cast<size_t>(live_numel_ + grad_numel_) * dtype_size(dtype_));
  }

  void drain_reductions() {
    while (!reductions_.empty()) complete_reduction();
  }

  DeviceArena arena_;                   ///< gathered units and gradient buffers (several ranks)
  std::vector<Unit> units_;             ///< per layer; declared after arena_, freed before it
  FlatBuffer resident_;                 ///< resident units, full [padded] each, compute dtype
  FlatBuffer sharded_;                  ///< partitioned units, this rank's slice [shard] each
  PinnedBuffer host_shards_;            ///< offload_param: sharded_ in pinned host memory instead
  std::unique_ptr<CopyStream> copies_;  ///< offload_param: host → device copies of the slices
  uint64_t last_copy_ = 0;
  /// offload_param nvme: the slices past max_in_cpu (declared after copies_, which its buffers'
  /// last copies use, so it goes first).
  std::unique_ptr<ParamSwap> param_swap_;
  bool params_offloaded() const { return policy_.params_offloaded(); }
  /// Whether layer `l`'s slice is paged from NVMe (param_swap_).
  bool paged(int l) const { return param_swap_ && param_swap_->on_nvme(l); }
  FlatBuffer grad_shard_;  ///< [shard_numel_] compute dtype: Σ over micro-steps, ranks
  Zero3Schedule schedule_;
  int64_t live_numel_ = 0;           ///< elements of gathered (non-resident) units held now
  int64_t grad_numel_ = 0;           ///< elements of full gradient buffers held now
  size_t peak_transient_bytes_ = 0;  ///< elements of gathered (non-resident) units held now
  std::deque<Reduction> reductions_;
  std::shared_ptr<HybridGroups> hybrid_;  ///< hybrid sharding's groups (null: over every rank)
  std::vector<std::unique_ptr<Work>> replica_reductions_;  ///< hybrid: across groups, in flight
  bool last_micro_ = true;  ///< the micro-step under way is the step's last
};

}  // namespace

std::unique_ptr<Strategy> make_zero3_strategy(const StrategyOptions& options,
                                              const OffloadPolicy& offload, Backend& backend,
                                              Communicator& comm) {
  std::shared_ptr<HybridGroups> hybrid;
  const int64_t g = options.zero.hpz_partition_size;
  if (g > 1 && g < comm.world_size()) {
    // Collective: every rank splits the world the same way.
    const NodeGroups groups = NodeGroups::of(comm.world_size(), comm.rank(), static_cast<int>(g));
    hybrid = std::make_shared<HybridGroups>();
    hybrid->shard = comm.split(groups.node);
    hybrid->replica = comm.split(groups.across);
    if (options.zero.quantized_gradients)
      hybrid->quantized = std::make_unique<HierarchicalReduction>(*hybrid->replica, 1, backend,
                                                                  true, groups.across);
  } else {
    check<ConfigError>(g <= comm.world_size(), "{} {} exceeds the {} ranks of the job",
                       zero_knob(&ZeroConfig::hpz_partition_size).key(), g, comm.world_size());
  }
  return std::make_unique<Zero3>(options, offload, backend, comm, std::move(hybrid));
}

}  // namespace shardtrain
