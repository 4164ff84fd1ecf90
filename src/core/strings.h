// Small string helpers for messages: joining lists and "did you mean" suggestions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace shardtrain {

/// Edit distance (Levenshtein, with adjacent transpositions counting as one edit).
std::size_t edit_distance(std::string_view a, std::string_view b);

/// The candidate closest to `name` by edit distance (ignoring case), if it is close enough to be
/// a plausible typo (at most max(1, |name| / 3) edits); std::nullopt otherwise.
std::optional<std::string> closest_match(std::string_view name,
                                         const std::vector<std::string>& candidates);

/// " (did you mean 'x'?)" for the closest candidate, or "" when none is close. Words longer than
/// kMaxSuggestedWord bytes get no suggestion (no typo is that long, and the edit distance costs
/// |word| × |candidate|).
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates);

/// The longest word closest_match() and did_you_mean() compare, in bytes.
inline constexpr std::size_t kMaxSuggestedWord = 64;

/// A bounded, printable excerpt of untrusted input for messages: `text` in single quotes with
/// control bytes, NUL, DEL, backslash and the quote escaped (\n, \t, \0, \xNN, \', \\) and
/// invalid UTF-8 bytes shown as \xNN. When `text` is longer than `max_bytes` bytes, the first
/// `max_bytes` bytes are quoted and followed by "... (N bytes)". Never longer than about
/// 4 × max_bytes + 40 characters, whatever the input.
std::string excerpt(std::string_view text, std::size_t max_bytes = 64);

/// excerpt() without the quotes, for text shown inside other quotes (a JSON key path in "...").
std::string escaped(std::string_view text, std::size_t max_bytes = 64);

std::string join(const std::vector<std::string>& items, std::string_view sep);

/// 1234567 -> "1,234,567".
std::string with_commas(long long value);

/// `s` in lower case (ASCII).
std::string lowercase(std::string_view s);

/// The environment variable `name`, or "" when it is not set.
std::string getenv_str(const char* name);

/// Bytes as "512 B", "3.2 MiB", "1.50 GiB".
std::string human_bytes(double bytes);

/// `text` with the XML special characters (< > & ") escaped, for SVG text and attributes.
std::string xml_escape(std::string_view text);

/// The whole of `s` as a decimal int64 (std::from_chars); nullopt for an empty string, other
/// characters or a value out of range.
std::optional<int64_t> parse_int64(const std::string& s);

/// The whole of `s` as a finite double (strtod); nullopt for an empty string, other characters,
/// infinities and NaN.
std::optional<double> parse_finite_double(const std::string& s);

/// The start of an SVG picture of `width` × `height` pixels on white, with `title` (escaped) at
/// (title_x, 22) in 15 px sans-serif; close it with "</svg>\n".
std::string svg_begin(double width, double height, double title_x, std::string_view title);

}  // namespace shardtrain
