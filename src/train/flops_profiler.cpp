#include "train/flops_profiler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace shardtrain {

std::vector<ModuleFlops> analytic_module_flops(const GPT2Config& c, int64_t tokens,
                                               int64_t seq_len) {
  const int64_t C = c.n_embd, L = c.n_layer, V = c.vocab_size, P = c.n_positions;
  const double n = static_cast<double>(tokens);
  auto linear = [&](int64_t params) { return 6.0 * static_cast<double>(params) * n; };
  std::vector<ModuleFlops> rows;
  // wte [V,C] is listed with the embedding that owns it; its FLOPs are the head's projection's.
  rows.push_back({"embedding", 0, 0, V * C + P * C, linear(P * C)});
  const int64_t ln = 2 * C;
  const int64_t attn = C * 3 * C + 3 * C + C * C + C;
  const int64_t mlp = C * 4 * C + 4 * C + 4 * C * C + C;
  // QKᵀ and AV: 2·B·T²·C each forward, twice that backward (full T², causal mask ignored).
  const double attn_core = 12.0 * static_cast<double>(C) * static_cast<double>(seq_len) * n;
  for (int64_t i = 0; i < L; ++i) {
    const int layer = static_cast<int>(i + 1);
    ModuleFlops parts[] = {{"ln_1", 1, layer, ln, linear(ln)},
                           {"attention", 1, layer, attn, linear(attn) + attn_core},
                           {"ln_2", 1, layer, ln, linear(ln)},
                           {"mlp", 1, layer, mlp, linear(mlp)}};
    ModuleFlops block{fmt::format("block {}", i), 0, layer, 0, 0};
    for (const ModuleFlops& p : parts) {
      block.params += p.params;
      block.flops += p.flops;
    }
    rows.push_back(block);
    for (const ModuleFlops& p : parts) rows.push_back(p);
  }
  // ln_f + the tied projection [C]→[V] (2·N·C·V forward, 4·N·C·V backward) + cross-entropy (0).
  rows.push_back({"head", 0, static_cast<int>(L + 1), ln, linear(ln) + linear(V * C)});
  return rows;
}

double analytic_total_flops(const GPT2Config& c, int64_t tokens, int64_t seq_len) {
  return c.flops_per_token(seq_len) * static_cast<double>(tokens);
}

// ---- ProfilingHooks -------------------------------------------------------------------------

ProfilingHooks::ProfilingHooks(LayerHooks* inner, StreamClock& clock, int num_layers)
    : inner_(inner),
      clock_(clock),
      fwd_(static_cast<size_t>(num_layers), 0.0),
      bwd_(static_cast<size_t>(num_layers), 0.0) {}

void ProfilingHooks::before_forward(int layer) {
  if (inner_) inner_->before_forward(layer);
  clock_.mark();
  spans_.emplace_back(layer, false);
}

void ProfilingHooks::after_forward(int layer) {
  clock_.mark();
  if (inner_) inner_->after_forward(layer);
}

void ProfilingHooks::before_backward(int layer) {
  if (inner_) inner_->before_backward(layer);
  clock_.mark();
  spans_.emplace_back(layer, true);
}

void ProfilingHooks::after_backward(int layer) {
  clock_.mark();
  if (inner_) inner_->after_backward(layer);
}

void ProfilingHooks::between_layers() {
  if (inner_) inner_->between_layers();
}

bool ProfilingHooks::take_tied_embedding_grad(int64_t rows) {
  return inner_ && inner_->take_tied_embedding_grad(rows);
}

void ProfilingHooks::tied_embedding_grad(Tensor dx, Tensor tokens) {
  if (inner_) inner_->tied_embedding_grad(dx, tokens);
}

void ProfilingHooks::collect() {
  const std::vector<double> t = clock_.intervals();
  ST_ASSERT(t.size() + 1 == 2 * spans_.size() || (t.empty() && spans_.empty()));
  for (size_t k = 0; k < spans_.size(); ++k) {
    const auto [layer, backward] = spans_[k];
    (backward ? bwd_ : fwd_)[static_cast<size_t>(layer)] += t[2 * k];
  }
  spans_.clear();
}

// ---- the table ------------------------------------------------------------------------------

namespace {

std::string human(double v, const char* unit) {
  const char* prefixes[] = {"", "K", "M", "G", "T", "P", "E"};
  int i = 0;
  while (std::abs(v) >= 1000.0 && i < 6) {
    v /= 1000.0;
    ++i;
  }
  return fmt::format("{:.2f} {}{}", v, prefixes[i], unit);
}

std::string ms(double s) { return s < 0 ? std::string("-") : fmt::format("{:.3f}", 1e3 * s); }

}  // namespace

std::vector<std::string> format_flops_profile(const FlopsProfileInput& in) {
  const GPT2Config& c = in.model;
  const std::vector<ModuleFlops> rows = analytic_module_flops(c, in.tokens, in.seq_len);
  const double total_flops = analytic_total_flops(c, in.tokens, in.seq_len);
  const PhaseTimes& ph = in.phases;
  const double step_s = ph.forward + ph.backward + ph.reduce_wait + ph.optimizer;
  auto layer_s = [&](const std::vector<double>& v, int layer) {
    return static_cast<size_t>(layer) < v.size() ? v[static_cast<size_t>(layer)] : 0.0;
  };
  double layers_s = 0;
  for (size_t i = 0; i < in.layer_forward_s.size(); ++i)
    layers_s += in.layer_forward_s[i] + layer_s(in.layer_backward_s, static_cast<int>(i));

  std::vector<std::string> out;
  const std::string rule(104, '-');
  out.push_back(fmt::format("{:-^104}", " shardtrain FLOPs profiler (DeepSpeed flops_profiler) "));
  out.push_back(fmt::format(
      "profile step {} | {} tokens on this rank (micro-batch {} x seq {} x accumulation {}) | "
      "model {}",
      in.step, in.tokens, in.micro_batch, in.seq_len, in.accumulation, c.name));
  out.push_back(
      "FLOPs: forward + backward, analytic: 6 per parameter per token (linear 2·N·IC·OC fwd, "
      "2x that bwd;");
  out.push_back(
      "  LayerNorm 6·2C per token, GELU/softmax/cross-entropy 0) + attention QKᵀ/AV 2·B·T²·C each "
      "fwd, 2x bwd");
  out.push_back(
      "  (full T², causal mask ignored); tied wte counted in the head; optimizer and "
      "communication 0.");
  out.push_back(
      "Latency: device timers around each layer's forward/backward; block parts are not timed "
      "separately.");
  out.push_back(rule);
  out.push_back(fmt::format("{:<22} {:>12} {:>14} {:>10} {:>10} {:>11} {:>10} {:>8}", "module",
                            "params", "FLOPs", "fwd ms", "bwd ms", "latency ms", "TFLOP/s",
                            "% step"));
  out.push_back(rule);
  struct Timed {
    std::string name;
    double seconds;
  };
  std::vector<Timed> timed;
  auto row = [&](const std::string& name, int64_t params, double flops, double fwd, double bwd,
                 double lat) {
    const std::string tflops =
        lat > 0 && flops > 0 ? fmt::format("{:.3f}", flops / lat / 1e12) : std::string("-");
    const std::string share =
        lat >= 0 && step_s > 0 ? fmt::format("{:.1f}", 100.0 * lat / step_s) : std::string("-");
    out.push_back(fmt::format("{:<22} {:>12} {:>14} {:>10} {:>10} {:>11} {:>10} {:>8}", name,
                              params, flops > 0 ? human(flops, "") : std::string("0"), ms(fwd),
                              ms(bwd), ms(lat), tflops, share));
  };
  const bool parts = in.options.detailed && in.options.module_depth != 0;
  for (const ModuleFlops& m : rows) {
    if (m.depth == 0) {
      const double f = layer_s(in.layer_forward_s, m.layer);
      const double b = layer_s(in.layer_backward_s, m.layer);
      row(m.name, m.params, m.flops, f, b, f + b);
      timed.push_back({m.name, f + b});
    } else if (parts) {
      row("  " + m.name, m.params, m.flops, -1, -1, -1);
    }
  }
  const double other = std::max(0.0, ph.forward + ph.backward - layers_s);
  row("other (fwd/bwd)", 0, 0, -1, -1, other);
  row("optimizer step", c.num_parameters(), 0, -1, -1, ph.optimizer);
  row("gradient reduce wait", 0, 0, -1, -1, ph.reduce_wait);
  out.push_back(rule);
  row("total", c.num_parameters(), total_flops, ph.forward, ph.backward, step_s);
  out.push_back(rule);
  out.push_back(fmt::format(
      "total model FLOPs of the step: {:.0f} = (6 x {} params + 12 x {} layers x {} x {}) x {} "
      "tokens",
      total_flops, c.num_parameters(), c.n_layer, c.n_embd, in.seq_len, in.tokens));
  if (in.on_gpu && step_s > 0 && in.peak_tflops > 0) {
    out.push_back(fmt::format(
        "achieved {:.2f} TFLOP/s | MFU {:.2f}% of {:g} TFLOP/s peak", total_flops / step_s / 1e12,
        100.0 * total_flops / step_s / (in.peak_tflops * 1e12), in.peak_tflops));
  } else if (step_s > 0) {
    out.push_back(fmt::format("achieved {:.4f} TFLOP/s | MFU: n/a on CPU (no peak to compare)",
                              total_flops / step_s / 1e12));
  }
  if (in.options.top_modules > 0 && !timed.empty()) {
    std::stable_sort(timed.begin(), timed.end(),
                     [](const Timed& a, const Timed& b) { return a.seconds > b.seconds; });
    std::string top;
    const size_t k = std::min(timed.size(), static_cast<size_t>(in.options.top_modules));
    for (size_t i = 0; i < k; ++i)
      top += fmt::format("{}{} ({} ms)", i ? ", " : "", timed[i].name, ms(timed[i].seconds));
    out.push_back(fmt::format("top {} modules by latency: {}", k, top));
  }
  out.push_back(rule);
  return out;
}

}  // namespace shardtrain
