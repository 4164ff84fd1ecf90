// Pipeline parallelism: the strategy `pipeline` (docs/PIPELINE.md).
//
// The world of P·D ranks is a grid of P stages × D data-parallel replicas, stage-major as in
// Megatron-LM and DeepSpeed's PipelineParallelGrid: rank = stage·D + replica, so consecutive
// ranks are the replicas of one stage. Each rank builds its stage's part of GPT-2 (GPT2Model's
// layer_ids constructor: the layers partition.h assigns to its V chunks) and runs an ordinary
// strategy on it across the replicas of its stage — dp, zero1 or zero2 (the plan's ZeRO stage) —
// over a communicator split from the world; the P stages of a replica exchange activations and
// their gradients over another (executor.h).
//
// The tied embedding. The first stage owns wte; the last stage's head reads a copy (compute
// dtype) and accumulates its gradient into a buffer of its own, which it sends to the first stage
// once the step's last head backward is done; the first stage adds it to the embedding's gradient
// in its last embedding backward, so the optimizer, the gradient norm and checkpoints see one wte.
// After the optimizer step the first stage sends the updated wte to the last (Megatron's
// embedding group does the same with an all-reduce of two copies).
//
// One optimizer step (run_step): the schedule's actions run on every stage; the loss is the last
// stage's, summed over the world; the gradient norm sums the stages' squared norms; clipping and
// the fp16 loss scale act as in TrainStep. PipeDream-2BW (arXiv 2006.09503 §3.1) computes step t's
// gradient on the weights of step t-1 (W(t+1) = W(t) − η·∇f(W(t−1))): the stage keeps the
// previous version of its compute weights and swaps it in for the step's passes. Without a flush
// (§3: run_step's `next`), a step also runs the next step's look-ahead forwards, on W(t): the
// stage switches versions around them (two copies of its compute weights per look-ahead run).
//
// Checkpoints are written in the whole model's flat layout (each stage's ranges mapped to it), so
// a pipeline checkpoint loads into dp/zero runs and back, and consolidates to Hugging Face format.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "data/dataset.h"
#include "model/micro_batch.h"
#include "optim/loss_scaler.h"
#include "parallel/pipeline/partition.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/trace.h"
#include "parallel/pipeline/transfer_plan.h"
#include "parallel/step_result.h"
#include "parallel/strategy.h"

namespace shardtrain {

class PipelineExecutor;  // executor.h

/// What the pipeline strategy is told.
struct PipelineOptions {
  int stages = 1;  ///< P
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  int virtual_stages = 1;  ///< V model chunks per rank
  PartitionMethod partition = PartitionMethod::kParameters;
  bool activation_checkpointing = false;  ///< blocks recompute in backward
  std::string trace_dir;                  ///< --trace: the measured timeline
  /// The micro-batch [B, T] (for `time` partitioning's measurement).
  int64_t micro_batch = 1, seq_len = 1;
};

/// Validation loss over the evaluation data of this replica's share.
struct PipelineEvaluation {
  double loss_sum = 0;  ///< Σ per-sample mean loss (every rank of the world; summed)
  int64_t samples = 0;
};

class PipelineParallel final : public Strategy {
 public:
  /// `inner`: the strategy across replicas (plan.zero_stage 0, 1 or 2; no offload). `world`:
  /// all P·D ranks. Throws ConfigError when the world size is not a multiple of P or the plan
  /// asks for ZeRO-3 or offload.
  PipelineParallel(const PipelineOptions& options, const StrategyOptions& inner, Backend& backend,
                   Communicator& world);
  ~PipelineParallel() override;

  std::string name() const override { return "pipeline"; }

  /// `model`: the whole model (its layout and config; it runs nothing). Builds this rank's stage
  /// model and the strategy across replicas; `init_params` in the whole model's flat layout.
  void setup(Model& model, const std::vector<float>& init_params) override;

  /// One optimizer step over `accumulation` micro-batches (M) — the same contract as
  /// TrainStep::run. Collective over the world. 2bw: with `next` (the next step's micro-batches,
  /// the same on every rank's call: set or not), the step does not drain — it ends with the
  /// next step's look-ahead forwards (PipeDream-2BW without a flush, arXiv 2006.09503 §3) — and
  /// the next step does not fill; the results equal the flushed ones. Without `next` (the last
  /// step, or before an evaluation) it drains.
  StepResult run_step(int64_t step, double lr, const MicroBatchSource& batches, LossScaler& scaler,
                      const TrainStepOptions& options, const MicroBatchSource* next = nullptr);
  /// Forward-only pass over this replica's share of `data` in batches of up to `batch`
  /// (validation). Collective over the world; the result is the world's sum.
  PipelineEvaluation evaluate(const PackedDataset& data, int64_t batch);

  /// The shape the last run_step ran (2bw: whether it filled and drained the pipeline).
  const PipelineShape& last_step_shape() const;
  int stage() const { return stage_; }
  int replica() const { return replica_; }
  int data_parallel_size() const { return D_; }
  /// Banner lines: the stages' layers, the schedule, 2bw's staleness.
  std::vector<std::string> describe() const;
  /// Ends tracing (--trace): writes this stage's last traced step; rank 0 merges the stages' files
  /// and returns the summary lines (empty elsewhere or without --trace). Collective.
  std::vector<std::string> finish_trace();

  // ---- Strategy: the stage's inner strategy, ranges mapped to the whole model's layout ----
  void zero_grad() override;
  void begin_micro_step(int64_t, int64_t) override {}
  void finish_gradients() override {}
  double grad_norm(double scale) override;
  void step(double lr, double grad_scale) override;
  FullState gather_state() override;
  void load_state(const FullState& state) override;
  size_t model_state_bytes() const override;
  std::vector<FlatRange> save_ranges() const override;
  void read_state(StateTensor q, int64_t offset, int64_t numel, float* host) override;
  std::vector<FlatRange> load_ranges() const override;
  void write_state(StateTensor q, int64_t offset, int64_t numel, const float* host) override;
  void finish_load(int64_t optimizer_steps) override;
  int64_t optimizer_steps() const override;
  OptimizerKind optimizer_kind() const override;
  int64_t gathered_bytes_last_step() const override;

 private:
  /// Maps a whole-model flat range (inside one layer of this stage) to the stage's layout.
  int64_t stage_offset(int64_t whole_offset) const;
  std::vector<FlatRange> to_whole(const std::vector<FlatRange>& stage_ranges) const;
  void sync_tied_weight();
  void swap_in_previous_weights();
  void restore_current_weights();
  /// 2bw without a flush, between swap_in_previous_weights and restore_current_weights: the
  /// stage computes with the next step's weights W(t) (`next`) or this step's W(t−1).
  void use_weight_version(bool next);
  std::vector<double> layer_costs(const GPT2Model& whole);

  PipelineOptions opt_;
  StrategyOptions inner_opt_;
  Backend& backend_;
  Communicator& world_;
  int P_, D_, stage_, replica_;
  /// The P ranks of this replica (collectives); data_comm_: the D replicas of this stage.
  std::unique_ptr<Communicator> pipe_comm_, data_comm_;
  /// The transfer channels over the P ranks of this replica (transfer_plan.h), indexed as
  /// channel_map_ says; channel(src, dst) is the one from stage src to its neighbour dst.
  PipelineChannels channel_map_;
  std::vector<std::unique_ptr<Communicator>> channels_;
  Communicator& channel(int src, int dst);
  std::vector<LayerSpan> spans_;
  GPT2Config config_;
  const ParamLayout* whole_layout_ = nullptr;
  std::unique_ptr<GPT2Model> stage_model_;
  std::unique_ptr<Strategy> inner_;
  std::unique_ptr<PipelineExecutor> executor_;
  /// The last stage's copy of wte and its gradient (stages with the head, not the embedding).
  FlatBuffer wte_copy_, dwte_copy_;
  /// 2bw: the previous version of the compute weights (and of the wte copy), and scratch.
  FlatBuffer prev_params_, prev_wte_, spare_params_, spare_wte_;
  bool have_prev_ = false;
  int64_t traced_step_ = 0;     ///< the step the executor's trace holds
  PipelineShape traced_shape_;  ///< its shape (2bw: whether it filled and drained)
  bool steady_traced_ = false;  ///< 2bw: a step that neither filled nor drained was traced
  std::vector<std::string> layer_names_;
};

}  // namespace shardtrain
