// Image-model weights as torchvision state dicts in safetensors: what `--init-from FILE` reads
// for image models and tools/convert_torchvision.py writes (parameters and batch norm's
// running_mean / running_var under torchvision's state-dict names, fp32; num_batches_tracked is
// ignored).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "model/image/image_model.h"

namespace shardtrain {

/// What load_torchvision_weights() did.
struct TorchvisionLoadReport {
  int64_t tensors_loaded = 0;  ///< parameters and buffers read from the file
  /// Head tensors (ImageModel::head_parameter_names()) kept at their fresh initialization
  /// because the file's head has another shape (replace_head); empty otherwise.
  std::vector<std::string> fresh_head;
  /// The file's class count (first dimension of its head weight), 0 when the file has no head.
  int64_t file_classes = 0;
  std::vector<std::string>
      ignored;  ///< tensors of the file that were skipped (num_batches_tracked)
};

/// Reads the torchvision-named tensors of `file` (safetensors; F32, BF16 or F16) into `params`
/// (the model's flat fp32 layout, layout().numel() values, already holding the fresh
/// initialization) and `buffers` (Σ state_buffers() numel fp32, already holding their initial
/// values). Every parameter and buffer of the model must be in the file with the model's shape
/// (buffers: [C]), except the classifier head (head_parameter_names()): when the file's head has
/// another shape (another class count, e.g. ImageNet's 1000 for a 10-class data set) and
/// `replace_head` is true, the head keeps its fresh initialization (the fine-tuning path) and the
/// report lists it. Throws ConfigError naming the file and each problem (a missing tensor, a
/// shape mismatch with the expected and found shapes, a tensor the model lacks, an unreadable
/// dtype, a head of another class count without replace_head) and what to do; CheckpointError
/// when the file is not safetensors.
TorchvisionLoadReport load_torchvision_weights(const std::filesystem::path& file,
                                               const ImageModel& model, float* params,
                                               float* buffers, bool replace_head);

/// Writes `params` (flat layout, fp32) and `buffers` (Σ state_buffers() numel fp32) of `model` to
/// `file` as a torchvision-named fp32 safetensors (the format load_torchvision_weights reads;
/// weights in torchvision's layouts). Not atomic. Throws RuntimeFailure on I/O errors.
void save_torchvision_weights(const std::filesystem::path& file, const ImageModel& model,
                              const float* params, const float* buffers);

}  // namespace shardtrain
