#include "core/json_input.h"

#include <fmt/core.h>

#include <algorithm>
#include <set>
#include <vector>

#include "core/strings.h"

namespace shardtrain {
namespace {

using json = nlohmann::json;

/// Builds the value as nlohmann's DOM parser does (a stack of the open containers; only the top
/// one grows, so pointers to its ancestors stay valid), while keeping the key path for messages,
/// the nesting limit and, when asked, the duplicate-key check.
class BoundedBuilder : public nlohmann::json_sax<json> {
 public:
  BoundedBuilder(std::string_view text, const JsonInputOptions& options)
      : text_(text), options_(options) {}

  bool null() override { return put(json(nullptr)); }
  bool boolean(bool v) override { return put(json(v)); }
  bool number_integer(number_integer_t v) override { return put(json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return put(json(v)); }
  bool number_float(number_float_t v, const string_t&) override { return put(json(v)); }
  bool string(string_t& v) override { return put(json(std::move(v))); }
  bool binary(binary_t& v) override { return put(json::binary(std::move(v))); }

  bool start_object(std::size_t) override { return open(json::object(), false); }
  bool start_array(std::size_t) override { return open(json::array(), true); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }

  bool key(string_t& k) override {
    Frame& f = frames_.back();
    if (options_.reject_duplicate_keys && !f.keys.insert(k).second) {
      error_ = fmt::format("key \"{}\" appears twice in the same object", path_with(k));
      return false;
    }
    f.key = std::move(k);
    return true;
  }

  bool parse_error(std::size_t position, const std::string& last_token,
                   const nlohmann::detail::exception& ex) override {
    const std::string where = location(position);
    const std::string under = frames_.empty() || path().empty()
                                  ? std::string()
                                  : fmt::format(" under key \"{}\"", excerpt_path(path()));
    if (ex.id == 406) {  // out_of_range.406: a number beyond a double
      error_ = fmt::format("{}: number {} {}is out of range (beyond ±1.8e308)", where,
                           excerpt(last_token, 32), under.empty() ? "" : under.substr(1) + " ");
      return false;
    }
    // nlohmann's text: "[json.exception.parse_error.101] parse error at line L, column C:
    // syntax error while parsing <context> - <problem>; last read: '<token>'; expected <what>".
    std::string what = ex.what();
    if (const auto colon = what.find(": ");
        what.rfind("[json.exception", 0) == 0 && colon != std::string::npos) {
      what = what.substr(colon + 2);  // after "... column C: "
    }
    const std::string quoted = "; last read: '" + last_token + "'";
    if (const auto at = what.find(quoted); at != std::string::npos)
      what.replace(at, quoted.size(), "; last read: " + excerpt(last_token, 32));
    if (what.size() > 300) what = what.substr(0, 300) + "...";
    error_ = fmt::format("{}: {}{}", where, what, under);
    return false;
  }

  json take() { return std::move(root_); }
  const std::string& error() const { return error_; }

 private:
  struct Frame {
    json* container = nullptr;
    bool array = false;
    std::size_t index = 0;  ///< arrays: the next element's index
    std::string key;        ///< objects: the key of the value being read
    std::set<std::string> keys;
  };

  /// "zero_optimization.offload_optimizer.ratio", "layers[3].name".
  std::string path() const {
    std::string p;
    for (const Frame& f : frames_) {
      if (f.array) {
        p += fmt::format("[{}]", f.index);
      } else {
        if (!p.empty()) p += '.';
        p += f.key;
      }
    }
    return p;
  }
  std::string path_with(const std::string& k) const {
    std::string p;
    for (std::size_t i = 0; i + 1 < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      p += f.array ? fmt::format("[{}]", f.index) : (p.empty() ? "" : ".") + f.key;
    }
    if (!p.empty()) p += '.';
    return excerpt_path(p + k);
  }
  /// A key path bounded for messages (keys are input too).
  static std::string excerpt_path(const std::string& p) { return escaped(p, 120); }

  /// "line L, column C" (both from 1) of the last byte read when `position` bytes had been
  /// (nlohmann's numbering).
  std::string location(std::size_t position) const {
    const std::size_t end = std::min(position, text_.size());
    const std::string_view before = text_.substr(0, end);
    const auto line = 1 + std::count(before.begin(), before.end(), '\n');
    const std::size_t newline = before.rfind('\n');
    const std::size_t column = newline == std::string_view::npos ? end : end - newline - 1;
    return fmt::format("line {}, column {}", line, column);
  }

  /// Stores `v` where the parser stands; returns the stored value.
  json* store(json&& v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = frames_.back();
    if (f.array) {
      f.container->push_back(std::move(v));
      ++f.index;
      return &f.container->back();
    }
    json& slot = (*f.container)[f.key];
    slot = std::move(v);
    return &slot;
  }
  bool put(json&& v) {
    store(std::move(v));
    return true;
  }
  bool open(json&& empty, bool array) {
    if (static_cast<int>(frames_.size()) >= options_.max_depth) {
      const std::string p = path();
      error_ = fmt::format("nested deeper than {} levels{}: no file shardtrain reads is that deep",
                           options_.max_depth,
                           p.empty() ? std::string() : " under key \"" + excerpt_path(p) + "\"");
      return false;
    }
    json* c = store(std::move(empty));
    // An array's element index was advanced by store(); the child names its own position.
    if (!frames_.empty() && frames_.back().array) --frames_.back().index;
    frames_.push_back(Frame{c, array, 0, {}, {}});
    return true;
  }
  bool close() {
    frames_.pop_back();
    if (!frames_.empty() && frames_.back().array) ++frames_.back().index;
    return true;
  }

  std::string_view text_;
  JsonInputOptions options_;
  json root_;
  std::vector<Frame> frames_;
  std::string error_;
};

}  // namespace

JsonInputResult parse_json_input(std::string_view text, const JsonInputOptions& options) {
  BoundedBuilder builder(text, options);
  JsonInputResult r;
  bool ok = false;
  try {
    ok = json::sax_parse(text, &builder, json::input_format_t::json, /*strict=*/true,
                         options.allow_comments);
  } catch (const json::exception& e) {  // not expected: the builder reports errors itself
    r.error = fmt::format("not valid JSON ({})", e.what());
    return r;
  }
  if (!ok) {
    r.error = builder.error().empty() ? "not valid JSON" : builder.error();
    return r;
  }
  r.value = builder.take();
  return r;
}

std::string json_excerpt(const nlohmann::json& v, std::size_t max_bytes) {
  const std::string d = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (d.size() <= max_bytes) return d;
  std::size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(d[cut]) & 0xC0) == 0x80) --cut;  // whole chars
  return fmt::format("{}... ({} bytes)", d.substr(0, cut),
                     with_commas(static_cast<long long>(d.size())));
}

const char* json_type_phrase(const nlohmann::json& v) {
  switch (v.type()) {
    case json::value_t::object:
      return "an object";
    case json::value_t::array:
      return "an array";
    case json::value_t::string:
      return "a string";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::null:
      return "null";
    case json::value_t::binary:
      return "binary data";
    default:
      return "a number";
  }
}

}  // namespace shardtrain
