#include "parallel/pipeline/pipeline_parallel.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "comm/scalar_all_reduce.h"
#include "config/knob.h"
#include "core/error.h"
#include "parallel/pipeline/executor.h"

namespace shardtrain {

PipelineParallel::PipelineParallel(const PipelineOptions& options, const StrategyOptions& inner,
                                   Backend& backend, Communicator& world)
    : opt_(options), inner_opt_(inner), backend_(backend), world_(world), P_(options.stages) {
  const int W = world.world_size();
  check<ConfigError>(P_ >= 1 && W % P_ == 0,
                     "world size {} is not divisible by {} {}: launch a multiple of {} ranks "
                     "(stages × data-parallel replicas) or change the stages",
                     W, knob_for(&TrainConfig::pipeline, &PipelineConfig::stages).name(), P_, P_);
  const ParallelPlan& plan = inner.plan;
  check<ConfigError>(plan.zero_stage <= 2 && plan.optimizer_offload == OffloadDevice::kNone &&
                         plan.param_offload == OffloadDevice::kNone,
                     "pipeline parallelism runs with ZeRO stage 0, 1 or 2 across the replicas of "
                     "each stage, without offload (got stage {}{}): set {} to 0, 1 or 2 and "
                     "remove {} / {}",
                     plan.zero_stage,
                     plan.optimizer_offload != OffloadDevice::kNone ? ", optimizer offload" : "",
                     zero_knob(&ZeroConfig::stage).path,
                     zero_knob(&ZeroConfig::offload_optimizer_device).section(),
                     zero_knob(&ZeroConfig::offload_param_device).section());
  D_ = W / P_;
  stage_ = world.rank() / D_;
  replica_ = world.rank() % D_;
  std::vector<int> pipe_ranks, data_ranks;
  for (int s = 0; s < P_; ++s) pipe_ranks.push_back(s * D_ + replica_);
  for (int d = 0; d < D_; ++d) data_ranks.push_back(stage_ * D_ + d);
  // Collective: every rank splits the same ways (its own groups), in the same order: the pipeline
  // group (collectives), one communicator per transfer channel (transfer_plan.h), the replicas.
  pipe_comm_ = world.split(pipe_ranks);
  channel_map_ = PipelineChannels::per_neighbour(P_);
  for (int c = 0; c < channel_map_.count(); ++c) channels_.push_back(world.split(pipe_ranks));
  data_comm_ = world.split(data_ranks);
}

PipelineParallel::~PipelineParallel() = default;

Communicator& PipelineParallel::channel(int src, int dst) {
  return *channels_[static_cast<size_t>(channel_map_.of(src, dst, MessageKind::kActivation))];
}

// ---- setup -------------------------------------------------------------------------------------

std::vector<double> PipelineParallel::layer_costs(const GPT2Model& whole) {
  const ParamLayout& layout = whole.layout();
  const int n = layout.num_layers();
  std::vector<double> costs(static_cast<size_t>(n), 1.0);
  costs.front() = costs.back() = 0;
  if (opt_.partition == PartitionMethod::kUniform) return costs;
  if (opt_.partition == PartitionMethod::kParameters) {
    for (int l = 0; l < n; ++l) {
      double& c = costs[static_cast<size_t>(l)] = 0;
      for (const ParamTensor& t : layout.layers()[static_cast<size_t>(l)].tensors)
        c += static_cast<double>(t.numel);
    }
    // The head computes with the tied wte: count it there too (DeepSpeed's tied layer specs).
    costs.back() += static_cast<double>(layout.find("transformer.wte.weight")->numel);
    return costs;
  }
  // kTime: forward + backward of the embedding, one block and the head on one micro-batch,
  // measured here and averaged over the world (so every rank cuts the same way).
  GPT2Model probe(config_, backend_, opt_.activation_checkpointing, {0, 1, config_.n_layer + 1});
  const int64_t numel = probe.layout().numel();
  std::vector<float> host(static_cast<size_t>(numel));
  probe.init_parameters(host.data(), 1);
  FlatBuffer master(backend_, DType::kF32, numel),
      params(backend_, backend_.compute_dtype(), numel),
      grads(backend_, backend_.compute_dtype(), numel);
  backend_.copy_from_host(master.data(), host.data(), host.size() * sizeof(float));
  backend_.convert(params.view(), master.view());
  probe.bind(params.view(), grads.view());
  const int64_t B = opt_.micro_batch, T = opt_.seq_len;
  std::vector<int32_t> tokens(static_cast<size_t>(B * T), 1);
  using Clock = std::chrono::steady_clock;
  double measured[3] = {0, 0, 0};
  constexpr int kReps = 3;
  for (int rep = 0; rep <= kReps; ++rep) {  // rep 0 warms up
    probe.prepare(0, tokens.data(), tokens.data(), B, T, 1.0f / static_cast<float>(B * T));
    for (int l = 0; l < 3; ++l) {
      backend_.synchronize();
      const auto t0 = Clock::now();
      probe.forward_layers(0, l, l + 1);
      backend_.synchronize();
      if (rep > 0) measured[l] += std::chrono::duration<double>(Clock::now() - t0).count();
    }
    for (int l = 2; l >= 0; --l) {
      backend_.synchronize();
      const auto t0 = Clock::now();
      probe.backward_layers(0, l, l + 1, BackwardPass::kFull);
      backend_.synchronize();
      if (rep > 0) measured[l] += std::chrono::duration<double>(Clock::now() - t0).count();
    }
  }
  ScalarAllReduce(backend_, world_, 3).sum(measured);
  costs.front() = measured[0];
  for (int l = 1; l + 1 < n; ++l) costs[static_cast<size_t>(l)] = measured[1];
  costs.back() = measured[2];
  return costs;
}

void PipelineParallel::setup(Model& model, const std::vector<float>& init) {
  auto* gpt2 = dynamic_cast<GPT2Model*>(&model);
  check<ConfigError>(gpt2 != nullptr,
                     "pipeline parallelism splits GPT-2 models only, not {}; choose dp, zero1, "
                     "zero2, zero3 or offload for it",
                     model.name());
  GPT2Model& whole = *gpt2;
  config_ = whole.config();
  whole_layout_ = &whole.layout();
  const int V = opt_.virtual_stages;
  spans_ = partition_layers(layer_costs(whole), P_ * V);
  const std::vector<int> ids = stage_layer_ids(spans_, P_, stage_);
  stage_model_ = std::make_unique<GPT2Model>(config_, backend_, opt_.activation_checkpointing, ids);
  const ParamLayout& sl = stage_model_->layout();
  for (int l = 0; l < sl.num_layers(); ++l)
    ST_ASSERT(sl.layers()[static_cast<size_t>(l)].numel ==
              whole_layout_->layers()[static_cast<size_t>(ids[static_cast<size_t>(l)])].numel);

  std::vector<float> stage_init;
  if (!init.empty()) {
    stage_init.resize(static_cast<size_t>(sl.numel()));
    for (int l = 0; l < sl.num_layers(); ++l) {
      const LayerRange& r = sl.layers()[static_cast<size_t>(l)];
      const LayerRange& w =
          whole_layout_->layers()[static_cast<size_t>(ids[static_cast<size_t>(l)])];
      std::copy_n(init.begin() + w.offset, r.numel, stage_init.begin() + r.offset);
    }
  }
  StrategyOptions io = inner_opt_;
  io.plan.pipeline_stages = 1;
  if (V > 1) {
    // Chunks run their backwards interleaved: reduce after the whole backward, and never let a
    // gradient bucket span two chunks (one layer per bucket).
    io.zero.overlap_comm = false;
    io.zero.reduce_bucket_size = 1;
    io.zero.reduce_bucket_size_set = true;
  }
  inner_ = make_strategy(io, backend_, *data_comm_);
  inner_->setup(*stage_model_, stage_init);

  Tensor dwte;
  if (P_ > 1 && stage_model_->has_head() && !stage_model_->has_embedding()) {
    const int64_t VC = config_.vocab_size * config_.n_embd;
    wte_copy_ = FlatBuffer(backend_, backend_.compute_dtype(), VC);
    dwte_copy_ = FlatBuffer(backend_, backend_.compute_dtype(), VC);
    const auto as_matrix = [&](const FlatBuffer& f) {
      return Tensor(f.data(), f.dtype(), backend_.kind(), {config_.vocab_size, config_.n_embd});
    };
    stage_model_->set_tied_embedding(as_matrix(wte_copy_), as_matrix(dwte_copy_));
    dwte = as_matrix(dwte_copy_);
  }
  std::vector<ChunkLayers> chunks;
  for (int c = 0; c < V; ++c) {
    const LayerSpan& s = spans_[static_cast<size_t>(c * P_ + stage_)];
    const auto pos = [&](int id) {
      return static_cast<int>(std::find(ids.begin(), ids.end(), id) - ids.begin());
    };
    chunks.push_back({pos(s.first), pos(s.last - 1) + 1});
  }
  std::vector<Communicator*> channels;
  for (auto& c : channels_) channels.push_back(c.get());
  executor_ =
      std::make_unique<PipelineExecutor>(*stage_model_, *inner_, backend_, std::move(channels),
                                         opt_.schedule, V, std::move(chunks), dwte);
  layer_names_.clear();
  for (const LayerSpan& s : spans_) {
    const auto name = [&](int id) { return whole_layout_->layers()[static_cast<size_t>(id)].name; };
    layer_names_.push_back(s.last - s.first == 1 ? name(s.first)
                                                 : name(s.first) + ".." + name(s.last - 1));
  }
  sync_tied_weight();
}

void PipelineParallel::sync_tied_weight() {
  if (P_ == 1) return;
  inner_->wait_for_parameters();
  if (stage_ == 0) channel(0, P_ - 1).send(stage_model_->embedding_weight(), P_ - 1)->wait();
  if (stage_ == P_ - 1) channel(0, P_ - 1).recv(wte_copy_.view(), 0)->wait();
}

// ---- 2bw weight versions
// -------------------------------------------------------------------------

void PipelineParallel::swap_in_previous_weights() {
  // P holds W(t), prev W(t-1): keep W(t) in spare and compute this step on W(t-1).
  const auto swap_in = [&](Tensor live, FlatBuffer& prev, FlatBuffer& spare) {
    if (spare.numel() != live.numel()) spare = FlatBuffer(backend_, live.dtype, live.numel());
    backend_.copy(spare.data(), live.data, live.bytes());
    backend_.copy(live.data, prev.data(), live.bytes());
  };
  swap_in(inner_->compute_parameters(), prev_params_, spare_params_);
  if (wte_copy_.numel() > 0) swap_in(wte_copy_.view(), prev_wte_, spare_wte_);
}

void PipelineParallel::use_weight_version(bool next) {
  if (!have_prev_) return;  // step 0: W(-1) = W(0), one version
  const auto use = [&](Tensor live, FlatBuffer& version) {
    backend_.copy(live.data, version.data(), live.bytes());
  };
  use(inner_->compute_parameters(), next ? spare_params_ : prev_params_);
  if (wte_copy_.numel() > 0) use(wte_copy_.view(), next ? spare_wte_ : prev_wte_);
}

void PipelineParallel::restore_current_weights() {
  const auto restore = [&](Tensor live, FlatBuffer& prev, FlatBuffer& spare) {
    if (!have_prev_) {  // step 0: W(-1) = W(0)
      prev = FlatBuffer(backend_, live.dtype, live.numel());
      backend_.copy(prev.data(), live.data, live.bytes());
      return;
    }
    backend_.copy(live.data, spare.data(), live.bytes());
    std::swap(prev, spare);  // prev = W(t) for the next step
  };
  restore(inner_->compute_parameters(), prev_params_, spare_params_);
  if (wte_copy_.numel() > 0) restore(wte_copy_.view(), prev_wte_, spare_wte_);
  have_prev_ = true;
}

// ---- one step
// ------------------------------------------------------------------------------------

void PipelineParallel::zero_grad() {
  inner_->zero_grad();
  if (dwte_copy_.numel() > 0) backend_.fill_zero(dwte_copy_.view());
}

double PipelineParallel::grad_norm(double scale) {
  const double mine = inner_->grad_norm(scale);
  double sq = mine * mine;
  ScalarAllReduce(backend_, *pipe_comm_, 1).sum(std::span<double>(&sq, 1));
  return std::sqrt(sq);
}

void PipelineParallel::step(double lr, double grad_scale) {
  inner_->step(lr, grad_scale);
  sync_tied_weight();
}

StepResult PipelineParallel::run_step(int64_t step_index, double lr,
                                      const MicroBatchSource& batches, LossScaler& scaler,
                                      const TrainStepOptions& options,
                                      const MicroBatchSource* next) {
  const int64_t M = options.accumulation_steps;
  const bool two_bw = opt_.schedule == PipelineSchedule::k2BW;
  std::optional<PipelineLookahead> lookahead;
  if (two_bw && next != nullptr && P_ > 1)
    lookahead.emplace(
        PipelineLookahead{*next, [this](bool use_next) { use_weight_version(use_next); }});
  // --trace keeps a 2bw step that neither fills nor drains once there is one (the steady state).
  const bool steady = lookahead && executor_->holds_lookahead();
  const bool trace = !opt_.trace_dir.empty() && (steady || !steady_traced_);
  StepResult r;
  r.loss_scale = scaler.scale();
  if (two_bw && have_prev_) swap_in_previous_weights();
  zero_grad();
  // Dropout seeds from (run seed, replica, step, micro-batch): the masks data parallelism over
  // D ranks draws for the same micro-batches.
  executor_->set_dropout_step(options.dropout_seed, replica_, step_index);
  const double loss = executor_->run(static_cast<int>(M), batches, r.loss_scale, trace,
                                     lookahead ? &*lookahead : nullptr);
  if (trace) {
    traced_step_ = step_index;
    traced_shape_ = executor_->shape();
    steady_traced_ = steady_traced_ || steady;
  }
  inner_->finish_gradients();
  if (two_bw) restore_current_weights();
  // Gradients hold Σ over micro-batches and replicas of ∂(loss_scale · mean loss)/∂θ.
  const double mean_scale = 1.0 / (static_cast<double>(M * D_) * r.loss_scale);
  r.grad_norm = grad_norm(mean_scale);
  clip_and_update(r, step_index, lr, options.gradient_clipping, mean_scale, scaler,
                  [&](double grad_scale) { inner_->step(lr, grad_scale); });
  sync_tied_weight();
  double sum = loss;  // the last stage's micro-batch losses; 0 elsewhere
  ScalarAllReduce(backend_, world_, 1).sum(std::span<double>(&sum, 1));
  r.loss = sum / static_cast<double>(M * D_);
  backend_.synchronize();
  check_loss_finite(r, step_index, lr);
  return r;
}

const PipelineShape& PipelineParallel::last_step_shape() const { return executor_->shape(); }

PipelineEvaluation PipelineParallel::evaluate(const PackedDataset& data, int64_t batch) {
  executor_->discard_lookahead();  // 2bw: the slots are needed (the next step fills again)
  const int64_t T = data.max_length();
  const int V = opt_.virtual_stages, last_v = P_ * V - 1;
  std::vector<int32_t> tokens, targets;
  double totals[2] = {0, 0};
  GPT2Model& m = *stage_model_;
  for (const FlatRange& range : even_split(data.size(), D_, replica_)) {
    const int64_t end = range.offset + range.numel;
    for (int64_t start = range.offset; start < end; start += batch) {
      const int64_t b = std::min(batch, end - start);
      data.batch(start, b, tokens, targets);
      m.prepare(0, tokens.data(), targets.data(), b, T, 1.0f, false);
      for (int c = 0; c < V; ++c) {
        const int v = c * P_ + stage_;
        const ChunkLayers ch = executor_->chunk(c);
        if (v > 0) {
          const int src = (v - 1) % P_;
          if (src != stage_)
            channel(src, stage_).recv(m.activation(0, ch.first), src)->wait();
          else  // the previous chunk is on this rank (one stage, interleaved)
            backend_.copy(m.activation(0, ch.first).data,
                          m.activation(0, executor_->chunk(c - 1).last).data,
                          m.activation(0, ch.first).bytes());
        }
        m.forward_layers(0, ch.first, ch.last);
        if (v == last_v) {
          totals[0] += m.slot_loss(0) * static_cast<double>(b);
          totals[1] += static_cast<double>(b);
        } else if ((v + 1) % P_ != stage_) {
          channel(stage_, (v + 1) % P_).send(m.activation(0, ch.last), (v + 1) % P_)->wait();
        }
      }
    }
  }
  ScalarAllReduce(backend_, world_, 2).sum(totals);
  return {totals[0], static_cast<int64_t>(totals[1])};
}

// ---- reporting ----------------------------------------------------------------------------------

std::vector<std::string> PipelineParallel::describe() const {
  std::vector<std::string> out;
  out.push_back(fmt::format(
      "pipeline: {} stage{} × {} data-parallel replica{} (rank = stage·{} + replica), schedule {}"
      "{}, {} partition, {} across replicas",
      P_, P_ == 1 ? "" : "s", D_, D_ == 1 ? "" : "s", D_, to_string(opt_.schedule),
      opt_.virtual_stages > 1 ? fmt::format(" with {} virtual stages", opt_.virtual_stages) : "",
      to_string(opt_.partition), inner_ ? inner_->name() : std::string("?")));
  std::string stages;
  for (size_t v = 0; v < layer_names_.size(); ++v)
    stages += fmt::format("{}{}: {}", v ? " | " : "", v, layer_names_[v]);
  out.push_back("  virtual stages: " + stages);
  if (opt_.schedule == PipelineSchedule::k2BW)
    out.push_back(
        "  PipeDream-2BW (arXiv 2006.09503): each step's gradient is computed on the weights of "
        "the step before (one step stale): W(t+1) = W(t) − lr·adamw(∇f(W(t−1))); two weight "
        "versions per stage; no flush between steps (each step ends with the next one's first "
        "forwards; the pipeline drains only before an evaluation and at the end)");
  return out;
}

std::vector<std::string> PipelineParallel::finish_trace() {
  if (opt_.trace_dir.empty() || !executor_) return {};
  if (replica_ == 0)
    write_stage_trace(opt_.trace_dir, stage_, static_cast<int>(traced_step_), executor_->trace());
  world_.barrier();
  if (world_.rank() != 0) return {};
  const MeasuredPipeline m = merge_pipeline_trace(opt_.trace_dir, opt_.schedule, traced_shape_);
  std::vector<std::string> out{format_measured_summary(m)};
  std::string files;
  for (const auto& f : m.files) files += (files.empty() ? "" : ", ") + f.string();
  out.push_back("trace: wrote " + files);
  return out;
}

// ---- checkpoints: the stage's ranges in the whole model's layout --------------------------------

int64_t PipelineParallel::stage_offset(int64_t whole_offset) const {
  const ParamLayout& sl = stage_model_->layout();
  for (int l = 0; l < sl.num_layers(); ++l) {
    const LayerRange& w =
        whole_layout_->layers()[static_cast<size_t>(stage_model_->global_layer(l))];
    if (whole_offset >= w.offset && whole_offset < w.offset + w.numel)
      return whole_offset - w.offset + sl.layers()[static_cast<size_t>(l)].offset;
  }
  throw RuntimeFailure(fmt::format(
      "pipeline stage {}: flat element {} is not in this stage's layers", stage_, whole_offset));
}

std::vector<FlatRange> PipelineParallel::to_whole(const std::vector<FlatRange>& ranges) const {
  const ParamLayout& sl = stage_model_->layout();
  std::vector<FlatRange> out;
  for (const FlatRange& r : ranges) {
    for (int l = 0; l < sl.num_layers(); ++l) {
      const LayerRange& s = sl.layers()[static_cast<size_t>(l)];
      const int64_t a = std::max(r.offset, s.offset);
      const int64_t b = std::min(r.offset + r.numel, s.offset + s.numel);
      if (a >= b) continue;
      const LayerRange& w =
          whole_layout_->layers()[static_cast<size_t>(stage_model_->global_layer(l))];
      out.push_back({a - s.offset + w.offset, b - a});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const FlatRange& x, const FlatRange& y) { return x.offset < y.offset; });
  return out;
}

namespace {

/// Calls fn(stage_offset, n, index into the caller's buffer) for the pieces of the whole-layout
/// range [offset, offset + numel), split where the stage's layers or `ranges` (stage layout) end.
template <typename Fn>
void for_each_piece(const ParamLayout& sl, const ParamLayout& whole, const GPT2Model& model,
                    const std::vector<FlatRange>& ranges, int64_t offset, int64_t numel, Fn fn) {
  for (int l = 0; l < sl.num_layers(); ++l) {
    const LayerRange& w = whole.layers()[static_cast<size_t>(model.global_layer(l))];
    const int64_t a = std::max(offset, w.offset), b = std::min(offset + numel, w.offset + w.numel);
    if (a >= b) continue;
    const int64_t shift = sl.layers()[static_cast<size_t>(l)].offset - w.offset;
    for (const FlatRange& r : ranges) {
      const int64_t ra = std::max(a + shift, r.offset),
                    rb = std::min(b + shift, r.offset + r.numel);
      if (ra < rb) fn(ra, rb - ra, ra - shift - offset);
    }
  }
}

}  // namespace

std::vector<FlatRange> PipelineParallel::save_ranges() const {
  return to_whole(inner_->save_ranges());
}

std::vector<FlatRange> PipelineParallel::load_ranges() const {
  return to_whole(inner_->load_ranges());
}

void PipelineParallel::read_state(StateTensor q, int64_t offset, int64_t numel, float* host) {
  for_each_piece(
      stage_model_->layout(), *whole_layout_, *stage_model_, inner_->save_ranges(), offset, numel,
      [&](int64_t so, int64_t n, int64_t at) { inner_->read_state(q, so, n, host + at); });
}

void PipelineParallel::write_state(StateTensor q, int64_t offset, int64_t numel,
                                   const float* host) {
  for_each_piece(
      stage_model_->layout(), *whole_layout_, *stage_model_, inner_->load_ranges(), offset, numel,
      [&](int64_t so, int64_t n, int64_t at) { inner_->write_state(q, so, n, host + at); });
}

void PipelineParallel::finish_load(int64_t optimizer_steps) {
  inner_->finish_load(optimizer_steps);
  have_prev_ = false;  // 2bw: the loaded weights are both versions
  executor_->discard_lookahead();
  sync_tied_weight();
}

int64_t PipelineParallel::optimizer_steps() const { return inner_->optimizer_steps(); }
OptimizerKind PipelineParallel::optimizer_kind() const { return inner_->optimizer_kind(); }

int64_t PipelineParallel::gathered_bytes_last_step() const {
  return inner_->gathered_bytes_last_step();
}

size_t PipelineParallel::model_state_bytes() const {
  return inner_->model_state_bytes() + wte_copy_.bytes() + dwte_copy_.bytes() +
         prev_params_.bytes() + prev_wte_.bytes();
}

FullState PipelineParallel::gather_state() {
  throw RuntimeFailure(
      "the pipeline strategy keeps no full state on any rank: save a sharded checkpoint "
      "(save_sharded_checkpoint) and read it with load_full_state");
}

void PipelineParallel::load_state(const FullState&) {
  throw RuntimeFailure(
      "the pipeline strategy loads sharded checkpoints only (load_sharded_checkpoint)");
}

}  // namespace shardtrain
