#include "model/gpt2_config.h"

#include <algorithm>

#include "core/error.h"
#include "core/strings.h"

namespace shardtrain {
namespace {

struct Preset {
  const char* name;
  int n_layer, n_head, n_embd;
};

// The four OpenAI sizes, then small CPU-friendly shapes with the full GPT-2 vocabulary.
constexpr Preset kPresets[] = {
    {"gpt2-micro", 2, 2, 64},  {"gpt2-tiny", 4, 4, 128},      {"gpt2-mini", 6, 6, 384},
    {"gpt2", 12, 12, 768},     {"gpt2-medium", 24, 16, 1024}, {"gpt2-large", 36, 20, 1280},
    {"gpt2-xl", 48, 25, 1600},
};

}  // namespace

int64_t GPT2Config::num_parameters() const {
  const int64_t C = n_embd, L = n_layer;
  const int64_t per_block = 2 * C                // ln_1
                            + C * 3 * C + 3 * C  // c_attn
                            + C * C + C          // attn.c_proj
                            + 2 * C              // ln_2
                            + C * 4 * C + 4 * C  // c_fc
                            + 4 * C * C + C;     // mlp.c_proj
  return static_cast<int64_t>(vocab_size) * C + static_cast<int64_t>(n_positions) * C +
         L * per_block + 2 * C;
}

double GPT2Config::flops_per_token(int64_t seq_len) const {
  return 6.0 * static_cast<double>(num_parameters()) +
         12.0 * n_layer * static_cast<double>(n_embd) * static_cast<double>(seq_len);
}

GPT2Config gpt2_preset(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) {
      GPT2Config c;
      c.name = p.name;
      c.n_layer = p.n_layer;
      c.n_head = p.n_head;
      c.n_embd = p.n_embd;
      return c;
    }
  }
  const auto names = gpt2_preset_names();
  throw ConfigError(fmt::format("unknown model '{}'{}: valid models are {}", name,
                                did_you_mean(name, names), join(names, ", ")));
}

std::vector<std::string> gpt2_preset_names() {
  std::vector<std::string> out;
  for (const Preset& p : kPresets) out.emplace_back(p.name);
  return out;
}

}  // namespace shardtrain
