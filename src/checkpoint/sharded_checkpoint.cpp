#include "checkpoint/sharded_checkpoint.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "config/knob.h"
#include "core/error.h"
#include "io/atomic_file.h"

namespace shardtrain {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr StateTensor kQuantities[] = {StateTensor::kParams, StateTensor::kExpAvg,
                                       StateTensor::kExpAvgSq};

/// The quantities a checkpoint of `kind` holds per element: SGD has no exp_avg_sq.
std::vector<StateTensor> quantities_of(OptimizerKind kind) {
  if (kind == OptimizerKind::kSGD) return {StateTensor::kParams, StateTensor::kExpAvg};
  return {std::begin(kQuantities), std::end(kQuantities)};
}

const char* tensor_name(StateTensor q) {
  switch (q) {
    case StateTensor::kExpAvg:
      return "exp_avg";
    case StateTensor::kExpAvgSq:
      return "exp_avg_sq";
    case StateTensor::kParams:
      break;
  }
  return "params";
}

std::string sidecar_name(int rank) { return fmt::format("rank-{:05d}.json", rank); }
std::string hex(uint64_t h) { return fmt::format("{:016x}", h); }

json layout_json(const ParamLayout& layout) {
  json tensors = json::array();
  for (const ParamTensor* t : layout.tensors())
    tensors.push_back(
        {{"name", t->name}, {"shape", t->shape}, {"offset", t->offset}, {"numel", t->numel}});
  return {{"numel", layout.numel()}, {"tensors", tensors}};
}

json ranges_json(const std::vector<FlatRange>& ranges) {
  json out = json::array();
  for (const FlatRange& r : ranges) out.push_back({r.offset, r.numel});
  return out;
}

/// Calls fn(offset, count) for consecutive pieces of at most `chunk` elements of `r`.
template <typename F>
void for_each_chunk(const FlatRange& r, int64_t chunk, F&& fn) {
  for (int64_t done = 0; done < r.numel; done += chunk)
    fn(r.offset + done, std::min(chunk, r.numel - done));
}

/// Where a piece of the flat layout lies in a format-2 checkpoint.
struct Piece {
  int64_t offset = 0;  ///< flat element
  int64_t numel = 0;
  int rank = 0;             ///< the rank whose file holds it
  int64_t file_offset = 0;  ///< element offset inside that file's tensors
};

/// Reads ranges of a checkpoint's state, of either format. Format 2: random-access reads of the
/// shard files; format 1: the (small, legacy) files are loaded whole on first use.
class StateReader {
 public:
  StateReader(const CheckpointInfo& info, const ParamLayout& layout, bool with_optimizer)
      : info_(info), layout_(layout), with_optimizer_(with_optimizer) {
    if (info.version < 2) return;
    check_checkpoint_layout(info, layout);
    try {
      parse_manifest();
    } catch (const json::exception& e) {
      throw CheckpointError(
          fmt::format("{}/manifest.json is corrupt: {}", info.dir.string(), e.what()));
    }
  }

  /// Verifies the checksums of the files that hold any of `ranges` (each read in full, in
  /// pieces of 1 MiB). Throws CheckpointError naming the file and its rank.
  void verify(const std::vector<FlatRange>& ranges) {
    if (info_.version < 2) return;  // format 1: load_checkpoint_state verifies
    std::vector<bool> needed(files_.size(), false);
    for (const FlatRange& r : ranges)
      for_each_piece(r.offset, r.numel, [&](const Piece& p, int64_t, int64_t) {
        needed[static_cast<size_t>(p.rank)] = true;
      });
    for (size_t rank = 0; rank < files_.size(); ++rank) {
      if (!needed[rank]) continue;
      const ShardFile& f = files_[rank];
      if (hex(fnv1a64_file(f.path)) != f.fnv1a64)
        throw CheckpointError(
            fmt::format("{} (written by rank {}) fails its checksum: the checkpoint is corrupt; "
                        "resume from an earlier one",
                        f.path.string(), rank));
    }
  }

  /// Copies quantity `q` of the flat elements [offset, offset + count) to `dst`.
  void read(StateTensor q, int64_t offset, int64_t count, float* dst) {
    if (info_.version < 2) {
      read_v1(q, offset, count, dst);
      return;
    }
    for_each_piece(offset, count, [&](const Piece& p, int64_t from, int64_t n) {
      ShardFile& f = files_[static_cast<size_t>(p.rank)];
      if (!f.file) f.file.emplace(f.path);
      f.file->read_range(tensor_name(q), p.file_offset + (from - p.offset), n,
                         dst + (from - offset));
    });
  }

 private:
  struct ShardFile {
    fs::path path;
    std::string fnv1a64;
    std::optional<SafetensorsFile> file;  ///< opened on first read
  };

  void parse_manifest() {
    const json& m = info_.manifest;
    const int world = m.at("world_size").get<int>();
    const json& files = m.at("files");
    for (const json& r : m.at("ranks")) {
      const int rank = r.at("rank").get<int>();
      check<CheckpointError>(rank == static_cast<int>(files_.size()) && rank < world,
                             "{}/manifest.json lists rank {} out of order", info_.dir.string(),
                             rank);
      const std::string name = r.at("file").get<std::string>();
      const fs::path path = info_.dir / name;
      const auto want = files.at(name).at("bytes").get<uint64_t>();
      check<CheckpointError>(fs::exists(path),
                             "checkpoint {} is incomplete: {} (written by rank {} of {}) is "
                             "missing; copy the whole checkpoint directory or resume from an "
                             "earlier checkpoint",
                             info_.dir.string(), name, rank, world);
      const auto have = fs::file_size(path);
      check<CheckpointError>(have == want,
                             "{} (written by rank {} of {}) is {} bytes but the manifest says {}: "
                             "the file is truncated or was replaced; resume from an earlier "
                             "checkpoint",
                             path.string(), rank, world, have, want);
      files_.push_back({path, files.at(name).at("fnv1a64").get<std::string>(), std::nullopt});
      int64_t file_offset = 0;
      for (const json& range : r.at("ranges")) {
        const Piece p{range.at(0).get<int64_t>(), range.at(1).get<int64_t>(), rank, file_offset};
        file_offset += p.numel;
        if (p.numel > 0) pieces_.push_back(p);
      }
    }
    check<CheckpointError>(static_cast<int>(files_.size()) == world,
                           "{}/manifest.json lists {} ranks but a world size of {}",
                           info_.dir.string(), files_.size(), world);
    std::sort(pieces_.begin(), pieces_.end(),
              [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
    int64_t next = 0;
    for (const Piece& p : pieces_) {
      check<CheckpointError>(p.offset == next,
                             "{}/manifest.json: the ranks' ranges do not cover the flat layout "
                             "exactly once (a gap or an overlap at element {}); the checkpoint "
                             "is corrupt",
                             info_.dir.string(), std::min(p.offset, next));
      next += p.numel;
    }
    check<CheckpointError>(next == layout_.numel(),
                           "{}/manifest.json: the ranks' ranges cover {} elements but the layout "
                           "has {}; the checkpoint is corrupt",
                           info_.dir.string(), next, layout_.numel());
  }

  /// fn(piece, from, n) for the intersections [from, from + n) of [offset, offset + count) with
  /// the pieces, ascending.
  template <typename F>
  void for_each_piece(int64_t offset, int64_t count, F&& fn) const {
    auto it = std::upper_bound(pieces_.begin(), pieces_.end(), offset,
                               [](int64_t o, const Piece& p) { return o < p.offset; });
    if (it != pieces_.begin()) --it;
    for (; it != pieces_.end() && it->offset < offset + count; ++it) {
      const int64_t from = std::max(offset, it->offset);
      const int64_t to = std::min(offset + count, it->offset + it->numel);
      if (to > from) fn(*it, from, to - from);
    }
  }

  void read_v1(StateTensor q, int64_t offset, int64_t count, float* dst) {
    if (!full_) full_ = load_checkpoint_state(info_, layout_, with_optimizer_);
    const std::vector<float>& src = q == StateTensor::kParams   ? full_->params
                                    : q == StateTensor::kExpAvg ? full_->exp_avg
                                                                : full_->exp_avg_sq;
    ST_ASSERT(offset >= 0 && offset + count <= static_cast<int64_t>(src.size()));
    std::copy_n(src.begin() + offset, count, dst);
  }

  const CheckpointInfo& info_;
  const ParamLayout& layout_;
  bool with_optimizer_;
  std::vector<ShardFile> files_;   ///< by rank
  std::vector<Piece> pieces_;      ///< ascending flat offsets, covering [0, numel)
  std::optional<FullState> full_;  ///< format 1
};

}  // namespace

std::string shard_file_name(int rank, int world) {
  return fmt::format("rank-{:05d}-of-{:05d}.safetensors", rank, world);
}

void check_checkpoint_layout(const CheckpointInfo& info, const ParamLayout& layout) {
  if (info.version < 2) return;
  const json* lj = nullptr;
  try {
    lj = &info.manifest.at("layout");
    const json& tensors = lj->at("tensors");
    const std::vector<const ParamTensor*> ours = layout.tensors();
    const std::string where = fmt::format("checkpoint {} (model '{}') does not match the model",
                                          info.dir.string(), info.model.name);
    const size_t n = std::min(ours.size(), tensors.size());
    for (size_t i = 0; i < n; ++i) {
      const ParamTensor& t = *ours[i];
      const auto name = tensors[i].at("name").get<std::string>();
      const auto shape = tensors[i].at("shape").get<std::vector<int64_t>>();
      if (name != t.name)
        throw CheckpointError(
            fmt::format("{}: tensor #{} is '{}' in the checkpoint but '{}' in "
                        "the model; pass the checkpoint's {}",
                        where, i, name, t.name, knob_for(&TrainConfig::model).name()));
      if (shape != t.shape || tensors[i].at("offset").get<int64_t>() != t.offset)
        throw CheckpointError(fmt::format(
            "{}: tensor '{}' has shape [{}] in the checkpoint but [{}] in the model; pass the "
            "checkpoint's {}",
            where, name, fmt::join(shape, ", "), fmt::join(t.shape, ", "),
            knob_for(&TrainConfig::model).name()));
    }
    if (ours.size() != tensors.size())
      throw CheckpointError(fmt::format(
          "{}: the checkpoint has {} tensors and the model {}; the first unmatched is '{}'", where,
          tensors.size(), ours.size(),
          ours.size() > n ? ours[n]->name : tensors[n].at("name").get<std::string>()));
    check<CheckpointError>(lj->at("numel").get<int64_t>() == layout.numel(),
                           "{}: flat layout of {} elements in the checkpoint but {} in the model",
                           where, lj->at("numel").get<int64_t>(), layout.numel());
  } catch (const json::exception& e) {
    throw CheckpointError(
        fmt::format("{}/manifest.json is corrupt: {}", info.dir.string(), e.what()));
  }
}

fs::path save_sharded_checkpoint(const fs::path& output_dir, const std::string& name,
                                 const ParamLayout& layout, Strategy& strategy, Communicator& comm,
                                 const CheckpointInfo& info, const ShardedSaveOptions& options) {
  ST_ASSERT(options.chunk_elements > 0);
  const int rank = comm.rank(), world = comm.world_size();
  // The same id on every rank without communication: a stale directory of an earlier attempt
  // at this step is removed by rank 0 before anybody writes.
  const std::string id = fmt::format("s{}", info.progress.step);
  const fs::path tmp_dir = output_dir / fmt::format(".{}.tmp.{}", name, id);
  if (rank == 0) create_checkpoint_tmp_dir(output_dir, name, id);
  comm.barrier();

  // ---- every rank: its shard file and sidecar ----
  const std::vector<FlatRange> ranges = strategy.save_ranges();
  int64_t total = 0, largest = 0;
  for (const FlatRange& r : ranges) {
    total += r.numel;
    largest = std::max(largest, r.numel);
  }
  const std::string file = shard_file_name(rank, world);
  const std::vector<StateTensor> quantities = quantities_of(strategy.optimizer_kind());
  std::vector<SafetensorEntry> entries;
  for (StateTensor q : quantities)
    entries.push_back(
        {tensor_name(q), "F32", {total}, nullptr, static_cast<size_t>(total) * sizeof(float), 0});
  int64_t buffer_numel = 0;
  for (const ModelBuffer& b : options.buffer_tensors) buffer_numel += b.numel;
  check<RuntimeFailure>(buffer_numel == static_cast<int64_t>(options.buffers.size()),
                        "checkpoint: {} buffer values for buffers of {} elements (a bug)",
                        options.buffers.size(), buffer_numel);
  if (buffer_numel > 0)
    entries.push_back({"buffers",
                       "F32",
                       {buffer_numel},
                       nullptr,
                       static_cast<size_t>(buffer_numel) * sizeof(float),
                       0});
  SafetensorsWriter writer(tmp_dir / file, entries,
                           {{"format", "shardtrain-shard"},
                            {"rank", std::to_string(rank)},
                            {"world_size", std::to_string(world)}});
  std::vector<float> buf(static_cast<size_t>(std::min(largest, options.chunk_elements)));
  for (StateTensor q : quantities)
    for (const FlatRange& r : ranges)
      for_each_chunk(r, options.chunk_elements, [&](int64_t offset, int64_t n) {
        strategy.read_state(q, offset, n, buf.data());
        writer.write(buf.data(), static_cast<size_t>(n) * sizeof(float));
      });
  if (buffer_numel > 0)
    writer.write(options.buffers.data(), options.buffers.size() * sizeof(float));
  const WrittenFile written = writer.finish();
  const json sidecar = {{"rank", rank},
                        {"world_size", world},
                        {"file", file},
                        {"bytes", written.bytes},
                        {"fnv1a64", hex(written.fnv1a64)},
                        {"numel", total},
                        {"ranges", ranges_json(ranges)}};
  write_file_atomic(tmp_dir / sidecar_name(rank), sidecar.dump(2) + "\n");
  comm.barrier();

  // ---- rank 0: manifest, publish ----
  const fs::path final_dir = output_dir / name;
  if (rank == 0) {
    json ranks = json::array(), files = json::object();
    for (int r = 0; r < world; ++r) {
      json s;
      try {
        s = json::parse(read_file(tmp_dir / sidecar_name(r)));
      } catch (const std::exception& e) {
        throw RuntimeFailure(fmt::format(
            "rank {} did not leave a readable {} in {} ({}): is the output directory on a "
            "filesystem every rank shares?",
            r, sidecar_name(r), tmp_dir.string(), e.what()));
      }
      ranks.push_back({{"rank", r}, {"file", s.at("file")}, {"ranges", s.at("ranges")}});
      files[s.at("file").get<std::string>()] = {
          {"bytes", s.at("bytes")}, {"fnv1a64", s.at("fnv1a64")}, {"rank", r}};
      const auto side = tmp_dir / sidecar_name(r);
      files[sidecar_name(r)] = {
          {"bytes", fs::file_size(side)}, {"fnv1a64", hex(fnv1a64_file(side))}, {"rank", r}};
    }
    json manifest = {{"format", kCheckpointFormat},
                     {"version", kCheckpointVersion},
                     {"model", manifest_model_json(info)},
                     {"layout", layout_json(layout)},
                     {"world_size", world},
                     {"strategy", strategy.name()},
                     {"ranks", ranks},
                     {"progress", manifest_progress_json(info.progress)},
                     {"optimizer",
                      {{"type", manifest_optimizer_type(strategy.optimizer_kind())},
                       {"step", strategy.optimizer_steps()},
                       {"flat_numel", layout.numel()}}},
                     {"config", info.config},
                     {"files", files}};
    if (!info.loss_scaler.is_null()) manifest["loss_scaler"] = info.loss_scaler;
    if (buffer_numel > 0) {
      json tensors = json::array();
      int64_t offset = 0;
      for (const ModelBuffer& b : options.buffer_tensors) {
        tensors.push_back({{"name", b.name}, {"numel", b.numel}, {"offset", offset}});
        offset += b.numel;
      }
      manifest["buffers"] = {{"numel", buffer_numel}, {"per_rank", true}, {"tensors", tensors}};
    }
    if (options.consolidated_bf16_model) {
      CheckpointInfo shards = info;
      shards.dir = tmp_dir;
      shards.version = 2;
      shards.manifest = manifest;
      HfWeightsWriter model(tmp_dir / "model.safetensors", layout, HfDtype::kBF16);
      for_each_param_tensor(shards, layout,
                            [&](const ParamTensor& t, const float* data) { model.write(t, data); });
      const WrittenFile m = model.finish();
      manifest["files"]["model.safetensors"] = {{"bytes", m.bytes}, {"fnv1a64", hex(m.fnv1a64)}};
      if (!info.image) save_hf_config(tmp_dir, info.model);
    }
    write_file_atomic(tmp_dir / "manifest.json", manifest_text(std::move(manifest)));
    publish_checkpoint_dir(output_dir, tmp_dir, name);
  }
  comm.barrier();
  return final_dir;
}

void load_sharded_checkpoint(const CheckpointInfo& info, const ParamLayout& layout,
                             Strategy& strategy, Communicator& /*comm*/, bool with_optimizer,
                             int64_t chunk_elements) {
  ST_ASSERT(chunk_elements > 0);
  if (with_optimizer) check_state_kind(info.optimizer, strategy.optimizer_kind());
  const std::vector<StateTensor> quantities = quantities_of(info.optimizer);
  StateReader reader(info, layout, with_optimizer);
  const std::vector<FlatRange> ranges = strategy.load_ranges();
  reader.verify(ranges);
  int64_t largest = 0;
  for (const FlatRange& r : ranges) largest = std::max(largest, r.numel);
  std::vector<float> buf(static_cast<size_t>(std::min(largest, chunk_elements)));
  for (const FlatRange& r : ranges)
    for_each_chunk(r, chunk_elements, [&](int64_t offset, int64_t n) {
      for (StateTensor q : quantities) {
        if (!with_optimizer && q != StateTensor::kParams) continue;
        reader.read(q, offset, n, buf.data());
        strategy.write_state(q, offset, n, buf.data());
      }
    });
  strategy.finish_load(with_optimizer ? info.optimizer_step : 0);
}

void capture_model_buffers(Model& model, ShardedSaveOptions& options) {
  options.buffer_tensors = model.state_buffers();
  int64_t n = 0;
  for (const ModelBuffer& b : options.buffer_tensors) n += b.numel;
  options.buffers.assign(static_cast<size_t>(n), 0.0f);
  if (n > 0) model.read_state_buffers(options.buffers.data());
}

void load_model_buffers(const CheckpointInfo& info, Model& model, int rank) {
  const std::vector<ModelBuffer> want = model.state_buffers();
  int64_t n = 0;
  for (const ModelBuffer& b : want) n += b.numel;
  if (n == 0) return;
  const std::string dir = info.dir.string();
  check<CheckpointError>(info.version >= 2 && info.manifest.contains("buffers"),
                         "checkpoint {} holds no state buffers (batch norm running statistics), "
                         "but model '{}' has {} ({} first): it was not saved from this model",
                         dir, model.name(), want.size(), want.front().name);
  std::vector<float> values(static_cast<size_t>(n));
  try {
    const json& bj = info.manifest.at("buffers");
    const json& tensors = bj.at("tensors");
    for (size_t i = 0; i < std::max(want.size(), tensors.size()); ++i) {
      check<CheckpointError>(
          i < want.size() && i < tensors.size(),
          "checkpoint {} has {} state buffers but model '{}' has {}; the first "
          "unmatched is '{}'",
          dir, tensors.size(), model.name(), want.size(),
          i < want.size() ? want[i].name : tensors[i].at("name").get<std::string>());
      const auto name = tensors[i].at("name").get<std::string>();
      const auto numel = tensors[i].at("numel").get<int64_t>();
      check<CheckpointError>(name == want[i].name && numel == want[i].numel,
                             "checkpoint {}: state buffer #{} is '{}' ({} values) in the "
                             "checkpoint but '{}' ({} values) in model '{}'",
                             dir, i, name, numel, want[i].name, want[i].numel, model.name());
    }
    const int world = info.manifest.at("world_size").get<int>();
    const int from = rank < world ? rank : 0;
    const std::string file = shard_file_name(from, world);
    const fs::path path = info.dir / file;
    check<CheckpointError>(fs::exists(path),
                           "checkpoint {} is incomplete: {} (written by rank {} of {}) is missing",
                           dir, file, from, world);
    const json& entry = info.manifest.at("files").at(file);
    check<CheckpointError>(fs::file_size(path) == entry.at("bytes").get<uint64_t>(),
                           "{} (written by rank {} of {}) is truncated or was replaced",
                           path.string(), from, world);
    check<CheckpointError>(hex(fnv1a64_file(path)) == entry.at("fnv1a64").get<std::string>(),
                           "{} (written by rank {}) fails its checksum: the checkpoint is corrupt; "
                           "resume from an earlier one",
                           path.string(), from);
    SafetensorsFile st(path);
    check<CheckpointError>(st.contains("buffers") && st.entry("buffers").bytes == values.size() * 4,
                           "{} holds no 'buffers' tensor of {} values", path.string(), n);
    st.read("buffers", values.data());
  } catch (const json::exception& e) {
    throw CheckpointError(fmt::format("{}/manifest.json is corrupt: {}", dir, e.what()));
  }
  model.write_state_buffers(values.data());
}

void for_each_param_tensor(const CheckpointInfo& info, const ParamLayout& layout,
                           const std::function<void(const ParamTensor&, const float*)>& fn) {
  StateReader reader(info, layout, false);
  reader.verify({FlatRange{0, layout.numel()}});
  std::vector<float> buf;
  for (const ParamTensor* t : layout.tensors()) {
    buf.resize(static_cast<size_t>(t->numel));
    reader.read(StateTensor::kParams, t->offset, t->numel, buf.data());
    fn(*t, buf.data());
  }
}

std::vector<float> load_checkpoint_params(const CheckpointInfo& info, const ParamLayout& layout) {
  std::vector<float> flat(static_cast<size_t>(layout.numel()), 0.0f);
  for_each_param_tensor(info, layout, [&](const ParamTensor& t, const float* data) {
    std::copy_n(data, t.numel, flat.begin() + t.offset);
  });
  return flat;
}

FullState load_full_state(const CheckpointInfo& info, const ParamLayout& layout,
                          bool with_optimizer) {
  if (info.version < 2) return load_checkpoint_state(info, layout, with_optimizer);
  StateReader reader(info, layout, with_optimizer);
  const auto n = static_cast<size_t>(layout.numel());
  reader.verify({FlatRange{0, layout.numel()}});
  FullState s;
  s.params.resize(n);
  reader.read(StateTensor::kParams, 0, layout.numel(), s.params.data());
  if (!with_optimizer) return s;
  const bool has_v = info.optimizer == OptimizerKind::kAdamW;  // SGD: exp_avg only
  s.optimizer = info.optimizer;
  s.exp_avg.resize(n);
  s.exp_avg_sq.resize(has_v ? n : 0);
  reader.read(StateTensor::kExpAvg, 0, layout.numel(), s.exp_avg.data());
  if (has_v) reader.read(StateTensor::kExpAvgSq, 0, layout.numel(), s.exp_avg_sq.data());
  s.optimizer_steps = info.optimizer_step;
  return s;
}

}  // namespace shardtrain
