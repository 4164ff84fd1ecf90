// The `shardtrain` subcommands. Each register_* function adds one subcommand to the CLI11 app
// with a callback that does the work; callbacks throw shardtrain::Error on bad input, which
// main() prints as "error: ..." and turns into exit status 2.
#pragma once

#include <CLI/CLI.hpp>

namespace shardtrain {

void register_train_command(CLI::App& app);         // app/cmd_train.cpp
void register_tokenize_command(CLI::App& app);      // app/cmd_tokenize.cpp
void register_generate_command(CLI::App& app);      // app/cmd_generate.cpp
void register_launch_command(CLI::App& app);        // app/cmd_launch.cpp
void register_export_command(CLI::App& app);        // app/cmd_export.cpp
void register_estimate_command(CLI::App& app);      // app/cmd_estimate.cpp
void register_consolidate_command(CLI::App& app);   // app/cmd_consolidate.cpp
void register_pipeline_sim_command(CLI::App& app);  // app/cmd_pipeline_sim.cpp
void register_data_dir_command(CLI::App& app);      // app/cmd_data_dir.cpp
void register_compare_command(CLI::App& app);       // app/cmd_compare.cpp
void register_report_command(CLI::App& app);        // app/cmd_report.cpp
void register_env_command(CLI::App& app);           // app/cmd_env.cpp
void register_config_command(CLI::App& app);        // app/cmd_config.cpp

/// Registers every subcommand above, then gives every numeric flag of each a check of what its
/// variable can hold: a FLOAT flag refuses nan, inf and numbers beyond a double; an INT or UINT
/// flag refuses anything but a decimal integer within 64 bits (and a UINT one a negative
/// number). (CLI11 reads "nan" as a double, saturates 99999999999999999999 and wraps -5 into an
/// unsigned variable.) app/cli_numbers.cpp.
void register_all_commands(CLI::App& app);

}  // namespace shardtrain
