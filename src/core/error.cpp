#include "core/error.h"

namespace shardtrain {

void assertion_failed(const char* expr, const char* file, int line) {
  throw Error(
      fmt::format("internal error: assertion `{}` failed at {}:{} — this is a bug in shardtrain, "
                  "please report it",
                  expr, file, line));
}

}  // namespace shardtrain
