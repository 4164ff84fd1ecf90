#include "checkpoint/image_weights.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>

#include "checkpoint/safetensors.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/half.h"

namespace shardtrain {
namespace fs = std::filesystem;

namespace {

/// One tensor of the model: a parameter (flat offset in params) or a buffer (offset in buffers).
struct Slot {
  std::string name;
  std::vector<int64_t> shape;
  float* dst = nullptr;
  int64_t numel = 0;
  bool head = false;
};

std::string shape_str(const std::vector<int64_t>& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

bool is_num_batches_tracked(const std::string& name) {
  return name.ends_with("num_batches_tracked");
}

void read_f32(const SafetensorsFile& st, const SafetensorEntry& e, float* out) {
  if (e.dtype == "F32") {
    st.read(e.name, out);
    return;
  }
  std::vector<uint16_t> half(e.bytes / 2);
  st.read(e.name, half.data());
  for (size_t i = 0; i < half.size(); ++i)
    out[i] = e.dtype == "BF16" ? bf16_to_float(half[i]) : fp16_to_float(half[i]);
}

}  // namespace

TorchvisionLoadReport load_torchvision_weights(const fs::path& file, const ImageModel& model,
                                               float* params, float* buffers, bool replace_head) {
  const SafetensorsFile st(file);
  const std::vector<std::string> head_names = model.head_parameter_names();
  const std::set<std::string> head(head_names.begin(), head_names.end());
  std::vector<Slot> slots;
  for (const ParamTensor* t : model.layout().tensors())
    slots.push_back({t->name, t->shape, params + t->offset, t->numel, head.count(t->name) != 0});
  int64_t offset = 0;
  for (const ModelBuffer& b : model.state_buffers()) {
    slots.push_back({b.name, {b.numel}, buffers + offset, b.numel, false});
    offset += b.numel;
  }

  TorchvisionLoadReport report;
  const std::string where =
      fmt::format("{} {}", knob_for(&TrainConfig::init_from).name(), file.string());
  // The file's head: its class count, and whether it differs from the model's.
  bool head_differs = false;
  for (const Slot& s : slots) {
    if (!s.head) continue;
    if (!st.contains(s.name)) {
      head_differs = true;
      continue;
    }
    const SafetensorEntry& e = st.entry(s.name);
    if (s.shape.size() == 2 && !e.shape.empty()) report.file_classes = e.shape[0];
    if (e.shape != s.shape) head_differs = true;
  }
  if (head_differs && !replace_head) {
    std::vector<std::string> what;
    for (const Slot& s : slots)
      if (s.head)
        what.push_back(st.contains(s.name)
                           ? fmt::format("'{}' is {} in the file but the model needs {}", s.name,
                                         shape_str(st.entry(s.name).shape), shape_str(s.shape))
                           : fmt::format("'{}' is missing from the file", s.name));
    throw ConfigError(fmt::format(
        "{}: the classifier head does not fit model '{}' with {} classes ({}){}; pass {} to "
        "keep a freshly initialized head and fine-tune (the body is loaded), or train on a data "
        "set with the file's class count",
        where, model.name(), model.spec().num_classes, fmt::join(what, "; "),
        report.file_classes > 0
            ? fmt::format(" — the file's head has {} classes", report.file_classes)
            : std::string(),
        knob_for(&TrainConfig::replace_head).name()));
  }

  std::vector<std::string> problems;
  std::set<std::string> used;
  std::vector<float> tmp;
  for (const Slot& s : slots) {
    used.insert(s.name);
    if (s.head && head_differs) {
      report.fresh_head.push_back(s.name);
      continue;
    }
    if (!st.contains(s.name)) {
      problems.push_back(fmt::format("tensor '{}' (shape {}) is missing from the file", s.name,
                                     shape_str(s.shape)));
      continue;
    }
    const SafetensorEntry& e = st.entry(s.name);
    if (e.shape != s.shape) {
      problems.push_back(fmt::format("tensor '{}': expected shape {}, found {}", s.name,
                                     shape_str(s.shape), shape_str(e.shape)));
      continue;
    }
    if (e.dtype != "F32" && e.dtype != "BF16" && e.dtype != "F16") {
      problems.push_back(
          fmt::format("tensor '{}' is {}; F32, BF16 and F16 can be read", s.name, e.dtype));
      continue;
    }
    tmp.resize(static_cast<size_t>(s.numel));
    read_f32(st, e, tmp.data());
    std::copy(tmp.begin(), tmp.end(), s.dst);
    ++report.tensors_loaded;
  }
  for (const auto& [name, e] : st.entries()) {
    if (used.count(name)) continue;
    if (is_num_batches_tracked(name)) {
      report.ignored.push_back(name);
      continue;
    }
    problems.push_back(fmt::format("tensor '{}' (shape {}) is in the file but not in the model",
                                   name, shape_str(e.shape)));
  }
  if (!problems.empty()) {
    const size_t shown = std::min<size_t>(problems.size(), 6);
    throw ConfigError(fmt::format(
        "{} does not match image model '{}' (input {}×{}×{}, {} classes): {}{}; the file must hold "
        "the torchvision state dict of the same architecture (tools/convert_torchvision.py writes "
        "one) — check {}, the input channels of the data set, and {}",
        where, model.name(), model.spec().channels, model.spec().height, model.spec().width,
        model.spec().num_classes,
        fmt::join(problems.begin(), problems.begin() + static_cast<long>(shown), "; "),
        problems.size() > shown ? fmt::format(" (and {} more)", problems.size() - shown)
                                : std::string(),
        knob_for(&TrainConfig::model).name(), knob_for(&TrainConfig::image_size).name()));
  }
  return report;
}

void save_torchvision_weights(const fs::path& file, const ImageModel& model, const float* params,
                              const float* buffers) {
  std::vector<SafetensorEntry> entries;
  for (const ParamTensor* t : model.layout().tensors())
    entries.push_back({t->name, "F32", t->shape, params + t->offset,
                       static_cast<size_t>(t->numel) * sizeof(float), 0});
  int64_t offset = 0;
  for (const ModelBuffer& b : model.state_buffers()) {
    entries.push_back({b.name,
                       "F32",
                       {b.numel},
                       buffers + offset,
                       static_cast<size_t>(b.numel) * sizeof(float),
                       0});
    offset += b.numel;
  }
  write_safetensors(file, entries, {{"format", "pt"}});
}

}  // namespace shardtrain
