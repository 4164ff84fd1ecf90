#include "checkpoint/hf_export.h"

#include <fmt/core.h>

#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "backend/backend.h"
#include "checkpoint/sharded_checkpoint.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "model/gpt2.h"

namespace shardtrain {
namespace fs = std::filesystem;

namespace {

void rename_or_throw(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) throw RuntimeFailure(fmt::format("cannot rename {}: {}", from.string(), ec.message()));
}

/// The layout's tensors cut into files of at most `max_bytes` (whole tensors, in order).
std::vector<std::vector<const ParamTensor*>> shard_tensors(const ParamLayout& layout,
                                                           int64_t elem_bytes, int64_t max_bytes) {
  std::vector<std::vector<const ParamTensor*>> shards(1);
  int64_t bytes = 0;
  for (const ParamTensor* t : layout.tensors()) {
    const int64_t b = t->numel * elem_bytes;
    if (!shards.back().empty() && bytes + b > max_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(t);
    bytes += b;
  }
  return shards;
}

}  // namespace

int64_t parse_shard_size(const std::string& text) {
  size_t end = 0;
  double v = 0;
  try {
    v = std::stod(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  const std::string unit = text.substr(end);
  const double scale = unit.empty() || unit == "B" ? 1
                       : unit == "KB"              ? 1e3
                       : unit == "MB"              ? 1e6
                       : unit == "GB"              ? 1e9
                       : unit == "KiB"             ? 1024.0
                       : unit == "MiB"             ? 1048576.0
                       : unit == "GiB"             ? 1073741824.0
                                                   : -1;
  check<ConfigError>(end > 0 && scale > 0 && std::isfinite(v) && v * scale >= 1,
                     "--max-shard-size {}: give bytes, or a number with KB, MB, GB, KiB, MiB or "
                     "GiB (e.g. 5GB, as transformers' save_pretrained)",
                     text);
  return static_cast<int64_t>(v * scale);
}

void export_hf_model(const CheckpointInfo& info, const fs::path& out_dir,
                     const fs::path& tokenizer_dir, HfDtype dtype, int64_t max_shard_bytes) {
  require_gpt2_checkpoint(info, "the Hugging Face GPT-2 export");
  check<ConfigError>(max_shard_bytes >= 1, "the largest shard must be >= 1 byte (got {})",
                     max_shard_bytes);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec)
    throw RuntimeFailure(
        fmt::format("cannot create export directory {}: {}", out_dir.string(), ec.message()));
  auto backend = make_cpu_backend();  // the model's layout only: nothing is allocated
  const GPT2Model model(info.model, *backend);
  const ParamLayout& layout = model.layout();
  const int64_t elem = dtype == HfDtype::kF32 ? 4 : 2;
  const auto shards = shard_tensors(layout, elem, max_shard_bytes);
  const size_t n = shards.size();
  const auto name = [&](size_t k) {
    return n == 1 ? std::string("model.safetensors")
                  : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
  };
  const fs::path index_path = out_dir / "model.safetensors.index.json";
  // A weights file of the other layout would be read instead of (or beside) this export's.
  fs::remove(n == 1 ? index_path : out_dir / "model.safetensors", ec);
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  std::unique_ptr<HfWeightsWriter> writer;
  size_t shard = 0, in_shard = 0;
  const auto partial = [&](size_t k) { return out_dir / (name(k) + ".partial"); };
  for_each_param_tensor(info, layout, [&](const ParamTensor& t, const float* data) {
    if (!writer) writer = std::make_unique<HfWeightsWriter>(partial(shard), shards[shard], dtype);
    writer->write(t, data);
    weight_map[t.name] = name(shard);
    total += t.numel * elem;
    if (++in_shard == shards[shard].size()) {
      writer->finish();
      writer.reset();
      rename_or_throw(partial(shard), out_dir / name(shard));
      ++shard;
      in_shard = 0;
    }
  });
  if (n > 1) {
    const nlohmann::json index = {{"metadata", {{"total_size", total}}},
                                  {"weight_map", weight_map}};
    write_file_atomic(index_path, index.dump(2) + "\n");
  }
  save_hf_config(out_dir, info.model);
  const auto copy = [&](const fs::path& from, const fs::path& to) {
    fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
    if (ec)
      throw RuntimeFailure(
          fmt::format("cannot copy {} to {}: {}", from.string(), to.string(), ec.message()));
  };
  copy(tokenizer_dir / "encoder.json", out_dir / "vocab.json");
  copy(tokenizer_dir / "vocab.bpe", out_dir / "merges.txt");
}

}  // namespace shardtrain
