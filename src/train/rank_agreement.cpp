#include "train/rank_agreement.h"

#include <fmt/core.h>

#include <algorithm>
#include <map>

#include "comm/scalar_all_reduce.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/hash.h"
#include "core/json_input.h"
#include "core/strings.h"
#include "train/train_common.h"

namespace shardtrain {
namespace {

using nlohmann::json;

/// Adds the leaves of `j` to `out` as "prefix.key" → value (arrays are leaves).
void flatten(const json& j, const std::string& prefix, json& out) {
  if (!j.is_object()) {
    out[prefix] = j;
    return;
  }
  for (auto it = j.begin(); it != j.end(); ++it)
    flatten(*it, prefix.empty() ? it.key() : prefix + "." + it.key(), out);
}

/// "0, 1, 3".
std::string rank_list(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  for (int r : ranks) parts.push_back(std::to_string(r));
  return join(parts, ", ");
}

}  // namespace

json agreement_record(const TrainConfig& cfg, const std::string& model_shape) {
  json snap = config_snapshot(cfg);
  snap.erase("monitor");  // the monitors' directories
  snap["model_shape"] = model_shape;
  // Every knob's value, by its JSON path (or flag; a flag's snapshot path is already there),
  // but where a node keeps its files (data files and directories, a model's config.json).
  for (const KnobTable* table : all_knob_tables())
    for (const Knob& k : *table) {
      if (k.node_local)
        snap.erase(k.snapshot);
      else if (k.get && k.status == KnobStatus::kHonoured &&
               !(k.path.empty() && !k.snapshot.empty()))
        snap[k.path.empty() ? k.name() : k.path] = k.get(cfg);
    }
  // Whether a run resumes or starts from weights (the paths are a node's own).
  snap["resume"] = !cfg.resume.empty();
  snap["init_from"] = !cfg.init_from.empty();
  snap["flops_profiler.enabled"] = cfg.flops_profiler.enabled;
  json flat = json::object();
  flatten(snap, "", flat);
  return flat;
}

std::string rank_disagreement(const std::vector<json>& records) {
  std::vector<std::string> keys;
  for (const json& r : records)
    for (auto it = r.begin(); it != r.end(); ++it)
      if (std::find(keys.begin(), keys.end(), it.key()) == keys.end()) keys.push_back(it.key());
  std::sort(keys.begin(), keys.end());
  std::vector<std::string> differences;
  for (const std::string& key : keys) {
    std::map<std::string, std::vector<int>> by_value;  // value as shown → ranks
    for (size_t r = 0; r < records.size(); ++r) {
      const auto it = records[r].find(key);
      by_value[it == records[r].end() ? "(absent)" : json_excerpt(*it, 48)].push_back(
          static_cast<int>(r));
    }
    if (by_value.size() < 2) continue;
    std::vector<std::string> parts;
    for (const auto& [value, ranks] : by_value)
      parts.push_back(
          fmt::format("{} on rank{} {}", value, ranks.size() > 1 ? "s" : "", rank_list(ranks)));
    differences.push_back(fmt::format("{}: {}", key, join(parts, "; ")));
  }
  if (differences.empty()) return {};
  constexpr size_t kShown = 8;
  const size_t more = differences.size() > kShown ? differences.size() - kShown : 0;
  differences.resize(std::min(differences.size(), kShown));
  return fmt::format(
      "the ranks were started with different settings: {}{}. Every rank must get the same flags "
      "and DeepSpeed config (does a node read another copy of the config, or miss a flag?)",
      join(differences, " | "), more ? fmt::format(" | and {} more", more) : std::string());
}

void check_ranks_agree(const TrainConfig& cfg, const std::string& model_shape, Backend& backend,
                       Communicator& comm) {
  if (comm.world_size() <= 1) return;
  const std::string text = agreement_record(cfg, model_shape).dump();
  const uint64_t h = fnv1a64(text);
  // Values travel as doubles exact to ~48 bits: the hash in 24-bit pieces.
  const double mine[4] = {static_cast<double>(h & 0xFFFFFF),
                          static_cast<double>((h >> 24) & 0xFFFFFF), static_cast<double>(h >> 48),
                          static_cast<double>(text.size())};
  ScalarAllReduce first(backend, comm, 4);
  const std::vector<double> all = first.gather(mine);
  const int world = comm.world_size();
  bool same = true;
  size_t longest = 0;
  for (int r = 0; r < world; ++r) {
    for (int k = 0; k < 4; ++k) same = same && all[static_cast<size_t>(r * 4 + k)] == mine[k];
    longest = std::max(longest, static_cast<size_t>(all[static_cast<size_t>(r * 4 + 3)]));
  }
  if (same) return;
  // Some rank differs: every rank's record, 3 bytes per value, to name what differs.
  const size_t n = (longest + 2) / 3;
  std::vector<double> packed(n, 0.0);
  for (size_t i = 0; i < text.size(); ++i)
    packed[i / 3] += static_cast<double>(static_cast<unsigned char>(text[i]) << (8 * (i % 3)));
  ScalarAllReduce second(backend, comm, static_cast<int>(n));
  const std::vector<double> texts = second.gather(packed);
  std::vector<json> records;
  for (int r = 0; r < world; ++r) {
    const size_t len = static_cast<size_t>(all[static_cast<size_t>(r * 4 + 3)]);
    std::string t(len, '\0');
    for (size_t i = 0; i < len; ++i) {
      const auto v = static_cast<uint32_t>(texts[static_cast<size_t>(r) * n + i / 3]);
      t[i] = static_cast<char>((v >> (8 * (i % 3))) & 0xFF);
    }
    JsonInputResult parsed = parse_json_input(t);
    records.push_back(parsed.error.empty() ? std::move(parsed.value) : json::object());
  }
  std::string message = rank_disagreement(records);
  if (message.empty())
    message = "the ranks were started with different settings (their configurations differ)";
  ConfigError e(message);
  e.mark_same_on_every_rank();
  throw e;
}

}  // namespace shardtrain
