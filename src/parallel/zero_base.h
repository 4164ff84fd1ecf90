// The ZeRO machinery stages 1, 2 and 3 share (Rajbhandari et al., "ZeRO: Memory Optimizations
// Toward Training Trillion Parameter Models", arXiv 1910.02054, §5): the partition, the owned
// fp32 master weights and AdamW state, the optimizer step and its all-gathers, the gradient norm
// and the sharded-checkpoint state access. Stages 1/2 (zero.cpp) and 3 (zero3.cpp) derive from it.
// Offload is a policy handed in (parallel/offload/zero_offload.h): with it, the host-stepped half
// of the optimizer is a ZeroOffload, which this class calls at the points every stage shares.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "comm/scalar_all_reduce.h"
#include "core/error.h"
#include "core/half.h"
#include "parallel/buckets.h"
#include "parallel/hierarchical_reduction.h"
#include "parallel/offload/zero_offload.h"
#include "parallel/registered_buffers.h"
#include "parallel/strategy.h"

namespace shardtrain {

/// What stages 1, 2 and 3 share: the partition of the layout into buckets and of each bucket
/// into one slice per rank (buckets.h), the fp32 master weights and AdamW state of the owned
/// slices, the optimizer step, the gradient norm and the checkpoint state. Subclasses own the
/// parameter storage (own_params, gather_target) and the gradients. `offload` says what leaves
/// the GPU (make_strategy resolves it from the plan: offload_policy).
class ZeroStrategy : public Strategy {
 public:
  ZeroStrategy(const StrategyOptions& options, OffloadPolicy offload, Backend& backend,
               Communicator& comm)
      : opt_(options), policy_(std::move(offload)), backend_(backend), comm_(comm) {}
  /// Waits for the parameter all-gathers still in flight (launched by step()) before their
  /// buffers go.
  ~ZeroStrategy() override {
    if (offload_) offload_->host().drain();  // its tasks write into the parameters freed below
    try {
      for (size_t i = 0; i < gathers_.size(); ++i) wait_gather(i);
    } catch (const std::exception&) {
      // A rank failed: the job is stopping (the communicator stopped the others).
    }
  }

  void setup(Model& model, const std::vector<float>& init) final {
    ST_ASSERT(init.empty() || static_cast<int64_t>(init.size()) == model.layout().numel());
    ParameterSource copy;
    if (!init.empty())
      copy = [&init](int64_t offset, int64_t numel, float* out) {
        std::copy_n(init.data() + offset, numel, out);
      };
    setup_from(model, copy);
  }

  /// Without a source every parameter stays 0 (a checkpoint is loaded next).
  void setup_from(Model& model, const ParameterSource& source) final {
    model_ = &model;
    const ParamLayout& layout = model.layout();
    world_ = comm_.world_size();
    rank_ = comm_.rank();
    dtype_ = backend_.compute_dtype();
    buckets_ = make_buckets(layout);
    parts_ = partition_buckets(buckets_, world_, rank_);
    part_of_layer_.assign(static_cast<size_t>(model.num_layers()), -1);
    padded_numel_ = shard_numel_ = max_padded_ = 0;
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      padded_numel_ += p.padded;
      shard_numel_ += p.shard;
      max_padded_ = std::max(max_padded_, p.padded);
      for (int l = p.bucket.first_layer; l <= p.bucket.last_layer; ++l)
        part_of_layer_[static_cast<size_t>(l)] = static_cast<int>(i);
    }
    allocate_params();
    split_ = owned_state_split(parts_, policy_.optimizer_offloaded(), policy_.ratio);
    if (dtype_ != DType::kF32)
      master_ = FlatBuffer(backend_, DType::kF32, split_.device_state_numel);
    // AdamW m and v (SGD: the momentum buffer only) of every owned slice in buffers laid out
    // like the slices (one device allocation each rather than one per slice).
    const bool has_v = opt_.optimizer.kind == OptimizerKind::kAdamW;
    exp_avg_ = FlatBuffer(backend_, DType::kF32, split_.device_state_numel);
    exp_avg_sq_ = FlatBuffer(backend_, DType::kF32, has_v ? split_.device_state_numel : 0);
    optimizers_.clear();
    optimizers_.resize(parts_.size());
    std::vector<FlatRange> host_ranges;
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      const int64_t g = split_.on_device[i], off = split_.device_offset[i];
      if (g > 0)
        optimizers_[i] = std::make_unique<Optimizer>(
            backend_, layout, p.owned_offset, g, opt_.optimizer, exp_avg_.slice(off, g),
            has_v ? exp_avg_sq_.slice(off, g) : Tensor(nullptr, DType::kF32, backend_.kind(), {0}));
      host_ranges.push_back({p.owned_offset + g, p.owned_numel - g});
    }
    offload_.reset();
    if (policy_.optimizer_offloaded()) {
      std::vector<Tensor> in_host;  // host-stepped elements whose parameters live on the host
      StagedParams staged;
      for (size_t i = 0; i < parts_.size(); ++i) {
        const Tensor t = host_params(i);
        in_host.push_back(t.empty() ? t : t.slice1d(split_.on_device[i], host_ranges[i].numel));
        staged.ranges.push_back(params_paged(i));
      }
      if (std::find(staged.ranges.begin(), staged.ranges.end(), true) == staged.ranges.end())
        staged.ranges.clear();
      staged.write = [this](size_t i, const void* params, int64_t numel) {
        write_paged_params(i, params, numel);
      };
      offload_ = std::make_unique<ZeroOffload>(policy_, backend_, layout, std::move(host_ranges),
                                               opt_.optimizer, dtype_, rank_, std::move(in_host),
                                               std::move(staged));
    }
    norm_reduce_ = std::make_unique<ScalarAllReduce>(backend_, comm_, 1);
    allocate_gradients();
    std::vector<Tensor> buffers = gradient_buffers();
    for (const Tensor& t : param_buffers()) buffers.push_back(t);
    registered_ = RegisteredBuffers(comm_, backend_, buffers);
    hierarchical_.reset();
    if (opt_.hierarchical_ranks_per_node > 0 && world_ > 1)
      hierarchical_ = std::make_unique<HierarchicalReduction>(
          comm_, opt_.hierarchical_ranks_per_node, backend_, opt_.zero.quantized_gradients);
    if (source) write_params(source);  // else all zero
    bind_layers();
    model.set_hooks(this);
  }

  /// Makes the updated parameters of the parts `layer` uses visible to it: waits for their
  /// all-gathers (launched by step()) and, with offload, queues the host's update first.
  void before_forward(int layer) override {
    for (int u : model_->layout().uses(layer)) {
      const auto i = static_cast<size_t>(part_of(u));
      ensure_published(i);
      wait_gather(i);
    }
  }
  void wait_for_parameters() override {
    publish_all();
    for (size_t i = 0; i < gathers_.size(); ++i) wait_gather(i);
  }

  /// Stages 1 and 2 act around a layer's forward per layer (its update published and gathered),
  /// not per micro-batch; stage 3 overrides (its gathers follow a per-micro-step schedule).
  bool allows_layer_major_forward() const override { return true; }
  bool allows_layer_major_backward() const override { return true; }

  /// Offload at stages 1-2 (not the delayed update): the host optimizer starts each part's
  /// update as soon as its gradient leaves for the host, during backward
  /// (HostOptimizer::speculate). Stage 3 keeps the update after backward: its gathers may still
  /// read a part's shard after the part's gradient is final (persistent parameters).
  void expect_update(double lr, double grad_scale) override {
    if (offload_ && policy_.speculative_update)
      offload_->host().speculate(lr, grad_scale, host_targets());
  }
  void cancel_expected_update() override {
    if (offload_) offload_->host().cancel_speculation();
  }
  int64_t rolled_back_updates() const override {
    return offload_ ? offload_->host().rolled_back_steps() : 0;
  }
  void set_trace(StepTrace* trace) override {
    if (offload_) offload_->host().set_trace(trace);
  }

  double grad_norm(double scale) override {
    double local = 0;
    for (size_t i = 0; i < parts_.size(); ++i)
      if (parts_[i].owned_numel > 0) local += backend_.sum_squares(grad_shard(i));
    return std::sqrt(sum_over_ranks(local)) * scale;
  }

  void step(double lr, double grad_scale) override {
    ++steps_;
    wait_for_parameters();  // the last update is in place before this one (forward did it)
    before_update();
    const bool separate_master = master_.numel() > 0;
    // In forward order: each part's all-gather leaves as soon as its update is done (no host
    // offload), overlapping the updates after it and the next forward up to the first layer that
    // reads the part (before_forward waits there: Megatron-LM's distributed optimizer overlaps
    // its parameter all-gather with the forward the same way).
    const bool gather_now = !offload_;
    gathers_.resize(parts_.size());
    for (size_t i : split_.forward_order) {
      const int64_t g = split_.on_device[i];
      if (optimizers_[i]) {
        optimizers_[i]->step(master(i), grad_shard(i).slice1d(0, g),
                             separate_master ? own_params(i).slice1d(0, g) : Tensor(), lr,
                             grad_scale);
      }
      if (gather_now) launch_gather(i);
    }
    if (offload_) {
      // The host half: queued on the CPU worker, parts in forward order; each part is published
      // (all-gathered) when the next forward first needs it (before_forward).
      offload_remaining_gradients();
      offload_->step(lr, grad_scale, split_.forward_order, host_targets());
    }
  }

  HostMemory host_memory() const override {
    return offload_ ? offload_->memory(extra_pinned_bytes(), extra_nvme_bytes()) : HostMemory{};
  }
  double host_step_seconds() const override {
    return offload_ ? offload_->host().last_step_seconds() : 0;
  }

  FullState gather_state() override {
    if (offload_) offload_->host().wait_all();
    wait_for_parameters();
    const auto n = static_cast<size_t>(model_->layout().numel());
    FullState s;
    s.params.resize(n);
    const bool has_v = opt_.optimizer.kind == OptimizerKind::kAdamW;
    s.optimizer = opt_.optimizer.kind;
    s.exp_avg.resize(n);
    s.exp_avg_sq.resize(has_v ? n : 0);  // SGD keeps no second moment
    s.optimizer_steps = steps_;
    FlatBuffer stage(backend_, DType::kF32, max_padded_);
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      Optimizer* opt = optimizers_[i].get();
      const std::pair<Tensor, std::vector<float>*> quantities[] = {
          {opt ? master(i) : Tensor(), &s.params},
          {opt ? opt->exp_avg() : Tensor(), &s.exp_avg},
          {opt ? opt->exp_avg_sq() : Tensor(), &s.exp_avg_sq}};
      const StateTensor qs[] = {StateTensor::kParams, StateTensor::kExpAvg, StateTensor::kExpAvgSq};
      int k = 0;
      for (const auto& [src, dst] : quantities) {
        if (qs[k] == StateTensor::kExpAvgSq && !has_v) break;
        Tensor own = stage.slice(static_cast<int64_t>(rank_) * p.shard, p.shard);
        backend_.fill_zero(own);
        if (opt) backend_.copy(own.data, src.data, src.bytes());
        if (offload_ && offload_->range(i).numel > 0) {
          const int64_t hn = offload_->range(i).numel;
          std::vector<float> h(static_cast<size_t>(hn));
          offload_->host().read_state(qs[k], i, 0, hn, h.data());
          backend_.copy_from_host(own.slice1d(split_.on_device[i], hn).data, h.data(),
                                  h.size() * 4);
        }
        ++k;
        comm_.all_gather(stage.slice(0, p.padded), own)->wait();
        backend_.copy_to_host(dst->data() + p.bucket.offset, stage.data(),
                              static_cast<size_t>(p.bucket.numel) * sizeof(float));
      }
    }
    return s;
  }

  void load_state(const FullState& s) override {
    const auto n = static_cast<size_t>(model_->layout().numel());
    check_state_kind(s.optimizer, opt_.optimizer.kind);
    const size_t nv = opt_.optimizer.kind == OptimizerKind::kAdamW ? n : 0;
    ST_ASSERT(s.params.size() == n && s.exp_avg.size() == n && s.exp_avg_sq.size() == nv);
    write_full(s.params.data(), s.exp_avg.data(), nv ? s.exp_avg_sq.data() : nullptr,
               s.optimizer_steps);
  }

  /// The owned ranges; empty where another replica group writes them (hybrid sharding).
  std::vector<FlatRange> save_ranges() const final {
    return saves_state_ ? owned_ranges() : std::vector<FlatRange>{};
  }
  std::vector<FlatRange> load_ranges() const final { return owned_ranges(); }

 private:
  std::vector<FlatRange> owned_ranges() const {
    std::vector<FlatRange> out;
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      const int64_t g = split_.on_device[i];
      // The part stepped on the device, then the one stepped on the host (offload).
      if (g > 0) out.push_back({p.owned_offset, g});
      if (p.owned_numel > g) out.push_back({p.owned_offset + g, p.owned_numel - g});
    }
    std::sort(out.begin(), out.end(),
              [](const FlatRange& x, const FlatRange& y) { return x.offset < y.offset; });
    return out;
  }

 public:
  void read_state(StateTensor q, int64_t offset, int64_t numel, float* host) final {
    if (offload_) {
      offload_->host().wait_all();
      if (const auto [i, at] = offload_->range_holding(offset, numel); i >= 0)
        return offload_->host().read_state(q, static_cast<size_t>(i), at, numel, host);
    }
    const Tensor src = owned_state(q, offset, numel);
    backend_.copy_to_host(host, src.data, src.bytes());
  }
  void write_state(StateTensor q, int64_t offset, int64_t numel, const float* host) final {
    if (offload_) {
      offload_->host().wait_all();
      if (const auto [i, at] = offload_->range_holding(offset, numel); i >= 0)
        return offload_->host().write_state(q, static_cast<size_t>(i), at, numel, host);
    }
    const Tensor dst = owned_state(q, offset, numel);
    backend_.copy_from_host(dst.data, host, dst.bytes());
  }
  void finish_load(int64_t optimizer_steps) final {
    if (offload_) offload_->host().wait_all();
    for (size_t i = 0; i < gathers_.size(); ++i) wait_gather(i);
    if (offload_) offload_->forget_pending();
    before_update();
    AllGatherWindow window(comm_, opt_.zero.allgather_bucket_size);
    for (size_t i = 0; i < parts_.size(); ++i) {
      const int64_t g = split_.on_device[i];
      if (optimizers_[i]) {
        optimizers_[i]->set_step_count(optimizer_steps);
        if (master_.numel() > 0) backend_.convert(own_params(i).slice1d(0, g), master(i));
      }
      if (offload_ && offload_->range(i).numel > 0) {
        const int64_t n = offload_->range(i).numel;
        std::vector<float> m(static_cast<size_t>(n));
        offload_->host().read_state(StateTensor::kParams, i, 0, n, m.data());
        set_host_params(i, Tensor(m.data(), DType::kF32, DeviceKind::kCPU, {n}));
      }
      publish(i, window);
    }
    window.drain();
    if (offload_) offload_->host().set_step_count(optimizer_steps);
    steps_ = optimizer_steps;
  }
  int64_t optimizer_steps() const final { return steps_; }
  OptimizerKind optimizer_kind() const final { return opt_.optimizer.kind; }
  int64_t gathered_bytes_last_step() const override { return gathered_bytes_; }

  /// Device bytes of parameters, gradients and the optimizer state stepped on the device.
  size_t model_state_bytes() const override {
    size_t bytes = param_bytes() + master_.bytes() + gradient_bytes();
    bytes += exp_avg_.bytes() + exp_avg_sq_.bytes();
    return bytes;
  }

 protected:
  /// Starts the sum over ranks of gradient bucket `whole` [W·s] into `own`, its slice [rank·s, s)
  /// (in place): one reduce-scatter over the world, or hierarchically within and across nodes
  /// (--hierarchical-all-reduce: parallel/hierarchical_reduction.h). Call at the same point on
  /// every rank; progress_reductions() moves hierarchical ones on.
  std::unique_ptr<Work> reduce_scatter_gradients(Tensor own, Tensor whole) {
    return hierarchical_ ? hierarchical_->reduce_scatter(own, whole)
                         : comm_.reduce_scatter(own, whole, ReduceOp::kSum);
  }
  /// Issues the later steps of hierarchical reductions that are ready (never waits).
  void progress_reductions() {
    if (hierarchical_) hierarchical_->progress();
  }
  /// Marks the start of a step for cross_node_bytes_last_step().
  void start_cross_node_count() {
    if (hierarchical_) hierarchical_->reset_network_bytes();
  }

 public:
  int64_t cross_node_bytes_last_step() const override {
    return hierarchical_ ? hierarchical_->network_bytes() : 0;
  }

 protected:
  /// All-gathers of updated parameters in flight, at most `max_numel` elements of output at once
  /// (zero_optimization.allgather_bucket_size); the destructor waits for the rest.
  class AllGatherWindow {
   public:
    AllGatherWindow(Communicator& comm, int64_t max_numel) : comm_(comm), max_(max_numel) {}
    ~AllGatherWindow() { drain(); }
    void add(Tensor output, Tensor input) {
      if (!in_flight_.empty() && numel_ + output.numel() > max_) drain();
      in_flight_.push_back(comm_.all_gather(output, input));
      numel_ += output.numel();
    }
    void drain() {
      for (auto& w : in_flight_) w->wait();
      in_flight_.clear();
      numel_ = 0;
    }

   private:
    Communicator& comm_;
    int64_t max_;
    int64_t numel_ = 0;
    std::vector<std::unique_ptr<Work>> in_flight_;
  };

  /// The layout's buckets (any order; parts_[i] partitions buckets_[i]). Stages 1/2: gradient
  /// buckets of whole layers up to reduce_bucket_size, tied sources alone.
  virtual std::vector<GradBucket> make_buckets(const ParamLayout& layout) const {
    const bool overlap_default =
        !opt_.zero.reduce_bucket_size_set && comm_.registration_staging_bytes() > 0;
    // Tied sources (the embedding, whose wte the LM head reads) get buckets of their own: their
    // gradients are written by a later layer's backward before their own (ParamLayout::tie).
    return build_grad_buckets(
        layout, overlap_default ? kOverlapBucketElements : opt_.zero.reduce_bucket_size,
        layout.tied_sources());
  }
  /// Allocates the parameter storage (stages 1/2: every parameter, padded buckets).
  virtual void allocate_params() { params_ = FlatBuffer(backend_, dtype_, padded_numel_); }
  /// The parameter buffers registered for the copy-engine collectives.
  virtual std::vector<Tensor> param_buffers() const { return {params_.view()}; }
  virtual size_t param_bytes() const { return params_.bytes(); }
  /// This rank's slice of part `i` in compute dtype [shard], padding included.
  virtual Tensor own_params(size_t i) const {
    const BucketPartition& p = parts_[i];
    return params_.slice(p.padded_offset + static_cast<int64_t>(rank_) * p.shard, p.shard);
  }
  /// This rank's slice of part `i` [shard] when it lives in host memory (stage 3's offloaded
  /// parameters; the offloaded optimizer lands its gradient there), else an empty tensor.
  virtual Tensor host_params(size_t /*i*/) const { return {}; }
  /// Whether part `i`'s slice is paged from NVMe (stage 3's offload_param.max_in_cpu): it has no
  /// memory of its own; the offloaded optimizer stages its gradient and writes its updates
  /// through write_paged_params.
  virtual bool params_paged(size_t /*i*/) const { return false; }
  /// Stores the first `numel` elements of part `i`'s slice (compute dtype, host memory) where
  /// it is paged to. Called from the optimizer's worker thread.
  virtual void write_paged_params(size_t /*i*/, const void* /*params*/, int64_t /*numel*/) {
    ST_ASSERT(false && "write_paged_params: no paged parameters");
  }
  /// Sets part `i`'s host-stepped parameters from its fp32 master weights `master` (host).
  virtual void set_host_params(size_t i, Tensor master) {
    write_host_params(own_params(i).slice1d(split_.on_device[i], master.numel()), master);
  }
  /// NVMe bytes a stage holds besides the optimizer's (stage 3's paged parameters).
  virtual size_t extra_nvme_bytes() const { return 0; }
  /// Where part `i`'s updated slices are all-gathered after a step ([padded], own_params(i) its
  /// slice rank), or an empty tensor when nothing needs gathering (stage 3's sharded parts).
  virtual Tensor gather_target(size_t i) const {
    return params_.slice(parts_[i].padded_offset, parts_[i].padded);
  }
  /// Called before the parameters change (step, load): stage 3 drops gathered copies.
  virtual void before_update() {}

  /// Offload: part `i`'s reduced gradient of this step is final in grad_shard(i) (compute-stream
  /// order): its host-stepped tail leaves for the host now. Stages call it as soon as they can
  /// (during backward); offload_remaining_gradients() sends the rest.
  void offload_gradient(size_t i) {
    if (!offload_) return;
    offload_->gradient_ready(i,
                             grad_shard(i).slice1d(split_.on_device[i], offload_->range(i).numel));
  }
  /// Per part, where its host-stepped parameters land ([range numel], compute dtype).
  std::vector<Tensor> host_targets() const {
    std::vector<Tensor> targets;
    for (size_t i = 0; i < parts_.size(); ++i)
      targets.push_back(own_params(i).slice1d(split_.on_device[i], offload_->range(i).numel));
    return targets;
  }
  void offload_remaining_gradients() {
    if (!offload_) return;
    for (size_t i = 0; i < parts_.size(); ++i) offload_gradient(i);
  }
  /// Whether part `i`'s latest update has reached its parameters (non-blocking).
  bool update_landed(size_t i) const { return !offload_ || offload_->landed(i); }
  /// Offload: part `i`'s update has reached its parameters (and been all-gathered).
  void ensure_published(size_t i) {
    if (!offload_ || !offload_->take_update(i)) return;
    AllGatherWindow window(comm_, opt_.zero.allgather_bucket_size);
    publish(i, window);
  }
  void publish_all() {
    for (size_t i = 0; i < parts_.size(); ++i) ensure_published(i);
  }
  /// Pinned bytes a stage holds besides the optimizer's (stage 3's offloaded parameters).
  virtual size_t extra_pinned_bytes() const { return 0; }

  /// Makes part `i`'s updated own slice visible where the model reads it.
  void publish(size_t i, AllGatherWindow& window) {
    const Tensor target = gather_target(i);
    if (target.empty()) return;
    window.add(target, own_params(i));
    gathered_bytes_ += static_cast<int64_t>(target.bytes());
  }
  /// Starts part `i`'s all-gather of its updated slices; wait_gather(i) orders what follows
  /// after it.
  void launch_gather(size_t i) {
    const Tensor target = gather_target(i);
    if (target.empty()) return;
    gathers_[i] = comm_.all_gather(target, own_params(i));
    gathered_bytes_ += static_cast<int64_t>(target.bytes());
  }
  void wait_gather(size_t i) {
    if (i >= gathers_.size() || !gathers_[i]) return;
    gathers_[i]->wait();
    gathers_[i].reset();
  }

  /// Sets the state from full host arrays in the flat layout (exp_avg/exp_avg_sq may be null:
  /// zeros): each rank copies its owned slices, then finish_load. Collective.
  void write_full(const float* params, const float* exp_avg, const float* exp_avg_sq,
                  int64_t optimizer_steps) {
    for (const FlatRange& r : load_ranges()) {
      write_state(StateTensor::kParams, r.offset, r.numel, params + r.offset);
      if (exp_avg) write_state(StateTensor::kExpAvg, r.offset, r.numel, exp_avg + r.offset);
      if (exp_avg_sq) write_state(StateTensor::kExpAvgSq, r.offset, r.numel, exp_avg_sq + r.offset);
    }
    finish_load(optimizer_steps);
  }

  /// Sets the parameters of the owned ranges from `source` (fp32, pieces of at most 2^28
  /// elements: 1 GiB of host memory at a time), m and v zero, then finish_load. Collective.
  void write_params(const ParameterSource& source) {
    constexpr int64_t kPiece = int64_t{1} << 28;
    std::vector<float> piece;
    for (const FlatRange& r : load_ranges()) {
      for (int64_t at = 0; at < r.numel; at += kPiece) {
        const int64_t n = std::min(kPiece, r.numel - at);
        piece.resize(static_cast<size_t>(n));
        source(r.offset + at, n, piece.data());
        write_state(StateTensor::kParams, r.offset + at, n, piece.data());
      }
    }
    finish_load(0);
  }

  /// Allocates the gradient buffers (called once from setup, after the partition is known).
  virtual void allocate_gradients() = 0;
  /// The buffers the gradient reduce-scatters read (registered with the communicator).
  virtual std::vector<Tensor> gradient_buffers() const = 0;
  /// Binds every layer to its parameters and (initial) gradient views.
  virtual void bind_layers() = 0;
  /// The reduced gradients of the real elements rank owns of part `i` [owned_numel], valid after
  /// finish_gradients().
  virtual Tensor grad_shard(size_t i) const = 0;
  virtual size_t gradient_bytes() const = 0;

  /// Binds `layer` to its parameters and to gradients in `grad_bucket`, a buffer laid out like
  /// the layer's padded bucket (element 0 = the bucket's first element).
  void bind_layer(int layer, const Tensor& grad_bucket) {
    const LayerRange& r = model_->layout().layers()[static_cast<size_t>(layer)];
    const BucketPartition& p = parts_[static_cast<size_t>(part_of(layer))];
    const int64_t in_bucket = r.offset - p.bucket.offset;
    model_->bind_layer(layer, r, params_.slice(p.padded_offset + in_bucket, r.numel),
                       grad_bucket.slice1d(in_bucket, r.numel));
  }

  int part_of(int layer) const { return part_of_layer_[static_cast<size_t>(layer)]; }

  /// fp32 master weights of the owned elements of part `i` stepped on the device
  /// [split_.on_device[i]] (all the real owned elements without offload).
  Tensor master(size_t i) const {
    const int64_t g = split_.on_device[i];
    if (master_.numel() == 0) return own_params(i).slice1d(0, g);
    return master_.slice(split_.device_offset[i], g);
  }

  /// Sets parameters `dst` ([n], compute dtype; device memory, or pinned host memory for
  /// offloaded parameters) from fp32 host master weights `src` [n]. Blocking.
  void write_host_params(Tensor dst, Tensor src) {
    const int64_t n = src.numel();
    if (n == 0) return;
    const bool host_dst = dst.device == DeviceKind::kCPU;
    if (dtype_ == DType::kF32) {
      if (host_dst)
        std::memcpy(dst.data, src.data, src.bytes());
      else
        backend_.copy_from_host(dst.data, src.data, src.bytes());
      return;
    }
    std::vector<uint16_t> tmp(host_dst ? 0 : static_cast<size_t>(n));
    uint16_t* out = host_dst ? static_cast<uint16_t*>(dst.data) : tmp.data();
    const float* in = src.f32();
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < n; ++k)
      out[k] = dtype_ == DType::kBF16 ? float_to_bf16(in[k]) : float_to_fp16(in[k]);
    if (!host_dst) backend_.copy_from_host(dst.data, tmp.data(), static_cast<size_t>(n) * 2);
  }

  /// Quantity `q` of the owned flat elements [offset, offset + numel) stepped on the device
  /// (inside one range of save_ranges()).
  Tensor owned_state(StateTensor q, int64_t offset, int64_t numel) const {
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      if (offset < p.owned_offset || offset + numel > p.owned_offset + split_.on_device[i])
        continue;
      check<RuntimeFailure>(
          q != StateTensor::kExpAvgSq || optimizers_[i]->kind() == OptimizerKind::kAdamW,
          "{}: SGD keeps no exp_avg_sq (a bug: its caller asked for it)", name());
      const Tensor whole = q == StateTensor::kParams   ? master(i)
                           : q == StateTensor::kExpAvg ? optimizers_[i]->exp_avg()
                                                       : optimizers_[i]->exp_avg_sq();
      return whole.slice1d(offset - p.owned_offset, numel);
    }
    throw RuntimeFailure(fmt::format("{}: elements [{}, {}) are not owned by rank {}", name(),
                                     offset, offset + numel, rank_));
  }

  /// Σ over ranks of `x` in double, added in rank order: identical on every rank (each rank
  /// contributes x as a float pair, about 48 bits: ScalarAllReduce).
  double sum_over_ranks(double x) {
    norm_reduce_->sum(std::span<double>(&x, 1));
    return x;
  }

  StrategyOptions opt_;
  OffloadPolicy policy_;  ///< what leaves the GPU: the optimizer's host half, stage 3's parameters
  Backend& backend_;
  Communicator& comm_;
  Model* model_ = nullptr;
  int world_ = 1, rank_ = 0;
  /// Whether this rank writes its owned ranges to checkpoints (hybrid sharding: only the first
  /// replica group does; every group loads them).
  bool saves_state_ = true;
  DType dtype_ = DType::kF32;
  std::vector<GradBucket> buckets_;     ///< backward order; parts_[i] partitions buckets_[i]
  std::vector<BucketPartition> parts_;  ///< this rank's view of each bucket's partition
  std::vector<int> part_of_layer_;
  int64_t padded_numel_ = 0;  ///< Σ padded: the parameter buffer
  int64_t shard_numel_ = 0;   ///< Σ shard: buffers of this rank's slices
  int64_t max_padded_ = 0;
  FlatBuffer params_;           ///< stages 1/2: [padded_numel_] compute dtype, every parameter
  int64_t gathered_bytes_ = 0;  ///< parameter bytes all-gathered since zero_grad()
  FlatBuffer master_;  ///< [split_.device_state_numel] fp32 master weights; empty for fp32 compute
  FlatBuffer exp_avg_, exp_avg_sq_;  ///< fp32 AdamW m, v (SGD: momentum, none), like master_
  OwnedStateSplit split_;  ///< per part: the owned elements stepped on the device; forward order
  std::unique_ptr<ZeroOffload> offload_;  ///< offload: the host-stepped half of the optimizer
  /// Per part: the all-gather of its updated slices launched by step(), until a forward (or
  /// wait_for_parameters) waited for it.
  std::vector<std::unique_ptr<Work>> gathers_;
  std::vector<std::unique_ptr<Optimizer>> optimizers_;  ///< per part; null where nothing is owned
  std::unique_ptr<ScalarAllReduce> norm_reduce_;        ///< for sum_over_ranks
  int64_t steps_ = 0;
  // params_ and gradient_buffers() for the copy-engine collectives. It outlives the subclasses'
  // gradient buffers by the rest of the destructor chain, which is harmless: nothing allocates
  // meanwhile, and freed blocks stay mapped in the caching allocator.
  RegisteredBuffers registered_;
  /// --hierarchical-all-reduce (zero1, zero2, zero3 without hybrid sharding): the gradient
  /// reduce-scatters within and across nodes.
  std::unique_ptr<HierarchicalReduction> hierarchical_;
};

}  // namespace shardtrain
