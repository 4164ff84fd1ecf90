#!/usr/bin/env bash
# Trains a GPT-2 model on WikiText-2 on the GPUs (or CPU ranks) of this node: a thin wrapper over
# `shardtrain launch --nproc-per-node N -- train ...`, as `deepspeed --num_gpus N train.py
# --deepspeed_config ds_config.json` or `torchrun --nproc_per_node N train.py`.
#
#   examples/gpt2/launch_distributed.sh MODEL STRATEGY NUM_GPUS MICRO_BATCH [TRAIN FLAGS...]
#   examples/gpt2/launch_distributed.sh gpt2-medium zero1 8 16
#   examples/gpt2/launch_distributed.sh gpt2-xl zero3 2 4 --activation-checkpointing
#   examples/gpt2/launch_distributed.sh gpt2-xl pipeline 2 4      # 2 stages, 1F1B, 8 micro-batches
#   DEVICE=cpu examples/gpt2/launch_distributed.sh gpt2-tiny zero2 2 4 --max-steps 20
#
# MICRO_BATCH is per GPU (train_micro_batch_size_per_gpu); the global batch is MICRO_BATCH ×
# NUM_GPUS × the config's gradient_accumulation_steps (for pipeline: MICRO_BATCH × 8
# micro-batches × NUM_GPUS / stages). STRATEGY picks examples/ds_config_*.json: dp, zero1, zero2,
# zero3, zero2_offload, zero3_offload, infinity, pipeline, and --strategy's aliases ddp,
# fsdp_stage2, fsdp_stage3, offload with --strategy's meaning (examples/common.sh). MODEL as in
# train_single_gpu.sh.
#
# Environment: SHARDTRAIN (the binary), DEVICE (auto|cpu|cuda; default auto: the GPUs when there
# are, else CPU ranks under mpirun), MAX_LENGTH (default 1024), DS_CONFIG (another DeepSpeed
# JSON), NVME_PATH (infinity's swap directory, default /tmp/shardtrain_nvme), PIPELINE_STAGES
# (pipeline: ranks per pipeline, default the config's 2; NUM_GPUS must be a multiple),
# OUTPUT_DIR (default runs/MODEL-STRATEGY). TRAIN FLAGS go to `shardtrain train` as they are.
# The peak learning rate is GPT-3's for MODEL's size (gpt3_lr in examples/common.sh) unless
# TRAIN FLAGS give --lr or DS_CONFIG is set; the config's schedule (warmup, cosine) stays.
set -euo pipefail
examples="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=../common.sh
source "$examples/common.sh"

if [ "$#" -lt 4 ]; then
  echo "usage: $0 MODEL STRATEGY NUM_GPUS MICRO_BATCH [TRAIN FLAGS...]" >&2
  echo "  MODEL: gpt2-tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, ... or a config.json" >&2
  echo "  STRATEGY: $STRATEGY_NAMES" >&2
  echo "  MICRO_BATCH: per GPU; e.g. $0 gpt2 zero2 8 8    (env: DEVICE, MAX_LENGTH, DS_CONFIG, OUTPUT_DIR)" >&2
  exit 2
fi
model=$1 strategy=$2 num_gpus=$3 micro_batch=$4
shift 4
find_shardtrain

train=(--model "$model" --dataset wikitext-2 --batch-size "$micro_batch"
  --max-length "${MAX_LENGTH:-1024}" --device "${DEVICE:-auto}"
  --output-dir "${OUTPUT_DIR:-runs/$(basename "$model" .json)-$strategy}")
add_strategy_flags "$strategy" "$examples"
add_gpt3_lr_flag "$model" "$@"

set -x
exec "$bin" launch --nproc-per-node "$num_gpus" -- train "${train[@]}" "$@"
