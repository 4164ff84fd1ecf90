#!/usr/bin/env bash
# Trains a GPT-2 model on WikiText-2 in one process (one GPU, or the CPU): `shardtrain train`,
# the way `python train.py --deepspeed_config ds_config.json` runs on one GPU.
#
#   examples/gpt2/train_single_gpu.sh MODEL STRATEGY MICRO_BATCH [TRAIN FLAGS...]
#   examples/gpt2/train_single_gpu.sh gpt2 dp 16
#   MAX_LENGTH=512 examples/gpt2/train_single_gpu.sh gpt2-xl zero2_offload 16   # 1.5B: optimizer on the CPU
#   DEVICE=cpu examples/gpt2/train_single_gpu.sh gpt2-tiny dp 8 --max-steps 20
#
# MODEL: gpt2-micro, gpt2-tiny, gpt2-mini, gpt2, gpt2-medium, gpt2-large, gpt2-xl, or the path of
# a Hugging Face style config.json (examples/gpt2/model_configs/ has 2.7B, 6.7B and 13B shapes).
# STRATEGY picks examples/ds_config_*.json (examples/common.sh). On one GPU ZeRO has nothing to
# shard: dp, or zero2_offload / zero3_offload / infinity to hold a model that does not fit
# (docs/STRATEGIES.md). MICRO_BATCH: sequences per step (global batch = MICRO_BATCH × the
# config's gradient_accumulation_steps).
#
# Environment: SHARDTRAIN (the binary), DEVICE (auto|cpu|cuda; default auto), MAX_LENGTH (tokens
# per sequence, default 1024), DS_CONFIG (another DeepSpeed JSON), NVME_PATH (infinity's swap
# directory, default /tmp/shardtrain_nvme), OUTPUT_DIR (default runs/MODEL-STRATEGY). TRAIN FLAGS
# go to `shardtrain train` as they are (--max-steps, --epochs, --lr, --activation-checkpointing,
# ...); do not repeat the flags this script passes.
# The peak learning rate is GPT-3's for MODEL's size (gpt3_lr in examples/common.sh) unless
# TRAIN FLAGS give --lr or DS_CONFIG is set; the config's schedule (warmup, cosine) stays.
set -euo pipefail
examples="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=../common.sh
source "$examples/common.sh"

if [ "$#" -lt 3 ]; then
  echo "usage: $0 MODEL STRATEGY MICRO_BATCH [TRAIN FLAGS...]" >&2
  echo "  MODEL: gpt2-tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, ... or a config.json" >&2
  echo "  STRATEGY: $STRATEGY_NAMES" >&2
  echo "  e.g. $0 gpt2 dp 16    (env: DEVICE, MAX_LENGTH, DS_CONFIG, NVME_PATH, OUTPUT_DIR)" >&2
  exit 2
fi
model=$1 strategy=$2 micro_batch=$3
shift 3
find_shardtrain

train=(--model "$model" --dataset wikitext-2 --batch-size "$micro_batch"
  --max-length "${MAX_LENGTH:-1024}" --device "${DEVICE:-auto}"
  --output-dir "${OUTPUT_DIR:-runs/$(basename "$model" .json)-$strategy}")
add_strategy_flags "$strategy" "$examples"
add_gpt3_lr_flag "$model" "$@"

set -x
exec "$bin" train "${train[@]}" "$@"
