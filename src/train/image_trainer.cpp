#include "train/image_trainer.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/strings.h"
#include "data/dataset.h"
#include "data/image_dataset.h"
#include "io/atomic_file.h"
#include "model/image/image_zoo.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "parallel/strategy.h"
#include "train/train_common.h"
#include "train/train_step.h"
#include "train/trainer.h"

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

/// The held-out set through predict(), divided over the ranks in contiguous ranges, the counts
/// summed over the ranks (every rank returns the same evaluation). Collective.
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
  for (const FlatRange& range : even_split(set.size(), comm.world_size(), comm.rank())) {
    const int64_t end = range.offset + range.numel;
    for (int64_t start = range.offset; start < end; start += batch) {
      const int64_t b = std::min(batch, end - start);
      idx.resize(static_cast<size_t>(b));
      for (int64_t i = 0; i < b; ++i) idx[static_cast<size_t>(i)] = start + i;
      images.resize(static_cast<size_t>(b) * img);
      labels.resize(static_cast<size_t>(b));
      make_image_batch(set, transform, idx.data(), b, false, 0, 0, images.data(), labels.data());
      const std::vector<float> logits = model.predict(images.data(), b);
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

}  // namespace

ImageTrainSummary train_image_model(const TrainConfig& cfg, Communicator& comm) {
  const bool rank0 = comm.rank() == 0;
  Console out(rank0);
  ImageTrainSummary summary;
  check<ConfigError>(cfg.strategy != StrategyKind::kPipeline,
                     "--strategy pipeline trains GPT-2 models only; image model '{}' trains with "
                     "dp, zero1, zero2, zero3 or offload",
                     cfg.model);
  check<ConfigError>(cfg.resume.empty() && cfg.init_from.empty(),
                     "--resume and --init-from are not supported for image models yet");

  // ---- data ----
  const auto t_data = TrainClock::now();
  ImageData data = load_image_data(cfg);
  const double data_seconds = seconds_since(t_data);
  ImageTransform transform;
  transform.channels = data.train.channels;
  transform.crop_padding = data.train.height >= 32 ? 4 : 2;
  transform.horizontal_flip = data.flip;
  channel_statistics(data.train, transform.mean, transform.stdev);

  // ---- model and device ----
  std::unique_ptr<Backend> backend = make_backend(cfg.device, local_rank_of(comm), cfg.precision);
  const bool on_gpu = backend->kind() == DeviceKind::kCUDA;
  ComputeStreamScope compute_stream(comm, *backend);
  LossScaler scaler(cfg.loss_scale, backend->compute_dtype() == DType::kF16);
  ImageModelSpec spec;
  spec.name = cfg.model;
  spec.channels = data.train.channels;
  spec.height = data.train.height;
  spec.width = data.train.width;
  spec.num_classes = static_cast<int64_t>(data.train.classes.size());
  std::unique_ptr<ImageModel> model;
  try {
    model = make_image_model(spec, *backend);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("--model {} on {} images of {}×{}×{}: {}", cfg.model,
                                  data.train.name, spec.channels, spec.height, spec.width,
                                  e.what()));
  }
  model->set_label_smoothing(static_cast<float>(cfg.label_smoothing));
  if (cfg.sync_batchnorm && comm.world_size() > 1)
    model->set_sync_batchnorm(
        [&comm](Tensor t) { comm.all_reduce(std::move(t), ReduceOp::kSum)->wait(); },
        comm.world_size());

  const int64_t B = cfg.micro_batch_size, accum = cfg.gradient_accumulation_steps;
  DistributedSampler sampler(data.train.size(), B, accum, comm.rank(), comm.world_size(), cfg.seed);
  const int64_t steps_per_epoch = sampler.steps_per_epoch();
  const int64_t total_steps = cfg.max_steps > 0 ? cfg.max_steps : cfg.epochs * steps_per_epoch;
  const int64_t warmup =
      cfg.warmup_steps >= 0 ? cfg.warmup_steps : std::min<int64_t>(1000, total_steps / 10);
  const int64_t images_per_step = sampler.global_batch();

  // ---- parameters and strategy ----
  std::unique_ptr<Strategy> strategy = make_strategy(cfg, *backend, comm);
  {
    std::vector<float> init(static_cast<size_t>(model->layout().numel()), 0.0f);
    model->init_parameters(init.data(), cfg.seed);
    strategy->setup(*model, init);
  }
  MetricsWriter metrics = open_run_metrics(cfg, rank0);
  const json snapshot = config_snapshot(cfg);
  Monitor monitor = open_run_monitor(cfg, comm.rank(), snapshot.dump(2));

  // ---- banner ----
  const int64_t params = model->layout().num_parameters();
  out.line("shardtrain {} | train {} ({} parameters) | strategy {} | {} × {} rank{}",
           SHARDTRAIN_VERSION, cfg.model, with_commas(params), to_string(cfg.strategy),
           backend->description(), comm.world_size(), comm.world_size() > 1 ? "s" : "");
  out.line(
      "  data: {} — {} training images {}×{}×{}, {} classes, {} held-out images; loaded in {:.1f} "
      "s",
      data.train.name, with_commas(data.train.size()), data.train.channels, data.train.height,
      data.train.width, spec.num_classes, with_commas(data.held_out.size()), data_seconds);
  std::string mean, stdev;
  for (size_t c = 0; c < transform.mean.size(); ++c) {
    mean += fmt::format("{}{:.4f}", c ? ", " : "", transform.mean[c]);
    stdev += fmt::format("{}{:.4f}", c ? ", " : "", transform.stdev[c]);
  }
  out.line("  augmentation: random crop (padding {}){} | normalization mean ({}) std ({})",
           transform.crop_padding, transform.horizontal_flip ? ", horizontal flip" : "", mean,
           stdev);
  out.line(
      "  batch: micro-batch {} × accumulation {} × {} rank{} = global batch {} images | batch "
      "norm statistics: {}",
      B, accum, comm.world_size(), comm.world_size() > 1 ? "s" : "", images_per_step,
      cfg.sync_batchnorm && comm.world_size() > 1 ? "synchronized over the ranks"
                                                  : "each rank's micro-batch");
  out.line(
      "  steps: {} ({} per epoch{}), warmup {}, {} schedule, {}, clip {:g}, label smoothing {:g}",
      total_steps, steps_per_epoch,
      cfg.max_steps > 0 ? fmt::format(", --max-steps {}", cfg.max_steps)
                        : fmt::format(", {} epochs", cfg.epochs),
      warmup, to_string(cfg.lr_schedule), describe_optimizer(cfg), cfg.gradient_clipping,
      cfg.label_smoothing);
  out.line(
      "  precision: {} | model states {} per rank | {:.3f} GFLOPs per training image | output: {}",
      dtype_name(backend->compute_dtype()),
      human_bytes(static_cast<double>(strategy->model_state_bytes())),
      model->train_flops_per_sample(0) / 1e9, cfg.output_dir);
  if (rank0) {
    json run = snapshot;
    run["model_name"] = cfg.model;
    run["parameters"] = params;
    run["flops_per_sample"] = model->train_flops_per_sample(0);
    run["peak_tflops"] = cfg.peak_tflops;
    run["on_gpu"] = on_gpu;
    run["backend"] = backend->description();
    run["world_size"] = comm.world_size();
    run["global_batch"] = images_per_step;
    run["steps_per_epoch"] = steps_per_epoch;
    run["total_steps"] = total_steps;
    run["classes"] = data.train.classes;
    write_file_atomic(fs::path(cfg.output_dir) / "run.json", run.dump(2) + "\n");
  }

  // ---- loop ----
  const auto K = static_cast<size_t>(spec.num_classes);
  ScalarAllReduce rank_scalars(*backend, comm, static_cast<int>(4 + K + K * K));
  TrainStep train_step(*model, *strategy, comm, *backend, scaler,
                       TrainStepOptions{accum, cfg.gradient_clipping, cfg.seed});
  StepLog step_log(out, metrics, monitor, cfg,
                   Throughput{"images", images_per_step, model->train_flops_per_sample(0)},
                   comm.world_size(), on_gpu, total_steps);
  const size_t img =
      static_cast<size_t>(data.train.image_bytes() / data.train.channels * transform.channels);
  std::vector<float> images(static_cast<size_t>(B) * img);
  std::vector<int32_t> labels(static_cast<size_t>(B));
  TrainingProgress progress;
  progress.seed = cfg.seed;
  auto evaluate_now = [&](int64_t epoch) {
    ImageEvaluation ev = evaluate_images(*model, data.held_out, transform,
                                         std::max<int64_t>(B, 256), comm, rank_scalars);
    out.line(
        "validation | epoch {} | step {} | loss {:.4f} | top-1 {:.2f}% | top-5 {:.2f}% | {} "
        "images in {:.1f} s",
        epoch + 1, progress.step, ev.loss, 100 * ev.top1, 100 * ev.top5, ev.samples, ev.seconds);
    json per_class = json::object();
    for (size_t k = 0; k < K; ++k)
      per_class[data.train.classes[k]] =
          std::isnan(ev.class_accuracy[k]) ? json(nullptr) : json(ev.class_accuracy[k]);
    json confusion = json::array();
    for (size_t r = 0; r < K; ++r)
      confusion.push_back(
          std::vector<int64_t>(ev.confusion.begin() + static_cast<long>(r * K),
                               ev.confusion.begin() + static_cast<long>(r * K + K)));
    metrics.write({{"step", progress.step},
                   {"epoch", epoch + 1},
                   {"val_loss", ev.loss},
                   {"val_top1", ev.top1},
                   {"val_top5", ev.top5},
                   {"val_samples", ev.samples},
                   {"val_class_accuracy", per_class},
                   {"val_confusion", confusion},
                   {"time_s", ev.seconds}});
    monitor.scalar("val/loss", ev.loss, progress.step);
    monitor.scalar("val/top1", ev.top1, progress.step);
    monitor.scalar("val/top5", ev.top5, progress.step);
    summary.eval = std::move(ev);
  };

  const auto t_train = TrainClock::now();
  EpochLoop loop{.cfg = cfg,
                 .out = out,
                 .metrics = metrics,
                 .monitor = monitor,
                 .backend = *backend,
                 .reduce = rank_scalars,
                 .strategy = *strategy,
                 .scaler = scaler,
                 .step_log = step_log,
                 .steps_per_epoch = steps_per_epoch,
                 .total_steps = total_steps,
                 .warmup = warmup,
                 .samples_per_step = images_per_step,
                 .units_per_step = images_per_step,  // progress.tokens_seen counts images here
                 .seq_len = 0,
                 .bar_unit = "img"};
  loop.step = [&](int64_t epoch, double lr) {
    const MicroBatchSource batch = [&](int64_t k) {
      const auto idx = sampler.micro_batch_indices(epoch, progress.step_in_epoch, k);
      make_image_batch(data.train, transform, idx.data(), B, true, cfg.seed, epoch, images.data(),
                       labels.data());
      MicroBatch mb;
      mb.images = images.data();
      mb.targets = labels.data();
      mb.batch = B;
      mb.seq_len = 0;
      return mb;
    };
    return train_step.run(progress.step, lr, batch);
  };
  loop.evaluate = evaluate_now;
  LossHistory losses = run_epochs(loop, progress);
  summary.first_loss = losses.first;
  summary.last_loss = losses.last;
  summary.losses = std::move(losses.all);
  summary.steps = progress.step;
  summary.seconds = seconds_since(t_train);
  out.line(
      "done | {} steps | {:.1f} s | loss {:.4f} → {:.4f} | validation loss {:.4f} | top-1 "
      "{:.2f}% | top-5 {:.2f}%",
      progress.step, summary.seconds, summary.first_loss, summary.last_loss, summary.eval.loss,
      100 * summary.eval.top1, 100 * summary.eval.top5);
  metrics.write({{"event", "done"},
                 {"step", progress.step},
                 {"time_s", summary.seconds},
                 {"final_loss", summary.last_loss},
                 {"val_loss", summary.eval.loss},
                 {"val_top1", summary.eval.top1},
                 {"val_top5", summary.eval.top5}});
  if (rank0 && cfg.save_checkpoints)
    out.line(
        "  note: checkpoints of image models are not written yet (parameters and batch-norm "
        "statistics)");
  return summary;
}

}  // namespace shardtrain
