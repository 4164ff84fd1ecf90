// Every flag of every subcommand, probed through CLI11 as main() builds it (register_all_commands,
// plus a required flag that is never given, so that parsing stops after the values are converted
// and checked, before any command runs): a flag that refuses "abc" takes a number or a
// name, and must then refuse "nan", "inf" and numbers beyond a double too; a flag that takes "1"
// but refuses "1.5" takes an integer, and must refuse one beyond 64 bits rather than saturate.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "app/commands.h"
#include "core/error.h"

namespace {

enum class Verdict { kAccepted, kRefused };

/// Parses `sub --flag value` on a fresh app; a conversion or validation error of the value (or an
/// option function's ConfigError) is a refusal, anything else (the missing --never-given) an
/// acceptance.
Verdict probe(const std::string& sub, const std::string& flag, const std::string& value) {
  CLI::App app;
  shardtrain::register_all_commands(app);
  std::string never;
  app.add_option("--never-given", never)->required();
  try {
    app.parse(sub + " " + flag + " " + value, false);
  } catch (const CLI::ConversionError&) {
    return Verdict::kRefused;
  } catch (const CLI::ValidationError&) {
    return Verdict::kRefused;
  } catch (const shardtrain::ConfigError&) {  // an option function's own check
    return Verdict::kRefused;
  } catch (const CLI::ParseError&) {
  }
  return Verdict::kAccepted;
}

struct Flag {
  std::string sub, name;
};

std::vector<Flag> value_flags() {
  CLI::App app;
  shardtrain::register_all_commands(app);
  std::vector<Flag> out;
  for (CLI::App* s : app.get_subcommands([](CLI::App*) { return true; }))
    for (const CLI::Option* o : s->get_options())
      if (o->get_type_size() > 0 && !o->get_lnames().empty())
        out.push_back({s->get_name(), "--" + o->get_lnames().front()});
  return out;
}

TEST(CliNumbers, EveryNumericFlagRefusesNanInfinityAndOverflow) {
  const std::vector<Flag> flags = value_flags();
  ASSERT_GT(flags.size(), 60u);  // train alone has more
  int numeric = 0, integer = 0;
  for (const Flag& f : flags) {
    if (probe(f.sub, f.name, "abc") == Verdict::kAccepted) continue;  // text: any value
    ++numeric;
    for (const char* v : {"nan", "-nan", "inf", "-inf", "1e999"})
      EXPECT_EQ(probe(f.sub, f.name, v), Verdict::kRefused) << f.sub << " " << f.name << " " << v;
    if (probe(f.sub, f.name, "1") == Verdict::kAccepted &&
        probe(f.sub, f.name, "1.5") == Verdict::kRefused) {
      ++integer;
      for (const char* v : {"99999999999999999999", "1e23"})
        EXPECT_EQ(probe(f.sub, f.name, v), Verdict::kRefused) << f.sub << " " << f.name << " " << v;
    }
  }
  EXPECT_GT(numeric, 30);
  EXPECT_GT(integer, 15);
}

TEST(CliNumbers, UnsignedFlagsRefuseNegativeNumbers) {
  EXPECT_EQ(probe("train", "--seed", "-5"), Verdict::kRefused);
  EXPECT_EQ(probe("generate", "--seed", "-5"), Verdict::kRefused);
  EXPECT_EQ(probe("train", "--seed", "18446744073709551615"), Verdict::kAccepted);
  EXPECT_EQ(probe("train", "--seed", "18446744073709551616"), Verdict::kRefused);
}

}  // namespace
