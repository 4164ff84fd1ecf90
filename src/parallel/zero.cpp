// ZeRO stages 1 and 2: the strategies `zero1` and `zero2` (Rajbhandari et al., "ZeRO: Memory
// Optimizations Toward Training Trillion Parameter Models", arXiv 1910.02054, §5.1 P_os and
// §5.2 P_os+g).
//
// Partition. The layout's layers are grouped into gradient buckets (parallel/buckets.h: runs of
// consecutive layers of at most zero.reduce_bucket_size elements, in backward order; the
// embedding always forms a bucket of its own). Every bucket is padded with zeros to a multiple of
// world·16 elements and split into `world` equal slices: rank r owns slice r of EVERY bucket
// (ZeRO partitions per bucket so that each reduce-scatter covers one whole bucket and delivers
// exactly the owned slice, §5.2). The owned elements of a rank are thus a set of slices, one per
// bucket; any parameter count works, the padding (zero parameters with zero gradient, never
// updated) absorbing counts that do not divide evenly.
//
// Buffers. Parameters are kept whole on every rank, in the compute dtype, in a buffer of padded
// buckets (each bucket's layers in layout order, its padding after them); the layers are bound to
// their ranges in it. fp32 master weights and AdamW m/v exist only for the owned slices: one
// AdamW object per owned slice (optim/adamw.h; its weight-decay mask follows the layout). With
// fp32 compute (CPU) the master weights ARE the owned slices of the parameter buffer, updated in
// place; with bf16/fp16 compute they are a compact fp32 buffer of the slices and AdamW writes the
// rounded weights into the parameter buffer. After the update every bucket is all-gathered in
// place (input = the rank's own slice of the output), at most zero.allgather_bucket_size elements
// in flight, each launched as soon as its slice is updated so that it overlaps the next AdamW.
// This is ZeRO's 2Ψ + 2Ψ + 12Ψ/N (stage 1) and 2Ψ + 14Ψ/N (stage 2) bytes for bf16 compute.
//
// zero1 = zero2 without gradient partitioning: full gradients in a buffer of padded buckets,
// accumulated locally over the micro-steps; during the backward of the LAST micro-step each bucket
// is reduce-scattered in place (output = the rank's own slice of the bucket) as soon as its layers
// are done, overlapping the rest of backward.
//
// zero2: each rank keeps a persistent gradient shard (the compute dtype, one slice per bucket)
// and transient bucket buffers. During the backward of EVERY micro-step (as DeepSpeed reduces each
// micro-step): before_backward of a bucket's first (highest-index) layer takes the next of two
// bucket buffers (one when there is a single such bucket), zeroes it and rebinds the bucket's
// layers' gradient views into it; after_backward of its last layer reduce-scatters it in place
// (async) and the result is added into the gradient shard when that buffer is needed again (or
// in finish_gradients), in issue order. Tied weights (ParamLayout::tie): the LM head writes the wte
// gradient into the embedding layer's dwte view during ITS backward, before the embedding runs; so
// every tied source's gradients live in a persistent buffer of their own, always bound, zeroed
// before its first user's backward and reduce-scattered after its own backward.
//
// Gradient norm: the sum of squares of the owned reduced gradients, summed over ranks in rank
// order in double precision (each rank contributes its sum as a pair of floats: all_gather), so
// every rank gets the same bits. Checkpoints: gather_state() all-gathers master weights, m and v
// bucket by bucket into the unpadded flat layout; load_state() copies each rank's owned slices
// out of it, so a checkpoint written with N ranks resumes with any M.
#include "parallel/zero.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <deque>
#include <limits>

#include "core/error.h"
#include "parallel/buckets.h"
#include "parallel/registered_buffers.h"

namespace shardtrain {
namespace {

/// What stages 1 and 2 share: the partition, parameters and master weights, the optimizer step,
/// the gradient norm and the checkpoint state. Subclasses own the gradients.
class ZeroStrategy : public Strategy {
 public:
  ZeroStrategy(const StrategyOptions& options, Backend& backend, Communicator& comm)
      : opt_(options), backend_(backend), comm_(comm) {}

  void setup(GPT2Model& model, const std::vector<float>& init) final {
    model_ = &model;
    const ParamLayout& layout = model.layout();
    ST_ASSERT(static_cast<int64_t>(init.size()) == layout.numel());
    world_ = comm_.world_size();
    rank_ = comm_.rank();
    dtype_ = backend_.compute_dtype();
    check<ConfigError>(opt_.reduce_bucket_size >= 1 && opt_.allgather_bucket_size >= 1,
                       "zero_optimization.reduce_bucket_size ({}) and allgather_bucket_size ({}) "
                       "must be >= 1 element",
                       opt_.reduce_bucket_size, opt_.allgather_bucket_size);
    const bool overlap_default =
        !opt_.reduce_bucket_size_set && comm_.registration_staging_bytes() > 0;
    // Tied sources (the embedding, whose wte the LM head reads) get buckets of their own: their
    // gradients are written by a later layer's backward before their own (ParamLayout::tie).
    std::vector<int> tied_sources;
    for (int l = 0; l < layout.num_layers(); ++l)
      if (layout.is_tied_source(l)) tied_sources.push_back(l);
    buckets_ = build_grad_buckets(
        layout, overlap_default ? kOverlapBucketElements : opt_.reduce_bucket_size, tied_sources);
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
    params_ = FlatBuffer(backend_, dtype_, padded_numel_);
    if (dtype_ != DType::kF32) master_ = FlatBuffer(backend_, DType::kF32, shard_numel_);
    const AdamWHyper hyper = opt_.adamw;
    optimizers_.clear();
    optimizers_.resize(parts_.size());
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      if (p.owned_numel > 0)
        optimizers_[i] =
            std::make_unique<AdamW>(backend_, layout, p.owned_offset, p.owned_numel, hyper);
    }
    norm_buf_ = FlatBuffer(backend_, DType::kF32, 2 * static_cast<int64_t>(world_));
    allocate_gradients();
    write_params(init);
    std::vector<Tensor> buffers = gradient_buffers();
    buffers.push_back(params_.view());
    registered_ = RegisteredBuffers(comm_, backend_, buffers);
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
    const bool separate_master = master_.numel() > 0;
    std::vector<std::unique_ptr<Work>> in_flight;
    int64_t in_flight_numel = 0;
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      if (optimizers_[i]) {
        optimizers_[i]->step(master(i), grad_shard(i),
                             separate_master ? own_params(i).slice1d(0, p.owned_numel) : Tensor(),
                             lr, grad_scale);
      }
      if (!in_flight.empty() && in_flight_numel + p.padded > opt_.allgather_bucket_size) {
        for (auto& w : in_flight) w->wait();
        in_flight.clear();
        in_flight_numel = 0;
      }
      in_flight.push_back(
          comm_.all_gather(params_.slice(p.padded_offset, p.padded), own_params(i)));
      in_flight_numel += p.padded;
    }
    for (auto& w : in_flight) w->wait();
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
          {opt ? opt->exp_avg().view() : Tensor(), &s.exp_avg},
          {opt ? opt->exp_avg_sq().view() : Tensor(), &s.exp_avg_sq}};
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
    write_params(s.params);
    for (size_t i = 0; i < parts_.size(); ++i) {
      AdamW* opt = optimizers_[i].get();
      if (!opt) continue;
      const BucketPartition& p = parts_[i];
      const size_t bytes = static_cast<size_t>(p.owned_numel) * sizeof(float);
      backend_.copy_from_host(opt->exp_avg().data(), s.exp_avg.data() + p.owned_offset, bytes);
      backend_.copy_from_host(opt->exp_avg_sq().data(), s.exp_avg_sq.data() + p.owned_offset,
                              bytes);
      opt->set_step_count(s.optimizer_steps);
    }
    steps_ = s.optimizer_steps;
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
    std::vector<std::unique_ptr<Work>> in_flight;
    int64_t in_flight_numel = 0;
    for (size_t i = 0; i < parts_.size(); ++i) {
      const BucketPartition& p = parts_[i];
      if (optimizers_[i]) {
        optimizers_[i]->set_step_count(optimizer_steps);
        if (master_.numel() > 0) backend_.convert(own_params(i).slice1d(0, p.owned_numel), master(i));
      }
      if (!in_flight.empty() && in_flight_numel + p.padded > opt_.allgather_bucket_size) {
        for (auto& w : in_flight) w->wait();
        in_flight.clear();
        in_flight_numel = 0;
      }
      in_flight.push_back(comm_.all_gather(params_.slice(p.padded_offset, p.padded), own_params(i)));
      in_flight_numel += p.padded;
    }
    for (auto& w : in_flight) w->wait();
    steps_ = optimizer_steps;
  }
  int64_t optimizer_steps() const final { return steps_; }

  size_t model_state_bytes() const override {
    size_t bytes = params_.bytes() + master_.bytes() + gradient_bytes();
    for (const auto& opt : optimizers_)
      if (opt) bytes += opt->exp_avg().bytes() + opt->exp_avg_sq().bytes();
    return bytes;
  }

 protected:
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

  /// This rank's slice of part `i` in the parameter buffer [shard], padding included.
  Tensor own_params(size_t i) const {
    const BucketPartition& p = parts_[i];
    return params_.slice(p.padded_offset + static_cast<int64_t>(rank_) * p.shard, p.shard);
  }

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
      const Tensor whole = q == StateTensor::kParams  ? master(i)
                           : q == StateTensor::kExpAvg ? optimizers_[i]->exp_avg().view()
                                                       : optimizers_[i]->exp_avg_sq().view();
      return whole.slice1d(offset - p.owned_offset, numel);
    }
    throw RuntimeFailure(fmt::format("{}: elements [{}, {}) are not owned by rank {}", name(),
                                     offset, offset + numel, rank_));
  }

  /// Loads full fp32 parameters (host, flat layout) into the parameter buffer and the master
  /// weights of the owned slices. No communication: every rank passes the same values.
  void write_params(const std::vector<float>& host) {
    if (dtype_ == DType::kF32) {
      for (const BucketPartition& p : parts_)
        backend_.copy_from_host(params_.slice(p.padded_offset, p.bucket.numel).data,
                                host.data() + p.bucket.offset,
                                static_cast<size_t>(p.bucket.numel) * sizeof(float));
      return;
    }
    FlatBuffer stage(backend_, DType::kF32, max_padded_);
    for (const BucketPartition& p : parts_) {
      backend_.copy_from_host(stage.data(), host.data() + p.bucket.offset,
                              static_cast<size_t>(p.bucket.numel) * sizeof(float));
      backend_.convert(params_.slice(p.padded_offset, p.bucket.numel),
                       stage.slice(0, p.bucket.numel));
      if (p.owned_numel > 0)
        backend_.copy_from_host(master_.slice(p.shard_offset, p.owned_numel).data,
                                host.data() + p.owned_offset,
                                static_cast<size_t>(p.owned_numel) * sizeof(float));
    }
  }

  /// Σ over ranks of `x` in double, added in rank order: identical on every rank. Each rank
  /// contributes x as the float pair (hi, x - hi), which keeps ~48 bits.
  double sum_over_ranks(double x) {
    float pair[2] = {0.0f, 0.0f};
    if (std::isfinite(x) && std::fabs(x) <= static_cast<double>(FLT_MAX)) {
      pair[0] = static_cast<float>(x);
      pair[1] = static_cast<float>(x - static_cast<double>(pair[0]));
    } else {
      pair[0] = std::isnan(x) ? std::numeric_limits<float>::quiet_NaN()
                              : std::numeric_limits<float>::infinity();
    }
    Tensor own = norm_buf_.slice(2 * static_cast<int64_t>(rank_), 2);
    backend_.copy_from_host(own.data, pair, sizeof pair);
    comm_.all_gather(norm_buf_.view(), own)->wait();
    std::vector<float> all(static_cast<size_t>(2 * world_));
    backend_.copy_to_host(all.data(), norm_buf_.data(), all.size() * sizeof(float));
    double sum = 0;
    for (int r = 0; r < world_; ++r)
      sum += static_cast<double>(all[2 * static_cast<size_t>(r)]) +
             static_cast<double>(all[2 * static_cast<size_t>(r) + 1]);
    return sum;
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
  FlatBuffer params_;  ///< [padded_numel_] compute dtype, every parameter (padded buckets)
  FlatBuffer master_;  ///< [shard_numel_] fp32 owned master weights; empty for fp32 compute
  std::vector<std::unique_ptr<AdamW>> optimizers_;  ///< per part; null where nothing is owned
  FlatBuffer norm_buf_;                             ///< [2·world] fp32 for sum_over_ranks
  int64_t steps_ = 0;
  // params_ and gradient_buffers() for the copy-engine collectives. It outlives the subclasses'
  // gradient buffers by the rest of the destructor chain, which is harmless: nothing allocates
  // meanwhile, and freed blocks stay mapped in the caching allocator.
  RegisteredBuffers registered_;
};

/// ZeRO stage 1 (P_os, arXiv 1910.02054 §5.1): optimizer states partitioned; full gradients
/// reduce-scattered once per optimizer step, bucket by bucket during the last micro-step's
/// backward.
class Zero1 final : public ZeroStrategy {
 public:
  using ZeroStrategy::ZeroStrategy;
  std::string name() const override { return "zero1"; }

  void zero_grad() override {
    backend_.fill_zero(grads_.view());
    readiness_.reset();
  }

  void begin_micro_step(int64_t index, int64_t count) override {
    last_micro_ = index + 1 == count;
    if (last_micro_) readiness_.reset();
  }

  void after_backward(int layer) override {
    if (!last_micro_) return;
    const int b = readiness_.layer_done(layer);
    if (b < 0) return;
    const BucketPartition& p = parts_[static_cast<size_t>(b)];
    // In place: the rank's own slice of the bucket receives the sum of that slice over ranks.
    pending_.push_back(comm_.reduce_scatter(own_grads(static_cast<size_t>(b)),
                                            grads_.slice(p.padded_offset, p.padded),
                                            ReduceOp::kSum));
  }

  void finish_gradients() override {
    for (auto& w : pending_) w->wait();
    pending_.clear();
  }

 protected:
  void allocate_gradients() override {
    grads_ = FlatBuffer(backend_, dtype_, padded_numel_);
    readiness_ = BucketReadiness(buckets_, model_->num_layers());
  }

  void bind_layers() override {
    for (int l = 0; l < model_->num_layers(); ++l) {
      const BucketPartition& p = parts_[static_cast<size_t>(part_of(l))];
      bind_layer(l, grads_.slice(p.padded_offset, p.padded));
    }
  }

  Tensor grad_shard(size_t i) const override {
    return own_grads(i).slice1d(0, parts_[i].owned_numel);
  }

  size_t gradient_bytes() const override { return grads_.bytes(); }

  std::vector<Tensor> gradient_buffers() const override { return {grads_.view()}; }

 private:
  Tensor own_grads(size_t i) const {
    const BucketPartition& p = parts_[i];
    return grads_.slice(p.padded_offset + static_cast<int64_t>(rank_) * p.shard, p.shard);
  }

  FlatBuffer grads_;  ///< [padded_numel_] compute dtype, laid out like params_
  BucketReadiness readiness_;
  std::vector<std::unique_ptr<Work>> pending_;
  bool last_micro_ = true;
};

/// ZeRO stage 2 (P_os+g, arXiv 1910.02054 §5.2): optimizer states and gradients partitioned;
/// every micro-step's gradients are reduce-scattered bucket by bucket into the rank's gradient
/// shard, overlapped with backward.
class Zero2 final : public ZeroStrategy {
 public:
  using ZeroStrategy::ZeroStrategy;
  std::string name() const override { return "zero2"; }

  void zero_grad() override {
    drain_all();
    backend_.fill_zero(shard_.view());
  }

  void begin_micro_step(int64_t, int64_t) override {}

  void before_backward(int layer) override {
    const ParamLayout& layout = model_->layout();
    for (int src : layout.layers()[static_cast<size_t>(layer)].reads) {
      // `layer` (the LM head) is the first in backward to write the gradient of the tied source
      // `src` (the embedding): its buffer must be free and zeroed now.
      if (layout.users(src).back() != layer) continue;
      const int tag = tied_tag(part_of(src));
      drain_through(tag);
      backend_.fill_zero(buffer(tag).view());
    }
    const int i = part_of(layer);
    const BucketPartition& p = parts_[static_cast<size_t>(i)];
    if (tied_tag(i) != kNoTag || layer != p.bucket.last_layer) return;
    const int s = next_slot_;
    next_slot_ = (next_slot_ + 1) % static_cast<int>(slots_.size());
    drain_through(s);
    Tensor buf = slots_[static_cast<size_t>(s)].slice(0, p.padded);
    backend_.fill_zero(buf);
    for (int l = p.bucket.first_layer; l <= p.bucket.last_layer; ++l) bind_layer(l, buf);
    slot_of_part_[static_cast<size_t>(i)] = s;
  }

  void after_backward(int layer) override {
    const int i = part_of(layer);
    const BucketPartition& p = parts_[static_cast<size_t>(i)];
    if (layer != p.bucket.first_layer) return;
    const int tag = tied_tag(i) != kNoTag ? tied_tag(i) : slot_of_part_[static_cast<size_t>(i)];
    const FlatBuffer& buf = buffer(tag);
    Tensor own = buf.slice(static_cast<int64_t>(rank_) * p.shard, p.shard);
    // In place: the rank's own slice of the bucket buffer receives the sum over ranks.
    pending_.push_back(
        {i, tag, own, comm_.reduce_scatter(own, buf.slice(0, p.padded), ReduceOp::kSum)});
  }

  void finish_gradients() override { drain_all(); }

 protected:
  void allocate_gradients() override {
    shard_ = FlatBuffer(backend_, dtype_, shard_numel_);
    const ParamLayout& layout = model_->layout();
    tied_tag_of_part_.assign(parts_.size(), kNoTag);
    tied_bufs_.clear();
    for (int l = 0; l < layout.num_layers(); ++l) {
      if (!layout.is_tied_source(l)) continue;  // a bucket of its own (setup)
      const int i = part_of(l);
      tied_tag_of_part_[static_cast<size_t>(i)] = -2 - static_cast<int>(tied_bufs_.size());
      tied_bufs_.emplace_back(backend_, dtype_, parts_[static_cast<size_t>(i)].padded);
    }
    int64_t max_regular = 0;
    int regular = 0;
    for (size_t i = 0; i < parts_.size(); ++i) {
      if (tied_tag_of_part_[i] != kNoTag) continue;
      max_regular = std::max(max_regular, parts_[i].padded);
      ++regular;
    }
    ST_ASSERT(regular >= 1);
    slots_.clear();
    for (int s = 0; s < std::min(2, regular); ++s)
      slots_.emplace_back(backend_, dtype_, max_regular);
    slot_of_part_.assign(parts_.size(), 0);
    next_slot_ = 0;
  }

  void bind_layers() override {
    for (int l = 0; l < model_->num_layers(); ++l) {
      const int i = part_of(l);
      const BucketPartition& p = parts_[static_cast<size_t>(i)];
      bind_layer(l, tied_tag(i) != kNoTag ? buffer(tied_tag(i)).view() : slots_[0].slice(0, p.padded));
    }
  }

  Tensor grad_shard(size_t i) const override {
    return shard_.slice(parts_[i].shard_offset, parts_[i].owned_numel);
  }

  size_t gradient_bytes() const override {
    size_t bytes = shard_.bytes();
    for (const auto& b : tied_bufs_) bytes += b.bytes();
    for (const auto& s : slots_) bytes += s.bytes();
    return bytes;
  }

  std::vector<Tensor> gradient_buffers() const override {
    std::vector<Tensor> buffers;
    for (const auto& b : tied_bufs_) buffers.push_back(b.view());
    for (const auto& s : slots_) buffers.push_back(s.view());
    return buffers;
  }

 private:
  /// Buffer tags: a slot index (>= 0), or -2 - k for tied_bufs_[k].
  static constexpr int kNoTag = -1;

  /// The tag of the persistent buffer of part `i` when it holds a tied source, else kNoTag.
  int tied_tag(int i) const { return tied_tag_of_part_[static_cast<size_t>(i)]; }
  const FlatBuffer& buffer(int tag) const {
    return tag >= 0 ? slots_[static_cast<size_t>(tag)] : tied_bufs_[static_cast<size_t>(-2 - tag)];
  }

  /// A reduce-scatter in flight: its result lands in `own` (a slice of bucket buffer `tag`).
  struct Pending {
    int part;
    int tag;  ///< see buffer()
    Tensor own;
    std::unique_ptr<Work> work;
  };

  /// Waits for the oldest pending reduction and adds it into the gradient shard.
  void complete_front() {
    Pending& q = pending_.front();
    q.work->wait();
    const BucketPartition& p = parts_[static_cast<size_t>(q.part)];
    Tensor dst = shard_.slice(p.shard_offset, p.shard);
    backend_.add(dst, dst, q.own);
    pending_.pop_front();
  }

  /// Completes pending reductions in issue order up to the last one using buffer `tag`.
  void drain_through(int tag) {
    size_t last = pending_.size();
    for (size_t k = 0; k < pending_.size(); ++k)
      if (pending_[k].tag == tag) last = k;
    if (last == pending_.size()) return;
    for (size_t k = 0; k <= last; ++k) complete_front();
  }

  void drain_all() {
    while (!pending_.empty()) complete_front();
  }

  FlatBuffer shard_;      ///< [shard_numel_] compute dtype: Σ over micro-steps and ranks, owned
  /// Per tied source (the embedding): a persistent buffer [its padded bucket], always bound.
  std::vector<FlatBuffer> tied_bufs_;
  std::vector<int> tied_tag_of_part_;
  std::vector<FlatBuffer> slots_;  ///< 1 or 2 transient bucket buffers [max padded bucket]
  std::vector<int> slot_of_part_;
  int next_slot_ = 0;
  std::deque<Pending> pending_;
};

}  // namespace

std::unique_ptr<Strategy> make_zero_strategy(const StrategyOptions& options, Backend& backend,
                                             Communicator& comm) {
  switch (options.plan.zero_stage) {
    case 1:
      return std::make_unique<Zero1>(options, backend, comm);
    case 2:
      return std::make_unique<Zero2>(options, backend, comm);
    default:
      ST_ASSERT(false && "make_zero_strategy: not a ZeRO stage 1/2 plan");
  }
  return nullptr;
}

}  // namespace shardtrain
