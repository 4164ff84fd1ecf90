// A checkpoint (any format) as a Hugging Face GPT-2 model directory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "checkpoint/checkpoint.h"

namespace shardtrain {

/// transformers' default max_shard_size of save_pretrained ("5GB"): 5·10⁹ bytes.
inline constexpr int64_t kHfMaxShardBytes = 5'000'000'000;

/// Writes a Hugging Face GPT-2 model directory: the weights (HF GPT2LMHeadModel names, Conv1D
/// weights [in, out], in `dtype`), config.json and the GPT-2 tokenizer files (vocab.json =
/// encoder.json, merges.txt = vocab.bpe from `tokenizer_dir`), streaming the parameters tensor by
/// tensor from the checkpoint's shards (memory: about one tensor).
///
/// Weights of at most `max_shard_bytes` go to model.safetensors; more are split as
/// save_pretrained splits them: model-00001-of-0000N.safetensors files of at most
/// `max_shard_bytes` each (whole tensors in layout order; a larger tensor gets a file of its own)
/// and model.safetensors.index.json ({"metadata": {"total_size": bytes}, "weight_map": {tensor:
/// file}}), which from_pretrained and `--init-from` read. Each file is written under a temporary
/// name and renamed when complete, the index last; a weights file of the other layout left by an
/// earlier export is removed. Throws CheckpointError for a missing, corrupt or mismatched
/// checkpoint, ConfigError for max_shard_bytes < 1, and RuntimeFailure naming the file on I/O
/// errors.
void export_hf_model(const CheckpointInfo& info, const std::filesystem::path& out_dir,
                     const std::filesystem::path& tokenizer_dir, HfDtype dtype = HfDtype::kF32,
                     int64_t max_shard_bytes = kHfMaxShardBytes);

/// Parses a shard size as transformers writes it: bytes, or a number with KB, MB, GB (powers of
/// 10) or KiB, MiB, GiB (powers of 2), e.g. "5GB", "500MB". Throws ConfigError naming `text`.
int64_t parse_shard_size(const std::string& text);

}  // namespace shardtrain
