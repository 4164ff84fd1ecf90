#include "model/gpt2_config.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "core/file_input.h"
#include "core/json_input.h"
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

namespace fs = std::filesystem;
using nlohmann::json;

/// A required dimension of config.json: its GPT-2 key, Hugging Face's other spellings (read
/// when the GPT-2 key is absent), what it means, and the largest value accepted.
struct DimKey {
  const char* key;
  std::vector<const char*> aliases;
  const char* meaning;
  int GPT2Config::*field;
  int max;
  int example;
};

/// The value of `key` (or its first alias present) as an int, or a ConfigError naming the file,
/// the key, the value and the fix.
int read_dim(const json& j, const DimKey& d, const std::string& source) {
  const char* used = d.key;
  const json* v = j.contains(d.key) ? &j.at(d.key) : nullptr;
  for (const char* alias : d.aliases) {
    if (v) break;
    if (j.contains(alias)) {
      v = &j.at(alias);
      used = alias;
    }
  }
  if (!v) {
    std::string also;
    for (const char* a : d.aliases) also += fmt::format("{}'{}'", also.empty() ? "" : " or ", a);
    throw ConfigError(fmt::format(
        "{}: missing key '{}' ({}{}): add it, e.g. \"{}\": {}", source, d.key, d.meaning,
        also.empty() ? "" : fmt::format("; Hugging Face also spells it {}", also), d.key,
        d.example));
  }
  if (!v->is_number_integer()) {
    throw ConfigError(fmt::format("{}: '{}' is {} but must be a positive integer (e.g. \"{}\": {})",
                                  source, used, json_excerpt(*v), used, d.example));
  }
  const bool negative = v->is_number_unsigned() ? false : v->get<int64_t>() < 0;
  if (negative || v->get<int64_t>() == 0) {
    throw ConfigError(fmt::format("{}: '{}' is {}: {} must be at least 1", source, used,
                                  json_excerpt(*v), d.meaning));
  }
  if (v->is_number_unsigned() ? v->get<uint64_t>() > static_cast<uint64_t>(d.max)
                              : v->get<int64_t>() > d.max) {
    throw ConfigError(
        fmt::format("{}: '{}' is {}, beyond the {} shardtrain accepts for {}: is it a typo?",
                    source, used, json_excerpt(*v), d.max, d.meaning));
  }
  return v->get<int>();
}

/// The divisor of n that is closest to `near` (ties: the smaller).
int closest_divisor(int n, int near) {
  int best = 1;
  for (int k = 1; k <= n; ++k)
    if (n % k == 0 && std::abs(k - near) < std::abs(best - near)) best = k;
  return best;
}

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

bool GPT2Config::same_shape(const GPT2Config& o) const {
  return n_layer == o.n_layer && n_head == o.n_head && n_embd == o.n_embd &&
         vocab_size == o.vocab_size && n_positions == o.n_positions;
}

std::string GPT2Config::shape_string() const {
  return fmt::format("n_layer {}, n_embd {}, n_head {}, n_positions {}, vocab_size {}", n_layer,
                     n_embd, n_head, n_positions, vocab_size);
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
  throw ConfigError(fmt::format(
      "unknown model '{}'{}: valid models are {}, or the path of a Hugging Face style "
      "config.json (n_layer, n_embd, n_head, n_positions, vocab_size) for a shape of your own",
      name, did_you_mean(name, names), join(names, ", ")));
}

std::vector<std::string> gpt2_preset_names() {
  std::vector<std::string> out;
  for (const Preset& p : kPresets) out.emplace_back(p.name);
  return out;
}

GPT2Config parse_gpt2_config(const std::string& text, const std::string& source,
                             const std::string& name) {
  JsonInputResult parsed = parse_json_input(text);
  if (!parsed.error.empty())
    throw ConfigError(fmt::format("{} is not valid JSON: {}", source, parsed.error));
  const json j = std::move(parsed.value);
  if (!j.is_object()) {
    throw ConfigError(fmt::format(
        "{}: expected a JSON object with n_layer, n_embd, n_head, n_positions and vocab_size, "
        "found {}",
        source, json_type_phrase(j)));
  }
  if (j.contains("model_type") && j.at("model_type") != "gpt2") {
    throw ConfigError(fmt::format(
        "{}: model_type is {} but shardtrain trains GPT-2 models only: use \"model_type\": "
        "\"gpt2\" (or leave it out)",
        source, json_excerpt(j.at("model_type"))));
  }
  if (j.contains("activation_function")) {
    const json& a = j.at("activation_function");
    if (a != "gelu_new" && a != "gelu_pytorch_tanh" && a != "gelu") {
      throw ConfigError(fmt::format(
          "{}: activation_function is {} but shardtrain's GPT-2 computes the tanh GELU: use "
          "\"gelu_new\" (or leave it out)",
          source, json_excerpt(a)));
    }
  }

  GPT2Config c;
  c.name = name;
  const ModelDimLimits& m = kMaxModelDims;
  const DimKey dims[] = {
      {"n_layer",
       {"num_hidden_layers"},
       "the number of transformer blocks",
       &GPT2Config::n_layer,
       m.n_layer,
       12},
      {"n_embd", {"hidden_size"}, "the embedding width", &GPT2Config::n_embd, m.n_embd, 768},
      {"n_head",
       {"num_attention_heads"},
       "the number of attention heads",
       &GPT2Config::n_head,
       m.n_head,
       12},
      {"n_positions",
       {"n_ctx", "max_position_embeddings"},
       "the context length (learned position embeddings)",
       &GPT2Config::n_positions,
       m.n_positions,
       1024},
      {"vocab_size", {}, "the vocabulary size", &GPT2Config::vocab_size, m.vocab_size, 50257},
  };
  for (const DimKey& d : dims) c.*d.field = read_dim(j, d, source);

  if (c.n_embd % c.n_head != 0) {
    throw ConfigError(fmt::format(
        "{}: n_embd {} is not divisible by n_head {}: every head gets n_embd / n_head dimensions; "
        "use an n_head that divides n_embd (e.g. {})",
        source, c.n_embd, c.n_head, closest_divisor(c.n_embd, c.n_head)));
  }
  if (c.vocab_size < kGpt2TokenizerVocab) {
    throw ConfigError(fmt::format(
        "{}: vocab_size {} is smaller than the {} tokens of the GPT-2 tokenizer shardtrain trains "
        "with: use {} (or a padded size such as 50304)",
        source, c.vocab_size, kGpt2TokenizerVocab, kGpt2TokenizerVocab));
  }
  if (j.contains("n_inner") && !j.at("n_inner").is_null()) {
    const json& inner = j.at("n_inner");
    if (!inner.is_number_integer() || inner.get<int64_t>() != 4 * int64_t{c.n_embd}) {
      throw ConfigError(fmt::format(
          "{}: n_inner is {} but shardtrain's GPT-2 MLP is 4·n_embd = {} wide: use \"n_inner\": "
          "null (or leave it out)",
          source, json_excerpt(inner), 4 * int64_t{c.n_embd}));
    }
  }
  // Dropout probabilities (Hugging Face's GPT-2 configs say 0.1): absent or null means 0.
  for (auto [key, field] : {std::pair{"embd_pdrop", &GPT2Config::embd_pdrop},
                            std::pair{"attn_pdrop", &GPT2Config::attn_pdrop},
                            std::pair{"resid_pdrop", &GPT2Config::resid_pdrop}}) {
    if (!j.contains(key) || j.at(key).is_null()) continue;
    const json& v = j.at(key);
    if (!v.is_number()) {
      throw ConfigError(fmt::format(
          "{}: {} is {} but must be a dropout probability in [0, 1) (e.g. 0.1, or 0 for none)",
          source, key, json_excerpt(v)));
    }
    c.*field = v.get<float>();
  }
  validate_dropout(c, source);
  return c;
}

void validate_gpt2_shape(const GPT2Config& c, const std::string& source) {
  const ModelDimLimits& m = kMaxModelDims;
  for (auto [key, value, max] :
       {std::tuple{"n_layer", c.n_layer, m.n_layer}, std::tuple{"n_embd", c.n_embd, m.n_embd},
        std::tuple{"n_head", c.n_head, m.n_head},
        std::tuple{"n_positions", c.n_positions, m.n_positions},
        std::tuple{"vocab_size", c.vocab_size, m.vocab_size}}) {
    if (value < 1 || value > max)
      throw ConfigError(
          fmt::format("{}: {} is {}; it must be an integer in [1, {}]", source, key, value, max));
  }
  if (c.n_embd % c.n_head != 0)
    throw ConfigError(
        fmt::format("{}: n_embd {} is not divisible by n_head {}", source, c.n_embd, c.n_head));
  validate_dropout(c, source);
}

void validate_dropout(const GPT2Config& c, const std::string& source) {
  for (auto [key, p] :
       {std::pair{"embd_pdrop", c.embd_pdrop}, std::pair{"attn_pdrop", c.attn_pdrop},
        std::pair{"resid_pdrop", c.resid_pdrop}}) {
    if (!(p >= 0.0f && p < 1.0f)) {
      throw ConfigError(fmt::format(
          "{}: {} is {} but a dropout probability must be in [0, 1): use e.g. 0.1 (GPT-2's), or 0 "
          "to turn dropout off",
          source, key, p));
    }
  }
}

GPT2Config resolve_model(const std::string& name_or_path) {
  for (const Preset& p : kPresets)
    if (name_or_path == p.name) return gpt2_preset(name_or_path);

  const fs::path arg = name_or_path;
  std::error_code ec;
  const bool looks_like_path = name_or_path.find('/') != std::string::npos ||
                               arg.extension() == ".json" || name_or_path.rfind('.', 0) == 0;
  if (!fs::exists(arg, ec)) {
    if (looks_like_path) {
      throw ConfigError(fmt::format(
          "--model {}: no such file: give a preset name ({}) or the path of a Hugging Face style "
          "config.json",
          name_or_path, join(gpt2_preset_names(), ", ")));
    }
    gpt2_preset(name_or_path);  // throws: unknown model, the closest name, and the paths taken
  }
  fs::path file = arg;
  if (fs::is_directory(arg, ec)) {
    file = arg / "config.json";
    if (!fs::is_regular_file(file, ec)) {
      throw ConfigError(fmt::format(
          "--model {}: the directory holds no config.json: give the path of a Hugging Face style "
          "config.json (n_layer, n_embd, n_head, n_positions, vocab_size) or a preset name",
          name_or_path));
    }
  }
  const std::string text = read_input_file_or_throw<ConfigError>(
      file, fmt::format("--model {}: the model config", excerpt(name_or_path, 200)),
      kMaxConfigFileBytes);

  // The model's name in logs and checkpoints: the file's stem, or its directory's name for the
  // conventional config.json.
  const fs::path abs = fs::absolute(file, ec).lexically_normal();
  std::string name = file.stem().string();
  if (file.filename() == "config.json") name = abs.parent_path().filename().string();
  if (name.empty() || name == "." || name == "..") name = "custom";
  return parse_gpt2_config(text, file.string(), name);
}

}  // namespace shardtrain
