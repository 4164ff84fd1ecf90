// A checkpoint's manifest.json: written with a checksum of its own content, and read as untrusted
// input (every number range-checked and the model shape validated before anything is sized by it).
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "checkpoint/checkpoint.h"

namespace shardtrain {

/// The key of the manifest's own checksum: FNV-1a 64 (16 hex digits) of the manifest without
/// that key, as nlohmann::json::dump() writes it (compact, keys sorted).
inline constexpr const char* kManifestChecksumKey = "manifest_fnv1a64";

/// `manifest` with its checksum added, as the text manifest.json holds (indented, one newline).
std::string manifest_text(nlohmann::json manifest);

/// Parses the text of `dir`/manifest.json (format 1 and 2: format, version, model, progress,
/// optimizer, files, config, loss_scaler; the format-2 keys stay in `manifest`). Checks the
/// manifest's checksum when it has one (manifests written before it existed have none) and
/// `verify_checksum` is set; every count, step and size as an integer in its range; a GPT-2
/// model's shape with validate_gpt2_shape() and an image model's classes and input shape. Throws
/// CheckpointError naming the file, the key and the value, with bounded excerpts of the input.
CheckpointInfo parse_checkpoint_manifest(std::string_view text, const std::filesystem::path& dir,
                                         bool verify_checksum = true);

}  // namespace shardtrain
