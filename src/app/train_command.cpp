#include "app/train_command.h"

#include <fmt/core.h>

#include <filesystem>
#include <optional>

#include "config/knob.h"

namespace shardtrain {
namespace {

/// The value `command[i]` gives `flag` ("--flag V" or "--flag=V"), advancing `i` past it; none
/// when it is another argument.
std::optional<std::string> value_of(const std::vector<std::string>& command, size_t& i,
                                    const std::string& flag) {
  const std::string& a = command[i];
  if (a == flag) {
    if (i + 1 >= command.size()) return std::nullopt;
    return command[++i];
  }
  if (a.rfind(flag + "=", 0) == 0) return a.substr(flag.size() + 1);
  return std::nullopt;
}

}  // namespace

std::optional<std::string> given_device(const std::vector<std::string>& command) {
  const std::string device = knob_for(&TrainConfig::device).name();
  std::optional<std::string> value;
  for (size_t i = 0; i < command.size(); ++i)
    if (auto v = value_of(command, i, device)) value = *v;
  return value;
}

std::string device_flag(const std::vector<std::string>& command) {
  return given_device(command).value_or(TrainConfig{}.device);
}

std::vector<std::string> restart_command(const std::vector<std::string>& command,
                                         std::string* why) {
  if (command.empty() || command[0] != "train") {
    if (why) *why = "the same command";
    return command;
  }
  const std::string output_dir = knob_for(&TrainConfig::output_dir).name();
  const std::string resume = knob_for(&TrainConfig::resume).name();
  std::string out = TrainConfig{}.output_dir;
  std::vector<std::string> kept{command[0]};
  for (size_t i = 1; i < command.size(); ++i) {
    if (value_of(command, i, resume)) continue;  // replaced below
    const size_t at = i;
    if (auto v = value_of(command, i, output_dir)) out = *v;
    kept.insert(kept.end(), command.begin() + static_cast<std::ptrdiff_t>(at),
                command.begin() + static_cast<std::ptrdiff_t>(i) + 1);
  }
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::path(out) / "latest", ec)) {
    if (why) *why = fmt::format("from the start: {} has no complete checkpoint yet", out);
    return command;
  }
  if (why) *why = fmt::format("from the latest checkpoint of {}", out);
  kept.insert(kept.end(), {resume, out});
  return kept;
}

}  // namespace shardtrain
