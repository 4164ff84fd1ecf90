#include "checkpoint/manifest.h"

#include <fmt/core.h>

#include <cstdint>
#include <limits>

#include "core/error.h"
#include "core/hash.h"
#include "core/json_input.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

using nlohmann::json;

std::string checksum_of(const json& manifest_without_checksum) {
  return fmt::format("{:016x}", fnv1a64(manifest_without_checksum.dump()));
}

/// Reads the values of one manifest, naming the file and the key path in every error.
class ManifestReader {
 public:
  explicit ManifestReader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw CheckpointError(
        fmt::format("{}: {} {}: the manifest is corrupt or was edited; use another checkpoint",
                    file_, key, problem));
  }

  const json& member(const json& obj, const std::string& path, const char* key) const {
    const std::string full = path.empty() ? key : path + "." + key;
    if (!obj.is_object()) fail(path, fmt::format("is {}, not an object", json_type_phrase(obj)));
    const auto it = obj.find(key);
    if (it == obj.end()) fail(full, "is missing");
    return *it;
  }

  const json& object(const json& obj, const std::string& path, const char* key) const {
    const json& v = member(obj, path, key);
    if (!v.is_object())
      fail(path.empty() ? key : path + "." + key,
           fmt::format("is {}, not an object", json_type_phrase(v)));
    return v;
  }

  int64_t integer(const json& obj, const std::string& path, const char* key, int64_t lo,
                  int64_t hi) const {
    const json& v = member(obj, path, key);
    return integer_value(v, path.empty() ? key : path + "." + key, lo, hi);
  }

  int64_t integer_value(const json& v, const std::string& full, int64_t lo, int64_t hi) const {
    bool fits = false;
    int64_t x = 0;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      fits = u <= static_cast<uint64_t>(hi);
      if (fits) x = static_cast<int64_t>(u);
      fits = fits && x >= lo;
    } else if (v.is_number_integer()) {
      x = v.get<int64_t>();
      fits = x >= lo && x <= hi;
    }
    if (!fits)
      fail(full,
           fmt::format("is {}; expected an integer in [{}, {}]", json_excerpt(v, 40), lo, hi));
    return x;
  }

  uint64_t unsigned_integer(const json& obj, const std::string& path, const char* key) const {
    const json& v = member(obj, path, key);
    if (!v.is_number_unsigned())
      fail(path + "." + key,
           fmt::format("is {}; expected a non-negative integer", json_excerpt(v, 40)));
    return v.get<uint64_t>();
  }

  std::string string(const json& obj, const std::string& path, const char* key,
                     size_t max_bytes) const {
    const json& v = member(obj, path, key);
    if (!v.is_string() || v.get_ref<const std::string&>().size() > max_bytes)
      fail(path.empty() ? key : path + "." + key,
           fmt::format("is {}; expected a string of at most {} bytes", json_excerpt(v, 40),
                       max_bytes));
    return v.get<std::string>();
  }

  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

constexpr int64_t kMaxCount = std::numeric_limits<int64_t>::max() / 4;

void read_model(const ManifestReader& r, const json& mj, CheckpointInfo& info) {
  const auto kind = mj.is_object() ? mj.find("kind") : mj.end();
  if (kind != mj.end() && *kind == "image") {
    ImageCheckpointModel im;
    im.name = r.string(mj, "model", "name", 256);
    im.num_classes = r.integer(mj, "model", "num_classes", 1, 1 << 20);
    const json& in = r.member(mj, "model", "input_shape");
    if (!in.is_array() || in.size() != 3)
      r.fail("model.input_shape", fmt::format("is {}; expected [C, H, W]", json_excerpt(in, 40)));
    im.channels = r.integer_value(in[0], "model.input_shape[0]", 1, 4);
    im.height = r.integer_value(in[1], "model.input_shape[1]", 1, 1 << 16);
    im.width = r.integer_value(in[2], "model.input_shape[2]", 1, 1 << 16);
    info.image = im;
    info.model.name = im.name;
    return;
  }
  if (kind != mj.end() && *kind != "gpt2")
    r.fail("model.kind",
           fmt::format("is {}; this build reads \"gpt2\" and \"image\"", json_excerpt(*kind, 40)));
  GPT2Config& c = info.model;
  const ModelDimLimits& m = kMaxModelDims;
  c.name = r.string(mj, "model", "name", 256);
  c.n_layer = static_cast<int>(r.integer(mj, "model", "n_layer", 1, m.n_layer));
  c.n_head = static_cast<int>(r.integer(mj, "model", "n_head", 1, m.n_head));
  c.n_embd = static_cast<int>(r.integer(mj, "model", "n_embd", 1, m.n_embd));
  c.vocab_size = static_cast<int>(r.integer(mj, "model", "vocab_size", 1, m.vocab_size));
  c.n_positions = static_cast<int>(r.integer(mj, "model", "n_positions", 1, m.n_positions));
  for (auto [key, field] : {std::pair{"embd_pdrop", &GPT2Config::embd_pdrop},
                            std::pair{"attn_pdrop", &GPT2Config::attn_pdrop},
                            std::pair{"resid_pdrop", &GPT2Config::resid_pdrop}}) {
    const auto it = mj.find(key);
    if (it == mj.end()) continue;
    if (!it->is_number() || !(it->get<double>() >= 0 && it->get<double>() < 1))
      r.fail(std::string("model.") + key,
             fmt::format("is {}; expected a probability in [0, 1)", json_excerpt(*it, 40)));
    c.*field = it->get<float>();
  }
  try {
    validate_gpt2_shape(c, "model");
  } catch (const ConfigError& e) {
    throw CheckpointError(
        fmt::format("{}: {}: the manifest is corrupt or was edited", r.file(), e.what()));
  }
}

}  // namespace

const char* manifest_optimizer_type(OptimizerKind k) {
  return k == OptimizerKind::kSGD ? "SGD" : "AdamW";
}

OptimizerKind parse_manifest_optimizer_type(const std::string& type,
                                            const std::filesystem::path& dir) {
  for (OptimizerKind k : {OptimizerKind::kAdamW, OptimizerKind::kSGD})
    if (type == manifest_optimizer_type(k)) return k;
  throw CheckpointError(fmt::format(
      "{}/manifest.json: optimizer.type \"{}\" is not one this build knows (AdamW, SGD): the "
      "checkpoint was written by a newer shardtrain, or the manifest is corrupt",
      dir.string(), escaped(type)));
}

std::string manifest_text(json manifest) {
  manifest.erase(kManifestChecksumKey);
  const std::string sum = checksum_of(manifest);
  manifest[kManifestChecksumKey] = sum;
  return manifest.dump(2) + "\n";
}

CheckpointInfo parse_checkpoint_manifest(std::string_view text, const std::filesystem::path& dir,
                                         bool verify_checksum) {
  const std::string file = (dir / "manifest.json").string();
  const ManifestReader r(file);
  JsonInputOptions limits;
  limits.max_depth = 32;  // the run configuration nests a few levels
  json m = parse_json_or_throw<CheckpointError>(text, file, limits);
  if (!m.is_object())
    throw CheckpointError(
        fmt::format("{} is {}, not a shardtrain checkpoint manifest", file, json_type_phrase(m)));
  if (const auto sum = m.find(kManifestChecksumKey); sum != m.end()) {
    if (!sum->is_string()) r.fail(kManifestChecksumKey, "is not a string");
    const std::string want = sum->get<std::string>();
    json rest = m;
    rest.erase(kManifestChecksumKey);
    if (verify_checksum && checksum_of(rest) != want)
      throw CheckpointError(
          fmt::format("{} fails its checksum: it was edited or is corrupt; use another checkpoint "
                      "(or restore the file)",
                      file));
  }
  const auto format = m.find("format");
  if (format == m.end() || *format != kCheckpointFormat)
    throw CheckpointError(
        fmt::format("{} is not a shardtrain checkpoint manifest (its \"format\" "
                    "is not \"{}\")",
                    file, kCheckpointFormat));
  CheckpointInfo info;
  info.dir = dir;
  info.version = static_cast<int>(r.integer(m, "", "version", 1, 1 << 20));
  if (info.version > kCheckpointVersion)
    throw CheckpointError(fmt::format(
        "{} was written by a newer shardtrain (format version {}); upgrade shardtrain to read it",
        dir.string(), info.version));
  read_model(r, r.object(m, "", "model"), info);

  const json& pj = r.object(m, "", "progress");
  info.progress.step = r.integer(pj, "progress", "step", 0, kMaxCount);
  info.progress.epoch = r.integer(pj, "progress", "epoch", 0, kMaxCount);
  info.progress.step_in_epoch = r.integer(pj, "progress", "step_in_epoch", 0, kMaxCount);
  info.progress.tokens_seen = r.integer(pj, "progress", "tokens_seen", 0, kMaxCount);
  info.progress.seed = r.unsigned_integer(r.object(pj, "progress", "rng"), "progress.rng", "seed");

  const json& oj = r.object(m, "", "optimizer");
  info.optimizer_step = r.integer(oj, "optimizer", "step", 0, kMaxCount);
  const auto type = oj.find("type");
  if (type != oj.end() && !type->is_string()) r.fail("optimizer.type", "is not a string");
  info.optimizer = parse_manifest_optimizer_type(
      type == oj.end() ? std::string("AdamW") : type->get<std::string>(), dir);

  const json& files = r.object(m, "", "files");
  for (auto it = files.begin(); it != files.end(); ++it) {
    const std::string path = "files." + excerpt(it.key(), 80);
    const std::string& name = it.key();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      r.fail(path, "does not name a file of the checkpoint directory");
    r.unsigned_integer(*it, path, "bytes");
    const std::string sum = r.string(*it, path, "fnv1a64", 16);
    if (sum.size() != 16 || sum.find_first_not_of("0123456789abcdef") != std::string::npos)
      r.fail(path + ".fnv1a64", fmt::format("is {}; expected 16 hex digits", excerpt(sum)));
  }
  info.files = files;
  // The run configuration, for reference: an object, or null / absent (tools and tests that save
  // without one).
  info.config = json::object();
  if (const auto c = m.find("config"); c != m.end() && !c->is_null()) {
    if (!c->is_object()) r.fail("config", "is not an object");
    info.config = *c;
  }
  if (const auto ls = m.find("loss_scaler"); ls != m.end()) {
    if (!ls->is_object() && !ls->is_null()) r.fail("loss_scaler", "is not an object");
    info.loss_scaler = *ls;
  }
  info.manifest = std::move(m);
  return info;
}

}  // namespace shardtrain
