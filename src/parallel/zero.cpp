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
// Across nodes (--hierarchical-all-reduce): every reduce-scatter above goes in two steps, within
// the node and then across nodes with 1/k of the bucket, optionally in int8
// (parallel/hierarchical_reduction.h); the slices rank r owns are the same.
//
// Gradient norm: the sum of squares of the owned reduced gradients, summed over ranks in rank
// order in double precision (each rank contributes its sum as a pair of floats: all_gather), so
// every rank gets the same bits. Checkpoints: gather_state() all-gathers master weights, m and v
// bucket by bucket into the unpadded flat layout; load_state() copies each rank's owned slices
// out of it, so a checkpoint written with N ranks resumes with any M.
#include "parallel/zero.h"

#include <deque>

#include "parallel/zero_base.h"

namespace shardtrain {
namespace {

/// ZeRO stage 1 (P_os, arXiv 1910.02054 §5.1): optimizer states partitioned; full gradients
/// reduce-scattered once per optimizer step, bucket by bucket during the last micro-step's
/// backward.
class Zero1 final : public ZeroStrategy {
 public:
  using ZeroStrategy::ZeroStrategy;
  std::string name() const override { return "zero1"; }
  Tensor compute_parameters() override {
    wait_for_parameters();
    return params_.view();
  }

  void zero_grad() override {
    gathered_bytes_ = 0;
    start_cross_node_count();
    if (offload_) offload_->before_gradients_change();
    backend_.fill_zero(grads_.view());
    readiness_.reset();
  }

  void begin_micro_step(int64_t index, int64_t count) override {
    last_micro_ = index + 1 == count;
    if (last_micro_) readiness_.reset();
  }

  void after_backward(int layer) override {
    if (!last_micro_ || !opt_.zero.overlap_comm) return;
    const int b = readiness_.layer_done(layer);
    if (b >= 0) reduce(static_cast<size_t>(b));
    progress_reductions();
  }

  void finish_gradients() override {
    // overlap_comm false: every bucket is reduced here, after backward.
    if (!opt_.zero.overlap_comm)
      for (size_t b = 0; b < parts_.size(); ++b) reduce(b);
    for (auto& w : reductions_) w->wait();
    reductions_.clear();
    offload_remaining_gradients();
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
  /// Reduce-scatters bucket `b` in place: the rank's own slice receives the sum over ranks.
  void reduce(size_t b) {
    const BucketPartition& p = parts_[b];
    reductions_.push_back(
        reduce_scatter_gradients(own_grads(b), grads_.slice(p.padded_offset, p.padded)));
  }

  Tensor own_grads(size_t i) const {
    const BucketPartition& p = parts_[i];
    return grads_.slice(p.padded_offset + static_cast<int64_t>(rank_) * p.shard, p.shard);
  }

  FlatBuffer grads_;  ///< [padded_numel_] compute dtype, laid out like params_
  BucketReadiness readiness_;
  std::vector<std::unique_ptr<Work>> reductions_;
  bool last_micro_ = true;
};

/// ZeRO stage 2 (P_os+g, arXiv 1910.02054 §5.2): optimizer states and gradients partitioned;
/// every micro-step's gradients are reduce-scattered bucket by bucket into the rank's gradient
/// shard, overlapped with backward.
class Zero2 final : public ZeroStrategy {
 public:
  using ZeroStrategy::ZeroStrategy;
  std::string name() const override { return "zero2"; }
  Tensor compute_parameters() override {
    wait_for_parameters();
    return params_.view();
  }

  void zero_grad() override {
    gathered_bytes_ = 0;
    drain_all();
    start_cross_node_count();
    if (offload_) offload_->before_gradients_change();
    backend_.fill_zero(shard_.view());
  }

  void begin_micro_step(int64_t index, int64_t count) override { last_micro_ = index + 1 == count; }

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
    progress_reductions();
    const int i = part_of(layer);
    const BucketPartition& p = parts_[static_cast<size_t>(i)];
    if (layer != p.bucket.first_layer) return;
    const int tag = tied_tag(i) != kNoTag ? tied_tag(i) : slot_of_part_[static_cast<size_t>(i)];
    const FlatBuffer& buf = buffer(tag);
    Tensor own = buf.slice(static_cast<int64_t>(rank_) * p.shard, p.shard);
    // In place: the rank's own slice of the bucket buffer receives the sum over ranks.
    reductions_.push_back(
        {i, tag, own, reduce_scatter_gradients(own, buf.slice(0, p.padded)), last_micro_});
    if (!opt_.zero.overlap_comm) drain_all();  // no reduction runs behind the rest of backward
  }

  void finish_gradients() override {
    drain_all();
    offload_remaining_gradients();
  }

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
      bind_layer(l,
                 tied_tag(i) != kNoTag ? buffer(tied_tag(i)).view() : slots_[0].slice(0, p.padded));
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
  struct Reduction {
    int part;
    int tag;  ///< see buffer()
    Tensor own;
    std::unique_ptr<Work> work;
    bool last_micro;  ///< of the step's last micro-batch: completes the part's gradient
  };

  /// Waits for the oldest pending reduction and adds it into the gradient shard; with the
  /// optimizer offloaded, a part's final gradient then leaves for the host (during backward).
  void complete_front() {
    Reduction& q = reductions_.front();
    q.work->wait();
    const BucketPartition& p = parts_[static_cast<size_t>(q.part)];
    Tensor dst = shard_.slice(p.shard_offset, p.shard);
    backend_.add(dst, dst, q.own);
    if (q.last_micro) offload_gradient(static_cast<size_t>(q.part));
    reductions_.pop_front();
  }

  /// Completes pending reductions in issue order up to the last one using buffer `tag`.
  void drain_through(int tag) {
    size_t last = reductions_.size();
    for (size_t k = 0; k < reductions_.size(); ++k)
      if (reductions_[k].tag == tag) last = k;
    if (last == reductions_.size()) return;
    for (size_t k = 0; k <= last; ++k) complete_front();
  }

  void drain_all() {
    while (!reductions_.empty()) complete_front();
  }

  FlatBuffer shard_;  ///< [shard_numel_] compute dtype: Σ over micro-steps and ranks, owned
  /// Per tied source (the embedding): a persistent buffer [its padded bucket], always bound.
  std::vector<FlatBuffer> tied_bufs_;
  std::vector<int> tied_tag_of_part_;
  std::vector<FlatBuffer> slots_;  ///< 1 or 2 transient bucket buffers [max padded bucket]
  std::vector<int> slot_of_part_;
  int next_slot_ = 0;
  std::deque<Reduction> reductions_;
  bool last_micro_ = true;
};

}  // namespace

std::unique_ptr<Strategy> make_zero_strategy(const StrategyOptions& options,
                                             const OffloadPolicy& offload, Backend& backend,
                                             Communicator& comm) {
  switch (options.plan.zero_stage) {
    case 1:
      return std::make_unique<Zero1>(options, offload, backend, comm);
    case 2:
      return std::make_unique<Zero2>(options, offload, backend, comm);
    default:
      ST_ASSERT(false && "make_zero_strategy: not a ZeRO stage 1/2 plan");
  }
  return nullptr;
}

}  // namespace shardtrain
