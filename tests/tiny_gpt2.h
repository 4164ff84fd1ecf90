// The tiny GPT-2 the strategy and checkpoint tests share: 2 layers, 3 heads, 27 channels,
// vocabulary 97 — 21,303 parameters at 16 positions, an odd count that neither 2 nor 4 ranks
// divide, with layers small enough that every ZeRO bucket needs padding.
#pragma once

#include <cstdint>
#include <string>

#include "model/gpt2_config.h"

namespace shardtrain::test_support {

inline GPT2Config tiny_gpt2(const std::string& name, int64_t n_positions = 16) {
  GPT2Config c;
  c.name = name;
  c.n_layer = 2;
  c.n_head = 3;
  c.n_embd = 27;
  c.vocab_size = 97;
  c.n_positions = n_positions;
  return c;
}

}  // namespace shardtrain::test_support
