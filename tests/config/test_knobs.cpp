// Tests of the knob tables (config/knob.h): every row's flag and DeepSpeed JSON key set the same
// field, run.json's snapshot reads back the same value, an explicit flag beats the JSON, the
// range checks name the row, and docs/CONFIG.md holds the tables the rows print and lists every
// flag of `train` with its row's default.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "config/knob.h"
#include "config_test_support.h"
#include "core/strings.h"
#include "test_support.h"

namespace shardtrain {
namespace {

using nlohmann::json;

/// A valid value of `k` other than its default in `defaults`.
json other_value(const Knob& k, const TrainConfig& defaults) {
  const json d = k.get(defaults);
  switch (k.type) {
    case KnobType::kBool:
      return !d.get<bool>();
    case KnobType::kString: {
      for (const std::string& c : k.choices)
        if (c != d.get<std::string>()) return c;
      return "/tmp/knob-value";
    }
    case KnobType::kInt: {
      for (double v : {d.get<double>() + 1, d.get<double>() - 1, k.min + 1, k.min}) {
        if (k.accepts(json(static_cast<int64_t>(v))) && v != d.get<double>())
          return static_cast<int64_t>(v);
      }
      break;
    }
    case KnobType::kNumber: {
      for (double v : {d.get<double>() / 2, d.get<double>() * 2, d.get<double>() + 1, 0.5})
        if (k.accepts(json(v)) && v != d.get<double>()) return v;
      break;
    }
    case KnobType::kNone:
      break;
  }
  ADD_FAILURE() << "no other value for " << k.name();
  return d;
}

/// `value` at the dotted `path` of a JSON document.
json document(const std::string& path, const json& value) {
  json root = json::object();
  json* at = &root;
  std::stringstream parts(path);
  std::string part, next;
  std::getline(parts, part, '.');
  while (std::getline(parts, next, '.')) {
    at = &(*at)[part];
    part = next;
  }
  (*at)[part] = value;
  return root;
}

/// `value` at the row's JSON path, under a type the key exists for ("optimizer.type": "SGD"); a
/// pipeline key in a section that asks for a pipeline (DeepSpeed reads it only for one).
json row_document(const Knob& k, const std::string& path, const json& value) {
  json root = document(path, value);
  if (!k.variant_path.empty()) root.merge_patch(document(k.variant_path, k.variants.front()));
  if (k.section() == "pipeline") root.merge_patch(document("pipeline.stages", 2));
  return root;
}

/// The flag's arguments that set `value`. A bare flag turns its field on, but one that CLI11
/// reads as false: "!--no-x" (the negation of "--x") or "--no-x{false}".
std::vector<std::string> flag_args(const Knob& k, const json& value) {
  if (k.type == KnobType::kBool && !k.bool_flag_takes_value) {
    std::stringstream names(k.flag);
    for (std::string n; std::getline(names, n, ',');) {
      const bool sets_false = n.front() == '!' || n.find("{false}") != std::string::npos;
      if (sets_false != value.get<bool>())
        return {n.substr(n.find('-'), n.find('{') - n.find('-'))};
    }
    ADD_FAILURE() << k.name() << ": no bare flag sets " << value;
    return {k.name()};
  }
  return {k.name(), value.is_string() ? value.get<std::string>() : value.dump()};
}

/// The rows whose value can be set and read (honoured, with a field).
std::vector<const Knob*> settable_rows() {
  std::vector<const Knob*> out;
  for (const KnobTable* table : all_knob_tables()) {
    for (const Knob& k : *table) {
      if (k.status == KnobStatus::kHonoured && k.get && k.set) out.push_back(&k);
    }
  }
  return out;
}

TEST_F(ConfigTest, EveryRowsFlagJsonKeyAndSnapshotSetTheSameField) {
  const TrainConfig defaults;
  int flags = 0, keys = 0, snapshots = 0;
  for (const Knob* k : settable_rows()) {
    const json value = other_value(*k, defaults);
    // Via the flag.
    if (k->surfaces & kTrainFlag) {
      TrainConfig cfg;
      CLI::App app{"shardtrain train"};
      add_train_flags(app, cfg);
      std::vector<std::string> args = flag_args(*k, value);
      std::reverse(args.begin(), args.end());
      app.parse(args);
      EXPECT_EQ(k->get(cfg), value) << k->name();
      ++flags;
    }
    // Via the DeepSpeed JSON, under each spelling.
    if (!k->path.empty() && !k->read_by_hand) {
      std::vector<std::string> paths = {k->path};
      for (const std::string& a : k->aliases) paths.push_back(k->section() + "." + a);
      for (const std::string& path : paths) {
        const TrainConfig cfg = apply_json(row_document(*k, path, value).dump());
        EXPECT_EQ(k->get(cfg), value) << path;
      }
      ++keys;
    }
    // Through run.json's snapshot.
    if (!k->snapshot.empty()) {
      TrainConfig cfg;
      k->set(cfg, value);
      json snapshot = json::object();
      for (const KnobTable* table : all_knob_tables()) write_knob_snapshot(cfg, *table, snapshot);
      TrainConfig back;
      for (const KnobTable* table : all_knob_tables()) read_knob_snapshot(snapshot, *table, back);
      EXPECT_EQ(k->get(back), value) << k->snapshot;
      ++snapshots;
    }
  }
  EXPECT_GT(flags, 5);
  EXPECT_GT(keys, 15);
  EXPECT_GT(snapshots, 5);
}

TEST_F(ConfigTest, AnExplicitFlagBeatsItsJsonKey) {
  const TrainConfig defaults;
  for (const Knob* k : settable_rows()) {
    if (!(k->surfaces & kTrainFlag) || k->path.empty() || k->read_by_hand) continue;
    const json value = other_value(*k, defaults);
    TrainConfig cfg;
    std::vector<std::string> ignored, overridden;
    cfg.deepspeed_config = write("ds.json", row_document(*k, k->path, value).dump());
    apply_deepspeed_config(cfg.deepspeed_config, cfg, {k->explicit_name()}, ignored, overridden);
    EXPECT_EQ(k->get(cfg), k->get(defaults)) << k->path;
    ASSERT_EQ(overridden.size(), 1u) << k->path;
    EXPECT_EQ(overridden[0], k->name() + " over " + k->path);
  }
}

// Messages name a knob through its row, found by the field: renaming a flag or key in the row
// renames it wherever code names the knob.
TEST_F(ConfigTest, AFieldFindsItsRowForMessages) {
  EXPECT_EQ(zero_knob(&ZeroConfig::offload_ratio).label(),
            "zero_optimization.offload_optimizer.ratio (--offload-ratio)");
  EXPECT_EQ(knob_for(&TrainConfig::optimizer).name(), "--optimizer");
  EXPECT_EQ(zero_knob(&ZeroConfig::offload_param_buffer_count).label(),
            "zero_optimization.offload_param.buffer_count");
  EXPECT_EQ(knob_for(&TrainConfig::pipeline, &PipelineConfig::virtual_stages).label(),
            "pipeline.virtual_stages (--virtual-stages)");
  // Every row with a field is found by it: the first row of that field (a field that several
  // keys set, as nvme_path or lr and warmup_max_lr, is named by its first).
  const std::vector<const Knob*> rows = settable_rows();
  for (const Knob* k : rows) {
    ASSERT_GE(k->field, 0) << k->name();
    const Knob* first = *std::find_if(rows.begin(), rows.end(),
                                      [&](const Knob* r) { return r->field == k->field; });
    EXPECT_EQ(&knob_detail::knob_at_offset(k->field), first) << k->name();
  }
}

TEST_F(ConfigTest, EveryDefaultPassesTheRangeChecks) {
  const TrainConfig defaults;
  for (const KnobTable* table : all_knob_tables()) check_knob_ranges(defaults, *table);
  for (const Knob* k : settable_rows()) {
    // A flag's default is its field's default.
    if (k->type == KnobType::kBool || k->flag.empty()) continue;
    EXPECT_TRUE(k->accepts(k->get(defaults)) || k->unset_value) << k->name();
  }
}

TEST_F(ConfigTest, RangeChecksNameTheRowValueAndFix) {
  TrainConfig cfg = valid_config();
  cfg.zero.reduce_bucket_size = 0;
  EXPECT_CONTAINS(config_error([&] { validate(cfg, 1024); }),
                  "zero_optimization.reduce_bucket_size 0 is not valid: use an integer >= 1");
  cfg = valid_config();
  cfg.zero.offload_moments_dtype = "fp8";
  EXPECT_CONTAINS(
      config_error([&] { validate(cfg, 1024); }),
      "--offload-moments-dtype 'fp8' (zero_optimization.offload_optimizer.moments_dtype) "
      "is not valid: use \"fp32\" or \"bf16\"");
  cfg = valid_config();
  cfg.gradient_clipping = -1;
  EXPECT_CONTAINS(config_error([&] { validate(cfg, 1024); }),
                  "--grad-clip -1 (gradient_clipping) is not valid: use a number >= 0");
  cfg = valid_config();
  cfg.loss_scale.min_loss_scale = 0;
  EXPECT_CONTAINS(config_error([&] { validate(cfg, 1024); }),
                  "fp16.min_loss_scale 0 is not valid: use a number > 0");
  cfg = valid_config();
  cfg.zero.offload_param_max_in_cpu = -1;  // the default: all in host memory
  validate(cfg, 1024);
}

/// The text of docs/CONFIG.md.
std::string config_md() {
  std::ifstream in(std::string(SHARDTRAIN_SOURCE_DIR) + "/docs/CONFIG.md");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST_F(ConfigTest, ConfigMdHoldsTheTablesTheRowsPrint) {
  const std::string text = config_md();
  for (const KnobTable* table : all_knob_tables()) {
    const std::string tables = knob_markdown(*table);
    EXPECT_NE(text.find(tables), std::string::npos)
        << "docs/CONFIG.md does not hold these tables as `shardtrain config --markdown` prints "
           "them (paste its output over the old ones):\n"
        << tables;
  }
}

/// The cells of a Markdown table line "| a | b |" (escaped pipes kept in their cell).
std::vector<std::string> cells(const std::string& line) {
  std::vector<std::string> out;
  std::string cell;
  for (size_t i = 1; i < line.size(); ++i) {
    if (line[i] == '|' && line[i - 1] != '\\') {
      out.push_back(cell);
      cell.clear();
    } else {
      cell += line[i];
    }
  }
  for (std::string& c : out) {
    c.erase(0, c.find_first_not_of(' '));
    c.erase(c.find_last_not_of(' ') + 1);
  }
  return out;
}

/// The flags a cell names ("`--adam-beta1 X`, `--adam-beta2 X`": both).
std::vector<std::string> flags_in(const std::string& cell) {
  static const std::regex flag("`(--[a-z0-9-]+)");
  std::vector<std::string> out;
  for (auto it = std::sregex_iterator(cell.begin(), cell.end(), flag); it != std::sregex_iterator();
       ++it)
    out.push_back((*it)[1]);
  return out;
}

/// Whether the default cell `shown` ("128", "`cosine`", "-1 (all)", "off") says `k`'s default.
/// Not compared: a default in words (the row's `shows_default`, a value meaning "unset"), a key
/// read with others (`by_hand`: the ZeRO stage is the strategy's), a negated flag, a free string.
bool shows_default(const Knob& k, const std::string& shown) {
  if (!k.default_text.empty() || k.read_by_hand) return true;
  std::string token = shown;
  token.erase(std::remove(token.begin(), token.end(), '`'), token.end());
  const size_t end =
      token.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.+-_");
  token = token.substr(0, end);
  const json d = k.get(TrainConfig{});
  switch (k.type) {
    case KnobType::kInt:
    case KnobType::kNumber: {
      if (k.unset_value && d.get<double>() == *k.unset_value && token != "-1") return true;
      const std::optional<double> v = parse_finite_double(token);
      return v && std::fabs(*v - d.get<double>()) <= 1e-12 * std::fabs(d.get<double>());
    }
    case KnobType::kBool:
      if (k.flag.find('!') != std::string::npos || k.flag.find("{false}") != std::string::npos)
        return true;  // a negated flag: the cell says what happens without it
      if (k.bool_flag_takes_value) return token == (d.get<bool>() ? "true" : "false");
      return token == (d.get<bool>() ? "on" : "off");
    case KnobType::kString:
      return k.choices.empty() || token == d.get<std::string>();
    case KnobType::kNone:
      return true;
  }
  return true;
}

TEST_F(ConfigTest, ConfigMdListsEveryTrainFlagWithItsDefault) {
  const std::string text = config_md();
  const size_t begin = text.find("## Flags of `shardtrain train`");
  const size_t end = text.find("\n## ", begin + 1);
  ASSERT_NE(begin, std::string::npos);
  std::map<std::string, std::string> documented;  // flag -> its default cell
  std::stringstream lines(text.substr(begin, end - begin));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("| `--", 0) != 0) continue;
    const std::vector<std::string> c = cells(line);
    if (c.size() < 2) continue;
    const std::vector<std::string> flags = flags_in(c[0]);
    // One default per flag when the cell lists them ("0.9, 0.999"), else the one for all.
    std::vector<std::string> parts;
    std::stringstream split(c[1]);
    for (std::string p; std::getline(split, p, ',');)
      parts.push_back(p.erase(0, p.find_first_not_of(' ')));
    for (size_t i = 0; i < flags.size(); ++i)  // a flag's first row (not a later table's)
      documented.emplace(flags[i], parts.size() == flags.size() ? parts[i] : c[1]);
  }
  // train's flags as it parses them: every one documented, every documented one real.
  const test_support::CommandResult help = test_support::run_shardtrain("train --help");
  ASSERT_EQ(help.status, 0) << help.output;
  std::set<std::string> real;
  static const std::regex option("\\n  (?:-[a-z],)?(--[a-z0-9-]+)(?:,!?(--[a-z0-9-]+))?");
  for (auto it = std::sregex_iterator(help.output.begin(), help.output.end(), option);
       it != std::sregex_iterator(); ++it)
    for (size_t g = 1; g < it->size(); ++g)
      if ((*it)[g].matched) real.insert((*it)[g]);
  ASSERT_GT(real.size(), 50u) << help.output;
  for (const std::string& f : real)
    EXPECT_TRUE(f == "--help" || documented.count(f))
        << f << " (a flag of `shardtrain train`) is missing from docs/CONFIG.md's flag tables";
  for (const auto& [f, shown] : documented)
    EXPECT_TRUE(real.count(f)) << f << " is in docs/CONFIG.md's flag tables but not a train flag";
  // The default each row's flag shows is the row's.
  for (const KnobTable* table : all_knob_tables())
    for (const Knob& k : *table) {
      if (!(k.surfaces & kTrainFlag) || !k.get) continue;
      const auto it = documented.find(k.name());
      if (it == documented.end()) continue;  // reported above
      EXPECT_TRUE(shows_default(k, it->second))
          << k.name() << ": docs/CONFIG.md shows the default '" << it->second << "', the row's is "
          << k.get(TrainConfig{}).dump();
    }
}

}  // namespace
}  // namespace shardtrain
