#include "parallel/tied_embedding_grad.h"

#include <span>

#include "comm/scalar_all_reduce.h"
#include "core/error.h"

namespace shardtrain {

namespace {
constexpr const char* kTiedTensor = "transformer.wte.weight";
}  // namespace

TiedEmbeddingGrad::TiedEmbeddingGrad(Backend& backend, Communicator& comm,
                                     const ParamLayout& layout, bool overlap_comm)
    : backend_(&backend), comm_(&comm) {
  const int n = layout.num_layers();
  if (comm.world_size() == 1 || !overlap_comm || n < 2) return;
  // GPT-2's whole model: the embedding (layer 0, wte first) read by the head (the last layer).
  if (layout.tied_sources() != std::vector<int>{0} || layout.users(0) != std::vector<int>{0, n - 1})
    return;
  const ParamTensor& wte = layout.layers().front().tensors.front();
  if (wte.name != kTiedTensor || wte.shape.size() != 2) return;
  ST_ASSERT(wte.offset == layout.layers().front().offset);
  enabled_ = true;
  reader_ = n - 1;
  offset_ = wte.offset;
  numel_ = wte.numel;
  vocab_ = wte.shape[0];
  channels_ = wte.shape[1];
}

bool TiedEmbeddingGrad::take(int64_t rows) {
  if (!enabled_) return false;
  ST_ASSERT(!active_ && rows > 0);
  if (rows != checked_rows_) {
    // Every rank is here (the same micro-step of the same backward): agree on the row count.
    ScalarAllReduce scalars(*backend_, *comm_, 1);
    const double mine = static_cast<double>(rows);
    const std::vector<double> all = scalars.gather(std::span<const double>(&mine, 1));
    for (size_t r = 0; r < all.size(); ++r)
      check<RuntimeFailure>(all[r] == mine,
                            "tied-embedding gradient exchange: rank {} hands over {} rows, "
                            "rank {} {} (data parallelism needs equal micro-batches)",
                            comm_->rank(), rows, r, static_cast<int64_t>(all[r]));
    checked_rows_ = rows;
    const int64_t world = comm_->world_size();
    dx_ = FlatBuffer(*backend_, backend_->compute_dtype(), world * rows * channels_);
    tokens_ = FlatBuffer(*backend_, DType::kI32, world * rows);
  }
  active_ = true;
  gathered_ = false;
  return true;
}

void TiedEmbeddingGrad::gather(Tensor dx, Tensor tokens) {
  ST_ASSERT(active_ && !gathered_);
  ST_ASSERT(dx.numel() == checked_rows_ * channels_ && tokens.numel() == checked_rows_);
  ST_ASSERT(dx.dtype == dx_.dtype() && tokens.dtype == DType::kI32);
  pending_.push_back(comm_->all_gather(dx_.view(), dx.reshape({dx.numel()})));
  pending_.push_back(comm_->all_gather(tokens_.view(), tokens.reshape({tokens.numel()})));
  gathered_ = true;
}

void TiedEmbeddingGrad::finish(Tensor dwte) {
  ST_ASSERT(active_);
  check<RuntimeFailure>(gathered_,
                        "tied-embedding gradient exchange: the model took over the embedding's "
                        "gradient but never handed it over (a bug)");
  ST_ASSERT(dwte.numel() == numel_ && dwte.dtype == dx_.dtype());
  for (auto& w : pending_) w->wait();
  pending_.clear();
  const int64_t n = tokens_.numel();
  // Every rank's rows as one batch of world·rows sequences of length 1; no position part.
  backend_->embedding_backward(dwte.reshape({vocab_, channels_}), Tensor(),
                               dx_.view().reshape({n, 1, channels_}), tokens_.view());
  active_ = false;
  gathered_ = false;
}

}  // namespace shardtrain
