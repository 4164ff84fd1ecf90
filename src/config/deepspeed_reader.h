// The DeepSpeed JSON reader (apply_deepspeed_config): one class whose section readers live in
// config/deepspeed_config.cpp (batch, precision, zero_optimization, pipeline, aio, monitors,
// profiler) and config/deepspeed_optimizer.cpp (optimizer, scheduler). Internal to config/.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "config/config.h"
#include "config/deepspeed_keys.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/json_input.h"
#include "core/strings.h"

namespace shardtrain::deepspeed_reader {

using nlohmann::json;
using namespace deepspeed;

inline constexpr const char* kDocsUrl = "https://www.deepspeed.ai/docs/config-json/";

/// "prefix.key" for messages; the key is input, so it is escaped and bounded.
inline std::string path_of(const std::string& prefix, const std::string& key) {
  const std::string shown = escaped(key, kMaxSuggestedWord);
  return prefix.empty() ? shown : prefix + "." + shown;
}

inline std::string dashed_flag(std::string_view name) {
  std::string out = "--";
  for (char c : name) out += c == '_' ? '-' : c;
  return out;
}

/// A value that turns a feature on: not false, null, 0, "", "none", "auto" or an object
/// whose "enabled" is not on.
inline bool is_on(const json& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v.get<double>() != 0.0;
  if (v.is_string()) {
    const auto s = lowercase(v.get<std::string>());
    return !s.empty() && s != "none" && s != "auto" && s != "false";
  }
  if (v.is_object()) {
    auto it = v.find("enabled");
    if (it != v.end()) return is_on(*it);
    return !v.empty();
  }
  return !v.empty();  // array
}

inline bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

inline std::string json_type_name(const json& v) {
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

/// Reads one DeepSpeed JSON document into a TrainConfig.

/// Reads one DeepSpeed JSON document into a TrainConfig.
class DeepSpeedReader {
 public:
  DeepSpeedReader(std::string file, TrainConfig& cfg, const ExplicitFlags& explicit_flags,
                  std::vector<std::string>& ignored, std::vector<std::string>& overridden)
      : file_(std::move(file)),
        cfg_(cfg),
        explicit_flags_(explicit_flags),
        ignored_(ignored),
        overridden_(overridden) {}

  /// Reads `root` into the config: every section, each key checked.
  void apply(const json& root);

 private:
  // ---- errors -----------------------------------------------------------------------------

  [[noreturn]] void fail(const std::string& msg) const {
    throw ConfigError(fmt::format("DeepSpeed config '{}': {}", file_, msg));
  }

  [[noreturn]] void bad_value(const std::string& path, const json& v,
                              std::string_view expected) const {
    fail(fmt::format("\"{}\": {} is not valid: expected {}", path, json_excerpt(v), expected));
  }

  [[noreturn]] void unknown_key(const std::string& prefix, const std::string& key,
                                const KeyList& honoured, const KeyList& ignored) const {
    const std::string path = path_of(prefix, key);
    if (key == "aio" && !prefix.empty()) {
      fail(fmt::format(
          "\"{}\": the \"aio\" section belongs at the top level of the config, not inside "
          "\"{}\" (DeepSpeed reads it only there): move the \"aio\" section to the top level",
          path, prefix));
    }
    if (prefix.empty()) {
      for (const auto& [name, flag] : tutorial_keys()) {
        if (key == name) {
          fail(fmt::format(
              "\"{}\" is not a DeepSpeed config key (it belongs to the tutorials' CONFIG dict, "
              "not to ds_config.json): remove it and use {} on the command line",
              key, flag));
        }
      }
    }
    KeyList candidates = honoured;
    candidates.insert(candidates.end(), ignored.begin(), ignored.end());
    std::string msg = fmt::format("unknown key \"{}\"", path);
    if (auto best = closest_match(key, candidates)) {
      msg += fmt::format(": did you mean '{}'?", path_of(prefix, *best));
      if (lowercase(*best) == lowercase(key)) msg += " (keys are case-sensitive)";
    } else {
      // Maybe the key is valid, but in another section.
      for (const auto& [section, keys] : kSections) {
        if (section != prefix && std::find(keys->begin(), keys->end(), key) != keys->end()) {
          msg += fmt::format(": \"{}\" belongs {}", key,
                             section.empty() ? std::string("at the top level")
                                             : fmt::format("in \"{}\"", section));
          fail(msg);
        }
      }
      if (prefix.empty()) {
        msg += fmt::format(": DeepSpeed has no such key; shardtrain reads {} (see {})",
                           join(honoured, ", "), kDocsUrl);
      } else {
        msg += fmt::format(": DeepSpeed has no such key; valid keys in \"{}\": {}", prefix,
                           join(candidates, ", "));
      }
    }
    fail(msg);
  }

  /// Every key of `obj` must be in `honoured` or `ignored`; ignored keys that are "on" are
  /// recorded with their dotted path.
  void check_keys(const json& obj, const std::string& prefix, const KeyList& honoured,
                  const KeyList& ignored) {
    for (const auto& [key, value] : obj.items()) {
      if (std::find(honoured.begin(), honoured.end(), key) != honoured.end()) continue;
      if (std::find(ignored.begin(), ignored.end(), key) != ignored.end()) {
        if (is_on(value)) ignored_.push_back(path_of(prefix, key));
        continue;
      }
      unknown_key(prefix, key, honoured, ignored);
    }
  }

  // ---- typed access; absent, null and "auto" read as unset -----------------------------------

  static bool has(const json& obj, const char* key) { return obj.contains(key); }

  static const json* find(const json& obj, const char* key) {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null() || is_auto(*it)) return nullptr;
    return &*it;
  }

  const json* find_object(const json& obj, const char* key, const std::string& prefix,
                          std::string_view expected) const {
    const json* v = find(obj, key);
    if (v != nullptr && !v->is_object()) bad_value(path_of(prefix, key), *v, expected);
    return v;
  }

  std::optional<int64_t> get_int(const json& obj, const char* key, const std::string& prefix,
                                 int64_t min, std::string_view expected) const {
    const json* v = find(obj, key);
    if (v == nullptr) return std::nullopt;
    int64_t out = 0;
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() &&
          v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        bad_value(path_of(prefix, key), *v, expected);
      }
      out = v->get<int64_t>();
    } else if (v->is_number_float()) {
      // DeepSpeed configs often write sizes as 5e8.
      const double d = v->get<double>();
      if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.0e18) {
        bad_value(path_of(prefix, key), *v, expected);
      }
      out = static_cast<int64_t>(d);
    } else {
      bad_value(path_of(prefix, key), *v, expected);
    }
    if (out < min) bad_value(path_of(prefix, key), *v, expected);
    return out;
  }

  /// A finite number >= min (> min when `exclusive`).
  std::optional<double> get_number(const json& obj, const char* key, const std::string& prefix,
                                   double min, bool exclusive, std::string_view expected) const {
    const json* v = find(obj, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) bad_value(path_of(prefix, key), *v, expected);
    const double d = v->get<double>();
    if (!std::isfinite(d) || d < min || (exclusive && d == min)) {
      bad_value(path_of(prefix, key), *v, expected);
    }
    return d;
  }

  std::optional<bool> get_bool(const json& obj, const char* key, const std::string& prefix) const {
    const json* v = find(obj, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) bad_value(path_of(prefix, key), *v, "true or false");
    return v->get<bool>();
  }

  std::optional<std::string> get_string(const json& obj, const char* key, const std::string& prefix,
                                        std::string_view expected) const {
    const json* v = find(obj, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) bad_value(path_of(prefix, key), *v, expected);
    return v->get<std::string>();
  }

  // ---- assignment honouring explicit flags -----------------------------------------------------

  bool is_explicit(std::string_view flag) const {
    return std::find(explicit_flags_.begin(), explicit_flags_.end(), flag) != explicit_flags_.end();
  }

  /// Sets `field` unless `flag` was given explicitly; `in_json` says whether the value was
  /// written in the file (rather than being a DeepSpeed default), for the overridden list.
  template <typename Field, typename Value>
  bool assign(std::string_view flag, const std::string& path, bool in_json, Field& field,
              const Value& value) {
    if (is_explicit(flag)) {
      if (in_json) overridden_.push_back(fmt::format("{} over {}", dashed_flag(flag), path));
      return false;
    }
    // A value the field cannot hold is refused, not narrowed (an int of 2^40, a float of 1e300).
    if constexpr (std::is_integral_v<Field> && std::is_integral_v<Value> &&
                  !std::is_same_v<Field, bool>) {
      if (!std::in_range<Field>(value))
        fail(fmt::format("\"{}\": {} is out of range: at most {}", path, value,
                         std::numeric_limits<Field>::max()));
    } else if constexpr (std::is_floating_point_v<Field> && std::is_arithmetic_v<Value>) {
      if (std::fabs(static_cast<double>(value)) >
          static_cast<double>(std::numeric_limits<Field>::max()))
        fail(fmt::format("\"{}\": {} is out of range", path, value));
    }
    field = static_cast<Field>(value);
    return true;
  }

  // ---- sections
  // ----------------------------------------------------------------------------------

  // ---- rows of the knob tables (config/knob.h) ---------------------------------------------

  /// The spelling of `k`'s key that `obj` gives (its key or an alias), if any; two spellings of
  /// one setting are an error.
  std::optional<std::string> given_spelling(const json& obj, const Knob& k) const {
    std::optional<std::string> given;
    if (obj.contains(k.key())) given = k.key();
    for (const std::string& alias : k.aliases) {
      if (!obj.contains(alias)) continue;
      if (given) {
        fail(fmt::format(
            "\"{0}.{1}\" and \"{0}.{2}\" are both given: they are the same setting (DeepSpeed "
            "accepts either spelling); keep only \"{3}\"",
            k.section(), *given, alias, k.key()));
      }
      given = alias;
    }
    return given;
  }

  /// Applies the rows of `table` in `section` that `obj` gives (but those read by hand), of the
  /// type `variant` ("" = any): checks each value against its row, then sets the field unless
  /// the row's flag was given. A row with a DeepSpeed default that `obj` omits takes it.
  void read_rows(const json& obj, const std::string& section, const KnobTable& table,
                 const std::string& variant = "") {
    for (const Knob& k : table) {
      if (k.path.empty() || k.section() != section || k.read_by_hand) continue;
      if (k.status == KnobStatus::kIgnored || !k.applies_to(variant)) continue;
      const std::string flag = k.explicit_name();
      const std::optional<std::string> key = given_spelling(obj, k);
      if (!key && k.json_default) {
        if (flag.empty() || !is_explicit(flag)) k.set(cfg_, *k.json_default);
        continue;
      }
      const json* v = key ? find(obj, key->c_str()) : nullptr;
      if (v == nullptr) continue;
      const std::string path = path_of(section, *key);
      if (!k.accepts(*v)) {
        bad_value(path, *v,
                  k.type == KnobType::kBool
                      ? std::string("true or false")
                      : k.expected + (k.expected_or_auto ? " or \"auto\"" : ""));
      }
      if (k.status == KnobStatus::kAlwaysOn) {
        if (!v->get<bool>()) ignored_.push_back(path + ": false");
        continue;
      }
      if (!flag.empty() && is_explicit(flag)) {
        overridden_.push_back(fmt::format("{} over {}", dashed_flag(flag), path));
        continue;
      }
      k.set(cfg_, *v);
      if (k.after_json) k.after_json(cfg_);
    }
  }

  /// The number `obj` gives for the row at `path` of `table`; absent: the row's DeepSpeed
  /// default; null or "auto": none. (For keys read by hand that depend on another key's value.)
  std::optional<double> number_or_default(const json& obj, const KnobTable& table,
                                          const std::string& path) const {
    const Knob& k = knob_row(table, path);
    if (!obj.contains(k.key())) return k.json_default->get<double>();
    const json* v = find(obj, k.key().c_str());
    return v == nullptr ? std::nullopt : std::optional<double>(v->get<double>());
  }

  /// Checks the keys of `obj`, the JSON section `section`, against the rows of `table` (of the
  /// type `variant`, "" = any).
  void check_rows(const json& obj, const std::string& section, const KnobTable& table,
                  const std::string& variant = "") {
    check_keys(obj, section, honoured_keys(table, section, variant),
               ignored_keys(table, section, variant));
  }

  /// Checks the values `obj` gives for the rows of `table` in `section` that read_rows() applies,
  /// without applying them (a section that may turn out ignored is still checked).
  void check_values(const json& obj, const std::string& section, const KnobTable& table) const {
    for (const Knob& k : table) {
      if (k.path.empty() || k.section() != section || k.read_by_hand) continue;
      if (k.status != KnobStatus::kHonoured) continue;
      const std::optional<std::string> key = given_spelling(obj, k);
      const json* v = key ? find(obj, key->c_str()) : nullptr;
      if (v != nullptr && !k.accepts(*v))
        bad_value(path_of(section, *key), *v,
                  k.type == KnobType::kBool ? std::string("true or false") : k.expected);
    }
  }

  /// An integer in [min, INT_MAX] of `obj`, if given.
  std::optional<int> get_small_int(const json& obj, const char* key, const std::string& prefix,
                                   int min, std::string_view expected) const {
    auto v = get_int(obj, key, prefix, min, expected);
    if (v && *v > std::numeric_limits<int>::max())
      bad_value(path_of(prefix, key), obj.at(key), expected);
    if (!v) return std::nullopt;
    return static_cast<int>(*v);
  }

  // ---- sections (deepspeed_config.cpp; optimizer and scheduler: deepspeed_optimizer.cpp) ----
  void read_precision(const json& root);
  void read_offload(const json& z, const std::string& key);
  void read_zero(const json& z);
  void read_pipeline(const json& root);
  void read_activation_checkpointing(const json& ac);
  void read_aio(const json& a);
  /// A monitor section {"enabled", "output_path", "job_name"}: when enabled, `dir` is
  /// output_path/job_name, as DeepSpeed's monitors make it (defaults "" and "DeepSpeedJobName",
  /// relative to the working directory), unless `flag` (--tensorboard, --csv-monitor) was given.
  void read_monitor(const json& m, const std::string& prefix, std::string_view flag,
                    std::string& dir);
  /// DeepSpeed's flops_profiler: {"enabled", "profile_step" (1-based, DeepSpeed's default 1),
  /// "module_depth" (-1 = all), "top_modules", "detailed", "output_file" (null: the log)}.
  /// --profile-step N wins over enabled/profile_step.
  void read_flops_profiler(const json& f);
  void read_optimizer(const json& opt);
  /// Adam/AdamW's params that are not rows of their own: betas and the switches shardtrain has
  /// one setting of (`adam`: the type is "Adam", whose adam_w_mode false would mean L2).
  void read_adam(const json& p, bool adam);
  /// SGD's params that must keep torch.optim.SGD's defaults (dampening, maximize).
  void read_sgd(const json& p);
  void read_warmup_type(const json& p, const std::string& prefix);
  void read_total_steps(const json& p, const std::string& prefix);
  /// WarmupLR / WarmupDecayLR's warmup_min_lr: a fraction of warmup_max_lr.
  void read_warmup_min_lr(const json& p, const std::string& prefix, bool decay);
  void read_scheduler(const json& sched);

  std::string file_;
  TrainConfig& cfg_;
  const ExplicitFlags& explicit_flags_;
  std::vector<std::string>& ignored_;
  std::vector<std::string>& overridden_;
};

}  // namespace shardtrain::deepspeed_reader
