#include "core/strings.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>

namespace shardtrain {
std::size_t edit_distance(std::string_view a, std::string_view b) {
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1, 0));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[n][m];
}

std::optional<std::string> closest_match(std::string_view name,
                                         const std::vector<std::string>& candidates) {
  if (name.empty() || name.size() > kMaxSuggestedWord) return std::nullopt;
  const std::string key = lowercase(name);
  std::optional<std::string> best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (const auto& c : candidates) {
    if (c.size() > kMaxSuggestedWord) continue;
    const std::size_t d = edit_distance(key, lowercase(c));
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  if (!best || best_distance >= key.size() ||
      best_distance > std::max<std::size_t>(1, key.size() / 3)) {
    return std::nullopt;
  }
  return best;
}

std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates) {
  const auto m = closest_match(word, candidates);
  return m ? fmt::format(" (did you mean '{}'?)", *m) : std::string();
}

namespace {

/// Length of the valid UTF-8 sequence of 2 to 4 bytes at the start of `s`, or 0.
std::size_t utf8_sequence(std::string_view s) {
  const auto b = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(0);
  std::size_t len = 0;
  if (c >= 0xC2 && c <= 0xDF)
    len = 2;
  else if (c >= 0xE0 && c <= 0xEF)
    len = 3;
  else if (c >= 0xF0 && c <= 0xF4)
    len = 4;
  if (len == 0 || s.size() < len) return 0;
  for (std::size_t k = 1; k < len; ++k)
    if ((b(k) & 0xC0) != 0x80) return 0;
  // Overlong forms, surrogates and code points above U+10FFFF (RFC 3629).
  if ((c == 0xE0 && b(1) < 0xA0) || (c == 0xED && b(1) > 0x9F) || (c == 0xF0 && b(1) < 0x90) ||
      (c == 0xF4 && b(1) > 0x8F))
    return 0;
  return len;
}

/// The first `max_bytes` bytes of `text` escaped for a message whose quotes are `quote`.
std::string escape_for_message(std::string_view text, std::size_t max_bytes, char quote) {
  const std::string_view shown = text.substr(0, max_bytes);
  std::string out;
  for (std::size_t i = 0; i < shown.size();) {
    const auto c = static_cast<unsigned char>(shown[i]);
    if (c >= 0x80) {
      const std::size_t len = utf8_sequence(shown.substr(i));
      if (len > 0) {
        out.append(shown.substr(i, len));
        i += len;
      } else {
        out += fmt::format("\\x{:02x}", c);
        ++i;
      }
      continue;
    }
    switch (c) {
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\0':
        out += "\\0";
        break;
      case '\\':
        out += "\\\\";
        break;
      default:
        if (c == static_cast<unsigned char>(quote)) {
          out += '\\';
          out.push_back(quote);
          break;
        }
        if (c < 0x20 || c == 0x7F)
          out += fmt::format("\\x{:02x}", c);
        else
          out.push_back(static_cast<char>(c));
    }
    ++i;
  }
  return out;
}

std::string cut_note(std::string_view text, std::size_t max_bytes) {
  return text.size() > max_bytes
             ? fmt::format("... ({} bytes)", with_commas(static_cast<long long>(text.size())))
             : std::string();
}

}  // namespace

std::string excerpt(std::string_view text, std::size_t max_bytes) {
  std::string out = "'";
  out += escape_for_message(text, max_bytes, '\'');
  out += '\'';
  out += cut_note(text, max_bytes);
  return out;
}

std::string escaped(std::string_view text, std::size_t max_bytes) {
  return escape_for_message(text, max_bytes, '"') + cut_note(text, max_bytes);
}

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i];
  }
  return out;
}

std::string with_commas(long long value) {
  std::string digits = fmt::format("{}", value < 0 ? -value : value);
  std::string out;
  int n = 0;
  for (auto it = digits.rbegin(); it != digits.rend(); ++it) {
    if (n && n % 3 == 0) out.push_back(',');
    out.push_back(*it);
    ++n;
  }
  if (value < 0) out.push_back('-');
  return {out.rbegin(), out.rend()};
}

std::string human_bytes(double bytes) {
  if (bytes < 1024) return fmt::format("{:.0f} B", bytes);
  if (bytes < 1024.0 * 1024) return fmt::format("{:.1f} KiB", bytes / 1024);
  if (bytes < 1024.0 * 1024 * 1024) return fmt::format("{:.1f} MiB", bytes / 1048576.0);
  return fmt::format("{:.2f} GiB", bytes / 1073741824.0);
}

std::string getenv_str(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

std::string lowercase(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string xml_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string svg_begin(double width, double height, double title_x, std::string_view title) {
  return fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" "
      "viewBox=\"0 0 {:.0f} {:.0f}\" font-family=\"sans-serif\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{:.0f}\" y=\"22\" font-size=\"15\">{}</text>\n",
      width, height, width, height, title_x, xml_escape(title));
}

std::optional<int64_t> parse_int64(const std::string& s) {
  int64_t v = 0;
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, v);
  if (ec != std::errc() || ptr != end || s.empty()) return std::nullopt;
  return v;
}

std::optional<double> parse_finite_double(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

}  // namespace shardtrain
