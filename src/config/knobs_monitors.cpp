// The knobs of the monitoring sections, one row per key: tensorboard and csv_monitor
// (MonitorConfig; DeepSpeed's monitor/config.py) and flops_profiler (FlopsProfilerConfig;
// DeepSpeed's profiling/config.py).
#include "config/knob.h"

namespace shardtrain {

namespace {

template <typename T>
Knob profiler(T FlopsProfilerConfig::*m) {
  return knob_at(&TrainConfig::flops_profiler, m);
}

/// A monitor section's three keys: read together (DeepSpeedReader::read_monitor), the directory
/// being output_path/job_name when enabled.
void add_monitor_rows(KnobTable& t, const std::string& section, const std::string& flag) {
  t.push_back(Knob{}.json_key(section + ".enabled").by_hand().shows_default("false"));
  t.push_back(Knob{}
                  .json_key(section + ".output_path")
                  .by_hand()
                  .shows_default("`\"\"` (working directory)"));
  t.push_back(
      Knob{}
          .json_key(section + ".job_name")
          .by_hand()
          .shows_default("`\"DeepSpeedJobName\"`")
          .docs(fmt::format("the files go to `output_path/job_name`, unless `{}` is given", flag)));
}

}  // namespace

const KnobTable& monitor_knobs() {
  static const KnobTable rows = [] {
    KnobTable t = {
        knob_at(&TrainConfig::monitor, &MonitorConfig::tensorboard_dir)
            .train_flag("--tensorboard", "DIR")
            .a_node_path()
            .docs("write TensorBoard event files (train/loss, train/lr, train/grad_norm, "
                  "train/tokens_per_s, memory/*, val/loss, ... and the configuration as text) in "
                  "DIR; rank 0 only (DeepSpeed tensorboard.output_path/job_name; default: off)"),
        knob_at(&TrainConfig::monitor, &MonitorConfig::tensorboard_all_ranks)
            .train_flag("--tensorboard-all-ranks")
            .docs("with --tensorboard: every rank writes its own events, in DIR/rank-<r> "
                  "(default: rank 0 only, in DIR)"),
        knob_at(&TrainConfig::monitor, &MonitorConfig::csv_dir)
            .train_flag("--csv-monitor", "DIR")
            .a_node_path()
            .docs("write the TensorBoard scalars as CSV files in DIR, one per tag "
                  "(train_loss.csv: step,loss); rank 0 only (DeepSpeed "
                  "csv_monitor.output_path/job_name; default: off)"),
    };
    add_monitor_rows(t, "tensorboard", "--tensorboard");
    add_monitor_rows(t, "csv_monitor", "--csv-monitor");
    const KnobTable profiler_rows = {
        Knob{}.json_key("flops_profiler.enabled").by_hand().shows_default("false"),
        profiler(&FlopsProfilerConfig::profile_step)
            .json_key("flops_profiler.profile_step")
            .by_hand()  // applies when enabled; --profile-step also enables (read_flops_profiler)
            .train_flag("--profile-step", "N")
            .at_least(1)
            .expects("an integer >= 1 (the optimizer step to profile)")
            .docs("at optimizer step N (1-based), print the FLOPs profile: per module "
                  "(embedding, each block's attention/MLP/LayerNorms, LM head, optimizer, "
                  "gradient reduction) its parameters, analytic FLOPs, device latency, TFLOP/s "
                  "and share of the step, and the model's total and MFU; rank 0 (DeepSpeed "
                  "flops_profiler.profile_step; default: off)"),
        profiler(&FlopsProfilerConfig::module_depth)
            .json_key("flops_profiler.module_depth")
            .at_least(-1)
            .expects("an integer >= -1 (-1: every level)")
            .shows_default("-1 (every level)")
            .docs("0: the top-level rows only"),
        profiler(&FlopsProfilerConfig::top_modules)
            .json_key("flops_profiler.top_modules")
            .at_least(0)
            .expects("an integer >= 0")
            .docs("the modules of the longest latency listed after the table"),
        profiler(&FlopsProfilerConfig::detailed)
            .json_key("flops_profiler.detailed")
            .docs("attention/MLP/LayerNorm rows per block"),
        profiler(&FlopsProfilerConfig::output_file)
            .json_key("flops_profiler.output_file")
            .a_node_path()
            .expects("a file path (string) or null")
            .shows_default("`null` (the log)"),
    };
    t.insert(t.end(), profiler_rows.begin(), profiler_rows.end());
    return t;
  }();
  return rows;
}

}  // namespace shardtrain
