#!/usr/bin/env bash
# Trains an image classifier on several nodes: a thin wrapper over `shardtrain launch`.
#
#   examples/launch_multi_node.sh MODEL STRATEGY NUM_NODES GPUS_PER_NODE BATCH_SIZE EPOCHS [TRAIN FLAGS...]
#
# Two ways, as DeepSpeed and torchrun do it:
#  * a hostfile (default): run this once, on the first node. $HOSTFILE (default ./hostfile) lists
#    the nodes in DeepSpeed's format, one "HOST slots=N" line per node ('#' starts a comment);
#    it must list NUM_NODES hosts of GPUS_PER_NODE slots each. `shardtrain launch --hostfile`
#    starts one launch per host over ssh (GPU jobs; passwordless ssh, shardtrain and this
#    directory at the same path on every host) or one mpirun over all hosts (CPU jobs). The
#    first host is the master unless MASTER_ADDR is set.
#  * one launch per node (torchrun's way): set NODE_RANK (0 .. NUM_NODES-1) and MASTER_ADDR (the
#    address of node 0) and run this on every node. GPU jobs only: CPU jobs of several nodes
#    start through mpirun, so use the hostfile.
#
#   printf 'gpu-node-1 slots=8\ngpu-node-2 slots=8\n' > hostfile
#   examples/launch_multi_node.sh mobilenet_v2 zero2 2 8 64 10
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 examples/launch_multi_node.sh cnn dp 2 8 64 10
#
# BATCH_SIZE is the per-GPU micro-batch (the global batch: BATCH_SIZE × NUM_NODES ×
# GPUS_PER_NODE × gradient_accumulation_steps). STRATEGY, the other variables (SHARDTRAIN, DEVICE,
# DATASET, DATA_DIR, DS_CONFIG, NVME_PATH, OUTPUT_DIR) and TRAIN FLAGS as in
# launch_distributed.sh (infinity: the NVMe directory must exist on every node);
# MASTER_PORT (default 29500) must be free on the master. OUTPUT_DIR must be on a filesystem
# every node shares: each rank writes its shard of the checkpoints there.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [ "$#" -lt 6 ]; then
  echo "usage: $0 MODEL STRATEGY NUM_NODES GPUS_PER_NODE BATCH_SIZE EPOCHS [TRAIN FLAGS...]" >&2
  echo "  the nodes: \$HOSTFILE (default ./hostfile, lines 'HOST slots=GPUS_PER_NODE'), or" >&2
  echo "  NODE_RANK and MASTER_ADDR set on every node; BATCH_SIZE: per GPU (micro-batch)" >&2
  echo "  STRATEGY: $STRATEGY_NAMES" >&2
  echo "  e.g. $0 cnn dp 2 8 32 1" >&2
  exit 2
fi
model=$1 strategy=$2 num_nodes=$3 gpus_per_node=$4 batch_size=$5 epochs=$6
shift 6

find_shardtrain

multi_node_launch_flags "$num_nodes" "$gpus_per_node"

train=(--model "$model" --batch-size "$batch_size" --epochs "$epochs" --device "${DEVICE:-auto}"
  --output-dir "${OUTPUT_DIR:-runs/$model-$strategy}")
if [ -n "${DATA_DIR:-}" ]; then
  train+=(--data-dir "$DATA_DIR")
else
  train+=(--dataset "${DATASET:-fashion-mnist}")
fi
add_strategy_flags "$strategy" "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

set -x
exec "$bin" launch "${launch[@]}" -- train "${train[@]}" "$@"
