#!/usr/bin/env bash
# Trains an image classifier on the ranks of this node: a thin wrapper over `shardtrain launch`.
#
#   examples/launch_distributed.sh MODEL STRATEGY NUM_GPUS BATCH_SIZE EPOCHS [TRAIN FLAGS...]
#   examples/launch_distributed.sh cnn ddp 2 32 1
#   DEVICE=cpu examples/launch_distributed.sh cnn fsdp_stage2 2 32 1 --max-steps 20
#
# BATCH_SIZE is the per-GPU (per-rank) micro-batch, as DeepSpeed's train_micro_batch_size_per_gpu
# and torchrun scripts' --batch-size: the global batch is BATCH_SIZE × NUM_GPUS × the config's
# gradient_accumulation_steps. It is passed as --batch-size, which takes precedence over the
# config's train_micro_batch_size_per_gpu (shardtrain says so in a warning).
# STRATEGY ddp, fsdp_stage2 and fsdp_stage3 train with examples/ds_config_<STRATEGY>.json, whose
# zero_optimization section decides the strategy (as in DeepSpeed); any other strategy (dp, zero1,
# zero2, zero3, offload, infinity) is passed as --strategy. See examples/README.md.
#
# Environment: SHARDTRAIN (the binary; default ./build/shardtrain, then shardtrain on PATH),
# DEVICE (auto|cpu|cuda; default auto: the GPUs when there are, else CPU ranks under mpirun),
# DATASET (default fashion-mnist), DATA_DIR (an ImageFolder root: one subfolder per class;
# replaces DATASET), DS_CONFIG (another DeepSpeed JSON), OUTPUT_DIR (default
# runs/MODEL-STRATEGY). TRAIN FLAGS go to `shardtrain train` as they are; do not repeat the
# flags this script passes.
set -euo pipefail

if [ "$#" -lt 5 ]; then
  echo "usage: $0 MODEL STRATEGY NUM_GPUS BATCH_SIZE EPOCHS [TRAIN FLAGS...]" >&2
  echo "  MODEL: cnn, mobilenet_v2, efficientnet_b0, vgg11_bn, vgg16_bn, cnn_lstm, ensemble:A,B" >&2
  echo "  STRATEGY: ddp, fsdp_stage2, fsdp_stage3 (with examples/ds_config_STRATEGY.json) or" >&2
  echo "            dp, zero1, zero2, zero3, offload, infinity; BATCH_SIZE: per GPU (micro-batch)" >&2
  echo "  e.g. $0 cnn ddp 2 32 1    (env: DEVICE, DATASET, DATA_DIR, DS_CONFIG, OUTPUT_DIR)" >&2
  exit 2
fi
model=$1 strategy=$2 num_gpus=$3 batch_size=$4 epochs=$5
shift 5

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${SHARDTRAIN:-}" ]; then
  bin=$SHARDTRAIN
elif [ -x ./build/shardtrain ]; then
  bin=./build/shardtrain
elif [ -x "$here/../build/shardtrain" ]; then
  bin="$here/../build/shardtrain"
elif command -v shardtrain >/dev/null 2>&1; then
  bin=shardtrain
else
  echo "error: shardtrain not found: build it (scripts/setup.sh), put it on PATH, or set SHARDTRAIN=/path/to/shardtrain" >&2
  exit 2
fi

train=(--model "$model" --batch-size "$batch_size" --epochs "$epochs" --device "${DEVICE:-auto}"
  --output-dir "${OUTPUT_DIR:-runs/$model-$strategy}")
if [ -n "${DATA_DIR:-}" ]; then
  train+=(--data-dir "$DATA_DIR")
else
  train+=(--dataset "${DATASET:-fashion-mnist}")
fi
case "$strategy" in
  ddp | fsdp_stage2 | fsdp_stage3) config="${DS_CONFIG:-$here/ds_config_$strategy.json}" ;;
  *) config="${DS_CONFIG:-}" ;;
esac
if [ -n "$config" ]; then
  train+=(--deepspeed-config "$config")
else
  train+=(--strategy "$strategy")
fi

set -x
exec "$bin" launch --nproc-per-node "$num_gpus" -- train "${train[@]}" "$@"
