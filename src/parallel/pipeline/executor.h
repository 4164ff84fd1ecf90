// The pipeline executor: runs one rank's schedule (schedule.h) for one optimizer step on its
// stage model, any schedule — forwards, fused backwards, input- and weight-gradient passes,
// and the point-to-point transfers between neighbouring stages (Megatron-LM's habit: schedules
// apart from p2p communication).
//
// Activation slots. Each (micro-batch, chunk) in flight holds a slot of the stage model
// (GPT2Model::prepare): its input, what backward needs, its residual gradient. A slot is taken at
// its micro-batch's first receive or forward and given back after its last pass (the fused
// backward, or W) once its sends completed, so a rank holds as many slots as the schedule keeps
// micro-batches in flight (M for GPipe, ≤ P for 1F1B).
//
// Transfers never deadlock. Sends are nonblocking. Messages between two ranks are matched in
// issue order (MPI without tags; NCCL), so a receiver posts its receives from a peer in the order
// the peer sends them: it derives that order from the peer's own action list (a pure function of
// the schedule) and, when it needs a message, posts every earlier one from that peer first, into
// the slot it belongs to; then it waits for the one it needs. Whether a schedule can finish is
// the simulator's check (a forward waits only for the previous stage's forward, a backward for
// the next stage's backward): every schedule here passes it for every shape (tests).
//
// The tied embedding's gradient (pipeline_parallel.h) travels as one more message from the last
// stage to the first: after the head's last weight-gradient pass of the step, and it is added to
// the embedding's gradient in the embedding's last weight-gradient pass, before the strategy's
// after_backward hook reduces it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "model/gpt2.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/trace.h"
#include "parallel/strategy.h"
#include "train/train_step.h"

namespace shardtrain {

/// Local layers [first, last) of the stage model that one chunk runs.
struct ChunkLayers {
  int first = 0, last = 0;
};

class PipelineExecutor : public LayerHooks {
 public:
  /// `model`: this rank's stage model, its hooks set to `inner` (the strategy across replicas);
  /// the executor puts itself in between. `activations`, `gradients`: two communicators over the
  /// P ranks of this replica in stage order, one for each direction of travel (on GPUs each has
  /// its own NCCL stream, so a send waiting for its receiver never holds up the other direction).
  /// `chunks`: the layers of each of the V chunks. `dwte` (last stage without the embedding: the
  /// head's wte gradient, sent to stage 0) may be empty.
  PipelineExecutor(GPT2Model& model, Strategy& inner, Backend& backend, Communicator& activations,
                   Communicator& gradients, PipelineSchedule schedule, int virtual_stages,
                   std::vector<ChunkLayers> chunks, Tensor dwte);

  /// Runs this rank's actions for M = `micro_batches` micro-batches of `batches`, each
  /// micro-batch's loss scaled by `grad_scale` per token. Returns the sum of the micro-batches'
  /// mean losses on the last stage (0 elsewhere). Collective over `pipe`. With `trace`, records
  /// each action's start and end (synchronizing the device after each).
  double run(int micro_batches, const MicroBatchSource& batches, double loss_scale, bool trace);
  /// The next run()'s dropout: micro-batch m draws its masks from
  /// micro_batch_dropout_seed(run_seed, replica, step, m) (model/gpt2.h) in its forward, its
  /// recompute and its backward, whatever the order the schedule runs them in.
  void set_dropout_step(uint64_t run_seed, int replica, int64_t step) {
    dropout_run_seed_ = run_seed;
    dropout_replica_ = replica;
    dropout_step_ = step;
  }
  /// The actions of the last traced run, times in seconds from its start.
  const std::vector<MeasuredAction>& trace() const { return trace_; }
  const ChunkLayers& chunk(int c) const { return chunks_[static_cast<size_t>(c)]; }
  /// M of the last run.
  int micro_batches() const { return M_; }
  /// The most slots held at once since construction (micro-batch chunks in flight).
  int peak_slots() const { return peak_slots_; }

  // LayerHooks: forwards to the inner strategy; adds the received tied gradient.
  void before_forward(int layer) override { inner_hooks_.before_forward(layer); }
  void after_forward(int layer) override { inner_hooks_.after_forward(layer); }
  void before_backward(int layer) override { inner_hooks_.before_backward(layer); }
  void after_backward(int layer) override;
  /// Polls every send and receive in flight (progress for MPI's rendezvous transfers).
  void between_layers() override;

 private:
  enum class Msg { kActivation, kGradient, kTiedGrad };
  struct Key {
    Msg msg;
    int m, c;
    auto operator<=>(const Key&) const = default;
  };
  struct SlotState {
    int slot = -1;
    std::vector<std::unique_ptr<Work>> sends;
  };

  int slot_for(int m, int c);
  void release(int m, int c);
  void reclaim();
  Tensor receive_buffer(const Key& k);
  /// Posts the receives from `peer` up to `k` (in the peer's send order on k's communicator),
  /// then waits for `k`; with post_ahead_, posts the peer's next message right away.
  void receive(int peer, const Key& k);
  /// Posts the next receive from `peer` on the activations' (or gradients') communicator in the
  /// peer's order; false when every one of the step is posted.
  bool post_next(int peer, bool activations);
  /// The messages `peer` sends to this rank in one step on the communicator of `activations`
  /// (else of gradients and the tied gradient), in its order.
  std::vector<Key> messages_from(int peer, bool activations) const;
  Communicator& comm_of(Msg m) { return m == Msg::kActivation ? act_comm_ : grad_comm_; }
  /// Whether `a` (of rank `rank`) is the pass that completes the chunk's weight gradients for the
  /// step given the passes counted so far.
  static bool writes_weights(ActionType t) {
    return t == ActionType::kBackward || t == ActionType::kBackwardWeight;
  }
  int virtual_stage(int c) const { return c * P_ + rank_; }
  int rank_of(int v) const { return v % P_; }
  int chunk_of(int v) const { return v / P_; }
  uint64_t dropout_seed(int m) const {
    return micro_batch_dropout_seed(dropout_run_seed_, dropout_replica_, dropout_step_, m);
  }

  GPT2Model& model_;
  LayerHooks& inner_hooks_;
  Strategy& inner_;
  Backend& backend_;
  Communicator& act_comm_;
  Communicator& grad_comm_;
  PipelineSchedule schedule_;
  int P_, V_, rank_;
  uint64_t dropout_run_seed_ = 0;
  int dropout_replica_ = 0;
  int64_t dropout_step_ = 0;
  std::vector<ChunkLayers> chunks_;
  /// CPU (MPI): keep the next receive from each neighbour posted, so that a large (rendezvous)
  /// transfer proceeds while this rank computes. GPU: post receives when needed — NCCL runs a
  /// communicator's operations in order on one stream, where an early receive would hold up this
  /// rank's sends queued behind it.
  bool post_ahead_;
  Tensor dwte_;           ///< last stage: the head's wte gradient (sent)
  FlatBuffer tied_grad_;  ///< first stage: the received wte gradient
  bool add_tied_ = false;
  /// Tracing on a GPU: the host waits for each received message before the next action starts,
  /// so that a receive's wait is timed as the receive's and not inside the next compute pass
  /// (a GPU receive otherwise only makes the compute stream wait).
  bool sync_receives_ = false;

  int M_ = 0;
  std::vector<PipelineAction> actions_;  ///< this rank's, with transfers, for M_ micro-batches
  // Per run.
  int64_t B_ = 0, T_ = 0;
  float grad_scale_ = 1;
  std::map<std::pair<int, int>, SlotState> live_;
  std::vector<SlotState> done_;  ///< finished slots whose sends may still be in flight
  std::vector<int> free_slots_;
  int next_slot_ = 0, peak_slots_ = 0;
  /// Per (peer, activations?): the peer's messages to this rank (kept while M_ stays), and how
  /// many of them this run has posted.
  std::map<std::pair<int, bool>, std::vector<Key>> expected_;
  std::map<std::pair<int, bool>, size_t> posted_;
  std::map<Key, std::unique_ptr<Work>> pending_recv_;
  std::vector<std::unique_ptr<Work>> other_sends_;
  std::vector<MeasuredAction> trace_;
};

}  // namespace shardtrain
