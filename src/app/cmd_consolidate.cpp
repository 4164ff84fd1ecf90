// `shardtrain consolidate`: a (sharded) checkpoint as one Hugging Face model directory, streamed
// tensor by tensor from the rank files (DeepSpeed's zero_to_fp32.py, without holding the model).
#include <fmt/core.h>

#include "app/commands.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_export.h"
#include "data/data_dir.h"
#include "data/dataset.h"

namespace shardtrain {

void register_consolidate_command(CLI::App& app) {
  auto checkpoint = std::make_shared<std::string>();
  auto output = std::make_shared<std::string>();
  auto dtype = std::make_shared<std::string>("fp32");
  auto shard = std::make_shared<std::string>("5GB");
  CLI::App* cmd = app.add_subcommand(
      "consolidate",
      "merge a checkpoint's per-rank shards into a Hugging Face GPT-2 directory "
      "(model.safetensors, config.json, vocab.json, merges.txt), one tensor in memory at a time");
  cmd->add_option("checkpoint", *checkpoint,
                  "checkpoint directory, or an output directory (its latest checkpoint)")
      ->required();
  cmd->add_option("--output", *output, "directory to write")->required();
  cmd->add_option("--dtype", *dtype, "bf16 | fp32 (default fp32)");
  cmd->add_option("--max-shard-size", *shard,
                  "larger weights are split into model-0000K-of-0000N.safetensors files of at "
                  "most this size and model.safetensors.index.json, as transformers' "
                  "save_pretrained (default 5GB)");
  cmd->callback([checkpoint, output, dtype, shard]() {
    const HfDtype dt = parse_hf_dtype(*dtype);
    const int64_t max_shard = parse_shard_size(*shard);
    const CheckpointInfo info = read_checkpoint_info(*checkpoint);
    export_hf_model(info, *output, default_data_dir() / "gpt2-tokenizer", dt, max_shard);
    fmt::print("consolidated {} (model {}, step {}, {}) into {}\n", info.dir.string(),
               info.model.name, info.progress.step, dt == HfDtype::kBF16 ? "bf16" : "fp32",
               *output);
  });
}

}  // namespace shardtrain
