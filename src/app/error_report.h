// How the program reports the error that ends it (app/main.cpp's top-level catch), so that a job
// of several ranks prints one error once, whole:
//  * every message is written to stderr with one write() call, so the lines of ranks sharing a
//    terminal or a log (mpirun forwards every rank's stderr) never cut into each other mid-line;
//  * rank 0 reports at once. An error every rank raises identically (Error::same_on_every_rank:
//    the configuration, validated from the same flags and DeepSpeed JSON on every rank, and
//    command-line parse errors) is printed as "error: MESSAGE"; any other as "error: rank 0:
//    MESSAGE";
//  * any other rank waits a grace period first (error_report_grace_s(), 5 s unless set) and then
//    prints "error: rank R: MESSAGE". When rank 0 failed too, its exit has made the launcher
//    (shardtrain launch, mpirun, torchrun) stop this rank in the meantime, so the job's error
//    appears once; when rank 0 did not fail (only rank 2's data file is missing, a flag differs
//    between ranks), nothing stops this rank and its error appears, naming it. The grace stays
//    below half the communication timeout, so rank 0 never gives up waiting for this rank (and
//    aborts the job) before the message is out.
// A single process (no launcher variables, or world size 1) prints "error: MESSAGE" at once.
#pragma once

#include <exception>
#include <string>
#include <string_view>

#include "core/error.h"

namespace shardtrain {

/// What one process writes for the error that ends it, and when.
struct ErrorReport {
  std::string text;    ///< the whole text for stderr, ending in '\n'
  double delay_s = 0;  ///< seconds to wait before writing it
};

/// The report of rank `rank` of `world` (world ≤ 1: a single process) for `message`, after
/// `lead` (e.g. "error: "; CLI11's own parse messages come without one): rank 0 without a rank
/// when `same_on_every_rank`, else "rank R: " after the lead; ranks other than 0 after
/// `grace_s`. A message that begins with "rank N: " names its rank already and gets no second
/// one. Pure.
ErrorReport plan_error_report(std::string_view lead, std::string_view message,
                              bool same_on_every_rank, int rank, int world, double grace_s);

/// Seconds ranks other than 0 wait before printing their error: 5, or less when set (cmd_train
/// sets min(5, timeout / 2) from the communication timeout). Negative values count as 0.
void set_error_report_grace(double seconds);
double error_report_grace_s();

/// plan_error_report for this process (its rank and world size from the launcher's variables,
/// comm/dist_env.h; a single process when they are absent or malformed), then the wait and the
/// write. Never throws.
void report_fatal_error(std::string_view lead, std::string_view message, bool same_on_every_rank);

/// How to need less of `memory`, naming the knobs through their rows (config/knob.h):
/// "Fix: lower --batch-size or --max-length, ..." (kGpu), "use a smaller model, ..." (kHost),
/// "or offload less (... ratio ...)" (kPinnedHost, after the allocator's own fix). Never throws
/// but std::bad_alloc.
std::string memory_remedy(Memory memory);

/// The exit status and message for the exception `e` (rethrown inside): shardtrain's bad-input
/// errors (ConfigError, DataError, CheckpointError) 2, its other errors, std::bad_alloc ("out of
/// host memory") and other exceptions 1; an OutOfMemory's message gets its memory_remedy().
/// Never throws.
struct FatalError {
  int status = 1;
  std::string message;
  bool same_on_every_rank = false;
};
FatalError classify_exception(const std::exception_ptr& e);

/// Makes an exception that escapes where none may — an OpenMP region, a thread, a noexcept
/// function — end the process as main()'s own catch would: one "error: ..." line
/// (report_fatal_error) and exit status 1 or 2 (classify_exception), instead of "terminate
/// called after throwing ..." and SIGABRT. std::terminate without an exception still aborts.
void install_terminate_handler();

/// Whether this process is rank 0 of its job or a single process (from the launcher's
/// variables, as report_fatal_error). Never throws.
bool is_first_rank();

/// Writes `text` to stderr with one write() call (again for the rest only after a partial write
/// or an interrupted call), so that processes sharing stderr never interleave inside it.
void write_to_stderr(std::string_view text);

}  // namespace shardtrain
