#include "parallel/pipeline/executor.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace shardtrain {

PipelineExecutor::PipelineExecutor(GPT2Model& model, Strategy& inner, Backend& backend,
                                   Communicator& activations, Communicator& gradients,
                                   PipelineSchedule schedule, int virtual_stages,
                                   std::vector<ChunkLayers> chunks, Tensor dwte)
    : model_(model),
      inner_hooks_(inner),
      inner_(inner),
      backend_(backend),
      act_comm_(activations),
      grad_comm_(gradients),
      schedule_(schedule),
      P_(activations.world_size()),
      V_(virtual_stages),
      rank_(activations.rank()),
      chunks_(std::move(chunks)),
      post_ahead_(backend.kind() == DeviceKind::kCPU),
      dwte_(dwte) {
  ST_ASSERT(static_cast<int>(chunks_.size()) == V_);
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

// ---- receives in the sender's order ------------------------------------------------------------

std::vector<PipelineExecutor::Key> PipelineExecutor::messages_from(int peer,
                                                                   bool activations) const {
  const PipelineShape shape{P_, M_, V_};
  const auto actions =
      with_transfers(pipeline_compute_actions(schedule_, shape, peer), shape, peer);
  const int last_v = P_ * V_ - 1;
  std::vector<Key> out;
  int head_passes = 0;
  for (const PipelineAction& a : actions) {
    const int v = a.chunk * P_ + peer;
    if (activations) {
      if (a.type == ActionType::kSendActivation && rank_of(v + 1) == rank_)
        out.push_back({Msg::kActivation, a.micro_batch, chunk_of(v + 1)});
      continue;
    }
    if (a.type == ActionType::kSendGradient && rank_of(v - 1) == rank_)
      out.push_back({Msg::kGradient, a.micro_batch, chunk_of(v - 1)});
    // The tied wte gradient: after the head's last weight pass (rank P-1, chunk V-1).
    if (v == last_v && writes_weights(a.type) && ++head_passes == M_ && rank_ == 0 && peer != 0)
      out.push_back({Msg::kTiedGrad, 0, 0});
  }
  return out;
}

Tensor PipelineExecutor::receive_buffer(const Key& k) {
  switch (k.msg) {
    case Msg::kActivation: {
      const int s = slot_for(k.m, k.c);
      return model_.activation(s, chunks_[static_cast<size_t>(k.c)].first);
    }
    case Msg::kGradient:
      return model_.activation_grad(slot_for(k.m, k.c));
    case Msg::kTiedGrad:
      return tied_grad_.view();
  }
  return {};
}

bool PipelineExecutor::post_next(int peer, bool activations) {
  auto [it, fresh] = expected_.try_emplace({peer, activations});
  if (fresh) it->second = messages_from(peer, activations);
  size_t& posted = posted_[{peer, activations}];
  if (posted >= it->second.size()) return false;
  const Key next = it->second[posted++];
  pending_recv_[next] = comm_of(next.msg).recv(receive_buffer(next), peer);
  return true;
}

void PipelineExecutor::receive(int peer, const Key& k) {
  const bool act = k.msg == Msg::kActivation;
  while (!pending_recv_.count(k))
    check<RuntimeFailure>(post_next(peer, act),
                          "pipeline: rank {} expects a message rank {} never sends (schedule "
                          "mismatch between stages)",
                          rank_, peer);
  auto node = pending_recv_.extract(k);
  node.mapped()->wait();
  if (sync_receives_) backend_.synchronize();
  if (post_ahead_) post_next(peer, act);
}

// ---- one step ----------------------------------------------------------------------------------

double PipelineExecutor::run(int micro_batches, const MicroBatchSource& batches, double loss_scale,
                             bool trace) {
  if (micro_batches != M_ || actions_.empty()) {
    // This rank's actions and (on first use) its peers' message orders, kept while M stays.
    M_ = micro_batches;
    const PipelineShape shape{P_, M_, V_};
    actions_ = with_transfers(pipeline_compute_actions(schedule_, shape, rank_), shape, rank_);
    expected_.clear();
  }
  {
    const MicroBatch first = batches(0);
    B_ = first.batch;
    T_ = first.seq_len;
  }
  grad_scale_ = static_cast<float>(loss_scale / static_cast<double>(B_ * T_));
  posted_.clear();
  ST_ASSERT(live_.empty() && pending_recv_.empty());
  trace_.clear();

  const int last_v = P_ * V_ - 1;
  const bool on_device = backend_.kind() != DeviceKind::kCPU;
  sync_receives_ = trace && on_device;
  // MPI (CPU): every neighbour's first message is awaited from the start (post_ahead_).
  const int prev = (rank_ + P_ - 1) % P_, next = (rank_ + 1) % P_;
  if (post_ahead_)
    for (int peer : {prev, next})
      if (peer != rank_ && (peer == prev || next != prev)) {
        post_next(peer, true);
        post_next(peer, false);
      }
  std::vector<int> weight_passes(static_cast<size_t>(V_), 0);
  double loss = 0;
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const auto now = [&]() { return std::chrono::duration<double>(Clock::now() - t0).count(); };

  for (const PipelineAction& a : actions_) {
    const double start = trace ? now() : 0;
    const int m = a.micro_batch, c = a.chunk, v = virtual_stage(c);
    const ChunkLayers& ch = chunks_[static_cast<size_t>(c)];
    switch (a.type) {
      case ActionType::kRecvActivation:
        if (rank_of(v - 1) != rank_) receive(rank_of(v - 1), {Msg::kActivation, m, c});
        break;
      case ActionType::kRecvGradient:
        if (rank_of(v + 1) != rank_) receive(rank_of(v + 1), {Msg::kGradient, m, c});
        break;
      case ActionType::kSendActivation: {
        const int s = slot_for(m, c);
        Tensor out = model_.activation(s, ch.last);
        const int dst = rank_of(v + 1);
        if (dst == rank_) {  // the next chunk is on this rank (one stage, interleaved)
          const int cn = chunk_of(v + 1);
          Tensor in = model_.activation(slot_for(m, cn), chunks_[static_cast<size_t>(cn)].first);
          backend_.copy(in.data, out.data, out.bytes());
        } else {
          live_[{m, c}].sends.push_back(act_comm_.send(out, dst));
        }
        break;
      }
      case ActionType::kSendGradient: {
        const int s = slot_for(m, c);
        Tensor g = model_.activation_grad(s);
        const int dst = rank_of(v - 1);
        if (dst == rank_) {
          Tensor into = model_.activation_grad(slot_for(m, chunk_of(v - 1)));
          backend_.copy(into.data, g.data, g.bytes());
        } else {
          live_[{m, c}].sends.push_back(grad_comm_.send(g, dst));
        }
        // Fused backward: the slot is done once its gradient left (W passes release it later).
        if (schedule_ != PipelineSchedule::kZBH1) release(m, c);
        break;
      }
      case ActionType::kForward: {
        const int s = slot_for(m, c);
        const bool embed = v == 0, head = v == last_v;
        if (embed || head) {
          const MicroBatch mb = batches(m);
          check<ConfigError>(mb.batch == B_ && mb.seq_len == T_,
                             "pipeline: micro-batch {} is [{}, {}] but micro-batch 0 was [{}, {}]: "
                             "every micro-batch of a step must have the same shape",
                             m, mb.batch, mb.seq_len, B_, T_);
          model_.prepare(s, embed ? mb.tokens : nullptr, head ? mb.targets : nullptr, B_, T_,
                         grad_scale_, true, dropout_seed(m));
        }
        model_.forward_layers(s, ch.first, ch.last);
        if (head) loss += model_.slot_loss(s);
        break;
      }
      case ActionType::kBackward:
      case ActionType::kBackwardInput:
      case ActionType::kBackwardWeight: {
        const int s = slot_for(m, c);
        const bool weights = writes_weights(a.type);
        if (weights) {
          int& k = weight_passes[static_cast<size_t>(c)];
          inner_.begin_micro_step(k, M_);
          ++k;
          // The embedding's last weight pass adds the head's wte gradient from the last stage.
          if (v == 0 && P_ > 1 && k == M_) {
            receive(P_ - 1, {Msg::kTiedGrad, 0, 0});
            add_tied_ = true;
          }
        }
        const BackwardPass pass = a.type == ActionType::kBackward        ? BackwardPass::kFull
                                  : a.type == ActionType::kBackwardInput ? BackwardPass::kInput
                                                                         : BackwardPass::kWeight;
        model_.backward_layers(s, ch.first, ch.last, pass);
        if (weights && v == last_v && !dwte_.empty() && weight_passes[static_cast<size_t>(c)] == M_)
          other_sends_.push_back(grad_comm_.send(dwte_, 0));
        // The first virtual stage sends no gradient: its slot is done after its last pass.
        const bool done =
            a.type == ActionType::kBackwardWeight || (a.type == ActionType::kBackward && v == 0);
        if (done) release(m, c);
        break;
      }
    }
    if (trace) {
      const bool compute = a.type == ActionType::kForward || a.type == ActionType::kBackward ||
                           a.type == ActionType::kBackwardInput ||
                           a.type == ActionType::kBackwardWeight;
      if (compute && on_device) backend_.synchronize();
      trace_.push_back({a, start, now()});
    }
  }
  // Every slot is done; wait for the sends still in flight.
  ST_ASSERT(live_.empty() && pending_recv_.empty());
  for (SlotState& s : done_) {
    for (auto& w : s.sends) w->wait();
    free_slots_.push_back(s.slot);
  }
  done_.clear();
  for (auto& w : other_sends_) w->wait();
  other_sends_.clear();
  return loss;
}

}  // namespace shardtrain
