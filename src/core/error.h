// shardtrain — error types and checks.
//
// Every user-facing failure is an exception derived from shardtrain::Error whose
// message names what is wrong and how to fix it. The CLI catches Error at the top
// level, prints "error: <message>" (in a job of several ranks once, app/error_report.h)
// and exits with status 2 (bad input) or 1 (runtime failure). Internal invariant
// violations use ST_ASSERT and are reported as bugs.
#pragma once

#if !defined(__CUDACC__)
#include <fmt/core.h>
#endif

#include <stdexcept>
#include <string>
#include <utility>

namespace shardtrain {

/// Base class of every error shardtrain throws on purpose.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}

  /// Whether every rank of a job raises this error identically — a configuration error found
  /// while validating the flags and the DeepSpeed JSON, which every rank reads the same way — so
  /// that rank 0 alone reports it, without naming a rank (app/error_report.h). False (the
  /// default): it may be this rank's own (its data file, its GPU, its checkpoint shard).
  bool same_on_every_rank() const { return same_on_every_rank_; }
  /// Marks it so, where it is caught on its way out of such a validation (app/cmd_train.cpp).
  void mark_same_on_every_rank() { same_on_every_rank_ = true; }

 private:
  bool same_on_every_rank_ = false;
};

/// Bad configuration: flags, DeepSpeed JSON, model/strategy names, numbers.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// Missing, unreadable or corrupt input files: data sets, tokenizer, token caches.
class DataError : public Error {
 public:
  using Error::Error;
};

/// Missing or corrupt checkpoints, or a checkpoint that does not match the run.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// A failure of the machine or a library (allocation, BLAS, I/O, CUDA, NCCL, MPI).
class RuntimeFailure : public Error {
 public:
  using Error::Error;
};

/// Which memory an allocation ran out of (OutOfMemory::memory()).
enum class Memory {
  kGpu,         ///< device memory (the CUDA caching allocator)
  kHost,        ///< host memory of the process (the CPU backend's tensors, std::bad_alloc)
  kPinnedHost,  ///< pinned host memory for offloaded state (Backend::allocate_pinned)
};

/// An allocation that failed. The message states the facts (bytes asked, held, free); the
/// command line appends the remedy, naming the knobs that lower the need
/// (app/error_report.h: memory_remedy), which the layers that allocate do not know.
class OutOfMemory : public RuntimeFailure {
 public:
  OutOfMemory(Memory memory, const std::string& what) : RuntimeFailure(what), memory_(memory) {}
  Memory memory() const { return memory_; }

 private:
  Memory memory_;
};

/// The GPU a run asked for cannot be used at all: no CUDA GPU is visible, or this build has no
/// CUDA. The message states the facts and ends with a remedy clause; the command line appends
/// the other remedy, training on the CPU, naming the device flag (app/error_report.cpp), which
/// the backends and communicators do not know.
class DeviceUnavailable : public RuntimeFailure {
 public:
  using RuntimeFailure::RuntimeFailure;
};

#if !defined(__CUDACC__)
// nvcc 13 cannot compile fmt 9 in C++20 mode (its consteval format strings), so code that nvcc
// compiles (*.cu) builds messages with std::string instead and never sees fmt.
/// Throws E with a fmt-formatted message when `cond` is false.
template <typename E = Error, typename... Args>
inline void check(bool cond, fmt::format_string<Args...> f, Args&&... args) {
  if (!cond) throw E(fmt::format(f, std::forward<Args>(args)...));
}
#endif

[[noreturn]] void assertion_failed(const char* expr, const char* file, int line);

}  // namespace shardtrain

/// Internal invariant: a failure is a bug in shardtrain, not bad input.
#define ST_ASSERT(expr) \
  ((expr) ? (void)0 : ::shardtrain::assertion_failed(#expr, __FILE__, __LINE__))
