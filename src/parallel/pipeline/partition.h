// Cutting GPT-2's layers into pipeline stages.
//
// The whole model's layers are numbered 0 = embedding, 1..L = the transformer blocks, L+1 = the
// head (GPT2Model's layer_ids). The P·V virtual stages (P ranks, V model chunks each) get
// contiguous runs of blocks, at least one each; the embedding goes with the first virtual stage
// and the head with the last. Virtual stage v runs on rank v mod P as its chunk v / P (Megatron's
// interleaved assignment, arXiv 2104.04473 §2.2; schedule.h).
#pragma once

#include <string>
#include <vector>

namespace shardtrain {

/// How the blocks are balanced across stages (the `pipeline.partition_method` setting).
enum class PartitionMethod {
  kUniform,     ///< equal block counts (the first L mod S stages one more)
  kParameters,  ///< balance parameter counts, the head counting the tied wte it reads (DeepSpeed's
                ///< default "parameters")
  kTime,        ///< balance measured forward + backward time per layer
};

/// Parses uniform | parameters | time (config/config.h's pipeline_partition_methods()). Throws
/// ConfigError listing them (check_partition_method).
PartitionMethod parse_partition_method(const std::string& name);
std::string to_string(PartitionMethod m);

/// Whole-model layers [first, last) of one virtual stage.
struct LayerSpan {
  int first = 0, last = 0;
  bool operator==(const LayerSpan&) const = default;
};

/// Splits the blocks of a model with `costs.size() - 2` blocks into `parts` contiguous spans
/// (≥ 1 block each) minimizing the largest span cost; `costs` has one entry per whole-model layer
/// (embedding, blocks, head), the embedding's added to the first span and the head's to the
/// last. Throws ConfigError when parts exceeds the blocks ("more stages than layers").
std::vector<LayerSpan> partition_layers(const std::vector<double>& costs, int parts);

/// The whole-model layer ids rank `rank` holds: its chunks' spans (virtual stages c·P + rank,
/// c = 0..V-1), ascending.
std::vector<int> stage_layer_ids(const std::vector<LayerSpan>& spans, int stages, int rank);

}  // namespace shardtrain
