// Helpers about the processes shardtrain starts.
#pragma once

#include <string>

namespace shardtrain {

/// The full path of `program` found on PATH (executable regular files only; a name with a '/'
/// is checked as it is), or "" when it is not there.
std::string find_on_path(const std::string& program);

}  // namespace shardtrain
