// Prefetcher: prepares the next micro-batch on a worker thread while the current one trains (as
// PyTorch's DataLoader with a worker and pin_memory), so the host's batch assembly (sampling,
// crop, flip, gray to RGB) is off the device's critical path.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace shardtrain {

/// Double-buffered: slot 0 and slot 1 hold two micro-batches, filled by `fill(key, slot)`
/// (keys: the micro-batches' positions in the run, any int64 ≥ 0). get(key, next) returns the
/// slot holding `key` — the one prefetched when `next` of the previous call was `key`, else
/// filled now on the caller's thread — and starts filling `next` into the other slot. A slot
/// stays unchanged until the get() after the one that returned it, so the caller may read it
/// (or a device copy may) until then.
///
/// Without a worker (`threaded` false, e.g. on a CPU backend whose ops already use every core)
/// get() fills `key` itself and ignores `next`. Errors of a background fill are rethrown by the
/// next get().
class Prefetcher {
 public:
  using Fill = std::function<void(int64_t key, int slot)>;

  explicit Prefetcher(Fill fill, bool threaded = true);
  /// Waits for a fill in progress, then stops the worker.
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  /// The slot (0 or 1) that holds `key`; then fills `next` (< 0: nothing) into the other slot,
  /// in the background when threaded. Rethrows the exception of a failed fill.
  int get(int64_t key, int64_t next);

  /// Fills run in the background so far whose key the following get() asked for (for tests and
  /// the run's log).
  int64_t hits() const { return hits_; }

 private:
  void work();

  Fill fill_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t job_key_ = -1;    ///< while busy_: the key the worker fills
  int job_slot_ = 0;        ///< and its slot
  int64_t ready_key_ = -1;  ///< the key the worker filled last; -1: none
  int ready_slot_ = 1;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  int64_t hits_ = 0;
  std::thread worker_;  ///< last: started once the state above exists
};

}  // namespace shardtrain
