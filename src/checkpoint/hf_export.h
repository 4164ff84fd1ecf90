// A checkpoint (any format) as a Hugging Face GPT-2 model directory.
#pragma once

#include <filesystem>

#include "checkpoint/checkpoint.h"

namespace shardtrain {

/// Writes `out_dir`/model.safetensors (HF GPT2LMHeadModel names, Conv1D weights [in, out], in
/// `dtype`), config.json and the GPT-2 tokenizer files (vocab.json = encoder.json, merges.txt =
/// vocab.bpe from `tokenizer_dir`), streaming the parameters tensor by tensor from the
/// checkpoint's shards (memory: about one tensor). model.safetensors is written under a
/// temporary name and renamed when complete. Throws CheckpointError for a missing, corrupt or
/// mismatched checkpoint and RuntimeFailure naming the file on I/O errors.
void export_hf_model(const CheckpointInfo& info, const std::filesystem::path& out_dir,
                     const std::filesystem::path& tokenizer_dir, HfDtype dtype = HfDtype::kF32);

}  // namespace shardtrain
