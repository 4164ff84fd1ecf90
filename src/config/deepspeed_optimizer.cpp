// The optimizer and scheduler sections of the DeepSpeed JSON (DeepSpeedReader,
// config/deepspeed_reader.h): their keys are the rows of config/knobs_optimizer.cpp, applied by
// read_rows with DeepSpeed's defaults; here the type, which picks the keys, and the keys whose
// value decides more than their field (betas, the switches with one setting, warmup_min_lr,
// total_num_steps, warmup_type).
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "config/deepspeed_reader.h"
#include "core/error.h"
#include "core/strings.h"

namespace shardtrain::deepspeed_reader {

void DeepSpeedReader::read_optimizer(const json& opt) {
  if (!opt.is_object()) {
    bad_value("optimizer", opt, "an object {\"type\": \"AdamW\", \"params\": {...}}");
  }
  check_rows(opt, "optimizer", optimizer_knobs());
  std::string type = "AdamW";
  if (auto t = get_string(opt, "type", "optimizer", "an optimizer name such as \"AdamW\"")) {
    type = *t;
  }
  const std::string lower_type = lowercase(type);
  const bool sgd = lower_type == "sgd";
  if (!sgd && lower_type != "adam" && lower_type != "adamw") {
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
  const std::string variant = sgd ? "SGD" : lower_type == "adam" ? "Adam" : "AdamW";
  const json* params =
      find_object(opt, "params", "optimizer",
                  sgd ? "an object of SGD parameters" : "an object of Adam parameters");
  const json empty = json::object();
  const json& p = params != nullptr ? *params : empty;
  const std::string prefix = "optimizer.params";
  check_rows(p, prefix, optimizer_knobs(), variant);
  assign("optimizer", "optimizer.type", true, cfg_.optimizer,
         sgd ? OptimizerKind::kSGD : OptimizerKind::kAdamW);
  // Parameters the section omits take DeepSpeed's (FusedAdam's; SGD: PyTorch's) defaults.
  read_rows(p, prefix, optimizer_knobs(), variant);
  if (sgd) {
    read_sgd(p);
  } else {
    read_adam(p, lower_type == "adam");
  }
}
void DeepSpeedReader::read_adam(const json& p, bool adam) {
  const std::string prefix = "optimizer.params";
  const bool given = has(p, "betas");
  const json* betas =
      given ? find(p, "betas") : &*knob_row(optimizer_knobs(), prefix + ".betas").json_default;
  if (betas != nullptr) {
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
    assign("adam_beta1", prefix + ".betas[0]", given, cfg_.beta1, (*betas)[0].get<double>());
    assign("adam_beta2", prefix + ".betas[1]", given, cfg_.beta2, (*betas)[1].get<double>());
  }
  // DeepSpeed runs "Adam" as AdamW (decoupled weight decay) unless adam_w_mode is false.
  if (auto w_mode = get_bool(p, "adam_w_mode", prefix)) {
    if (!*w_mode && adam && cfg_.weight_decay > 0.0) {
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
void DeepSpeedReader::read_sgd(const json& p) {
  const std::string prefix = "optimizer.params";
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
void DeepSpeedReader::read_warmup_type(const json& p, const std::string& prefix) {
  if (auto t = get_string(p, "warmup_type", prefix, "\"linear\" or \"log\"")) {
    if (*t == "log") {
      ignored_.push_back(prefix + ".warmup_type");  // shardtrain warms up linearly
    } else if (*t != "linear") {
      bad_value(prefix + ".warmup_type", p.at("warmup_type"), "\"linear\" or \"log\"");
    }
  }
}
void DeepSpeedReader::read_total_steps(const json& p, const std::string& prefix) {
  if (auto total = get_int(p, "total_num_steps", prefix, 1,
                           "an integer >= 1 (optimizer steps) or \"auto\"")) {
    if (is_explicit("max_steps")) {
      overridden_.push_back(fmt::format("{} over {}.total_num_steps",
                                        knob_for(&TrainConfig::max_steps).name(), prefix));
    } else if (cfg_.max_steps == -1) {
      cfg_.max_steps = *total;
    }
  }
}
void DeepSpeedReader::read_warmup_min_lr(const json& p, const std::string& prefix, bool decay) {
  const Knob& row = knob_row(scheduler_knobs(), prefix + ".warmup_min_lr");
  const bool given = has(p, "warmup_min_lr");
  auto min_lr =
      given ? get_number(p, "warmup_min_lr", prefix, 0.0, false, "a learning rate >= 0 or \"auto\"")
            : std::optional<double>(row.json_default->get<double>());
  if (!min_lr) return;
  const auto max_lr = number_or_default(p, scheduler_knobs(), prefix + ".warmup_max_lr");
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
    assign("min_lr_ratio", prefix + ".warmup_min_lr", given, cfg_.min_lr_ratio, *min_lr / peak);
  }
}
void DeepSpeedReader::read_scheduler(const json& sched) {
  if (!sched.is_object()) {
    bad_value("scheduler", sched, "an object {\"type\": \"WarmupCosineLR\", \"params\": {...}}");
  }
  check_rows(sched, "scheduler", scheduler_knobs());
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
    if (auto best = closest_match(*type, kTypes)) hint = fmt::format(": did you mean '{}'?", *best);
    fail(
        fmt::format("\"scheduler.type\": \"{}\" is not a DeepSpeed scheduler{}; shardtrain "
                    "supports WarmupLR, WarmupDecayLR and WarmupCosineLR",
                    *type, hint));
  }
  const json empty = json::object();
  const json& p = params != nullptr ? *params : empty;
  const std::string prefix = "scheduler.params";
  check_rows(p, prefix, scheduler_knobs(), *type);
  const LrSchedule schedule = *type == "WarmupCosineLR"  ? LrSchedule::kCosine
                              : *type == "WarmupDecayLR" ? LrSchedule::kLinear
                                                         : LrSchedule::kConstant;
  assign("lr_schedule", "scheduler.type", true, cfg_.lr_schedule, schedule);
  read_total_steps(p, prefix);  // (a key of WarmupDecayLR and WarmupCosineLR: check_rows)
  // WarmupLR and WarmupDecayLR: warmup_max_lr overrides the optimizer's lr, as in DeepSpeed.
  read_rows(p, prefix, scheduler_knobs(), *type);
  if (knob_row(scheduler_knobs(), prefix + ".warmup_min_lr").applies_to(*type))
    read_warmup_min_lr(p, prefix, schedule == LrSchedule::kLinear);
  read_warmup_type(p, prefix);
}
}  // namespace shardtrain::deepspeed_reader
