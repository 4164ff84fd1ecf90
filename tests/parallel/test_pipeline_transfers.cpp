// The pipeline's issue order and channels (parallel/pipeline/transfer_plan.h) under a model of
// NCCL's semantics: a send completes only when its receive runs on the peer, and the operations
// of one stream (one communicator) run in issue order. A deadlock of this kind would hang a GPU
// job on its first step; here it fails on CPU.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "parallel/pipeline/transfer_plan.h"

namespace shardtrain {
namespace {

constexpr PipelineSchedule kAll[] = {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                                     PipelineSchedule::kInterleaved, PipelineSchedule::kZBH1,
                                     PipelineSchedule::k2BW};

std::vector<std::vector<IssuedOp>> orders(PipelineSchedule s, const PipelineShape& shape,
                                          const PipelineChannels& channels,
                                          bool post_ahead = false) {
  std::vector<std::vector<IssuedOp>> out;
  for (int r = 0; r < shape.stages; ++r)
    out.push_back(pipeline_issue_order(s, shape, r, channels, post_ahead));
  return out;
}

/// The shapes the fix must run: P = 2…8, M = P, 2P, 8, 16, V = 2 for interleaved (and 3).
std::vector<PipelineShape> shapes_for(PipelineSchedule s) {
  std::vector<PipelineShape> out;
  for (int P = 2; P <= 8; ++P)
    for (int M : std::set<int>{P, 2 * P, 8, 16})
      for (int V : {1, 2, 3})
        for (int flush = 0; flush < 4; ++flush) {  // 2bw: with and without fill and drain
          const PipelineShape shape{P, M, V, (flush & 1) == 0, (flush & 2) == 0};
          try {
            check_pipeline_shape(s, shape);
            out.push_back(shape);
          } catch (const ConfigError&) {
          }
        }
  return out;
}

/// `steps` consecutive 2bw steps of `shape` (the first fills, the last drains), each rank's orders
/// concatenated with step k's micro-batch m renamed k·M + m — so a look-ahead micro-batch M + j
/// of step k is micro-batch j of step k + 1, as the executor carries it.
std::vector<std::vector<IssuedOp>> consecutive_2bw(PipelineShape shape, int steps,
                                                   const PipelineChannels& channels) {
  std::vector<std::vector<IssuedOp>> out(static_cast<size_t>(shape.stages));
  for (int k = 0; k < steps; ++k) {
    shape.fill = k == 0;
    shape.drain = k + 1 == steps;
    for (int r = 0; r < shape.stages; ++r)
      for (IssuedOp op : pipeline_issue_order(PipelineSchedule::k2BW, shape, r, channels, false)) {
        op.action.micro_batch += k * shape.micro_batches;
        if (op.message.kind != MessageKind::kTiedGradient)
          op.message.micro_batch += k * shape.micro_batches;
        else
          op.message.micro_batch = k;  // one per step
        out[static_cast<size_t>(r)].push_back(op);
      }
  }
  return out;
}

IssuedOp send(int peer, int channel, int m) {
  return {IssueType::kSend,
          {ActionType::kSendActivation, m, 0},
          {MessageKind::kActivation, m, 0},
          peer,
          channel};
}
IssuedOp post(int peer, int channel, int m) {
  return {IssueType::kPostRecv,
          {ActionType::kRecvActivation, m, 0},
          {MessageKind::kActivation, m, 0},
          peer,
          channel};
}
IssuedOp wait(int peer, int channel, int m) {
  return {IssueType::kWaitRecv,
          {ActionType::kRecvActivation, m, 0},
          {MessageKind::kActivation, m, 0},
          peer,
          channel};
}
IssuedOp compute(int m) { return {IssueType::kCompute, {ActionType::kForward, m, 0}}; }

// The model itself: two ranks that each send to the other before receiving on one stream wait
// forever; on two streams, or with the receive first on one side, they finish.
TEST(NcclOrderModel, HeadToHeadSendsOnOneStreamDeadlock) {
  EXPECT_NE(nccl_order_deadlock({{send(1, 0, 0), post(1, 0, 1), wait(1, 0, 1)},
                                 {send(0, 0, 1), post(0, 0, 0), wait(0, 0, 0)}}),
            "");
  EXPECT_EQ(nccl_order_deadlock({{send(1, 0, 0), post(1, 1, 1), wait(1, 1, 1)},
                                 {send(0, 1, 1), post(0, 0, 0), wait(0, 0, 0)}}),
            "");
  EXPECT_EQ(nccl_order_deadlock({{send(1, 0, 0), post(1, 0, 1), wait(1, 0, 1)},
                                 {post(0, 0, 0), wait(0, 0, 0), send(0, 0, 1)}}),
            "");
}

// A transfer waits for the compute issued before it: a send whose data comes from a pass that
// waits for the peer's reply, which the peer can only send after this send, never completes.
TEST(NcclOrderModel, TransfersWaitForComputeIssuedBeforeThem) {
  EXPECT_NE(nccl_order_deadlock({{post(1, 1, 0), wait(1, 1, 0), compute(0), send(1, 0, 1)},
                                 {post(0, 0, 1), wait(0, 0, 1), send(0, 1, 0)}}),
            "");
  EXPECT_EQ(nccl_order_deadlock({{post(1, 1, 0), wait(1, 1, 0), compute(0), send(1, 0, 1)},
                                 {send(0, 1, 0), post(0, 0, 1), wait(0, 0, 1)}}),
            "");
  // Messages out of order on a channel are named.
  const std::string why =
      nccl_order_deadlock({{send(1, 0, 0), send(1, 0, 1)}, {post(0, 0, 1), post(0, 0, 0)}});
  EXPECT_NE(why.find("meets"), std::string::npos) << why;
}

// One channel per kind of message (the executor's layout before per-neighbour channels)
// deadlocks 4-stage 1F1B, GPipe and interleaved 1F1B in their first step, as they did on 4 GPUs;
// ZB-H1 on 4 stages and 1F1B on 2 stages ran there, and pass here too.
TEST(NcclOrderModel, PerKindChannelsDeadlockFourStages) {
  const PipelineChannels per_kind = PipelineChannels::per_kind(4);
  for (int M : {4, 8, 16}) {
    SCOPED_TRACE(M);
    EXPECT_NE(nccl_order_deadlock(orders(PipelineSchedule::k1F1B, {4, M, 1}, per_kind)), "");
    EXPECT_NE(nccl_order_deadlock(orders(PipelineSchedule::kGPipe, {4, M, 1}, per_kind)), "");
    EXPECT_NE(nccl_order_deadlock(orders(PipelineSchedule::kInterleaved, {4, M, 2}, per_kind)), "");
    EXPECT_EQ(nccl_order_deadlock(orders(PipelineSchedule::kZBH1, {4, M, 1}, per_kind)), "");
    EXPECT_EQ(nccl_order_deadlock(
                  orders(PipelineSchedule::k1F1B, {2, M, 1}, PipelineChannels::per_kind(2))),
              "");
  }
  // The 4-stage 1F1B cycle: stage 3's tied gradient to stage 0 queued before its last activation
  // gradient to stage 2 (see transfer_plan.h).
  const std::string why = nccl_order_deadlock(orders(PipelineSchedule::k1F1B, {4, 8, 1}, per_kind));
  EXPECT_NE(why.find("rank 3 channel 1: send tied gradient"), std::string::npos) << why;
}

// Per-neighbour channels: every schedule, P = 2…8, V = 1, 2 (3), M = P, 2P, 8, 16 finishes under
// the model, with receives posted when needed (GPUs) or kept posted ahead (CPU ranks).
TEST(NcclOrderModel, PerNeighbourChannelsNeverDeadlock) {
  for (PipelineSchedule s : kAll)
    for (const PipelineShape& shape : shapes_for(s))
      for (bool ahead : {false, true}) {
        SCOPED_TRACE(fmt::format("{} P {} M {} V {} post_ahead {}", to_string(s), shape.stages,
                                 shape.micro_batches, shape.virtual_stages, ahead));
        EXPECT_EQ(nccl_order_deadlock(
                      orders(s, shape, PipelineChannels::per_neighbour(shape.stages), ahead)),
                  "");
      }
}

// Each rank uses a channel for one peer and one direction; on each channel a sender's messages
// and its receiver's posted receives are the same list in the same order.
// 2bw without a flush: the look-ahead activations a step sends are received in that step, and
// consecutive steps run as one stream without a wait cycle.
TEST(NcclOrderModel, TwoBWStepsWithoutFlushChain) {
  for (int P = 2; P <= 6; ++P)
    for (int M : std::set<int>{P, P + 1, 8}) {
      const PipelineShape shape{P, M, 1};
      const std::string cycle =
          nccl_order_deadlock(consecutive_2bw(shape, 4, PipelineChannels::per_neighbour(P)));
      EXPECT_EQ(cycle, "") << "P=" << P << " M=" << M;
    }
}

TEST(NcclOrderModel, ChannelsHaveOneSenderAndOneReceiver) {
  for (int P = 2; P <= 9; ++P) {
    const PipelineChannels ch = PipelineChannels::per_neighbour(P);
    for (int r = 0; r < P; ++r) {
      std::map<int, std::pair<int, int>> use;  // channel → (src, dst)
      for (int peer : {(r + 1) % P, (r + P - 1) % P})
        for (auto [src, dst] : {std::pair{r, peer}, std::pair{peer, r}}) {
          const int c = ch.of(src, dst, MessageKind::kActivation);
          EXPECT_GE(c, 0);
          EXPECT_LT(c, ch.count());
          EXPECT_EQ(c, ch.of(src, dst, MessageKind::kGradient));
          const auto [it, fresh] = use.emplace(c, std::pair{src, dst});
          EXPECT_TRUE(fresh || it->second == std::pair(src, dst))
              << "P " << P << " rank " << r << " channel " << c;
        }
    }
    if (P > 3) {
      EXPECT_THROW(ch.of(0, 2, MessageKind::kActivation), ConfigError);
    }
  }
  for (PipelineSchedule s : kAll)
    for (const PipelineShape& shape : shapes_for(s)) {
      const auto all = orders(s, shape, PipelineChannels::per_neighbour(shape.stages));
      std::map<std::tuple<int, int, int>, std::vector<PipelineMessage>> sent, posted;
      for (int r = 0; r < shape.stages; ++r)
        for (const IssuedOp& op : all[static_cast<size_t>(r)]) {
          if (op.type == IssueType::kSend) sent[{op.channel, r, op.peer}].push_back(op.message);
          if (op.type == IssueType::kPostRecv)
            posted[{op.channel, op.peer, r}].push_back(op.message);
        }
      EXPECT_EQ(sent, posted) << to_string(s) << " P " << shape.stages;
    }
}

}  // namespace
}  // namespace shardtrain
