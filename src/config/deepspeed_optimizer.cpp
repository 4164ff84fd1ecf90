// The optimizer and scheduler sections of the DeepSpeed JSON (DeepSpeedReader,
// config/deepspeed_reader.h): DeepSpeed's Adam/AdamW and torch.optim.SGD parameters with their
// defaults, and the WarmupLR, WarmupDecayLR and WarmupCosineLR schedules (DeepSpeed's
// runtime/lr_schedules.py).
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
void DeepSpeedReader::read_sgd(const json& opt) {
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
      overridden_.push_back(fmt::format("--max-steps over {}.total_num_steps", prefix));
    } else if (cfg_.max_steps == -1) {
      cfg_.max_steps = *total;
    }
  }
}
void DeepSpeedReader::read_scheduler(const json& sched) {
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
    if (auto best = closest_match(*type, kTypes)) hint = fmt::format(": did you mean '{}'?", *best);
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
      assign("min_lr_ratio", prefix + ".cos_min_ratio", has(p, "cos_min_ratio"), cfg_.min_lr_ratio,
             *cos_min);
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
      assign("min_lr_ratio", prefix + ".warmup_min_lr", has(p, "warmup_min_lr"), cfg_.min_lr_ratio,
             *min_lr / peak);
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
}  // namespace shardtrain::deepspeed_reader
