// The DeepSpeed JSON config: its reader into TrainConfig (DeepSpeed's key names, aliases,
// "auto" values and precedence rules, after deepspeed/runtime/config.py), with every key either
// honoured, ignored with a warning, or rejected with the fix.
#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <type_traits>
#include <utility>

#include "config/config.h"
#include "config/deepspeed_keys.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/file_input.h"
#include "core/json_input.h"
#include "core/strings.h"

namespace shardtrain {

namespace {

using nlohmann::json;
using namespace deepspeed;

constexpr const char* kDocsUrl = "https://www.deepspeed.ai/docs/config-json/";

/// "prefix.key" for messages; the key is input, so it is escaped and bounded.
std::string path_of(const std::string& prefix, const std::string& key) {
  const std::string shown = escaped(key, kMaxSuggestedWord);
  return prefix.empty() ? shown : prefix + "." + shown;
}

std::string dashed_flag(std::string_view name) {
  std::string out = "--";
  for (char c : name) out += c == '_' ? '-' : c;
  return out;
}

/// A value that turns a feature on: not false, null, 0, "", "none", "auto" or an object
/// whose "enabled" is not on.
bool is_on(const json& v) {
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

bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

std::string json_type_name(const json& v) {
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

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

  void apply(const json& root) {
    if (!root.is_object()) {
      fail(fmt::format("the top level is {}, expected a JSON object {{...}} of DeepSpeed keys",
                       json_type_name(root)));
    }
    check_keys(root, "", kTopHonoured, kTopIgnored);
    read_batch(root);
    read_rows(root, "", top_level_knobs());  // the single values
    if (const json* opt = find(root, "optimizer")) read_optimizer(*opt);
    if (const json* sched = find(root, "scheduler")) read_scheduler(*sched);
    read_precision(root);
    // Before zero_optimization: a pipeline keeps running as one at the stage read there.
    read_pipeline(root);
    if (const json* zero = find(root, "zero_optimization")) read_zero(*zero);
    if (const json* ac = find(root, "activation_checkpointing")) read_activation_checkpointing(*ac);
    if (const json* aio = find(root, "aio")) read_aio(*aio);
    if (const json* tb = find(root, "tensorboard"))
      read_monitor(*tb, "tensorboard", "tensorboard", cfg_.monitor.tensorboard_dir);
    if (const json* csv = find(root, "csv_monitor"))
      read_monitor(*csv, "csv_monitor", "csv_monitor", cfg_.monitor.csv_dir);
    if (const json* fp = find(root, "flops_profiler")) read_flops_profiler(*fp);
    for (std::string& key : ignored_) {
      if (key == "wandb")
        key =
            "wandb (Weights & Biases logs to its online service: not supported offline; use "
            "tensorboard or csv_monitor)";
    }
  }

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
      for (const auto& [name, flag] : kTutorialKeys) {
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

  void read_batch(const json& root) {
    if (auto v = get_int(root, "train_batch_size", "", 1,
                         "an integer >= 1 (global batch in samples) or \"auto\"")) {
      assign("train_batch_size", "train_batch_size", true, cfg_.train_batch_size, *v);
    }
    if (auto v = get_int(root, "train_micro_batch_size_per_gpu", "", 1,
                         "an integer >= 1 (samples per device per micro-step) or \"auto\"")) {
      if (assign("batch_size", "train_micro_batch_size_per_gpu", true, cfg_.micro_batch_size, *v)) {
        cfg_.micro_batch_set = true;
      }
    }
    if (auto v = get_int(root, "gradient_accumulation_steps", "", 1,
                         "an integer >= 1 (micro-steps per optimizer step) or \"auto\"")) {
      if (assign("gradient_accumulation_steps", "gradient_accumulation_steps", true,
                 cfg_.gradient_accumulation_steps, *v)) {
        cfg_.accumulation_set = true;
      }
    }
  }

  void read_optimizer(const json& opt) {
    if (!opt.is_object()) {
      bad_value("optimizer", opt, "an object {\"type\": \"AdamW\", \"params\": {...}}");
    }
    check_keys(opt, "optimizer", kOptimizerHonoured, kOptimizerIgnored);
    std::string type = "AdamW";
    if (auto t = get_string(opt, "type", "optimizer", "an optimizer name such as \"AdamW\"")) {
      type = *t;
    }
    const std::string lower_type = lowercase(type);
    if (lower_type == "sgd") {
      read_sgd(opt);
      return;
    }
    if (lower_type != "adam" && lower_type != "adamw") {
      static const KeyList kDeepSpeedOptimizers = {
          "Adagrad", "Lamb",    "OneBitAdam", "ZeroOneAdam", "OneBitLamb",
          "MuAdam",  "MuAdamW", "MuSGD",      "Lion",        "Muon"};
      std::string hint;
      if (auto best = closest_match(type, {"Adam", "AdamW", "SGD"})) {
        hint = fmt::format(" (did you mean '{}'?)", *best);
      }
      const bool known =
          std::any_of(kDeepSpeedOptimizers.begin(), kDeepSpeedOptimizers.end(),
                      [&](const std::string& n) { return lowercase(n) == lower_type; });
      fail(fmt::format(
          "\"optimizer.type\": \"{}\" is {}{}: shardtrain implements Adam/AdamW "
          "and SGD only; set \"type\": \"AdamW\" or \"SGD\"",
          escaped(type), known ? "not available in shardtrain" : "not a known optimizer", hint));
    }
    const json* params = find_object(opt, "params", "optimizer", "an object of Adam parameters");
    const json empty = json::object();
    const json& p = params != nullptr ? *params : empty;
    const std::string prefix = "optimizer.params";
    check_keys(p, prefix, kAdamHonoured, kAdamIgnored);
    assign("optimizer", "optimizer.type", true, cfg_.optimizer, OptimizerKind::kAdamW);

    // Parameters the section omits take DeepSpeed's (FusedAdam) defaults.
    auto lr = has(p, "lr") ? get_number(p, "lr", prefix, 0.0, true,
                                        "a learning rate > 0 (e.g. 6e-4) or \"auto\"")
                           : std::optional<double>(1e-3);
    if (lr) assign("lr", prefix + ".lr", has(p, "lr"), cfg_.lr, *lr);

    std::optional<double> b1 = 0.9, b2 = 0.999;
    if (has(p, "betas")) {
      b1.reset();
      b2.reset();
      if (const json* betas = find(p, "betas")) {
        constexpr std::string_view kBetas =
            "[beta1, beta2], two numbers in [0, 1) such as [0.9, 0.999]";
        if (!betas->is_array() || betas->size() != 2) bad_value(prefix + ".betas", *betas, kBetas);
        for (std::size_t i = 0; i < 2; ++i) {
          const json& b = (*betas)[i];
          if (!b.is_number() || !std::isfinite(b.get<double>()) || b.get<double>() < 0.0 ||
              b.get<double>() >= 1.0) {
            bad_value(prefix + ".betas", *betas, kBetas);
          }
        }
        b1 = (*betas)[0].get<double>();
        b2 = (*betas)[1].get<double>();
      }
    }
    if (b1) assign("adam_beta1", prefix + ".betas[0]", has(p, "betas"), cfg_.beta1, *b1);
    if (b2) assign("adam_beta2", prefix + ".betas[1]", has(p, "betas"), cfg_.beta2, *b2);

    auto eps = has(p, "eps")
                   ? get_number(p, "eps", prefix, 0.0, true, "a number > 0 (e.g. 1e-8) or \"auto\"")
                   : std::optional<double>(1e-8);
    if (eps) assign("adam_eps", prefix + ".eps", has(p, "eps"), cfg_.adam_eps, *eps);

    auto wd = has(p, "weight_decay") ? get_number(p, "weight_decay", prefix, 0.0, false,
                                                  "a number >= 0 (0 = no weight decay) or \"auto\"")
                                     : std::optional<double>(0.0);
    if (wd)
      assign("weight_decay", prefix + ".weight_decay", has(p, "weight_decay"), cfg_.weight_decay,
             *wd);

    // DeepSpeed runs "Adam" as AdamW (decoupled weight decay) unless adam_w_mode is false.
    if (auto w_mode = get_bool(p, "adam_w_mode", prefix)) {
      if (!*w_mode && lower_type == "adam" && cfg_.weight_decay > 0.0) {
        fail(fmt::format(
            "\"{}.adam_w_mode\": false asks for Adam with L2 regularisation (weight_decay {}), "
            "which shardtrain does not implement: remove adam_w_mode to get AdamW (decoupled "
            "weight decay), or set weight_decay to 0",
            prefix, cfg_.weight_decay));
      }
    }
    if (auto amsgrad = get_bool(p, "amsgrad", prefix); amsgrad && *amsgrad) {
      fail(
          fmt::format("\"{}.amsgrad\": true is not available in shardtrain: remove it or set "
                      "it to false",
                      prefix));
    }
    if (auto bc = get_bool(p, "bias_correction", prefix); bc && !*bc) {
      fail(
          fmt::format("\"{}.bias_correction\": false is not available in shardtrain (Adam "
                      "always bias-corrects): remove it or set it to true",
                      prefix));
    }
  }

  /// optimizer {"type": "SGD", "params": {lr, momentum, nesterov, weight_decay}}: torch.optim.SGD
  /// (parameters the section omits take PyTorch's defaults, lr DeepSpeed's 1e-3).
  void read_sgd(const json& opt) {
    const std::string prefix = "optimizer.params";
    const json* params = find_object(opt, "params", "optimizer", "an object of SGD parameters");
    const json empty = json::object();
    const json& p = params != nullptr ? *params : empty;
    check_keys(p, prefix, kSgdHonoured, kSgdIgnored);
    assign("optimizer", "optimizer.type", true, cfg_.optimizer, OptimizerKind::kSGD);
    auto lr = has(p, "lr") ? get_number(p, "lr", prefix, 0.0, true,
                                        "a learning rate > 0 (e.g. 0.1) or \"auto\"")
                           : std::optional<double>(1e-3);
    if (lr) assign("lr", prefix + ".lr", has(p, "lr"), cfg_.lr, *lr);
    auto momentum = has(p, "momentum") ? get_number(p, "momentum", prefix, 0.0, false,
                                                    "a number in [0, 1) (e.g. 0.9) or \"auto\"")
                                       : std::optional<double>(0.0);
    if (momentum)
      assign("momentum", prefix + ".momentum", has(p, "momentum"), cfg_.momentum, *momentum);
    auto wd = has(p, "weight_decay") ? get_number(p, "weight_decay", prefix, 0.0, false,
                                                  "a number >= 0 (0 = no weight decay) or \"auto\"")
                                     : std::optional<double>(0.0);
    if (wd)
      assign("weight_decay", prefix + ".weight_decay", has(p, "weight_decay"), cfg_.weight_decay,
             *wd);
    const std::optional<bool> nesterov = get_bool(p, "nesterov", prefix);
    assign("nesterov", prefix + ".nesterov", nesterov.has_value(), cfg_.nesterov,
           nesterov.value_or(false));
    if (const json* d = find(p, "dampening");
        d != nullptr && !(d->is_number() && d->get<double>() == 0.0)) {
      fail(
          fmt::format("\"{}.dampening\": {} is not available in shardtrain (SGD runs with "
                      "dampening 0): remove it or set it to 0",
                      prefix, json_excerpt(*d)));
    }
    if (auto mx = get_bool(p, "maximize", prefix); mx && *mx) {
      fail(
          fmt::format("\"{}.maximize\": true is not available in shardtrain: remove it or "
                      "set it to false",
                      prefix));
    }
  }

  void read_warmup_type(const json& p, const std::string& prefix) {
    if (auto t = get_string(p, "warmup_type", prefix, "\"linear\" or \"log\"")) {
      if (*t == "log") {
        ignored_.push_back(prefix + ".warmup_type");  // shardtrain warms up linearly
      } else if (*t != "linear") {
        bad_value(prefix + ".warmup_type", p.at("warmup_type"), "\"linear\" or \"log\"");
      }
    }
  }

  void read_total_steps(const json& p, const std::string& prefix) {
    if (auto total = get_int(p, "total_num_steps", prefix, 1,
                             "an integer >= 1 (optimizer steps) or \"auto\"")) {
      if (is_explicit("max_steps")) {
        overridden_.push_back(fmt::format("--max-steps over {}.total_num_steps", prefix));
      } else if (cfg_.max_steps == -1) {
        cfg_.max_steps = *total;
      }
    }
  }

  void read_scheduler(const json& sched) {
    if (!sched.is_object()) {
      bad_value("scheduler", sched, "an object {\"type\": \"WarmupCosineLR\", \"params\": {...}}");
    }
    check_keys(sched, "scheduler", kSchedulerHonoured, {});
    static const KeyList kTypes = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                                   "LRRangeTest"};
    auto type = get_string(sched, "type", "scheduler", "a scheduler name such as \"WarmupLR\"");
    const json* params =
        find_object(sched, "params", "scheduler", "an object of scheduler parameters");
    if (!type) {
      if (params != nullptr) {
        fail(
            "\"scheduler.params\" is given without \"scheduler.type\": set \"type\" to "
            "WarmupLR, WarmupDecayLR or WarmupCosineLR");
      }
      return;
    }
    if (*type == "OneCycle" || *type == "LRRangeTest") {
      fail(
          fmt::format("\"scheduler.type\": \"{}\" is not available in shardtrain: use "
                      "WarmupLR (constant after warmup), WarmupDecayLR (linear decay) or "
                      "WarmupCosineLR (cosine decay)",
                      *type));
    }
    if (*type != "WarmupLR" && *type != "WarmupDecayLR" && *type != "WarmupCosineLR") {
      std::string hint;
      if (auto best = closest_match(*type, kTypes))
        hint = fmt::format(": did you mean '{}'?", *best);
      fail(
          fmt::format("\"scheduler.type\": \"{}\" is not a DeepSpeed scheduler{}; shardtrain "
                      "supports WarmupLR, WarmupDecayLR and WarmupCosineLR",
                      *type, hint));
    }
    const json empty = json::object();
    const json& p = params != nullptr ? *params : empty;
    const std::string prefix = "scheduler.params";

    if (*type == "WarmupCosineLR") {
      check_keys(p, prefix, kWarmupCosineLrHonoured, kSchedulerParamsIgnored);
      assign("lr_schedule", "scheduler.type", true, cfg_.lr_schedule, LrSchedule::kCosine);
      read_total_steps(p, prefix);
      auto ratio_expected = "a number in [0, 1] (fraction of the optimizer's lr)";
      auto warm_min = has(p, "warmup_min_ratio")
                          ? get_number(p, "warmup_min_ratio", prefix, 0.0, false, ratio_expected)
                          : std::optional<double>(0.0);
      if (warm_min) {
        if (*warm_min > 1.0)
          bad_value(prefix + ".warmup_min_ratio", p.at("warmup_min_ratio"), ratio_expected);
        cfg_.warmup_min_ratio = *warm_min;
      }
      auto warmup = has(p, "warmup_num_steps")
                        ? get_int(p, "warmup_num_steps", prefix, 0, "an integer >= 0 or \"auto\"")
                        : std::optional<int64_t>(1000);
      if (warmup) {
        assign("warmup_steps", prefix + ".warmup_num_steps", has(p, "warmup_num_steps"),
               cfg_.warmup_steps, *warmup);
      }
      auto cos_min = has(p, "cos_min_ratio")
                         ? get_number(p, "cos_min_ratio", prefix, 0.0, false, ratio_expected)
                         : std::optional<double>(0.0001);
      if (cos_min) {
        if (*cos_min > 1.0)
          bad_value(prefix + ".cos_min_ratio", p.at("cos_min_ratio"), ratio_expected);
        assign("min_lr_ratio", prefix + ".cos_min_ratio", has(p, "cos_min_ratio"),
               cfg_.min_lr_ratio, *cos_min);
      }
      read_warmup_type(p, prefix);
      return;
    }

    // WarmupLR and WarmupDecayLR: warm up from warmup_min_lr to warmup_max_lr (which overrides
    // the optimizer's lr, as in DeepSpeed), then constant or linear decay to warmup_min_lr.
    const bool decay = *type == "WarmupDecayLR";
    check_keys(p, prefix, decay ? kWarmupDecayLrHonoured : kWarmupLrHonoured,
               kSchedulerParamsIgnored);
    assign("lr_schedule", "scheduler.type", true, cfg_.lr_schedule,
           decay ? LrSchedule::kLinear : LrSchedule::kConstant);
    if (decay) read_total_steps(p, prefix);
    auto max_lr = has(p, "warmup_max_lr") ? get_number(p, "warmup_max_lr", prefix, 0.0, true,
                                                       "a learning rate > 0 or \"auto\"")
                                          : std::optional<double>(0.001);
    if (max_lr) assign("lr", prefix + ".warmup_max_lr", has(p, "warmup_max_lr"), cfg_.lr, *max_lr);
    auto min_lr = has(p, "warmup_min_lr") ? get_number(p, "warmup_min_lr", prefix, 0.0, false,
                                                       "a learning rate >= 0 or \"auto\"")
                                          : std::optional<double>(0.0);
    if (min_lr) {
      const double peak = max_lr ? *max_lr : cfg_.lr;
      if (*min_lr > peak) {
        fail(
            fmt::format("\"{0}.warmup_min_lr\": {1} is larger than warmup_max_lr {2}: the "
                        "warmup starts at warmup_min_lr and rises to warmup_max_lr; set "
                        "warmup_min_lr to at most {2}",
                        prefix, *min_lr, peak));
      }
      cfg_.warmup_min_ratio = *min_lr / peak;
      if (decay) {
        assign("min_lr_ratio", prefix + ".warmup_min_lr", has(p, "warmup_min_lr"),
               cfg_.min_lr_ratio, *min_lr / peak);
      }
    }
    auto warmup = has(p, "warmup_num_steps")
                      ? get_int(p, "warmup_num_steps", prefix, 0, "an integer >= 0 or \"auto\"")
                      : std::optional<int64_t>(1000);
    if (warmup) {
      assign("warmup_steps", prefix + ".warmup_num_steps", has(p, "warmup_num_steps"),
             cfg_.warmup_steps, *warmup);
    }
    read_warmup_type(p, prefix);
  }

  void read_precision(const json& root) {
    if (find(root, "bf16") != nullptr && find(root, "bfloat16") != nullptr) {
      fail("both \"bf16\" and \"bfloat16\" (its old name) are given: keep only \"bf16\"");
    }
    std::optional<bool> bf16, fp16;
    std::string bf16_key = find(root, "bf16") != nullptr ? "bf16" : "bfloat16";
    if (const json* bf = find_object(root, bf16_key.c_str(), "", "an object {\"enabled\": true}")) {
      check_keys(*bf, bf16_key, kBf16Honoured, kBf16Ignored);
      bf16 = get_bool(*bf, "enabled", bf16_key);
    }
    if (const json* fp = find_object(root, "fp16", "", "an object {\"enabled\": true, ...}")) {
      const std::string prefix = "fp16";
      check_rows(*fp, prefix, fp16_knobs());
      fp16 = get_bool(*fp, "enabled", prefix);
      read_rows(*fp, prefix, fp16_knobs());
    }
    if (bf16.value_or(false) && fp16.value_or(false)) {
      fail(
          fmt::format("\"{}.enabled\" and \"fp16.enabled\" are both true: enable at most one "
                      "(bf16 needs no loss scaling; fp16 uses the fp16 loss-scale settings)",
                      bf16_key));
    }
    if (bf16 || fp16) {
      Precision p = Precision::kFp32;  // both written as false: DeepSpeed trains in fp32
      std::string path = bf16 ? bf16_key + ".enabled" : "fp16.enabled";
      if (bf16.value_or(false)) {
        p = Precision::kBf16;
        path = bf16_key + ".enabled";
      } else if (fp16.value_or(false)) {
        p = Precision::kFp16;
        path = "fp16.enabled";
      }
      assign("precision", path, true, cfg_.precision, p);
    }
  }

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

  /// Applies the rows of `table` in `section` that `obj` gives (but those read by hand): checks
  /// each value against its row, then sets the field unless the row's flag was given.
  void read_rows(const json& obj, const std::string& section, const KnobTable& table) {
    for (const Knob& k : table) {
      if (k.path.empty() || k.section() != section || k.read_by_hand) continue;
      if (k.status == KnobStatus::kIgnored) continue;
      const std::optional<std::string> key = given_spelling(obj, k);
      const json* v = key ? find(obj, key->c_str()) : nullptr;
      if (v == nullptr) continue;
      const std::string path = path_of(section, *key);
      if (!k.accepts(*v))
        bad_value(path, *v, k.type == KnobType::kBool ? "true or false" : k.expected);
      if (k.status == KnobStatus::kAlwaysOn) {
        if (!v->get<bool>()) ignored_.push_back(path + ": false");
        continue;
      }
      const std::string flag = k.explicit_name();
      if (!flag.empty() && is_explicit(flag)) {
        overridden_.push_back(fmt::format("{} over {}", dashed_flag(flag), path));
        continue;
      }
      k.set(cfg_, *v);
      if (k.after_json) k.after_json(cfg_);
    }
  }

  /// Checks the keys of `obj`, the JSON section `section`, against the rows of `table`.
  void check_rows(const json& obj, const std::string& section, const KnobTable& table) {
    check_keys(obj, section, honoured_keys(table, section), ignored_keys(table, section));
  }

  void read_offload(const json& z, const std::string& key) {
    const std::string prefix = "zero_optimization." + key;
    const json* off = find_object(z, key.c_str(), "zero_optimization",
                                  "an object {\"device\": \"none\" | \"cpu\" | \"nvme\", ...}");
    if (off == nullptr) return;
    // Keys of offload_optimizer alone: elsewhere an error naming where they belong.
    const KeyList own = honoured_keys(zero_knobs(), prefix);
    for (const std::string& k :
         honoured_keys(zero_knobs(), "zero_optimization.offload_optimizer")) {
      if (off->contains(k) && std::find(own.begin(), own.end(), k) == own.end()) {
        throw ConfigError(
            fmt::format("{}.{} in '{}': {} belongs to offload_optimizer, not {}; move it there",
                        prefix, k, file_, k, key));
      }
    }
    check_rows(*off, prefix, zero_knobs());
    read_rows(*off, prefix, zero_knobs());
  }

  void read_zero(const json& z) {
    ZeroConfig& zc = cfg_.zero;
    std::optional<int64_t> stage;
    if (z.is_boolean()) {
      stage = z.get<bool>() ? 1 : 0;  // deprecated form: true = stage 1
    } else if (!z.is_object()) {
      bad_value("zero_optimization", z, "an object {\"stage\": 0, ...}");
    } else {
      const std::string prefix = "zero_optimization";
      check_rows(z, prefix, zero_knobs());
      stage = get_int(z, "stage", prefix, 0, "a ZeRO stage 0, 1, 2 or 3");
      if (stage && *stage > 3)
        bad_value("zero_optimization.stage", z.at("stage"), "a ZeRO stage 0, 1, 2 or 3");
      read_rows(z, prefix, zero_knobs());
      // Deprecated spellings of offload_optimizer / offload_param {"device": "cpu"}.
      if (auto v = get_bool(z, "cpu_offload", prefix); v && *v) zc.offload_optimizer_device = "cpu";
      if (auto v = get_bool(z, "cpu_offload_param", prefix); v && *v) {
        zc.offload_param_device = "cpu";
      }
      read_offload(z, "offload_optimizer");
      read_offload(z, "offload_param");
    }
    if (!stage) return;
    const std::string path = z.is_boolean() ? "zero_optimization" : "zero_optimization.stage";
    if (!assign("zero_stage", path, true, zc.stage, *stage)) return;
    // As in DeepSpeed, the config's stage decides the strategy; a pipeline stays one and runs
    // that stage across its data-parallel replicas (validate() allows stages 0, 1 and 2).
    if (cfg_.strategy == StrategyKind::kPipeline) return;
    cfg_.strategy = strategy_for_zero(static_cast<int>(*stage), zc.offload_optimizer_device,
                                      zc.offload_param_device);
    cfg_.strategy_name = to_string(cfg_.strategy);
    cfg_.strategy_source = "deepspeed";
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

  void read_pipeline(const json& root) {
    const std::string prefix = "pipeline";
    const json* section = find(root, "pipeline");
    if (section == nullptr) return;
    const json& p = *section;
    if (!p.is_object()) bad_value(prefix, p, "an object {\"stages\": 4, ...}");
    const std::size_t ignored_before = ignored_.size();
    check_keys(p, prefix, kPipelineHonoured, kPipelineIgnored);

    if (has(p, "stages") && is_auto(p.at("stages"))) {
      fail(
          "\"pipeline.stages\": \"auto\" is not supported: shardtrain does not choose the "
          "number of pipeline stages; give a number, e.g. \"stages\": 4 (ranks per pipeline; "
          "the world size must be a multiple of it)");
    }
    const auto stages =
        get_small_int(p, "stages", prefix, 1, "an integer >= 1 (ranks per pipeline), e.g. 4");
    std::optional<PipelineSchedule> schedule;
    if (auto name = get_string(p, "schedule", prefix,
                               "a schedule name: gpipe, 1f1b, interleaved-1f1b, zb-h1 or 2bw")) {
      try {
        schedule = parse_pipeline_schedule(*name);
      } catch (const ConfigError& e) {
        fail(fmt::format("\"pipeline.schedule\": {}", e.what()));
      }
    }
    const auto virtual_stages =
        get_small_int(p, "virtual_stages", prefix, 1,
                      "an integer >= 1 (model chunks per rank; > 1 only with interleaved-1f1b)");
    if (has(p, "partition_method") && has(p, "partition")) {
      fail(
          "\"pipeline.partition_method\" and \"pipeline.partition\" are both given: they are "
          "the same setting; keep only \"partition_method\"");
    }
    const char* partition_key = has(p, "partition") ? "partition" : "partition_method";
    const std::string partition_path = path_of(prefix, partition_key);
    std::optional<std::string> partition;
    if (auto m = get_string(p, partition_key, prefix, "\"parameters\", \"uniform\" or \"time\"")) {
      partition = lowercase(*m);
      if (partition->rfind("type:", 0) == 0) {
        fail(
            fmt::format("\"{}\": \"{}\" (DeepSpeed's partition by layer class) is not available in "
                        "shardtrain: use \"parameters\" (balance parameter counts, the default), "
                        "\"uniform\" (equal block counts) or \"time\" (balance measured time)",
                        partition_path, *m));
      }
      try {
        check_partition_method(*partition);
      } catch (const ConfigError& e) {
        fail(fmt::format("\"{}\": {}", partition_path, e.what()));
      }
    }
    const auto interval =
        get_small_int(p, "activation_checkpoint_interval", prefix, 0,
                      "an integer >= 0 (blocks per activation checkpoint; 0 = off)");

    // A pipeline section with stages > 1 selects the pipeline, as DeepSpeed's PipelineEngine
    // runs whenever the model is a PipelineModule.
    const bool selects = stages && *stages > 1;
    if (selects && cfg_.strategy != StrategyKind::kPipeline) {
      if (cfg_.strategy_source == "--strategy") {
        fail(fmt::format(
            "\"pipeline.stages\": {} asks for pipeline parallelism, but --strategy {} asks for "
            "strategy '{}': use --strategy pipeline (or drop --strategy), or remove the "
            "\"pipeline\" section",
            *stages, cfg_.strategy_name, to_string(cfg_.strategy)));
      }
      cfg_.strategy = StrategyKind::kPipeline;
      cfg_.strategy_name = to_string(cfg_.strategy);
      cfg_.strategy_source = "deepspeed";
    }
    if (cfg_.strategy != StrategyKind::kPipeline) {
      // DeepSpeed, too, reads the section only when it runs a pipeline: all of it is ignored.
      ignored_.resize(ignored_before);
      if (is_on(p)) ignored_.push_back(prefix);
      return;
    }
    PipelineConfig& pc = cfg_.pipeline;
    if (stages) assign("pipeline_stages", "pipeline.stages", true, pc.stages, *stages);
    if (schedule) assign("pipeline_schedule", "pipeline.schedule", true, pc.schedule, *schedule);
    if (virtual_stages) {
      assign("virtual_stages", "pipeline.virtual_stages", true, pc.virtual_stages, *virtual_stages);
    }
    if (partition) {
      assign("partition_method", partition_path, true, pc.partition_method, *partition);
    }
    if (interval) {
      assign("activation_checkpoint_interval", "pipeline.activation_checkpoint_interval", true,
             pc.activation_checkpoint_interval, *interval);
    }
  }

  void read_activation_checkpointing(const json& ac) {
    const std::string prefix = "activation_checkpointing";
    if (!ac.is_object()) bad_value(prefix, ac, "an object {\"partition_activations\": false, ...}");
    check_keys(ac, prefix, {}, kActivationCheckpointingKeys);
    bool on = false;
    for (const auto& key : kActivationCheckpointingKeys) {
      const json* v = find(ac, key.c_str());
      if (v == nullptr) continue;
      if (key == "number_checkpoints") {
        get_int(ac, "number_checkpoints", prefix, 0, "an integer >= 0 or null");
      } else {
        get_bool(ac, key.c_str(), prefix);
      }
      on = on || is_on(*v);
    }
    if (on) assign("activation_checkpointing", prefix, true, cfg_.activation_checkpointing, true);
  }

  void read_aio(const json& a) {
    const std::string prefix = "aio";
    if (!a.is_object()) bad_value(prefix, a, "an object {\"block_size\": 1048576, ...}");
    check_rows(a, prefix, aio_knobs());
    read_rows(a, prefix, aio_knobs());
  }

  /// A monitor section {"enabled", "output_path", "job_name"}: when enabled, `dir` is
  /// output_path/job_name, as DeepSpeed's monitors make it (defaults "" and "DeepSpeedJobName",
  /// relative to the working directory), unless `flag` (--tensorboard, --csv-monitor) was given.
  void read_monitor(const json& m, const std::string& prefix, std::string_view flag,
                    std::string& dir) {
    if (!m.is_object())
      bad_value(prefix, m,
                "an object {\"enabled\": true, \"output_path\": ..., \"job_name\": ...}");
    check_keys(m, prefix, kMonitorHonoured, {});
    const bool enabled = get_bool(m, "enabled", prefix).value_or(false);
    const std::string output_path =
        get_string(m, "output_path", prefix, "a directory path (string)").value_or("");
    const std::string job_name =
        get_string(m, "job_name", prefix, "a name (string)").value_or("DeepSpeedJobName");
    if (job_name.empty())
      bad_value(path_of(prefix, "job_name"), m.at("job_name"), "a non-empty name");
    if (!enabled) return;
    const std::string path = (std::filesystem::path(output_path) / job_name).string();
    assign(flag, prefix, true, dir, path);
  }

  /// DeepSpeed's flops_profiler: {"enabled", "profile_step" (1-based, DeepSpeed's default 1),
  /// "module_depth" (-1 = all), "top_modules", "detailed", "output_file" (null: the log)}.
  /// --profile-step N wins over enabled/profile_step.
  void read_flops_profiler(const json& f) {
    const std::string prefix = "flops_profiler";
    if (!f.is_object())
      bad_value(prefix, f, "an object {\"enabled\": true, \"profile_step\": 1, ...}");
    check_keys(f, prefix, kFlopsProfilerHonoured, {});
    FlopsProfilerConfig& p = cfg_.flops_profiler;
    const bool enabled = get_bool(f, "enabled", prefix).value_or(false);
    const auto step =
        get_int(f, "profile_step", prefix, 1, "an integer >= 1 (the optimizer step to profile)");
    if (enabled) {
      if (!is_explicit("profile_step")) p.enabled = true;
      assign("profile_step", path_of(prefix, "profile_step"), step.has_value(), p.profile_step,
             step.value_or(1));
    }
    if (auto v = get_int(f, "module_depth", prefix, -1, "an integer >= -1 (-1: every level)"))
      p.module_depth = *v;
    if (auto v = get_int(f, "top_modules", prefix, 0, "an integer >= 0")) p.top_modules = *v;
    if (auto v = get_bool(f, "detailed", prefix)) p.detailed = *v;
    if (f.contains("output_file") && !f.at("output_file").is_null()) {
      if (auto v = get_string(f, "output_file", prefix, "a file path (string) or null"))
        p.output_file = *v;
    }
  }

  std::string file_;
  TrainConfig& cfg_;
  const ExplicitFlags& explicit_flags_;
  std::vector<std::string>& ignored_;
  std::vector<std::string>& overridden_;
};

/// Parses the file, accepting comments (DeepSpeed reads configs with hjson) and rejecting
/// duplicate keys (as DeepSpeed does), nesting beyond 64 levels and numbers beyond a double.
json parse_json_file(const std::string& path) {
  const std::string what = fmt::format("DeepSpeed config '{}' (--deepspeed-config)", path);
  const std::string text = read_input_file_or_throw<ConfigError>(
      path, "DeepSpeed config (--deepspeed-config)", kMaxConfigFileBytes);
  JsonInputOptions options;
  options.allow_comments = true;
  options.reject_duplicate_keys = true;
  JsonInputResult r = parse_json_input(text, options);
  if (!r.error.empty()) {
    throw ConfigError(
        fmt::format("cannot parse {}: {}: fix the JSON there (comments are allowed, "
                    "trailing commas are not; DeepSpeed rejects duplicate keys)",
                    what, r.error));
  }
  return std::move(r.value);
}

}  // namespace

// ---- DeepSpeed JSON -------------------------------------------------------------------------

void apply_deepspeed_config(const std::string& path, TrainConfig& cfg,
                            const ExplicitFlags& explicit_flags,
                            std::vector<std::string>& ignored_keys,
                            std::vector<std::string>& overridden) {
  const json root = parse_json_file(path);
  DeepSpeedReader(path, cfg, explicit_flags, ignored_keys, overridden).apply(root);
}

void apply_deepspeed_config(const std::string& path, TrainConfig& cfg,
                            const ExplicitFlags& explicit_flags,
                            std::vector<std::string>& ignored_keys) {
  std::vector<std::string> overridden;
  apply_deepspeed_config(path, cfg, explicit_flags, ignored_keys, overridden);
}

}  // namespace shardtrain
