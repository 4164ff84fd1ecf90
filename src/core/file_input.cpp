#include "core/file_input.h"

#include <fmt/core.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <system_error>

#include "core/strings.h"

namespace shardtrain {
namespace fs = std::filesystem;

std::string regular_file_problem(const fs::path& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    return fmt::format("cannot be read: {}", ec.message());
  if (!fs::exists(st)) return "not found";
  if (fs::is_directory(st)) return "is a directory, not a file";
  if (!fs::is_regular_file(st)) return "is not a regular file (a device, pipe or socket)";
  return {};
}

FileInput read_input_file(const fs::path& path, std::string_view what, uint64_t max_bytes) {
  FileInput out;
  const std::string shown = excerpt(path.string(), 200);
  if (const std::string problem = regular_file_problem(path); !problem.empty()) {
    out.error = fmt::format(
        "cannot open {} {}: {}", what, shown,
        problem == "not found" ? std::string("no such file; check the path") : "it " + problem);
    return out;
  }
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) {
    out.error = fmt::format("cannot read {} {}: {}", what, shown, ec.message());
    return out;
  }
  if (size > max_bytes) {
    out.error = fmt::format(
        "{} {} holds {} bytes, more than the {} such a file can be: is it "
        "the right file?",
        what, shown, with_commas(static_cast<long long>(size)),
        human_bytes(static_cast<double>(max_bytes)));
    return out;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    out.error = fmt::format("cannot open {} {}: {}", what, shown, std::strerror(errno));
    return out;
  }
  out.bytes.resize(size);
  in.read(out.bytes.data(), static_cast<std::streamsize>(size));
  if (static_cast<uint64_t>(in.gcount()) != size) {
    out.error = fmt::format("cannot read {} {}: it shrank while being read", what, shown);
    out.bytes.clear();
  }
  return out;
}

}  // namespace shardtrain
