// ParamLayout: where every parameter tensor lives in the flat buffers.
//
// Parameters, gradients and optimizer state each live in ONE flat, contiguous buffer with the
// same layout. The layout is an ordered list of layers (embedding, block 0..L-1, head), each a
// contiguous range holding its named tensors. That makes the layer the natural unit for the
// strategies: ZeRO shards the flat range [0, numel) across data-parallel ranks (any
// boundary works), ZeRO-3 gathers one layer's range before its forward, and pipeline stages own
// whole layers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

struct ParamTensor {
  std::string name;  ///< Hugging Face GPT2LMHeadModel name, e.g. "transformer.h.0.ln_1.weight"
  std::vector<int64_t> shape;  ///< our layout; linear weights are [out, in]
  int64_t offset = 0;          ///< element offset in the flat buffer (multiple of kAlign)
  int64_t numel = 0;
  bool weight_decay = false;   ///< AdamW decays 2-D weights only (not biases, LayerNorm)
  bool hf_transposed = false;  ///< stored as [in, out] by HF's Conv1D
  float init_std = 0.0f;       ///< normal(0, init_std); 0 = constant init_value
  /// uniform(−init_uniform, init_uniform) when > 0 (PyTorch's nn.LSTM, EfficientNet's linear);
  /// takes precedence over init_std.
  float init_uniform = 0.0f;
  float init_value = 0.0f;
};

struct LayerRange {
  std::string name;    ///< "embed", "block.3", "head"
  int64_t offset = 0;  ///< first element (multiple of kAlign)
  int64_t numel = 0;   ///< elements up to the next layer's offset (includes alignment padding)
  std::vector<ParamTensor> tensors;
  /// Other layers whose parameters this layer reads in forward (and whose gradients it
  /// accumulates into in backward): tied weights, e.g. GPT-2's LM head reads the embedding's
  /// wte. Ascending layer indices, never this layer itself. Declared with ParamLayout::tie().
  std::vector<int> reads;
};

class ParamLayout {
 public:
  /// Tensor offsets are aligned to 16 elements (64 bytes in fp32) for vector loads; the
  /// padding elements are zero and stay zero (zero gradient, zero init).
  static constexpr int64_t kAlign = 16;

  /// Appends a layer whose tensors are given by name/shape/init; offsets are assigned here.
  void add_layer(const std::string& name, std::vector<ParamTensor> tensors);

  /// Declares that layer `reader` reads tensor `tensor_name` of an earlier layer (a tied
  /// weight). Throws ConfigError when no earlier layer holds that tensor.
  void tie(int reader, const std::string& tensor_name);

  const std::vector<LayerRange>& layers() const { return layers_; }
  int num_layers() const { return static_cast<int>(layers_.size()); }
  /// The layers whose parameters `layer` needs resident to run: itself, then its reads.
  std::vector<int> uses(int layer) const;
  /// The layers that use `layer`'s parameters (itself and its tied readers), ascending. In
  /// backward (last layer first) users.back() writes the layer's gradients first and
  /// users.front() (the layer itself) last.
  std::vector<int> users(int layer) const;
  /// Whether another layer reads `layer`'s parameters (a tied source).
  bool is_tied_source(int layer) const { return users(layer).size() > 1; }
  /// The tied sources, ascending (GPT-2: the embedding).
  std::vector<int> tied_sources() const;
  /// Elements in the flat buffer (≥ num_parameters() because of alignment padding).
  int64_t numel() const { return numel_; }
  /// Real parameters (sum of tensor sizes).
  int64_t num_parameters() const;
  /// Finds a tensor by name; nullptr when absent.
  const ParamTensor* find(const std::string& name) const;
  /// All tensors in layout order.
  std::vector<const ParamTensor*> tensors() const;

 private:
  std::vector<LayerRange> layers_;
  int64_t numel_ = 0;
};

/// Initializes every tensor of `layout` into the host fp32 buffer `host` [layout.numel()]:
/// uniform(±init_uniform), normal(0, init_std) (Box–Muller over SplitMix64) or the constant
/// init_value. Each tensor draws
/// from its own stream seeded by (seed, tensor name), so the result does not depend on how the
/// buffer is sharded or which other tensors exist. Padding elements are left untouched.
void init_layout_parameters(const ParamLayout& layout, float* host, uint64_t seed);

/// Flat elements [offset, offset + numel) of what init_layout_parameters writes, into
/// out[0, numel) (fp32; padding elements 0), without the rest of the model: each tensor's stream
/// is skipped ahead to the range. What a strategy initialises from when no rank may hold the
/// whole model on the host (Strategy::setup_from).
void init_layout_range(const ParamLayout& layout, uint64_t seed, int64_t offset, int64_t numel,
                       float* out);

}  // namespace shardtrain
