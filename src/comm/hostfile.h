// Hostfiles in DeepSpeed's (and Open MPI's) format, for `shardtrain launch --hostfile`.
#pragma once

#include <string>
#include <vector>

namespace shardtrain {

/// One line of a hostfile: "HOST slots=N".
struct HostSlots {
  std::string host;
  int slots = 1;
  int line = 0;  ///< 1-based line number in the file
};

/// Parses a hostfile in DeepSpeed's (and Open MPI's) format: one "HOST slots=N" per line (N ≥ 1),
/// '#' starts a comment, blank lines are skipped. `name` names the file in messages. Throws
/// ConfigError naming the line for anything else (e.g. "node1 slot=4", "node1 slots=0", a host
/// listed twice, a host that is not a host name or address or begins with '-', which ssh and
/// mpirun would read as an option) and when no host is listed. Messages quote bounded excerpts.
std::vector<HostSlots> parse_hostfile(const std::string& text, const std::string& name);

/// Reads and parses the hostfile at `path`. Throws ConfigError when it is missing, not a regular
/// file, larger than kMaxConfigFileBytes or cannot be read.
std::vector<HostSlots> read_hostfile(const std::string& path);

}  // namespace shardtrain
