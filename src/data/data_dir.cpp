#include "data/data_dir.h"

#include <fmt/core.h>

#include <system_error>

#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {
namespace fs = std::filesystem;

namespace {

// The running program's directory, from /proc/self/exe (empty when it cannot be read).
fs::path executable_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : exe.parent_path();
}

}  // namespace

DataDirLookup find_data_dir() {
  DataDirLookup r;
  const fs::path exe_dir = executable_dir();
  if (!exe_dir.empty()) {
    r.searched = {(exe_dir / ".." / "share" / "shardtrain" / "data").lexically_normal(),
                  exe_dir / "data", (exe_dir / ".." / "data").lexically_normal()};
  }
  if (std::string v = getenv_str("SHARDTRAIN_DATA_DIR"); !v.empty()) {
    r.dir = fs::path(v);
    r.how = "set by $SHARDTRAIN_DATA_DIR";
    return r;
  }
  for (size_t i = 0; i < r.searched.size(); ++i) {
    std::error_code ec;
    if (fs::is_regular_file(r.searched[i] / "gpt2-tokenizer" / "encoder.json", ec)) {
      r.dir = r.searched[i];
      r.how = i == 0 ? "the installed tree, next to the executable"
                     : "the build tree, next to the executable";
      return r;
    }
  }
  return r;
}

std::string data_dir_hint() {
  const DataDirLookup l = find_data_dir();
  const std::string env = getenv_str("SHARDTRAIN_DATA_DIR");
  std::string where = env.empty() ? std::string("$SHARDTRAIN_DATA_DIR (unset)")
                                  : fmt::format("$SHARDTRAIN_DATA_DIR ({})", env);
  if (env.empty()) {
    for (const fs::path& p : l.searched) where += ", " + p.string();
  }
  return fmt::format(
      "looked in {}; install shardtrain with `cmake --install <build> --prefix P` (the data goes "
      "to P/share/shardtrain/data, next to P/bin/shardtrain), run it from its build tree (CMake "
      "unpacks the data into <build>/data), or set SHARDTRAIN_DATA_DIR to a directory holding "
      "gpt2-tokenizer/ and wikitext-2/",
      where);
}

fs::path default_data_dir() {
  DataDirLookup l = find_data_dir();
  if (l.dir.empty()) {
    throw DataError(
        fmt::format("shardtrain's data directory (the GPT-2 tokenizer and "
                    "WikiText-2) was not found: {}",
                    data_dir_hint()));
  }
  return l.dir;
}

}  // namespace shardtrain
