// `shardtrain compare`: trains a matrix of runs (models × strategies × batch sizes × rank counts),
// one `shardtrain launch -- train ...` child process each with its own output directory under the
// report directory, and writes the comparison report (train/report.h) from their metrics. A run
// that fails is marked failed in the report with the last lines of its log; the others go on.
// `shardtrain report` (app/cmd_report.cpp) writes the same report from runs that already finished.
#include <fcntl.h>
#include <fmt/core.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "app/commands.h"
#include "comm/launch.h"
#include "comm/nccl_communicator.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/process.h"
#include "train/report.h"

namespace shardtrain {
namespace fs = std::filesystem;
namespace {

/// The name of train's flag for the field `m` (its row's).
template <typename T>
std::string train_flag(T TrainConfig::*m) {
  return knob_for(m).name();
}

struct CompareFlags {
  std::vector<std::string> models = {"gpt2-medium"};
  std::vector<std::string> strategies;  ///< empty: the default set (+ pipeline on > 1 rank)
  std::vector<int64_t> batch_sizes = {4};
  std::vector<int> gpus = {1};
  int64_t num_samples = 1000;
  int64_t max_length = 512;
  int64_t epochs = 1;
  std::string device;  ///< empty: cuda when a GPU is visible, else cpu
  std::string dataset = "wikitext-2";
  std::string nvme_path;  ///< empty: REPORT_DIR/nvme
  std::string report_dir = "compare";
  bool dry_run = false;
  std::vector<std::string> train_flags;  ///< after '--': passed to every run
};

std::string self_exe() {
  std::error_code ec;
  const auto p = fs::read_symlink("/proc/self/exe", ec);
  check<RuntimeFailure>(!ec, "compare: cannot find this program (/proc/self/exe): {}",
                        ec.message());
  return p.string();
}

/// This program as a user would type it in the commands the report records: `shardtrain` when
/// PATH finds this very file, else its path relative to the working directory when it lies below
/// it (./build/shardtrain), else its absolute path.
std::string shown_program(const std::string& exe) {
  std::error_code ec;
  const std::string on_path = find_on_path("shardtrain");
  if (!on_path.empty() && fs::equivalent(on_path, exe, ec)) return "shardtrain";
  const fs::path rel = fs::path(exe).lexically_relative(fs::current_path());
  if (!rel.empty() && *rel.begin() != "..") return "./" + rel.string();
  return exe;
}

bool has_flag(const std::vector<std::string>& args, const std::string& flag) {
  return std::any_of(args.begin(), args.end(), [&](const std::string& a) {
    return a == flag || a.rfind(flag + "=", 0) == 0;
  });
}

/// The last `n` lines of the file at `path`.
std::string tail_lines(const fs::path& path, size_t n) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string l; std::getline(in, l);) {
    // The progress bar redraws with carriage returns: keep what the line ended with.
    const size_t cr = l.find_last_of('\r', l.size() >= 2 ? l.size() - 2 : 0);
    if (cr != std::string::npos && cr + 1 < l.size()) l = l.substr(cr + 1);
    lines.push_back(l);
    if (lines.size() > n) lines.pop_front();
  }
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

/// The first line of the file at `path` that holds "error:" ("" when none): under mpirun the
/// failing rank's message is followed by mpirun's own report, which the tail alone may cut.
std::string first_error(const fs::path& path) {
  std::ifstream in(path);
  for (std::string l; std::getline(in, l);)
    if (l.find("error:") != std::string::npos) return l;
  return "";
}

/// Runs `argv` with stdout and stderr into `log`; returns its exit status (128 + signal when
/// killed).
int run_logged(const std::vector<std::string>& argv, const fs::path& log) {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  check<RuntimeFailure>(pid >= 0, "compare: fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) ::_exit(126);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::close(fd);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::fprintf(stderr, "cannot run %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    check<RuntimeFailure>(errno == EINTR, "compare: waitpid failed: {}", std::strerror(errno));
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void run_compare(const CompareFlags& f) {
  const std::string device =
      !f.device.empty() ? f.device : (cuda_device_count() > 0 ? "cuda" : "cpu");
  // As given (relative paths stay relative: every run starts in this working directory), so the
  // commands the report records run anywhere.
  const fs::path report = f.report_dir;
  if (!f.dry_run) fs::create_directories(report / "runs");
  const std::string exe = self_exe();
  const bool own_data = has_flag(f.train_flags, train_flag(&TrainConfig::dataset)) ||
                        has_flag(f.train_flags, train_flag(&TrainConfig::train_file)) ||
                        has_flag(f.train_flags, train_flag(&TrainConfig::deepspeed_config));
  struct Case {
    std::vector<std::string> argv;
    fs::path dir;
    fs::path nvme;  ///< infinity's swap directory to create ("" for the others)
    std::string model, strategy;
    int64_t batch;
    int gpus;
  };
  std::vector<Case> cases;
  for (const std::string& model : f.models)
    for (const int64_t batch : f.batch_sizes)
      for (const int g : f.gpus) {
        std::vector<std::string> strategies = f.strategies;
        if (strategies.empty()) {
          strategies = {"dp", "zero1", "zero2", "zero3", "offload", "infinity"};
          if (g > 1) strategies.push_back("pipeline");
        }
        for (const std::string& s : strategies) {
          check<ConfigError>(s != "pipeline" || g > 1,
                             "compare: --strategies pipeline needs --gpus 2 or more (one stage "
                             "per rank)");
          const fs::path dir =
              report / "runs" /
              fmt::format("{}-{}-b{}-g{}", fs::path(model).filename().string(), s, batch, g);
          std::vector<std::string> a = {exe,
                                        "launch",
                                        "--nproc-per-node",
                                        std::to_string(g),
                                        "--",
                                        "train",
                                        train_flag(&TrainConfig::device),
                                        device,
                                        train_flag(&TrainConfig::model),
                                        model,
                                        train_flag(&TrainConfig::strategy_name),
                                        s,
                                        train_flag(&TrainConfig::micro_batch_size),
                                        std::to_string(batch),
                                        train_flag(&TrainConfig::num_samples),
                                        std::to_string(f.num_samples),
                                        train_flag(&TrainConfig::max_length),
                                        std::to_string(f.max_length),
                                        train_flag(&TrainConfig::epochs),
                                        std::to_string(f.epochs),
                                        train_flag(&TrainConfig::output_dir),
                                        dir.string()};
          if (!own_data) a.insert(a.end(), {train_flag(&TrainConfig::dataset), f.dataset});
          const std::string no_save = train_flag(&TrainConfig::save_checkpoints);
          if (!has_flag(f.train_flags, train_flag(&TrainConfig::save_interval)) &&
              !has_flag(f.train_flags, no_save))
            a.push_back(no_save);
          const std::string log_interval = train_flag(&TrainConfig::log_interval);
          if (!has_flag(f.train_flags, log_interval)) {
            // About 100 points on each loss curve.
            const int64_t steps = f.num_samples * f.epochs / std::max<int64_t>(1, batch * g);
            a.insert(a.end(), {log_interval, std::to_string(std::max<int64_t>(1, steps / 100))});
          }
          const std::string stages_flag =
              knob_for(&TrainConfig::pipeline, &PipelineConfig::stages).name();
          if (s == "pipeline" && !has_flag(f.train_flags, stages_flag))
            a.insert(a.end(), {stages_flag, std::to_string(g)});
          fs::path nvme;  // created before the run: train wants an existing directory
          const std::string nvme_flag = zero_knob(&ZeroConfig::nvme_path).name();
          if (s == "infinity" && !has_flag(f.train_flags, nvme_flag)) {
            nvme = f.nvme_path.empty() ? report / "nvme" / dir.filename() : fs::path(f.nvme_path);
            a.insert(a.end(), {nvme_flag, nvme.string()});
          }
          a.insert(a.end(), f.train_flags.begin(), f.train_flags.end());
          cases.push_back({a, dir, nvme, model, s, batch, g});
        }
      }
  std::vector<RunRecord> runs;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    std::string command = shell_quote(shown_program(c.argv[0]));
    for (size_t w = 1; w < c.argv.size(); ++w) command += " " + shell_quote(c.argv[w]);
    fmt::print("[{}/{}] {}\n", i + 1, cases.size(), command);
    std::fflush(stdout);
    if (f.dry_run) continue;
    std::error_code ec;
    fs::remove_all(c.dir, ec);  // a previous comparison's run: its metrics.jsonl would be appended
    fs::create_directories(c.dir);
    if (!c.nvme.empty()) fs::create_directories(c.nvme);
    { std::ofstream(c.dir / "command.txt") << command << "\n"; }
    const fs::path log = c.dir / "train.log";
    const auto t0 = std::chrono::steady_clock::now();
    const int status = run_logged(c.argv, log);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    RunRecord r = read_run(c.dir);
    r.command = command;
    if (r.strategy.empty()) {  // failed before writing run.json: what it was meant to be
      r.model = c.model;
      r.strategy = c.strategy;
      r.micro_batch = c.batch;
      r.world_size = c.gpus;
      r.device = device;
    }
    if (status != 0) {
      r.ok = false;
      const std::string tail = tail_lines(log, 20), error = first_error(log);
      r.failure = fmt::format(
          "exited with status {}{}; the last lines of {}:\n{}", status,
          error.empty() || tail.find(error) != std::string::npos ? std::string() : "\n" + error,
          log.string(), tail);
      fmt::print("  failed (status {}) after {:.1f} s; log: {}\n", status, seconds, log.string());
    } else if (!r.ok) {
      r.failure += fmt::format("\nthe last lines of {}:\n{}", log.string(), tail_lines(log, 20));
      fmt::print("  finished after {:.1f} s but {}\n", seconds, r.failure);
    } else {
      fmt::print("  done in {:.1f} s: {:.2f} s/epoch, {:.0f} tokens/s, loss {:.4f}\n", seconds,
                 r.epoch_time_s, r.tokens_per_s, r.final_loss);
    }
    std::fflush(stdout);
    runs.push_back(std::move(r));
  }
  if (f.dry_run) return;
  write_report(runs, report);
  const auto failed =
      std::count_if(runs.begin(), runs.end(), [](const RunRecord& r) { return !r.ok; });
  fmt::print("report: {} ({} run{}{})\n", (report / "report.md").string(), runs.size(),
             runs.size() == 1 ? "" : "s",
             failed ? fmt::format(", {} failed", failed) : std::string());
}

}  // namespace

void register_compare_command(CLI::App& app) {
  auto f = std::make_shared<CompareFlags>();
  CLI::App* cmd = app.add_subcommand(
      "compare",
      "train a matrix of strategies (models, batch sizes, ranks) and write a report comparing "
      "their speed, memory and loss, with pictures (`shardtrain compare -- --eval-samples 64`)");
  cmd->add_option("--models", f->models, "models to train, comma-separated (default gpt2-medium)")
      ->delimiter(',');
  cmd->add_option("--strategies", f->strategies,
                  "strategies, comma-separated (default dp,zero1,zero2,zero3,offload,infinity, "
                  "and pipeline for --gpus above 1)")
      ->delimiter(',');
  cmd->add_option("--batch-sizes", f->batch_sizes,
                  fmt::format("micro-batch sizes per rank ({} of train), comma-separated "
                              "(default 4)",
                              knob_for(&TrainConfig::micro_batch_size).name()))
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  cmd->add_option("--gpus", f->gpus,
                  "ranks per run (GPUs, or CPU processes under mpirun), comma-separated "
                  "(default 1)")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096));
  // train's flags of the same names, passed on to every run.
  cmd->add_option(train_flag(&TrainConfig::num_samples), f->num_samples,
                  "training samples per epoch (default 1000)")
      ->check(CLI::PositiveNumber);
  cmd->add_option(train_flag(&TrainConfig::max_length), f->max_length,
                  "tokens per sample (default 512)")
      ->check(CLI::PositiveNumber);
  cmd->add_option(train_flag(&TrainConfig::epochs), f->epochs, "epochs per run (default 1)")
      ->check(CLI::PositiveNumber);
  cmd->add_option(train_flag(&TrainConfig::device), f->device,
                  "cpu | cuda (default: cuda when a GPU is visible, else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option(train_flag(&TrainConfig::dataset), f->dataset,
                  fmt::format("named data set (default wikitext-2; {} after '--' replaces it)",
                              train_flag(&TrainConfig::train_file)));
  // train's flag, under its name: the directory of infinity's runs.
  cmd->add_option(zero_knob(&ZeroConfig::nvme_path).name(), f->nvme_path,
                  "infinity: directory of the swap files (default REPORT_DIR/nvme/RUN)");
  cmd->add_option("--report-dir,-o", f->report_dir,
                  "where the runs (runs/NAME) and the report go (default ./compare)");
  cmd->add_flag("--dry-run", f->dry_run, "print the commands it would run, and exit");
  cmd->add_option("train_flags", f->train_flags,
                  "flags after '--' given to every `train` (e.g. -- --eval-samples 64)")
      ->expected(-1);
  cmd->callback([f]() { run_compare(*f); });
}

}  // namespace shardtrain
