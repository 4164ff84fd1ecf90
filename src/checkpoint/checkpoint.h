// Checkpoints: a directory per save, written atomically; the shared parts of both formats.
//
// Format 2 (what training writes, sharded: checkpoint/sharded_checkpoint.h) has one file per rank.
// Format 1 (below; still read, and written by save_checkpoint for tests and tools) holds the full
// state:
//
//   OUT/checkpoint-000300/
//     manifest.json        format, model shape, progress (step, epoch, data position, RNG),
//                          run configuration, file sizes and FNV-1a checksums
//     model.safetensors    fp32 weights with Hugging Face GPT2LMHeadModel names and layouts
//                          (Conv1D weights [in, out]) — loadable by transformers as is
//     optimizer.safetensors AdamW exp_avg / exp_avg_sq in the flat layout, fp32 (SGD: exp_avg,
//                           the momentum buffer, only; the manifest's optimizer.type says which)
//   OUT/latest             name of the newest complete checkpoint
//
// A checkpoint is assembled in a temporary directory, every file fsync'ed, then renamed into
// place, and only then is `latest` replaced (atomically): a crash while saving leaves the
// previous checkpoint and `latest` intact.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
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

/// What an image classifier's checkpoint was trained as (manifest "model" with "kind": "image").
struct ImageCheckpointModel {
  std::string name;         ///< "cnn", "mobilenet_v2", "ensemble:cnn,cnn_lstm", ...
  int64_t num_classes = 0;  ///< K
  int64_t channels = 0, height = 0, width = 0;  ///< input C×H×W (pixels)
  bool operator==(const ImageCheckpointModel&) const = default;
  /// "image model 'cnn' (10 classes, input 1×28×28)".
  std::string describe() const;
};

struct CheckpointInfo {
  GPT2Config model;  ///< GPT-2 checkpoints (unset when `image` is)
  /// Image-model checkpoints: the model; nullopt for GPT-2 (manifests without "kind").
  std::optional<ImageCheckpointModel> image;
  TrainingProgress progress;
  nlohmann::json config;  ///< the run configuration, for reference and checks
  std::filesystem::path dir;
  nlohmann::json files;        ///< file name -> {bytes, fnv1a64} (read from the manifest)
  int64_t optimizer_step = 0;  ///< the optimizer's step count (AdamW's bias correction)
  /// Whose state the checkpoint holds: the manifest's optimizer.type, "AdamW" (also when absent:
  /// checkpoints written before SGD existed) or "SGD".
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  /// Dynamic loss scaling state (fp16) as written by the trainer; null when not used.
  nlohmann::json loss_scaler;
  int version = 0;          ///< format version (read from the manifest)
  nlohmann::json manifest;  ///< the whole manifest.json (read_checkpoint_info)
};

/// The manifest's optimizer.type for `k`: "AdamW" or "SGD".
const char* manifest_optimizer_type(OptimizerKind k);
/// The inverse of manifest_optimizer_type; throws CheckpointError naming `dir` for other names.
OptimizerKind parse_manifest_optimizer_type(const std::string& type,
                                            const std::filesystem::path& dir);

/// manifest.json's "format" (both versions).
inline constexpr const char* kCheckpointFormat = "shardtrain-checkpoint";
/// The newest checkpoint format version this build reads and writes.
inline constexpr int kCheckpointVersion = 2;

/// The manifest's "model" and "progress" objects (shared by both formats).
nlohmann::json manifest_model_json(const GPT2Config& model);
/// The manifest's "model" of `info`: GPT-2's shape, or for image models {"kind": "image", "name",
/// "num_classes", "input_shape": [C, H, W]}.
nlohmann::json manifest_model_json(const CheckpointInfo& info);
/// What the checkpoint holds, for error messages: "image model 'cnn' (10 classes, input
/// 1×28×28)" or "GPT-2 model 'gpt2-tiny' (<shape>)".
std::string checkpoint_model_description(const CheckpointInfo& info);
/// Throws CheckpointError when `info` holds an image model: `what` ("shardtrain generate", ...)
/// works on GPT-2 checkpoints only.
void require_gpt2_checkpoint(const CheckpointInfo& info, const std::string& what);
nlohmann::json manifest_progress_json(const TrainingProgress& progress);

/// Creates (empty) `output_dir/.NAME.tmp.ID`, removing a stale one of the same name first.
/// Returns its path. Throws RuntimeFailure naming the directory on failure.
std::filesystem::path create_checkpoint_tmp_dir(const std::filesystem::path& output_dir,
                                                const std::string& name, const std::string& id);

/// Moves the finished `tmp_dir` (every file fsync'ed, manifest.json last) to `output_dir/name`
/// (replacing an older checkpoint of that name) and then atomically points `output_dir/latest`
/// at it. Returns the final directory. Throws RuntimeFailure; until the rename the previous
/// checkpoint and `latest` are untouched.
std::filesystem::path publish_checkpoint_dir(const std::filesystem::path& output_dir,
                                             const std::filesystem::path& tmp_dir,
                                             const std::string& name);

/// Removes the directories a save that never finished left in `output_dir`
/// (`.checkpoint-*.tmp.ID`, being assembled, and `.checkpoint-*.old.PID`, being replaced), and
/// returns them. A finished
/// checkpoint and `latest` are never touched. Call it before this run saves anything. Throws
/// RuntimeFailure naming a directory that cannot be removed.
std::vector<std::filesystem::path> remove_partial_checkpoints(
    const std::filesystem::path& output_dir);

/// Saves `state` as a format-1 (full state) checkpoint `output_dir/name` and points
/// `output_dir/latest` at it. Returns the directory. Throws RuntimeFailure on I/O errors (the
/// previous checkpoint stays intact).
std::filesystem::path save_checkpoint(const std::filesystem::path& output_dir,
                                      const std::string& name, const ParamLayout& layout,
                                      const FullState& state, const CheckpointInfo& info);

/// A checkpoint directory, or an output directory whose `latest` names one. Throws
/// CheckpointError saying what was looked for when neither is there.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& dir);

/// Reads manifest.json of a checkpoint directory (resolve_checkpoint applied). Throws
/// CheckpointError for a missing or corrupt manifest.
CheckpointInfo read_checkpoint_info(const std::filesystem::path& dir);

/// Loads a format-1 checkpoint's full state for `layout`, verifying sizes and checksums. With
/// `with_optimizer` false only the parameters are read. Throws CheckpointError naming the file
/// or tensor on any mismatch, and for other formats (load_full_state in
/// checkpoint/sharded_checkpoint.h reads every format).
FullState load_checkpoint_state(const CheckpointInfo& info, const ParamLayout& layout,
                                bool with_optimizer);

/// Reads Hugging Face GPT-2 weights (model.safetensors of GPT2LMHeadModel or GPT2Model, names
/// with or without the "transformer." prefix) into `flat` (layout.numel() fp32), transposing
/// Conv1D weights. `file` may also be a sharded model's model.safetensors.index.json: each
/// tensor is read from the shard its weight_map names. Throws CheckpointError naming each
/// missing or mis-shaped tensor, or an index that cannot be read.
void load_hf_weights(const std::filesystem::path& file, const ParamLayout& layout, float* flat);

/// Writes the weights in `flat` as a Hugging Face model.safetensors (fp32, HF names/layouts).
void save_hf_weights(const std::filesystem::path& file, const ParamLayout& layout,
                     const float* flat);

/// Element type of an exported Hugging Face model.
enum class HfDtype { kF32, kBF16 };

/// Parses "fp32"/"f32"/"float32" and "bf16"/"bfloat16". Throws ConfigError naming the choices.
HfDtype parse_hf_dtype(const std::string& s);

/// Streams a Hugging Face model.safetensors tensor by tensor (HF names, Conv1D weights
/// transposed to [in, out], fp32 or bf16 rounded to nearest even): construct, then write() every
/// tensor of the layout in layout order, then finish(). Memory: one tensor. Throws RuntimeFailure
/// on I/O errors and when tensors come out of order.
class HfWeightsWriter {
 public:
  HfWeightsWriter(const std::filesystem::path& file, const ParamLayout& layout, HfDtype dtype);
  /// A file of `tensors` only (a shard of a sharded export), written in their order.
  HfWeightsWriter(const std::filesystem::path& file, std::vector<const ParamTensor*> tensors,
                  HfDtype dtype);
  /// `data`: tensor `t` in our layout (t.numel fp32 values, linear weights [out, in]).
  void write(const ParamTensor& t, const float* data);
  WrittenFile finish();

 private:
  std::vector<const ParamTensor*> tensors_;
  size_t next_ = 0;
  HfDtype dtype_;
  SafetensorsWriter writer_;
};

/// Writes a Hugging Face GPT2Config (config.json) for `model` into `dir`, so that
/// GPT2LMHeadModel.from_pretrained(dir) loads the model.safetensors beside it.
void save_hf_config(const std::filesystem::path& dir, const GPT2Config& model);

}  // namespace shardtrain
