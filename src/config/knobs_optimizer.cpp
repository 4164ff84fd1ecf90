// The optimizer and scheduler knobs, one row per key: DeepSpeed's optimizer section (Adam/AdamW,
// whose defaults are FusedAdam's, and torch.optim.SGD's arguments) and its scheduler section
// (WarmupLR, WarmupDecayLR, WarmupCosineLR: deepspeed/runtime/lr_schedules.py). A present
// section's omitted parameters take DeepSpeed's defaults (deepspeed_default), not the flags'.
#include "config/knob.h"

namespace shardtrain {

namespace {

constexpr const char* kOptimizerType = "optimizer.type";
constexpr const char* kSchedulerType = "scheduler.type";

// (Lists made where they are used: the tables may be built during another file's static
// initialisation, before this file's.)

}  // namespace

const KnobTable& optimizer_knobs() {
  static const KnobTable rows = [] {
    const std::vector<std::string> kAdam = {"Adam", "AdamW"};
    const std::vector<std::string> kAnyOptimizer = {"Adam", "AdamW", "SGD"};
    const std::vector<std::string> kSgd = {"SGD"};
    KnobTable t = {
        // ---- optimizer ----
        knob_enum(&TrainConfig::optimizer, parse_optimizer, {"adamw", "sgd"})
            .json_key(kOptimizerType)
            .by_hand()  // picks the params' keys (read_optimizer)
            .train_flag("--optimizer", "NAME")
            .in_snapshot("optimizer")
            .shows_default("`\"AdamW\"`")
            .docs("adamw (AdamW) or sgd (torch.optim.SGD: --momentum, --nesterov, L2 weight "
                  "decay) (default: {})"),
        Knob{}.json_key("optimizer.params").by_hand().shows_default("`{}`"),
        ignored_key("optimizer.legacy_fusion"),
        // ---- optimizer.params ----
        knob_at(&TrainConfig::lr)
            .json_key("optimizer.params.lr")
            .only_with(kOptimizerType, kAnyOptimizer)
            .train_flag("--lr", "LR")
            .at_least(0, /*open=*/true)
            .deepspeed_default(1e-3)
            .or_auto()
            .in_snapshot("lr")
            .expects("a learning rate > 0 (e.g. 6e-4)")
            .shows_default("1e-3")
            .docs("peak learning rate of the optimizer (default: {})"),
        knob_at(&TrainConfig::weight_decay)
            .json_key("optimizer.params.weight_decay")
            .only_with(kOptimizerType, kAnyOptimizer)
            .train_flag("--weight-decay", "X")
            .at_least(0)
            .deepspeed_default(0.0)
            .or_auto()
            .in_snapshot("weight_decay")
            .expects("a number >= 0 (0 = no weight decay)")
            .shows_default("0")
            .docs("weight decay of the 2-D weights: AdamW's decoupled decay, SGD's L2 term added "
                  "to the gradient; 0 = off (default: {})"),
        knob_at(&TrainConfig::momentum)
            .json_key("optimizer.params.momentum")
            .only_with(kOptimizerType, kSgd)
            .train_flag("--momentum", "X")
            .at_least(0)
            .at_most(1, /*open=*/true)
            .deepspeed_default(0.0)
            .or_auto()
            .in_snapshot("momentum")
            .expects("a number in [0, 1) (e.g. 0.9)")
            .shows_default("0")
            .docs("SGD momentum, in [0, 1); 0 = plain SGD (default: {}, as PyTorch)"),
        knob_at(&TrainConfig::nesterov)
            .json_key("optimizer.params.nesterov")
            .only_with(kOptimizerType, kSgd)
            .train_flag("--nesterov")
            .deepspeed_default(false)
            .in_snapshot("nesterov")
            .docs("SGD with Nesterov momentum (torch.optim.SGD nesterov=True); needs --momentum > "
                  "0"),
        Knob{}
            .json_key("optimizer.params.betas")
            .only_with(kOptimizerType, kAdam)
            .by_hand()  // an array of the two rows below
            .deepspeed_default(nlohmann::json::array({0.9, 0.999}))
            .shows_default("[0.9, 0.999]")
            .docs("[beta1, beta2], each in [0, 1): `--adam-beta1`, `--adam-beta2`"),
        knob_at(&TrainConfig::beta1)
            .train_flag("--adam-beta1", "X")
            .at_least(0)
            .at_most(1, /*open=*/true)
            .in_snapshot("betas[0]")
            .expects("a number in [0, 1) (typically 0.9)")
            .docs("AdamW beta1, in [0, 1) (default: {})"),
        knob_at(&TrainConfig::beta2)
            .train_flag("--adam-beta2", "X")
            .at_least(0)
            .at_most(1, /*open=*/true)
            .in_snapshot("betas[1]")
            .expects("a number in [0, 1) (typically 0.999 or 0.95)")
            .docs("AdamW beta2, in [0, 1) (default: {})"),
        knob_at(&TrainConfig::adam_eps)
            .json_key("optimizer.params.eps")
            .only_with(kOptimizerType, kAdam)
            .train_flag("--adam-eps", "X")
            .at_least(0, /*open=*/true)
            .deepspeed_default(1e-8)
            .or_auto()
            .in_snapshot("eps")
            .expects("a number > 0 (e.g. 1e-8)")
            .shows_default("1e-8")
            .docs("AdamW epsilon, > 0 (default: {})"),
        Knob{}
            .json_key("optimizer.params.adam_w_mode")
            .only_with(kOptimizerType, kAdam)
            .by_hand()
            .shows_default("true")
            .docs("`false` with `weight_decay` > 0 on `Adam` is an error (Adam with L2 "
                  "regularisation is not implemented)"),
        Knob{}
            .json_key("optimizer.params.amsgrad")
            .only_with(kOptimizerType, kAdam)
            .by_hand()
            .shows_default("false")
            .docs("`true` is an error"),
        Knob{}
            .json_key("optimizer.params.bias_correction")
            .only_with(kOptimizerType, kAdam)
            .by_hand()
            .shows_default("true")
            .docs("`false` is an error (Adam always bias-corrects)"),
        Knob{}
            .json_key("optimizer.params.dampening")
            .only_with(kOptimizerType, kSgd)
            .by_hand()
            .shows_default("0")
            .docs("other values than 0 are errors"),
        Knob{}
            .json_key("optimizer.params.maximize")
            .only_with(kOptimizerType, kSgd)
            .by_hand()
            .shows_default("false")
            .docs("`true` is an error"),
    };
    for (const char* key : {"torch_adam", "set_grad_none", "fp32_optimizer_states", "max_grad_norm",
                            "fused", "foreach", "capturable", "differentiable"})
      t.push_back(
          ignored_key(std::string("optimizer.params.") + key).only_with(kOptimizerType, kAdam));
    for (const char* key : {"foreach", "differentiable", "fused"})
      t.push_back(
          ignored_key(std::string("optimizer.params.") + key).only_with(kOptimizerType, kSgd));
    return t;
  }();
  return rows;
}

const KnobTable& scheduler_knobs() {
  static const KnobTable rows = [] {
    const std::vector<std::string> kWarmupLr = {"WarmupLR", "WarmupDecayLR"};
    const std::vector<std::string> kTotalSteps = {"WarmupDecayLR", "WarmupCosineLR"};
    const std::vector<std::string> kCosine = {"WarmupCosineLR"};
    const std::vector<std::string> kAnySchedule = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"};
    return KnobTable{
        knob_at(&TrainConfig::warmup_steps)
            .json_key("scheduler.params.warmup_num_steps")
            .only_with(kSchedulerType, kAnySchedule)
            .train_flag("--warmup-steps", "N")
            .at_least(0)
            .unset_is(-1)  // the flag's: 10% of the steps, at most 1000
            .deepspeed_default(1000)
            .or_auto()
            .in_snapshot("warmup_steps")
            .expects("an integer >= 0")
            .docs("optimizer steps of linear warmup; -1 = 10% of the total steps, at most 1000 "
                  "(default: {})"),
        knob_enum(&TrainConfig::lr_schedule, parse_lr_schedule, {"constant", "linear", "cosine"})
            .json_key(kSchedulerType)
            .by_hand()  // picks the params' keys (read_scheduler)
            .train_flag("--lr-schedule", "SCHEDULE")
            .in_snapshot("lr_schedule")
            .shows_default("none: cosine with the flags' warmup")
            .docs("constant|linear|cosine decay after warmup (default: {})"),
        knob_at(&TrainConfig::min_lr_ratio)
            .json_key("scheduler.params.cos_min_ratio")
            .only_with(kSchedulerType, kCosine)
            .train_flag("--min-lr-ratio", "X")
            .at_least(0)
            .at_most(1)
            .deepspeed_default(0.0001)
            .in_snapshot("min_lr_ratio")
            .expects("a number in [0, 1] (fraction of the optimizer's lr)")
            .docs("final learning rate of linear/cosine decay as a fraction of --lr, in [0, 1] "
                  "(default: {})"),
        knob_at(&TrainConfig::lr)
            .json_key("scheduler.params.warmup_max_lr")
            .only_with(kSchedulerType, kWarmupLr)
            .overridden_by("--lr")
            .at_least(0, /*open=*/true)
            .deepspeed_default(0.001)
            .or_auto()
            .expects("a learning rate > 0")
            .docs("`--lr`: replaces `optimizer.params.lr`, as in DeepSpeed"),
        Knob{}
            .json_key("scheduler.params.warmup_min_lr")
            .only_with(kSchedulerType, kWarmupLr)
            .by_hand()  // a fraction of warmup_max_lr
            .deepspeed_default(0.0)
            .shows_default("0")
            .docs("the warmup's start; WarmupDecayLR: also the decay's floor (`--min-lr-ratio` = "
                  "min / max); above `warmup_max_lr` an error"),
        knob_at(&TrainConfig::warmup_min_ratio)
            .json_key("scheduler.params.warmup_min_ratio")
            .only_with(kSchedulerType, kCosine)
            .at_least(0)
            .at_most(1)
            .deepspeed_default(0.0)
            .expects("a number in [0, 1] (fraction of the optimizer's lr)")
            .shows_default("0")
            .docs("the warmup starts at ratio × lr"),
        Knob{}
            .json_key("scheduler.params.total_num_steps")
            .only_with(kSchedulerType, kTotalSteps)
            .by_hand()  // --max-steps, when that is not given
            .shows_default("none")
            .docs("`--max-steps` when `--max-steps` is not given"),
        Knob{}
            .json_key("scheduler.params.warmup_type")
            .only_with(kSchedulerType, kAnySchedule)
            .by_hand()
            .shows_default("`\"linear\"`")
            .docs(
                "`\"log\"` is ignored with a warning (shardtrain warms up linearly); other values "
                "than `linear` and `log` are errors"),
        ignored_key("scheduler.params.last_batch_iteration"),
        Knob{}.json_key("scheduler.params").by_hand().shows_default("`{}`"),
    };
  }();
  return rows;
}

}  // namespace shardtrain
