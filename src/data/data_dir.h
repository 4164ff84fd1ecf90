// shardtrain's own data directory (the GPT-2 tokenizer files and WikiText-2): where it is looked
// for, and the hint every missing-data error ends with.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace shardtrain {

/// Where shardtrain's own data (gpt2-tokenizer/ and wikitext-2/) was looked for and found.
/// No path of the build machine is compiled in: the directory is $SHARDTRAIN_DATA_DIR when set,
/// else the first of these, relative to the running executable (/proc/self/exe), that holds
/// gpt2-tokenizer/encoder.json:
///   <exe dir>/../share/shardtrain/data   an installed tree (cmake --install build --prefix P)
///   <exe dir>/data                       the build tree (<build>/shardtrain, <build>/data)
///   <exe dir>/../data                    programs one level down the build tree (<build>/tests)
struct DataDirLookup {
  std::filesystem::path dir;  ///< empty when nothing was found
  std::string how;  ///< "set by $SHARDTRAIN_DATA_DIR", "the installed tree, ..." or "" (none)
  std::vector<std::filesystem::path> searched;  ///< the executable-relative candidates, in order
};
DataDirLookup find_data_dir();

/// find_data_dir()'s directory; throws DataError naming where it looked and the fix when there
/// is none.
std::filesystem::path default_data_dir();

/// "looked in $SHARDTRAIN_DATA_DIR (...), A, B, C; install ... or set SHARDTRAIN_DATA_DIR ...":
/// the end of every missing-data error.
std::string data_dir_hint();

}  // namespace shardtrain
