// Data parallelism: every rank holds all parameters, gradients and optimizer state (16Ψ bytes
// in mixed precision, ZeRO paper §5); gradients are all-reduced in buckets of whole layers,
// launched from the backward hook of the last micro-step as soon as a bucket's layers are done,
// so communication overlaps the rest of backward (Li et al., "PyTorch Distributed", VLDB 2020,
// §3.2.3); across nodes optionally in three steps (parallel/hierarchical_reduction.h). GPT-2's
// tied wte is reduced early, after the LM head's backward, and the embedding's part of its gradient
// exchanged as rows (parallel/tied_embedding_grad.h).
#include "parallel/data_parallel.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "parallel/buckets.h"
#include "parallel/hierarchical_reduction.h"
#include "parallel/registered_buffers.h"
#include "parallel/tied_embedding_grad.h"

namespace shardtrain {
namespace {

class DataParallel final : public Strategy {
 public:
  DataParallel(const StrategyOptions& options, Backend& backend, Communicator& comm)
      : opt_(options), backend_(backend), comm_(comm) {}

  std::string name() const override { return "dp"; }
  Tensor compute_parameters() override { return params_.view(); }

  void setup(Model& model, const std::vector<float>& init) override {
    model_ = &model;
    const ParamLayout& layout = model.layout();
    const int64_t n = layout.numel();
    ST_ASSERT(init.empty() || static_cast<int64_t>(init.size()) == n);
    const DType dt = backend_.compute_dtype();
    params_ = FlatBuffer(backend_, dt, n);
    grads_ = FlatBuffer(backend_, dt, n);
    if (dt != DType::kF32) master_ = FlatBuffer(backend_, DType::kF32, n);
    if (!init.empty()) {
      FlatBuffer& master = dt == DType::kF32 ? params_ : master_;
      backend_.copy_from_host(master.data(), init.data(), init.size() * sizeof(float));
      if (dt != DType::kF32) backend_.convert(params_.view(), master_.view());
    }
    optimizer_ = std::make_unique<Optimizer>(backend_, layout, 0, n, opt_.optimizer);
    model.bind(params_.view(), grads_.view());
    model.set_hooks(this);
    // DeepSpeed's 5e8-element default would make every model below 500 M parameters a single
    // bucket, reduced only after the whole backward. Unless a bucket size was given, dp uses
    // PyTorch DDP's default instead, so reductions overlap the rest of backward.
    buckets_ =
        build_grad_buckets(layout, opt_.zero.reduce_bucket_size_set ? opt_.zero.reduce_bucket_size
                                                                    : kOverlapBucketElements);
    readiness_ = BucketReadiness(buckets_, model.num_layers());
    tied_ = TiedEmbeddingGrad(backend_, comm_, layout, opt_.zero.overlap_comm);
    registered_ = RegisteredBuffers(comm_, backend_, {grads_.view()});
    const int k = opt_.hierarchical_ranks_per_node;
    if (k > 0 && comm_.world_size() > 1)
      hierarchical_ = std::make_unique<HierarchicalReduction>(comm_, k, backend_,
                                                              opt_.zero.quantized_gradients);
  }

  void zero_grad() override {
    backend_.fill_zero(grads_.view());
    if (hierarchical_) hierarchical_->reset_network_bytes();
  }
  int64_t cross_node_bytes_last_step() const override {
    return hierarchical_ ? hierarchical_->network_bytes() : 0;
  }

  /// No hook acts in forward.
  bool allows_layer_major_forward() const override { return true; }
  bool allows_layer_major_backward() const override { return true; }
  void begin_micro_step(int64_t index, int64_t count) override {
    last_micro_ = index + 1 == count;
    if (last_micro_) readiness_.reset();
  }

  void after_backward(int layer) override {
    if (!last_micro_ || comm_.world_size() == 1 || !reduce_in_backward_) return;
    // The tied wte, complete but for the embedding's rows: reduced on its own from here.
    if (tied_.active() && layer == tied_.reader_layer())
      pending_.push_back(comm_.all_reduce(tied_grad(), ReduceOp::kSum));
    const int b = readiness_.layer_done(layer);
    if (b >= 0) reduce(static_cast<size_t>(b));
    if (hierarchical_) hierarchical_->progress();  // the later steps of the buckets in flight
  }

  // after_backward reduces nothing on one rank, or when the reduction waits for
  // finish_gradients; the tied embedding (GPT-2) is not the image models' concern but is checked.
  bool capturable() const override {
    return (comm_.world_size() == 1 || !reduce_in_backward_) && !tied_.active();
  }
  // A graph of the whole micro-step: every bucket is all-reduced after the replay.
  bool allow_capture() override {
    if (!tied_.active()) reduce_in_backward_ = false;
    return capturable();
  }

  bool take_tied_embedding_grad(int64_t rows) override { return last_micro_ && tied_.take(rows); }
  void tied_embedding_grad(Tensor dx, Tensor tokens) override { tied_.gather(dx, tokens); }

  void finish_gradients() override {
    if (!reduce_in_backward_ && comm_.world_size() > 1)
      for (size_t b = 0; b < buckets_.size(); ++b) reduce(b);
    for (auto& w : pending_) w->wait();
    pending_.clear();
    if (tied_.active()) tied_.finish(tied_grad());
  }

  double grad_norm(double scale) override {
    return std::sqrt(backend_.sum_squares(grads_.view())) * scale;
  }

  void step(double lr, double grad_scale) override {
    Tensor master = master_.numel() ? master_.view() : params_.view();
    optimizer_->step(master, grads_.view(), master_.numel() ? params_.view() : Tensor(), lr,
                     grad_scale);
  }

  FullState gather_state() override {
    FullState s;
    const auto n = static_cast<size_t>(params_.numel());
    s.params.resize(n);
    s.optimizer = optimizer_->kind();
    const auto nv = static_cast<size_t>(optimizer_->exp_avg_sq().numel());  // 0 for SGD
    s.exp_avg.resize(n);
    s.exp_avg_sq.resize(nv);
    const FlatBuffer& master = master_.numel() ? master_ : params_;
    backend_.copy_to_host(s.params.data(), master.data(), n * sizeof(float));
    backend_.copy_to_host(s.exp_avg.data(), optimizer_->exp_avg().data, n * sizeof(float));
    if (nv) backend_.copy_to_host(s.exp_avg_sq.data(), optimizer_->exp_avg_sq().data, nv * 4);
    s.optimizer_steps = optimizer_->step_count();
    return s;
  }

  void load_state(const FullState& s) override {
    const auto n = static_cast<size_t>(params_.numel());
    const auto nv = static_cast<size_t>(optimizer_->exp_avg_sq().numel());  // 0 for SGD
    check_state_kind(s.optimizer, optimizer_->kind());
    ST_ASSERT(s.params.size() == n && s.exp_avg.size() == n && s.exp_avg_sq.size() == nv);
    FlatBuffer& master = master_.numel() ? master_ : params_;
    backend_.copy_from_host(master.data(), s.params.data(), n * sizeof(float));
    if (master_.numel()) backend_.convert(params_.view(), master_.view());
    backend_.copy_from_host(optimizer_->exp_avg().data, s.exp_avg.data(), n * sizeof(float));
    if (nv) backend_.copy_from_host(optimizer_->exp_avg_sq().data, s.exp_avg_sq.data(), nv * 4);
    optimizer_->set_step_count(s.optimizer_steps);
  }

  size_t model_state_bytes() const override {
    return params_.bytes() + grads_.bytes() + master_.bytes() + optimizer_->exp_avg().bytes() +
           optimizer_->exp_avg_sq().bytes();
  }

  std::vector<FlatRange> save_ranges() const override {
    return even_split(params_.numel(), comm_.world_size(), comm_.rank());
  }
  std::vector<FlatRange> load_ranges() const override { return {FlatRange{0, params_.numel()}}; }

  void read_state(StateTensor q, int64_t offset, int64_t numel, float* host) override {
    backend_.copy_to_host(host, state(q).slice1d(offset, numel).data,
                          static_cast<size_t>(numel) * sizeof(float));
  }
  void write_state(StateTensor q, int64_t offset, int64_t numel, const float* host) override {
    backend_.copy_from_host(state(q).slice1d(offset, numel).data, host,
                            static_cast<size_t>(numel) * sizeof(float));
  }
  void finish_load(int64_t optimizer_steps) override {
    if (master_.numel()) backend_.convert(params_.view(), master_.view());
    optimizer_->set_step_count(optimizer_steps);
  }
  int64_t optimizer_steps() const override { return optimizer_->step_count(); }
  OptimizerKind optimizer_kind() const override { return opt_.optimizer.kind; }

 private:
  /// The fp32 buffer of quantity `q` [numel].
  Tensor state(StateTensor q) const {
    switch (q) {
      case StateTensor::kExpAvg:
        return optimizer_->exp_avg();
      case StateTensor::kExpAvgSq:
        check<RuntimeFailure>(optimizer_->kind() == OptimizerKind::kAdamW,
                              "dp: SGD keeps no exp_avg_sq (a bug: its caller asked for it)");
        return optimizer_->exp_avg_sq();
      case StateTensor::kParams:
        break;
    }
    return master_.numel() ? master_.view() : params_.view();
  }

  /// All-reduces bucket `b`; while the tied exchange is active, without wte (reduced already).
  void reduce(size_t b) {
    const GradBucket& bk = buckets_[b];
    int64_t offset = bk.offset, numel = bk.numel;
    if (tied_.active() && bk.contains(tied_.source_layer())) {
      ST_ASSERT(offset == tied_.offset());  // the embedding is the bucket's first layer
      offset += tied_.numel();
      numel -= tied_.numel();
    }
    if (numel <= 0) return;
    const Tensor g = grads_.slice(offset, numel);
    pending_.push_back(hierarchical_ ? hierarchical_->all_reduce(g)
                                     : comm_.all_reduce(g, ReduceOp::kSum));
  }
  /// wte's gradient [V·C] in grads_.
  Tensor tied_grad() const { return grads_.slice(tied_.offset(), tied_.numel()); }

  StrategyOptions opt_;
  Backend& backend_;
  Communicator& comm_;
  Model* model_ = nullptr;
  FlatBuffer params_, grads_, master_;
  std::unique_ptr<Optimizer> optimizer_;
  // Buckets of whole layers up to zero.reduce_bucket_size elements (parallel/buckets.h).
  std::vector<GradBucket> buckets_;
  BucketReadiness readiness_;
  TiedEmbeddingGrad tied_;  ///< the early wte reduction and the embedding's rows
  std::vector<std::unique_ptr<Work>> pending_;
  bool last_micro_ = true;
  /// Buckets all-reduced from after_backward (overlap_comm), or all in finish_gradients.
  bool reduce_in_backward_ = opt_.zero.overlap_comm;
  /// --hierarchical-all-reduce: the buckets' sums within nodes, then across them.
  std::unique_ptr<HierarchicalReduction> hierarchical_;
  RegisteredBuffers registered_;  ///< grads_ for the copy-engine all-reduce; destroyed first
};

}  // namespace

std::unique_ptr<Strategy> make_data_parallel_strategy(const StrategyOptions& options,
                                                      Backend& backend, Communicator& comm) {
  return std::make_unique<DataParallel>(options, backend, comm);
}

}  // namespace shardtrain
