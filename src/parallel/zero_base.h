// The ZeRO machinery stages 1, 2 and 3 share (Rajbhandari et al., "ZeRO: Memory Optimizations
// Toward Training Trillion Parameter Models", arXiv 1910.02054, §5): the partition, the owned
// fp32 master weights and AdamW state, the optimizer step and its all-gathers, the gradient norm
// and the sharded-checkpoint state access. Stages 1/2 (zero.cpp) and 3 (zero3.cpp) derive from it.
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "comm/scalar_all_reduce.h"
#include "core/error.h"
#include "parallel/buckets.h"
#include "parallel/registered_buffers.h"
#include "parallel/strategy.h"

namespace shardtrain {

/// What stages 1, 2 and 3 share: the partition of the layout into buckets and of each bucket
/// into one slice per rank (buckets.h), the fp32 master weights and AdamW state of the owned
/// slices, the optimizer step, the gradient norm and the checkpoint state. Subclasses own the
/// parameter storage (own_params, gather_target) and the gradients.
class ZeroStrategy : public Strategy {
 public:
  ZeroStrategy(const StrategyOptions& options, Backend& backend, Communicator& comm)
      : opt_(options), backend_(backend), comm_(comm) {}

  void setup(GPT2Model& model, const std::vector<float>& init) final {
    model_ = &model;
    const ParamLayout& layout = model.layout();
    ST_ASSERT(init.empty() || static_cast<int64_t>(init.size()) == layout.numel());
    world_ = comm_.world_size();
    rank_ = comm_.rank();
    dtype_ = backend_.compute_dtype();
    check<ConfigError>(opt_.reduce_bucket_size >= 1 && opt_.allgather_bucket_size >= 1,
                       "zero_optimization.reduce_bucket_size ({}) and allgather_bucket_size ({}) "
                       "must be >= 1 element",
                       opt_.reduce_bucket_size, opt_.allgather_bucket_size);
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
    if (dtype_ != DType::kF32) master_ = FlatBuffer(backend_, DType::kF32, shard_numel_);
    // AdamW m and v of every owned slice in two buffers laid out like the slices (one device
    // allocation each rather than two per slice).
    exp_avg_ = FlatBuffer(backend_, DType::kF32, shard_numel_);
    exp_avg_sq_ = FlatBuffer(backend_, DType::kF32, shard_numel_);
    optimizers_.clear();
    optimizers_.resize(parts_.size());
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      if (p.owned_numel > 0)
        optimizers_[i] =
            std::make_unique<AdamW>(backend_, layout, p.owned_offset, p.owned_numel, opt_.adamw,
                                    exp_avg_.slice(p.shard_offset, p.owned_numel),
                                    exp_avg_sq_.slice(p.shard_offset, p.owned_numel));
    }
    norm_reduce_ = std::make_unique<ScalarAllReduce>(backend_, comm_, 1);
    allocate_gradients();
    std::vector<Tensor> buffers = gradient_buffers();
    for (const Tensor& t : param_buffers()) buffers.push_back(t);
    registered_ = RegisteredBuffers(comm_, backend_, buffers);
    if (!init.empty()) write_full(init.data(), nullptr, nullptr, 0);  // else all zero
    bind_layers();
    model.set_hooks(this);
  }

  double grad_norm(double scale) override {
    double local = 0;
    for (size_t i = 0; i < parts_.size(); ++i)
      if (parts_[i].owned_numel > 0) local += backend_.sum_squares(grad_shard(i));
    return std::sqrt(sum_over_ranks(local)) * scale;
  }

  void step(double lr, double grad_scale) override {
    ++steps_;
    before_update();
    const bool separate_master = master_.numel() > 0;
    AllGatherWindow window(comm_, opt_.allgather_bucket_size);
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      if (optimizers_[i]) {
        optimizers_[i]->step(master(i), grad_shard(i),
                             separate_master ? own_params(i).slice1d(0, p.owned_numel) : Tensor(),
                             lr, grad_scale);
      }
      publish(i, window);
    }
  }

  FullState gather_state() override {
    const auto n = static_cast<size_t>(model_->layout().numel());
    FullState s;
    s.params.resize(n);
    s.exp_avg.resize(n);
    s.exp_avg_sq.resize(n);
    s.optimizer_steps = steps_;
    FlatBuffer stage(backend_, DType::kF32, max_padded_);
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      AdamW* opt = optimizers_[i].get();
      const std::pair<Tensor, std::vector<float>*> quantities[] = {
          {opt ? master(i) : Tensor(), &s.params},
          {opt ? opt->exp_avg() : Tensor(), &s.exp_avg},
          {opt ? opt->exp_avg_sq() : Tensor(), &s.exp_avg_sq}};
      for (const auto& [src, dst] : quantities) {
        Tensor own = stage.slice(static_cast<int64_t>(rank_) * p.shard, p.shard);
        backend_.fill_zero(own);
        if (opt) backend_.copy(own.data, src.data, src.bytes());
        comm_.all_gather(stage.slice(0, p.padded), own)->wait();
        backend_.copy_to_host(dst->data() + p.bucket.offset, stage.data(),
                              static_cast<size_t>(p.bucket.numel) * sizeof(float));
      }
    }
    return s;
  }

  void load_state(const FullState& s) override {
    const auto n = static_cast<size_t>(model_->layout().numel());
    ST_ASSERT(s.params.size() == n && s.exp_avg.size() == n && s.exp_avg_sq.size() == n);
    write_full(s.params.data(), s.exp_avg.data(), s.exp_avg_sq.data(), s.optimizer_steps);
  }

  std::vector<FlatRange> save_ranges() const final {
    std::vector<FlatRange> out;
    for (const BucketPartition& p : parts_)
      if (p.owned_numel > 0) out.push_back({p.owned_offset, p.owned_numel});
    std::sort(out.begin(), out.end(),
              [](const FlatRange& x, const FlatRange& y) { return x.offset < y.offset; });
    return out;
  }
  std::vector<FlatRange> load_ranges() const final { return save_ranges(); }

  void read_state(StateTensor q, int64_t offset, int64_t numel, float* host) final {
    const Tensor src = owned_state(q, offset, numel);
    backend_.copy_to_host(host, src.data, src.bytes());
  }
  void write_state(StateTensor q, int64_t offset, int64_t numel, const float* host) final {
    const Tensor dst = owned_state(q, offset, numel);
    backend_.copy_from_host(dst.data, host, dst.bytes());
  }
  void finish_load(int64_t optimizer_steps) final {
    before_update();
    AllGatherWindow window(comm_, opt_.allgather_bucket_size);
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      if (optimizers_[i]) {
        optimizers_[i]->set_step_count(optimizer_steps);
        if (master_.numel() > 0)
          backend_.convert(own_params(i).slice1d(0, p.owned_numel), master(i));
      }
      publish(i, window);
    }
    window.drain();
    steps_ = optimizer_steps;
  }
  int64_t optimizer_steps() const final { return steps_; }
  int64_t gathered_bytes_last_step() const override { return gathered_bytes_; }

  size_t model_state_bytes() const override {
    size_t bytes = param_bytes() + master_.bytes() + gradient_bytes();
    bytes += exp_avg_.bytes() + exp_avg_sq_.bytes();
    return bytes;
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
        !opt_.reduce_bucket_size_set && comm_.registration_staging_bytes() > 0;
    // Tied sources (the embedding, whose wte the LM head reads) get buckets of their own: their
    // gradients are written by a later layer's backward before their own (ParamLayout::tie).
    return build_grad_buckets(layout,
                              overlap_default ? kOverlapBucketElements : opt_.reduce_bucket_size,
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
  /// Where part `i`'s updated slices are all-gathered after a step ([padded], own_params(i) its
  /// slice rank), or an empty tensor when nothing needs gathering (stage 3's sharded parts).
  virtual Tensor gather_target(size_t i) const {
    return params_.slice(parts_[i].padded_offset, parts_[i].padded);
  }
  /// Called before the parameters change (step, load): stage 3 drops gathered copies.
  virtual void before_update() {}

  /// Makes part `i`'s updated own slice visible where the model reads it.
  void publish(size_t i, AllGatherWindow& window) {
    const Tensor target = gather_target(i);
    if (target.empty()) return;
    window.add(target, own_params(i));
    gathered_bytes_ += static_cast<int64_t>(target.bytes());
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
    model_->layer(layer).bind(r, params_.slice(p.padded_offset + in_bucket, r.numel),
                              grad_bucket.slice1d(in_bucket, r.numel));
  }

  int part_of(int layer) const { return part_of_layer_[static_cast<size_t>(layer)]; }

  /// fp32 master weights of the real elements owned in part `i` [owned_numel].
  Tensor master(size_t i) const {
    const BucketPartition& p = parts_[i];
    if (master_.numel() == 0) return own_params(i).slice1d(0, p.owned_numel);
    return master_.slice(p.shard_offset, p.owned_numel);
  }

  /// Quantity `q` of the owned flat elements [offset, offset + numel) (inside one owned slice).
  Tensor owned_state(StateTensor q, int64_t offset, int64_t numel) const {
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      if (offset < p.owned_offset || offset + numel > p.owned_offset + p.owned_numel) continue;
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
  Backend& backend_;
  Communicator& comm_;
  GPT2Model* model_ = nullptr;
  int world_ = 1, rank_ = 0;
  DType dtype_ = DType::kF32;
  std::vector<GradBucket> buckets_;     ///< backward order; parts_[i] partitions buckets_[i]
  std::vector<BucketPartition> parts_;  ///< this rank's view of each bucket's partition
  std::vector<int> part_of_layer_;
  int64_t padded_numel_ = 0;  ///< Σ padded: the parameter buffer
  int64_t shard_numel_ = 0;   ///< Σ shard: buffers of this rank's slices
  int64_t max_padded_ = 0;
  FlatBuffer params_;           ///< stages 1/2: [padded_numel_] compute dtype, every parameter
  int64_t gathered_bytes_ = 0;  ///< parameter bytes all-gathered since zero_grad()
  FlatBuffer master_;  ///< [shard_numel_] fp32 owned master weights; empty for fp32 compute
  FlatBuffer exp_avg_, exp_avg_sq_;  ///< [shard_numel_] fp32 AdamW m and v, laid out like master_
  std::vector<std::unique_ptr<AdamW>> optimizers_;  ///< per part; null where nothing is owned
  std::unique_ptr<ScalarAllReduce> norm_reduce_;    ///< for sum_over_ranks
  int64_t steps_ = 0;
  // params_ and gradient_buffers() for the copy-engine collectives. It outlives the subclasses'
  // gradient buffers by the rest of the destructor chain, which is harmless: nothing allocates
  // meanwhile, and freed blocks stay mapped in the caching allocator.
  RegisteredBuffers registered_;
};

}  // namespace shardtrain
