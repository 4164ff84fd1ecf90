// Tokenizing text files of any size on all cores, in bounded memory (`shardtrain tokenize`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace shardtrain {

class BpeTokenizer;

/// The files `shardtrain tokenize` reads for its arguments: a file stands for itself; a
/// directory for the regular files directly inside it whose names do not start with '.', sorted
/// by name (byte order; subdirectories are not descended into). Throws DataError for a missing
/// argument, a device, or a directory holding no such file (naming it and the fix).
std::vector<std::filesystem::path> tokenize_inputs(const std::vector<std::string>& args);

/// Where a streamed tokenization stands once done.
struct StreamTokenizeStats {
  uint64_t bytes = 0;        ///< text bytes read, separators included
  uint64_t tokens = 0;       ///< ids produced
  uint64_t source_hash = 0;  ///< FNV-1a 64 of those bytes (for one file: of the file's bytes)
};

/// Encodes the text T = file₀ + "<|endoftext|>" + file₁ + ... + "<|endoftext|>" + fileₙ₋₁ (the
/// files' exact bytes; GPT-2's end-of-text token separates documents of different files, as
/// GPT-2's training data does) and hands its ids to `sink` in order, several calls of any size.
/// The ids equal BpeTokenizer::encode(T) exactly: for one file, what encode() gives for the
/// whole file. Since "<|endoftext|>" is GPT-2's special token, the ids are those of each file
/// encoded alone, joined by id 50256.
///
/// The text is read `piece_bytes` at a time and cut, about every `piece_bytes` bytes, right
/// before a ' ' or '\n' that is followed by a printable ASCII character other than '<' (see
/// tokenization_cut_points(): GPT-2's pre-tokenizer starts a new piece there, and both bytes are
/// ASCII, so a cut never falls inside a UTF-8 character). Unlike tokenization_cut_points(),
/// invalid UTF-8 does not stop the cuts: the regex has no look-behind and, with
/// PCRE2_MATCH_INVALID_UTF, never matches an invalid byte, so the pieces on both sides of a cut
/// end and start exactly as inside the whole text (tested on random invalid bytes). Batches of
/// pieces (4 per thread) are encoded in parallel with OpenMP on `threads` threads (0: OpenMP's
/// default, all cores) and handed to `sink` in order. Memory: about 4 · threads · piece_bytes of
/// text plus its ids, except that a stretch of text with no cut point (no ' '/'\n' before printable
/// ASCII, e.g. one long line of CJK text or of spaces) is held whole until its end. Throws
/// DataError when a file cannot be read; what `sink` throws propagates.
StreamTokenizeStats encode_files_streaming(
    const BpeTokenizer& tok, const std::vector<std::filesystem::path>& files,
    const std::function<void(std::span<const int32_t>)>& sink, size_t piece_bytes = 1 << 20,
    int threads = 0);

}  // namespace shardtrain
