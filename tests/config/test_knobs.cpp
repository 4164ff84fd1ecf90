// Tests of the knob tables (config/knob.h): every row's flag and DeepSpeed JSON key set the same
// field, run.json's snapshot reads back the same value, an explicit flag beats the JSON, the
// range checks name the row, and docs/CONFIG.md holds the tables the rows print.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "config/knob.h"
#include "config_test_support.h"

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

/// The flag's arguments that set `value`.
std::vector<std::string> flag_args(const Knob& k, const json& value) {
  if (k.type == KnobType::kBool && !k.bool_flag_takes_value) {
    EXPECT_TRUE(value.get<bool>()) << k.name() << ": a bare flag can only turn it on";
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

TEST_F(ConfigTest, ConfigMdHoldsTheTablesTheRowsPrint) {
  std::ifstream in(std::string(SHARDTRAIN_SOURCE_DIR) + "/docs/CONFIG.md");
  std::stringstream text;
  text << in.rdbuf();
  for (const KnobTable* table : all_knob_tables()) {
    const std::string tables = knob_markdown(*table);
    EXPECT_NE(text.str().find(tables), std::string::npos)
        << "docs/CONFIG.md does not hold these tables as `shardtrain config --markdown` prints "
           "them (paste its output over the old ones):\n"
        << tables;
  }
}

}  // namespace
}  // namespace shardtrain
