#include "monitor/render_png.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <vector>

#include "core/process.h"

extern char** environ;

namespace shardtrain {
namespace {

/// Runs `argv` (argv[0] a full path) with stdout and stderr sent to /dev/null; true when it exits
/// with status 0.
bool run_quietly(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t files;
  if (posix_spawn_file_actions_init(&files) != 0) return false;
  posix_spawn_file_actions_addopen(&files, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&files, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&files, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, args[0], &files, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  if (rc != 0) return false;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

bool has_png_signature(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  char head[8] = {};
  return in.read(head, sizeof head) && std::string(head, 8) == "\x89PNG\r\n\x1a\n";
}

}  // namespace

std::string png_renderer() {
  std::string r = find_on_path("rsvg-convert");
  return r.empty() ? find_on_path("convert") : r;
}

bool render_png(const std::filesystem::path& svg, const std::filesystem::path& png) {
  const std::string renderer = png_renderer();
  if (renderer.empty()) return false;
  std::error_code ec;
  // Absolute paths never start with '-', so neither renderer can take one for an option.
  const std::filesystem::path in = std::filesystem::absolute(svg, ec);
  if (ec) return false;
  const std::filesystem::path out = std::filesystem::absolute(png, ec);
  if (ec) return false;
  const std::filesystem::path tmp = out.string() + ".tmp";
  std::vector<std::string> argv;
  if (std::filesystem::path(renderer).filename() == "rsvg-convert")
    argv = {renderer, "--format", "png", "--output", tmp.string(), in.string()};
  else  // ImageMagick: the format prefixes keep ':' or '[' in the names from being read as such
    argv = {renderer, "svg:" + in.string(), "png:" + tmp.string()};
  const bool ok = run_quietly(argv) && has_png_signature(tmp);
  if (ok) std::filesystem::rename(tmp, out, ec);
  std::error_code ignored;
  std::filesystem::remove(tmp, ignored);  // left behind by a failed renderer
  return ok && !ec;
}

}  // namespace shardtrain
