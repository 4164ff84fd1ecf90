// Charts drawn by gnuplot (https://gnuplot.info), run as a program: each chart writes its data
// (STEM.dat, tab-separated) and script (STEM.gp) and gnuplot draws STEM.png (pngcairo terminal)
// and STEM.svg (svg terminal), both `width` × `height` pixels. Used by the strategy comparison
// report (train/report.h). gnuplot is found as $SHARDTRAIN_GNUPLOT (a full path) or `gnuplot` on
// PATH; Debian/Ubuntu ship it as gnuplot-nox, which scripts/setup.sh installs.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace shardtrain {

/// The gnuplot program the charts use: $SHARDTRAIN_GNUPLOT when set (it must be executable), else
/// gnuplot's full path on PATH, else "".
std::string gnuplot_program();

/// Bar chart: one group of bars per category (x axis), one bar per series in each group (side
/// by side), or the series stacked on each other (`stacked`).
struct BarChart {
  std::string title;
  std::string ylabel;                   ///< with its unit, e.g. "time per epoch (s)"
  std::vector<std::string> categories;  ///< x-axis labels
  std::vector<std::string> series;      ///< legend entries (one series: no legend)
  /// values[s][c]: series s in category c (NaN: no bar).
  std::vector<std::vector<double>> values;
  bool stacked = false;
  bool value_labels = true;           ///< print each bar's value above it (side-by-side bars only)
  std::string value_format = "%.3g";  ///< printf format of those labels
};

/// Line chart: one line per series (x, y pairs), overlaid.
struct LineChart {
  std::string title;
  std::string xlabel, ylabel;  ///< with their units
  struct Series {
    std::string name;
    std::vector<double> x, y;
  };
  std::vector<Series> series;
};

/// Draws `chart` as STEM.png and STEM.svg (and leaves STEM.dat and STEM.gp beside them). Throws
/// RuntimeFailure when gnuplot is missing (naming the package to install and SHARDTRAIN_GNUPLOT)
/// or fails (with its messages).
void plot_bars(const BarChart& chart, const std::filesystem::path& stem, int width = 960,
               int height = 540);
void plot_lines(const LineChart& chart, const std::filesystem::path& stem, int width = 960,
                int height = 540);

}  // namespace shardtrain
