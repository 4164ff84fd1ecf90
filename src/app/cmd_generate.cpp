// `shardtrain generate`: sample text from a checkpoint (temperature and top-k sampling).
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "app/commands.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/sharded_checkpoint.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/rng.h"
#include "data/bpe_tokenizer.h"
#include "model/gpt2.h"
#include "train/trainer.h"

namespace shardtrain {
namespace {

struct GenerateOptions {
  std::string checkpoint;
  std::string prompt = "\n";
  int max_new_tokens = 64;
  double temperature = 0.8;
  int top_k = 40;
  uint64_t seed = 1337;
  std::string device = "auto";
};

/// Samples one id from `logits` [V]: temperature scaling, then top-k, then the softmax.
int32_t sample_token(std::vector<float> logits, const GenerateOptions& o, SplitMix64& rng) {
  const auto V = static_cast<int32_t>(logits.size());
  if (o.temperature == 0.0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  const int32_t k = o.top_k > 0 ? std::min<int32_t>(o.top_k, V) : V;
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
  });
  const double maxv = logits[static_cast<size_t>(ids[0])];
  std::vector<double> p(static_cast<size_t>(k));
  double sum = 0;
  for (int32_t i = 0; i < k; ++i) {
    p[static_cast<size_t>(i)] =
        std::exp((logits[static_cast<size_t>(ids[static_cast<size_t>(i)])] - maxv) / o.temperature);
    sum += p[static_cast<size_t>(i)];
  }
  double u = rng.uniform() * sum;
  for (int32_t i = 0; i < k; ++i) {
    u -= p[static_cast<size_t>(i)];
    if (u <= 0) return ids[static_cast<size_t>(i)];
  }
  return ids[static_cast<size_t>(k - 1)];
}

void run_generate(const GenerateOptions& o) {
  check<ConfigError>(o.temperature >= 0 && std::isfinite(o.temperature),
                     "--temperature {} must be ≥ 0 (0 = greedy)", o.temperature);
  check<ConfigError>(o.max_new_tokens >= 1, "--max-new-tokens {} must be ≥ 1", o.max_new_tokens);
  const CheckpointInfo info = read_checkpoint_info(o.checkpoint);
  require_gpt2_checkpoint(info, "shardtrain generate");
  auto backend = make_backend(o.device, 0);
  GPT2Model model(info.model, *backend);
  const std::vector<float> weights = load_checkpoint_params(info, model.layout());
  FlatBuffer params(*backend, DType::kF32, model.layout().numel());
  backend->copy_from_host(params.data(), weights.data(), weights.size() * sizeof(float));
  if (backend->compute_dtype() != DType::kF32) {
    FlatBuffer compute(*backend, backend->compute_dtype(), model.layout().numel());
    backend->convert(compute.view(), params.view());
    params = std::move(compute);
  }
  model.bind(params.view(), Tensor());
  BpeTokenizer tok = BpeTokenizer::load_default();
  std::vector<int32_t> ids = tok.encode(o.prompt);
  check<ConfigError>(!ids.empty(), "--prompt is empty: give some text to continue");
  SplitMix64 rng{o.seed};
  fmt::print("{}", o.prompt);
  std::fflush(stdout);
  for (int i = 0; i < o.max_new_tokens; ++i) {
    const int64_t ctx = std::min<int64_t>(static_cast<int64_t>(ids.size()), info.model.n_positions);
    const int32_t* window = ids.data() + (ids.size() - static_cast<size_t>(ctx));
    model.forward(window, nullptr, 1, ctx, 1.0f, false);
    const int32_t next = sample_token(model.logits_at(0, ctx - 1), o, rng);
    ids.push_back(next);
    fmt::print("{}", tok.decode(std::span<const int32_t>(&next, 1)));
    std::fflush(stdout);
  }
  fmt::print("\n");
}

}  // namespace

void register_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "sample text from a trained checkpoint");
  cmd->add_option("--checkpoint", o->checkpoint,
                  "checkpoint directory, or an output directory (its latest checkpoint)")
      ->required();
  cmd->add_option("--prompt", o->prompt, "text to continue");
  cmd->add_option("--max-new-tokens", o->max_new_tokens, "tokens to generate (default 64)");
  cmd->add_option("--temperature", o->temperature, "softmax temperature; 0 = greedy (default 0.8)");
  cmd->add_option("--top-k", o->top_k,
                  "sample among the k most likely tokens; 0 = all (default 40)");
  cmd->add_option("--seed", o->seed, "sampling seed (default 1337)");
  cmd->add_option(knob_for(&TrainConfig::device).name(), o->device,
                  "auto | cpu | cuda (default auto)");
  cmd->callback([o]() { run_generate(*o); });
}

}  // namespace shardtrain
