// Run configuration: CLI flags and DeepSpeed JSON config, merged and validated.
//
// Precedence: built-in defaults < DeepSpeed JSON (--deepspeed-config) < flags given explicitly
// on the command line. Names follow DeepSpeed (train_batch_size, train_micro_batch_size_per_gpu,
// gradient_accumulation_steps, zero_optimization.stage, ...) and the CONFIG dict of the DeepSpeed
// GPT-2 tutorials (model, strategy, batch_size, epochs, max_length, num_samples, seed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config/pipeline_schedule.h"

namespace shardtrain {

/// Parallelism strategy (--strategy): presets of a ParallelPlan (plan_of).
enum class StrategyKind { kDataParallel, kZero1, kZero2, kZero3, kOffload, kInfinity, kPipeline };

enum class LrSchedule { kConstant, kLinear, kCosine };

/// The optimizer: AdamW (Loshchilov & Hutter, arXiv 1711.05101) or torch.optim.SGD (momentum,
/// Nesterov, coupled L2 weight decay).
enum class OptimizerKind { kAdamW, kSGD };

enum class Precision { kAuto, kFp32, kBf16, kFp16 };

/// DeepSpeed fp16 section: dynamic loss scaling (DeepSpeed docs, "FP16 training options").
struct LossScaleConfig {
  double loss_scale = 0.0;           ///< 0 = dynamic; > 0 = static scale
  int initial_scale_power = 16;      ///< dynamic scale starts at 2^initial_scale_power
  int64_t loss_scale_window = 1000;  ///< steps without overflow before the scale doubles
  int hysteresis = 2;                ///< overflows tolerated before the scale halves
  double min_loss_scale = 1.0;
};

/// DeepSpeed zero_optimization section.
struct ZeroConfig {
  int stage = 0;
  int64_t reduce_bucket_size = 500'000'000;     ///< elements (DeepSpeed's default)
  bool reduce_bucket_size_set = false;          ///< given explicitly (DeepSpeed JSON)
  int64_t allgather_bucket_size = 500'000'000;  ///< elements
  /// Launch gradient reductions (and stage-3 prefetches) while computing; false: after
  /// backward / when a layer is needed.
  bool overlap_comm = true;
  std::string offload_optimizer_device = "none";  ///< none | cpu | nvme
  std::string offload_param_device = "none";      ///< none | cpu | nvme
  std::string nvme_path;
  /// offload_optimizer.ratio: fraction of the optimizer state (and step) on the host; the rest
  /// stays on the GPU (partial offload). In [0, 1].
  double offload_ratio = 1.0;
  /// offload_optimizer.delayed_update (shardtrain's key; --offload-delayed-update): ZeRO-Offload's
  /// one-step delayed parameter update (arXiv 2101.06840, §4.3): the CPU step of step t overlaps
  /// the GPU's step t+1, which computes on the parameters of step t-1.
  bool offload_delayed_update = false;
  /// offload_optimizer.speculative_update (shardtrain's key; --offload-speculative-update): the
  /// host starts each part's AdamW as soon as the part's gradient is final, during backward,
  /// assuming the step is not clipped; when the gradient norm then calls for clipping, the parts
  /// are rolled back and redone with the clipped gradients (SuperOffload's speculation then
  /// validation, arXiv 2509.21271 §4.3). Unclipped steps are the same bit for bit; redone steps
  /// agree to fp32 rounding. Not with the delayed update or fp16; state on NVMe is not
  /// speculated. Default on.
  bool offload_speculative_update = true;
  /// offload_optimizer.max_in_cpu (shardtrain's key, after offload_param's): with the optimizer on
  /// NVMe, the elements per rank whose optimizer state (fp32 master, m, v: 12 bytes each) stays in
  /// host memory; the rest is paged from the swap file. 0 (default): all of it on NVMe, as
  /// DeepSpeed does. >= 0.
  int64_t offload_optimizer_max_in_cpu = 0;
  /// offload_optimizer.forward_group (shardtrain's key; --offload-forward-group): micro-batches at
  /// the start of each step whose forward runs layer by layer (layer 0 of all of them, then layer
  /// 1, …), so that the host's update, which lands layer by layer, overlaps that many forwards
  /// instead of one. Same results bit for bit; costs (group − 1) · (n_layer + 1) · B·T·n_embd
  /// activations in the compute dtype. Needs activation checkpointing. 0 (default): every
  /// micro-batch of the step when the optimizer is offloaded and activation checkpointing is on,
  /// else 1 (off). >= 0.
  int64_t offload_forward_group = 0;
  /// offload_optimizer.moments_dtype (shardtrain's key; --offload-moments-dtype): "fp32" (default)
  /// or "bf16": AdamW's m and v of the host-stepped elements in bf16, rounded stochastically
  /// (optim/cpu_adamw.h), so the host and NVMe state is 8 bytes per element instead of 12.
  std::string offload_moments_dtype = "fp32";
  /// offload_param.max_in_cpu: with offload_param "nvme", the parameter elements per rank kept in
  /// pinned host memory (whole layers in order while they fit); the others are paged from a swap
  /// file through offload_param.buffer_count pinned buffers (ZeRO-Infinity's parameter half).
  /// -1 (default, unlike DeepSpeed's 1e9): all in host memory. >= 0.
  int64_t offload_param_max_in_cpu = -1;
  /// offload_param.buffer_count: pinned buffers (each the size of the largest layer's slice) the
  /// paged parameters are read ahead into. >= 2; default 5, as DeepSpeed.
  int offload_param_buffer_count = 5;
  // (contiguous_gradients and reduce_scatter are not options here: ZeRO gradients always live
  // in contiguous flat buffers and are always reduce-scattered; the reader warns when a
  // DeepSpeed config turns them off.)
  // ---- stage 3 (DeepSpeed's stage3_* keys, also accepted without the prefix; element counts)
  /// Elements of parameters gathered ahead of the layer that needs them (prefetch window);
  /// 0 = no prefetch (gather each layer when it is needed). >= 0.
  int64_t stage3_prefetch_bucket_size = 50'000'000;
  /// A layer with fewer parameters than this stays replicated (never partitioned). >= 0.
  int64_t stage3_param_persistence_threshold = 100'000;
  /// Most gathered parameter elements alive at once on a rank. >= 1.
  int64_t stage3_max_live_parameters = 1'000'000'000;
  /// A gathered layer needed again within this many elements of parameters is kept. >= 0.
  int64_t stage3_max_reuse_distance = 1'000'000'000;
  /// Hybrid sharding (zero_hpz_partition_size, DeepSpeed ZeRO++'s key; FSDP2's HSDP): > 1 shards
  /// ZeRO-3's parameters, gradients and optimizer state within groups of this many consecutive
  /// ranks (a node) and replicates them across the groups; 1 = shard over every rank.
  int64_t hpz_partition_size = 1;
  /// zero_quantized_gradients (ZeRO++'s qgZ): the gradients that cross nodes — dp's
  /// hierarchical all-reduce, zero3's hybrid sharding — go as int8 with per-block scales
  /// (parallel/hierarchical_reduction.h).
  bool quantized_gradients = false;
  /// Checkpoints also hold a consolidated 16-bit model.safetensors (rank 0 streams it).
  /// (Deprecated spelling: stage3_gather_fp16_weights_on_model_save.)
  bool stage3_gather_16bit_weights_on_model_save = false;
};

/// DeepSpeed's top-level "aio" section: how the NVMe swap of ZeRO-Infinity
/// (parallel/offload/nvme_swap.h) does its I/O. DeepSpeed drives libaio; shardtrain runs a pool of
/// threads issuing pread/pwrite on a file opened with O_DIRECT, and maps the keys onto it as
/// follows.
struct AioConfig {
  /// aio.block_size: bytes of each pread/pwrite request a transfer is split into (the last
  /// request of a transfer may be shorter). >= 4096 and a multiple of 4096 (O_DIRECT alignment).
  int64_t block_size = 1 << 20;
  /// aio.queue_depth: most requests in flight on one swap file at once; further requests wait,
  /// in submission order. As each I/O thread runs one request at a time, the requests that
  /// actually run concurrently are min(thread_count, queue_depth). >= 1.
  int queue_depth = 8;
  /// aio.thread_count (DeepSpeed also spells it aio.intra_op_parallelism): I/O threads per swap
  /// file; the requests of one transfer are spread over them. In [1, 256].
  int thread_count = 1;
  /// aio.single_submit: DeepSpeed submits requests one io_submit at a time instead of in
  /// batches. Accepted; it changes nothing here, where every request is its own system call.
  bool single_submit = false;
  /// aio.overlap_events: DeepSpeed overlaps submitting new requests with reaping completed ones.
  /// Accepted; it changes nothing here, where a thread starts the next waiting request as soon
  /// as its previous one completes (always overlapped).
  bool overlap_events = true;
};

/// Where a kind of state lives (DeepSpeed offload_optimizer / offload_param "device").
enum class OffloadDevice { kNone, kCpu, kNvme };

/// How the job is parallelized: ZeRO stage and placement of state are independent settings;
/// --strategy names (dp, zero1, zero2, zero3, offload, infinity, pipeline and their aliases) are
/// presets of it (plan_for_strategy).
struct ParallelPlan {
  int zero_stage = 0;  ///< 0 (dp), 1, 2, 3: arXiv 1910.02054 §5
  OffloadDevice optimizer_offload =
      OffloadDevice::kNone;              ///< where fp32 master/m/v and the step live
  double optimizer_offload_ratio = 1.0;  ///< fraction of the optimizer state offloaded
  OffloadDevice param_offload = OffloadDevice::kNone;  ///< stage 3: where bf16 params live
  int pipeline_stages = 1;  ///< pipeline.stages for --strategy pipeline; 1 otherwise

  bool operator==(const ParallelPlan&) const = default;
};

/// Pipeline parallelism (--strategy pipeline; DeepSpeed's top-level "pipeline" section): the
/// transformer blocks are cut into `stages` consecutive parts, one per rank of a pipeline; the
/// world holds world_size / stages such pipelines (data-parallel replicas, reduced with ZeRO
/// stage 0, 1 or 2). The micro-batches of a pipeline step are its gradient_accumulation_steps.
struct PipelineConfig {
  int stages = 1;  ///< P ranks per pipeline (--pipeline-stages, pipeline.stages); >= 1
  PipelineSchedule schedule = PipelineSchedule::k1F1B;  ///< --pipeline-schedule
  /// V model chunks per rank (--virtual-stages); > 1 only with interleaved-1f1b (which needs
  /// V >= 2): the layers are then cut into P·V parts.
  int virtual_stages = 1;
  /// How the blocks are assigned to the stages (--partition-method, pipeline.partition_method):
  /// "uniform" = equal block counts; "parameters" = balance the parameter counts (the default,
  /// as DeepSpeed's PipelineModule); "time" = balance the measured per-layer time.
  std::string partition_method = "parameters";
  /// k > 0: activation checkpointing of the transformer blocks inside each stage (DeepSpeed's
  /// activation_checkpoint_interval); 0 = off. Every block is recomputed from its own input
  /// (the residual stream between blocks is kept anyway), so any k > 0 acts as k = 1. validate()
  /// sets it to 1 when it is 0 and TrainConfig::activation_checkpointing is on.
  int activation_checkpoint_interval = 0;

  bool operator==(const PipelineConfig&) const = default;
};

/// Where the training monitors (monitor/monitor.h) write; empty directories are off.
struct MonitorConfig {
  /// TensorBoard event files (--tensorboard DIR; DeepSpeed tensorboard.output_path/job_name).
  std::string tensorboard_dir;
  /// Every rank writes TensorBoard events, rank r in tensorboard_dir/rank-r; otherwise rank 0
  /// only, in tensorboard_dir itself (--tensorboard-all-ranks).
  bool tensorboard_all_ranks = false;
  /// CSV files, rank 0 only (--csv-monitor DIR; DeepSpeed csv_monitor.output_path/job_name).
  std::string csv_dir;
};

/// The FLOPs profiler (train/flops_profiler.h; DeepSpeed's flops_profiler section, --profile-step):
/// at optimizer step profile_step (1-based) rank 0 prints a per-module table of parameters,
/// analytic FLOPs, measured device latency, TFLOP/s and share of the step.
struct FlopsProfilerConfig {
  bool enabled = false;
  int64_t profile_step = 1;   ///< 1-based optimizer step to profile
  int64_t module_depth = -1;  ///< -1: every level (blocks and their parts); 0: top-level rows only
  int64_t top_modules = 1;    ///< the N modules of the longest latency, listed after the table
  bool detailed = true;       ///< the attention/MLP/LayerNorm sub-rows of each block
  std::string output_file;    ///< write the table there instead of the log; "" = the log
};

/// --offload auto (parallel/placement_planner.h): the ZeRO stage and where the optimizer state
/// and the parameters live (GPU, host, NVMe) are chosen at start-up, the plan that fits these
/// budgets (the smallest over all ranks) with the fewest bytes over PCIe and the disk per step.
struct PlacementConfig {
  bool automatic = false;
  double gpu_memory_gib = 0;       ///< per GPU (--gpu-memory); 0: the device's total memory
  double max_host_memory_gib = 0;  ///< per node (--max-host-memory); 0: its available memory
};

struct TrainConfig {
  // ---- model and placement ----
  /// Preset name or path of a config.json (resolve_model in model/gpt2_config.h); empty with
  /// `resume` set: the checkpoint's own shape (resolve_train_model in train/trainer.h).
  std::string model = "gpt2-tiny";
  std::string strategy_name = "dp";  ///< as given by the user (aliases allowed)
  StrategyKind strategy = StrategyKind::kDataParallel;
  std::string device = "auto";  ///< auto | cpu | cuda
  Precision precision = Precision::kAuto;
  LossScaleConfig loss_scale;
  ZeroConfig zero;
  AioConfig aio;  ///< DeepSpeed "aio" section: I/O of the NVMe swap (ZeRO-Infinity)
  /// What runs: derived by validate() from `strategy` (a preset) and `zero` (plan_of). train()
  /// refuses a config whose plan does not match them (validate() was not called).
  ParallelPlan plan;
  PlacementConfig placement;  ///< --offload auto: `strategy`, `zero` and `plan` chosen at start-up
  bool activation_checkpointing = false;
  PipelineConfig pipeline;  ///< --strategy pipeline: stages, schedule, partition
  /// Where `strategy` came from, for error messages: "" (default or set in code), "--strategy",
  /// "--zero-stage" or "deepspeed" (zero_optimization.stage in the DeepSpeed JSON).
  std::string strategy_source;

  // ---- batch (DeepSpeed batch identity: train_batch_size = micro × accumulation × D, D the
  // data-parallel degree: world_size, or world_size / pipeline stages for a pipeline) ----
  int64_t micro_batch_size = 8;  ///< samples per device per micro-step (--batch-size)
  int64_t gradient_accumulation_steps = 1;
  int64_t train_batch_size = 0;  ///< global batch in samples; derived after validate()
  int world_size = 1;            ///< ranks (set by the launcher); pipeline: stages × replicas
  int ranks_per_node = 1;        ///< ranks on each node (the launcher's LOCAL_WORLD_SIZE)
  /// dp, zero1, zero2, zero3: sum the gradients within each node, then across nodes 1/k of them
  /// per rank (dp: then gather within the node; parallel/hierarchical_reduction.h).
  /// --hierarchical-all-reduce asks for it, --no-hierarchical-all-reduce forbids it; neither:
  /// chosen by hierarchical_reduction() (see there).
  bool hierarchical_all_reduce = false;
  bool no_hierarchical_all_reduce = false;
  /// Whether micro_batch_size / gradient_accumulation_steps were given explicitly (flag or
  /// DeepSpeed JSON). validate() derives the ones not given from train_batch_size, as DeepSpeed.
  bool micro_batch_set = false;
  bool accumulation_set = false;

  // ---- length of training ----
  int64_t epochs = 1;
  int64_t max_steps = -1;    ///< optimizer steps; -1 = as many as `epochs` allows
  int64_t max_length = 128;  ///< tokens per sample (sequence length T); ≤ model context
  int64_t num_samples = -1;  ///< training samples used; -1 = all
  uint64_t seed = 42;
  /// --dropout: when ≥ 0, the model's embd_pdrop, attn_pdrop and resid_pdrop all become this
  /// (in [0, 1)); -1 keeps the model's own (0 in the presets, a config.json's values).
  double dropout = -1;

  // ---- optimizer: AdamW (Loshchilov & Hutter, arXiv 1711.05101) or SGD (torch.optim.SGD),
  // PyTorch defaults ----
  OptimizerKind optimizer = OptimizerKind::kAdamW;  ///< --optimizer / optimizer.type
  double lr = 6e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double adam_eps = 1e-8;
  /// AdamW: decoupled decay; SGD: coupled L2 added to the gradient (as torch.optim.SGD).
  double weight_decay = 0.01;
  double momentum = 0.0;           ///< SGD momentum μ in [0, 1) (PyTorch's default 0: plain SGD)
  bool nesterov = false;           ///< SGD Nesterov momentum; needs momentum > 0 (as PyTorch)
  double gradient_clipping = 1.0;  ///< max global L2 norm; 0 = off

  // ---- learning-rate schedule: linear warmup from 0, then decay to min_lr_ratio * lr ----
  int64_t warmup_steps = -1;  ///< -1 = 10% of the total steps (rounded down), at most 1000
  LrSchedule lr_schedule = LrSchedule::kCosine;
  double min_lr_ratio = 0.1;
  /// Learning rate at the start of warmup as a fraction of lr (DeepSpeed WarmupCosineLR
  /// warmup_min_ratio, or warmup_min_lr / warmup_max_lr); 0 = warm up from 0.
  double warmup_min_ratio = 0.0;

  // ---- data ----
  std::string dataset;     ///< "wikitext-2" or empty when train_file is given
  std::string train_file;  ///< plain text (or a token file written by `shardtrain tokenize`)
  std::string valid_file;
  std::string data_dir;   ///< where named data sets live; empty = the shipped copy
  std::string cache_dir;  ///< token caches; empty = $SHARDTRAIN_CACHE_DIR or ~/.cache/shardtrain
  int64_t eval_samples = -1;  ///< validation samples per evaluation; -1 = the whole split
  /// Image models: every image resized to image_size × image_size (bilinear); 0 = as stored.
  int64_t image_size = 0;
  /// Image models: label smoothing ε of the training loss (0 = plain cross-entropy).
  double label_smoothing = 0;
  /// Image models: batch norm's training statistics over all data-parallel ranks (SyncBatchNorm).
  bool sync_batchnorm = false;
  /// Image models on CUDA: replay each micro-batch's forward and backward as one captured CUDA
  /// graph (ImageModel::train_micro_batch); false: enqueue every op each time.
  bool cuda_graphs = true;

  // ---- output, logging, checkpoints ----
  std::string output_dir = "out";
  int64_t log_interval = 10;  ///< steps between log lines (DeepSpeed steps_per_print)
  /// Time forward, backward, the gradient-reduction wait and the optimizer step on the device
  /// and log their means with each log line (DeepSpeed wall_clock_breakdown).
  bool wall_clock_breakdown = false;
  /// --trace DIR (pipeline): write the measured per-stage pipeline timeline there; "" = none.
  std::string trace_dir;
  int64_t eval_interval = 0;  ///< steps between validations; 0 = at the end of each epoch
  int64_t save_interval = 0;  ///< steps between checkpoints; 0 = only at the end
  std::string resume;         ///< checkpoint directory (or an output dir: its latest)
  std::string init_from;      ///< initial weights (checkpoint or HF safetensors)
  /// Image models with --init-from FILE.safetensors: when the file's classifier head has another
  /// shape (class count) than the model's, keep the freshly initialized head (fine-tuning)
  /// instead of failing (like transformers' ignore_mismatched_sizes=True).
  bool replace_head = false;

  std::string deepspeed_config;  ///< path of the DeepSpeed JSON, if any
  double peak_tflops = 989.0;    ///< the GPU's dense bf16 peak (TFLOP/s) for MFU; H100/H200 SXM
  bool save_checkpoints = true;  ///< false (--no-save): write no checkpoint at all (benchmarks)
  MonitorConfig monitor;         ///< TensorBoard and CSV scalars (monitor/monitor.h)
  FlopsProfilerConfig flops_profiler;  ///< --profile-step / DeepSpeed flops_profiler
};

/// Canonical name of a strategy ("dp", "zero1", ...).
std::string to_string(StrategyKind s);
std::string to_string(LrSchedule s);
/// "adamw", "sgd".
std::string to_string(OptimizerKind k);
std::string to_string(Precision p);
/// "none", "cpu", "nvme".
std::string to_string(OffloadDevice d);

/// Parses a strategy name or alias: dp|ddp, zero1, zero2|fsdp_stage2, zero3|fsdp_stage3,
/// offload, infinity, pipeline (case-insensitive, '-' read as '_'). Throws ConfigError listing
/// the valid names and suggesting the closest one otherwise.
StrategyKind parse_strategy(const std::string& name);

/// Parses auto|fp32|bf16|fp16. Throws ConfigError naming the valid values otherwise.
Precision parse_precision(const std::string& name);

/// Parses adamw|sgd (case-insensitive). Throws ConfigError naming the valid values otherwise.
OptimizerKind parse_optimizer(const std::string& name);

/// Parses constant|linear|cosine. Throws ConfigError naming the valid values otherwise.
LrSchedule parse_lr_schedule(const std::string& name);

/// The ZeRO stage a strategy runs at: dp/pipeline 0, zero1 1, zero2/offload 2, zero3/infinity 3.
int zero_stage_of(StrategyKind s);

/// The strategy DeepSpeed runs for a ZeRO stage (0..3) and offload devices ("none", "cpu",
/// "nvme"): stage 0 dp, 1 zero1, 2 zero2, 3 zero3; any offload at stage 1-2 offload, at stage 3
/// infinity. ST_ASSERTs that 0 <= stage <= 3.
StrategyKind strategy_for_zero(int stage, const std::string& offload_optimizer_device = "none",
                               const std::string& offload_param_device = "none");

/// The parallel plan `cfg` asks for: the ZeRO stage of its strategy preset (zero_stage_of) and
/// the offload devices of its zero_optimization section. --strategy pipeline: the ZeRO stage of
/// zero_optimization (0, 1 or 2 across the replicas) and pipeline_stages = pipeline.stages.
ParallelPlan plan_of(const TrainConfig& cfg);

/// Names of the fields set explicitly on the command line (so the JSON does not override them).
using ExplicitFlags = std::vector<std::string>;

/// Applies the DeepSpeed JSON at `path` to `cfg`, except fields in `explicit_flags`
/// (e.g. "batch_size", "lr"). Valid DeepSpeed keys that shardtrain ignores are appended to
/// `ignored_keys` (the caller prints one warning). Throws ConfigError for malformed JSON,
/// wrong value types and unknown keys (naming the closest valid key).
///
/// Details (see https://www.deepspeed.ai/docs/config-json/):
///  - "auto" (as the Hugging Face integration writes) leaves the field unchanged.
///  - A present optimizer or scheduler section is read as DeepSpeed builds it: parameters it
///    omits take DeepSpeed's defaults (e.g. lr 1e-3, weight_decay 0, warmup_num_steps 1000).
///  - zero_optimization.stage decides `strategy` (even over an explicit --strategy, as in
///    DeepSpeed; "zero_stage" in `explicit_flags` keeps the flag) and sets strategy_source;
///    with the pipeline strategy it sets the ZeRO stage across the replicas and keeps pipeline.
///  - The "pipeline" section (stages, partition_method or partition, activation_checkpoint_interval
///    and shardtrain's schedule, virtual_stages) fills cfg.pipeline. "stages" > 1 selects the
///    pipeline strategy, as DeepSpeed's PipelineEngine would (an explicit --strategy naming another
///    strategy is an error); without it and without --strategy pipeline the section is listed in
///    `ignored_keys` and not applied.
///  - Ignored keys are listed only when their value is "on" (not false, null, "none" or a
///    section with "enabled": false). Unknown top-level keys are errors too (DeepSpeed itself
///    skips them silently), so that a typo cannot go unnoticed.
///  - JSON comments are accepted (DeepSpeed reads configs with hjson); duplicate keys are errors.
void apply_deepspeed_config(const std::string& path, TrainConfig& cfg,
                            const ExplicitFlags& explicit_flags,
                            std::vector<std::string>& ignored_keys);

/// As above; also appends to `overridden` one entry per JSON value not applied because a flag
/// was given explicitly, e.g. "--lr over optimizer.params.lr".
void apply_deepspeed_config(const std::string& path, TrainConfig& cfg,
                            const ExplicitFlags& explicit_flags,
                            std::vector<std::string>& ignored_keys,
                            std::vector<std::string>& overridden);

/// Whether the gradients are reduced hierarchically across nodes: asked for
/// (--hierarchical-all-reduce), or — unless --no-hierarchical-all-reduce — chosen because it moves
/// fewer bytes across nodes than one collective over all ranks: dp, zero1, zero2 and zero3
/// without hybrid sharding, on several nodes of several ranks each (ranks_per_node > 1 and
/// world_size > ranks_per_node). Per node a ring all-reduce over W ranks sends 2(W−1)/W of the
/// gradient across the network, the hierarchical one 2(n−1)/n over n nodes, fewer whenever a node
/// has more than one rank; with one rank per node they are the same, and it stays off.
bool hierarchical_reduction(const TrainConfig& cfg);

/// Micro-batches at the start of each step whose forward runs layer by layer
/// (zero.offload_forward_group resolved; TrainStepOptions::forward_group): the key's value when
/// given (≥ 1); by default every micro-batch of the step when the optimizer is offloaded under
/// ZeRO stage 1 or 2 with activation checkpointing, else 1. Meaningful after validate().
int64_t forward_group(const TrainConfig& cfg);
/// Whether the configuration asks for offloading (--strategy offload/infinity, an
/// offload_optimizer device, --offload auto), before the plan is resolved: --trace then draws the
/// offload timeline.
bool offload_asked(const TrainConfig& cfg);
/// Whether the run's offloaded optimizer starts its update during backward
/// (zero.offload_speculative_update, resolved; TrainStepOptions::speculative_update): the key,
/// with the optimizer offloaded at ZeRO stage 1 or 2, not a pipeline, not the delayed update, not
/// fp16.
bool speculative_update(const TrainConfig& cfg);

/// The data-parallel degree D: world_size, or world_size / pipeline.stages for --strategy
/// pipeline (the replicas of the pipeline). Meaningful after validate().
int data_parallel_size(const TrainConfig& cfg);

/// Checks every field and derives the batch sizes (DeepSpeed _configure_train_batch_size):
/// train_batch_size = micro_batch_size × gradient_accumulation_steps × D (data_parallel_size).
/// With train_batch_size 0 it is derived; otherwise the sizes not given explicitly
/// (micro_batch_set / accumulation_set) are derived from it (both missing: accumulation 1),
/// and the identity is checked. warmup_steps -1 is left as is: the trainer resolves it once it
/// knows the total number of steps. Checks the strategy against the ZeRO stage and offload
/// devices; sets cfg.plan = plan_of(cfg). Checks the stage-3 settings (zero_optimization.stage3_*)
/// and refuses bf16/fp16 with --device cpu. Pipeline: the world size must be a multiple of the
/// stages; the schedule must run P stages, M = gradient_accumulation_steps micro-batches and V
/// virtual stages (check_pipeline_shape; 2bw also needs M >= P, no fp16 and no delayed offload
/// update); ZeRO stage 0-2 only, no offload; pipeline settings with another strategy are an
/// error. What needs the model's layer count is check_pipeline_model().
/// `model_context` is the model's maximum sequence length (n_positions); <= 0 skips that check.
/// Throws ConfigError naming the flag or key, its value and the fix.
void validate(TrainConfig& cfg, int64_t model_context);

/// The rule of a run on the CPU (--device cpu, or auto without a usable GPU): it computes in
/// fp32, so a `precision` other than auto or fp32 throws ConfigError naming --precision and
/// --device. validate() applies it to --device cpu, make_backend() to the device it resolves.
void check_cpu_precision(Precision precision);

/// The partition methods of PipelineConfig::partition_method: uniform, parameters, time.
const std::vector<std::string>& pipeline_partition_methods();

/// Checks a partition method (one of pipeline_partition_methods(), lowercase). Throws
/// ConfigError listing them and suggesting the closest one otherwise.
void check_partition_method(const std::string& method);

/// The pipeline checks that need the model's number of transformer blocks `n_layer` (after
/// validate()); nothing for other strategies. stages × virtual_stages must be at most n_layer
/// (each virtual stage holds at least one block). Throws ConfigError naming the numbers and the
/// fix. The trainer calls it once the model's shape is known.
void check_pipeline_model(const TrainConfig& cfg, int n_layer);

/// Warnings about settings that are valid but do not do what they are meant to for this model,
/// one line each (empty: none). `largest_layer_numel`: parameters of the model's largest layer.
/// Today: at ZeRO stage 3, a stage3_param_persistence_threshold above it keeps every layer
/// replicated (a layer with fewer parameters than the threshold is not partitioned), so ZeRO-3
/// saves no parameter memory.
std::vector<std::string> model_config_warnings(const TrainConfig& cfg, int64_t largest_layer_numel);

}  // namespace shardtrain
