// Checkpoint and Hugging Face files as untrusted input: safetensors headers validated against the
// file (offsets, sizes, overlaps, dtypes, shapes), manifests range-checked and covered by their own
// checksum, `latest` and shard names that cannot point elsewhere, partial checkpoints cleared.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint/checkpoint.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "test_support.h"

using namespace shardtrain;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

/// A safetensors file's bytes: 8-byte length, header, `data_bytes` zero bytes of data.
std::string safetensors(const std::string& header, size_t data_bytes) {
  const uint64_t n = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + std::string(data_bytes, '\0');
}

std::string parse_error(const std::string& file) {
  try {
    parse_safetensors_header(file, file.size(), "m.safetensors");
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "";
}

TEST(SafetensorsHeader, AcceptsAValidFile) {
  const std::string f = safetensors(
      R"({"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},)"
      R"( "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},)"
      R"( "e": {"dtype": "F8_E4M3", "shape": [0], "data_offsets": [32, 32]}})",
      32);
  const SafetensorsHeader h = parse_safetensors_header(f, f.size(), "m");
  ASSERT_EQ(h.entries.size(), 3u);
  EXPECT_EQ(h.entries.at("a").bytes, 24u);
  EXPECT_EQ(h.entries.at("b").offset, 24u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

TEST(SafetensorsHeader, TrustsNoOffsetOverTheShape) {
  // The issue's reproductions: offsets spanning more, or less, than shape × dtype size.
  EXPECT_CONTAINS(parse_error(safetensors(
                      R"({"w": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 64]}})", 64)),
                  "span 64 bytes but shape [2, 4] of F32 needs 32");
  EXPECT_CONTAINS(parse_error(safetensors(
                      R"({"w": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 0]}})", 32)),
                  "span 0 bytes");
  EXPECT_CONTAINS(parse_error(safetensors(
                      R"({"w": {"dtype": "F32", "shape": [2, 4], "data_offsets": [8, 40]}})", 32)),
                  "outside the file's 32 bytes of data");
  EXPECT_CONTAINS(
      parse_error(safetensors(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                              R"( "v": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
                              24)),
      "overlap");
  EXPECT_CONTAINS(
      parse_error(safetensors(
          R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 0]}})",
          0)),
      "more than 2^64");
}

TEST(SafetensorsHeader, RefusesWhatIsNotAHeader) {
  EXPECT_CONTAINS(parse_error(safetensors("[1, 2]", 0)), "is an array, not an object");
  EXPECT_CONTAINS(parse_error(safetensors(R"({"__metadata__": [1]})", 0)),
                  "\"__metadata__\" is an array");
  EXPECT_CONTAINS(parse_error(safetensors(R"({"__metadata__": {"k": 1}})", 0)),
                  "object of strings");
  EXPECT_CONTAINS(parse_error(safetensors(
                      R"({"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}})", 1)),
                  "dtype 'Q4' is not a safetensors dtype");
  EXPECT_CONTAINS(parse_error(safetensors(
                      R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4)),
                  "not a non-negative integer");
  std::string wraps(8, '\xff');
  EXPECT_CONTAINS(parse_error(wraps + "{}"), "past the end of the file");
  EXPECT_CONTAINS(parse_error("abc"), "fewer than the 8-byte header length");
}

TEST(SafetensorsFile, SaysDirectoryAndDevice) {
  const fs::path dir = test_support::make_temp_dir("st_dir");
  EXPECT_THROW_MSG(SafetensorsFile{dir}, CheckpointError, "is a directory");
  EXPECT_THROW_MSG(SafetensorsFile{fs::path("/dev/zero")}, CheckpointError, "not a regular file");
  fs::remove_all(dir);
}

/// A manifest as training writes it (format 2 keys left out), without its checksum.
json manifest_json() {
  return {{"format", kCheckpointFormat},
          {"version", 2},
          {"model",
           {{"name", "gpt2-micro"},
            {"n_layer", 2},
            {"n_head", 2},
            {"n_embd", 64},
            {"vocab_size", 50257},
            {"n_positions", 1024}}},
          {"progress",
           {{"step", 2},
            {"epoch", 0},
            {"step_in_epoch", 2},
            {"tokens_seen", 128},
            {"rng", {{"algorithm", "splitmix64(seed, epoch)"}, {"seed", 42}}}}},
          {"optimizer", {{"type", "AdamW"}, {"step", 2}, {"flat_numel", 100}}},
          {"config", {{"lr", 0.0006}}},
          {"files", {{"model.safetensors", {{"bytes", 10}, {"fnv1a64", "0123456789abcdef"}}}}}};
}

std::string manifest_error(const std::string& text, bool verify = true) {
  try {
    parse_checkpoint_manifest(text, "ck", verify);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "";
}

TEST(Manifest, RoundTripsWithItsChecksum) {
  const std::string text = manifest_text(manifest_json());
  EXPECT_CONTAINS(text, kManifestChecksumKey);
  const CheckpointInfo info = parse_checkpoint_manifest(text, "ck");
  EXPECT_EQ(info.model.n_head, 2);
  EXPECT_EQ(info.progress.step, 2);
  EXPECT_EQ(info.progress.seed, 42u);
  EXPECT_EQ(info.optimizer_step, 2);
  // Written before manifests had a checksum: read as before.
  EXPECT_NO_THROW(parse_checkpoint_manifest(manifest_json().dump(2), "ck"));
}

TEST(Manifest, AnEditIsCaughtByTheChecksum) {
  json m = json::parse(manifest_text(manifest_json()));
  m["progress"]["step"] = 1;
  EXPECT_CONTAINS(manifest_error(m.dump(2)), "fails its checksum");
  // Re-indented but unchanged: still valid (the checksum covers the content, not the layout).
  EXPECT_EQ(manifest_error(json::parse(manifest_text(manifest_json())).dump()), "");
}

TEST(Manifest, ModelShapeIsValidatedBeforeAnythingIsSized) {
  const auto with = [](const char* key, json value) {
    json m = manifest_json();
    m["model"][key] = std::move(value);
    return manifest_text(m);
  };
  EXPECT_CONTAINS(manifest_error(with("n_head", 0)), "model.n_head is 0;");
  EXPECT_CONTAINS(manifest_error(with("n_layer", -3)), "model.n_layer is -3;");
  EXPECT_CONTAINS(manifest_error(with("n_embd", 1e30)), "model.n_embd");
  EXPECT_CONTAINS(manifest_error(with("n_embd", "64")), "model.n_embd");
  EXPECT_CONTAINS(manifest_error(with("n_head", 3)), "not divisible by n_head 3");
  EXPECT_CONTAINS(manifest_error(with("resid_pdrop", 1.5)), "model.resid_pdrop");
}

TEST(Manifest, CountsAndFileNamesAreChecked) {
  json m = manifest_json();
  m["progress"]["step"] = -1;
  EXPECT_CONTAINS(manifest_error(manifest_text(m)), "progress.step");
  m = manifest_json();
  m["files"]["../../etc/passwd"] = {{"bytes", 1}, {"fnv1a64", "0123456789abcdef"}};
  EXPECT_CONTAINS(manifest_error(manifest_text(m)), "does not name a file of the checkpoint");
  m = manifest_json();
  m["files"]["model.safetensors"]["fnv1a64"] = "xyz";
  EXPECT_CONTAINS(manifest_error(manifest_text(m)), "16 hex digits");
  EXPECT_CONTAINS(manifest_error("[1]"), "is an array");
  EXPECT_CONTAINS(manifest_error("{\"format\": \"shardtrain-checkpoint\", \"version\": 1e999}"),
                  "out of range");
}

TEST(Checkpoints, LatestCannotPointOutsideTheOutputDirectory) {
  const fs::path dir = test_support::make_temp_dir("latest");
  std::ofstream(dir / "latest") << "../../etc\n";
  EXPECT_THROW_MSG(resolve_checkpoint(dir), CheckpointError, "not the name of a checkpoint");
  fs::remove_all(dir);
}

TEST(Checkpoints, PartialCheckpointsAreRemovedAndFinishedOnesKept) {
  const fs::path dir = test_support::make_temp_dir("partial");
  for (const char* d : {".checkpoint-000010.tmp.123/x", ".checkpoint-000005.old.77",
                        "checkpoint-000005", ".config"})
    fs::create_directories(dir / d);
  const std::vector<fs::path> removed = remove_partial_checkpoints(dir);
  EXPECT_EQ(removed.size(), 2u);
  EXPECT_FALSE(fs::exists(dir / ".checkpoint-000010.tmp.123"));
  EXPECT_FALSE(fs::exists(dir / ".checkpoint-000005.old.77"));
  EXPECT_TRUE(fs::exists(dir / "checkpoint-000005"));
  EXPECT_TRUE(fs::exists(dir / ".config"));
  fs::remove_all(dir);
}

}  // namespace
