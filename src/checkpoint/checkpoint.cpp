#include "checkpoint/checkpoint.h"

#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <memory>

#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "core/file_input.h"
#include "core/half.h"
#include "core/hash.h"
#include "core/json_input.h"
#include "core/strings.h"
#include "io/atomic_file.h"

namespace shardtrain {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

/// FNV-1a of a checkpoint file as the manifest writes it (16 hex digits).
std::string checksum_hex(const fs::path& p) {
  if (!fs::exists(p))
    throw CheckpointError(fmt::format("checkpoint file {} is missing", p.string()));
  return fmt::format("{:016x}", fnv1a64_file(p));
}

// HF name without the "transformer." prefix (GPT2Model checkpoints on the hub use these).
std::string short_name(const std::string& n) {
  const std::string prefix = "transformer.";
  return n.rfind(prefix, 0) == 0 ? n.substr(prefix.size()) : n;
}

/// Reads a tensor stored as F32, BF16 or F16 into fp32.
void read_as_f32(const SafetensorsFile& st, const std::string& name, const std::string& dtype,
                 float* out) {
  if (dtype == "F32") {
    st.read(name, out);
    return;
  }
  const size_t n = st.entry(name).bytes / 2;
  std::vector<uint16_t> half(n);
  st.read(name, half.data());
  for (size_t i = 0; i < n; ++i)
    out[i] = dtype == "BF16" ? bf16_to_float(half[i]) : fp16_to_float(half[i]);
}

}  // namespace

namespace {

/// A float probability as the double of its shortest decimal form (0.1f is written 0.1, not
/// 0.10000000149011612).
double probability_json(float p) { return std::stod(fmt::format("{}", p)); }

}  // namespace

json manifest_model_json(const GPT2Config& c) {
  json j = {{"name", c.name},     {"n_layer", c.n_layer},       {"n_head", c.n_head},
            {"n_embd", c.n_embd}, {"vocab_size", c.vocab_size}, {"n_positions", c.n_positions}};
  if (c.has_dropout()) {  // only then: manifests without dropout stay as they were
    j["embd_pdrop"] = probability_json(c.embd_pdrop);
    j["attn_pdrop"] = probability_json(c.attn_pdrop);
    j["resid_pdrop"] = probability_json(c.resid_pdrop);
  }
  return j;
}

std::string ImageCheckpointModel::describe() const {
  return fmt::format("image model '{}' ({} classes, input {}×{}×{})", name, num_classes, channels,
                     height, width);
}

json manifest_model_json(const CheckpointInfo& info) {
  if (!info.image) return manifest_model_json(info.model);
  const ImageCheckpointModel& m = *info.image;
  return {{"kind", "image"},
          {"name", m.name},
          {"num_classes", m.num_classes},
          {"input_shape", {m.channels, m.height, m.width}}};
}

std::string checkpoint_model_description(const CheckpointInfo& info) {
  if (info.image) return info.image->describe();
  return fmt::format("GPT-2 model '{}' ({})", info.model.name, info.model.shape_string());
}

void require_gpt2_checkpoint(const CheckpointInfo& info, const std::string& what) {
  check<CheckpointError>(!info.image, "checkpoint {} holds {}: {} works on GPT-2 checkpoints only",
                         info.dir.string(), checkpoint_model_description(info), what);
}

json manifest_progress_json(const TrainingProgress& p) {
  return {{"step", p.step},
          {"epoch", p.epoch},
          {"step_in_epoch", p.step_in_epoch},
          {"tokens_seen", p.tokens_seen},
          {"rng", {{"algorithm", "splitmix64(seed, epoch)"}, {"seed", p.seed}}}};
}

HfDtype parse_hf_dtype(const std::string& s) {
  if (s == "fp32" || s == "f32" || s == "float32") return HfDtype::kF32;
  if (s == "bf16" || s == "bfloat16") return HfDtype::kBF16;
  throw ConfigError(fmt::format("--dtype {} is not supported: use bf16 or fp32", s));
}

namespace {

std::vector<SafetensorEntry> hf_entries(const std::vector<const ParamTensor*>& tensors,
                                        HfDtype dtype) {
  std::vector<SafetensorEntry> entries;
  const size_t esize = dtype == HfDtype::kF32 ? 4 : 2;
  for (const ParamTensor* t : tensors) {
    SafetensorEntry e;
    e.name = t->name;
    e.dtype = dtype == HfDtype::kF32 ? "F32" : "BF16";
    e.shape = t->shape;
    if (t->hf_transposed) std::swap(e.shape[0], e.shape[1]);
    e.bytes = static_cast<size_t>(t->numel) * esize;
    entries.push_back(std::move(e));
  }
  return entries;
}

}  // namespace

HfWeightsWriter::HfWeightsWriter(const fs::path& file, const ParamLayout& layout, HfDtype dtype)
    : HfWeightsWriter(file, layout.tensors(), dtype) {}

HfWeightsWriter::HfWeightsWriter(const fs::path& file, std::vector<const ParamTensor*> tensors,
                                 HfDtype dtype)
    : tensors_(std::move(tensors)),
      dtype_(dtype),
      writer_(file, hf_entries(tensors_, dtype), {{"format", "pt"}}) {}

void HfWeightsWriter::write(const ParamTensor& t, const float* data) {
  if (next_ >= tensors_.size() || tensors_[next_]->name != t.name)
    throw RuntimeFailure(fmt::format("{}: tensor '{}' written out of layout order (expected '{}')",
                                     writer_.path().string(), t.name,
                                     next_ < tensors_.size() ? tensors_[next_]->name : "none"));
  ++next_;
  const auto n = static_cast<size_t>(t.numel);
  std::vector<float> transposed;
  if (t.hf_transposed) {
    const int64_t rows = t.shape[0], cols = t.shape[1];  // ours [out, in]
    transposed.resize(n);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        transposed[static_cast<size_t>(c * rows + r)] = data[r * cols + c];
    data = transposed.data();
  }
  if (dtype_ == HfDtype::kF32) {
    writer_.write(data, n * sizeof(float));
    return;
  }
  std::vector<uint16_t> half(n);
  for (size_t i = 0; i < n; ++i) half[i] = float_to_bf16(data[i]);
  writer_.write(half.data(), n * sizeof(uint16_t));
}

WrittenFile HfWeightsWriter::finish() {
  if (next_ != tensors_.size())
    throw RuntimeFailure(fmt::format("{}: only {} of {} tensors were written",
                                     writer_.path().string(), next_, tensors_.size()));
  return writer_.finish();
}

void save_hf_weights(const fs::path& file, const ParamLayout& layout, const float* flat) {
  HfWeightsWriter w(file, layout, HfDtype::kF32);
  for (const ParamTensor* t : layout.tensors()) w.write(*t, flat + t->offset);
  w.finish();
}

namespace {

/// The safetensors files of a Hugging Face model: one file, or the shards a
/// model.safetensors.index.json maps each tensor name to (opened when first needed).
class HfWeightFiles {
 public:
  explicit HfWeightFiles(const fs::path& file) {
    if (file.extension() != ".json") {
      single_ = std::make_unique<SafetensorsFile>(file);
      return;
    }
    const json index = parse_json_or_throw<CheckpointError>(
        read_file(file), fmt::format("safetensors index {}", file.string()));
    const auto map = index.is_object() ? index.find("weight_map") : index.end();
    if (map == index.end() || !map->is_object())
      throw CheckpointError(fmt::format(
          "safetensors index {} has no \"weight_map\" object (tensor name -> shard file)",
          file.string()));
    for (const auto& [name, shard] : map->items()) {
      const std::string s = shard.is_string() ? shard.get<std::string>() : std::string();
      // A shard is a file beside the index: no path may lead elsewhere.
      if (s.empty() || s.find('/') != std::string::npos || s == "." || s == "..")
        throw CheckpointError(fmt::format(
            "safetensors index {}: weight_map[{}] is {}; it must name a shard file in the same "
            "directory (e.g. \"model-00001-of-00002.safetensors\")",
            file.string(), excerpt(name),
            shard.is_string() ? excerpt(s) : json_type_phrase(shard)));
      map_[name] = file.parent_path() / s;
    }
  }
  /// The file holding tensor `name`, or null.
  const SafetensorsFile* find(const std::string& name) {
    if (single_) return single_->contains(name) ? single_.get() : nullptr;
    const auto it = map_.find(name);
    if (it == map_.end()) return nullptr;
    auto& f = open_[it->second.string()];
    if (!f) f = std::make_unique<SafetensorsFile>(it->second);
    return f->contains(name) ? f.get() : nullptr;
  }

 private:
  std::unique_ptr<SafetensorsFile> single_;
  std::map<std::string, fs::path> map_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;
};

}  // namespace

void load_hf_weights(const fs::path& file, const ParamLayout& layout, float* flat) {
  HfWeightFiles files(file);
  std::vector<std::string> problems;
  std::vector<float> tmp;
  for (const ParamTensor* t : layout.tensors()) {
    std::string name = t->name;
    const SafetensorsFile* found = files.find(name);
    if (!found) found = files.find(name = short_name(t->name));
    if (!found) {
      problems.push_back(fmt::format("missing tensor '{}'", t->name));
      continue;
    }
    const SafetensorsFile& st = *found;
    const SafetensorEntry& e = st.entry(name);
    std::vector<int64_t> want = t->shape;
    if (t->hf_transposed) std::swap(want[0], want[1]);
    if (e.shape != want) {
      problems.push_back(fmt::format("tensor '{}' has shape [{}] but the model needs [{}]", name,
                                     fmt::join(e.shape, ", "), fmt::join(want, ", ")));
      continue;
    }
    if (e.dtype != "F32" && e.dtype != "BF16" && e.dtype != "F16") {
      problems.push_back(
          fmt::format("tensor '{}' is {}; F32, BF16 and F16 can be read", name, e.dtype));
      continue;
    }
    tmp.resize(static_cast<size_t>(t->numel));
    read_as_f32(st, name, e.dtype, tmp.data());
    if (!t->hf_transposed) {
      std::copy(tmp.begin(), tmp.end(), flat + t->offset);
      continue;
    }
    const int64_t rows = t->shape[0], cols = t->shape[1];
    float* dst = flat + t->offset;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = tmp[static_cast<size_t>(c * rows + r)];
  }
  if (!problems.empty()) {
    throw CheckpointError(
        fmt::format("{} does not match the model: {}", file.string(), fmt::join(problems, "; ")));
  }
}

void save_hf_config(const fs::path& dir, const GPT2Config& c) {
  const json cfg = {{"architectures", {"GPT2LMHeadModel"}},
                    {"model_type", "gpt2"},
                    {"vocab_size", c.vocab_size},
                    {"n_positions", c.n_positions},
                    {"n_ctx", c.n_positions},
                    {"n_embd", c.n_embd},
                    {"n_layer", c.n_layer},
                    {"n_head", c.n_head},
                    {"n_inner", nullptr},
                    {"activation_function", "gelu_new"},
                    {"layer_norm_epsilon", 1e-5},
                    {"initializer_range", 0.02},
                    {"resid_pdrop", probability_json(c.resid_pdrop)},
                    {"embd_pdrop", probability_json(c.embd_pdrop)},
                    {"attn_pdrop", probability_json(c.attn_pdrop)},
                    {"scale_attn_weights", true},
                    {"tie_word_embeddings", true},
                    {"bos_token_id", 50256},
                    {"eos_token_id", 50256},
                    {"torch_dtype", "float32"}};
  write_file_atomic(dir / "config.json", cfg.dump(2) + "\n");
}

fs::path create_checkpoint_tmp_dir(const fs::path& output_dir, const std::string& name,
                                   const std::string& id) {
  std::error_code ec;
  fs::create_directories(output_dir, ec);
  if (ec)
    throw RuntimeFailure(
        fmt::format("cannot create output directory {}: {}", output_dir.string(), ec.message()));
  const fs::path tmp_dir = output_dir / fmt::format(".{}.tmp.{}", name, id);
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) throw RuntimeFailure(fmt::format("cannot create {}: {}", tmp_dir.string(), ec.message()));
  return tmp_dir;
}

std::vector<fs::path> remove_partial_checkpoints(const fs::path& output_dir) {
  std::vector<fs::path> removed;
  std::error_code ec;
  for (fs::directory_iterator it(output_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool partial =
        name.rfind(".checkpoint-", 0) == 0 &&
        (name.find(".tmp.") != std::string::npos || name.find(".old.") != std::string::npos) &&
        it->is_directory(ec);
    if (partial) removed.push_back(it->path());
  }
  std::sort(removed.begin(), removed.end());
  for (const fs::path& p : removed) {
    fs::remove_all(p, ec);
    if (ec)
      throw RuntimeFailure(
          fmt::format("cannot remove the partial checkpoint {}: {}", p.string(), ec.message()));
  }
  return removed;
}

fs::path publish_checkpoint_dir(const fs::path& output_dir, const fs::path& tmp_dir,
                                const std::string& name) {
  std::error_code ec;
  fsync_path(tmp_dir);
  const fs::path final_dir = output_dir / name;
  // Swap the finished directory in; an older checkpoint of the same name goes last.
  if (fs::exists(final_dir)) {
    const fs::path old = output_dir / fmt::format(".{}.old.{}", name, ::getpid());
    fs::rename(final_dir, old, ec);
    if (ec)
      throw RuntimeFailure(fmt::format("cannot replace {}: {}", final_dir.string(), ec.message()));
    fs::rename(tmp_dir, final_dir, ec);
    fs::remove_all(old);
  } else {
    fs::rename(tmp_dir, final_dir, ec);
  }
  if (ec)
    throw RuntimeFailure(
        fmt::format("cannot move checkpoint into {}: {}", final_dir.string(), ec.message()));
  fsync_path(output_dir);
  write_file_atomic(output_dir / "latest", name + "\n");
  return final_dir;
}

fs::path save_checkpoint(const fs::path& output_dir, const std::string& name,
                         const ParamLayout& layout, const FullState& state,
                         const CheckpointInfo& info) {
  const fs::path tmp_dir = create_checkpoint_tmp_dir(output_dir, name, std::to_string(::getpid()));
  save_hf_weights(tmp_dir / "model.safetensors", layout, state.params.data());
  std::vector<SafetensorEntry> opt_entries = {{"exp_avg",
                                               "F32",
                                               {static_cast<int64_t>(state.exp_avg.size())},
                                               state.exp_avg.data(),
                                               state.exp_avg.size() * sizeof(float)}};
  if (state.optimizer == OptimizerKind::kAdamW)  // SGD keeps no second moment
    opt_entries.push_back({"exp_avg_sq",
                           "F32",
                           {static_cast<int64_t>(state.exp_avg_sq.size())},
                           state.exp_avg_sq.data(),
                           state.exp_avg_sq.size() * sizeof(float)});
  write_safetensors(tmp_dir / "optimizer.safetensors", opt_entries);

  if (!info.image) save_hf_config(tmp_dir, info.model);
  json files = json::object();
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    files[f] = {{"bytes", fs::file_size(tmp_dir / f)}, {"fnv1a64", checksum_hex(tmp_dir / f)}};
  }
  json manifest = {{"format", kCheckpointFormat},
                   {"version", 1},
                   {"model", manifest_model_json(info)},
                   {"progress", manifest_progress_json(info.progress)},
                   {"optimizer",
                    {{"type", manifest_optimizer_type(state.optimizer)},
                     {"step", state.optimizer_steps},
                     {"flat_numel", layout.numel()}}},
                   {"config", info.config},
                   {"files", files}};
  write_file_atomic(tmp_dir / "manifest.json", manifest_text(std::move(manifest)));
  return publish_checkpoint_dir(output_dir, tmp_dir, name);
}

fs::path resolve_checkpoint(const fs::path& dir) {
  if (fs::exists(dir / "manifest.json")) return dir;
  if (fs::exists(dir / "latest")) {
    std::string name =
        read_input_file_or_throw<CheckpointError>(dir / "latest", "checkpoint pointer", 4096);
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    // `latest` names a checkpoint directory beside it, nothing elsewhere.
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      throw CheckpointError(fmt::format(
          "{}/latest holds {}, not the name of a checkpoint directory beside it (e.g. "
          "checkpoint-000300): the file is corrupt; pass a checkpoint directory instead",
          dir.string(), excerpt(name)));
    const fs::path p = dir / name;
    if (fs::exists(p / "manifest.json")) return p;
    throw CheckpointError(
        fmt::format("{}/latest names {}, which has no manifest.json: the "
                    "checkpoint was removed; pass a checkpoint directory instead",
                    dir.string(), excerpt(name)));
  }
  throw CheckpointError(fmt::format(
      "no checkpoint at {}: expected a checkpoint directory (with manifest.json) or an output "
      "directory with a 'latest' file",
      dir.string()));
}

CheckpointInfo read_checkpoint_info(const fs::path& path) {
  const fs::path dir = resolve_checkpoint(path);
  return parse_checkpoint_manifest(
      read_input_file_or_throw<CheckpointError>(dir / "manifest.json", "checkpoint manifest",
                                                kMaxConfigFileBytes),
      dir);
}

FullState load_checkpoint_state(const CheckpointInfo& info, const ParamLayout& layout,
                                bool with_optimizer) {
  check<CheckpointError>(info.version == 1,
                         "{} is a format-{} checkpoint; load_checkpoint_state reads format 1 (a "
                         "bug: call load_full_state)",
                         info.dir.string(), info.version);
  const json& files = info.files;
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    if (!with_optimizer && std::string(f) == "optimizer.safetensors") continue;
    const fs::path p = info.dir / f;
    if (!fs::exists(p))
      throw CheckpointError(
          fmt::format("checkpoint {} is incomplete: {} is missing", info.dir.string(), f));
    const auto want_bytes = files.at(f).at("bytes").get<uint64_t>();
    if (fs::file_size(p) != want_bytes)
      throw CheckpointError(
          fmt::format("{} is {} bytes but the manifest says {}: the file is "
                      "truncated or was replaced",
                      p.string(), fs::file_size(p), want_bytes));
    if (checksum_hex(p) != files.at(f).at("fnv1a64").get<std::string>())
      throw CheckpointError(
          fmt::format("{} fails its checksum: the checkpoint is corrupt; resume "
                      "from an earlier one",
                      p.string()));
  }
  FullState s;
  const auto n = static_cast<size_t>(layout.numel());
  s.params.assign(n, 0.0f);
  load_hf_weights(info.dir / "model.safetensors", layout, s.params.data());
  if (!with_optimizer) return s;
  SafetensorsFile opt(info.dir / "optimizer.safetensors");
  const bool has_v = info.optimizer == OptimizerKind::kAdamW;  // SGD: exp_avg only
  for (const char* key : {"exp_avg", "exp_avg_sq"}) {
    if (!has_v && std::string(key) == "exp_avg_sq") continue;
    const auto& e = opt.entry(key);
    if (e.bytes != n * sizeof(float))
      throw CheckpointError(fmt::format("{}: '{}' holds {} elements but the model's layout has {}",
                                        info.dir.string(), key, e.bytes / sizeof(float), n));
  }
  s.optimizer = info.optimizer;
  s.exp_avg.resize(n);
  s.exp_avg_sq.resize(has_v ? n : 0);
  opt.read("exp_avg", s.exp_avg.data());
  if (has_v) opt.read("exp_avg_sq", s.exp_avg_sq.data());
  s.optimizer_steps = info.optimizer_step;
  return s;
}

}  // namespace shardtrain
