#include "comm/hostfile.h"

#include <fmt/core.h>

#include <map>
#include <sstream>

#include "core/error.h"
#include "core/file_input.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

}  // namespace

std::vector<HostSlots> parse_hostfile(const std::string& text, const std::string& name) {
  std::vector<HostSlots> hosts;
  std::map<std::string, int> seen;
  std::istringstream in(text);
  std::string raw;
  int line_no = 0;
  while (std::getline(in, raw)) {
    ++line_no;
    std::string line = raw.substr(0, raw.find('#'));
    line = trim(line);
    if (line.empty()) continue;
    std::istringstream words(line);
    std::string host, slots, extra;
    words >> host >> slots;
    const bool more = static_cast<bool>(words >> extra);
    int n = 0;
    bool ok = !host.empty() && slots.rfind("slots=", 0) == 0 && !more;
    if (ok) {
      const std::string v = slots.substr(6);
      ok = !v.empty() && v.size() <= 6 && v.find_first_not_of("0123456789") == std::string::npos;
      if (ok) n = std::atoi(v.c_str());
      ok = ok && n >= 1;
    }
    check<ConfigError>(ok,
                       "hostfile {} line {}: {}: expected 'HOST slots=N' with N ≥ 1 (e.g. "
                       "'worker-1 slots=8'); '#' starts a comment",
                       name, line_no, excerpt(trim(raw), 80));
    // The host is passed to ssh and mpirun: a leading '-' would be read as an option of theirs,
    // and only a host name's or address's characters belong in it.
    check<ConfigError>(host.size() <= 255 && host[0] != '-' &&
                           host.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV"
                                                  "WXYZ0123456789.-_:[]@") == std::string::npos,
                       "hostfile {} line {}: host {} is not a host name or address (letters, "
                       "digits and . - _ : [ ] @, at most 255, not starting with '-')",
                       name, line_no, excerpt(host, 80));
    const auto [it, fresh] = seen.emplace(host, line_no);
    check<ConfigError>(fresh, "hostfile {} line {}: host {} is listed again (first on line {})",
                       name, line_no, excerpt(host, 80), it->second);
    hosts.push_back({host, n, line_no});
  }
  check<ConfigError>(!hosts.empty(), "hostfile {} lists no host: add lines like 'worker-1 slots=8'",
                     name);
  return hosts;
}

std::vector<HostSlots> read_hostfile(const std::string& path) {
  return parse_hostfile(
      read_input_file_or_throw<ConfigError>(path, "hostfile", kMaxConfigFileBytes), path);
}

}  // namespace shardtrain
