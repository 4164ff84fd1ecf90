#include "parallel/hierarchical_reduction.h"

#include <utility>
#include <vector>

#include "memory/flat_buffer.h"

namespace shardtrain {

NodeGroups NodeGroups::of(int world_size, int rank, int ranks_per_node) {
  check<ConfigError>(ranks_per_node >= 1 && world_size % ranks_per_node == 0,
                     "hierarchical all-reduce: {} ranks per node do not divide the {} ranks of "
                     "the job (every node must run the same number of ranks)",
                     ranks_per_node, world_size);
  NodeGroups g;
  const int k = ranks_per_node, node = rank / k, local = rank % k;
  for (int i = 0; i < k; ++i) g.node.push_back(node * k + i);
  for (int n = 0; n < world_size / k; ++n) g.across.push_back(n * k + local);
  return g;
}

struct HierarchicalReduction::Job {
  bool scatter = false;  ///< reduce_scatter() (else all_reduce())
  /// All-reduce: [k·c], the part that takes the three steps. Reduce-scatter: step 1's input,
  /// the caller's buffer or `reordered`.
  Tensor main;
  /// All-reduce: [c], this rank's chunk of main. Reduce-scatter: [n·s], the n chunks this local
  /// rank holds after step 1, in node order.
  Tensor chunk;
  Tensor piece;          ///< reduce-scatter: [s], the chunk of `chunk` that step 2 leaves here
  Tensor own;            ///< reduce-scatter: [s], where the caller wants the result
  FlatBuffer reordered;  ///< reduce-scatter over several nodes of several ranks: main
  /// 1, 2: that step issued (the node's reduce-scatter, the network step); 4: every step issued
  /// (`work`: the last one's operations, or none).
  int step = 0;
  std::vector<std::unique_ptr<Work>> work;  ///< the step in flight (two exchanges: quantized)
  /// Quantized step 2: this rank's int8 and scales, and every node's.
  FlatBuffer q, scales, q_all, scales_all;
  /// Quantized all-reduce over nodes of several ranks: every local rank's q_all and scales_all,
  /// gathered within the node ([k][n][c] and [k][n][blocks]).
  FlatBuffer q_node, scales_node;
  std::unique_ptr<Work> rest;  ///< the world all-reduce of the elements past k·c
};

class HierarchicalReduction::JobWork final : public Work {
 public:
  JobWork(HierarchicalReduction& owner, std::shared_ptr<Job> job)
      : owner_(owner), job_(std::move(job)) {}
  void wait() override {
    owner_.finish(*job_);
    for (auto& w : job_->work) w->wait();
    if (job_->rest) job_->rest->wait();
  }
  bool completed() override {
    owner_.progress();
    if (job_->step < 4) return false;
    for (auto& w : job_->work)
      if (!w->completed()) return false;
    return !job_->rest || job_->rest->completed();
  }

 private:
  HierarchicalReduction& owner_;
  std::shared_ptr<Job> job_;
};

HierarchicalReduction::HierarchicalReduction(Communicator& world, int ranks_per_node,
                                             Backend& backend, bool quantize,
                                             const std::vector<int>& members)
    : world_(world),
      backend_(backend),
      quantize_(quantize),
      chained_(world.starts_after_on_device()) {
  NodeGroups g = NodeGroups::of(world.world_size(), world.rank(), ranks_per_node);
  if (!members.empty()) {
    ST_ASSERT(static_cast<int>(members.size()) == world.world_size());
    for (std::vector<int>* v : {&g.node, &g.across})
      for (int& r : *v) r = members[static_cast<size_t>(r)];
  }
  k_ = ranks_per_node;
  nodes_ = world.world_size() / k_;
  local_ = world.rank() % k_;
  node_ = world.rank() / k_;
  // One rank per node (the cross-group sums of zero3's hybrid sharding, or nodes of one GPU):
  // steps 1 and 3 are nothing to do, and their groups are not made.
  if (k_ > 1) node_scatter_ = world.split(g.node);
  across_ = world.split(g.across);
  if (k_ > 1) node_gather_ = world.split(g.node);
}

HierarchicalReduction::~HierarchicalReduction() = default;

std::unique_ptr<Work> HierarchicalReduction::all_reduce(Tensor t) {
  auto job = std::make_shared<Job>();
  const int64_t n = t.numel(), c = n / k_;
  if (n > c * k_) job->rest = world_.all_reduce(t.slice1d(c * k_, n - c * k_), ReduceOp::kSum);
  if (c == 0) {
    job->step = 4;
  } else {
    job->main = t.slice1d(0, c * k_);
    job->chunk = job->main.slice1d(local_ * c, c);
    if (node_scatter_)
      job->work.push_back(node_scatter_->reduce_scatter(job->chunk, job->main, ReduceOp::kSum));
    job->step = 1;
  }
  return start(std::move(job));
}

std::unique_ptr<Work> HierarchicalReduction::reduce_scatter(Tensor own, Tensor whole) {
  const int64_t w = world_.world_size(), s = own.numel();
  ST_ASSERT(whole.numel() == w * s && own.dtype == whole.dtype &&
            own.data == whole.slice1d(world_.rank() * s, s).data);
  auto job = std::make_shared<Job>();
  job->scatter = true;
  job->own = own;
  job->main = whole;
  if (k_ > 1 && nodes_ > 1) {
    // Chunk j·k + l of the world's order goes to position l·n + j: local rank l's n chunks
    // together, in node order.
    job->reordered = FlatBuffer::uninitialized(backend_, whole.dtype, whole.numel());
    job->main = job->reordered.view();
    for (int j = 0; j < nodes_; ++j)
      for (int l = 0; l < k_; ++l)
        backend_.copy(job->main.slice1d((l * nodes_ + j) * s, s).data,
                      whole.slice1d((j * k_ + l) * s, s).data, static_cast<size_t>(own.bytes()));
  }
  job->chunk = job->main.slice1d(local_ * nodes_ * s, nodes_ * s);
  job->piece = job->chunk.slice1d(node_ * s, s);
  if (node_scatter_)
    job->work.push_back(node_scatter_->reduce_scatter(job->chunk, job->main, ReduceOp::kSum));
  job->step = 1;
  return start(std::move(job));
}

std::unique_ptr<Work> HierarchicalReduction::start(std::shared_ptr<Job> job) {
  jobs_.push_back(job);
  // On the device every step that only communicates is issued now, chained to the one before:
  // the same order on every rank.
  if (chained_)
    while (advance(*job, false)) {
    }
  return std::make_unique<JobWork>(*this, std::move(job));
}

bool HierarchicalReduction::chains(const Job& j) const {
  if (!chained_) return false;
  if (j.step == 1) return !quantize_;  // the network step after the node's reduce-scatter
  if (j.step == 2) {
    // quantized all-reduce: the node's all-gather of the int8 chunks after the network step
    if (quantize_) return !j.scatter && node_gather_;
    // the node's all-gather (all-reduce), or nothing left to copy (reduce-scatter)
    return !j.scatter || j.piece.data == j.own.data;
  }
  return false;  // summing the int8 pieces needs them on the compute stream
}

bool HierarchicalReduction::advance(Job& j, bool block) {
  if (j.step >= 4) return false;
  // The job before this one must have issued the step this one would issue next (or be done):
  // each communicator sees the jobs' steps in start order.
  for (size_t i = 0; i < jobs_.size() && jobs_[i].get() != &j; ++i)
    if (jobs_[i]->step < 4 && jobs_[i]->step <= j.step) return false;
  const bool chain = chains(j);
  // Quantizing on the device needs the node's reduce-scatter on the compute stream (a short wait
  // within the node), not seen complete by the host.
  const bool quantize_now = chained_ && quantize_ && j.step == 1;
  if (!chain) {
    for (auto& w : j.work)
      if (!block && !quantize_now && !w->completed()) return false;
    for (auto& w : j.work) w->wait();
  }
  std::vector<std::unique_ptr<Work>> before = std::move(j.work);
  j.work.clear();
  Communicator* next = nullptr;  // where the step issued now runs
  switch (j.step) {
    case 1:
      if (quantize_) {
        issue_quantized(j);
        break;
      }
      next = across_.get();
      if (chain)
        for (auto& w : before) next->start_after(*w);
      j.work.push_back(j.scatter ? next->reduce_scatter(j.piece, j.chunk, ReduceOp::kSum)
                                 : next->all_reduce(j.chunk, ReduceOp::kSum));
      if (nodes_ > 1) network_bytes_ += static_cast<int64_t>(j.chunk.bytes());
      break;
    case 2:
      if (quantize_ && !j.scatter && node_gather_) {
        // The int8 chunks of every node, gathered within the node as they are: each rank then
        // sums every chunk itself (step 3), so nothing is issued after a dequantization.
        next = node_gather_.get();
        if (chain)
          for (auto& w : before) next->start_after(*w);
        j.q_node = FlatBuffer::uninitialized(backend_, DType::kU8, j.q_all.numel() * k_);
        j.scales_node = FlatBuffer::uninitialized(backend_, DType::kF32, j.scales_all.numel() * k_);
        j.work.push_back(next->all_gather(j.q_node.view(), j.q_all.view()));
        j.work.push_back(next->all_gather(j.scales_node.view(), j.scales_all.view()));
        break;
      }
      if (quantize_) sum_quantized(j);
      if (!j.scatter && node_gather_) {  // in place: chunk is this rank's slot of main
        next = node_gather_.get();
        if (chain)
          for (auto& w : before) next->start_after(*w);
        j.work.push_back(next->all_gather(j.main, j.chunk));
      } else if (chain) {
        j.work = std::move(before);  // the network step is the job's last
      } else if (j.scatter && j.piece.data != j.own.data) {
        backend_.copy(j.own.data, j.piece.data, static_cast<size_t>(j.own.bytes()));
      }
      j.reordered = FlatBuffer();
      j.step = 3;  // every step issued
      break;
    case 3:  // quantized all-reduce over nodes of several ranks: every chunk from every node
      sum_quantized(j);
      break;
    default:
      break;
  }
  ++j.step;
  return true;
}

void HierarchicalReduction::issue_quantized(Job& j) {
  Backend& be = backend_;
  // The pieces quantized on their own: the chunk (all-reduce), each node's chunk (reduce-scatter).
  const int pieces = j.scatter ? nodes_ : 1;
  const int64_t c = j.chunk.numel() / pieces, blocks = (c + kQuantBlock - 1) / kQuantBlock;
  j.q = FlatBuffer::uninitialized(be, DType::kU8, c * pieces);
  j.scales = FlatBuffer::uninitialized(be, DType::kF32, blocks * pieces);
  j.q_all = FlatBuffer::uninitialized(be, DType::kU8, c * nodes_);
  j.scales_all = FlatBuffer::uninitialized(be, DType::kF32, blocks * nodes_);
  for (int p = 0; p < pieces; ++p)
    be.quantize_int8(j.q.slice(p * c, c), j.scales.slice(p * blocks, blocks),
                     j.chunk.slice1d(p * c, c));
  if (j.scatter) {
    j.work.push_back(across_->all_to_all(j.q_all.view(), j.q.view()));
    j.work.push_back(across_->all_to_all(j.scales_all.view(), j.scales.view()));
  } else {
    j.work.push_back(across_->all_gather(j.q_all.view(), j.q.view()));
    j.work.push_back(across_->all_gather(j.scales_all.view(), j.scales.view()));
  }
  if (nodes_ > 1) network_bytes_ += static_cast<int64_t>(j.q.bytes() + j.scales.bytes());
}

void HierarchicalReduction::sum_quantized(Job& j) {
  Backend& be = backend_;
  // The sums to form: j's own piece or chunk, or, with the node's int8 gathered (all-reduce over
  // nodes of several ranks), each local rank's chunk of main.
  const bool whole_node = j.q_node.numel() > 0;
  const int sums = whole_node ? k_ : 1;
  const FlatBuffer& q = whole_node ? j.q_node : j.q_all;
  const FlatBuffer& scales = whole_node ? j.scales_node : j.scales_all;
  const int64_t c = j.scatter ? j.piece.numel() : j.chunk.numel();
  const int64_t blocks = j.scales_all.numel() / nodes_;
  for (int l = 0; l < sums; ++l) {
    Tensor out = j.scatter ? j.piece : whole_node ? j.main.slice1d(l * c, c) : j.chunk;
    be.fill_zero(out);
    for (int n = 0; n < nodes_; ++n) {  // node order: every rank the same sum
      const int64_t at = static_cast<int64_t>(l) * nodes_ + n;
      be.dequantize_add_int8(out, q.slice(at * c, c), scales.slice(at * blocks, blocks));
    }
  }
  j.q = FlatBuffer();
  j.scales = FlatBuffer();
  j.q_all = FlatBuffer();
  j.scales_all = FlatBuffer();
  j.q_node = FlatBuffer();
  j.scales_node = FlatBuffer();
}

void HierarchicalReduction::progress() {
  for (const auto& j : jobs_)
    while (advance(*j, false)) {
    }
  while (!jobs_.empty() && jobs_.front()->step >= 4) jobs_.pop_front();
}

void HierarchicalReduction::finish(Job& j) {
  if (j.step >= 4) return;
  // Every job before `j` first (their steps come first on each communicator), then `j`.
  for (size_t i = 0; i < jobs_.size(); ++i) {
    Job& x = *jobs_[i];
    while (x.step < 4) advance(x, true);
    if (&x == &j) break;
  }
  while (!jobs_.empty() && jobs_.front()->step >= 4) jobs_.pop_front();
}

}  // namespace shardtrain
