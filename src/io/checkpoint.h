// Checkpoints: a directory per save, written atomically.
//
//   OUT/checkpoint-000300/
//     manifest.json        format, model shape, progress (step, epoch, data position, RNG),
//                          run configuration, file sizes and FNV-1a checksums
//     model.safetensors    fp32 weights with Hugging Face GPT2LMHeadModel names and layouts
//                          (Conv1D weights [in, out]) — loadable by transformers as is
//     optimizer.safetensors AdamW exp_avg / exp_avg_sq in the flat layout, fp32
//   OUT/latest             name of the newest complete checkpoint
//
// A checkpoint is assembled in a temporary directory, every file fsync'ed, then renamed into
// place, and only then is `latest` replaced (atomically): a crash while saving leaves the
// previous checkpoint and `latest` intact.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memory/param_layout.h"
#include "model/gpt2_config.h"
#include "parallel/strategy.h"

namespace shardtrain {

/// Where training stands; everything needed to continue the same trajectory.
struct TrainingProgress {
  int64_t step = 0;           ///< optimizer steps completed
  int64_t epoch = 0;          ///< current epoch (0-based)
  int64_t step_in_epoch = 0;  ///< optimizer steps completed within `epoch` (data position)
  int64_t tokens_seen = 0;
  uint64_t seed = 0;  ///< sampler/initialization seed (the sampler's RNG is a pure
                      ///< function of (seed, epoch): see DistributedSampler)
};

struct CheckpointInfo {
  GPT2Config model;
  TrainingProgress progress;
  nlohmann::json config;  ///< the run configuration, for reference and checks
  std::filesystem::path dir;
  nlohmann::json files;        ///< file name -> {bytes, fnv1a64} (read from the manifest)
  int64_t optimizer_step = 0;  ///< AdamW's step count (bias correction)
};

/// Saves `state` as `output_dir/name` and points `output_dir/latest` at it. Returns the
/// directory. Throws RuntimeFailure on I/O errors (the previous checkpoint stays intact).
std::filesystem::path save_checkpoint(const std::filesystem::path& output_dir,
                                      const std::string& name, const ParamLayout& layout,
                                      const FullState& state, const CheckpointInfo& info);

/// A checkpoint directory, or an output directory whose `latest` names one. Throws
/// CheckpointError saying what was looked for when neither is there.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& dir);

/// Reads manifest.json of a checkpoint directory (resolve_checkpoint applied). Throws
/// CheckpointError for a missing or corrupt manifest.
CheckpointInfo read_checkpoint_info(const std::filesystem::path& dir);

/// Loads a checkpoint's full state for `layout`, verifying sizes and checksums. With
/// `with_optimizer` false only the parameters are read. Throws CheckpointError naming the file
/// or tensor on any mismatch.
FullState load_checkpoint_state(const CheckpointInfo& info, const ParamLayout& layout,
                                bool with_optimizer);

/// Reads Hugging Face GPT-2 weights (model.safetensors of GPT2LMHeadModel or GPT2Model, names
/// with or without the "transformer." prefix) into `flat` (layout.numel() fp32), transposing
/// Conv1D weights. Throws CheckpointError naming each missing or mis-shaped tensor.
void load_hf_weights(const std::filesystem::path& file, const ParamLayout& layout, float* flat);

/// Writes the weights in `flat` as a Hugging Face model.safetensors (fp32, HF names/layouts).
void save_hf_weights(const std::filesystem::path& file, const ParamLayout& layout,
                     const float* flat);

/// Writes a Hugging Face GPT2Config (config.json) for `model` into `dir`, so that
/// GPT2LMHeadModel.from_pretrained(dir) loads the model.safetensors beside it.
void save_hf_config(const std::filesystem::path& dir, const GPT2Config& model);

/// Copies a checkpoint's weights as a Hugging Face model directory: model.safetensors,
/// config.json and the GPT-2 tokenizer files (vocab.json = encoder.json, merges.txt =
/// vocab.bpe). Throws CheckpointError / RuntimeFailure naming the file on failure.
void export_hf_model(const CheckpointInfo& info, const std::filesystem::path& out_dir,
                     const std::filesystem::path& tokenizer_dir);

}  // namespace shardtrain
