// What guards every reader of untrusted input: bounded, escaped excerpts of input in messages,
// JSON with a nesting limit and numbers that name their key, files that are directories or
// devices said as such, and the last line of defence in the error report (bounded lines, an
// exception escaping an OpenMP region reported as main() would).
#include <gtest/gtest.h>
#include <omp.h>

#include <fstream>
#include <new>
#include <string>

#include "app/error_report.h"
#include "core/error.h"
#include "core/file_input.h"
#include "core/json_input.h"
#include "core/strings.h"
#include "test_support.h"

namespace st = shardtrain;

namespace {

TEST(Excerpt, EscapesControlBytesAndQuotesAndCutsLongInput) {
  EXPECT_EQ(st::excerpt("plain"), "'plain'");
  EXPECT_EQ(st::excerpt(std::string("a\0b\n\t'\\", 7)), "'a\\0b\\n\\t\\'\\\\'");
  EXPECT_EQ(st::excerpt("\x01\x7f"), "'\\x01\\x7f'");
  EXPECT_EQ(st::excerpt("héllo"), "'héllo'");            // valid UTF-8 stays
  EXPECT_EQ(st::excerpt("\xff\xc3("), "'\\xff\\xc3('");  // invalid bytes do not
  const std::string big(50'000'000, 'k');
  const std::string e = st::excerpt(big);
  EXPECT_LT(e.size(), 100u);
  EXPECT_CONTAINS(e, "(50,000,000 bytes)");
  EXPECT_EQ(st::escaped("say \"hi\""), "say \\\"hi\\\"");
}

TEST(Excerpt, NoSuggestionForLongWords) {
  EXPECT_EQ(st::did_you_mean("lrr", {"lr", "eps"}), " (did you mean 'lr'?)");
  // A 50 MB key would need a 50 MB × |candidate| edit-distance matrix: none is computed.
  EXPECT_EQ(st::did_you_mean(std::string(100, 'l') + "r", {"lr"}), "");
  EXPECT_FALSE(st::closest_match(std::string(st::kMaxSuggestedWord + 1, 'x'), {"x"}));
}

TEST(JsonInput, RefusesNestingBeyondTheLimitWithoutRecursion) {
  const std::string deep = "{\"a\": " + std::string(200000, '[') + std::string(200000, ']') + "}";
  const st::JsonInputResult r = st::parse_json_input(deep);
  EXPECT_CONTAINS(r.error, "nested deeper than 64 levels under key \"a");
  st::JsonInputOptions shallow;
  shallow.max_depth = 2;
  EXPECT_CONTAINS(st::parse_json_input("{\"a\": {\"b\": [1]}}", shallow).error,
                  "under key \"a.b\"");
  EXPECT_TRUE(st::parse_json_input("{\"a\": {\"b\": 1}}", shallow).error.empty());
}

TEST(JsonInput, NumberOverflowNamesItsKeyAndLine) {
  const st::JsonInputResult r =
      st::parse_json_input("{\n  \"optimizer\": {\"params\": {\"lr\": 1e309}}\n}");
  EXPECT_CONTAINS(r.error, "line 2");
  EXPECT_CONTAINS(r.error, "1e309");
  EXPECT_CONTAINS(r.error, "optimizer.params.lr");
  EXPECT_CONTAINS(st::parse_json_input("[1, 2, -1e400]").error, "-1e400");
  EXPECT_CONTAINS(st::parse_json_input("{\"x\": [0, {\"y\": 1e999}]}").error, "x[1].y");
}

TEST(JsonInput, BuildsTheSameValueAsNlohmann) {
  const std::string text =
      R"({"a": [1, -2, 3.5, "s", true, null, {"b": []}], "c": {"d": {"e": 18446744073709551615}}})";
  const st::JsonInputResult r = st::parse_json_input(text);
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.value, nlohmann::json::parse(text));
}

TEST(JsonInput, CommentsDuplicatesAndSyntaxErrors) {
  st::JsonInputOptions ds;
  ds.allow_comments = true;
  ds.reject_duplicate_keys = true;
  EXPECT_TRUE(st::parse_json_input("{ // x\n \"a\": 1 /* y */ }", ds).error.empty());
  EXPECT_CONTAINS(st::parse_json_input("{\"a\": {\"b\": 1, \"b\": 2}}", ds).error,
                  "key \"a.b\" appears twice");
  EXPECT_FALSE(st::parse_json_input("{\"a\": 1 // x\n}").error.empty());  // comments: opt-in
  // A syntax error quotes a bounded excerpt of the token, never the whole input.
  const std::string huge = "{\"" + std::string(1 << 20, 'x');
  const std::string e = st::parse_json_input(huge).error;
  EXPECT_CONTAINS(e, "line 1");
  EXPECT_LT(e.size(), 600u);
  EXPECT_CONTAINS(st::parse_json_input("{\"k\": \"a\\u0000b\", }").error, "line 1, column 19");
}

TEST(FileInput, SaysDirectoryDeviceMissingAndTooLarge) {
  const auto dir = st::test_support::make_temp_dir("file_input");
  EXPECT_EQ(st::regular_file_problem(dir), "is a directory, not a file");
  EXPECT_EQ(st::regular_file_problem("/dev/zero"),
            "is not a regular file (a device, pipe or socket)");
  EXPECT_EQ(st::regular_file_problem(dir / "nope"), "not found");
  std::ofstream(dir / "f.json") << "{}";
  EXPECT_EQ(st::read_input_file(dir / "f.json", "config", 100).bytes, "{}");
  EXPECT_CONTAINS(st::read_input_file(dir / "f.json", "config", 1).error, "holds 2 bytes");
  EXPECT_CONTAINS(st::read_input_file("/dev/zero", "DeepSpeed config", 100).error,
                  "cannot open DeepSpeed config '/dev/zero': it is not a regular file");
  std::filesystem::remove_all(dir);
}

TEST(ErrorReport, BoundsLinesAndEscapesControlBytes) {
  const st::ErrorReport r =
      st::plan_error_report("error: ", "bad\x01value " + std::string(10000, 'v'), false, 0, 1, 0);
  EXPECT_CONTAINS(r.text, "bad\\x01value");
  EXPECT_CONTAINS(r.text, "... (");
  EXPECT_LT(r.text.size(), 4200u);
  EXPECT_EQ(r.text.back(), '\n');
}

TEST(ErrorReport, OutOfMemoryIsClassifiedAsSuch) {
  const st::FatalError f = st::classify_exception(std::make_exception_ptr(std::bad_alloc()));
  EXPECT_EQ(f.status, 1);
  EXPECT_CONTAINS(f.message, "out of host memory");
  EXPECT_EQ(st::classify_exception(std::make_exception_ptr(st::DataError("x"))).status, 2);
  EXPECT_EQ(st::classify_exception(std::make_exception_ptr(st::RuntimeFailure("x"))).status, 1);
}

TEST(ErrorReport, OutOfMemoryGetsTheRemedyOfItsMemory) {
  auto message = [](st::Memory m) {
    return st::classify_exception(std::make_exception_ptr(st::OutOfMemory(m, "no room"))).message;
  };
  const std::string gpu = message(st::Memory::kGpu);
  EXPECT_CONTAINS(gpu, "no room. Fix: lower --batch-size");
  EXPECT_CONTAINS(gpu, "--activation-checkpointing");
  EXPECT_CONTAINS(gpu, "zero3");
  EXPECT_CONTAINS(message(st::Memory::kHost), "no room; use a smaller model, --batch-size");
  const std::string pinned = message(st::Memory::kPinnedHost);
  EXPECT_CONTAINS(pinned, "no room, or offload less (zero_optimization.offload_optimizer.ratio");
  EXPECT_CONTAINS(pinned, "(--offload-ratio) < 1");
  EXPECT_CONTAINS(pinned, "zero_optimization.offload_optimizer.device \"nvme\"");
  EXPECT_EQ(st::classify_exception(std::make_exception_ptr(st::OutOfMemory(st::Memory::kHost, "x")))
                .status,
            1);
}

void throw_in_an_openmp_region(const std::exception_ptr& e) {
  st::install_terminate_handler();
#pragma omp parallel num_threads(2)
  {
    if (omp_get_thread_num() == 1) std::rethrow_exception(e);
  }
}

TEST(ErrorReportDeathTest, AnExceptionLeavingAnOpenMPRegionEndsAsMainWould) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(throw_in_an_openmp_region(std::make_exception_ptr(std::bad_alloc())),
              testing::ExitedWithCode(1), "error: out of host memory");
  EXPECT_EXIT(throw_in_an_openmp_region(std::make_exception_ptr(st::DataError("x.jpg is bad"))),
              testing::ExitedWithCode(2), "error: x.jpg is bad");
}

}  // namespace
