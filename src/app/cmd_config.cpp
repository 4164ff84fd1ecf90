// `shardtrain config --markdown`: the tables of docs/CONFIG.md's DeepSpeed JSON keys, printed from
// the knob tables (config/knob.h); a test compares them with the file.
#include <fmt/core.h>

#include <memory>

#include "app/commands.h"
#include "config/knob.h"
#include "core/error.h"

namespace shardtrain {

void register_config_command(CLI::App& app) {
  auto markdown = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand(
      "config", "print the configuration knobs (flags, DeepSpeed JSON keys, defaults, notes)");
  cmd->add_flag("--markdown", *markdown,
                "as the Markdown tables of docs/CONFIG.md's DeepSpeed JSON keys");
  cmd->callback([markdown]() {
    if (!*markdown) throw ConfigError("config: give --markdown (the only format so far)");
    for (const KnobTable* table : all_knob_tables()) fmt::print("{}", knob_markdown(*table));
  });
}

}  // namespace shardtrain
