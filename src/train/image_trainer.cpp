#include "train/image_trainer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpoint/checkpoint.h"
#include "checkpoint/image_weights.h"
#include "checkpoint/sharded_checkpoint.h"
#include "config/knob.h"
#include "core/error.h"
#include "core/strings.h"
#include "data/dataset.h"
#include "data/image_dataset.h"
#include "data/prefetcher.h"
#include "io/atomic_file.h"
#include "memory/host_buffer.h"
#include "model/image/image_zoo.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "parallel/strategy.h"
#include "train/flops_profiler.h"
#include "train/rank_agreement.h"
#include "train/strategy_from_config.h"
#include "train/train_common.h"
#include "train/train_step.h"
#include "train/trainer.h"
#include "train/training_run.h"

namespace shardtrain {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

/// The first `n` images of `set` (n < 0 or ≥ size: all).
void keep_first(ImageSet& set, int64_t n) {
  if (n < 0 || n >= set.size()) return;
  set.labels.resize(static_cast<size_t>(n));
  set.pixels.resize(static_cast<size_t>(n * set.image_bytes()));
}

struct ImageData {
  ImageSet train, held_out;
  bool flip = false;  ///< natural images (ImageFolder) flip; Fashion-MNIST does not
};

/// Fashion-MNIST (train / its test set; --data-dir: the directory of its IDX files) or an
/// ImageFolder root with a 10% stratified held-out split.
ImageData load_image_data(const TrainConfig& cfg) {
  ImageData d;
  if (cfg.dataset == "fashion-mnist") {
    const fs::path dir = cfg.data_dir.empty() ? find_fashion_mnist_dir() : fs::path(cfg.data_dir);
    d.train = load_fashion_mnist(dir, true);
    d.held_out = load_fashion_mnist(dir, false);
  } else if (cfg.dataset == "synthetic") {
    // ImageNet-shaped random data for speed measurements (images are generated at their final
    // size, so nothing is resized): 4,096 training and 512 held-out images unless limited.
    const int64_t size = cfg.image_size > 0 ? cfg.image_size : 224;
    d.train = synthetic_images(cfg.num_samples > 0 ? cfg.num_samples : 4096, 3, size, size, 1000,
                               cfg.seed);
    d.held_out = synthetic_images(cfg.eval_samples > 0 ? cfg.eval_samples : 512, 3, size, size,
                                  1000, cfg.seed + 1);
  } else {
    d.train = load_image_folder(cfg.data_dir, cfg.image_size, cfg.image_size);
    d.held_out = split_held_out(d.train, 0.1, cfg.seed);
    d.flip = true;
  }
  if (cfg.image_size > 0) {
    resize_images(d.train, cfg.image_size, cfg.image_size);
    resize_images(d.held_out, cfg.image_size, cfg.image_size);
  }
  keep_first(d.train, cfg.num_samples);
  keep_first(d.held_out, cfg.eval_samples);
  return d;
}

/// The smallest N for which `spec`'s model takes N×N images (larger inputs fit when smaller ones
/// do: the layers only shrink them), or 0 when none up to 4096 does. For the message of an input
/// too small for the network; builds the model about 2·log2(N) times.
int64_t smallest_input_size(ImageModelSpec spec, Backend& backend) {
  auto fits = [&](int64_t n) {
    spec.height = spec.width = n;
    try {
      make_image_model(spec, backend);
      return true;
    } catch (const ConfigError&) {
      return false;
    }
  };
  int64_t lo = 1, hi = std::max<int64_t>(2, std::max(spec.height, spec.width));
  while (!fits(hi)) {  // lo: too small (or 1); hi: the candidate
    lo = hi;
    hi *= 2;
    if (hi > 4096) return 0;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? hi : lo) = mid;
  }
  return hi;
}

/// The profiled step (--profile-step): runs it with device timers around every layer's forward
/// and backward and the step's phases, then prints the layers that took longest (rank 0).
StepResult profiled_image_step(ImageModel& model, TrainStep& train_step, Backend& backend,
                               Console& out, int64_t step, double lr,
                               const MicroBatchSource& batch) {
  LayerHooks* const inner = model.hooks();
  std::unique_ptr<StreamClock> layer_clock = backend.make_stream_clock();
  std::unique_ptr<StreamClock> phase_clock = backend.make_stream_clock();  // read by TrainStep
  // Two profilers in a chain: the device clock (what each layer's kernels took, idle gaps
  // included) and the host clock (how long the host took to enqueue them): a layer whose host time
  // reaches its device time starves the GPU.
  StreamClock host_clock;
  ProfilingHooks host_profiling(inner, host_clock, model.num_layers());
  ProfilingHooks profiling(&host_profiling, *layer_clock, model.num_layers());
  model.set_hooks(&profiling);
  StreamClock* const step_clock = train_step.clock();
  train_step.set_clock(phase_clock.get());
  StepResult r = train_step.run(step, lr, batch);
  model.set_hooks(inner);
  train_step.set_clock(step_clock);
  profiling.collect();
  host_profiling.collect();
  const PhaseTimes ph = r.phases ? *r.phases : PhaseTimes{};
  const double total = ph.forward + ph.backward + ph.reduce_wait + ph.optimizer;
  out.line(
      "profile of step {}: forward {:.2f} ms | backward {:.2f} ms | gradient reduction wait "
      "{:.2f} ms | optimizer {:.2f} ms | device total {:.2f} ms",
      step + 1, 1e3 * ph.forward, 1e3 * ph.backward, 1e3 * ph.reduce_wait, 1e3 * ph.optimizer,
      1e3 * total);
  const auto& fwd = profiling.forward_seconds();
  const auto& bwd = profiling.backward_seconds();
  std::vector<size_t> order(fwd.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return fwd[a] + bwd[a] > fwd[b] + bwd[b]; });
  const auto& host_fwd = host_profiling.forward_seconds();
  const auto& host_bwd = host_profiling.backward_seconds();
  out.line("  {:<28} {:>10} {:>10} {:>7} {:>12} {:>12}", "layer (slowest first)", "fwd ms",
           "bwd ms", "share", "host fwd ms", "host bwd ms");
  const auto& layers = model.layout().layers();
  for (size_t k = 0; k < std::min<size_t>(order.size(), 20); ++k) {
    const size_t i = order[k];
    out.line("  {:<28} {:>10.3f} {:>10.3f} {:>6.1f}% {:>12.3f} {:>12.3f}", layers[i].name,
             1e3 * fwd[i], 1e3 * bwd[i], total > 0 ? 100.0 * (fwd[i] + bwd[i]) / total : 0.0,
             1e3 * host_fwd[i], 1e3 * host_bwd[i]);
  }
  return r;
}

}  // namespace

ImageEvaluation evaluate_images(ImageModel& model, const ImageSet& set,
                                const ImageTransform& transform, int64_t batch,
                                const Communicator& comm, ScalarAllReduce& reduce) {
  const auto t0 = TrainClock::now();
  const auto K = static_cast<size_t>(model.spec().num_classes);
  // [loss sum, top-1, top-5, samples, per-class count K, confusion K×K]
  std::vector<double> acc(4 + K + K * K, 0.0);
  const size_t img = static_cast<size_t>(transform.channels * set.height * set.width);
  std::vector<float> images;
  std::vector<int32_t> labels;
  std::vector<int64_t> idx;
  for (const EvalMicroBatch& mb :
       eval_micro_batches(set.size(), batch, comm.world_size(), comm.rank())) {
    const int64_t b = mb.count;
    idx.resize(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i) idx[static_cast<size_t>(i)] = mb.start + i;
    images.resize(static_cast<size_t>(b) * img);
    labels.resize(static_cast<size_t>(b));
    make_image_batch(set, transform, idx.data(), b, false, 0, 0, images.data(), labels.data());
    const std::vector<float> logits = model.predict(images.data(), b);
    if (!mb.counted) continue;  // padding: only there to join the others' collectives
    for (int64_t i = 0; i < b; ++i) {
      const float* z = logits.data() + static_cast<size_t>(i) * K;
      const auto y = static_cast<size_t>(labels[static_cast<size_t>(i)]);
      const double zmax = *std::max_element(z, z + K);
      double sum = 0;
      size_t above = 0, argmax = 0;
      for (size_t k = 0; k < K; ++k) {
        sum += std::exp(static_cast<double>(z[k]) - zmax);
        if (z[k] > z[y]) ++above;
        if (z[k] > z[argmax]) argmax = k;
      }
      acc[0] += std::log(sum) + zmax - static_cast<double>(z[y]);
      acc[1] += above == 0 ? 1 : 0;
      acc[2] += above < 5 ? 1 : 0;
      acc[3] += 1;
      acc[4 + y] += 1;
      acc[4 + K + y * K + argmax] += 1;
    }
  }
  reduce.sum(acc);
  ImageEvaluation ev;
  ev.samples = static_cast<int64_t>(acc[3]);
  const double n = std::max(acc[3], 1.0);
  ev.loss = acc[0] / n;
  ev.top1 = acc[1] / n;
  ev.top5 = acc[2] / n;
  ev.confusion.resize(K * K);
  for (size_t i = 0; i < K * K; ++i) ev.confusion[i] = std::llround(acc[4 + K + i]);
  for (size_t k = 0; k < K; ++k)
    ev.class_accuracy.push_back(acc[4 + k] > 0 ? acc[4 + K + k * K + k] / acc[4 + k]
                                               : std::numeric_limits<double>::quiet_NaN());
  ev.seconds = seconds_since(t0);
  return ev;
}

namespace {

/// The training transform of `train`: random crop (padding 4, or 2 below 32 pixels), flips for
/// natural images, normalization by the set's channel statistics.
ImageTransform training_transform(const ImageData& data) {
  ImageTransform t;
  t.channels = data.train.channels;
  t.crop_padding = data.train.height >= 32 ? 4 : 2;
  t.horizontal_flip = data.flip;
  channel_statistics(data.train, t.mean, t.stdev);
  return t;
}

/// The model --model names for `data`'s images and classes, with the run's label smoothing,
/// CUDA graphs and synchronized batch norm. Throws ConfigError naming the smallest input size
/// when the images are too small for the network.
std::unique_ptr<ImageModel> build_image_model(const TrainConfig& cfg, const ImageData& data,
                                              ImageModelSpec& spec, Backend& backend,
                                              Communicator& comm) {
  spec.name = cfg.model;
  spec.channels = data.train.channels;
  spec.height = data.train.height;
  spec.width = data.train.width;
  spec.num_classes = static_cast<int64_t>(data.train.classes.size());
  // --dropout P: the classifier's dropout (0 also turns stochastic depth off).
  if (cfg.dropout >= 0) {
    spec.dropout = cfg.dropout > 0;
    spec.classifier_dropout = static_cast<float>(cfg.dropout);
  }
  std::unique_ptr<ImageModel> model;
  try {
    model = make_image_model(spec, backend);
  } catch (const ConfigError& e) {
    std::string fix;
    if (std::string_view(e.what()).find("is too small") != std::string_view::npos) {
      if (const int64_t n = smallest_input_size(spec, backend); n > 0)
        fix = fmt::format(" ('{}' takes images of {}×{} pixels or more: {} {})", cfg.model, n, n,
                          knob_for(&TrainConfig::image_size).name(), n);
    }
    throw ConfigError(fmt::format("{} {} on {} images of {}×{}×{}: {}{}",
                                  knob_for(&TrainConfig::model).name(), cfg.model, data.train.name,
                                  spec.channels, spec.height, spec.width, e.what(), fix));
  }
  model->set_label_smoothing(static_cast<float>(cfg.label_smoothing));
  model->set_cuda_graphs(cfg.cuda_graphs && backend.kind() == DeviceKind::kCUDA);
  if (cfg.sync_batchnorm && comm.world_size() > 1)
    model->set_sync_batchnorm(
        [&comm](Tensor t) { comm.all_reduce(std::move(t), ReduceOp::kSum)->wait(); },
        comm.world_size());
  return model;
}

/// Throws CheckpointError unless `info` holds the very model `identity` describes (name, classes,
/// input); `flag` names the option that gave the checkpoint.
void require_same_model(const CheckpointInfo& info, const ImageCheckpointModel& identity,
                        const Knob& flag) {
  check<CheckpointError>(info.image && *info.image == identity,
                         "{} {}: the checkpoint holds {} but this run trains {}; pass the "
                         "checkpoint's {} and data, or start without {}",
                         flag.name(), info.dir.string(), checkpoint_model_description(info),
                         identity.describe(), knob_for(&TrainConfig::model).name(), flag.name());
}

/// The full fp32 parameters [layout numel] a fresh run starts from — the model's initialization
/// with cfg.seed, then --init-from (a shardtrain checkpoint, or torchvision safetensors with
/// --replace-head) — and the lines that say so in the banner. Writes the model's batch-norm
/// statistics from the same source.
std::vector<float> initial_image_parameters(const TrainConfig& cfg, const ImageModelSpec& spec,
                                            const ImageCheckpointModel& identity, ImageModel& model,
                                            std::vector<std::string>& notes) {
  std::vector<float> init(static_cast<size_t>(model.layout().numel()), 0.0f);
  model.init_parameters(init.data(), cfg.seed);
  if (cfg.init_from.empty()) return init;
  fs::path p = cfg.init_from;
  // A directory holding model.safetensors but no manifest: the weights file in it.
  if (fs::is_directory(p) && fs::exists(p / "model.safetensors") &&
      !fs::exists(p / "manifest.json") && !fs::exists(p / "latest"))
    p /= "model.safetensors";
  if (fs::is_directory(p)) {  // a shardtrain checkpoint (or an output directory)
    const CheckpointInfo from = read_checkpoint_info(p);
    require_same_model(from, identity, knob_for(&TrainConfig::init_from));
    init = load_checkpoint_params(from, model.layout());
    load_model_buffers(from, model, 0);
    notes.push_back(
        fmt::format("initialized from checkpoint {} (weights and batch norm "
                    "statistics; optimizer and step start afresh)",
                    from.dir.string()));
    return init;
  }
  int64_t nbuf = 0;
  for (const ModelBuffer& b : model.state_buffers()) nbuf += b.numel;
  std::vector<float> buffers(static_cast<size_t>(nbuf));
  model.read_state_buffers(buffers.data());
  const TorchvisionLoadReport r =
      load_torchvision_weights(p, model, init.data(), buffers.data(), cfg.replace_head);
  model.write_state_buffers(buffers.data());
  notes.push_back(fmt::format(
      "initialized from {} ({} tensors{})", p.string(), r.tensors_loaded,
      r.ignored.empty() ? std::string()
                        : fmt::format(", {} num_batches_tracked ignored", r.ignored.size())));
  if (!r.fresh_head.empty())
    notes.push_back(
        fmt::format("{}: the file's classifier head ({} classes) does not fit the data set's {} "
                    "classes: {} keep their fresh initialization (fine-tuning)",
                    knob_for(&TrainConfig::replace_head).name(), r.file_classes, spec.num_classes,
                    join(r.fresh_head, ", ")));
  return init;
}

/// What the image banner and run.json report besides the config.
struct ImageRunFacts {
  const ImageData& data;
  const ImageTransform& transform;
  const ImageModel& model;
  const Backend& backend;
  const Strategy& strategy;
  const RunPlan& plan;
  int world_size = 1;
  double data_seconds = 0;
  const std::vector<std::string>& notes;  ///< how the parameters were initialized
  const CheckpointInfo* resume = nullptr;
  const TrainingProgress* progress = nullptr;
};

void print_image_banner(Console& out, const TrainConfig& cfg, const ImageRunFacts& f) {
  const int world = f.world_size;
  out.line("shardtrain {} | train {} ({} parameters) | strategy {} | {} × {} rank{}",
           SHARDTRAIN_VERSION, cfg.model, with_commas(f.model.layout().num_parameters()),
           to_string(cfg.strategy), f.backend.description(), world, world > 1 ? "s" : "");
  out.line(
      "  data: {} — {} training images {}×{}×{}, {} classes, {} held-out images; loaded in {:.1f} "
      "s",
      f.data.train.name, with_commas(f.data.train.size()), f.data.train.channels,
      f.data.train.height, f.data.train.width, f.data.train.classes.size(),
      with_commas(f.data.held_out.size()), f.data_seconds);
  std::string mean, stdev;
  for (size_t c = 0; c < f.transform.mean.size(); ++c) {
    mean += fmt::format("{}{:.4f}", c ? ", " : "", f.transform.mean[c]);
    stdev += fmt::format("{}{:.4f}", c ? ", " : "", f.transform.stdev[c]);
  }
  out.line("  augmentation: random crop (padding {}){} | normalization mean ({}) std ({})",
           f.transform.crop_padding, f.transform.horizontal_flip ? ", horizontal flip" : "", mean,
           stdev);
  out.line(
      "  batch: micro-batch {} × accumulation {} × {} rank{} = global batch {} images | batch "
      "norm statistics: {}",
      cfg.micro_batch_size, cfg.gradient_accumulation_steps, world, world > 1 ? "s" : "",
      f.plan.global_batch,
      cfg.sync_batchnorm && world > 1 ? "synchronized over the ranks" : "each rank's micro-batch");
  out.line("  CUDA graphs: {}",
           !f.model.cuda_graphs_usable()
               ? (!cfg.cuda_graphs ? "off (--no-cuda-graphs)"
                  : f.backend.kind() != DeviceKind::kCUDA
                      ? "off (CPU)"
                      : "off (the strategy gathers parameters or reduces gradients during "
                        "backward, or --sync-batchnorm)")
           : world > 1 ? "on (each micro-batch's forward and backward replayed as one graph; the "
                         "gradients all-reduced after the step's last replay)"
                       : "on (each micro-batch's forward and backward replayed as one graph)");
  out.line(
      "  steps: {} ({} per epoch{}), warmup {}, {} schedule, {}, clip {:g}, label smoothing {:g}",
      f.plan.total_steps, f.plan.steps_per_epoch,
      cfg.max_steps > 0
          ? fmt::format(", {} {}", knob_for(&TrainConfig::max_steps).name(), cfg.max_steps)
          : fmt::format(", {} epochs", cfg.epochs),
      f.plan.warmup, to_string(cfg.lr_schedule), describe_optimizer(cfg), cfg.gradient_clipping,
      cfg.label_smoothing);
  out.line(
      "  precision: {} | model states {} per rank | {:.3f} GFLOPs per training image | output: {}",
      dtype_name(f.backend.compute_dtype()),
      human_bytes(static_cast<double>(f.strategy.model_state_bytes())),
      f.model.train_flops_per_sample(0) / 1e9, cfg.output_dir);
  for (const std::string& note : f.notes) out.line("  {}", note);
  if (f.resume)
    out.line("  resumed from {} at step {} (epoch {}, step {} of the epoch)",
             f.resume->dir.string(), f.progress->step, f.progress->epoch + 1,
             f.progress->step_in_epoch);
}

/// run.json (see train()'s): the configuration, the model's size and FLOPs, the ranks, the
/// global batch and the class names.
void write_image_run_json(const TrainConfig& cfg, const json& snapshot, const ImageRunFacts& f) {
  json run = snapshot;
  run["model_name"] = cfg.model;
  run["parameters"] = f.model.layout().num_parameters();
  run["flops_per_sample"] = f.model.train_flops_per_sample(0);
  run["peak_tflops"] = cfg.peak_tflops;
  run["on_gpu"] = f.backend.kind() == DeviceKind::kCUDA;
  run["backend"] = f.backend.description();
  run["world_size"] = f.world_size;
  run["global_batch"] = f.plan.global_batch;
  run["steps_per_epoch"] = f.plan.steps_per_epoch;
  run["total_steps"] = f.plan.total_steps;
  run["classes"] = f.data.train.classes;
  write_file_atomic(fs::path(cfg.output_dir) / "run.json", run.dump(2) + "\n");
}

/// The training micro-batches as uint8 pixels (normalized on the device: a quarter of fp32's
/// bytes to upload, 0.83 ms per step for 64 images of 224×224×3 fp32 on an H100) in page-locked
/// memory (one DMA transfer; pageable memory goes through a bounce buffer, 4–6 ms), the next one
/// assembled on a worker thread while the current one trains (on GPUs; a CPU backend's ops use
/// every core). Micro-batch key: its position in the run, ((epoch · steps per epoch) + step) ·
/// accumulation + k.
class ImageBatches {
 public:
  ImageBatches(const TrainConfig& cfg, const ImageData& data, const ImageTransform& transform,
               const DistributedSampler& sampler, const RunPlan& plan, Backend& backend)
      : B_(cfg.micro_batch_size),
        accum_(cfg.gradient_accumulation_steps),
        per_epoch_(plan.steps_per_epoch * accum_),
        total_steps_(plan.total_steps),
        affine_(transform.affine()),
        prefetcher_(
            [this, &cfg, &data, &transform, &sampler](int64_t key, int slot) {
              const int64_t epoch = key / per_epoch_, step = key % per_epoch_ / accum_,
                            k = key % accum_;
              const auto idx = sampler.micro_batch_indices(epoch, step, k);
              make_pixel_batch(data.train, transform, idx.data(), B_, true, cfg.seed, epoch,
                               pixels_[static_cast<size_t>(slot)].as<uint8_t>(),
                               labels_[static_cast<size_t>(slot)].as<int32_t>());
            },
            /*threaded=*/backend.kind() == DeviceKind::kCUDA) {
    const auto img = data.train.image_bytes() / data.train.channels * transform.channels;
    for (size_t s = 0; s < 2; ++s) {
      pixels_[s] = PinnedBuffer(backend, DType::kU8, B_ * img);
      labels_[s] = PinnedBuffer(backend, DType::kI32, B_);
    }
  }
  /// Micro-batch k of step `step_in_epoch` of `epoch` (the run's step `step`), the next one
  /// requested meanwhile.
  MicroBatch get(int64_t epoch, int64_t step_in_epoch, int64_t step, int64_t k) {
    const int64_t key = epoch * per_epoch_ + step_in_epoch * accum_ + k;
    const bool last = step + 1 >= total_steps_ && k + 1 == accum_;
    const auto slot = static_cast<size_t>(prefetcher_.get(key, last ? -1 : key + 1));
    MicroBatch mb;
    mb.pixels = pixels_[slot].as<uint8_t>();
    mb.pixel_affine = affine_.data();
    mb.targets = labels_[slot].as<int32_t>();
    mb.batch = B_;
    mb.seq_len = 0;
    return mb;
  }

 private:
  int64_t B_, accum_, per_epoch_, total_steps_;
  std::vector<float> affine_;
  std::array<PinnedBuffer, 2> pixels_, labels_;
  Prefetcher prefetcher_;  ///< last: stopped before the buffers it fills are freed
};

/// Prints a validation and records it (with per-class accuracy and the confusion matrix) in
/// metrics.jsonl and the monitors.
void report_image_validation(const ImageEvaluation& ev, const std::vector<std::string>& classes,
                             int64_t epoch, int64_t step, Console& out, MetricsWriter& metrics,
                             Monitor& monitor) {
  out.line(
      "validation | epoch {} | step {} | loss {:.4f} | top-1 {:.2f}% | top-5 {:.2f}% | {} "
      "images in {:.1f} s",
      epoch + 1, step, ev.loss, 100 * ev.top1, 100 * ev.top5, ev.samples, ev.seconds);
  const size_t K = classes.size();
  json per_class = json::object();
  for (size_t k = 0; k < K; ++k)
    per_class[classes[k]] =
        std::isnan(ev.class_accuracy[k]) ? json(nullptr) : json(ev.class_accuracy[k]);
  json confusion = json::array();
  for (size_t r = 0; r < K; ++r)
    confusion.push_back(std::vector<int64_t>(ev.confusion.begin() + static_cast<long>(r * K),
                                             ev.confusion.begin() + static_cast<long>(r * K + K)));
  metrics.write({{"step", step},
                 {"epoch", epoch + 1},
                 {"val_loss", ev.loss},
                 {"val_top1", ev.top1},
                 {"val_top5", ev.top5},
                 {"val_samples", ev.samples},
                 {"val_class_accuracy", per_class},
                 {"val_confusion", confusion},
                 {"time_s", ev.seconds}});
  monitor.scalar("val/loss", ev.loss, step);
  monitor.scalar("val/top1", ev.top1, step);
  monitor.scalar("val/top5", ev.top5, step);
}

/// Prints the run's last line and records it in metrics.jsonl.
void report_image_done(const ImageTrainSummary& summary, Console& out, MetricsWriter& metrics) {
  out.line(
      "done | {} steps | {:.1f} s | loss {:.4f} → {:.4f} | validation loss {:.4f} | top-1 "
      "{:.2f}% | top-5 {:.2f}%",
      summary.steps, summary.seconds, summary.first_loss, summary.last_loss, summary.eval.loss,
      100 * summary.eval.top1, 100 * summary.eval.top5);
  metrics.write({{"event", "done"},
                 {"step", summary.steps},
                 {"time_s", summary.seconds},
                 {"final_loss", summary.last_loss},
                 {"val_loss", summary.eval.loss},
                 {"val_top1", summary.eval.top1},
                 {"val_top5", summary.eval.top5}});
}

/// Image classifiers (ImageModel) in the trainer skeleton: Fashion-MNIST or an ImageFolder, its
/// augmentation, batch-norm statistics in checkpoints, evaluation with top-1/top-5 and the
/// confusion matrix, CUDA graphs.
class ImageFamily final : public ModelFamily {
 public:
  explicit ImageFamily(ImageTrainSummary& summary) : summary_(summary) {}

  // The data first: the model's input and classes come from it.
  void prepare(const TrainConfig& cfg, Console& /*out*/) override {
    const auto t0 = TrainClock::now();
    data_ = std::make_unique<ImageData>(load_image_data(cfg));
    data_seconds_ = seconds_since(t0);
    transform_ = training_transform(*data_);
  }
  std::string agreement_shape(const TrainConfig& cfg) const override { return cfg.model; }
  void build_model(const TrainConfig& cfg, Backend& backend, Communicator& comm,
                   Console& /*out*/) override {
    model_ = build_image_model(cfg, *data_, spec_, backend, comm);
    identity_ = ImageCheckpointModel{cfg.model, spec_.num_classes, spec_.channels, spec_.height,
                                     spec_.width};
  }
  Model& model() override { return *model_; }
  // The checkpoint must hold this very model (name, classes, input).
  std::optional<CheckpointInfo> read_resume(const TrainConfig& cfg) override {
    if (cfg.resume.empty()) return std::nullopt;
    CheckpointInfo resume = read_checkpoint_info(cfg.resume);
    require_same_model(resume, identity_, knob_for(&TrainConfig::resume));
    return resume;
  }
  RunPlan plan(const TrainConfig& cfg, Communicator& comm, Console& /*out*/) override {
    sampler_ = std::make_unique<DistributedSampler>(data_->train.size(), cfg.micro_batch_size,
                                                    cfg.gradient_accumulation_steps, comm.rank(),
                                                    comm.world_size(), cfg.seed);
    return plan_run(cfg, *sampler_, comm.world_size());
  }
  void set_up_parameters(Strategy& strategy, const TrainConfig& cfg, bool resuming) override {
    strategy.setup(
        *model_, resuming ? std::vector<float>{}
                          : initial_image_parameters(cfg, spec_, identity_, *model_, init_notes_));
    model_->prepare_cuda_graphs();
  }
  void after_resume(const CheckpointInfo& ck, int rank) override {
    load_model_buffers(ck, *model_, rank);
  }
  void announce(const RunContext& run) override {
    const ImageRunFacts facts{*data_,
                              transform_,
                              *model_,
                              run.backend,
                              run.strategy,
                              run.plan,
                              run.comm.world_size(),
                              data_seconds_,
                              init_notes_,
                              run.resume,
                              &run.progress};
    print_image_banner(run.out, run.cfg, facts);
    if (run.rank0()) write_image_run_json(run.cfg, config_snapshot(run.cfg), facts);
  }

  Throughput throughput(const RunContext& run) const override {
    return Throughput{"images", run.plan.global_batch, model_->train_flops_per_sample(0)};
  }
  void start_loop(const RunContext& run, EpochLoop& loop, StreamClock* /*clock*/) override {
    const TrainConfig& cfg = run.cfg;
    loop.units_per_step = run.plan.global_batch;  // progress.tokens_seen counts images here
    loop.seq_len = 0;
    loop.bar_unit = "img";
    train_step_ = std::make_unique<TrainStep>(
        *model_, run.strategy, run.comm, run.backend, run.scaler,
        TrainStepOptions{cfg.gradient_accumulation_steps, cfg.gradient_clipping, cfg.seed});
    batches_ =
        std::make_unique<ImageBatches>(cfg, *data_, transform_, *sampler_, run.plan, run.backend);
    const auto K = static_cast<size_t>(spec_.num_classes);
    rank_scalars_ =
        std::make_unique<ScalarAllReduce>(run.backend, run.comm, static_cast<int>(4 + K + K * K));
  }
  StepResult step(const RunContext& run, int64_t epoch, double lr) override {
    const TrainingProgress& progress = run.progress;
    const MicroBatchSource batch = [&](int64_t k) {
      return batches_->get(epoch, progress.step_in_epoch, progress.step, k);
    };
    if (run.cfg.flops_profiler.enabled && progress.step + 1 == run.cfg.flops_profiler.profile_step)
      return profiled_image_step(*model_, *train_step_, run.backend, run.out, progress.step, lr,
                                 batch);
    return train_step_->run(progress.step, lr, batch);
  }
  void evaluate(const RunContext& run, int64_t epoch) override {
    // One model is validated: every rank takes rank 0's batch-norm running statistics first,
    // as PyTorch DDP does (broadcast_buffers=True: rank 0's buffers before each forward).
    // Training normalizes with the batch's statistics, so it is unaffected; with
    // --sync-batchnorm the ranks' statistics are equal already. Nothing to validate: nothing
    // taken.
    if (run.comm.world_size() > 1 && model_->buffers().numel() > 0 && data_->held_out.size() > 0)
      run.comm.broadcast(model_->buffers(), 0)->wait();
    ImageEvaluation ev =
        evaluate_images(*model_, data_->held_out, transform_,
                        std::max<int64_t>(run.cfg.micro_batch_size, 256), run.comm, *rank_scalars_);
    report_image_validation(ev, data_->train.classes, epoch, run.progress.step, run.out,
                            run.metrics, run.monitor);
    summary_.eval = std::move(ev);
  }
  std::string save(const RunContext& run) override {
    CheckpointInfo ck;
    ck.image = identity_;
    ck.model.name = run.cfg.model;
    ck.config = config_snapshot(run.cfg);
    ck.progress = run.progress;
    ck.loss_scaler = loss_scaler_json(run.scaler);
    ShardedSaveOptions opts;
    opts.consolidated_bf16_model = run.cfg.zero.stage3_gather_16bit_weights_on_model_save;
    capture_model_buffers(*model_, opts);
    return save_sharded_checkpoint(run.cfg.output_dir,
                                   fmt::format("checkpoint-{:06d}", run.progress.step),
                                   model_->layout(), run.strategy, run.comm, ck, opts)
        .string();
  }

  void finish(const RunContext& run, LossHistory losses, double seconds,
              int64_t /*first_step*/) override {
    summary_.first_loss = losses.first;
    summary_.last_loss = losses.last;
    summary_.losses = std::move(losses.all);
    summary_.steps = run.progress.step;
    summary_.seconds = seconds;
  }
  void report_done(const RunContext& run, const std::string& /*checkpoint*/) override {
    report_image_done(summary_, run.out, run.metrics);
  }

  void end_loop() noexcept override {
    rank_scalars_.reset();
    batches_.reset();  // stops its prefetch thread before the buffers it fills go
    train_step_.reset();
  }
  void release() noexcept override {
    sampler_.reset();
    model_.reset();
    data_.reset();
  }

 private:
  ImageTrainSummary& summary_;
  std::unique_ptr<ImageData> data_;
  double data_seconds_ = 0;
  ImageTransform transform_;
  ImageModelSpec spec_;
  ImageCheckpointModel identity_;
  std::unique_ptr<ImageModel> model_;
  std::unique_ptr<DistributedSampler> sampler_;
  std::vector<std::string> init_notes_;  ///< how the parameters were initialized (banner)
  std::unique_ptr<TrainStep> train_step_;
  std::unique_ptr<ImageBatches> batches_;
  std::unique_ptr<ScalarAllReduce> rank_scalars_;  ///< the evaluation's sums: 4 + K + K²
};

}  // namespace

ImageTrainSummary train_image_model(const TrainConfig& cfg, Communicator& comm) {
  ImageTrainSummary summary;
  ImageFamily family(summary);
  run_training(family, cfg, comm);
  return summary;
}

}  // namespace shardtrain
