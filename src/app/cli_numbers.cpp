// Every numeric flag of every subcommand refuses what its variable cannot hold (see commands.h).
#include <fmt/core.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "app/commands.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

/// A finite number written in full (CLI11 itself accepts "nan", "inf" and "1e999" → inf).
CLI::Validator finite_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v))
          return fmt::format("must be a finite number, got {}", excerpt(s, 40));
        return {};
      },
      "");
}

/// A decimal integer within 64 bits (CLI11 itself saturates 99999999999999999999 and wraps -5 into
/// an unsigned variable; its narrowing check to int32 happens after that).
CLI::Validator whole_number(bool is_unsigned) {
  return CLI::Validator(
      [is_unsigned](std::string& s) -> std::string {
        const char* first = s.data();
        const char* last = s.data() + s.size();
        const char* start = first + (!s.empty() && s[0] == '+');
        std::from_chars_result r{};
        if (is_unsigned) {
          uint64_t v = 0;
          r = std::from_chars(start, last, v);
        } else {
          int64_t v = 0;
          r = std::from_chars(start, last, v);
        }
        const std::errc ec = r.ec;
        const char* end = r.ptr;
        if (ec == std::errc::result_out_of_range)
          return fmt::format("{} is out of range: at most {}", excerpt(s, 40),
                             is_unsigned ? "18446744073709551615" : "9223372036854775807");
        if (s.empty() || ec != std::errc() || end != last)
          return fmt::format("must be {} integer, got {}", is_unsigned ? "a non-negative" : "an",
                             excerpt(s, 40));
        return {};
      },
      "");
}

void add_checks(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    // The variable's type as CLI11 names it ("FLOAT", "INT", "UINT"), before any validator's
    // description (":POSITIVE"). Flags given another type name ("N", "GIB") check themselves.
    const std::string full = opt->get_type_name();
    const std::string type = full.substr(0, full.find(':'));
    if (type == "FLOAT")
      opt->check(finite_number());
    else if (type == "INT")
      opt->check(whole_number(false));
    else if (type == "UINT")
      opt->check(whole_number(true));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) add_checks(*sub);
}

}  // namespace

void register_all_commands(CLI::App& app) {
  register_train_command(app);
  register_tokenize_command(app);
  register_generate_command(app);
  register_launch_command(app);
  register_export_command(app);
  register_estimate_command(app);
  register_consolidate_command(app);
  register_pipeline_sim_command(app);
  register_data_dir_command(app);
  register_compare_command(app);
  register_report_command(app);
  register_env_command(app);
  register_config_command(app);
  add_checks(app);
}

}  // namespace shardtrain
