#include "parallel/pipeline/transfer_plan.h"

#include <fmt/core.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <utility>

#include "core/error.h"

namespace shardtrain {

// ---- channels ----------------------------------------------------------------------------------

PipelineChannels PipelineChannels::per_neighbour(int stages) {
  PipelineChannels c;
  c.stages_ = stages;
  c.count_ = stages <= 1 ? 0 : stages == 2 ? 2 : stages % 2 == 0 ? 4 : 6;
  return c;
}

PipelineChannels PipelineChannels::per_kind(int stages) {
  PipelineChannels c;
  c.stages_ = stages;
  c.per_kind_ = true;
  c.count_ = stages <= 1 ? 0 : 2;
  return c;
}

int PipelineChannels::of(int src, int dst, MessageKind kind) const {
  const int P = stages_;
  check<ConfigError>(src >= 0 && src < P && dst >= 0 && dst < P && src != dst,
                     "pipeline channel: no channel from rank {} to rank {} among {} stages", src,
                     dst, P);
  if (per_kind_) return kind == MessageKind::kActivation ? 0 : 1;
  if (P == 2) return src;
  // Edge colouring of the directed ring: forward edges r → r+1 take colours 0, 1 by the parity
  // of r, backward edges r+1 → r the next colours by the parity of r; with P odd the wrap-around
  // edge (index P−1) takes a third colour, so a rank's two edges of one direction never share one.
  const int forward_colours = P % 2 == 0 ? 2 : 3;
  const auto colour = [&](int index) { return P % 2 == 1 && index == P - 1 ? 2 : index % 2; };
  if (dst == (src + 1) % P) return colour(src);
  check<ConfigError>(src == (dst + 1) % P,
                     "pipeline channel: ranks {} and {} are not neighbours among {} stages", src,
                     dst, P);
  return forward_colours + colour(dst);
}

// ---- issue order -------------------------------------------------------------------------------

namespace {

/// A send as the schedule issues it: the message as its receiver names it, and the receiver.
struct Outgoing {
  PipelineMessage message;
  int dst;
};

/// Walks `rank`'s actions for one step and reports, in issue order, each compute action (local
/// transfers included: `local` set), each network send, each network receive the action needs
/// (`need`) and the tied gradient's send and wait.
struct Walker {
  std::function<void(const PipelineAction&)> compute;
  std::function<void(const PipelineAction&, const Outgoing&)> send;
  std::function<void(const PipelineAction&, const PipelineMessage&, int src)> need;
};

void walk(PipelineSchedule schedule, const PipelineShape& shape, int rank, const Walker& w) {
  const int P = shape.stages, V = shape.virtual_stages, M = shape.micro_batches;
  const int last_v = P * V - 1;
  const auto rank_of = [&](int v) { return v % P; };
  const auto chunk_of = [&](int v) { return v / P; };
  std::vector<int> weight_passes(static_cast<size_t>(V), 0);
  for (const PipelineAction& a :
       with_transfers(pipeline_compute_actions(schedule, shape, rank), shape, rank)) {
    const int v = virtual_stage(shape, rank, a.chunk);
    switch (a.type) {
      case ActionType::kRecvActivation:
        if (rank_of(v - 1) != rank)
          w.need(a, {MessageKind::kActivation, a.micro_batch, a.chunk}, rank_of(v - 1));
        break;
      case ActionType::kRecvGradient:
        if (rank_of(v + 1) != rank)
          w.need(a, {MessageKind::kGradient, a.micro_batch, a.chunk}, rank_of(v + 1));
        break;
      case ActionType::kSendActivation:
        if (rank_of(v + 1) == rank)
          w.compute(a);
        else
          w.send(a, {{MessageKind::kActivation, a.micro_batch, chunk_of(v + 1)}, rank_of(v + 1)});
        break;
      case ActionType::kSendGradient:
        if (rank_of(v - 1) == rank)
          w.compute(a);
        else
          w.send(a, {{MessageKind::kGradient, a.micro_batch, chunk_of(v - 1)}, rank_of(v - 1)});
        break;
      case ActionType::kForward:
        w.compute(a);
        break;
      case ActionType::kBackward:
      case ActionType::kBackwardInput:
      case ActionType::kBackwardWeight: {
        const bool weights = a.type != ActionType::kBackwardInput;
        int& k = weight_passes[static_cast<size_t>(a.chunk)];
        if (weights) ++k;
        // The embedding's last weight pass adds the head's wte gradient from the last stage.
        if (weights && v == 0 && P > 1 && k == M)
          w.need(a, {MessageKind::kTiedGradient, 0, 0}, P - 1);
        w.compute(a);
        if (weights && v == last_v && P > 1 && k == M)
          w.send(a, {{MessageKind::kTiedGradient, 0, 0}, 0});
        break;
      }
    }
  }
}

}  // namespace

std::vector<IssuedOp> pipeline_issue_order(PipelineSchedule schedule, const PipelineShape& shape,
                                           int rank, const PipelineChannels& channels,
                                           bool post_ahead) {
  check_pipeline_shape(schedule, shape);
  std::vector<IssuedOp> out;
  // Per (peer, channel): the messages the peer sends this rank there, in its order, and how many
  // of them are posted.
  struct Incoming {
    std::vector<PipelineMessage> messages;
    size_t posted = 0;
  };
  std::map<std::pair<int, int>, Incoming> incoming;
  for (int peer = 0; peer < shape.stages; ++peer) {
    if (peer == rank) continue;
    Walker w;
    w.compute = [](const PipelineAction&) {};
    w.need = [](const PipelineAction&, const PipelineMessage&, int) {};
    w.send = [&](const PipelineAction&, const Outgoing& o) {
      if (o.dst == rank)
        incoming[{peer, channels.of(peer, rank, o.message.kind)}].messages.push_back(o.message);
    };
    walk(schedule, shape, peer, w);
  }
  const auto post_next = [&](const PipelineAction& a, std::pair<int, int> key) {
    Incoming& in = incoming.at(key);
    if (in.posted >= in.messages.size()) return false;
    out.push_back({IssueType::kPostRecv, a, in.messages[in.posted++], key.first, key.second});
    return true;
  };
  if (post_ahead)
    for (auto& [key, in] : incoming) post_next({ActionType::kRecvActivation, 0, 0}, key);

  Walker w;
  w.compute = [&](const PipelineAction& a) { out.push_back({IssueType::kCompute, a}); };
  w.send = [&](const PipelineAction& a, const Outgoing& o) {
    out.push_back(
        {IssueType::kSend, a, o.message, o.dst, channels.of(rank, o.dst, o.message.kind)});
  };
  w.need = [&](const PipelineAction& a, const PipelineMessage& m, int src) {
    const std::pair<int, int> key{src, channels.of(src, rank, m.kind)};
    Incoming& in = incoming[key];
    const auto it = std::find(in.messages.begin(), in.messages.end(), m);
    check<RuntimeFailure>(it != in.messages.end(),
                          "pipeline: rank {} expects a message rank {} never sends (schedule "
                          "mismatch between stages)",
                          rank, src);
    const auto index = static_cast<size_t>(it - in.messages.begin());
    while (in.posted <= index) post_next(a, key);
    out.push_back({IssueType::kWaitRecv, a, m, src, key.second});
    if (post_ahead) post_next(a, key);
  };
  walk(schedule, shape, rank, w);
  return out;
}

// ---- the NCCL semantics model -----------------------------------------------------------------

namespace {

std::string describe(const IssuedOp& op) {
  static const char* kinds[] = {"activation", "gradient", "tied gradient"};
  const char* kind = kinds[static_cast<int>(op.message.kind)];
  switch (op.type) {
    case IssueType::kCompute:
      return fmt::format("compute {} of micro-batch {} chunk {}", static_cast<int>(op.action.type),
                         op.action.micro_batch, op.action.chunk);
    case IssueType::kPostRecv:
      return fmt::format("receive {} {}/{} from rank {} on channel {}", kind,
                         op.message.micro_batch, op.message.chunk, op.peer, op.channel);
    case IssueType::kWaitRecv:
      return fmt::format("wait for {} {}/{} from rank {}", kind, op.message.micro_batch,
                         op.message.chunk, op.peer);
    case IssueType::kSend:
      return fmt::format("send {} {}/{} to rank {} on channel {}", kind, op.message.micro_batch,
                         op.message.chunk, op.peer, op.channel);
  }
  return "?";
}

}  // namespace

std::string nccl_order_deadlock(const std::vector<std::vector<IssuedOp>>& orders) {
  const int P = static_cast<int>(orders.size());
  // Streams: per rank, the compute stream and one per channel. An entry: index into the rank's
  // order, and for transfers how many compute ops were issued before it.
  struct Entry {
    size_t op;
    size_t computes_before;
  };
  struct Rank {
    std::vector<Entry> compute;
    std::map<int, std::deque<Entry>> channels;
    size_t computes_done = 0;
    std::set<std::pair<int, PipelineMessage>> received;  // (peer, message)
  };
  std::vector<Rank> ranks(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    Rank& x = ranks[static_cast<size_t>(r)];
    size_t computes = 0;
    for (size_t i = 0; i < orders[static_cast<size_t>(r)].size(); ++i) {
      const IssuedOp& op = orders[static_cast<size_t>(r)][i];
      if (op.type == IssueType::kCompute || op.type == IssueType::kWaitRecv) {
        x.compute.push_back({i, 0});
        ++computes;
      } else {
        x.channels[op.channel].push_back({i, computes});
      }
    }
  }
  const auto op_of = [&](int r, const Entry& e) -> const IssuedOp& {
    return orders[static_cast<size_t>(r)][e.op];
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {  // compute streams
      Rank& x = ranks[static_cast<size_t>(r)];
      while (x.computes_done < x.compute.size()) {
        const IssuedOp& op = op_of(r, x.compute[x.computes_done]);
        if (op.type == IssueType::kWaitRecv && !x.received.count({op.peer, op.message})) break;
        ++x.computes_done;
        progress = true;
      }
    }
    for (int r = 0; r < P; ++r) {  // sends meet receives
      Rank& x = ranks[static_cast<size_t>(r)];
      for (auto& [channel, queue] : x.channels) {
        if (queue.empty() || x.computes_done < queue.front().computes_before) continue;
        const IssuedOp& send = op_of(r, queue.front());
        if (send.type != IssueType::kSend) continue;
        Rank& y = ranks[static_cast<size_t>(send.peer)];
        auto it = y.channels.find(channel);
        if (it == y.channels.end() || it->second.empty() ||
            y.computes_done < it->second.front().computes_before)
          continue;
        const IssuedOp& recv = op_of(send.peer, it->second.front());
        if (recv.type != IssueType::kPostRecv || recv.peer != r) continue;
        if (recv.message != send.message)
          return fmt::format("rank {}: {} meets rank {}: {}", r, describe(send), send.peer,
                             describe(recv));
        y.received.insert({r, recv.message});
        it->second.pop_front();
        queue.pop_front();
        progress = true;
      }
    }
  }
  std::string stuck;
  for (int r = 0; r < P; ++r) {
    const Rank& x = ranks[static_cast<size_t>(r)];
    if (x.computes_done < x.compute.size())
      stuck += fmt::format("{}rank {} compute: {}", stuck.empty() ? "" : "; ", r,
                           describe(op_of(r, x.compute[x.computes_done])));
    for (const auto& [channel, queue] : x.channels)
      if (!queue.empty())
        stuck += fmt::format("{}rank {} channel {}: {}", stuck.empty() ? "" : "; ", r, channel,
                             describe(op_of(r, queue.front())));
  }
  return stuck;
}

}  // namespace shardtrain
