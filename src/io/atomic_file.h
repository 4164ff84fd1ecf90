// Crash-safe file and directory replacement: write to a temporary name, fsync, rename.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string_view>

namespace shardtrain {

/// Writes `contents` to `path` atomically (temporary file in the same directory, fsync,
/// rename, fsync of the directory). Throws RuntimeFailure naming the path on failure.
void write_file_atomic(const std::filesystem::path& path, std::string_view contents);

/// fsync()s a file or directory. Throws RuntimeFailure on failure.
void fsync_path(const std::filesystem::path& path);

/// FNV-1a 64 (core/hash.h) of a whole file, read in pieces of 1 MiB. Throws RuntimeFailure
/// naming the path when it cannot be read.
uint64_t fnv1a64_file(const std::filesystem::path& path);

/// Reads a whole file. Throws the given error kind (via a flag) naming the path when missing.
std::string read_file(const std::filesystem::path& path);

}  // namespace shardtrain
