#include "train/report.h"

#include <fmt/core.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "config/config.h"
#include "core/error.h"
#include "core/json_input.h"
#include "io/atomic_file.h"
#include "model/gpt2_config.h"
#include "monitor/plot.h"
#include "parallel/memory_estimator.h"

namespace shardtrain {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

double num(const json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : NAN;
}

/// JSON number, or null for NaN / infinity (JSON has neither).
json jnum(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

std::string fixed(double v, const char* fmt_spec) {
  return std::isfinite(v) ? fmt::format(fmt::runtime(fmt_spec), v) : "n/a";
}

std::string mib(double bytes) {
  return std::isfinite(bytes) ? fmt::format("{:.0f}", bytes / (1024.0 * 1024.0)) : "n/a";
}

/// The dp run `r` is measured against: same model, micro-batch, ranks and device.
const RunRecord* dp_peer(const std::vector<RunRecord>& runs, const RunRecord& r) {
  for (const RunRecord& o : runs)
    if (o.ok && o.strategy == "dp" && o.model == r.model && o.micro_batch == r.micro_batch &&
        o.world_size == r.world_size && o.device == r.device && o.max_length == r.max_length)
      return &o;
  return nullptr;
}

}  // namespace

RunRecord read_run(const fs::path& dir) {
  RunRecord r;
  r.dir = dir;
  r.label = dir.filename().string();
  if (std::ifstream in(dir / "run.json"); in) {
    try {
      std::ostringstream text;
      text << in.rdbuf();
      JsonInputResult parsed = parse_json_input(text.str());
      if (!parsed.error.empty()) throw std::runtime_error(parsed.error);
      const json j = std::move(parsed.value);
      r.model = j.value("model", "");
      r.strategy = j.value("strategy", "");
      r.device = j.value("device", "");
      r.backend = j.value("backend", "");
      r.world_size = j.value("world_size", 1);
      r.micro_batch = j.value("micro_batch_size", int64_t{0});
      r.global_batch = j.value("global_batch", int64_t{0});
      r.max_length = j.value("max_length", int64_t{0});
      r.parameters = j.value("parameters", int64_t{0});
      r.on_gpu = j.value("on_gpu", false);
      if (j.value("optimizer", std::string("adamw")) == "sgd") r.optimizer = OptimizerKind::kSGD;
      if (r.on_gpu)
        r.device = "cuda";
      else if (r.device == "auto")
        r.device = "cpu";
      const double flops = num(j, "flops_per_token"), peak = num(j, "peak_tflops");
      r.mfu = flops / (peak * 1e12 * r.world_size);  // × tokens/s below
    } catch (const std::exception& e) {              // not JSON, or a key of another type
      r.ok = false;
      r.failure = fmt::format("{} is not valid: {}", (dir / "run.json").string(), e.what());
    }
  }
  std::ifstream in(dir / "metrics.jsonl");
  if (!in) {
    r.ok = false;
    if (r.failure.empty()) r.failure = fmt::format("no {}", (dir / "metrics.jsonl").string());
    r.mfu = NAN;
    return r;
  }
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    json rec;
    try {
      rec = json::parse(line);
    } catch (const json::exception&) {
      continue;  // a line cut short by a crash
    }
    if (rec.contains("event") && rec["event"] == "done") {
      r.final_loss = num(rec, "final_loss");
    } else if (rec.contains("val_loss")) {
      r.val_loss = num(rec, "val_loss");
      r.val_ppl = num(rec, "val_ppl");
    } else if (rec.contains("peak_memory_bytes")) {
      ++r.epochs;
      r.epoch_time_s = num(rec, "time_s");
      r.samples_per_s = num(rec, "samples_per_s");
      r.tokens_per_s = num(rec, "tokens_per_s");
      double peak = num(rec, "peak_memory_bytes");
      if (rec.contains("peak_memory_bytes_per_rank"))
        for (const auto& p : rec["peak_memory_bytes_per_rank"])
          if (p.is_number()) peak = std::max(peak, p.get<double>());
      r.peak_memory_bytes =
          std::isfinite(r.peak_memory_bytes) ? std::max(r.peak_memory_bytes, peak) : peak;
      const double host = num(rec, "peak_rss_bytes");
      r.host_peak_bytes =
          std::isfinite(r.host_peak_bytes) ? std::max(r.host_peak_bytes, host) : host;
    } else if (rec.contains("loss") && rec.contains("step")) {
      r.losses.emplace_back(rec["step"].get<int64_t>(), rec["loss"].get<double>());
    }
  }
  r.mfu = r.on_gpu ? r.mfu * r.tokens_per_s : NAN;
  if (!std::isfinite(r.final_loss) && !r.losses.empty()) r.final_loss = r.losses.back().second;
  if (r.epochs == 0 && r.ok) {
    r.ok = false;
    r.failure = "metrics.jsonl has no epoch record: the run did not finish an epoch";
  }
  return r;
}

std::optional<MemoryBreakdown> estimate_for(const RunRecord& run) {
  if (run.model.empty() || run.micro_batch < 1 || run.max_length < 1) return std::nullopt;
  StrategyKind kind;
  try {
    kind = parse_strategy(run.strategy);
  } catch (const Error&) {
    return std::nullopt;
  }
  if (kind == StrategyKind::kPipeline) return std::nullopt;
  MemoryEstimateOptions o;
  try {
    o.model = resolve_model(run.model);
  } catch (const Error&) {
    return std::nullopt;
  }
  o.gpus = std::max(1, run.world_size);
  o.micro_batch = run.micro_batch;
  o.max_length = run.max_length;
  o.optimizer = run.optimizer;
  const MemoryEstimate e = estimate_memory(o);
  const std::string want = kind == StrategyKind::kOffload    ? "offload"
                           : kind == StrategyKind::kInfinity ? "infinity"
                                                             : "";
  for (const StrategyEstimate& s : e.strategies) {
    if (!s.available || (want.empty() ? (s.strategy != kind || !s.name.empty()) : s.name != want))
      continue;
    // The model states split as the ZeRO paper counts them (bf16 parameters and gradients,
    // K bytes of fp32 optimizer state per parameter), each replicated or divided over N.
    const double psi = static_cast<double>(e.parameters), n = o.gpus;
    MemoryBreakdown b;
    switch (kind) {
      case StrategyKind::kDataParallel:
      case StrategyKind::kZero1:
        b.parameters = 2 * psi;
        b.gradients = 2 * psi;
        break;
      case StrategyKind::kZero2:
      case StrategyKind::kOffload:
        b.parameters = 2 * psi;
        b.gradients = 2 * psi / n;
        break;
      case StrategyKind::kZero3:
        b.parameters = 2 * psi / n;
        b.gradients = 2 * psi / n;
        break;
      default:  // infinity: parameters on the host, the gradient shard on the GPU
        b.gradients = 2 * psi / n;
        break;
    }
    b.optimizer = std::max(0.0, s.model_states - b.parameters - b.gradients);
    b.activations = s.activations;
    b.buffers = s.buffers;
    return b;
  }
  return std::nullopt;
}

void complete_runs(std::vector<RunRecord>& runs) {
  std::set<std::string> models, batches, ranks, devices;
  for (const RunRecord& r : runs) {
    if (r.strategy.empty()) continue;  // no run.json: nothing to tell it apart by
    models.insert(r.model);
    batches.insert(std::to_string(r.micro_batch));
    ranks.insert(std::to_string(r.world_size));
    devices.insert(r.device);
  }
  for (RunRecord& r : runs) {
    r.estimate = estimate_for(r);
    if (!r.strategy.empty()) {
      r.label = r.strategy;
      if (models.size() > 1) r.label += " " + fs::path(r.model).filename().string();
      if (batches.size() > 1) r.label += fmt::format(" b{}", r.micro_batch);
      if (ranks.size() > 1) r.label += fmt::format(" x{}", r.world_size);
      if (devices.size() > 1) r.label += " " + r.device;
    }
  }
  for (RunRecord& r : runs) {
    const RunRecord* dp = r.ok ? dp_peer(runs, r) : nullptr;
    r.speed_vs_dp = dp ? r.tokens_per_s / dp->tokens_per_s : NAN;
    r.memory_vs_dp = dp ? r.peak_memory_bytes / dp->peak_memory_bytes : NAN;
  }
}

json report_json(const std::vector<RunRecord>& runs) {
  json out = {{"generated_by", "shardtrain " SHARDTRAIN_VERSION}, {"runs", json::array()}};
  for (const RunRecord& r : runs) {
    json j = {{"label", r.label},
              {"dir", r.dir.string()},
              {"command", r.command},
              {"status", r.ok ? "ok" : "failed"},
              {"model", r.model},
              {"strategy", r.strategy},
              {"device", r.device},
              {"backend", r.backend},
              {"world_size", r.world_size},
              {"micro_batch_size", r.micro_batch},
              {"global_batch", r.global_batch},
              {"max_length", r.max_length},
              {"parameters", r.parameters},
              {"epochs", r.epochs},
              {"samples_per_epoch", jnum(samples_last_epoch(r))},
              {"time_per_epoch_s", jnum(r.epoch_time_s)},
              {"samples_per_s", jnum(r.samples_per_s)},
              {"tokens_per_s", jnum(r.tokens_per_s)},
              {"mfu", jnum(r.mfu)},
              {"peak_memory_bytes", jnum(r.peak_memory_bytes)},
              {"host_peak_bytes", jnum(r.host_peak_bytes)},
              {"final_loss", jnum(r.final_loss)},
              {"val_loss", jnum(r.val_loss)},
              {"val_ppl", jnum(r.val_ppl)},
              {"speed_vs_dp", jnum(r.speed_vs_dp)},
              {"memory_vs_dp", jnum(r.memory_vs_dp)}};
    if (!r.ok) j["failure"] = r.failure;
    json steps = json::array(), losses = json::array();
    for (const auto& [s, l] : r.losses) {
      steps.push_back(s);
      losses.push_back(jnum(l));
    }
    j["loss_curve"] = {{"step", steps}, {"loss", losses}};
    if (r.estimate) {
      const MemoryBreakdown& b = *r.estimate;
      j["estimate"] = {{"total_bytes", b.total()},           {"parameters_bytes", b.parameters},
                       {"gradients_bytes", b.gradients},     {"optimizer_bytes", b.optimizer},
                       {"activations_bytes", b.activations}, {"buffers_bytes", b.buffers}};
    } else {
      j["estimate"] = nullptr;
    }
    out["runs"].push_back(j);
  }
  return out;
}

std::string report_markdown(const std::vector<RunRecord>& runs,
                            const std::vector<std::string>& pictures) {
  bool any_gpu = false;
  for (const RunRecord& r : runs) any_gpu = any_gpu || r.on_gpu;
  std::string md = "# Strategy comparison\n\n";
  md += fmt::format(
      "{} run{}. Time, samples/s and tokens/s are the last epoch's (all ranks together); peak "
      "memory is the largest rank's peak ({}), with the memory estimator's prediction per GPU "
      "(`shardtrain estimate`) beside it; host peak is rank 0's peak resident set. Speed and "
      "memory are relative to the dp run of the same model, batch and ranks.\n\n",
      runs.size(), runs.size() == 1 ? "" : "s",
      any_gpu ? "GPU memory allocated" : "the process's resident set on CPU runs");
  md +=
      "| run | model | ranks | batch | samples/epoch | time/epoch (s) | samples/s | tokens/s | MFU "
      "| "
      "peak memory "
      "(MiB) | estimated (MiB) | host peak (MiB) | final loss | val ppl | speed vs dp | memory "
      "vs dp |\n";
  md += "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const RunRecord& r : runs) {
    if (!r.ok) {
      md += fmt::format("| {} | {} | {} | {} | **failed** | | | | | | | | | | | |\n", r.label,
                        r.model, r.world_size, r.micro_batch);
      continue;
    }
    md += fmt::format(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
        r.label, r.model, r.world_size, r.micro_batch, fixed(samples_last_epoch(r), "{:.0f}"),
        fixed(r.epoch_time_s, "{:.2f}"), fixed(r.samples_per_s, "{:.2f}"),
        fixed(r.tokens_per_s, "{:.0f}"),
        std::isfinite(r.mfu) ? fmt::format("{:.1f}%", 100 * r.mfu) : "n/a",
        mib(r.peak_memory_bytes), r.estimate ? mib(r.estimate->total()) : "n/a",
        mib(r.host_peak_bytes), fixed(r.final_loss, "{:.4f}"), fixed(r.val_ppl, "{:.2f}"),
        fixed(r.speed_vs_dp, "{:.2f}×"), fixed(r.memory_vs_dp, "{:.2f}×"));
  }
  bool failed = false;
  for (const RunRecord& r : runs) {
    if (r.ok) continue;
    if (!failed) md += "\n## Failed runs\n";
    failed = true;
    md += fmt::format("\n### {}\n\n`{}`\n\n```\n{}\n```\n", r.label,
                      r.command.empty() ? r.dir.string() : r.command, r.failure);
  }
  if (!any_gpu)
    md +=
        "\nThe estimates are for GPUs (bf16, CUDA context and workspaces included); CPU runs "
        "compute in fp32 and their peak is the whole process's resident set, so the two are not "
        "expected to agree.\n";
  if (!pictures.empty()) {
    md += "\n## Pictures\n\n";
    const std::map<std::string, std::string> captions = {
        {"time_per_epoch", "Time per epoch"},
        {"time_per_sample", "Time per 1,000 samples (the runs' epochs differ in length)"},
        {"peak_memory", "Peak memory: measured and estimated"},
        {"loss_curves", "Training loss"},
        {"memory_breakdown", "Estimated GPU memory per rank by category"}};
    for (const std::string& p : pictures) {
      const auto c = captions.find(p);
      md += fmt::format("![{}]({}.png) ([SVG]({}.svg))\n\n", c == captions.end() ? p : c->second, p,
                        p);
    }
  }
  const bool have_commands =
      std::any_of(runs.begin(), runs.end(), [](const RunRecord& r) { return !r.command.empty(); });
  if (have_commands) {
    md += "## Commands\n\n```\n";
    for (const RunRecord& r : runs)
      if (!r.command.empty()) md += r.command + "\n";
    md += "```\n";
  }
  return md;
}

double samples_last_epoch(const RunRecord& r) {
  const double n = std::round(r.samples_per_s * r.epoch_time_s);
  return std::isfinite(n) ? n : NAN;
}

std::string workload_title(const std::vector<RunRecord>& runs) {
  std::set<std::string> models, shapes, devices;
  for (const RunRecord& r : runs) {
    if (!r.ok || r.strategy.empty()) continue;
    models.insert(fs::path(r.model).filename().string());
    shapes.insert(fmt::format("micro-batch {} × {}", r.micro_batch, r.max_length));
    // "NVIDIA H100 80GB HBM3 (cuda:0, 79.2 GiB)" → "NVIDIA H100 80GB HBM3 × W"
    const std::string what =
        r.backend.empty() ? r.device : r.backend.substr(0, r.backend.find(" ("));
    devices.insert(fmt::format("{} × {}", what, r.world_size));
  }
  std::vector<std::string> parts;
  for (const std::set<std::string>* s : {&models, &shapes, &devices})
    if (s->size() == 1) parts.push_back(*s->begin());
  std::string t;
  for (const std::string& p : parts) t += (t.empty() ? "" : ", ") + p;
  return t;
}

std::vector<std::string> draw_pictures(const std::vector<RunRecord>& runs, const fs::path& dir) {
  std::vector<const RunRecord*> ok;
  for (const RunRecord& r : runs)
    if (r.ok) ok.push_back(&r);
  if (ok.empty()) return {};
  std::vector<std::string> drawn;
  std::vector<std::string> labels;
  for (const RunRecord* r : ok) labels.push_back(r->label);
  const std::string workload = workload_title(runs);
  const auto titled = [&](const std::string& what) {
    return workload.empty() ? what : what + " — " + workload;
  };

  // Runs whose epochs hold different sample counts (--num-samples, --max-steps) are compared per
  // sample: their epoch times would not be.
  std::set<double> lengths;
  for (const RunRecord* r : ok) lengths.insert(samples_last_epoch(*r));
  const bool same_length = lengths.size() == 1 && std::isfinite(*lengths.begin());
  BarChart time;
  time.values.resize(1);
  if (same_length) {
    time.title = titled(fmt::format("Time per epoch of {:.0f} samples", *lengths.begin()));
    time.ylabel = "time per epoch (s)";
    time.series = {"time per epoch"};
    time.categories = labels;
    for (const RunRecord* r : ok) time.values[0].push_back(r->epoch_time_s);
    time.value_format = "%.2f";
  } else {
    time.title = titled("Time per 1,000 samples");
    time.ylabel = "time per 1,000 samples (s)";
    time.series = {"time per 1,000 samples"};
    for (const RunRecord* r : ok) {
      time.categories.push_back(
          fmt::format("{} ({:.0f} samples)", r->label, samples_last_epoch(*r)));
      time.values[0].push_back(1000 * r->epoch_time_s / samples_last_epoch(*r));
    }
    time.value_format = "%.3g";
  }
  const std::string time_stem = same_length ? "time_per_epoch" : "time_per_sample";
  plot_bars(time, dir / time_stem);
  drawn.push_back(time_stem);

  BarChart peak;
  peak.title = titled("Peak memory per rank");
  peak.ylabel = "peak memory (MiB)";
  peak.categories = labels;
  peak.series = {"measured", "estimated (GPU)"};
  peak.values.resize(2);
  for (const RunRecord* r : ok) {
    peak.values[0].push_back(r->peak_memory_bytes / (1024.0 * 1024.0));
    peak.values[1].push_back(r->estimate ? r->estimate->total() / (1024.0 * 1024.0) : NAN);
  }
  peak.value_format = "%.0f";
  plot_bars(peak, dir / "peak_memory");
  drawn.push_back("peak_memory");

  // Against samples seen, so runs of other global batches or log intervals line up; each legend
  // entry says how long its run was, so a short run is not read as a part of a long one.
  bool by_samples = true;
  for (const RunRecord* r : ok) by_samples = by_samples && r->global_batch > 0;
  LineChart loss;
  loss.title = titled("Training loss");
  loss.xlabel = by_samples ? "samples seen" : "optimizer step";
  loss.ylabel = "loss (nats per token)";
  for (const RunRecord* r : ok) {
    const int64_t steps = r->losses.empty() ? 0 : r->losses.back().first;
    LineChart::Series s{
        fmt::format("{} ({} steps, {} logged)", r->label, steps, r->losses.size()), {}, {}};
    for (const auto& [step, l] : r->losses) {
      s.x.push_back(static_cast<double>(step) * (by_samples ? r->global_batch : 1));
      s.y.push_back(l);
    }
    loss.series.push_back(std::move(s));
  }
  plot_lines(loss, dir / "loss_curves");
  drawn.push_back("loss_curves");

  BarChart breakdown;
  breakdown.title = titled("Estimated GPU memory per rank by category");
  breakdown.ylabel = "memory (MiB)";
  breakdown.series = {"parameters", "gradients", "optimizer state", "activations", "buffers"};
  breakdown.values.resize(5);
  breakdown.stacked = true;
  for (const RunRecord* r : ok) {
    if (!r->estimate) continue;
    const MemoryBreakdown& b = *r->estimate;
    breakdown.categories.push_back(r->label);
    const double parts[] = {b.parameters, b.gradients, b.optimizer, b.activations, b.buffers};
    for (size_t i = 0; i < 5; ++i) breakdown.values[i].push_back(parts[i] / (1024.0 * 1024.0));
  }
  if (!breakdown.categories.empty()) {
    plot_bars(breakdown, dir / "memory_breakdown");
    drawn.push_back("memory_breakdown");
  }
  return drawn;
}

bool write_report(std::vector<RunRecord>& runs, const fs::path& dir) {
  fs::create_directories(dir);
  complete_runs(runs);
  std::vector<std::string> pictures;
  bool drawn = true;
  try {
    pictures = draw_pictures(runs, dir);
  } catch (const RuntimeFailure& e) {
    drawn = false;
    std::fprintf(stderr, "warning: the pictures were skipped: %s\n", e.what());
  }
  json j = report_json(runs);
  j["pictures"] = json::array();
  for (const std::string& p : pictures) j["pictures"].push_back({p + ".png", p + ".svg"});
  write_file_atomic(dir / "report.json", j.dump(2) + "\n");
  write_file_atomic(dir / "report.md", report_markdown(runs, pictures));
  return drawn;
}

}  // namespace shardtrain
