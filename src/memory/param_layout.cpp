#include "memory/param_layout.h"

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
