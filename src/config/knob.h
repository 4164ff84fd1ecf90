// The configuration knobs as tables: one row per knob (a flag, a DeepSpeed JSON key, or both)
// saying where it lives in TrainConfig, its default, the values it takes, what it does and
// whether shardtrain honours it. The flag parser (add_train_flags, `shardtrain estimate`), the
// DeepSpeed JSON reader, the range checks of validate(), run.json's config snapshot and the
// tables of docs/CONFIG.md (`shardtrain config --markdown`) all walk these rows instead of naming
// the knobs themselves. Rules that tie several sections together stay in validate().
//
// Adding a knob: a member in its section's struct (config.h) and one row in that section's
// table (config/knobs_<section>.cpp); then use the member where it acts.
#pragma once

#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "config/config.h"

namespace shardtrain {

/// What shardtrain does with a knob.
enum class KnobStatus {
  kHonoured,  ///< read and applied
  kIgnored,   ///< a DeepSpeed key shardtrain does not implement: listed in one warning when "on"
  kAlwaysOn,  ///< a DeepSpeed switch that is always on here: true accepted, false warned about
};

/// The type of a knob's value, in JSON and on the command line.
enum class KnobType { kNone, kBool, kInt, kNumber, kString };

/// Where a knob is a flag: `shardtrain train`, `shardtrain estimate`, both or neither.
enum KnobSurface : unsigned { kNoFlag = 0, kTrainFlag = 1, kEstimateFlag = 2 };

/// How a flag's value is checked while parsing (CLI::ValidationError "--flag: must be ...").
enum class FlagCheck {
  kRange,   ///< the row's range (or choices)
  kFinite,  ///< any finite number; validate() checks the range, naming the JSON key too
  kNone,    ///< as CLI11 converts it
};

/// One knob. Build rows with knob_at() / ignored_key() and the chained setters below.
struct Knob {
  // ---- names ----
  std::string flag;             ///< CLI11 name(s) of the flag ("--log-interval"); "" = no flag
  unsigned surfaces = kNoFlag;  ///< KnobSurface bits: which commands have the flag
  /// The DeepSpeed JSON path ("aio.queue_depth"); "" = not a JSON key.
  std::string path;
  std::vector<std::string> aliases;  ///< other spellings of the path's last key, same section
  std::string snapshot;              ///< its path in run.json's config snapshot; "" = not there
  // ---- values ----
  KnobType type = KnobType::kNone;
  double min = -std::numeric_limits<double>::infinity();  ///< inclusive unless min_open
  double max = std::numeric_limits<double>::infinity();   ///< inclusive unless max_open
  bool min_open = false;
  bool max_open = false;
  int64_t multiple = 0;              ///< kInt: a multiple of this; 0 = any
  std::vector<std::string> choices;  ///< kString: the values it takes; empty = any
  FlagCheck flag_check = FlagCheck::kRange;
  /// Checks a flag's value instead of the range and choices (throws ConfigError with the message
  /// CLI11 shows); empty = the range or choices.
  std::function<void(const std::string&)> flag_parse;
  bool bool_flag_takes_value = false;  ///< kBool: "--x true|false" instead of a bare "--x"
  // ---- words ----
  /// What a valid value is, after "expected" in JSON errors and "use" in validate()'s:
  /// "an integer >= 1 (elements)".
  std::string expected;
  /// --help's text and the docs' note; "{}" is replaced by the default.
  std::string doc;
  std::string type_name;  ///< the value's name in --help ("N", "DIR")
  /// What errors of validate() call it ("offload ratio"); "" = its JSON path or flag.
  std::string noun;
  /// The default as docs/CONFIG.md shows it; "" = the default's value.
  std::string default_text;
  KnobStatus status = KnobStatus::kHonoured;
  /// The value is where a node keeps its files (a directory, an output file): ranks may differ
  /// in it (train/rank_agreement.h compares every other row).
  bool node_local = false;
  /// A value that means "not set" (a default outside the range, e.g. -1 = all): validate()
  /// accepts it; the JSON and the flag do not.
  std::optional<double> unset_value;
  /// The flag that beats this key when given explicitly, when not the row's own ("--nvme-path"
  /// for offload_param.nvme_path, whose flag sits on offload_optimizer's row).
  std::string beaten_by;
  /// The section's reader applies the key itself (it decides more than one field); the row
  /// still lists it as honoured and documents it.
  bool read_by_hand = false;
  /// The value the field takes when its section is given without the key (DeepSpeed builds the
  /// optimizer and scheduler from their defaults, not from the flags'); none = left as it is.
  std::optional<nlohmann::json> json_default;
  /// JSON errors add `or "auto"` to `expected` (the key's DeepSpeed docs show "auto").
  bool expected_or_auto = false;
  /// The key exists only when the JSON value at `variant_path` ("optimizer.type") is one of
  /// `variants` ("Adam", "AdamW"); empty = always.
  std::string variant_path;
  std::vector<std::string> variants;
  // ---- access (empty for keys that are not applied) ----
  std::function<nlohmann::json(const TrainConfig&)> get;
  /// The field's byte offset in TrainConfig (knob_for finds a row by it); -1 = none.
  std::ptrdiff_t field = -1;
  /// Sets the field from a value already checked against the row.
  std::function<void(TrainConfig&, const nlohmann::json&)> set;
  /// Run after the JSON set the field (e.g. to record that it was given).
  std::function<void(TrainConfig&)> after_json;
  std::function<std::string(const TrainConfig&)> print;  ///< the value as --help shows it
  /// Registers the flag, bound to the field, with `help` as its text.
  std::function<CLI::Option*(const Knob&, CLI::App&, TrainConfig&, const std::string& help)> add_to;

  // ---- chained setters, for building the tables ----
  Knob& json_key(std::string p, std::vector<std::string> other_spellings = {}) {
    path = std::move(p);
    aliases = std::move(other_spellings);
    return *this;
  }
  Knob& train_flag(std::string f, std::string metavar = "") {
    flag = std::move(f);
    surfaces |= kTrainFlag;
    type_name = std::move(metavar);
    return *this;
  }
  Knob& estimate_flag(std::string f, std::string metavar = "") {
    if (flag.empty()) flag = std::move(f);
    surfaces |= kEstimateFlag;
    if (type_name.empty()) type_name = std::move(metavar);
    return *this;
  }
  /// The train flag is estimate's too (`shardtrain estimate` takes it, with the same doc).
  Knob& on_estimate() {
    surfaces |= kEstimateFlag;
    return *this;
  }
  Knob& in_snapshot(std::string p) {
    snapshot = std::move(p);
    return *this;
  }
  Knob& at_least(double lo, bool open = false) {
    min = std::max(min, lo);
    min_open = open;
    return *this;
  }
  Knob& at_most(double hi, bool open = false) {
    max = std::min(max, hi);
    max_open = open;
    return *this;
  }
  Knob& multiple_of(int64_t n) {
    multiple = n;
    return *this;
  }
  Knob& one_of(std::vector<std::string> values) {
    choices = std::move(values);
    return *this;
  }
  Knob& flag_checks(FlagCheck c) {
    flag_check = c;
    return *this;
  }
  Knob& flag_parsed_by(std::function<void(const std::string&)> parse) {
    flag_parse = std::move(parse);
    return *this;
  }
  Knob& bool_value() {
    bool_flag_takes_value = true;
    return *this;
  }
  Knob& expects(std::string e) {
    expected = std::move(e);
    return *this;
  }
  Knob& docs(std::string d) {
    doc = std::move(d);
    return *this;
  }
  Knob& called(std::string n) {
    noun = std::move(n);
    return *this;
  }
  Knob& shows_default(std::string d) {
    default_text = std::move(d);
    return *this;
  }
  Knob& unset_is(double v) {
    unset_value = v;
    return *this;
  }
  Knob& overridden_by(std::string f) {
    beaten_by = std::move(f);
    return *this;
  }
  Knob& on_json(std::function<void(TrainConfig&)> f) {
    after_json = std::move(f);
    return *this;
  }
  Knob& a_node_path() {
    node_local = true;
    return *this;
  }
  Knob& by_hand() {
    read_by_hand = true;
    return *this;
  }
  Knob& deepspeed_default(nlohmann::json v) {
    json_default = std::move(v);
    return *this;
  }
  Knob& or_auto() {
    expected_or_auto = true;
    return *this;
  }
  Knob& only_with(std::string path_of_type, std::vector<std::string> types) {
    variant_path = std::move(path_of_type);
    variants = std::move(types);
    return *this;
  }

  /// The last key of `path` ("queue_depth") and its section ("aio").
  std::string key() const;
  std::string section() const;
  /// The name used for --help and errors: the flag's first long name ("--no-save" of
  /// "--no-save{false}", "--cuda-graphs" of "--cuda-graphs,!--no-cuda-graphs"), else the JSON
  /// path.
  std::string name() const;
  /// How messages name the knob: "zero_optimization.offload_optimizer.ratio (--offload-ratio)",
  /// the JSON path alone, or the flag alone.
  std::string label() const;
  /// The flag's name as explicit_train_flags() lists it ("log_interval"); "" without a flag.
  /// For a key beaten by another row's flag, that flag's.
  std::string explicit_name() const;
  /// Whether `v` (a number) is within [min, max].
  bool in_range(double v) const;
  /// Whether the JSON `v` is a valid value: the right type, in range, one of the choices (a
  /// string with a flag_parse: what it reads, aliases included).
  bool accepts(const nlohmann::json& v) const;
  /// Whether the key exists for the type `variant` ("" = any type).
  bool applies_to(const std::string& variant) const;
};

using KnobTable = std::vector<Knob>;

namespace knob_detail {

template <typename T>
constexpr KnobType type_of() {
  if constexpr (std::is_same_v<T, bool>) return KnobType::kBool;
  if constexpr (std::is_integral_v<T>) return KnobType::kInt;
  if constexpr (std::is_floating_point_v<T>) return KnobType::kNumber;
  if constexpr (std::is_same_v<T, std::string>) return KnobType::kString;
  return KnobType::kNone;
}

/// A default TrainConfig, whose fields' addresses identify the rows' fields.
const TrainConfig& probe_config();

/// The byte offset of `field`, a field of probe_config(), in it.
inline std::ptrdiff_t offset_in_probe(const void* field) {
  return static_cast<const char*>(field) - reinterpret_cast<const char*>(&probe_config());
}

/// The row whose field is at `offset` (the first of the tables, in all_knob_tables() order).
const Knob& knob_at_offset(std::ptrdiff_t offset);

/// Registers the flag of `k`, bound to `field`.
template <typename T>
CLI::Option* add_flag(const Knob& k, CLI::App& cmd, T& field, const std::string& help);

/// The validator of `k`'s flag: its flag_parse, its choices, or its range.
CLI::Validator validator_of(const Knob& k);

}  // namespace knob_detail

namespace knob_detail {

/// A row for the field of type T that `at` reaches (`at(c)` is the field of `c`, TrainConfig or
/// const TrainConfig). Integer fields take the range of their type.
template <typename T, typename At>
Knob field_row(At at) {
  static_assert(type_of<T>() != KnobType::kNone, "a knob is a bool, number or string");
  Knob k;
  k.type = type_of<T>();
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    k.min = static_cast<double>(std::numeric_limits<T>::min());
    k.max = static_cast<double>(std::numeric_limits<T>::max());
  }
  k.get = [at](const TrainConfig& c) { return nlohmann::json(at(c)); };
  k.field = offset_in_probe(&at(probe_config()));
  k.set = [at](TrainConfig& c, const nlohmann::json& v) { at(c) = v.get<T>(); };
  k.print = [at](const TrainConfig& c) {
    if constexpr (std::is_same_v<T, bool>)
      return std::string(at(c) ? "true" : "false");
    else if constexpr (std::is_same_v<T, std::string>)
      return at(c);
    else
      return fmt::format("{}", at(c));
  };
  k.add_to = [at](const Knob& row, CLI::App& cmd, TrainConfig& c, const std::string& help) {
    return add_flag(row, cmd, at(c), help);
  };
  return k;
}

/// A row for the enumeration field of type E that `at` reaches: its flag is read with `parse`
/// and checked by the row's validator (its choices, or its flag_parse), written with
/// `to_string`.
template <typename E, typename At>
Knob enum_row(At at, E (*parse)(const std::string&), std::vector<std::string> choices) {
  Knob k;
  k.type = KnobType::kString;
  k.choices = std::move(choices);
  k.get = [at](const TrainConfig& c) { return nlohmann::json(to_string(at(c))); };
  k.field = offset_in_probe(&at(probe_config()));
  k.set = [at, parse](TrainConfig& c, const nlohmann::json& v) {
    at(c) = parse(v.get<std::string>());
  };
  k.print = [at](const TrainConfig& c) { return to_string(at(c)); };
  k.add_to = [at, parse](const Knob& row, CLI::App& cmd, TrainConfig& c, const std::string& help) {
    CLI::Option* opt = cmd.add_option_function<std::string>(
        row.flag, [&c, at, parse](const std::string& v) { at(c) = parse(v); }, help);
    if (!row.type_name.empty()) opt->type_name(row.type_name);
    return opt->check(validator_of(row));
  };
  return k;
}

}  // namespace knob_detail

/// A row for the field `m` of the section `s` of TrainConfig (e.g. &TrainConfig::aio,
/// &AioConfig::queue_depth). Integer fields take the range of their type.
template <typename S, typename T>
Knob knob_at(S TrainConfig::*s, T S::*m) {
  return knob_detail::field_row<T>([ s, m ](auto& c) -> auto& { return (c.*s).*m; });
}

/// A row for the field `m` of TrainConfig itself (&TrainConfig::log_interval).
template <typename T>
Knob knob_at(T TrainConfig::*m) {
  return knob_detail::field_row<T>([m](auto& c) -> auto& { return c.*m; });
}

CLI::Validator one_of(std::vector<std::string> values);

/// A row for the enumeration field `m` of TrainConfig (&TrainConfig::optimizer): its flag takes
/// the names `choices`, read with `parse` and written with `to_string`.
template <typename E>
Knob knob_enum(E TrainConfig::*m, E (*parse)(const std::string&),
               std::vector<std::string> choices) {
  return knob_detail::enum_row<E>(
      [m](auto& c) -> auto& { return c.*m; }, parse, std::move(choices));
}

/// A validator that accepts what `parse` accepts (any spelling it reads) and returns its
/// ConfigError's message otherwise.
CLI::Validator parsed_by(std::function<void(const std::string&)> parse);

/// Checks a flag's value that is -1 (automatic, or all) or an integer >= 1 (--max-steps,
/// --num-samples, --eval-samples): throws ConfigError "must be -1 or an integer >= 1, got 'V'".
void minus_one_or_positive(const std::string& value);

/// A row for the enumeration field `m` of the section `s` of TrainConfig
/// (&TrainConfig::pipeline, &PipelineConfig::schedule): its flag takes what `parse` reads
/// (`choices` being the names it writes).
template <typename S, typename E>
Knob knob_enum(S TrainConfig::*s, E S::*m, E (*parse)(const std::string&),
               std::vector<std::string> choices) {
  Knob k = knob_detail::enum_row<E>(
      [ s, m ](auto& c) -> auto& { return (c.*s).*m; }, parse, std::move(choices));
  k.flag_parse = [parse](const std::string& v) { parse(v); };
  return k;
}

/// A DeepSpeed key that shardtrain accepts and does not implement (KnobStatus::kIgnored), or,
/// with `status` kAlwaysOn, a switch that is always on here.
Knob ignored_key(std::string path, KnobStatus status = KnobStatus::kIgnored);

// ---- the tables -------------------------------------------------------------------------------

/// Top-level keys of the DeepSpeed JSON that are single values (knobs_sections.cpp).
const KnobTable& top_level_knobs();
/// bf16 and fp16: dynamic loss scaling (LossScaleConfig; "enabled" is the precision's).
const KnobTable& fp16_knobs();
/// zero_optimization, with offload_optimizer and offload_param (ZeroConfig; knobs_zero.cpp).
const KnobTable& zero_knobs();
/// aio: the I/O of the NVMe swap (AioConfig).
const KnobTable& aio_knobs();
/// optimizer: its type and params, Adam/AdamW's and SGD's (knobs_optimizer.cpp).
const KnobTable& optimizer_knobs();
/// scheduler: its type and the params of WarmupLR, WarmupDecayLR and WarmupCosineLR.
const KnobTable& scheduler_knobs();
/// tensorboard, csv_monitor and flops_profiler, with their flags (knobs_monitors.cpp).
const KnobTable& monitor_knobs();
/// pipeline: the pipeline's shape, schedule and partition (PipelineConfig; knobs_pipeline.cpp).
const KnobTable& pipeline_knobs();
/// activation_checkpointing: the flag, and the DeepSpeed options that turn it on.
const KnobTable& activation_checkpointing_knobs();
/// `train`'s flags without a DeepSpeed key (knobs_run.cpp): the model and where it runs
/// (--model, --strategy, --device, --precision, --offload, ...); the length of training and the
/// data (--epochs, --max-length, --dataset, --train-file, ...); the output and checkpoints
/// (--output-dir, --resume, --init-from, --deepspeed-config, ...).
const KnobTable& run_knobs();
const KnobTable& data_knobs();
const KnobTable& output_knobs();

/// The row of `table` at the JSON `path` (it must have one).
const Knob& knob_row(const KnobTable& table, const std::string& path);

/// The row of the field `m` of the section `s` (&TrainConfig::zero, &ZeroConfig::offload_ratio),
/// for messages that name the knob (its label()); the first row when several keys set it.
template <typename S, typename T>
const Knob& knob_for(S TrainConfig::*s, T S::*m) {
  return knob_detail::knob_at_offset(
      knob_detail::offset_in_probe(&((knob_detail::probe_config().*s).*m)));
}
/// The row of the field `m` of TrainConfig itself (&TrainConfig::optimizer).
template <typename T>
const Knob& knob_for(T TrainConfig::*m) {
  return knob_detail::knob_at_offset(
      knob_detail::offset_in_probe(&(knob_detail::probe_config().*m)));
}

/// knob_for(&TrainConfig::zero, m): ZeroConfig's rows, the ones messages name most.
template <typename T>
const Knob& zero_knob(T ZeroConfig::*m) {
  return knob_for(&TrainConfig::zero, m);
}

/// Every table, in the order of docs/CONFIG.md.
std::vector<const KnobTable*> all_knob_tables();

/// The rows of `table` whose path is in `section` ("zero_optimization.offload_param"): its
/// honoured and ignored keys, by their last key (aliases included); with `variant`, those of that
/// type only ("SGD" for optimizer.params).
std::vector<std::string> honoured_keys(const KnobTable& table, const std::string& section,
                                       const std::string& variant = "");
std::vector<std::string> ignored_keys(const KnobTable& table, const std::string& section,
                                      const std::string& variant = "");

// ---- who walks them -----------------------------------------------------------------------------

/// Registers the flags of the rows of `table` that have one on `surface`, bound to the fields of
/// `cfg` (which must outlive the parse). The help text is the row's doc with its default.
void add_knob_flags(CLI::App& cmd, TrainConfig& cfg, const KnobTable& table, KnobSurface surface);

/// validate()'s per-knob checks: every honoured row's value (set by a flag, the JSON or in code)
/// is in its range and among its choices. Throws ConfigError "NAME VALUE is not valid: use
/// EXPECTED" naming the row's JSON path (or flag).
void check_knob_ranges(const TrainConfig& cfg, const KnobTable& table);

/// Writes the rows that have a snapshot path into `snapshot` (run.json's config), nesting at dots.
void write_knob_snapshot(const TrainConfig& cfg, const KnobTable& table, nlohmann::json& snapshot);
/// Reads back what write_knob_snapshot() wrote: the rows whose snapshot path is present.
void read_knob_snapshot(const nlohmann::json& snapshot, const KnobTable& table, TrainConfig& cfg);

/// The Markdown tables of the DeepSpeed JSON keys of `table`, one per JSON section, as
/// docs/CONFIG.md holds them (`shardtrain config --markdown`).
std::string knob_markdown(const KnobTable& table);

// ---- flag validators (plain messages; CLI11 prefixes the flag) ----------------------------------

/// "must be an integer >= MIN, got 'S'".
CLI::Validator int_at_least(int64_t min);
/// A finite number in [lo, hi] (open ends when asked): "must be a number in [lo, hi], got 'S'".
CLI::Validator number_in(double lo, bool lo_open, double hi, bool hi_open);
/// Any finite number (CLI11 itself reads "nan" and "inf").
CLI::Validator finite_number();
/// One of `values`: "'S' is not valid: use a, b or c".
CLI::Validator one_of(std::vector<std::string> values);

namespace knob_detail {

template <typename T>
CLI::Option* add_flag(const Knob& k, CLI::App& cmd, T& field, const std::string& help) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!k.bool_flag_takes_value) return cmd.add_flag(k.flag, field, help);
  }
  CLI::Option* opt = cmd.add_option(k.flag, field, help);
  if (!k.type_name.empty()) opt->type_name(k.type_name);
  if (k.flag_check != FlagCheck::kNone) opt->check(validator_of(k));
  return opt;
}

}  // namespace knob_detail

}  // namespace shardtrain
