#include "monitor/plot.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/process.h"

extern char** environ;

namespace shardtrain {
namespace fs = std::filesystem;
namespace {

/// `s` as a gnuplot double-quoted string.
std::string quote(const std::string& s) {
  std::string q = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') q += '\\';
    q += c;
  }
  return q + "\"";
}

/// A data-file field: no tabs or newlines inside, "NaN" for missing numbers.
std::string field(const std::string& s) {
  std::string f = s.empty() ? "-" : s;
  for (char& c : f)
    if (c == '\t' || c == '\n' || c == '"') c = ' ';
  return "\"" + f + "\"";
}
std::string number(double v) { return std::isfinite(v) ? fmt::format("{:.9g}", v) : "NaN"; }

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();  // a full disk shows when the buffer is written
  check<RuntimeFailure>(static_cast<bool>(out), "cannot write {} (disk full?)", path.string());
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// Runs gnuplot on `script` (its messages into `log`); throws RuntimeFailure when it fails.
void run_gnuplot(const fs::path& script, const fs::path& log) {
  const std::string gnuplot = gnuplot_program();
  check<RuntimeFailure>(
      !gnuplot.empty(),
      "gnuplot is not installed (or $SHARDTRAIN_GNUPLOT is not an executable): install it "
      "(apt-get install gnuplot-nox, or scripts/setup.sh), or set SHARDTRAIN_GNUPLOT to its full "
      "path");
  const std::string script_path = fs::absolute(script).string();
  const std::string log_path = fs::absolute(log).string();
  std::vector<char*> args = {const_cast<char*>(gnuplot.c_str()),
                             const_cast<char*>(script_path.c_str()), nullptr};
  posix_spawn_file_actions_t files;
  check<RuntimeFailure>(posix_spawn_file_actions_init(&files) == 0, "posix_spawn failed");
  posix_spawn_file_actions_addopen(&files, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&files, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&files, 1, 2);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, gnuplot.c_str(), &files, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  check<RuntimeFailure>(rc == 0, "cannot run {}: {}", gnuplot, std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    check<RuntimeFailure>(errno == EINTR, "waitpid({}) failed", gnuplot);
  check<RuntimeFailure>(WIFEXITED(status) && WEXITSTATUS(status) == 0, "{} {} failed: {}", gnuplot,
                        script_path, read_text(log));
}

/// The script's opening for one terminal: pngcairo or svg, `width` × `height` pixels.
std::string terminal(const std::string& kind, const fs::path& out, int width, int height) {
  const std::string font = kind == "svg" ? "font 'Helvetica,13'" : "font 'Sans,11'";
  return fmt::format("set terminal {} size {},{} {} noenhanced\nset output {}\n",
                     kind == "svg" ? "svg" : "pngcairo", width, height, font,
                     quote(fs::absolute(out).string()));
}

/// Draws `body` (settings and the plot command) once per terminal, then runs gnuplot.
void draw(const std::string& body, const fs::path& stem, int width, int height) {
  std::string script = "# written by shardtrain (monitor/plot.cpp); run: gnuplot " +
                       fs::path(stem.string() + ".gp").filename().string() + "\n";
  for (const std::string kind : {"pngcairo", "svg"}) {
    script += terminal(kind, stem.string() + (kind == "svg" ? ".svg" : ".png"), width, height);
    script += body;
    script += "unset output\n";
  }
  const fs::path gp = stem.string() + ".gp";
  write_text(gp, script);
  run_gnuplot(gp, stem.string() + ".log");
  std::error_code ec;
  fs::remove(stem.string() + ".log", ec);
}

const char* kCommon =
    "set datafile separator '\\t'\n"
    "set datafile missing 'NaN'\n"
    "set border 3\nset tics nomirror\n"
    "set grid ytics lc rgb '#dddddd'\n"
    "set linetype 1 lc rgb '#4C72B0'\nset linetype 2 lc rgb '#DD8452'\n"
    "set linetype 3 lc rgb '#55A868'\nset linetype 4 lc rgb '#C44E52'\n"
    "set linetype 5 lc rgb '#8172B3'\nset linetype 6 lc rgb '#937860'\n"
    "set linetype 7 lc rgb '#DA8BC3'\nset linetype 8 lc rgb '#8C8C8C'\n";

}  // namespace

std::string gnuplot_program() {
  if (const char* env = std::getenv("SHARDTRAIN_GNUPLOT"); env != nullptr && *env != '\0')
    return ::access(env, X_OK) == 0 ? std::string(env) : std::string();
  return find_on_path("gnuplot");
}

void plot_bars(const BarChart& c, const fs::path& stem, int width, int height) {
  check<RuntimeFailure>(
      !c.categories.empty() && !c.series.empty() && c.values.size() == c.series.size(),
      "plot_bars({}): no data", stem.string());
  std::string data = "category";
  for (const auto& s : c.series) (data += '\t') += field(s);
  data += "\n";
  double top = 0;
  for (size_t i = 0; i < c.categories.size(); ++i) {
    data += field(c.categories[i]);
    double stack = 0;
    for (const auto& v : c.values) {
      const double x = i < v.size() ? v[i] : NAN;
      (data += '\t') += number(x);
      if (std::isfinite(x)) {
        stack += x;
        top = std::max(top, c.stacked ? stack : x);
      }
    }
    data += "\n";
  }
  const fs::path dat = stem.string() + ".dat";
  write_text(dat, data);
  const bool legend = c.series.size() > 1;
  std::string body = kCommon;
  body += fmt::format("set title {}\nset ylabel {}\n", quote(c.title), quote(c.ylabel));
  body += "set style data histograms\nset style fill solid 0.9 border -1\n";
  body += c.stacked ? "set style histogram rowstacked\nset boxwidth 0.6\n"
                    : "set style histogram clustered gap 1\n";
  // Room above the tallest bar for its value label.
  body += fmt::format("set yrange [0:{}]\n", number(top > 0 ? top * 1.12 : 1));
  // The first line of the data file names the series; every clause of the plot skips it.
  body += "set key autotitle columnhead\n";
  body += legend ? "set key outside below center horizontal maxrows 1 width 2\nset bmargin 5\n"
                 : "unset key\n";
  // Slanted labels when they would run into each other (about 7 pixels a character at 960 wide).
  size_t longest = 0;
  for (const std::string& label : c.categories) longest = std::max(longest, label.size());
  const bool slant = c.categories.size() > 6 || longest * c.categories.size() * 7 > 800;
  body += slant ? "set xtics rotate by 25 right\nset bmargin 7\n" : "";
  std::string plot = "plot ";
  const std::string file = quote(fs::absolute(dat).string());
  for (size_t s = 0; s < c.series.size(); ++s)
    plot += fmt::format("{}{} using {}{} title columnheader({})", s ? ", " : "", s ? "''" : file,
                        s + 2, s ? "" : ":xtic(1)", s + 2);
  if (c.value_labels && !c.stacked) {
    // Clustered bars of n series: bar s of category i is centred at i + (s - (n-1)/2) / (n+1).
    const double n = static_cast<double>(c.series.size());
    for (size_t s = 0; s < c.series.size(); ++s)
      plot += fmt::format(
          ", '' using ($0 + ({} - {}) / {}):{}:(sprintf({}, ${})) with labels offset 0,0.6 "
          "notitle",
          static_cast<double>(s), (n - 1) / 2, n + 1, s + 2, quote(c.value_format), s + 2);
  }
  body += plot + "\n";
  draw(body, stem, width, height);
}

void plot_lines(const LineChart& c, const fs::path& stem, int width, int height) {
  check<RuntimeFailure>(!c.series.empty(), "plot_lines({}): no data", stem.string());
  std::string data;
  for (size_t s = 0; s < c.series.size(); ++s) {
    if (s) data += "\n\n";  // gnuplot data blocks: `index s`
    data += "# " + c.series[s].name + "\n";
    for (size_t i = 0; i < c.series[s].x.size() && i < c.series[s].y.size(); ++i)
      data += number(c.series[s].x[i]) + "\t" + number(c.series[s].y[i]) + "\n";
    if (c.series[s].x.empty()) data += "NaN\tNaN\n";
  }
  const fs::path dat = stem.string() + ".dat";
  write_text(dat, data);
  std::string body = kCommon;
  body += fmt::format("set title {}\nset xlabel {}\nset ylabel {}\n", quote(c.title),
                      quote(c.xlabel), quote(c.ylabel));
  body += "set key outside right top vertical\nset grid xtics lc rgb '#dddddd'\n";
  std::string plot = "plot ";
  const std::string file = quote(fs::absolute(dat).string());
  for (size_t s = 0; s < c.series.size(); ++s)
    // Runs that agree draw on top of each other: each line has its own dashes and point shape.
    plot += fmt::format("{}{} index {} using 1:2 with linespoints lw 2 dt {} pt {} ps 0.7 title {}",
                        s ? ", " : "", file, s, s % 5 + 1, s % 6 + 4, quote(c.series[s].name));
  body += plot + "\n";
  draw(body, stem, width, height);
}

}  // namespace shardtrain
