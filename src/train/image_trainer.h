// The training loop of image classifiers (model/image/image_zoo.h): Fashion-MNIST or an
// ImageFolder directory → normalized, augmented micro-batches → TrainStep over any data-parallel
// strategy (dp, zero1/2/3, offload) with AdamW → step log in images/s, and each epoch an
// evaluation on the held-out set (loss, top-1, top-5, per-class accuracy, confusion matrix).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "config/config.h"

namespace shardtrain {

class ImageModel;       // model/image/image_model.h
struct ImageSet;        // data/image_dataset.h
struct ImageTransform;  // data/image_dataset.h
class ScalarAllReduce;  // comm/scalar_all_reduce.h

struct ImageEvaluation {
  double loss = 0;  ///< mean cross-entropy (no label smoothing)
  double top1 = 0;  ///< fraction of images whose largest logit is the label
  double top5 = 0;  ///< fraction with the label among the 5 largest logits (all when K ≤ 5)
  int64_t samples = 0;
  std::vector<double> class_accuracy;  ///< [K] top-1 per true class (NaN: class absent)
  std::vector<int64_t> confusion;      ///< [K × K] row = true class, column = predicted
  double seconds = 0;
};

/// `set` through model.predict() (running batch-norm statistics, no augmentation: `transform`
/// with train = false), in micro-batches of up to `batch` images: the mean cross-entropy, top-1
/// and top-5 over the images, per-class accuracy and the confusion matrix (K = the model's
/// classes). The images are divided over the ranks of `comm` by eval_micro_batches
/// (train/train_common.h): every image counted exactly once, and every rank runs the same number
/// of forwards (ranks with fewer images run uncounted padding micro-batches), so collectives
/// inside forward (ZeRO-3 / fsdp_stage3 all-gathers) match on every rank whatever set.size() and
/// the rank count are. The per-rank sums are summed with `reduce` (a ScalarAllReduce over `comm`
/// of at least 4 + K + K² values), so every rank returns the same evaluation. Collective over
/// `comm`. Throws ConfigError when `transform` cannot make the model's channels from the set.
ImageEvaluation evaluate_images(ImageModel& model, const ImageSet& set,
                                const ImageTransform& transform, int64_t batch,
                                const Communicator& comm, ScalarAllReduce& reduce);

struct ImageTrainSummary {
  int64_t steps = 0;
  double first_loss = 0, last_loss = 0;
  std::vector<double> losses;  ///< every step's loss
  ImageEvaluation eval;        ///< the last evaluation
  double seconds = 0;
};

/// Trains image model cfg.model (is_image_model) per `cfg` (validated) on this rank of `comm`.
/// Prints progress on rank 0 and writes metrics.jsonl and run.json under cfg.output_dir, and
/// sharded checkpoints (checkpoint/sharded_checkpoint.h) there as the GPT-2 trainer does: every
/// cfg.save_interval steps and at the end, holding parameters, AdamW state, progress (step,
/// epoch, position in the epoch; the data order and augmentation are functions of seed, epoch
/// and sample) and every rank's batch-norm running statistics, so cfg.resume continues the same
/// trajectory bit for bit. cfg.init_from: a checkpoint of the same model (weights and statistics),
/// or a torchvision state dict in safetensors (checkpoint/image_weights.h; cfg.replace_head keeps a
/// fresh classifier head when the file's class count differs). Throws Error subclasses on bad input
/// (ConfigError for the pipeline strategy, an input too small for the network, too few images for
/// one global batch, or --init-from weights that do not fit; CheckpointError for a checkpoint of
/// another model, naming both; DataError for missing data).
ImageTrainSummary train_image_model(const TrainConfig& cfg, Communicator& comm);

}  // namespace shardtrain
