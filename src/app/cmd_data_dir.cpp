// `shardtrain data-dir`: where this program finds its data (the GPT-2 tokenizer and WikiText-2)
// and how: $SHARDTRAIN_DATA_DIR, the installed tree or the build tree (data/dataset.h).
#include <fmt/core.h>

#include "app/commands.h"
#include "core/error.h"
#include "data/data_dir.h"
#include "data/dataset.h"

namespace shardtrain {

void register_data_dir_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "data-dir",
      "print the directory shardtrain reads its data (GPT-2 tokenizer, WikiText-2) from, and why");
  cmd->callback([] {
    const DataDirLookup l = find_data_dir();
    if (l.dir.empty()) {
      throw DataError(
          fmt::format("shardtrain's data directory was not found: {}", data_dir_hint()));
    }
    fmt::print("{}\n({})\n", l.dir.string(), l.how);
  });
}

}  // namespace shardtrain
