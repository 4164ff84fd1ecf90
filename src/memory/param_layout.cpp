#include "memory/param_layout.h"

#include <algorithm>

#include "core/error.h"

namespace shardtrain {

static int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

void ParamLayout::add_layer(const std::string& name, std::vector<ParamTensor> tensors) {
  LayerRange layer;
  layer.name = name;
  layer.offset = numel_;
  int64_t off = numel_;
  for (auto& t : tensors) {
    t.numel = 1;
    for (int64_t d : t.shape) t.numel *= d;
    t.offset = off;
    off = align_up(off + t.numel, kAlign);
  }
  layer.tensors = std::move(tensors);
  layer.numel = off - layer.offset;
  numel_ = off;
  layers_.push_back(std::move(layer));
}

void ParamLayout::tie(int reader, const std::string& tensor_name) {
  ST_ASSERT(reader >= 0 && reader < num_layers());
  for (int l = 0; l < reader; ++l) {
    for (const auto& t : layers_[static_cast<size_t>(l)].tensors) {
      if (t.name != tensor_name) continue;
      auto& reads = layers_[static_cast<size_t>(reader)].reads;
      if (std::find(reads.begin(), reads.end(), l) == reads.end()) {
        reads.push_back(l);
        std::sort(reads.begin(), reads.end());
      }
      return;
    }
  }
  throw ConfigError(
      fmt::format("layer {} ({}) is declared to read tensor '{}', which no earlier "
                  "layer holds",
                  reader, layers_[static_cast<size_t>(reader)].name, tensor_name));
}

std::vector<int> ParamLayout::uses(int layer) const {
  std::vector<int> out{layer};
  const auto& reads = layers_[static_cast<size_t>(layer)].reads;
  out.insert(out.end(), reads.begin(), reads.end());
  return out;
}

std::vector<int> ParamLayout::users(int layer) const {
  std::vector<int> out{layer};
  for (int l = layer + 1; l < num_layers(); ++l) {
    const auto& reads = layers_[static_cast<size_t>(l)].reads;
    if (std::find(reads.begin(), reads.end(), layer) != reads.end()) out.push_back(l);
  }
  return out;
}

std::vector<int> ParamLayout::tied_sources() const {
  std::vector<int> out;
  for (int l = 0; l < num_layers(); ++l)
    if (is_tied_source(l)) out.push_back(l);
  return out;
}

int64_t ParamLayout::num_parameters() const {
  int64_t n = 0;
  for (const auto& l : layers_)
    for (const auto& t : l.tensors) n += t.numel;
  return n;
}

const ParamTensor* ParamLayout::find(const std::string& name) const {
  for (const auto& l : layers_)
    for (const auto& t : l.tensors)
      if (t.name == name) return &t;
  return nullptr;
}

std::vector<const ParamTensor*> ParamLayout::tensors() const {
  std::vector<const ParamTensor*> out;
  for (const auto& l : layers_)
    for (const auto& t : l.tensors) out.push_back(&t);
  return out;
}

}  // namespace shardtrain
