#include "comm/dist_env.h"

#include <fmt/core.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "comm/communicator.h"
#include "core/error.h"

namespace shardtrain {
namespace {

/// Parses a whole decimal integer in [lo, hi]; throws ConfigError naming `name` otherwise.
int parse_int(const std::string& name, const std::string& value, long lo, long hi) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(value.c_str(), &end, 10);
  const bool ok =
      !value.empty() && end == value.c_str() + value.size() && errno == 0 && v >= lo && v <= hi;
  check<ConfigError>(ok, "{}='{}': expected an integer in [{}, {}]", name, value, lo, hi);
  return static_cast<int>(v);
}

std::optional<int> get_int(const EnvLookup& env, const std::string& name, long lo, long hi) {
  const auto v = env(name);
  if (!v) return std::nullopt;
  return parse_int(name, *v, lo, hi);
}

constexpr long kMaxRanks = 1L << 24;

}  // namespace

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

std::vector<int> expand_slurm_counts(const std::string& value, const std::string& what) {
  std::vector<int> out;
  size_t pos = 0;
  auto bad = [&]() {
    return ConfigError(fmt::format(
        "{}='{}': expected counts like '4' or '2(x3),1' (SLURM's format)", what, value));
  };
  while (pos < value.size()) {
    size_t end = value.find(',', pos);
    if (end == std::string::npos) end = value.size();
    const std::string item = value.substr(pos, end - pos);
    const size_t paren = item.find('(');
    int count = 0, repeat = 1;
    try {
      if (paren == std::string::npos) {
        count = parse_int(what, item, 1, kMaxRanks);
      } else {
        if (item.size() < paren + 4 || item.compare(paren, 2, "(x") != 0 || item.back() != ')')
          throw bad();
        count = parse_int(what, item.substr(0, paren), 1, kMaxRanks);
        repeat = parse_int(what, item.substr(paren + 2, item.size() - paren - 3), 1, kMaxRanks);
      }
    } catch (const ConfigError&) {
      throw bad();
    }
    out.insert(out.end(), static_cast<size_t>(repeat), count);
    pos = end + 1;
  }
  if (out.empty()) throw bad();
  return out;
}

std::string first_slurm_host(const std::string& hostlist, const std::string& what) {
  auto bad = [&]() {
    return ConfigError(fmt::format("{}='{}': expected a SLURM host list like 'node[01-04,07],gpu5'",
                                   what, hostlist));
  };
  // The first entry ends at the first comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < hostlist.size(); ++end) {
    const char c = hostlist[end];
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) throw bad();
    if (c == ',' && depth == 0) break;
  }
  if (depth != 0) throw bad();
  const std::string entry = hostlist.substr(0, end);
  if (entry.empty()) throw bad();
  const size_t open = entry.find('[');
  if (open == std::string::npos) return entry;
  const size_t close = entry.find(']', open);
  const std::string prefix = entry.substr(0, open);
  const std::string suffix = entry.substr(close + 1);
  std::string range = entry.substr(open + 1, close - open - 1);
  range = range.substr(0, range.find(','));  // first element of the bracket
  range = range.substr(0, range.find('-'));  // first number of a range (keeps zero padding)
  if (range.empty() || range.find_first_not_of("0123456789") != std::string::npos) throw bad();
  return prefix + range + suffix;
}

DistributedEnv read_distributed_env(const EnvLookup& env) {
  DistributedEnv d;
  if (env("RANK") && env("WORLD_SIZE")) {
    d.world_size = parse_int("WORLD_SIZE", *env("WORLD_SIZE"), 1, kMaxRanks);
    d.rank = parse_int("RANK", *env("RANK"), 0, d.world_size - 1);
    d.local_world_size = get_int(env, "LOCAL_WORLD_SIZE", 1, d.world_size).value_or(d.world_size);
    d.local_rank =
        get_int(env, "LOCAL_RANK", 0, d.local_world_size - 1).value_or(d.rank % d.local_world_size);
    auto node = get_int(env, "GROUP_RANK", 0, kMaxRanks);
    if (!node) node = get_int(env, "NODE_RANK", 0, kMaxRanks);
    d.node_rank = node.value_or(d.rank / d.local_world_size);
    d.launcher = env("SHARDTRAIN_LAUNCHER").value_or("torchrun");
  } else if (env("OMPI_COMM_WORLD_SIZE")) {
    d.world_size = parse_int("OMPI_COMM_WORLD_SIZE", *env("OMPI_COMM_WORLD_SIZE"), 1, kMaxRanks);
    check<ConfigError>(env("OMPI_COMM_WORLD_RANK").has_value(),
                       "OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK is not");
    d.rank = parse_int("OMPI_COMM_WORLD_RANK", *env("OMPI_COMM_WORLD_RANK"), 0, d.world_size - 1);
    d.local_world_size =
        get_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, d.world_size).value_or(d.world_size);
    d.local_rank = get_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, d.local_world_size - 1)
                       .value_or(d.rank % d.local_world_size);
    d.node_rank = (d.rank - d.local_rank) / d.local_world_size;
    d.launcher = "mpirun";
  } else if (env("SLURM_PROCID") &&
             (env("SLURM_STEP_NUM_TASKS") || (env("SLURM_NTASKS") && env("SLURM_STEP_ID")))) {
    const std::string size_var =
        env("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
    d.world_size = parse_int(size_var, *env(size_var), 1, kMaxRanks);
    d.rank = parse_int("SLURM_PROCID", *env("SLURM_PROCID"), 0, d.world_size - 1);
    d.node_rank = get_int(env, "SLURM_NODEID", 0, kMaxRanks).value_or(0);
    for (const char* var :
         {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      if (const auto v = env(var)) {
        const std::vector<int> counts = expand_slurm_counts(*v, var);
        d.local_world_size = counts[std::min(counts.size() - 1, static_cast<size_t>(d.node_rank))];
        break;
      }
    }
    if (!env("SLURM_STEP_TASKS_PER_NODE") && !env("SLURM_NTASKS_PER_NODE") &&
        !env("SLURM_TASKS_PER_NODE"))
      d.local_world_size = d.world_size;
    d.local_rank = get_int(env, "SLURM_LOCALID", 0, d.local_world_size - 1)
                       .value_or(d.rank % d.local_world_size);
    if (const auto nodes = env("SLURM_STEP_NODELIST")) {
      d.master_addr = first_slurm_host(*nodes, "SLURM_STEP_NODELIST");
    } else if (const auto job_nodes = env("SLURM_JOB_NODELIST")) {
      d.master_addr = first_slurm_host(*job_nodes, "SLURM_JOB_NODELIST");
    } else if (const auto ip = env("SLURM_LAUNCH_NODE_IPADDR")) {
      d.master_addr = *ip;
    }
    if (const auto job = get_int(env, "SLURM_JOB_ID", 0, 0x7fffffffL))
      d.master_port = 29500 + *job % 1000;
    d.launcher = "slurm";
  }
  if (const auto addr = env("MASTER_ADDR"); addr && !addr->empty()) d.master_addr = *addr;
  if (const auto port = get_int(env, "MASTER_PORT", 1, 65535)) d.master_port = *port;
  // Under torchrun its agent serves PyTorch's own store on MASTER_PORT: ours takes the next port.
  const auto agent_store = env("TORCHELASTIC_USE_AGENT_STORE");
  if (d.launcher == "torchrun" && agent_store &&
      (*agent_store == "True" || *agent_store == "true" || *agent_store == "1"))
    d.master_port = d.master_port < 65535 ? d.master_port + 1 : d.master_port - 1;
  return d;
}

DistributedEnv read_distributed_env() { return read_distributed_env(process_env()); }

void set_gpu_rank_environment(const DistributedEnv& env, const std::string& device) {
  if (env.world_size <= 1 || device == "cpu") return;
  const bool copy_engines = env.local_world_size == env.world_size && peer_collectives_wanted();
  if (!copy_engines) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 0);
  setenv("NCCL_NVLS_ENABLE", "0", 0);
}

std::string describe(const DistributedEnv& env) {
  return fmt::format("rank {} of {} (local {} of {}, node {}) via {}", env.rank, env.world_size,
                     env.local_rank, env.local_world_size, env.node_rank, env.launcher);
}

double comm_timeout_seconds(double flag_value) {
  if (flag_value > 0) return flag_value;
  const char* v = std::getenv("SHARDTRAIN_COMM_TIMEOUT");
  if (v == nullptr || *v == '\0') return 300;
  errno = 0;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  check<ConfigError>(end != v && *end == '\0' && errno == 0 && t > 0 && t < 1e9,
                     "SHARDTRAIN_COMM_TIMEOUT='{}': expected seconds > 0 (e.g. 300)", v);
  return t;
}

}  // namespace shardtrain
