// NCCL communicator for CUDA tensors (PyTorch c10d ProcessGroupNCCL's design, simplified):
//  * every communicator has its own communication stream;
//  * an operation records an event on the caller's compute stream, makes the communication stream
//    wait for it, enqueues the NCCL call there and records a completion event;
//  * Work::wait() makes the compute stream wait for the completion event (cudaStreamWaitEvent):
//    the host does not block and communication overlaps the compute enqueued in between;
//  * a watchdog thread per communicator polls the completion events and ncclCommGetAsyncError;
//    an operation not done within the timeout (or an asynchronous NCCL error) prints a message
//    naming the operation and the ranks that have not joined it (from the progress every rank
//    publishes to the TCP store) and ends the process with exit status 1, so the launcher stops
//    the other ranks (with CommOptions::abort_on_timeout false: aborts the communicator and
//    throws CommTimeoutError);
//  * collectives on buffers registered with register_buffers() run on the GPUs' copy engines
//    when every rank is on one node with peer access (comm/peer_collectives.h), unless
//    PeerCollectives has no plan for them (another dtype or op, a shape comm/peer_chunks.h
//    cannot split): those, like every other collective, go to NCCL.
// Compiled only with the CUDA toolkit (shardtrain_cuda). It uses shardtrain_lib only through
// header-only code and the Bootstrap interface (comm/comm_support.h).
#include <cuda_runtime.h>
#include <fmt/core.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_support.h"
#include "comm/communicator.h"
#include "comm/dist_env.h"
#include "comm/nccl_communicator.h"
#include "comm/peer_collectives.h"
#include "core/error.h"

namespace shardtrain {
namespace {

using Clock = std::chrono::steady_clock;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw RuntimeFailure(fmt::format("CUDA: {} failed: {}", what, cudaGetErrorString(e)));
}

void nccl_check(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess) return;
  const char* detail = ncclGetLastError(comm);
  throw RuntimeFailure(fmt::format("NCCL: {} failed: {}{}{}", what, ncclGetErrorString(r),
                                   detail && *detail ? ": " : "", detail ? detail : ""));
}

/// NCCL element type and count. uint16 (no reductions) travels as bytes.
std::pair<ncclDataType_t, size_t> nccl_type(const Tensor& t) {
  const auto n = static_cast<size_t>(t.numel());
  switch (t.dtype) {
    case DType::kF32:
      return {ncclFloat32, n};
    case DType::kBF16:
      return {ncclBfloat16, n};
    case DType::kF16:
      return {ncclFloat16, n};
    case DType::kI32:
      return {ncclInt32, n};
    case DType::kU16:
      return {ncclUint8, 2 * n};
    case DType::kF64:
      return {ncclFloat64, n};
    case DType::kU8:
      return {ncclUint8, n};
  }
  return {ncclUint8, t.bytes()};
}

ncclRedOp_t nccl_op(DType t, ReduceOp op, const char* what) {
  check<RuntimeFailure>(t != DType::kU16 && t != DType::kU8, "{}: cannot reduce {} tensors", what,
                        dtype_name(t));
  check<RuntimeFailure>(op != ReduceOp::kAvg || t != DType::kI32,
                        "{}: kAvg needs a floating dtype, got int32", what);
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

void check_cuda_tensor(const Tensor& t, const char* what) {
  check<RuntimeFailure>(t.device == DeviceKind::kCUDA,
                        "{}: the NCCL communicator works on CUDA tensors, got a CPU tensor", what);
}

/// A completion event with what it completes.
struct Pending {
  cudaEvent_t event = nullptr;
  std::string name;  ///< "all_reduce #17", "send #3 to rank 1"
  int64_t seq = 0;   ///< collective number, 0 for send/recv
  int peer = -1;     ///< world rank of the peer of a send/recv
  Clock::time_point start;
  ~Pending() {
    if (event) cudaEventDestroy(event);
  }
};

/// Timeline of the communicator's operations for finding exposed communication, enabled by
/// SHARDTRAIN_COMM_TRACE=PREFIX: every operation records timing events when the compute stream
/// reached it ("ready"), when the communication stream started it and when it ended; every
/// Work::wait() records when the compute stream reached the wait and when it went on. At the end
/// PREFIX.rank<R>.json is written in the Chrome trace format (chrome://tracing, Perfetto), times in
/// microseconds from the first event. Adds events only; no synchronization until the end.
class CommTrace {
 public:
  static std::unique_ptr<CommTrace> from_env(int world_rank) {
    const char* prefix = std::getenv("SHARDTRAIN_COMM_TRACE");
    if (prefix == nullptr || *prefix == '\0') return nullptr;
    return std::unique_ptr<CommTrace>(
        new CommTrace(fmt::format("{}.rank{}.json", prefix, world_rank)));
  }
  ~CommTrace() {
    for (auto& r : records_)
      for (cudaEvent_t e : r.events) cudaEventDestroy(e);
  }
  /// Records a timing event on `stream` and returns it (kept until the end).
  cudaEvent_t mark(cudaStream_t stream) {
    cudaEvent_t e = nullptr;
    cuda_check(cudaEventCreate(&e), "cudaEventCreate");
    cuda_check(cudaEventRecord(e, stream), "cudaEventRecord");
    return e;
  }
  /// An operation: ready (compute stream), start and end (communication stream).
  void op(std::string name, cudaEvent_t ready, cudaEvent_t start, cudaEvent_t end) {
    add({std::move(name), "comm", {ready, start, end}});
  }
  /// A wait: when the compute stream reached it and when it went on.
  void wait(std::string name, cudaEvent_t reached, cudaEvent_t resumed) {
    add({"wait " + std::move(name), "compute", {reached, resumed}});
  }
  /// Writes the trace file; call only when every recorded operation has completed.
  void write() {
    if (records_.empty()) return;
    std::FILE* f = std::fopen(path_.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "shardtrain: cannot write the communication trace %s\n", path_.c_str());
      return;
    }
    cudaEvent_t origin = records_.front().events.front();
    const auto us = [&](cudaEvent_t e) {
      float ms = 0;
      if (cudaEventSynchronize(e) != cudaSuccess ||
          cudaEventElapsedTime(&ms, origin, e) != cudaSuccess)
        return -1.0;
      return 1000.0 * ms;
    };
    std::fprintf(f, "{\"traceEvents\": [\n");
    for (size_t i = 0; i < records_.size(); ++i) {
      const Record& r = records_[i];
      const double a = us(r.events[r.lane == "comm" ? 1 : 0]), b = us(r.events.back());
      std::fprintf(f,
                   "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": 0, \"tid\": \"%s\", \"ts\": %.1f, "
                   "\"dur\": %.1f",
                   r.name.c_str(), r.lane.c_str(), a, b - a);
      if (r.lane == "comm") std::fprintf(f, ", \"args\": {\"ready\": %.1f}", us(r.events[0]));
      std::fprintf(f, "}%s\n", i + 1 < records_.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }

 private:
  struct Record {
    std::string name, lane;
    std::vector<cudaEvent_t> events;
  };
  static constexpr size_t kMaxRecords = 20000;
  explicit CommTrace(std::string path) : path_(std::move(path)) {}
  void add(Record r) {
    std::lock_guard<std::mutex> lock(mu_);
    if (records_.size() < kMaxRecords) {
      records_.push_back(std::move(r));
    } else {
      for (cudaEvent_t e : r.events) cudaEventDestroy(e);
    }
  }
  std::string path_;
  std::mutex mu_;
  std::vector<Record> records_;
};

/// Member lists → how many communicators over them this process created (main thread only):
/// names the progress keys of communicators identically on every member.
std::map<std::vector<int>, int>& created_counts() {
  static std::map<std::vector<int>, int> m;
  return m;
}

class NcclState {
 public:
  NcclState(ncclComm_t comm, std::vector<int> world_ranks, int world_rank, int device,
            cudaStream_t compute, const CommOptions& options, std::shared_ptr<Bootstrap> bootstrap,
            bool is_world)
      : comm_(comm),
        world_ranks_(std::move(world_ranks)),
        world_rank_(world_rank),
        device_(device),
        compute_(compute ? compute : cudaStreamLegacy),
        options_(options),
        bootstrap_(std::move(bootstrap)),
        fault_(FaultInjection::from_env(world_rank)),
        trace_(CommTrace::from_env(world_rank)) {
    // enqueue() runs on the caller's thread, the watchdog on its own: both are guarded by mutex_
    // where they share state (pending_, failure_); launched_ and failed_ are atomics.
    nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", comm_);
    nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount", comm_);
    if (!is_world) group_ = " in group " + rank_list(world_ranks_);
    std::string key;
    for (int r : world_ranks_) key += std::to_string(r) + ".";
    key += std::to_string(created_counts()[world_ranks_]++);
    board_prefix_ = "progress/" + key + "/";
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    // With copy-engine collectives the communication stream runs small sum kernels between the
    // copies: the highest priority lets them take the next free SMs instead of queueing behind
    // the compute kernels they overlap.
    int least = 0, greatest = 0;
    cuda_check(cudaDeviceGetStreamPriorityRange(&least, &greatest),
               "cudaDeviceGetStreamPriorityRange");
    cuda_check(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking,
                                            is_world && peer_collectives_wanted() ? greatest : 0),
               "cudaStreamCreateWithPriority");
    cuda_check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    watchdog_ = std::thread([this] { watch(); });
  }

  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;

  ~NcclState() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    bool clean = !failed_.load();
    for (auto& p : pending_) clean = clean && cudaEventQuery(p->event) == cudaSuccess;
    if (trace_ && clean) trace_->write();  // waits for each recorded event
    pending_.clear();
    if (comm_aborted_) {
      // fail() aborted it already
    } else if (clean) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);  // never wait for operations that will not complete
    }
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  int world_rank() const { return world_rank_; }
  int device() const { return device_; }
  ncclComm_t comm() const { return comm_; }
  cudaStream_t compute() const { return compute_; }
  /// The communication stream: operations run there in issue order.
  cudaStream_t stream() const { return stream_; }
  CommTrace* trace() const { return trace_.get(); }
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  const CommOptions& options() const { return options_; }
  const std::shared_ptr<Bootstrap>& bootstrap() const { return bootstrap_; }
  void set_compute(cudaStream_t s) { compute_ = s ? s : cudaStreamLegacy; }

  /// Throws CommTimeoutError when the watchdog found a failure (abort_on_timeout false).
  void rethrow() const {
    if (failed_.load()) {
      std::lock_guard<std::mutex> lock(mutex_);
      throw CommTimeoutError(failure_);
    }
  }

  /// Runs `launch(stream)` (the NCCL call) ordered after the compute stream's work so far and
  /// returns its completion event. `collective` ops take the next sequence number.
  std::shared_ptr<Pending> enqueue(const char* op, bool collective, int peer,
                                   const std::function<ncclResult_t(cudaStream_t)>& launch) {
    rethrow();
    auto p = std::make_shared<Pending>();
    if (collective) {
      p->seq = launched_.load() + 1;
      fault_.before_collective(p->seq, op);
      p->name = fmt::format("{} #{}", op, p->seq);
    } else {
      fault_.before_p2p(p2p_ + 1, op);
      p->name = fmt::format("{} #{} {} rank {}", op, ++p2p_,
                            std::string(op) == "send" ? "to" : "from", peer);
      p->peer = peer < 0 ? -1 : world_ranks_[static_cast<size_t>(peer)];
    }
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    cuda_check(cudaEventRecord(ready_, compute_), "cudaEventRecord");
    cudaEvent_t t_ready = trace_ ? trace_->mark(compute_) : nullptr;
    cuda_check(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    cudaEvent_t t_start = trace_ ? trace_->mark(stream_) : nullptr;
    nccl_check(launch(stream_), op, comm_);
    if (trace_) trace_->op(p->name, t_ready, t_start, trace_->mark(stream_));
    cuda_check(cudaEventCreateWithFlags(&p->event, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(p->event, stream_), "cudaEventRecord");
    p->start = Clock::now();
    if (collective) launched_.store(p->seq);
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(p);
    return p;
  }

  /// Blocks the host until `p` completed, with the timeout (barrier()).
  void host_wait(const Pending& p) {
    const auto start = Clock::now();
    for (;;) {
      rethrow();
      const cudaError_t e = cudaEventQuery(p.event);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) cuda_check(e, "cudaEventQuery");
      // The watchdog enforces the deadline (and ends the process); this loop only sleeps.
      std::this_thread::sleep_for(Clock::now() - start < std::chrono::milliseconds(1)
                                      ? std::chrono::microseconds(0)
                                      : std::chrono::microseconds(100));
    }
  }

 private:
  /// The watchdog: every 100 ms drops completed operations, checks the oldest one's age and NCCL's
  /// asynchronous error, and publishes this rank's progress about once a second.
  void watch() {
    cudaSetDevice(device_);
    std::unique_ptr<ProgressBoard> board;
    try {
      if (bootstrap_) board = bootstrap_->connect_board();
    } catch (const std::exception&) {
    }
    int64_t published = -1;
    auto last_publish = Clock::now() - std::chrono::seconds(10);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (stop_ || failed_.load()) break;
      while (!pending_.empty() && cudaEventQuery(pending_.front()->event) == cudaSuccess) {
        if (pending_.front()->seq > 0) completed_ = pending_.front()->seq;
        pending_.pop_front();
      }
      std::string failure;
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      std::shared_ptr<Pending> late;
      if (!pending_.empty() &&
          std::chrono::duration<double>(Clock::now() - pending_.front()->start).count() >
              options_.timeout_s)
        late = pending_.front();
      const int64_t launched = launched_.load();
      if (board && launched != published && Clock::now() - last_publish > std::chrono::seconds(1)) {
        lock.unlock();
        board->publish(board_prefix_ + std::to_string(world_rank_),
                       fmt::format("{} {}", launched, completed_));
        lock.lock();
        published = launched;
        last_publish = Clock::now();
      }
      if (async != ncclSuccess && async != ncclInProgress) {
        failure = fmt::format("rank {}: NCCL reported an asynchronous error{}: {}", world_rank_,
                              group_, ncclGetErrorString(async));
      } else if (late) {
        lock.unlock();
        failure = fmt::format("rank {}: {}{} did not complete within {:g} s: {}", world_rank_,
                              late->name, group_, options_.timeout_s, laggards(*late, board.get()));
        lock.lock();
      }
      if (!failure.empty()) {
        fail(failure);
        break;
      }
    }
  }

  /// Names the ranks that have not joined `p`, from the progress board.
  std::string laggards(const Pending& p, ProgressBoard* board) {
    if (board == nullptr)
      return "a rank that has not joined it is stuck or dead (the ranks that report no timeout "
             "are the stuck ones)";
    std::vector<int> silent;
    std::vector<std::string> behind;
    std::vector<int> peers;
    if (p.seq > 0) {
      for (int w : world_ranks_)
        if (w != world_rank_) peers.push_back(w);
    } else if (p.peer >= 0) {
      peers.push_back(p.peer);
    }
    for (int w : peers) {
      const auto v = board->read(board_prefix_ + std::to_string(w));
      long long launched = -1, done = -1;
      if (!v || std::sscanf(v->c_str(), "%lld %lld", &launched, &done) != 2) {
        silent.push_back(w);
      } else if (p.seq > 0 && launched < p.seq) {
        behind.push_back(
            fmt::format("rank {} has not joined it (its last collective is #{})", w, launched));
      }
    }
    std::string why;
    if (!silent.empty())
      why = fmt::format("{} {} not reported progress ({} stuck or dead)", name_ranks(silent),
                        silent.size() == 1 ? "has" : "have",
                        silent.size() == 1 ? "it is" : "they are");
    for (const auto& b : behind) {
      if (!why.empty()) why += "; ";
      why += b;
    }
    if (why.empty())
      why = p.seq > 0 ? "every rank has joined it: NCCL is stalled (run with NCCL_DEBUG=WARN)"
                      : fmt::format("rank {} did not post the matching send/recv", p.peer);
    return why;
  }

  /// Called with mutex_ held by the watchdog thread.
  void fail(const std::string& message) {
    failure_ = message;
    failed_.store(true);
    std::fprintf(stderr, "error: %s\n", message.c_str());
    std::fflush(stderr);
    // Exit before ncclCommAbort: it frees device memory, which waits for the device, and a
    // copy-engine collective's stream may wait forever for a peer's flag (comm/peer_collectives.h).
    // The driver reclaims the GPU from the exiting process; the launcher stops the other ranks.
    if (options_.abort_on_timeout) std::_Exit(1);
    ncclCommAbort(comm_);  // makes NCCL kernels in flight return
    comm_aborted_ = true;
  }

  ncclComm_t comm_;
  std::vector<int> world_ranks_;
  int world_rank_;
  int device_;
  int rank_ = 0, size_ = 1;
  cudaStream_t compute_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  CommOptions options_;
  std::shared_ptr<Bootstrap> bootstrap_;
  FaultInjection fault_;
  std::unique_ptr<CommTrace> trace_;  // SHARDTRAIN_COMM_TRACE; null when off
  std::string group_;
  std::string board_prefix_;
  std::atomic<int64_t> launched_{0};
  int64_t completed_ = 0;
  int64_t p2p_ = 0;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> pending_;
  bool stop_ = false;
  std::atomic<bool> failed_{false};
  bool comm_aborted_ = false;
  std::string failure_;
  std::thread watchdog_;
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> state, std::shared_ptr<Pending> pending)
      : state_(std::move(state)), pending_(std::move(pending)) {}

  /// Orders the compute stream after the operation; does not block the host.
  void wait() override {
    state_->rethrow();
    CommTrace* trace = state_->trace();
    cudaEvent_t reached = trace ? trace->mark(state_->compute()) : nullptr;
    cuda_check(cudaStreamWaitEvent(state_->compute(), pending_->event, 0), "cudaStreamWaitEvent");
    if (trace) trace->wait(pending_->name, reached, trace->mark(state_->compute()));
  }

  /// The operation's completion event (recorded on its communicator's stream).
  cudaEvent_t event() const { return pending_->event; }

  bool completed() override {
    state_->rethrow();
    const cudaError_t e = cudaEventQuery(pending_->event);
    if (e == cudaErrorNotReady) return false;
    cuda_check(e, "cudaEventQuery");
    return true;
  }

 private:
  std::shared_ptr<NcclState> state_;
  std::shared_ptr<Pending> pending_;
};

/// Keeps buffers registered with the copy-engine path; waits for the device before unmapping.
class PeerRegistration final : public BufferRegistration {
 public:
  PeerRegistration(std::shared_ptr<PeerCollectives> peers, int key)
      : peers_(std::move(peers)), key_(key) {}
  ~PeerRegistration() override {
    cudaDeviceSynchronize();  // no copy may still read the mappings
    peers_->release(key_);
  }

 private:
  std::shared_ptr<PeerCollectives> peers_;
  int key_;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::shared_ptr<NcclState> state) : st_(std::move(state)) {}

  /// Sets up the copy-engine path for registered buffers (collective; see PeerCollectives::create:
  /// only when every rank is on this `node`) unless SHARDTRAIN_PEER_COLLECTIVES=0.
  void enable_peer_collectives(int node) {
    if (!peer_collectives_wanted() || st_->size() < 2) return;
    peers_ = PeerCollectives::create(st_->rank(), st_->size(), st_->device(), node, exchange());
  }

  size_t registration_staging_bytes() const override { return peers_ ? kPeerStagingBytes : 0; }

  std::unique_ptr<BufferRegistration> register_buffers(const std::vector<Tensor>& buffers,
                                                       Tensor staging) override {
    if (!peers_) return nullptr;
    for (const Tensor& b : buffers) check_cuda_tensor(b, "register_buffers");
    check_cuda_tensor(staging, "register_buffers");
    const int key = peers_->register_buffers(buffers, staging, exchange());
    if (key < 0) return nullptr;
    return std::make_unique<PeerRegistration>(peers_, key);
  }

  int rank() const override { return st_->rank(); }
  int world_size() const override { return st_->size(); }
  std::string backend_name() const override { return "nccl"; }
  void set_compute_stream(void* stream) override {
    st_->set_compute(static_cast<cudaStream_t>(stream));
  }

  std::unique_ptr<Work> all_reduce(Tensor t, ReduceOp op) override {
    check_cuda_tensor(t, "all_reduce");
    const ncclRedOp_t rop = nccl_op(t.dtype, op, "all_reduce");
    if (auto plan = peers_ ? peers_->all_reduce_plan(t, op) : std::nullopt)
      return submit("all_reduce", true, -1, [&](cudaStream_t s) {
        peers_->run(*plan, t, t, op, s);
        return ncclSuccess;
      });
    const auto [type, n] = nccl_type(t);
    return submit("all_reduce", true, -1, [&](cudaStream_t s) {
      return ncclAllReduce(t.data, t.data, n, type, rop, st_->comm(), s);
    });
  }

  std::unique_ptr<Work> reduce_scatter(Tensor output, Tensor input, ReduceOp op) override {
    check_cuda_tensor(output, "reduce_scatter");
    check_cuda_tensor(input, "reduce_scatter");
    check<RuntimeFailure>(
        output.dtype == input.dtype && input.numel() == output.numel() * st_->size(),
        "reduce_scatter: input {} {} must hold world size {} × output {} {}",
        dtype_name(input.dtype), input.numel(), st_->size(), dtype_name(output.dtype),
        output.numel());
    const ncclRedOp_t rop = nccl_op(input.dtype, op, "reduce_scatter");
    if (auto plan = peers_ ? peers_->reduce_scatter_plan(output, input, op) : std::nullopt)
      return submit("reduce_scatter", true, -1, [&](cudaStream_t s) {
        peers_->run(*plan, input, output, op, s);
        return ncclSuccess;
      });
    const auto [type, n] = nccl_type(output);
    return submit("reduce_scatter", true, -1, [&](cudaStream_t s) {
      return ncclReduceScatter(input.data, output.data, n, type, rop, st_->comm(), s);
    });
  }

  std::unique_ptr<Work> all_gather(Tensor output, Tensor input) override {
    check_cuda_tensor(output, "all_gather");
    check_cuda_tensor(input, "all_gather");
    check<RuntimeFailure>(
        output.dtype == input.dtype && output.numel() == input.numel() * st_->size(),
        "all_gather: output {} {} must hold world size {} × input {} {} (every rank contributes "
        "the same count; pad uneven shards)",
        dtype_name(output.dtype), output.numel(), st_->size(), dtype_name(input.dtype),
        input.numel());
    if (auto plan = peers_ ? peers_->all_gather_plan(output, input) : std::nullopt)
      return submit("all_gather", true, -1, [&](cudaStream_t s) {
        peers_->run(*plan, input, output, ReduceOp::kSum, s);
        return ncclSuccess;
      });
    const auto [type, n] = nccl_type(input);
    return submit("all_gather", true, -1, [&](cudaStream_t s) {
      return ncclAllGather(input.data, output.data, n, type, st_->comm(), s);
    });
  }

  std::unique_ptr<Work> all_to_all(Tensor output, Tensor input) override {
    check_cuda_tensor(output, "all_to_all");
    check_cuda_tensor(input, "all_to_all");
    const int w = st_->size();
    check<RuntimeFailure>(output.dtype == input.dtype && output.numel() == input.numel() &&
                              input.numel() % w == 0 && output.data != input.data,
                          "all_to_all: input {} {} and output {} {} must be distinct buffers of "
                          "the same dtype and size, a multiple of the world size {}",
                          dtype_name(input.dtype), input.numel(), dtype_name(output.dtype),
                          output.numel(), w);
    const int64_t c = input.numel() / w;
    const auto [type, n] = nccl_type(input.slice1d(0, c));
    // NCCL's all-to-all: one send and one receive per peer in a group (its docs, "Point-to-point
    // communication: all-to-all").
    return submit("all_to_all", true, -1, [&](cudaStream_t s) {
      ncclResult_t r = ncclGroupStart();
      for (int p = 0; p < w && r == ncclSuccess; ++p) {
        r = ncclSend(input.slice1d(p * c, c).data, n, type, p, st_->comm(), s);
        if (r == ncclSuccess)
          r = ncclRecv(output.slice1d(p * c, c).data, n, type, p, st_->comm(), s);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  bool starts_after_on_device() const override { return true; }

  /// The communication stream waits for `w`'s completion event: every later operation here runs
  /// after it, and the compute stream is not involved.
  void start_after(Work& w) override {
    const auto* n = dynamic_cast<const NcclWork*>(&w);
    check<RuntimeFailure>(n != nullptr,
                          "start_after: the Work is not an operation of an NCCL communicator");
    cuda_check(cudaSetDevice(st_->device()), "cudaSetDevice");
    cuda_check(cudaStreamWaitEvent(st_->stream(), n->event(), 0), "cudaStreamWaitEvent");
  }

  std::unique_ptr<Work> broadcast(Tensor t, int root) override {
    check_cuda_tensor(t, "broadcast");
    check<ConfigError>(root >= 0 && root < st_->size(), "broadcast: root {} is outside [0, {})",
                       root, st_->size());
    const auto [type, n] = nccl_type(t);
    return submit("broadcast", true, -1, [&](cudaStream_t s) {
      return ncclBroadcast(t.data, t.data, n, type, root, st_->comm(), s);
    });
  }

  std::unique_ptr<Work> send(Tensor t, int peer) override {
    check_cuda_tensor(t, "send");
    check_peer(peer, "send");
    const auto [type, n] = nccl_type(t);
    return submit("send", false, peer,
                  [&](cudaStream_t s) { return ncclSend(t.data, n, type, peer, st_->comm(), s); });
  }

  std::unique_ptr<Work> recv(Tensor t, int peer) override {
    check_cuda_tensor(t, "recv");
    check_peer(peer, "recv");
    const auto [type, n] = nccl_type(t);
    return submit("recv", false, peer,
                  [&](cudaStream_t s) { return ncclRecv(t.data, n, type, peer, st_->comm(), s); });
  }

  /// NCCL has no barrier: an all_reduce of one int on the device, then the host waits for it.
  void barrier() override {
    if (scratch_ == nullptr) {
      cuda_check(cudaSetDevice(st_->device()), "cudaSetDevice");
      cuda_check(cudaMalloc(&scratch_, sizeof(int32_t)), "cudaMalloc");
    }
    auto p = st_->enqueue("barrier", true, -1, [&](cudaStream_t s) {
      return ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, st_->comm(), s);
    });
    st_->host_wait(*p);
  }

  std::unique_ptr<Communicator> split(const std::vector<int>& ranks) override {
    const std::vector<int>& mine = st_->world_ranks();
    int key = -1;
    for (size_t i = 0; i < ranks.size(); ++i) {
      check<ConfigError>(std::find(mine.begin(), mine.end(), ranks[i]) != mine.end(),
                         "split: rank {} is not in this group {}", ranks[i], rank_list(mine));
      check<ConfigError>(std::count(ranks.begin(), ranks.end(), ranks[i]) == 1,
                         "split: rank {} appears twice in {}", ranks[i], rank_list(ranks));
      if (ranks[i] == st_->world_rank()) key = static_cast<int>(i);
    }
    check<ConfigError>(key >= 0, "split: rank {} must be in the group it creates, got {}",
                       st_->world_rank(), rank_list(ranks));
    const int color = *std::min_element(ranks.begin(), ranks.end());
    ncclComm_t comm = nullptr;
    {
      Watchdog dog(st_->options().timeout_s,
                   fmt::format("rank {}: split into group {} (ncclCommSplit) did not complete "
                               "within {:g} s: a rank has not called split() (it is stuck or dead)",
                               st_->world_rank(), rank_list(ranks), st_->options().timeout_s));
      nccl_check(ncclCommSplit(st_->comm(), color, key, &comm, nullptr), "ncclCommSplit",
                 st_->comm());
    }
    return std::make_unique<NcclCommunicator>(
        std::make_shared<NcclState>(comm, ranks, st_->world_rank(), st_->device(), st_->compute(),
                                    st_->options(), st_->bootstrap(), false));
  }

  ~NcclCommunicator() override {
    if (scratch_ != nullptr) cudaFree(scratch_);
  }

 private:
  std::unique_ptr<Work> submit(const char* op, bool collective, int peer,
                               const std::function<ncclResult_t(cudaStream_t)>& launch) {
    return std::make_unique<NcclWork>(st_, st_->enqueue(op, collective, peer, launch));
  }

  /// A blocking all-gather of host bytes over NCCL (setup exchanges of the copy-engine path).
  ByteAllGather exchange() {
    return [this](const void* mine, size_t bytes, void* all) {
      const size_t w = static_cast<size_t>(st_->size());
      char* dev = nullptr;
      cuda_check(cudaSetDevice(st_->device()), "cudaSetDevice");
      cuda_check(cudaMalloc(&dev, bytes * (w + 1)), "cudaMalloc");
      try {
        cuda_check(cudaMemcpy(dev, mine, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
        auto p = st_->enqueue("exchange", true, -1, [&](cudaStream_t s) {
          return ncclAllGather(dev, dev + bytes, bytes, ncclUint8, st_->comm(), s);
        });
        st_->host_wait(*p);
        cuda_check(cudaMemcpy(all, dev + bytes, bytes * w, cudaMemcpyDeviceToHost), "cudaMemcpy");
      } catch (...) {
        cudaFree(dev);
        throw;
      }
      cudaFree(dev);
    };
  }

  void check_peer(int peer, const char* what) const {
    check<ConfigError>(peer >= 0 && peer < st_->size() && peer != st_->rank(),
                       "{}: peer {} must be another rank of [0, {})", what, peer, st_->size());
  }

  std::shared_ptr<NcclState> st_;
  void* scratch_ = nullptr;
  std::shared_ptr<PeerCollectives> peers_;  ///< copy-engine path; null when unavailable
};

/// NCCL's CTA policy (ncclConfig_t::CTAPolicy, NCCL ≥ 2.27) from SHARDTRAIN_NCCL_CTA_POLICY:
/// "default" (NCCL's choice: as many CTAs as the fastest collective needs), "efficiency" (as few
/// CTAs as give decent bandwidth, leaving SMs to the compute that the collectives overlap) or
/// "zero" (copy engines where NCCL can). Unset: default. Throws ConfigError for other values.
int cta_policy_from_env() {
  const char* v = std::getenv("SHARDTRAIN_NCCL_CTA_POLICY");
  const std::string s = v ? v : "";
  if (s.empty() || s == "default") return NCCL_CTA_POLICY_DEFAULT;
  if (s == "efficiency") return NCCL_CTA_POLICY_EFFICIENCY;
  if (s == "zero") return NCCL_CTA_POLICY_ZERO;
  throw ConfigError(fmt::format(
      "SHARDTRAIN_NCCL_CTA_POLICY='{}' is not a CTA policy: use default, efficiency or zero", s));
}

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

std::unique_ptr<Communicator> make_nccl_communicator(const DistributedEnv& env, void* cuda_stream,
                                                     const CommOptions& options,
                                                     std::shared_ptr<Bootstrap> bootstrap) {
  check<ConfigError>(options.timeout_s > 0, "the communication timeout must be > 0 s, got {:g}",
                     options.timeout_s);
  // NVLink SHARP (multicast) stays off unless the user chose otherwise.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  const int gpus = cuda_device_count();
  check<ConfigError>(
      env.local_rank < gpus,
      "rank {} is local rank {} on its node and needs GPU {}, but the node has {} "
      "visible GPU{} (CUDA_VISIBLE_DEVICES={}): start at most {} ranks per node",
      env.rank, env.local_rank, env.local_rank, gpus, gpus == 1 ? "" : "s",
      std::getenv("CUDA_VISIBLE_DEVICES") ? std::getenv("CUDA_VISIBLE_DEVICES") : "unset", gpus);
  cuda_check(cudaSetDevice(env.local_rank), "cudaSetDevice");
  ncclUniqueId id{};
  if (env.rank == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  bootstrap->broadcast(&id, sizeof id, 0);
  ncclComm_t comm = nullptr;
  {
    Watchdog dog(options.timeout_s,
                 fmt::format("rank {}: ncclCommInitRank did not complete within {:g} s: a rank is "
                             "stuck or dead (or the network between the nodes is blocked; run "
                             "with NCCL_DEBUG=WARN)",
                             env.rank, options.timeout_s));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.CTAPolicy = cta_policy_from_env();
    nccl_check(ncclCommInitRankConfig(&comm, env.world_size, id, env.rank, &config),
               "ncclCommInitRankConfig");
  }
  std::vector<int> ranks(static_cast<size_t>(env.world_size));
  for (int i = 0; i < env.world_size; ++i) ranks[static_cast<size_t>(i)] = i;
  auto communicator = std::make_unique<NcclCommunicator>(std::make_shared<NcclState>(
      comm, std::move(ranks), env.rank, env.local_rank, static_cast<cudaStream_t>(cuda_stream),
      options, std::move(bootstrap), true));
  communicator->enable_peer_collectives(env.node_rank);
  return communicator;
}

}  // namespace shardtrain
