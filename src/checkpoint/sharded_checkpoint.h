// Sharded checkpoints (format 2): every rank writes the state it holds, nobody gathers it, and a
// load reshards by the flat layout, so a checkpoint saved by any strategy on any number of ranks
// loads into any other (the flat layout of a model is the same everywhere: memory/param_layout.h).
//
//   OUT/checkpoint-000300/
//     manifest.json                      format 2: model shape, the layout (numel, every tensor's
//                                        name/shape/offset), world size and strategy, the ranges
//                                        of every rank, progress, optimizer type (AdamW or SGD)
//                                        and step, loss scaler, run configuration, every file's
//                                        bytes and FNV-1a 64
//     rank-00000-of-00004.safetensors    1-D F32 tensors params, exp_avg, exp_avg_sq (SGD: params
//     ...                                and exp_avg, its momentum buffer): the concatenation of
//                                        that rank's Strategy::save_ranges(); image models add
//                                        "buffers", the rank's own batch-norm running statistics
//                                        (Model::state_buffers(), listed in the manifest's
//                                        "buffers")
//     rank-00000.json ...                sidecar: the rank's ranges, file bytes and checksum
//     model.safetensors, config.json     only with consolidated_bf16_model (DeepSpeed's
//                                        stage3_gather_16bit_weights_on_model_save)
//   OUT/latest                           name of the newest complete checkpoint
//
// Atomicity with many ranks: rank 0 creates OUT/.NAME.tmp.s<step> (the id is derived from the
// step, so every rank knows it without communication); barrier; every rank writes and fsyncs its
// two files; barrier; rank 0 reads the sidecars, writes manifest.json, renames the directory into
// place and replaces OUT/latest atomically; barrier. A crash at any moment leaves the previous
// checkpoint the latest valid one (a leftover .tmp directory is never picked up and is removed by
// the next save of the same name). With several nodes OUT must be on a filesystem that every
// rank sees (as DeepSpeed requires): rank 0 reads the other ranks' sidecars.
//
// Memory: a rank streams its ranges through one host buffer of at most `chunk_elements` fp32
// values (default kCheckpointChunkElements = 8 Mi elements = 32 MiB) on save and on load; no
// rank ever holds the full state. for_each_param_tensor holds one tensor.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "memory/param_layout.h"
#include "parallel/strategy.h"

namespace shardtrain {

/// Bound of the host buffer that streams a rank's state (elements; 32 MiB of fp32).
inline constexpr int64_t kCheckpointChunkElements = int64_t{8} << 20;

struct ShardedSaveOptions {
  /// Host buffer bound in fp32 elements (> 0).
  int64_t chunk_elements = kCheckpointChunkElements;
  /// Also write model.safetensors (bf16, Hugging Face names) and config.json into the checkpoint,
  /// streamed by rank 0 from the finished shards before the directory is published.
  bool consolidated_bf16_model = false;
  /// This rank's model state buffers (Model::state_buffers(): batch norm's running statistics),
  /// names and sizes, and `buffers` their values (Σ numel fp32, in that order). Written as a
  /// fourth tensor "buffers" of the rank's shard file and listed in the manifest's "buffers";
  /// empty (GPT-2): none. capture_model_buffers() fills both.
  std::vector<ModelBuffer> buffer_tensors;
  std::vector<float> buffers;
};

/// Fills options.buffer_tensors / options.buffers from `model`'s state buffers on this rank.
void capture_model_buffers(Model& model, ShardedSaveOptions& options);

/// The shard file of `rank` of `world` ranks: "rank-RRRRR-of-WWWWW.safetensors".
std::string shard_file_name(int rank, int world);

/// Saves the state of `strategy` as the format-2 checkpoint `output_dir/name` and points
/// `output_dir/latest` at it (protocol above). Collective over `comm`: every rank calls it with
/// the same arguments (`info`: model, progress, config, loss_scaler; only rank 0's is written).
/// Returns the checkpoint directory on every rank. Throws RuntimeFailure naming the file on I/O
/// errors; the previous checkpoint stays the latest. A rank that throws leaves the others waiting
/// in the next barrier until the communicator's timeout stops the job.
std::filesystem::path save_sharded_checkpoint(const std::filesystem::path& output_dir,
                                              const std::string& name, const ParamLayout& layout,
                                              Strategy& strategy, Communicator& comm,
                                              const CheckpointInfo& info,
                                              const ShardedSaveOptions& options = {});

/// Throws CheckpointError when `info`'s checkpoint was saved from another layout, naming the
/// first mismatching tensor (name, shape in the checkpoint vs the model). Format 1 checkpoints
/// are checked tensor by tensor when read.
void check_checkpoint_layout(const CheckpointInfo& info, const ParamLayout& layout);

/// Loads a checkpoint of any format into `strategy`: for each of its load_ranges() reads the
/// pieces of whichever shard files hold them through a buffer of `chunk_elements` fp32 values,
/// write_state()s them, then finish_load(AdamW step). With `with_optimizer` false only the
/// parameters are written (m and v stay as they are) and the step count is 0 (--init-from).
/// Collective (finish_load). Before writing anything: checks the layout, that every shard file
/// exists with the manifest's size, and the checksums of the files this rank reads. Throws
/// CheckpointError naming the file and the rank that wrote it (missing, truncated, corrupt) or
/// the first mismatching tensor.
void load_sharded_checkpoint(const CheckpointInfo& info, const ParamLayout& layout,
                             Strategy& strategy, Communicator& comm, bool with_optimizer = true,
                             int64_t chunk_elements = kCheckpointChunkElements);

/// Restores `model`'s state buffers (batch norm's running statistics) from a format-2
/// checkpoint: rank `rank`'s own values when the checkpoint has a shard of that rank (the same
/// world size resumes every rank exactly), else rank 0's. Nothing to do when the model has no
/// buffers. Throws CheckpointError when the checkpoint lacks them, lists other names or sizes
/// (naming the first mismatch), or the shard file is missing, truncated or fails its checksum.
void load_model_buffers(const CheckpointInfo& info, Model& model, int rank);

/// Calls `fn(tensor, data)` for every tensor of `layout` in layout order with its fp32
/// parameters in our layout (linear weights [out, in]), reading one tensor at a time from the
/// checkpoint (any format). Verifies sizes and checksums first. Throws CheckpointError as
/// load_sharded_checkpoint.
void for_each_param_tensor(const CheckpointInfo& info, const ParamLayout& layout,
                           const std::function<void(const ParamTensor&, const float*)>& fn);

/// The checkpoint's full fp32 parameters in the flat layout (layout.numel() elements): for
/// tools that run the model (generate). Throws as for_each_param_tensor.
std::vector<float> load_checkpoint_params(const CheckpointInfo& info, const ParamLayout& layout);

/// The checkpoint's full state in the flat layout (any format; tests and tools). Throws as
/// load_sharded_checkpoint.
FullState load_full_state(const CheckpointInfo& info, const ParamLayout& layout,
                          bool with_optimizer);

}  // namespace shardtrain
