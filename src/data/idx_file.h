// IDX files: the format of MNIST and Fashion-MNIST (LeCun et al., yann.lecun.com/exdb/mnist,
// "FILE FORMATS FOR THE MNIST DATABASE"), read plain or gzip-compressed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

namespace shardtrain {

/// The most elements (bytes) an IDX file may declare: 2^36, far above any real data set.
inline constexpr uint64_t kMaxIdxElements = uint64_t{1} << 36;

/// An IDX array of unsigned bytes: `dims` (e.g. [N, 28, 28] for images, [N] for labels) and
/// its row-major elements.
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;  ///< Π dims bytes
};

/// Reads an IDX file of type 0x08 (unsigned byte): magic 0x00 0x00 0x08 D, then D big-endian
/// uint32 dimensions, then the data. A gzip-compressed file (.gz, as Debian's
/// dataset-fashion-mnist ships them) is decompressed on the fly (zlib). Throws DataError naming
/// the file when it is missing, unreadable, not IDX, of another element type, when its dimensions'
/// product exceeds kMaxIdxElements (checked without overflow), or when its data is shorter (or,
/// uncompressed, longer) than its dimensions say. Memory grows with the data actually read, in
/// pieces of 64 MiB, never to what a header merely claims.
IdxArray read_idx(const std::filesystem::path& path);

/// Writes an unsigned-byte IDX file (gzip-compressed when `path` ends in ".gz"). For tests and
/// tools. Throws DataError when the file cannot be written or data.size() ≠ Π dims.
void write_idx(const std::filesystem::path& path, const IdxArray& array);

}  // namespace shardtrain
