// `shardtrain export`: a checkpoint's weights as a Hugging Face model directory.
#include <fmt/core.h>

#include "app/commands.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_export.h"
#include "data/bpe_tokenizer.h"
#include "data/data_dir.h"
#include "data/dataset.h"

namespace shardtrain {

void register_export_command(CLI::App& app) {
  auto checkpoint = std::make_shared<std::string>();
  auto output = std::make_shared<std::string>();
  auto shard = std::make_shared<std::string>("5GB");
  CLI::App* cmd = app.add_subcommand(
      "export",
      "write a checkpoint as a Hugging Face GPT-2 directory (model.safetensors, config.json, "
      "vocab.json, merges.txt) that transformers' GPT2LMHeadModel.from_pretrained loads");
  cmd->add_option("--checkpoint", *checkpoint,
                  "checkpoint directory (sharded or full), or an output directory (its latest "
                  "checkpoint)")
      ->required();
  cmd->add_option("--output", *output, "directory to write")->required();
  cmd->add_option("--max-shard-size", *shard,
                  "larger weights are split into model-0000K-of-0000N.safetensors files of at "
                  "most this size and model.safetensors.index.json, as transformers' "
                  "save_pretrained (default 5GB)");
  cmd->callback([checkpoint, output, shard]() {
    const int64_t max_shard = parse_shard_size(*shard);
    const CheckpointInfo info = read_checkpoint_info(*checkpoint);
    export_hf_model(info, *output, default_data_dir() / "gpt2-tokenizer", HfDtype::kF32, max_shard);
    fmt::print("exported {} (model {}, step {}) to {}\n", info.dir.string(), info.model.name,
               info.progress.step, *output);
  });
}

}  // namespace shardtrain
