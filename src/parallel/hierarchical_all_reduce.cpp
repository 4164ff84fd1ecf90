#include "parallel/hierarchical_all_reduce.h"

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

struct HierarchicalAllReduce::Job {
  Tensor main;   ///< [k·c]: the part that takes the three steps
  Tensor chunk;  ///< [c]: this rank's chunk of main
  /// 1, 2, 3: that step issued (reduce-scatter, all-reduce across nodes, all-gather); 4: done.
  int step = 0;
  std::vector<std::unique_ptr<Work>> work;  ///< the step in flight (two all-gathers: quantized)
  /// Quantized step 2: this rank's int8 chunk and scales, and every node's.
  FlatBuffer q, scales, q_all, scales_all;
  std::unique_ptr<Work> rest;  ///< the world all-reduce of the elements past k·c
};

class HierarchicalAllReduce::JobWork final : public Work {
 public:
  JobWork(HierarchicalAllReduce& owner, std::shared_ptr<Job> job)
      : owner_(owner), job_(std::move(job)) {}
  void wait() override {
    owner_.finish(*job_);
    if (job_->rest) job_->rest->wait();
  }
  bool completed() override {
    owner_.progress();
    return job_->step >= 4 && (!job_->rest || job_->rest->completed());
  }

 private:
  HierarchicalAllReduce& owner_;
  std::shared_ptr<Job> job_;
};

HierarchicalAllReduce::HierarchicalAllReduce(Communicator& world, int ranks_per_node,
                                             Backend* quantize, const std::vector<int>& members)
    : world_(world), quantize_(quantize) {
  NodeGroups g = NodeGroups::of(world.world_size(), world.rank(), ranks_per_node);
  if (!members.empty()) {
    ST_ASSERT(static_cast<int>(members.size()) == world.world_size());
    for (std::vector<int>* v : {&g.node, &g.across})
      for (int& r : *v) r = members[static_cast<size_t>(r)];
  }
  k_ = ranks_per_node;
  nodes_ = world.world_size() / k_;
  local_ = world.rank() % k_;
  // One rank per node (the cross-group sums of zero3's hybrid sharding, or nodes of one GPU):
  // steps 1 and 3 are nothing to do, and their groups are not made.
  if (k_ > 1) node_scatter_ = world.split(g.node);
  across_ = world.split(g.across);
  if (k_ > 1) node_gather_ = world.split(g.node);
}

HierarchicalAllReduce::~HierarchicalAllReduce() = default;

std::unique_ptr<Work> HierarchicalAllReduce::start(Tensor t) {
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
  jobs_.push_back(job);
  return std::make_unique<JobWork>(*this, std::move(job));
}

bool HierarchicalAllReduce::advance(Job& j, bool block) {
  if (j.step >= 4) return false;
  // The job before this one must have issued the step this one would issue next (or be done):
  // each communicator sees the jobs' steps in start() order.
  for (size_t i = 0; i < jobs_.size() && jobs_[i].get() != &j; ++i)
    if (jobs_[i]->step < 4 && jobs_[i]->step <= j.step) return false;
  for (auto& w : j.work)
    if (!block && !w->completed()) return false;
  for (auto& w : j.work) w->wait();
  j.work.clear();
  switch (j.step) {
    case 1:
      if (quantize_) {
        issue_quantized(j);
      } else {
        j.work.push_back(across_->all_reduce(j.chunk, ReduceOp::kSum));
        if (nodes_ > 1) network_bytes_ += static_cast<int64_t>(j.chunk.bytes());
      }
      break;
    case 2:
      if (quantize_) sum_quantized(j);
      if (node_gather_)  // in place: chunk is this rank's slot of main
        j.work.push_back(node_gather_->all_gather(j.main, j.chunk));
      break;
    default:
      break;
  }
  ++j.step;
  return true;
}

void HierarchicalAllReduce::issue_quantized(Job& j) {
  Backend& be = *quantize_;
  const int64_t c = j.chunk.numel(), blocks = (c + kQuantBlock - 1) / kQuantBlock;
  j.q = FlatBuffer::uninitialized(be, DType::kU8, c);
  j.scales = FlatBuffer::uninitialized(be, DType::kF32, blocks);
  j.q_all = FlatBuffer::uninitialized(be, DType::kU8, c * nodes_);
  j.scales_all = FlatBuffer::uninitialized(be, DType::kF32, blocks * nodes_);
  be.quantize_int8(j.q.view(), j.scales.view(), j.chunk);
  j.work.push_back(across_->all_gather(j.q_all.view(), j.q.view()));
  j.work.push_back(across_->all_gather(j.scales_all.view(), j.scales.view()));
  if (nodes_ > 1) network_bytes_ += static_cast<int64_t>(j.q.bytes() + j.scales.bytes());
}

void HierarchicalAllReduce::sum_quantized(Job& j) {
  Backend& be = *quantize_;
  const int64_t c = j.chunk.numel(), blocks = j.scales.numel();
  be.fill_zero(j.chunk);
  for (int n = 0; n < nodes_; ++n)  // node order: every rank the same sum
    be.dequantize_add_int8(j.chunk, j.q_all.slice(n * c, c),
                           j.scales_all.slice(n * blocks, blocks));
  j.q = FlatBuffer();
  j.scales = FlatBuffer();
  j.q_all = FlatBuffer();
  j.scales_all = FlatBuffer();
}

void HierarchicalAllReduce::progress() {
  for (const auto& j : jobs_)
    while (advance(*j, false)) {
    }
  while (!jobs_.empty() && jobs_.front()->step >= 4) jobs_.pop_front();
}

void HierarchicalAllReduce::finish(Job& j) {
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
