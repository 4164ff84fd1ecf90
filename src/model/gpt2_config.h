// GPT-2 model shapes: the four published OpenAI sizes and small presets for CPU work.
// Radford et al., "Language Models are Unsupervised Multitask Learners" (2019), Table 2.
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

  /// Exact parameter count (tied LM head counted once), e.g. 124,439,808 for gpt2.
  int64_t num_parameters() const;
  /// Training FLOPs per token, 6N + 12·L·d·T (Kaplan et al., arXiv 2001.08361, §2.1, with the
  /// attention term), for sequence length T. Used for MFU.
  double flops_per_token(int64_t seq_len) const;
};

/// Looks up a preset: gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-mini, gpt2-tiny, gpt2-micro.
/// Throws ConfigError listing the valid names (and the closest one) for an unknown name.
GPT2Config gpt2_preset(const std::string& name);

/// Names of all presets, in size order.
std::vector<std::string> gpt2_preset_names();

}  // namespace shardtrain
