// Gradient buckets shared by the strategies: groups of consecutive layers whose gradients are
// reduced together as soon as the last of them has run backward, so that communication overlaps
// the rest of backward (Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3), and the ZeRO
// partition of each bucket into one even slice per rank (Rajbhandari et al., "ZeRO: Memory
// Optimizations Toward Training Trillion Parameter Models", arXiv 1910.02054, §5).
//
// Header-only: data parallelism (data_parallel.cpp), ZeRO-1/2 (zero.cpp) and the memory estimator
// (memory_estimator.cpp) build the same buckets from the same layout.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "memory/param_layout.h"

namespace shardtrain {

/// Elements per gradient bucket when no reduce_bucket_size was given and the reductions overlap
/// backward: PyTorch DDP's bucket_cap_mb = 25 (12.5 M bf16 gradients). dp always uses it; ZeRO
/// uses it on ranks whose communicator has the copy-engine collectives (one node), where small
/// buckets overlap backward (gpt2-medium zero2 on 2 H200s: 247 k tokens/s against 238 k with
/// DeepSpeed's 5e8-element default, measured 2026-11-21), and DeepSpeed's default otherwise, where
/// NCCL's kernels made small buckets slower (218 k against 233 k).
inline constexpr int64_t kOverlapBucketElements = 12'500'000;

/// A run of consecutive layers [first_layer, last_layer] of the layout, which is the contiguous
/// flat range [offset, offset + numel).
struct GradBucket {
  int64_t offset = 0;   ///< first element in the flat layout
  int64_t numel = 0;    ///< elements, the layers' alignment padding included
  int first_layer = 0;  ///< lowest layer index: its backward runs last and completes the bucket
  int last_layer = 0;   ///< highest layer index: its backward runs first
  int num_layers() const { return last_layer - first_layer + 1; }
  bool contains(int layer) const { return layer >= first_layer && layer <= last_layer; }
};

/// Buckets in backward order (bucket 0 holds the last layer): layers are added from the last one
/// backwards while the bucket stays within `max_elements` elements (zero.reduce_bucket_size); a
/// larger single layer forms a bucket of its own. Layers listed in `solo_layers` always get a
/// bucket of their own (ZeRO-2 keeps the embedding apart: the tied LM head writes its gradient
/// before the embedding runs backward).
inline std::vector<GradBucket> build_grad_buckets(const ParamLayout& layout, int64_t max_elements,
                                                  const std::vector<int>& solo_layers = {}) {
  const auto& layers = layout.layers();
  const auto solo = [&](int i) {
    return std::find(solo_layers.begin(), solo_layers.end(), i) != solo_layers.end();
  };
  std::vector<GradBucket> buckets;
  bool close = true;  // the next layer starts a new bucket
  for (int i = static_cast<int>(layers.size()) - 1; i >= 0; --i) {
    const LayerRange& l = layers[static_cast<size_t>(i)];
    if (close || solo(i) || buckets.back().numel + l.numel > max_elements) {
      buckets.push_back({l.offset, 0, i, i});
    }
    GradBucket& b = buckets.back();
    b.offset = l.offset;
    b.numel += l.numel;
    b.first_layer = i;
    close = solo(i);
  }
  return buckets;
}

/// Counts finished layers during one backward and says when a bucket is complete.
class BucketReadiness {
 public:
  BucketReadiness() = default;
  BucketReadiness(const std::vector<GradBucket>& buckets, int num_layers)
      : bucket_of_(static_cast<size_t>(num_layers), -1), size_(buckets.size()) {
    for (size_t b = 0; b < buckets.size(); ++b) {
      size_[b] = buckets[b].num_layers();
      for (int l = buckets[b].first_layer; l <= buckets[b].last_layer; ++l)
        bucket_of_[static_cast<size_t>(l)] = static_cast<int>(b);
    }
    reset();
  }
  /// Starts a new backward.
  void reset() { done_.assign(size_.size(), 0); }
  /// Index of the bucket holding `layer`.
  int bucket_of(int layer) const { return bucket_of_[static_cast<size_t>(layer)]; }
  /// Marks `layer`'s backward as done; returns its bucket's index when that completes the bucket,
  /// else -1.
  int layer_done(int layer) {
    const int b = bucket_of(layer);
    ST_ASSERT(b >= 0);
    return ++done_[static_cast<size_t>(b)] == size_[static_cast<size_t>(b)] ? b : -1;
  }

 private:
  std::vector<int> bucket_of_, size_, done_;
};

constexpr int64_t round_up(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

/// Elements of a bucket of `numel` elements once padded for a ZeRO partition over `world` ranks:
/// a multiple of world · ParamLayout::kAlign, so every rank's slice is equal and 64-byte aligned.
constexpr int64_t zero_padded_numel(int64_t numel, int world) {
  return round_up(numel, static_cast<int64_t>(world) * ParamLayout::kAlign);
}

/// One bucket under the ZeRO partition (arXiv 1910.02054, §5): the bucket is padded with zeros
/// to `padded` elements and split into `world` equal slices of `shard` elements; rank r owns
/// slice r, i.e. the padded elements [r·shard, (r+1)·shard) of the bucket. The padding (zeros,
/// zero gradient) lies past the bucket's real elements, so the last ranks' slices may be partly or
/// wholly padding.
struct BucketPartition {
  GradBucket bucket;
  int64_t padded = 0;         ///< bucket.numel rounded up to a multiple of world · kAlign
  int64_t shard = 0;          ///< padded / world
  int64_t padded_offset = 0;  ///< start of the bucket in buffers of padded buckets (layout order)
  int64_t shard_offset = 0;   ///< start of this rank's slice in buffers of slices (layout order)
  int64_t owned_offset = 0;   ///< first flat-layout element this rank owns
  int64_t owned_numel = 0;    ///< real (not padding) elements this rank owns, in [0, shard]
};

/// The partition of `buckets` (in any order; the result keeps it) for rank `rank` of `world`.
/// Padded offsets follow the layout order of the buckets, so buffers of padded buckets keep the
/// layers in layout order.
inline std::vector<BucketPartition> partition_buckets(const std::vector<GradBucket>& buckets,
                                                      int world, int rank) {
  ST_ASSERT(world >= 1 && rank >= 0 && rank < world);
  std::vector<BucketPartition> parts(buckets.size());
  std::vector<size_t> order(buckets.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return buckets[a].offset < buckets[b].offset; });
  int64_t padded_pos = 0, shard_pos = 0;
  for (size_t i : order) {
    BucketPartition& p = parts[i];
    p.bucket = buckets[i];
    p.padded = zero_padded_numel(p.bucket.numel, world);
    p.shard = p.padded / world;
    p.padded_offset = padded_pos;
    p.shard_offset = shard_pos;
    const int64_t begin = static_cast<int64_t>(rank) * p.shard;
    p.owned_offset = p.bucket.offset + begin;
    p.owned_numel = std::clamp<int64_t>(p.bucket.numel - begin, 0, p.shard);
    padded_pos += p.padded;
    shard_pos += p.shard;
  }
  return parts;
}

}  // namespace shardtrain
