// JSON read from files shardtrain did not write itself, or that a user may have edited: DeepSpeed
// and model configs, checkpoint manifests, safetensors headers and indexes, limits and reports.
// nlohmann's own parse() is iterative, but a value nested 200,000 deep then overflows the stack
// when it is printed or destroyed, and its messages quote whole tokens; this parser bounds the
// nesting, names the key that holds a bad number, and quotes a bounded excerpt of the input.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/error.h"

namespace shardtrain {

struct JsonInputOptions {
  /// Deepest nesting of objects and arrays accepted (the top-level value is depth 1). No file
  /// shardtrain reads needs more than 10.
  int max_depth = 64;
  /// Accept // and /* */ comments (DeepSpeed reads its configs with hjson).
  bool allow_comments = false;
  /// Refuse an object that holds the same key twice (DeepSpeed does); otherwise the last wins.
  bool reject_duplicate_keys = false;
};

/// What is wrong with a JSON text, or nothing.
struct JsonInputResult {
  nlohmann::json value;
  /// Empty when the text parsed. Otherwise one bounded line without the file's name, e.g.
  /// `line 3, column 14: number 1e309 under key "optimizer.params.lr" is out of range`.
  std::string error;
};

/// Parses `text` within `options`' limits. Never throws for bad input (the result's error says
/// what is wrong); throws std::bad_alloc only.
JsonInputResult parse_json_input(std::string_view text, const JsonInputOptions& options = {});

/// parse_json_input(), throwing E("<what>: <error>") when the text is not acceptable JSON.
/// `what` names the file and its role ("DeepSpeed config 'ds.json'").
template <typename E>
nlohmann::json parse_json_or_throw(std::string_view text, std::string_view what,
                                   const JsonInputOptions& options = {}) {
  JsonInputResult r = parse_json_input(text, options);
  if (!r.error.empty()) throw E(std::string(what) + ": " + r.error);
  return std::move(r.value);
}

/// `v` as JSON text for messages, bounded: its dump() (control characters already escaped, the
/// text valid UTF-8) when at most `max_bytes` long, else its first `max_bytes` bytes (whole
/// UTF-8 characters) and "... (N bytes)".
std::string json_excerpt(const nlohmann::json& v, std::size_t max_bytes = 64);

/// The JSON type of `v` for messages: "an object", "an array", "a string", "a number",
/// "a boolean" or "null".
const char* json_type_phrase(const nlohmann::json& v);

}  // namespace shardtrain
