// Small string helpers for messages: joining lists and "did you mean" suggestions.
#pragma once

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

/// " (did you mean 'x'?)" for the closest candidate, or "" when none is close.
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates);

std::string join(const std::vector<std::string>& items, std::string_view sep);

/// 1234567 -> "1,234,567".
std::string with_commas(long long value);

/// `s` in lower case (ASCII).
std::string lowercase(std::string_view s);

/// The environment variable `name`, or "" when it is not set.
std::string getenv_str(const char* name);

/// Bytes as "512 B", "3.2 MiB", "1.50 GiB".
std::string human_bytes(double bytes);

}  // namespace shardtrain
