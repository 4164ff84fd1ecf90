// GPT-2 model shapes: the four published OpenAI sizes and small presets for CPU work
// (Radford et al., "Language Models are Unsupervised Multitask Learners" (2019), Table 2), and
// shapes of one's own from a Hugging Face style config.json (resolve_model).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

struct GPT2Config {
  std::string name;
  int n_layer = 12;
  int n_head = 12;
  int n_embd = 768;
  int vocab_size = 50257;
  int n_positions = 1024;  ///< maximum context (learned position embeddings)
  /// Dropout probabilities in [0, 1) during training (Hugging Face GPT2Config's names): after
  /// the embedding, on the attention probabilities, and on each residual branch's output before
  /// its add. 0 in every preset (pretraining without dropout, as llm.c and nanoGPT); a
  /// config.json or --dropout sets them.
  float embd_pdrop = 0;
  float attn_pdrop = 0;
  float resid_pdrop = 0;

  /// Exact parameter count (tied LM head counted once), e.g. 124,439,808 for gpt2.
  int64_t num_parameters() const;
  /// Training FLOPs per token, 6N + 12·L·d·T (Kaplan et al., arXiv 2001.08361, §2.1, with the
  /// attention term), for sequence length T. Used for MFU.
  double flops_per_token(int64_t seq_len) const;

  /// Same n_layer, n_head, n_embd, vocab_size and n_positions (the name may differ).
  bool same_shape(const GPT2Config& other) const;
  /// "n_layer 12, n_embd 768, n_head 12, n_positions 1024, vocab_size 50257", for messages.
  std::string shape_string() const;
  /// Whether any dropout probability is non-zero.
  bool has_dropout() const { return embd_pdrop > 0 || attn_pdrop > 0 || resid_pdrop > 0; }
};

/// Throws ConfigError unless every dropout probability of `c` is in [0, 1); `source` names where
/// they came from (a file, --dropout) in the message.
void validate_dropout(const GPT2Config& c, const std::string& source);

/// Throws ConfigError, naming `source`, unless `c` is a shape the model code can build: every
/// dimension in [1, kMaxModelDims], n_head dividing n_embd, dropout probabilities in [0, 1).
/// (It does not ask for the GPT-2 tokenizer's vocabulary: parse_gpt2_config does.) Every shape
/// read from a file passes through it before anything is sized by it.
void validate_gpt2_shape(const GPT2Config& c, const std::string& source);

/// Looks up a preset: gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-mini, gpt2-tiny, gpt2-micro.
/// Throws ConfigError listing the valid names (and the closest one) for an unknown name.
GPT2Config gpt2_preset(const std::string& name);

/// Names of all presets, in size order.
std::vector<std::string> gpt2_preset_names();

/// The model `--model` names: a preset (gpt2_preset), or the path of a Hugging Face style GPT-2
/// config.json, or of a directory holding one (as Hugging Face model directories are laid out).
/// A preset name wins over a file of the same name (write ./gpt2 for a directory called gpt2).
/// A file's model is named after its stem ("config.json" after its directory). Throws ConfigError
/// for an unknown name (listing the presets), a missing file, or a config parse_gpt2_config
/// refuses.
GPT2Config resolve_model(const std::string& name_or_path);

/// The GPT-2 shape in the text of a config.json. Keys: n_layer, n_embd, n_head, n_positions,
/// vocab_size, with Hugging Face's aliases num_hidden_layers, hidden_size, num_attention_heads,
/// n_ctx / max_position_embeddings (used when the GPT-2 key is absent). model_type must be "gpt2"
/// and activation_function gelu_new, gelu_pytorch_tanh or gelu when given (shardtrain computes the
/// tanh GELU, gelu_new); n_inner must be null or 4·n_embd; other keys are ignored. Every number
/// must be a positive integer within kMaxModelDims; n_head must divide n_embd; vocab_size must
/// hold the GPT-2 tokenizer's 50257 tokens. Any head size n_embd/n_head is accepted: on GPUs the
/// fused flash-attention kernels take 32, 64 and 128 (bf16/fp16) and other sizes run the
/// materialized attention kernels (train warns). `source` names the file in errors; the result is
/// called `name`.
GPT2Config parse_gpt2_config(const std::string& text, const std::string& source,
                             const std::string& name);

/// Largest accepted dimensions of a custom shape, against typos (a GPT of 10^4 layers, an
/// embedding of 2^17, ... is a mistake, not a model).
struct ModelDimLimits {
  int n_layer = 4096;
  int n_embd = 65536;
  int n_head = 4096;
  int n_positions = 1 << 20;
  int vocab_size = 1 << 24;
};
inline constexpr ModelDimLimits kMaxModelDims{};

/// Token ids of the GPT-2 tokenizer, the one shardtrain trains with: vocab_size ≥ this.
inline constexpr int kGpt2TokenizerVocab = 50257;

}  // namespace shardtrain
