#include "memory/param_layout.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "core/error.h"
#include "core/hash.h"
#include "core/rng.h"

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

namespace {

/// Elements [from, to) of tensor `t`'s initial values into dst[0, to - from). Each tensor draws
/// from its own SplitMix64 stream, which advances its state by a constant per draw: the stream is
/// skipped ahead to the first draw the segment needs, so any segment equals the same elements of
/// the whole tensor.
void init_tensor_segment(const ParamTensor& t, uint64_t seed, int64_t from, int64_t to,
                         float* dst) {
  if (t.init_std == 0.0f && t.init_uniform <= 0.0f) {
    std::fill(dst, dst + (to - from), t.init_value);
    return;
  }
  SplitMix64 rng{seed ^ fnv1a64(t.name)};
  if (t.init_uniform > 0.0f) {
    rng.state += static_cast<uint64_t>(from) * SplitMix64::kGamma;  // one draw per element
    for (int64_t i = from; i < to; ++i)
      dst[i - from] = static_cast<float>(t.init_uniform * (2.0 * rng.uniform() - 1.0));
    return;
  }
  // Box–Muller: two independent normals per pair of uniforms (two draws per pair of elements).
  const int64_t first_pair = from / 2;
  rng.state += static_cast<uint64_t>(2 * first_pair) * SplitMix64::kGamma;
  for (int64_t i = 2 * first_pair; i < to; i += 2) {
    const double u1 = 1.0 - rng.uniform(), u2 = rng.uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    if (i >= from)
      dst[i - from] = static_cast<float>(t.init_std * r * std::cos(2.0 * std::numbers::pi * u2));
    if (i + 1 < to && i + 1 < t.numel)
      dst[i + 1 - from] =
          static_cast<float>(t.init_std * r * std::sin(2.0 * std::numbers::pi * u2));
  }
}

}  // namespace

void init_layout_parameters(const ParamLayout& layout, float* host, uint64_t seed) {
  const auto tensors = layout.tensors();
#pragma omp parallel for schedule(dynamic)
  for (size_t k = 0; k < tensors.size(); ++k) {
    const ParamTensor& t = *tensors[k];
    init_tensor_segment(t, seed, 0, t.numel, host + t.offset);
  }
}

void init_layout_range(const ParamLayout& layout, uint64_t seed, int64_t offset, int64_t numel,
                       float* out) {
  ST_ASSERT(offset >= 0 && numel >= 0 && offset + numel <= layout.numel());
  std::fill(out, out + numel, 0.0f);  // padding
  // Pieces of at most kPiece elements (even: Box–Muller pairs stay whole) of every tensor the
  // range overlaps, drawn in parallel: a few large tensors (a block's MLP weights) would
  // otherwise leave most threads idle.
  constexpr int64_t kPiece = int64_t{1} << 20;
  struct Piece {
    const ParamTensor* t;
    int64_t from, to;
  };
  std::vector<Piece> pieces;
  for (const ParamTensor* t : layout.tensors()) {
    const int64_t lo = std::max(offset, t->offset) - t->offset;
    const int64_t hi = std::min(offset + numel, t->offset + t->numel) - t->offset;
    for (int64_t a = lo; a < hi; a = (a / kPiece + 1) * kPiece)
      pieces.push_back({t, a, std::min(hi, (a / kPiece + 1) * kPiece)});
  }
#pragma omp parallel for schedule(dynamic)
  for (size_t k = 0; k < pieces.size(); ++k) {
    const Piece& p = pieces[k];
    init_tensor_segment(*p.t, seed, p.from, p.to, out + (p.t->offset + p.from - offset));
  }
}

}  // namespace shardtrain
