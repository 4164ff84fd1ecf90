// What `shardtrain launch` reads in, and changes in, the `train` command line it starts on every
// rank. The flags are named through their rows (config/knob.h), as `train` parses them.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace shardtrain {

/// The value `command` ("train", "--device", "cpu", ...) gives train's --device, as
/// "--device cpu" or "--device=cpu" (the last one given); none when it gives none.
std::optional<std::string> given_device(const std::vector<std::string>& command);

/// given_device(command), or "auto" (its default) when absent.
std::string device_flag(const std::vector<std::string>& command);

/// The command a restarted job runs (`launch --max-restarts`): a `train` command resumes from the
/// latest complete checkpoint of its output directory (its --output-dir, else train's default)
/// when that directory has one — `--resume DIR` replaces any --resume it had — and otherwise
/// starts over unchanged; other commands are unchanged. `why` (may be null) receives what was
/// chosen, for the launcher's message.
std::vector<std::string> restart_command(const std::vector<std::string>& command,
                                         std::string* why = nullptr);

}  // namespace shardtrain
