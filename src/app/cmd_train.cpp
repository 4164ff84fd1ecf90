// `shardtrain train`: flags (and an optional DeepSpeed JSON) → TrainConfig → train().
#include <fmt/core.h>

#include "app/commands.h"
#include "app/train_flags.h"
#include "comm/communicator.h"
#include "core/strings.h"
#include "model/gpt2_config.h"
#include "train/trainer.h"

namespace shardtrain {

void register_train_command(CLI::App& app) {
  auto cfg = std::make_shared<TrainConfig>();
  CLI::App* cmd = app.add_subcommand("train", "train a GPT-2 model (see --help for the flags)");
  add_train_flags(*cmd, *cfg);
  cmd->callback([cmd, cfg]() {
    std::vector<std::string> warnings;
    // The model's context bounds --max-length; an unknown model name fails here, clearly.
    const int64_t context = gpt2_preset(cfg->model).n_positions;
    TrainConfig final_cfg = finalize_train_config(*cmd, *cfg, context, warnings);
    for (const auto& w : warnings) fmt::print(stderr, "warning: {}\n", w);
    auto comm = make_local_communicator();
    train(final_cfg, *comm);
  });
}

}  // namespace shardtrain
