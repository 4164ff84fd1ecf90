// `shardtrain report RUN_DIR... [-o DIR]`: the comparison report (train/report.h) of runs that
// already finished — any `train --output-dir` with a metrics.jsonl and run.json — as `shardtrain
// compare` writes it after running its matrix.
#include <fmt/core.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "app/commands.h"
#include "core/error.h"
#include "train/report.h"

namespace shardtrain {
namespace fs = std::filesystem;

void register_report_command(CLI::App& app) {
  struct ReportFlags {
    std::vector<std::string> runs;
    std::string output = "report";
  };
  auto f = std::make_shared<ReportFlags>();
  CLI::App* cmd = app.add_subcommand(
      "report",
      "write the comparison report (report.md, report.json, pictures) of finished runs from "
      "their metrics.jsonl and run.json");
  cmd->add_option("--output-dir,-o", f->output, "directory of the report (default ./report)");
  cmd->add_option("run_dirs", f->runs, "the runs' --output-dir directories")
      ->required()
      ->expected(-1);
  cmd->callback([f]() {
    std::vector<RunRecord> runs;
    for (const std::string& d : f->runs) {
      check<ConfigError>(fs::is_directory(d), "report: {} is not a directory", d);
      RunRecord r = read_run(d);
      if (std::ifstream in(fs::path(d) / "command.txt"); in) std::getline(in, r.command);
      runs.push_back(std::move(r));
    }
    write_report(runs, f->output);
    fmt::print("report: {} ({} run{})\n", (fs::path(f->output) / "report.md").string(), runs.size(),
               runs.size() == 1 ? "" : "s");
  });
}

}  // namespace shardtrain
