#!/usr/bin/env bash
# Trains an image classifier on the ranks of this node: a thin wrapper over `shardtrain launch`.
#
#   examples/launch_distributed.sh MODEL STRATEGY NUM_GPUS BATCH_SIZE EPOCHS [TRAIN FLAGS...]
#   examples/launch_distributed.sh cnn dp 2 32 1
#   DEVICE=cpu examples/launch_distributed.sh cnn zero2 2 32 1 --max-steps 20
#
# BATCH_SIZE is the per-GPU (per-rank) micro-batch, as DeepSpeed's train_micro_batch_size_per_gpu
# and torchrun scripts' --batch-size: the global batch is BATCH_SIZE × NUM_GPUS × the config's
# gradient_accumulation_steps. It is passed as --batch-size, which takes precedence over the
# config's train_micro_batch_size_per_gpu (shardtrain says so in a warning).
# STRATEGY picks examples/ds_config_*.json (table in examples/common.sh and examples/README.md):
# dp, zero1, zero2, zero3, zero2_offload, zero3_offload, infinity, and --strategy's aliases ddp,
# fsdp_stage2, fsdp_stage3, offload with --strategy's meaning. The config's zero_optimization
# section decides the strategy, as in DeepSpeed. (pipeline is for GPT-2 models: examples/gpt2/.)
#
# Environment: SHARDTRAIN (the binary; default ./build/shardtrain, then shardtrain on PATH),
# DEVICE (auto|cpu|cuda; default auto: the GPUs when there are, else CPU ranks under mpirun),
# DATASET (default fashion-mnist), DATA_DIR (an ImageFolder root: one subfolder per class;
# replaces DATASET), DS_CONFIG (another DeepSpeed JSON), NVME_PATH (infinity's swap directory;
# default /tmp/shardtrain_nvme), OUTPUT_DIR (default runs/MODEL-STRATEGY). TRAIN FLAGS go to
# `shardtrain train` as they are; do not repeat the flags this script passes.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [ "$#" -lt 5 ]; then
  echo "usage: $0 MODEL STRATEGY NUM_GPUS BATCH_SIZE EPOCHS [TRAIN FLAGS...]" >&2
  echo "  MODEL: cnn, mobilenet_v2, efficientnet_b0, vgg11_bn, vgg16_bn, cnn_lstm, ensemble:A,B" >&2
  echo "  STRATEGY: $STRATEGY_NAMES" >&2
  echo "  BATCH_SIZE: per GPU (micro-batch)" >&2
  echo "  e.g. $0 cnn dp 2 32 1    (env: DEVICE, DATASET, DATA_DIR, DS_CONFIG, OUTPUT_DIR)" >&2
  exit 2
fi
model=$1 strategy=$2 num_gpus=$3 batch_size=$4 epochs=$5
shift 5
find_shardtrain

train=(--model "$model" --batch-size "$batch_size" --epochs "$epochs" --device "${DEVICE:-auto}"
  --output-dir "${OUTPUT_DIR:-runs/$model-$strategy}")
if [ -n "${DATA_DIR:-}" ]; then
  train+=(--data-dir "$DATA_DIR")
else
  train+=(--dataset "${DATASET:-fashion-mnist}")
fi
add_strategy_flags "$strategy" "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

set -x
exec "$bin" launch --nproc-per-node "$num_gpus" -- train "${train[@]}" "$@"
