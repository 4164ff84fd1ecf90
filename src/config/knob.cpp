// The walkers of the knob tables (config/knob.h): flags, validate()'s range checks, run.json's
// snapshot, docs/CONFIG.md's tables; and the flag validators.
#include "config/knob.h"

#include <fmt/core.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <utility>

#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {

namespace {

using nlohmann::json;

constexpr double kInf = std::numeric_limits<double>::infinity();

/// The number `v` as a message shows it: integers without a decimal point.
std::string number_text(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e18)
    return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);
}

/// "an integer in [1, 1048576]" for an integer flag bounded on both sides.
CLI::Validator int_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        auto v = parse_int64(s);
        if (!v || *v < lo || *v > hi)
          return fmt::format("must be an integer in [{}, {}], got '{}'", lo, hi, s);
        return {};
      },
      "");
}

/// The JSON at dotted `path` of `root`, or nullptr.
const json* find_path(const json& root, const std::string& path) {
  const json* at = &root;
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? dot : dot - start);
    if (!at->is_object()) return nullptr;
    auto it = at->find(part);
    if (it == at->end()) return nullptr;
    at = &*it;
    if (dot == std::string::npos) return at;
    start = dot + 1;
  }
}

}  // namespace

// ---- Knob -----------------------------------------------------------------------------------

std::string Knob::key() const {
  const std::size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

std::string Knob::section() const {
  const std::size_t dot = path.rfind('.');
  return dot == std::string::npos ? std::string() : path.substr(0, dot);
}

std::string Knob::name() const {
  if (flag.empty()) return path;
  std::string first = flag.substr(0, flag.find(','));
  return first.substr(0, first.find('{'));  // CLI11's "--no-save{false}": the value it sets
}

std::string Knob::explicit_name() const {
  std::string n = beaten_by;
  if (n.empty() && (surfaces & kTrainFlag)) n = name();
  n.erase(0, n.find_first_not_of('-'));
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

std::string Knob::label() const {
  if (path.empty()) return name();
  if (flag.empty() || !(surfaces & kTrainFlag)) return path;
  return fmt::format("{} ({})", path, name());
}

bool Knob::in_range(double v) const {
  const bool above = min_open ? v > min : v >= min;
  const bool below = max_open ? v < max : v <= max;
  return std::isfinite(v) && above && below;
}

bool Knob::accepts(const json& v) const {
  switch (type) {
    case KnobType::kBool:
      return v.is_boolean();
    case KnobType::kInt: {
      if (!v.is_number()) return false;
      const double d = v.get<double>();
      return d == std::floor(d) && in_range(d) &&
             (multiple == 0 || static_cast<int64_t>(d) % multiple == 0);
    }
    case KnobType::kNumber:
      return v.is_number() && in_range(v.get<double>());
    case KnobType::kString:
      if (!v.is_string()) return false;
      if (flag_parse) {
        try {
          flag_parse(v.get<std::string>());
        } catch (const ConfigError&) {
          return false;
        }
        return true;
      }
      return choices.empty() ||
             std::find(choices.begin(), choices.end(), v.get<std::string>()) != choices.end();
    case KnobType::kNone:
      return true;
  }
  return false;
}

bool Knob::applies_to(const std::string& variant) const {
  return variant.empty() || variants.empty() ||
         std::find(variants.begin(), variants.end(), variant) != variants.end();
}

Knob ignored_key(std::string path, KnobStatus status) {
  Knob k;
  k.path = std::move(path);
  k.status = status;
  k.type = status == KnobStatus::kAlwaysOn ? KnobType::kBool : KnobType::kNone;
  return k;
}

// ---- tables ---------------------------------------------------------------------------------

namespace knob_detail {

const TrainConfig& probe_config() {
  static const TrainConfig c{};
  return c;
}

const Knob& knob_at_offset(std::ptrdiff_t offset) {
  for (const KnobTable* table : all_knob_tables())
    for (const Knob& k : *table)
      if (k.field == offset) return k;
  ST_ASSERT(false && "knob_for: the field has no row");
  return top_level_knobs().front();
}

}  // namespace knob_detail

std::vector<const KnobTable*> all_knob_tables() {
  return {
      &top_level_knobs(), &optimizer_knobs(), &scheduler_knobs(), &fp16_knobs(),
      &zero_knobs(),      &aio_knobs(),       &pipeline_knobs(),  &activation_checkpointing_knobs(),
      &monitor_knobs(),   &run_knobs(),       &data_knobs(),      &output_knobs()};
}

const Knob& knob_row(const KnobTable& table, const std::string& path) {
  auto it = std::find_if(table.begin(), table.end(), [&](const Knob& k) { return k.path == path; });
  ST_ASSERT(it != table.end());
  return *it;
}

namespace {

std::vector<std::string> keys_of(const KnobTable& table, const std::string& section,
                                 const std::string& variant, bool ignored) {
  std::vector<std::string> out;
  auto add = [&out](const std::string& key) {
    if (std::find(out.begin(), out.end(), key) == out.end()) out.push_back(key);
  };
  for (const Knob& k : table) {
    if (k.path.empty() || k.section() != section || !k.applies_to(variant)) continue;
    if ((k.status == KnobStatus::kIgnored) != ignored) continue;
    add(k.key());
    for (const std::string& a : k.aliases) add(a);
  }
  return out;
}

}  // namespace

std::vector<std::string> honoured_keys(const KnobTable& table, const std::string& section,
                                       const std::string& variant) {
  return keys_of(table, section, variant, false);
}

std::vector<std::string> ignored_keys(const KnobTable& table, const std::string& section,
                                      const std::string& variant) {
  return keys_of(table, section, variant, true);
}

// ---- flags ----------------------------------------------------------------------------------

void add_knob_flags(CLI::App& cmd, TrainConfig& cfg, const KnobTable& table, KnobSurface surface) {
  for (const Knob& k : table) {
    if (!(k.surfaces & surface) || !k.add_to) continue;
    std::string help = k.doc;
    if (const std::size_t at = help.find("{}"); at != std::string::npos)
      help.replace(at, 2, k.print(cfg));
    k.add_to(k, cmd, cfg, help);
  }
}

// ---- validate() -------------------------------------------------------------------------------

void check_knob_ranges(const TrainConfig& cfg, const KnobTable& table) {
  for (const Knob& k : table) {
    if (!k.get || k.status != KnobStatus::kHonoured || k.type == KnobType::kBool) continue;
    const json v = k.get(cfg);
    if (k.accepts(v)) continue;
    if (k.unset_value && v.is_number() && v.get<double>() == *k.unset_value) continue;
    const std::string value =
        v.is_string() ? fmt::format("'{}'", v.get<std::string>()) : number_text(v.get<double>());
    // "--flag V (section.key)", "section.key V", or with a noun "NOUN V (--flag / section.key)".
    const bool flag = (k.surfaces & kTrainFlag) != 0;
    const std::string label = flag || k.path.empty() ? k.name() : k.path;
    std::string what;
    if (!k.noun.empty()) {
      what = fmt::format("{} {} ({})", k.noun, value,
                         flag && !k.path.empty() ? label + " / " + k.path : label);
    } else if (flag && !k.path.empty()) {
      what = fmt::format("{} {} ({})", label, value, k.path);
    } else {
      what = fmt::format("{} {}", label, value);
    }
    throw ConfigError(fmt::format("{} is not valid: use {}", what, k.expected));
  }
}

// ---- run.json -------------------------------------------------------------------------------

namespace {

/// A snapshot path's last part "betas[1]" as ("betas", 1); without an index, index -1.
std::pair<std::string, int> indexed(const std::string& part) {
  const std::size_t open = part.find('[');
  if (open == std::string::npos || part.back() != ']') return {part, -1};
  return {part.substr(0, open), std::atoi(part.c_str() + open + 1)};
}

}  // namespace

void write_knob_snapshot(const TrainConfig& cfg, const KnobTable& table, json& snapshot) {
  for (const Knob& k : table) {
    if (k.snapshot.empty() || !k.get) continue;
    json* at = &snapshot;
    std::size_t start = 0;
    for (std::size_t dot; (dot = k.snapshot.find('.', start)) != std::string::npos;
         start = dot + 1) {
      at = &(*at)[k.snapshot.substr(start, dot - start)];
    }
    const auto [name, index] = indexed(k.snapshot.substr(start));
    json& slot = (*at)[name];
    (index < 0 ? slot : slot[static_cast<std::size_t>(index)]) = k.get(cfg);
  }
}

void read_knob_snapshot(const json& snapshot, const KnobTable& table, TrainConfig& cfg) {
  for (const Knob& k : table) {
    if (k.snapshot.empty() || !k.set) continue;
    const auto [path, index] = indexed(k.snapshot);
    const json* v = find_path(snapshot, path);
    if (v != nullptr && index >= 0)
      v = v->is_array() && static_cast<std::size_t>(index) < v->size() ? &(*v)[index] : nullptr;
    if (v != nullptr) k.set(cfg, *v);
  }
}

// ---- docs/CONFIG.md -----------------------------------------------------------------------------

namespace {

std::string default_of(const Knob& k, const TrainConfig& defaults) {
  if (!k.default_text.empty()) return k.default_text;
  if (!k.get) return "";
  const json v = k.json_default ? *k.json_default : k.get(defaults);
  if (v.is_string()) return v.get<std::string>().empty() ? "none" : "`" + v.dump() + "`";
  if (v.is_number_integer() && std::llabs(v.get<long long>()) >= 10'000)
    return with_commas(v.get<long long>());
  return v.dump();
}

/// " (Adam, AdamW)": the types a key exists for.
std::string variants_of(const Knob& k) {
  return k.variants.empty() ? std::string() : " (" + join(k.variants, ", ") + ")";
}

std::string status_of(const Knob& k) {
  switch (k.status) {
    case KnobStatus::kHonoured:
      return "supported" + variants_of(k);
    case KnobStatus::kIgnored:
      return "ignored" + variants_of(k);
    case KnobStatus::kAlwaysOn:
      return "`true` accepted (always so); `false` ignored with a warning";
  }
  return "";
}

/// The row's note: its doc with the default filled in, or the flag's name.
std::string note_of(const Knob& k, const TrainConfig& defaults) {
  std::string note = k.doc;
  if (const std::size_t at = note.find("{}"); at != std::string::npos)
    note.replace(at, 2, k.print ? k.print(defaults) : "");
  for (std::size_t at = 0; (at = note.find('|', at)) != std::string::npos; at += 2)
    note.insert(at, "\\");  // a table cell
  std::string flag;
  if (k.surfaces & kTrainFlag) flag = "`" + k.name() + "`";
  if (flag.empty()) return note;
  return note.empty() ? flag : flag + "; " + note;
}

}  // namespace

std::string knob_markdown(const KnobTable& table) {
  const TrainConfig defaults;
  std::vector<std::string> sections;
  for (const Knob& k : table) {
    if (!k.path.empty() &&
        std::find(sections.begin(), sections.end(), k.section()) == sections.end())
      sections.push_back(k.section());
  }
  std::string out;
  for (const std::string& section : sections) {
    out += fmt::format("{}:\n\n| key | status | default | notes |\n|---|---|---|---|\n",
                       section.empty() ? std::string("Top-level values") : "`" + section + "`");
    // The ignored keys, one line per set of types they exist for.
    std::vector<std::pair<std::string, std::vector<std::string>>> ignored;
    for (const Knob& k : table) {
      if (k.path.empty() || k.section() != section) continue;
      std::string keys = "`" + k.key() + "`";
      if (k.status == KnobStatus::kIgnored) {
        for (const std::string& a : k.aliases) keys += " / `" + a + "`";
        const std::string status = status_of(k);
        auto line = std::find_if(ignored.begin(), ignored.end(),
                                 [&](const auto& l) { return l.first == status; });
        if (line == ignored.end()) line = ignored.insert(ignored.end(), {status, {}});
        line->second.push_back(keys);
        continue;
      }
      if (!k.aliases.empty()) {
        std::vector<std::string> quoted;
        for (const std::string& a : k.aliases) quoted.push_back("`" + a + "`");
        keys += " (or " + join(quoted, ", ") + ")";
      }
      out += fmt::format("| {} | {} | {} | {} |\n", keys, status_of(k), default_of(k, defaults),
                         note_of(k, defaults));
    }
    for (const auto& [status, keys] : ignored)
      out += fmt::format("| {} | {} | | |\n", join(keys, ", "), status);
    out += "\n";
  }
  return out;
}

// ---- flag validators ----------------------------------------------------------------------------

void minus_one_or_positive(const std::string& value) {
  const std::optional<int64_t> v = parse_int64(value);
  check<ConfigError>(v && (*v == -1 || *v >= 1), "must be -1 or an integer >= 1, got '{}'", value);
}

CLI::Validator parsed_by(std::function<void(const std::string&)> parse) {
  return CLI::Validator(
      [parse](std::string& s) -> std::string {
        try {
          parse(s);
        } catch (const ConfigError& e) {
          return e.what();
        }
        return {};
      },
      "");
}

CLI::Validator int_at_least(int64_t min) {
  return CLI::Validator(
      [min](std::string& s) -> std::string {
        auto v = parse_int64(s);
        if (!v || *v < min) return fmt::format("must be an integer >= {}, got '{}'", min, s);
        return {};
      },
      "");
}

CLI::Validator number_in(double lo, bool lo_open, double hi, bool hi_open) {
  std::string range;
  if (hi == kInf) {
    range = fmt::format("a number {} {}", lo_open ? ">" : ">=", lo);
  } else {
    range = fmt::format("a number in {}{}, {}{}", lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]");
  }
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        auto v = parse_finite_double(s);
        const bool ok = v && (lo_open ? *v > lo : *v >= lo) && (hi_open ? *v < hi : *v <= hi);
        if (!ok) return fmt::format("must be {}, got '{}'", range, s);
        return {};
      },
      "");
}

CLI::Validator finite_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (!parse_finite_double(s)) return fmt::format("must be a finite number, got '{}'", s);
        return {};
      },
      "");
}

CLI::Validator one_of(std::vector<std::string> values) {
  return CLI::Validator(
      [values](std::string& s) -> std::string {
        if (std::find(values.begin(), values.end(), s) != values.end()) return {};
        std::string list;
        for (std::size_t i = 0; i < values.size(); ++i) {
          list += (i == 0 ? "" : (i + 1 == values.size() ? " or " : ", ")) + values[i];
        }
        return fmt::format("'{}' is not valid: use {}", s, list);
      },
      "");
}

namespace knob_detail {

CLI::Validator validator_of(const Knob& k) {
  if (k.flag_parse) return parsed_by(k.flag_parse);
  if (!k.choices.empty()) return one_of(k.choices);
  if (k.type == KnobType::kBool) return one_of({"true", "false", "on", "off", "1", "0"});
  if (k.flag_check == FlagCheck::kFinite) return finite_number();
  if (k.type == KnobType::kInt) {
    auto lo = static_cast<int64_t>(k.min_open ? k.min + 1 : k.min);
    // A flag takes the value that means "unset" (--warmup-steps -1).
    if (k.unset_value && *k.unset_value < static_cast<double>(lo))
      lo = static_cast<int64_t>(*k.unset_value);
    if (k.max >= 9.0e18) return int_at_least(lo);
    return int_in(lo, static_cast<int64_t>(k.max_open ? k.max - 1 : k.max));
  }
  if (k.type == KnobType::kNumber) return number_in(k.min, k.min_open, k.max, k.max_open);
  return CLI::Validator([](std::string&) { return std::string(); }, "");
}

}  // namespace knob_detail

}  // namespace shardtrain
