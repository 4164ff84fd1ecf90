// MPI communicator for CPU tensors: nonblocking MPI collectives (MPI_Iallreduce, ...) behind
// Work handles whose wait() polls MPI_Test against a deadline.
//
// Naming the rank that holds a job up. Every process has a "health" communicator (a duplicate of
// MPI_COMM_WORLD). While a rank polls in wait() it also answers, on that communicator, queries
// asking which operation it is waiting for and how many collectives it has issued on a given
// communicator. When a wait() times out, the rank queries the other members of the group and waits
// a short grace period for answers: a rank that does not answer is not inside any wait() (it is
// stuck computing, sleeping or dead); a rank that answers with fewer collectives issued is waiting
// for another operation (a mismatch). The rank then prints
//   error: rank 0: all_reduce #17 did not complete within 30 s: rank 1 has not joined it (it is
//   stuck or dead)
// and calls MPI_Abort, which makes mpirun stop every rank. Only the main thread calls MPI
// (MPI_THREAD_FUNNELED).
//
// Determinism: MPI picks the reduction algorithm (and so the summation order) from the message
// size and the number of ranks; with 3 or more ranks floating-point sums may differ in the last
// bits between message sizes or Open MPI versions, but every rank receives the same result and a
// rerun with the same world size and build gives the same bits.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <fmt/core.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_support.h"
#include "comm/communicator.h"
#include "core/error.h"

namespace shardtrain {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kQueryTag = 1;
constexpr int kReplyTag = 2;
constexpr int kSplitTag = 7301;
constexpr int kP2PTag = 11;

void mpi_check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw RuntimeFailure(fmt::format("MPI: {} failed: {}", what, std::string(text, len)));
}

// ---- 16-bit floats --------------------------------------------------------------------------

float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);                 // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow → inf
  if (abs < 0x38800000u) {  // subnormal or zero in fp16
    if (abs < 0x33000000u) return sign;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14 .. 24
    const uint32_t half = 1u << (shift - 1);
    uint32_t v = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1);
    if (rest > half || (rest == half && (v & 1u))) ++v;
    return static_cast<uint16_t>(sign | v);
  }
  uint32_t v = ((abs >> 13) - (112u << 10));
  const uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (v & 1u))) ++v;
  return static_cast<uint16_t>(sign | v);
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float), bool kMax>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = Load(a[i]), y = Load(b[i]);
    b[i] = Store(kMax ? std::max(x, y) : x + y);
  }
}

// ---- process-wide state (main thread only) --------------------------------------------------

struct HealthQuery {
  int64_t id = 0;
  uint64_t comm_key = 0;
};

struct HealthReply {
  int64_t id = 0;
  int64_t launched = -1;  ///< collectives issued on the queried communicator; -1: not a member
  char doing[200] = {};
};

struct CommState;

struct PendingSend {
  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<char> buffer;
};

/// An operation whose Work was destroyed before it completed: kept until MPI is done with it.
struct Orphan {
  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<char> temp;
};

struct Runtime {
  bool we_initialized = false;
  bool finalized = false;
  bool failed = false;  ///< a timeout was reported: leave MPI objects alone
  MPI_Comm health = MPI_COMM_NULL;
  int world_rank = 0;
  int world_size = 1;
  MPI_Op bf16_sum = MPI_OP_NULL, bf16_max = MPI_OP_NULL;
  MPI_Op f16_sum = MPI_OP_NULL, f16_max = MPI_OP_NULL;
  std::vector<CommState*> comms;
  std::map<uint64_t, int> created;  ///< communicators created per member set
  std::string doing = "starting";
  int64_t next_query = 1;
  int64_t active_query = 0;
  std::map<int, HealthReply> replies;
  std::vector<std::unique_ptr<PendingSend>> sends;
  std::vector<std::unique_ptr<Orphan>> orphans;
};

Runtime& rt() {
  static Runtime r;
  return r;
}

struct CommState {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  std::vector<int> world_ranks;  ///< world rank of each group rank
  uint64_t key = 0;
  std::string group;  ///< "" for the world, " in group [0, 2]" otherwise
  int64_t launched = 0;
  int64_t p2p = 0;
  CommOptions options;
  FaultInjection fault;

  ~CommState() {
    Runtime& r = rt();
    r.comms.erase(std::remove(r.comms.begin(), r.comms.end(), this), r.comms.end());
    // Operations whose Work was dropped may still run on it: leave the handle then.
    if (comm != MPI_COMM_NULL && !r.failed && !r.finalized && r.orphans.empty())
      MPI_Comm_free(&comm);
  }
};

void post_send(int dest, int tag, const void* data, size_t bytes) {
  Runtime& r = rt();
  auto s = std::make_unique<PendingSend>();
  s->buffer.assign(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
  mpi_check(MPI_Isend(s->buffer.data(), static_cast<int>(bytes), MPI_BYTE, dest, tag, r.health,
                      &s->request),
            "MPI_Isend (health)");
  r.sends.push_back(std::move(s));
}

/// Answers other ranks' queries, collects answers to ours, and frees finished sends and orphans.
void service_health() {
  Runtime& r = rt();
  if (r.health == MPI_COMM_NULL) return;
  for (;;) {
    int flag = 0;
    MPI_Status st;
    mpi_check(MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, r.health, &flag, &st), "MPI_Iprobe");
    if (!flag) break;
    HealthQuery q;
    mpi_check(
        MPI_Recv(&q, sizeof q, MPI_BYTE, st.MPI_SOURCE, kQueryTag, r.health, MPI_STATUS_IGNORE),
        "MPI_Recv (health)");
    HealthReply rep;
    rep.id = q.id;
    for (const CommState* c : r.comms)
      if (c->key == q.comm_key) rep.launched = c->launched;
    std::snprintf(rep.doing, sizeof rep.doing, "%s", r.doing.c_str());
    post_send(st.MPI_SOURCE, kReplyTag, &rep, sizeof rep);
  }
  for (;;) {
    int flag = 0;
    MPI_Status st;
    mpi_check(MPI_Iprobe(MPI_ANY_SOURCE, kReplyTag, r.health, &flag, &st), "MPI_Iprobe");
    if (!flag) break;
    HealthReply rep;
    mpi_check(
        MPI_Recv(&rep, sizeof rep, MPI_BYTE, st.MPI_SOURCE, kReplyTag, r.health, MPI_STATUS_IGNORE),
        "MPI_Recv (health)");
    if (rep.id == r.active_query && r.active_query != 0) r.replies[st.MPI_SOURCE] = rep;
  }
  auto test_done = [](MPI_Request& req) {
    int flag = 0;
    MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    return flag != 0;
  };
  std::erase_if(r.sends, [&](auto& s) { return test_done(s->request); });
  std::erase_if(r.orphans, [&](auto& o) { return test_done(o->request); });
}

/// Sleeps a little longer the longer a wait lasts: yields for the first millisecond (collectives
/// of small messages finish in microseconds), then 20 µs, then 0.5 ms after 100 ms.
void backoff(Clock::duration waited) {
  if (waited < std::chrono::milliseconds(1))
    std::this_thread::yield();
  else if (waited < std::chrono::milliseconds(100))
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  else
    std::this_thread::sleep_for(std::chrono::microseconds(500));
}

uint64_t members_hash(const std::vector<int>& ranks) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (int v : ranks) {
    for (int b = 0; b < 4; ++b) {
      h ^= static_cast<uint64_t>((static_cast<uint32_t>(v) >> (8 * b)) & 0xffu);
      h *= 1099511628211ull;
    }
  }
  return h;
}

std::shared_ptr<CommState> register_comm(MPI_Comm comm, std::vector<int> world_ranks,
                                         const CommOptions& options) {
  Runtime& r = rt();
  auto st = std::make_shared<CommState>();
  st->comm = comm;
  mpi_check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  mpi_check(MPI_Comm_rank(comm, &st->rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(comm, &st->size), "MPI_Comm_size");
  const uint64_t h = members_hash(world_ranks);
  st->key = h ^ (static_cast<uint64_t>(r.created[h]++) * 0x9e3779b97f4a7c15ull);
  bool is_world = static_cast<int>(world_ranks.size()) == r.world_size;
  for (size_t i = 0; is_world && i < world_ranks.size(); ++i)
    is_world = world_ranks[i] == static_cast<int>(i);
  if (!is_world) st->group = " in group " + rank_list(world_ranks);
  st->world_ranks = std::move(world_ranks);
  st->options = options;
  st->fault = FaultInjection::from_env(r.world_rank);
  r.comms.push_back(st.get());
  return st;
}

/// What a Work waits for, for messages.
struct OpInfo {
  std::string name;  ///< "all_reduce #17", "recv #2 from rank 1"
  bool collective = true;
  int peer = -1;    ///< group rank of the peer of a send/recv
  int64_t seq = 0;  ///< collective number on its communicator (1-based)
};

class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<CommState> state, OpInfo info)
      : state_(std::move(state)), info_(std::move(info)) {}

  ~MpiWork() override {
    if (done_ || request_ == MPI_REQUEST_NULL || rt().finalized) return;
    auto o = std::make_unique<Orphan>();
    o->request = request_;
    o->temp = std::move(temp_);
    rt().orphans.push_back(std::move(o));
  }

  MPI_Request* request() { return &request_; }
  std::vector<char>& temp() { return temp_; }
  void on_complete(std::function<void()> f) { on_complete_ = std::move(f); }

  bool completed() override {
    if (done_) return true;
    if (test()) return true;
    service_health();
    return false;
  }

  void wait() override {
    if (done_) return;
    Runtime& r = rt();
    r.doing = "waiting for " + info_.name + state_->group;
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(state_->options.timeout_s));
    for (;;) {
      if (test()) break;
      service_health();
      const auto now = Clock::now();
      if (now >= deadline) {
        const std::string why = investigate();
        if (done_) break;  // it completed while we asked around
        report(why);       // throws, or ends the job
      }
      backoff(now - start);
    }
    r.doing = "computing (last completed " + info_.name + state_->group + ")";
  }

 private:
  bool test() {
    int flag = 0;
    mpi_check(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    if (!flag) return false;
    done_ = true;
    if (on_complete_) on_complete_();
    temp_.clear();
    temp_.shrink_to_fit();
    return true;
  }

  /// Asks the ranks this operation waits for what they are doing; returns the explanation.
  std::string investigate() {
    Runtime& r = rt();
    const CommState& st = *state_;
    std::vector<int> suspects;  // world ranks
    if (info_.collective) {
      for (int w : st.world_ranks)
        if (w != r.world_rank) suspects.push_back(w);
    } else {
      suspects.push_back(st.world_ranks[static_cast<size_t>(info_.peer)]);
    }
    r.active_query = r.next_query++;
    r.replies.clear();
    HealthQuery q;
    q.id = r.active_query;
    q.comm_key = st.key;
    for (int w : suspects) post_send(w, kQueryTag, &q, sizeof q);
    const double grace = std::clamp(st.options.timeout_s / 4, 1.0, 10.0);
    const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(grace));
    while (Clock::now() < until && r.replies.size() < suspects.size()) {
      if (test()) break;
      service_health();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    r.active_query = 0;
    std::vector<int> silent;
    std::vector<std::string> behind;
    for (int w : suspects) {
      const auto it = r.replies.find(w);
      if (it == r.replies.end()) {
        silent.push_back(w);
      } else if (!info_.collective || it->second.launched < info_.seq) {
        behind.push_back(fmt::format("rank {} has not joined it (it is {})", w, it->second.doing));
      }
    }
    std::string why;
    if (!silent.empty()) {
      why = fmt::format("{} {} not joined it ({} stuck or dead)", name_ranks(silent),
                        silent.size() == 1 ? "has" : "have",
                        silent.size() == 1 ? "it is" : "they are");
    }
    for (const auto& b : behind) {
      if (!why.empty()) why += "; ";
      why += b;
    }
    if (why.empty())
      why = "every rank has joined it and is waiting: communication is stalled (network?)";
    return why;
  }

  [[noreturn]] void report(const std::string& why) {
    Runtime& r = rt();
    const std::string msg =
        fmt::format("rank {}: {}{} did not complete within {:g} s: {}", r.world_rank, info_.name,
                    state_->group, state_->options.timeout_s, why);
    if (!state_->options.abort_on_timeout) throw CommTimeoutError(msg);
    r.failed = true;
    std::fprintf(stderr, "error: %s\n", msg.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }

  std::shared_ptr<CommState> state_;
  OpInfo info_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  std::vector<char> temp_;
  std::function<void()> on_complete_;
  bool done_ = false;
};

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::kF32:
      return MPI_FLOAT;
    case DType::kF64:
      return MPI_DOUBLE;
    case DType::kI32:
      return MPI_INT32_T;
    case DType::kBF16:
    case DType::kF16:
    case DType::kU16:
      return MPI_UINT16_T;
    case DType::kU8:
      return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(DType t, ReduceOp op, const char* what) {
  const Runtime& r = rt();
  const bool max = op == ReduceOp::kMax;
  check<RuntimeFailure>(op != ReduceOp::kAvg || t != DType::kI32,
                        "{}: kAvg needs a floating dtype, got int32", what);
  switch (t) {
    case DType::kF32:
    case DType::kF64:
    case DType::kI32:
      return max ? MPI_MAX : MPI_SUM;
    case DType::kBF16:
      return max ? r.bf16_max : r.bf16_sum;
    case DType::kF16:
      return max ? r.f16_max : r.f16_sum;
    case DType::kU16:
    case DType::kU8:
      break;
  }
  throw RuntimeFailure(fmt::format("{}: cannot reduce {} tensors", what, dtype_name(t)));
}

/// Divides `t` (a floating dtype) by `n` in place.
void divide(Tensor t, int n) {
  const int64_t count = t.numel();
  const float inv = 1.0f / static_cast<float>(n);
  if (t.dtype == DType::kF32) {
    float* p = t.f32();
    for (int64_t i = 0; i < count; ++i) p[i] *= inv;
  } else if (t.dtype == DType::kF64) {
    auto* p = t.as<double>();
    for (int64_t i = 0; i < count; ++i) p[i] /= n;
  } else {
    auto* p = t.as<uint16_t>();
    const bool bf = t.dtype == DType::kBF16;
    for (int64_t i = 0; i < count; ++i)
      p[i] = bf ? f32_to_bf16(bf16_to_f32(p[i]) * inv) : f32_to_f16(f16_to_f32(p[i]) * inv);
  }
}

int count_of(const Tensor& t, const char* what) {
  check<RuntimeFailure>(t.numel() <= INT_MAX, "{}: {} elements exceed MPI's int count (2^31-1)",
                        what, t.numel());
  return static_cast<int>(t.numel());
}

void check_cpu(const Tensor& t, const char* what) {
  check<RuntimeFailure>(t.device == DeviceKind::kCPU,
                        "{}: the MPI communicator works on CPU tensors, got a {} tensor", what,
                        device_name(t.device));
}

bool overlaps(const Tensor& a, const Tensor& b) {
  const char* a0 = static_cast<const char*>(a.data);
  const char* b0 = static_cast<const char*>(b.data);
  return a0 < b0 + b.bytes() && b0 < a0 + a.bytes();
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(std::shared_ptr<CommState> state) : st_(std::move(state)) {}

  int rank() const override { return st_->rank; }
  int world_size() const override { return st_->size; }
  std::string backend_name() const override { return "mpi"; }

  std::unique_ptr<Work> all_reduce(Tensor t, ReduceOp op) override {
    check_cpu(t, "all_reduce");
    const MPI_Op mop = mpi_op(t.dtype, op, "all_reduce");
    auto w = start_collective("all_reduce");
    mpi_check(MPI_Iallreduce(MPI_IN_PLACE, t.data, count_of(t, "all_reduce"), mpi_type(t.dtype),
                             mop, st_->comm, w->request()),
              "MPI_Iallreduce");
    if (op == ReduceOp::kAvg) w->on_complete([t, n = st_->size] { divide(t, n); });
    return w;
  }

  std::unique_ptr<Work> reduce_scatter(Tensor output, Tensor input, ReduceOp op) override {
    check_cpu(output, "reduce_scatter");
    check_cpu(input, "reduce_scatter");
    check<RuntimeFailure>(
        output.dtype == input.dtype && input.numel() == output.numel() * st_->size,
        "reduce_scatter: input {} {} must hold world size {} × output {} {}",
        dtype_name(input.dtype), input.numel(), st_->size, dtype_name(output.dtype),
        output.numel());
    const MPI_Op mop = mpi_op(input.dtype, op, "reduce_scatter");
    auto w = start_collective("reduce_scatter");
    const void* send = input.data;
    void* recv = output.data;
    if (output.data == input.data) {
      send = MPI_IN_PLACE;  // the result lands in the first chunk of `input`, which is `output`
      recv = input.data;
    } else if (overlaps(output, input)) {
      w->temp().assign(static_cast<const char*>(input.data),
                       static_cast<const char*>(input.data) + input.bytes());
      send = w->temp().data();
    }
    mpi_check(MPI_Ireduce_scatter_block(send, recv, count_of(output, "reduce_scatter"),
                                        mpi_type(input.dtype), mop, st_->comm, w->request()),
              "MPI_Ireduce_scatter_block");
    if (op == ReduceOp::kAvg) w->on_complete([output, n = st_->size] { divide(output, n); });
    return w;
  }

  std::unique_ptr<Work> all_gather(Tensor output, Tensor input) override {
    check_cpu(output, "all_gather");
    check_cpu(input, "all_gather");
    check<RuntimeFailure>(
        output.dtype == input.dtype && output.numel() == input.numel() * st_->size,
        "all_gather: output {} {} must hold world size {} × input {} {} (every "
        "rank contributes the same count; pad uneven shards)",
        dtype_name(output.dtype), output.numel(), st_->size, dtype_name(input.dtype),
        input.numel());
    auto w = start_collective("all_gather");
    const void* send = input.data;
    const char* own = static_cast<const char*>(output.data) + input.bytes() * st_->rank;
    if (input.data == own) {
      send = MPI_IN_PLACE;
    } else if (overlaps(output, input)) {
      w->temp().assign(static_cast<const char*>(input.data),
                       static_cast<const char*>(input.data) + input.bytes());
      send = w->temp().data();
    }
    const int n = count_of(input, "all_gather");
    const MPI_Datatype type = mpi_type(input.dtype);
    mpi_check(MPI_Iallgather(send, n, type, output.data, n, type, st_->comm, w->request()),
              "MPI_Iallgather");
    return w;
  }

  std::unique_ptr<Work> all_to_all(Tensor output, Tensor input) override {
    check_cpu(output, "all_to_all");
    check_cpu(input, "all_to_all");
    check<RuntimeFailure>(output.dtype == input.dtype && output.numel() == input.numel() &&
                              input.numel() % st_->size == 0 && !overlaps(output, input),
                          "all_to_all: input {} {} and output {} {} must be distinct buffers of "
                          "the same dtype and size, a multiple of the world size {}",
                          dtype_name(input.dtype), input.numel(), dtype_name(output.dtype),
                          output.numel(), st_->size);
    auto w = start_collective("all_to_all");
    const Tensor chunk = input.slice1d(0, input.numel() / st_->size);
    const int n = count_of(chunk, "all_to_all");
    const MPI_Datatype type = mpi_type(input.dtype);
    mpi_check(MPI_Ialltoall(input.data, n, type, output.data, n, type, st_->comm, w->request()),
              "MPI_Ialltoall");
    return w;
  }

  std::unique_ptr<Work> broadcast(Tensor t, int root) override {
    check_cpu(t, "broadcast");
    check<ConfigError>(root >= 0 && root < st_->size, "broadcast: root {} is outside [0, {})", root,
                       st_->size);
    auto w = start_collective("broadcast");
    mpi_check(MPI_Ibcast(t.data, count_of(t, "broadcast"), mpi_type(t.dtype), root, st_->comm,
                         w->request()),
              "MPI_Ibcast");
    return w;
  }

  std::unique_ptr<Work> send(Tensor t, int peer) override {
    check_cpu(t, "send");
    check_peer(peer, "send");
    st_->fault.before_p2p(st_->p2p + 1, "send");
    auto w = std::make_unique<MpiWork>(
        st_, OpInfo{fmt::format("send #{} to rank {}", ++st_->p2p, peer), false, peer, 0});
    mpi_check(MPI_Isend(t.data, count_of(t, "send"), mpi_type(t.dtype), peer, kP2PTag, st_->comm,
                        w->request()),
              "MPI_Isend");
    return w;
  }

  std::unique_ptr<Work> recv(Tensor t, int peer) override {
    check_cpu(t, "recv");
    check_peer(peer, "recv");
    st_->fault.before_p2p(st_->p2p + 1, "recv");
    auto w = std::make_unique<MpiWork>(
        st_, OpInfo{fmt::format("recv #{} from rank {}", ++st_->p2p, peer), false, peer, 0});
    mpi_check(MPI_Irecv(t.data, count_of(t, "recv"), mpi_type(t.dtype), peer, kP2PTag, st_->comm,
                        w->request()),
              "MPI_Irecv");
    return w;
  }

  void barrier() override {
    auto w = start_collective("barrier");
    mpi_check(MPI_Ibarrier(st_->comm, w->request()), "MPI_Ibarrier");
    w->wait();
  }

  std::unique_ptr<Communicator> split(const std::vector<int>& ranks) override {
    const Runtime& r = rt();
    const int me = st_->world_ranks[static_cast<size_t>(st_->rank)];
    std::vector<int> parent_ranks;
    for (int g : ranks) {
      const auto it = std::find(st_->world_ranks.begin(), st_->world_ranks.end(), g);
      check<ConfigError>(it != st_->world_ranks.end(), "split: rank {} is not in this group {}", g,
                         rank_list(st_->world_ranks));
      check<ConfigError>(std::count(ranks.begin(), ranks.end(), g) == 1,
                         "split: rank {} appears twice in {}", g, rank_list(ranks));
      parent_ranks.push_back(static_cast<int>(it - st_->world_ranks.begin()));
    }
    check<ConfigError>(std::find(ranks.begin(), ranks.end(), me) != ranks.end(),
                       "split: rank {} must be in the group it creates, got {}", me,
                       rank_list(ranks));
    MPI_Group parent_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
    mpi_check(MPI_Comm_group(st_->comm, &parent_group), "MPI_Comm_group");
    mpi_check(MPI_Group_incl(parent_group, static_cast<int>(parent_ranks.size()),
                             parent_ranks.data(), &group),
              "MPI_Group_incl");
    MPI_Comm comm = MPI_COMM_NULL;
    {
      Watchdog dog(st_->options.timeout_s,
                   fmt::format("rank {}: split into group {} did not complete within {:g} s: a "
                               "rank of the group has not called split() (it is stuck or dead)",
                               r.world_rank, rank_list(ranks), st_->options.timeout_s));
      mpi_check(MPI_Comm_create_group(st_->comm, group, kSplitTag, &comm), "MPI_Comm_create_group");
    }
    MPI_Group_free(&group);
    MPI_Group_free(&parent_group);
    return std::make_unique<MpiCommunicator>(register_comm(comm, ranks, st_->options));
  }

 private:
  std::unique_ptr<MpiWork> start_collective(const char* op) {
    const int64_t seq = st_->launched + 1;
    st_->fault.before_collective(seq, op);
    st_->launched = seq;
    return std::make_unique<MpiWork>(st_, OpInfo{fmt::format("{} #{}", op, seq), true, -1, seq});
  }

  void check_peer(int peer, const char* what) const {
    check<ConfigError>(peer >= 0 && peer < st_->size && peer != st_->rank,
                       "{}: peer {} must be another rank of [0, {})", what, peer, st_->size);
  }

  std::shared_ptr<CommState> st_;
};

}  // namespace

void init_mpi() {
  Runtime& r = rt();
  int initialized = 0;
  mpi_check(MPI_Initialized(&initialized), "MPI_Initialized");
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    mpi_check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    r.we_initialized = true;
  } else {
    mpi_check(MPI_Query_thread(&provided), "MPI_Query_thread");
  }
  check<RuntimeFailure>(provided >= MPI_THREAD_FUNNELED,
                        "MPI provides thread level {} but shardtrain needs MPI_THREAD_FUNNELED "
                        "(OpenMP threads run beside the thread that calls MPI)",
                        provided);
  if (r.health != MPI_COMM_NULL) return;
  mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &r.world_rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(MPI_COMM_WORLD, &r.world_size), "MPI_Comm_size");
  mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &r.health), "MPI_Comm_dup");
  mpi_check(MPI_Comm_set_errhandler(r.health, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  mpi_check(MPI_Op_create(&reduce16<bf16_to_f32, f32_to_bf16, false>, 1, &r.bf16_sum),
            "MPI_Op_create");
  mpi_check(MPI_Op_create(&reduce16<bf16_to_f32, f32_to_bf16, true>, 1, &r.bf16_max),
            "MPI_Op_create");
  mpi_check(MPI_Op_create(&reduce16<f16_to_f32, f32_to_f16, false>, 1, &r.f16_sum),
            "MPI_Op_create");
  mpi_check(MPI_Op_create(&reduce16<f16_to_f32, f32_to_f16, true>, 1, &r.f16_max), "MPI_Op_create");
}

void finalize_mpi(double timeout_s) {
  Runtime& r = rt();
  if (!r.we_initialized || r.finalized || r.failed) return;
  Watchdog dog(timeout_s, fmt::format("rank {}: MPI_Finalize did not complete within {:g} s: "
                                      "another rank is stuck or dead",
                                      r.world_rank, timeout_s));
  for (auto& s : r.sends) MPI_Request_free(&s->request);
  r.sends.clear();
  for (MPI_Op* op : {&r.bf16_sum, &r.bf16_max, &r.f16_sum, &r.f16_max})
    if (*op != MPI_OP_NULL) MPI_Op_free(op);
  if (r.health != MPI_COMM_NULL) MPI_Comm_free(&r.health);
  MPI_Finalize();
  r.finalized = true;
}

std::unique_ptr<Communicator> make_mpi_communicator(const CommOptions& options) {
  init_mpi();
  Runtime& r = rt();
  check<ConfigError>(options.timeout_s > 0, "the communication timeout must be > 0 s, got {:g}",
                     options.timeout_s);
  MPI_Comm comm = MPI_COMM_NULL;
  mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  std::vector<int> ranks(static_cast<size_t>(r.world_size));
  for (int i = 0; i < r.world_size; ++i) ranks[static_cast<size_t>(i)] = i;
  return std::make_unique<MpiCommunicator>(register_comm(comm, std::move(ranks), options));
}

}  // namespace shardtrain
