// The knobs of `shardtrain train` that are flags only (DeepSpeed's JSON has no key for them): the
// model and where it runs, the length of training and its data, and the output and checkpoints.
// One row per flag, as in the other tables; --help lists them in this order.
#include <charconv>
#include <string>
#include <vector>

#include "config/knob.h"
#include "core/error.h"
#include "core/strings.h"
#include "model/gpt2_config.h"

namespace shardtrain {

namespace {

/// Checks a flag's value that is a decimal integer in [0, 2^64) (--seed).
void unsigned_64(const std::string& s) {
  uint64_t v = 0;
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, v);
  check<ConfigError>(!s.empty() && ec == std::errc() && ptr == end,
                     "must be an integer in [0, 18446744073709551615], got '{}'", s);
}

/// The canonical strategy names (parse_strategy also reads their aliases: ddp, fsdp_stage2, ...).
std::vector<std::string> strategy_names() {
  std::vector<std::string> out;
  for (StrategyKind s : {StrategyKind::kDataParallel, StrategyKind::kZero1, StrategyKind::kZero2,
                         StrategyKind::kZero3, StrategyKind::kOffload, StrategyKind::kInfinity,
                         StrategyKind::kPipeline})
    out.push_back(to_string(s));
  return out;
}

/// --offload auto|none: whether the placement plan is chosen at start-up (PlacementConfig).
Knob offload_row() {
  static constexpr auto text = [](const TrainConfig& c) {
    return std::string(c.placement.automatic ? "auto" : "none");
  };
  static constexpr auto set = [](TrainConfig& c, const std::string& v) {
    c.placement.automatic = v == "auto";
  };
  Knob k;
  k.type = KnobType::kString;
  k.choices = {"auto", "none"};
  k.field = knob_detail::offset_in_probe(&knob_detail::probe_config().placement.automatic);
  k.get = [](const TrainConfig& c) { return nlohmann::json(text(c)); };
  k.set = [](TrainConfig& c, const nlohmann::json& v) { set(c, v.get<std::string>()); };
  k.print = text;
  k.add_to = [](const Knob& row, CLI::App& cmd, TrainConfig& c, const std::string& help) {
    return cmd
        .add_option_function<std::string>(
            row.flag, [&c](const std::string& v) { set(c, v); }, help)
        ->type_name(row.type_name)
        ->check(knob_detail::validator_of(row));
  };
  return k;
}

}  // namespace

const KnobTable& run_knobs() {
  static const KnobTable rows = {
      knob_at(&TrainConfig::model)
          .train_flag("--model", "NAME|PATH")
          .on_estimate()
          .in_snapshot("model")
          .a_node_path()  // a config.json may sit anywhere; the resolved shape is compared
          .docs(fmt::format("GPT-2 model: a preset ({}) or the path of a Hugging Face style "
                            "config.json (n_layer, n_embd, n_head, n_positions, vocab_size) or "
                            "of a directory holding one; with --resume, leave it out to use the "
                            "checkpoint's shape (default: {{}})",
                            join(gpt2_preset_names(), ", "))),
      knob_at(&TrainConfig::strategy_name)
          .train_flag("--strategy", "NAME")
          .one_of(strategy_names())
          .flag_parsed_by([](const std::string& s) { parse_strategy(s); })
          .expects("dp, zero1, zero2, zero3, offload, infinity or pipeline")
          .docs("parallelism strategy: dp|ddp (data parallel), zero1, zero2|fsdp_stage2, "
                "zero3|fsdp_stage3, offload (zero2 + optimizer on the CPU), infinity (zero3 + "
                "optimizer on NVMe, parameters on the CPU), pipeline (layers cut into stages, "
                "ZeRO 0-2 across the replicas) (default: {})"),
      knob_at(&TrainConfig::device)
          .train_flag("--device", "DEVICE")
          .one_of({"auto", "cpu", "cuda"})
          .in_snapshot("device")
          .expects("auto, cpu or cuda")
          .docs("auto|cpu|cuda; auto uses CUDA when a GPU is usable (default: {})"),
      knob_enum(&TrainConfig::precision, parse_precision, {"auto", "fp32", "bf16", "fp16"})
          .train_flag("--precision", "PREC")
          .in_snapshot("precision")
          .expects("auto, fp32, bf16 or fp16")
          .docs("auto|fp32|bf16|fp16 compute precision; auto lets the device decide (default: "
                "{})"),
      offload_row()
          .train_flag("--offload", "auto|none")
          .expects("auto or none")
          .docs("auto: choose the ZeRO stage and where the optimizer state and the parameters "
                "live (GPU, host, NVMe) at start-up, the plan that fits --gpu-memory and "
                "--max-host-memory with the fewest bytes over PCIe and the disk per step; given "
                "only a global batch, also the micro-batch and accumulation predicted fastest "
                "(`shardtrain estimate --gpu-memory` shows the candidates) (default: {})"),
      knob_at(&TrainConfig::placement, &PlacementConfig::gpu_memory_gib)
          .train_flag("--gpu-memory", "GIB")
          .on_estimate()
          .in_snapshot("placement.gpu_memory_gib")
          .at_least(0, /*open=*/true)
          .unset_is(0)
          .expects("a number > 0 (GiB per GPU)")
          .docs("--offload auto: GiB of memory per GPU the plan may use (default: the GPU's "
                "total; needed on CPU ranks)"),
      knob_at(&TrainConfig::placement, &PlacementConfig::max_host_memory_gib)
          .train_flag("--max-host-memory", "GIB")
          .on_estimate()
          .in_snapshot("placement.max_host_memory_gib")
          .at_least(0, /*open=*/true)
          .unset_is(0)
          .expects("a number > 0 (GiB per node)")
          .docs("--offload auto: GiB of host memory per node the plan may use (default: the "
                "node's available memory)"),
      knob_at(&TrainConfig::trace_dir)
          .train_flag("--trace", "DIR")
          .a_node_path()
          .docs("pipeline: write the measured per-stage pipeline timeline to this directory; "
                "offload: the timeline of two steps (GPU compute, PCIe each way, host AdamW, "
                "NVMe waits: offload-timeline.svg, offload-trace.json) (default: none)"),
      knob_at(&TrainConfig::save_checkpoints)
          .train_flag("--no-save{false}")
          .in_snapshot("save_checkpoints")
          .docs("write no checkpoint, not even at the end (for benchmarks)"),
      knob_at(&TrainConfig::peak_tflops)
          .train_flag("--peak-tflops", "TFLOPS")
          .on_estimate()
          .at_least(0, /*open=*/true)
          .expects("a number > 0 (TFLOP/s)")
          .docs("the GPU's dense bf16 peak in TFLOP/s, for the MFU in the log (default: {}, "
                "H100/H200 SXM)"),
      knob_at(&TrainConfig::hierarchical_all_reduce)
          .train_flag("--hierarchical-all-reduce")
          .shows_default("on for jobs of several nodes with several ranks each, off otherwise")
          .docs("dp, zero1, zero2 and zero3 across nodes: sum each gradient bucket within the "
                "node (reduce-scatter), across nodes 1/k of it per rank (k = ranks per node; "
                "dp: all-reduce then gather within the node, ZeRO: reduce-scatter) — each GPU "
                "sends 1/k of the gradients over the network (default: on for jobs of several "
                "nodes with several ranks each, where it moves fewer bytes across nodes; off "
                "otherwise)"),
      knob_at(&TrainConfig::no_hierarchical_all_reduce)
          .train_flag("--no-hierarchical-all-reduce")
          .shows_default("off: the nodes decide (--hierarchical-all-reduce)")
          .docs("one collective over all ranks for the gradients, whatever the nodes"),
      knob_at(&TrainConfig::cuda_graphs)
          .train_flag("--cuda-graphs,!--no-cuda-graphs")
          .in_snapshot("cuda_graphs")
          .docs("image models on CUDA: capture each micro-batch's forward and backward once as "
                "a CUDA graph and replay it, one launch instead of one per op (default: on; "
                "with ddp on several ranks the gradients are all-reduced after the step's last "
                "replay instead of during backward; not used with ZeRO strategies, which gather "
                "or reduce during the passes, or with --sync-batchnorm)"),
  };
  return rows;
}

const KnobTable& data_knobs() {
  static const KnobTable rows = {
      // ---- length of training ----
      knob_at(&TrainConfig::epochs)
          .train_flag("--epochs", "N")
          .in_snapshot("epochs")
          .at_least(1)
          .expects("an integer >= 1 (passes over the training data)")
          .docs("passes over the training data (default: {})"),
      knob_at(&TrainConfig::max_length)
          .train_flag("--max-length", "TOKENS")
          .on_estimate()
          .in_snapshot("max_length")
          .at_least(1)
          .expects("an integer >= 1 (tokens per sample)")
          .docs("tokens per sample (sequence length), at most the model's context (default: "
                "{})"),
      knob_at(&TrainConfig::num_samples)
          .train_flag("--num-samples", "N")
          .in_snapshot("num_samples")
          .at_least(1)
          .unset_is(-1)
          .flag_parsed_by(minus_one_or_positive)
          .expects("-1 (all samples) or a count >= 1")
          .docs("training samples to use; -1 = all (default: {})"),
      knob_at(&TrainConfig::seed)
          .train_flag("--seed", "N")
          .in_snapshot("seed")
          .flag_parsed_by(unsigned_64)
          .docs("random seed for initialisation and data order (default: {})"),
      knob_at(&TrainConfig::dropout)
          .train_flag("--dropout", "P")
          .in_snapshot("dropout")
          .at_least(0)
          .at_most(1, /*open=*/true)
          .unset_is(-1)
          .expects("a probability in [0, 1) (e.g. 0.1, GPT-2's), 0 to turn dropout off, or "
                   "left unset to keep the model's own")
          .docs("dropout probability in [0, 1) for the embedding, the attention probabilities "
                "and the residual branches (GPT-2's embd_pdrop, attn_pdrop, resid_pdrop: 0.1 in "
                "Hugging Face's configs); overrides the model's own (default: the model's: 0 in "
                "the presets, a config.json's values); image models: the classifier's dropout "
                "(torchvision's dropout=), 0 also turning stochastic depth off"),
      // ---- data ----
      knob_at(&TrainConfig::dataset)
          .train_flag("--dataset", "NAME")
          .in_snapshot("dataset")
          .shows_default("none")
          .docs("named data set: wikitext-2 (GPT-2), fashion-mnist (image models), synthetic "
                "(image models: random 3-channel images of --image-size, default 224, 1000 "
                "classes, for speed measurements) (default: none)"),
      knob_at(&TrainConfig::train_file)
          .train_flag("--train-file", "PATH")
          .in_snapshot("train_file")
          .a_node_path()
          .docs("training text file (or a token file written by `shardtrain tokenize`); "
                "instead of --dataset"),
      knob_at(&TrainConfig::valid_file)
          .train_flag("--valid-file", "PATH")
          .in_snapshot("valid_file")
          .a_node_path()
          .docs("validation text or token file, with --train-file (default: none)"),
      knob_at(&TrainConfig::data_dir)
          .train_flag("--data-dir", "DIR")
          .in_snapshot("data_dir")
          .a_node_path()
          .docs("directory holding the named data sets (default: the copy shipped with "
                "shardtrain); image models: an ImageFolder root (one subfolder per class; 10% "
                "held out), or with --dataset fashion-mnist the directory of its IDX files"),
      knob_at(&TrainConfig::image_size)
          .train_flag("--image-size", "N")
          .in_snapshot("image_size")
          .at_least(1)
          .unset_is(0)
          .expects("an integer >= 1 (pixels per side), or 0 to keep the stored size")
          .docs("image models: resize every image to N × N pixels (bilinear; default: as "
                "stored)"),
      knob_at(&TrainConfig::label_smoothing)
          .train_flag("--label-smoothing", "EPS")
          .in_snapshot("label_smoothing")
          .at_least(0)
          .at_most(1, /*open=*/true)
          .expects("a number in [0, 1)")
          .docs("image models: label smoothing of the training loss in [0, 1) (default: 0)"),
      knob_at(&TrainConfig::sync_batchnorm)
          .train_flag("--sync-batchnorm")
          .in_snapshot("sync_batchnorm")
          .docs("image models: batch norm's training statistics over all ranks "
                "(SyncBatchNorm; default: each rank's own micro-batch)"),
      knob_at(&TrainConfig::cache_dir)
          .train_flag("--cache-dir", "DIR")
          .a_node_path()
          .docs("directory for token caches (default: $SHARDTRAIN_CACHE_DIR or "
                "~/.cache/shardtrain)"),
      knob_at(&TrainConfig::eval_samples)
          .train_flag("--eval-samples", "N")
          .in_snapshot("eval_samples")
          .at_least(1)
          .unset_is(-1)
          .flag_parsed_by(minus_one_or_positive)
          .expects("-1 (the whole validation split) or a count >= 1")
          .docs("validation samples per evaluation; -1 = the whole split (default: {})"),
  };
  return rows;
}

const KnobTable& output_knobs() {
  static const KnobTable rows = {
      knob_at(&TrainConfig::output_dir)
          .train_flag("--output-dir", "DIR")
          .a_node_path()
          .docs("directory for checkpoints and logs (default: {})"),
      knob_at(&TrainConfig::eval_interval)
          .train_flag("--eval-interval", "STEPS")
          .at_least(0)
          .expects("0 (at the end of each epoch) or N >= 1 steps")
          .docs("optimizer steps between validations; 0 = at the end of each epoch (default: "
                "{})"),
      knob_at(&TrainConfig::save_interval)
          .train_flag("--save-interval", "STEPS")
          .at_least(0)
          .expects("0 (only at the end) or N >= 1 steps")
          .docs("optimizer steps between checkpoints; 0 = only at the end (default: {})"),
      knob_at(&TrainConfig::resume)
          .train_flag("--resume", "PATH")
          .a_node_path()  // whether it is given is compared (train/rank_agreement.cpp)
          .docs("resume from a checkpoint directory, or from the latest checkpoint of an "
                "output directory (default: none)"),
      knob_at(&TrainConfig::init_from)
          .train_flag("--init-from", "PATH")
          .a_node_path()  // whether it is given is compared (train/rank_agreement.cpp)
          .docs("initial weights: a shardtrain checkpoint, Hugging Face GPT-2 safetensors, or "
                "for image models a torchvision state dict as safetensors "
                "(tools/convert_torchvision.py) (default: none, random initialisation)"),
      knob_at(&TrainConfig::replace_head)
          .train_flag("--replace-head")
          .docs("image models with --init-from FILE.safetensors: when the file's classifier "
                "head has another class count than the data set (e.g. ImageNet's 1000), keep a "
                "freshly initialized head and load the rest (fine-tuning); without it such a "
                "file is an error"),
      knob_at(&TrainConfig::deepspeed_config)
          .train_flag("--deepspeed-config,--deepspeed_config", "PATH")
          .a_node_path()
          .docs("DeepSpeed JSON config (ds_config.json); flags given explicitly take "
                "precedence over it (default: none)"),
  };
  return rows;
}

}  // namespace shardtrain
