#include "parallel/pipeline/executor.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace shardtrain {

PipelineExecutor::PipelineExecutor(GPT2Model& model, Strategy& inner, Backend& backend,
                                   std::vector<Communicator*> channels, PipelineSchedule schedule,
                                   int virtual_stages, std::vector<ChunkLayers> chunks, Tensor dwte)
    : model_(model),
      inner_hooks_(inner),
      inner_(inner),
      backend_(backend),
      channels_(std::move(channels)),
      schedule_(schedule),
      P_(channels_.empty() ? 1 : channels_.front()->world_size()),
      V_(virtual_stages),
      rank_(channels_.empty() ? 0 : channels_.front()->rank()),
      chunks_(std::move(chunks)),
      post_ahead_(backend.kind() == DeviceKind::kCPU),
      dwte_(dwte) {
  ST_ASSERT(static_cast<int>(chunks_.size()) == V_);
  channel_map_ = PipelineChannels::per_neighbour(P_);
  ST_ASSERT(static_cast<int>(channels_.size()) == channel_map_.count());
  model_.set_hooks(this);
  if (P_ > 1 && model_.has_embedding()) {
    const Tensor g = model_.embedding_weight_grad();
    check<ConfigError>(g.dtype == backend_.compute_dtype(),
                       "pipeline: the embedding gradient is {}, the head's copy {}: the strategy "
                       "across replicas must keep gradients in the compute dtype",
                       dtype_name(g.dtype), dtype_name(backend_.compute_dtype()));
    tied_grad_ = FlatBuffer(backend_, g.dtype, g.numel());
  }
}

void PipelineExecutor::after_backward(int layer) {
  if (layer == 0 && add_tied_) {
    Tensor g = model_.embedding_weight_grad();
    Tensor received = g;
    received.data = tied_grad_.data();
    backend_.add(g, g, received);
    add_tied_ = false;
  }
  inner_hooks_.after_backward(layer);
}

void PipelineExecutor::between_layers() {
  for (auto& [key, s] : live_)
    for (auto& w : s.sends) w->completed();
  for (auto& s : done_)
    for (auto& w : s.sends) w->completed();
  for (auto& [key, w] : pending_recv_) w->completed();
  for (auto& w : other_sends_) w->completed();
}

// ---- slots ------------------------------------------------------------------------------------

int PipelineExecutor::slot_for(int m, int c) {
  auto it = live_.find({m, c});
  if (it != live_.end()) return it->second.slot;
  reclaim();
  int s;
  if (!free_slots_.empty()) {
    s = free_slots_.back();
    free_slots_.pop_back();
  } else {
    s = next_slot_++;
  }
  live_[{m, c}].slot = s;
  peak_slots_ = std::max(peak_slots_, static_cast<int>(live_.size()));
  model_.prepare(s, nullptr, nullptr, B_, T_, grad_scale_, true, dropout_seed(m));
  return s;
}

void PipelineExecutor::release(int m, int c) {
  auto it = live_.find({m, c});
  ST_ASSERT(it != live_.end());
  done_.push_back(std::move(it->second));
  live_.erase(it);
}

void PipelineExecutor::gradient_sent(int m, int c) {
  // Fused backward: the slot is done once its gradient left (W passes release it later).
  if (schedule_ != PipelineSchedule::kZBH1) release(m, c);
}

void PipelineExecutor::reclaim() {
  // A finished slot is reused once its sends completed (never waited for here: the receiver may
  // post its receive only after this rank's next message).
  for (auto it = done_.begin(); it != done_.end();) {
    const bool sent = std::all_of(it->sends.begin(), it->sends.end(),
                                  [](const std::unique_ptr<Work>& w) { return w->completed(); });
    if (!sent) {
      ++it;
      continue;
    }
    for (auto& w : it->sends) w->wait();
    free_slots_.push_back(it->slot);
    it = done_.erase(it);
  }
}

// ---- buffers -----------------------------------------------------------------------------------

Tensor PipelineExecutor::receive_buffer(const PipelineMessage& k) {
  switch (k.kind) {
    case MessageKind::kActivation:
      return model_.activation(slot_for(k.micro_batch, k.chunk),
                               chunks_[static_cast<size_t>(k.chunk)].first);
    case MessageKind::kGradient:
      return model_.activation_grad(slot_for(k.micro_batch, k.chunk));
    case MessageKind::kTiedGradient:
      return tied_grad_.view();
  }
  return {};
}

Tensor PipelineExecutor::send_buffer(const IssuedOp& op) {
  const PipelineAction& a = op.action;
  switch (op.message.kind) {
    case MessageKind::kActivation:
      return model_.activation(slot_for(a.micro_batch, a.chunk),
                               chunks_[static_cast<size_t>(a.chunk)].last);
    case MessageKind::kGradient:
      return model_.activation_grad(slot_for(a.micro_batch, a.chunk));
    case MessageKind::kTiedGradient:
      return dwte_;
  }
  return {};
}

// ---- passes ------------------------------------------------------------------------------------

void PipelineExecutor::compute(const PipelineAction& a, const MicroBatchSource& batches) {
  const int m = a.micro_batch, c = a.chunk, v = virtual_stage(c);
  const int last_v = P_ * V_ - 1;
  const ChunkLayers& ch = chunks_[static_cast<size_t>(c)];
  switch (a.type) {
    case ActionType::kSendActivation: {  // the next chunk is on this rank (one stage, interleaved)
      Tensor out = model_.activation(slot_for(m, c), ch.last);
      const int cn = chunk_of(v + 1);
      Tensor in = model_.activation(slot_for(m, cn), chunks_[static_cast<size_t>(cn)].first);
      backend_.copy(in.data, out.data, out.bytes());
      break;
    }
    case ActionType::kSendGradient: {
      Tensor g = model_.activation_grad(slot_for(m, c));
      Tensor into = model_.activation_grad(slot_for(m, chunk_of(v - 1)));
      backend_.copy(into.data, g.data, g.bytes());
      gradient_sent(m, c);
      break;
    }
    case ActionType::kForward: {
      use_weights_of(m);
      const int s = slot_for(m, c);
      const bool embed = v == 0, head = v == last_v;
      if (embed || head) {
        const MicroBatch mb = m < M_ ? batches(m) : lookahead_->next_batches(m - M_);
        check<ConfigError>(mb.batch == B_ && mb.seq_len == T_,
                           "pipeline: micro-batch {} is [{}, {}] but micro-batch 0 was [{}, {}]: "
                           "every micro-batch of a step must have the same shape",
                           m, mb.batch, mb.seq_len, B_, T_);
        model_.prepare(s, embed ? mb.tokens : nullptr, head ? mb.targets : nullptr, B_, T_,
                       grad_scale_, true, dropout_seed(m));
      }
      model_.forward_layers(s, ch.first, ch.last);
      if (head) {
        const Tensor losses = model_.slot_losses(s);
        backend_.copy(static_cast<float*>(step_losses_.data()) + m * B_ * T_, losses.data,
                      losses.bytes());
      }
      break;
    }
    case ActionType::kBackward:
    case ActionType::kBackwardInput:
    case ActionType::kBackwardWeight: {
      use_weights_of(m);
      const int s = slot_for(m, c);
      if (a.type != ActionType::kBackwardInput) {
        int& k = weight_passes_[static_cast<size_t>(c)];
        inner_.begin_micro_step(k, M_);
        ++k;
      }
      const BackwardPass pass = a.type == ActionType::kBackward        ? BackwardPass::kFull
                                : a.type == ActionType::kBackwardInput ? BackwardPass::kInput
                                                                       : BackwardPass::kWeight;
      model_.backward_layers(s, ch.first, ch.last, pass);
      // The first virtual stage sends no gradient: its slot is done after its last pass.
      if (a.type == ActionType::kBackwardWeight || (a.type == ActionType::kBackward && v == 0))
        release(m, c);
      break;
    }
    case ActionType::kRecvActivation:
    case ActionType::kRecvGradient:
      break;  // within the rank: the sender's copy delivered it
  }
}

void PipelineExecutor::use_weights_of(int m) {
  if (lookahead_ == nullptr || (m >= M_) == using_next_) return;
  using_next_ = m >= M_;
  lookahead_->use_weights(using_next_);
}

void PipelineExecutor::discard_lookahead() {
  for (auto& [key, slot] : live_) {
    for (auto& w : slot.sends) w->wait();
    free_slots_.push_back(slot.slot);
  }
  live_.clear();
  held_lookahead_ = false;
}

// ---- one step ----------------------------------------------------------------------------------

double PipelineExecutor::run(int micro_batches, const MicroBatchSource& batches, double loss_scale,
                             bool trace, const PipelineLookahead* lookahead) {
  ST_ASSERT(lookahead == nullptr || schedule_ == PipelineSchedule::k2BW);
  if (held_lookahead_ && micro_batches != M_) discard_lookahead();
  M_ = micro_batches;
  shape_ = PipelineShape{P_, M_, V_, !held_lookahead_, lookahead == nullptr};
  const auto key = std::make_tuple(M_, shape_.fill, shape_.drain);
  auto found = orders_.find(key);
  if (found == orders_.end()) {
    // Every rank checks the orders of all (pure functions of the shape) under NCCL's semantics
    // before the first transfer, so a wait cycle is an error here and never a hang.
    std::vector<std::vector<IssuedOp>> all;
    for (int r = 0; r < P_; ++r)
      all.push_back(pipeline_issue_order(schedule_, shape_, r, channel_map_, post_ahead_));
    const std::string cycle = nccl_order_deadlock(all);
    check<RuntimeFailure>(cycle.empty(),
                          "pipeline: internal error: the {} order for {} stages × {} "
                          "micro-batches can deadlock: {}",
                          to_string(schedule_), P_, M_, cycle);
    found = orders_.emplace(key, std::move(all[static_cast<size_t>(rank_)])).first;
  }
  const std::vector<IssuedOp>& order = found->second;
  {
    const MicroBatch first = batches(0);
    B_ = first.batch;
    T_ = first.seq_len;
  }
  grad_scale_ = static_cast<float>(loss_scale / static_cast<double>(B_ * T_));
  ST_ASSERT(pending_recv_.empty() && (held_lookahead_ || live_.empty()));
  lookahead_ = lookahead;
  using_next_ = false;
  if (trace) trace_.clear();
  const bool head_here = rank_of(P_ * V_ - 1) == rank_;
  if (head_here && step_losses_.numel() < M_ * B_ * T_)
    step_losses_ = FlatBuffer(backend_, DType::kF32, M_ * B_ * T_);
  weight_passes_.assign(static_cast<size_t>(V_), 0);

  const bool on_device = backend_.kind() != DeviceKind::kCPU;
  sync_receives_ = trace && on_device;
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const auto now = [&]() { return std::chrono::duration<double>(Clock::now() - t0).count(); };

  for (const IssuedOp& op : order) {
    const double start = trace ? now() : 0;
    const PipelineAction& a = op.action;
    bool traced = true;
    switch (op.type) {
      case IssueType::kPostRecv:
        pending_recv_[op.message] =
            channels_[static_cast<size_t>(op.channel)]->recv(receive_buffer(op.message), op.peer);
        traced = false;
        break;
      case IssueType::kWaitRecv: {
        auto node = pending_recv_.extract(op.message);
        ST_ASSERT(!node.empty());
        node.mapped()->wait();
        if (sync_receives_) backend_.synchronize();
        // The embedding's last weight pass (next) adds the head's wte gradient.
        if (op.message.kind == MessageKind::kTiedGradient) {
          add_tied_ = true;
          traced = false;
        }
        break;
      }
      case IssueType::kSend: {
        auto work = channels_[static_cast<size_t>(op.channel)]->send(send_buffer(op), op.peer);
        if (op.message.kind == MessageKind::kTiedGradient) {
          other_sends_.push_back(std::move(work));
          traced = false;
          break;
        }
        live_[{a.micro_batch, a.chunk}].sends.push_back(std::move(work));
        if (a.type == ActionType::kSendGradient) gradient_sent(a.micro_batch, a.chunk);
        break;
      }
      case IssueType::kCompute:
        compute(a, batches);
        break;
    }
    if (trace && traced) {
      const bool pass = op.type == IssueType::kCompute && a.type != ActionType::kSendActivation &&
                        a.type != ActionType::kSendGradient;
      if (pass && on_device) backend_.synchronize();
      trace_.push_back({a, start, now()});
    }
  }
  // Every slot is done but the look-ahead ones; wait for the sends still in flight (the
  // look-ahead activations' receivers posted theirs in this step).
  ST_ASSERT(pending_recv_.empty());
  for (SlotState& s : done_) {
    for (auto& w : s.sends) w->wait();
    free_slots_.push_back(s.slot);
  }
  done_.clear();
  for (auto& w : other_sends_) w->wait();
  other_sends_.clear();
  // The look-ahead micro-batches M.. are the next step's 0..
  std::map<std::pair<int, int>, SlotState> carried;
  for (auto& [mc, slot] : live_) {
    ST_ASSERT(mc.first >= M_);
    for (auto& w : slot.sends) w->wait();
    slot.sends.clear();
    carried[{mc.first - M_, mc.second}] = std::move(slot);
  }
  live_ = std::move(carried);
  held_lookahead_ = !shape_.drain;
  if (using_next_) lookahead_->use_weights(false);
  using_next_ = false;
  lookahead_ = nullptr;
  // The sum of the micro-batches' mean losses, in micro-batch order.
  double loss = 0;
  if (head_here)
    for (int m = 0; m < M_; ++m) {
      const Tensor losses(static_cast<float*>(step_losses_.data()) + m * B_ * T_, DType::kF32,
                          backend_.kind(), {B_ * T_});
      loss += backend_.sum(losses) / static_cast<double>(B_ * T_);
    }
  return loss;
}

}  // namespace shardtrain
