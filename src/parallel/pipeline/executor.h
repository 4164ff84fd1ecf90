// The pipeline executor: runs one rank's schedule (schedule.h) for one optimizer step on its
// stage model, any schedule — forwards, fused backwards, input- and weight-gradient passes,
// and the point-to-point transfers between neighbouring stages (Megatron-LM's habit: schedules
// apart from p2p communication). 2bw runs without a flush: a step may end with the next step's
// look-ahead forwards, whose slots (micro-batches M..M+w−1) carry over to the next run as its
// micro-batches 0..w−1.
//
// Activation slots. Each (micro-batch, chunk) in flight holds a slot of the stage model
// (GPT2Model::prepare): its input, what backward needs, its residual gradient. A slot is taken at
// its micro-batch's first receive or forward and given back after its last pass (the fused
// backward, or W) once its sends completed, so a rank holds as many slots as the schedule keeps
// micro-batches in flight (M for GPipe, ≤ P for 1F1B).
//
// Transfers never deadlock. The executor issues exactly pipeline_issue_order() (transfer_plan.h):
// every directed pair of neighbouring ranks has its own channel (communicator, and on GPUs its own
// NCCL stream), receives are posted in the sender's order, and at first use of a shape the orders
// of all ranks are run through the NCCL-semantics model (nccl_order_deadlock), which must find no
// wait cycle. Sends are nonblocking; a finished slot is reused once its sends completed.
//
// The tied embedding's gradient (pipeline_parallel.h) travels as one more message from the last
// stage to the first: after the head's last weight-gradient pass of the step, and it is added to
// the embedding's gradient in the embedding's last weight-gradient pass, before the strategy's
// after_backward hook reduces it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "comm/communicator.h"
#include "model/gpt2.h"
#include "model/micro_batch.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/trace.h"
#include "parallel/pipeline/transfer_plan.h"
#include "parallel/step_result.h"
#include "parallel/strategy.h"

namespace shardtrain {

/// Local layers [first, last) of the stage model that one chunk runs.
struct ChunkLayers {
  int first = 0, last = 0;
};

/// 2bw without a flush (schedule.h, PipelineShape::fill/drain): what a step that runs the next
/// step's look-ahead forwards needs.
struct PipelineLookahead {
  /// The next step's micro-batches (the first stage reads the first P − 1).
  const MicroBatchSource& next_batches;
  /// Makes the stage compute with the next step's weights (true) or this step's (false): the
  /// look-ahead forwards use the next step's (PipeDream-2BW's second weight version).
  std::function<void(bool next)> use_weights;
};

class PipelineExecutor : public LayerHooks {
 public:
  /// `model`: this rank's stage model, its hooks set to `inner` (the strategy across replicas);
  /// the executor puts itself in between. `channels`: PipelineChannels::per_neighbour(P).count()
  /// communicators over the P ranks of this replica in stage order (rank = stage), channel i
  /// carrying what PipelineChannels::of assigns to i. `chunks`: the layers of each of the V
  /// chunks. `dwte` (last stage without the embedding: the head's wte gradient, sent to stage 0)
  /// may be empty.
  PipelineExecutor(GPT2Model& model, Strategy& inner, Backend& backend,
                   std::vector<Communicator*> channels, PipelineSchedule schedule,
                   int virtual_stages, std::vector<ChunkLayers> chunks, Tensor dwte);

  /// Runs this rank's actions for M = `micro_batches` micro-batches of `batches`, each
  /// micro-batch's loss scaled by `grad_scale` per token. Returns the sum of the micro-batches'
  /// mean losses on the last stage (0 elsewhere). Collective over `pipe`. With `trace`, records
  /// each action's start and end (synchronizing the device after each).
  /// 2bw: `lookahead` set, the step ends with the next step's look-ahead forwards (it does not
  /// drain) and their activations stay in their slots for the next run; a run after one that
  /// did not drain does not fill. Every rank must pass the same.
  double run(int micro_batches, const MicroBatchSource& batches, double loss_scale, bool trace,
             const PipelineLookahead* lookahead = nullptr);
  /// Forgets the look-ahead forwards of the last run (their slots freed): the next run fills the
  /// pipeline again and recomputes them. For whatever needs the slots or the weights between two
  /// steps (evaluation, loading a checkpoint). Collective only in that every rank must call it.
  void discard_lookahead();
  /// Whether the last run left look-ahead forwards (the next run does not fill).
  bool holds_lookahead() const { return held_lookahead_; }
  /// The shape of the last run (2bw: whether it filled and drained).
  const PipelineShape& shape() const { return shape_; }
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
  struct SlotState {
    int slot = -1;
    std::vector<std::unique_ptr<Work>> sends;
  };

  int slot_for(int m, int c);
  void release(int m, int c);
  /// The input gradient of (m, c) left this chunk (to a peer or a chunk of this rank).
  void gradient_sent(int m, int c);
  void reclaim();
  /// Where message `k` lands (a slot's chunk input or gradient, or the tied gradient).
  Tensor receive_buffer(const PipelineMessage& k);
  /// What a send of `op` reads.
  Tensor send_buffer(const IssuedOp& op);
  /// 2bw without a flush: switches to the weights micro-batch `m` computes with (the next step's
  /// for a look-ahead micro-batch m ≥ M).
  void use_weights_of(int m);
  /// Runs a kCompute op: a pass, or a transfer to this same rank (a copy).
  void compute(const PipelineAction& a, const MicroBatchSource& batches);
  /// The micro-batch's dropout seed (a look-ahead micro-batch m ≥ M: the next step's m − M).
  uint64_t dropout_seed(int m) const {
    return m < M_ ? micro_batch_dropout_seed(dropout_run_seed_, dropout_replica_, dropout_step_, m)
                  : micro_batch_dropout_seed(dropout_run_seed_, dropout_replica_, dropout_step_ + 1,
                                             m - M_);
  }
  int virtual_stage(int c) const { return c * P_ + rank_; }
  int rank_of(int v) const { return v % P_; }
  int chunk_of(int v) const { return v / P_; }

  GPT2Model& model_;
  LayerHooks& inner_hooks_;
  Strategy& inner_;
  Backend& backend_;
  std::vector<Communicator*> channels_;
  PipelineChannels channel_map_;
  PipelineSchedule schedule_;
  int P_, V_, rank_;
  uint64_t dropout_run_seed_ = 0;
  int dropout_replica_ = 0;
  int64_t dropout_step_ = 0;
  std::vector<ChunkLayers> chunks_;
  /// CPU (MPI): keep the next receive from each neighbour posted, so that a large (rendezvous)
  /// transfer proceeds while this rank computes. GPU: post receives when needed — an early
  /// receive would wait for the compute enqueued before it, holding up the channel behind it.
  bool post_ahead_;
  Tensor dwte_;           ///< last stage: the head's wte gradient (sent)
  FlatBuffer tied_grad_;  ///< first stage: the received wte gradient
  bool add_tied_ = false;
  /// Tracing on a GPU: the host waits for each received message before the next action starts,
  /// so that a receive's wait is timed as the receive's and not inside the next compute pass
  /// (a GPU receive otherwise only makes the compute stream wait).
  bool sync_receives_ = false;

  int M_ = 0;
  PipelineShape shape_;  ///< of the current (last) run
  /// This rank's issue order for each (M, fill, drain) run so far.
  std::map<std::tuple<int, bool, bool>, std::vector<IssuedOp>> orders_;
  const PipelineLookahead* lookahead_ = nullptr;  ///< of the current run
  bool using_next_ = false;      ///< the stage computes with the next step's weights now
  bool held_lookahead_ = false;  ///< the last run left look-ahead forwards in their slots
  // Per run.
  int64_t B_ = 0, T_ = 0;
  float grad_scale_ = 1;
  double loss_ = 0;
  std::vector<int> weight_passes_;  ///< per chunk, weight-gradient passes run so far
  /// Last stage: each micro-batch's per-token losses [M, B·T] fp32, summed once after the step
  /// (reading a loss mid-step would make the host wait for the device).
  FlatBuffer step_losses_;
  std::map<std::pair<int, int>, SlotState> live_;
  std::vector<SlotState> done_;  ///< finished slots whose sends may still be in flight
  std::vector<int> free_slots_;
  int next_slot_ = 0, peak_slots_ = 0;
  std::map<PipelineMessage, std::unique_ptr<Work>> pending_recv_;
  std::vector<std::unique_ptr<Work>> other_sends_;
  std::vector<MeasuredAction> trace_;
};

}  // namespace shardtrain
