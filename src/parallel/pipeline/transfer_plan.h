// The order in which a pipeline rank issues its work for one step — compute passes, sends,
// receives and waits — as a pure function of the schedule, and a model of NCCL's semantics that
// tells whether a set of such orders can deadlock.
//
// Channels. Point-to-point messages travel on channels, each channel one communicator (on GPUs:
// one NCCL communicator with its own stream). A rank's operations on one channel run in issue
// order, and an NCCL send may not complete before its receive runs on the peer (NCCL's docs,
// "Point-to-point communication": ncclSend/ncclRecv block the GPU stream until the peer joins).
// With one channel per kind of message (all activations on one, all gradients on another), a
// rank's channel interleaves "receive from the previous stage" with "send to the next": a send
// waiting for its receiver holds up the receive queued behind it, and a chain of stages can wait
// in a ring. Example (4 stages, 1F1B): stage 3 sends the tied embedding's gradient to stage 0
// before its last activation gradient to stage 2; stage 0 receives its last activation gradient
// from stage 1 first, which waits on stage 2, which waits on stage 3's send behind the one to
// stage 0 — a cycle. per_neighbour() gives every directed pair of ranks its own channel (edge
// colouring: a rank never uses one channel for two peers or two directions), so a channel's
// messages have one sender and one receiver, posted in the same order on both sides.
//
// Receives. A rank posts a receive when a pass needs it (on GPUs an early receive would only
// wait for compute enqueued before it); messages on a channel match in issue order, so it posts
// the receives from one peer in that peer's send order: every earlier message first, into the
// slot it belongs to. With `post_ahead` (CPU ranks, MPI) it also keeps the next receive from
// each peer posted, so a large transfer progresses while the rank computes.
#pragma once

#include <compare>
#include <string>
#include <vector>

#include "parallel/pipeline/schedule.h"

namespace shardtrain {

enum class MessageKind {
  kActivation,    ///< forward output of virtual stage v to v + 1
  kGradient,      ///< ∂L/∂input of virtual stage v to v − 1
  kTiedGradient,  ///< the head's wte gradient, last stage to stage 0, once per step
};

/// A message as its receiver names it: kind, micro-batch and the receiver's model chunk (0 for
/// the tied gradient).
struct PipelineMessage {
  MessageKind kind = MessageKind::kActivation;
  int micro_batch = 0;
  int chunk = 0;
  auto operator<=>(const PipelineMessage&) const = default;
};

/// Which channel carries the messages from one rank to another.
class PipelineChannels {
 public:
  /// One channel per directed pair of neighbouring ranks (r → r+1, r → r−1, mod P), edge-coloured
  /// so that each rank uses a channel for one peer and one direction only: 2 channels for P = 2,
  /// 4 for even P ≥ 4, 6 for odd P ≥ 3 (the ring's wrap-around edge gets a colour of its own).
  static PipelineChannels per_neighbour(int stages);
  /// One channel for activations and one for gradients and the tied gradient, whatever the pair
  /// (the executor's layout before per_neighbour; kept to show the deadlock it allows).
  static PipelineChannels per_kind(int stages);

  /// Channels in use (the communicators to create), ≥ 1 for P ≥ 2, 0 for P = 1.
  int count() const { return count_; }
  /// The channel of a message of `kind` from rank `src` to rank `dst` (src ≠ dst, both in
  /// [0, P)). Throws ConfigError for ranks out of range.
  int of(int src, int dst, MessageKind kind) const;

 private:
  int stages_ = 1, count_ = 0;
  bool per_kind_ = false;
};

enum class IssueType {
  kCompute,  ///< a pass (F, B, I, W) or a transfer to the same rank (a copy), on the compute stream
  kPostRecv,  ///< post the receive of `message` from `peer` on `channel`
  kWaitRecv,  ///< make the compute stream wait for the receive of `message`
  kSend,      ///< send `message` (as the receiver names it) to `peer` on `channel`
};

/// One thing a rank issues. `action` is the schedule's action behind it (for kWaitRecv of the tied
/// gradient: the weight pass that needs it).
struct IssuedOp {
  IssueType type = IssueType::kCompute;
  PipelineAction action{ActionType::kForward, 0, 0};
  PipelineMessage message{};
  int peer = -1;
  int channel = -1;
  bool operator==(const IssuedOp&) const = default;
};

/// Everything `rank` issues in one step of `schedule` over `shape`, in issue order: the schedule's
/// actions (with_transfers) with each network transfer as kSend, or as kPostRecv(s) + kWaitRecv,
/// and the tied gradient (sent after the head's last weight pass, awaited before the embedding's
/// last weight pass). Throws ConfigError for shapes check_pipeline_shape rejects.
std::vector<IssuedOp> pipeline_issue_order(PipelineSchedule schedule, const PipelineShape& shape,
                                           int rank, const PipelineChannels& channels,
                                           bool post_ahead);

/// Runs the ranks' issue orders (`orders[r]`, e.g. from pipeline_issue_order) under NCCL's
/// semantics: each rank has a compute stream and one stream per channel; every op goes to its
/// stream in issue order and the host never blocks; a compute op starts after the compute op
/// before it and after every kWaitRecv issued before it has its receive completed; a send or a
/// receive starts after the op before it on its channel's stream and after all compute issued
/// before it (the NCCL communicator's ready event); a send and its receive complete together, once
/// both have started (no buffering). Returns an empty string when every op completes, otherwise a
/// description of the ops each stuck stream waits in (or of a send that met a different receive).
std::string nccl_order_deadlock(const std::vector<std::vector<IssuedOp>>& orders);

}  // namespace shardtrain
