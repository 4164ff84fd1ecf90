#!/usr/bin/env bash
# Trains a GPT-2 model on WikiText-2 on several nodes: a thin wrapper over `shardtrain launch
# --hostfile` (DeepSpeed's way) or one `shardtrain launch --nnodes` per node (torchrun's way).
#
#   examples/gpt2/launch_multi_node.sh MODEL STRATEGY NUM_NODES GPUS_PER_NODE MICRO_BATCH [TRAIN FLAGS...]
#
#   printf 'gpu-node-1 slots=8\ngpu-node-2 slots=8\n' > hostfile
#   examples/gpt2/launch_multi_node.sh gpt2-xl zero3 2 8 8          # run once, on gpu-node-1
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 examples/gpt2/launch_multi_node.sh gpt2-xl zero3 2 8 8
#
# The nodes, MASTER_ADDR / MASTER_PORT and the hostfile's rules as in examples/launch_multi_node.sh
# (HOSTFILE, default ./hostfile: NUM_NODES lines 'HOST slots=GPUS_PER_NODE'; CPU jobs need the
# hostfile). MICRO_BATCH is per GPU: the global batch is MICRO_BATCH × NUM_NODES × GPUS_PER_NODE ×
# gradient_accumulation_steps. STRATEGY and the variables (SHARDTRAIN, DEVICE, MAX_LENGTH,
# DS_CONFIG, NVME_PATH, PIPELINE_STAGES, OUTPUT_DIR) as in launch_distributed.sh; OUTPUT_DIR must
# be on a filesystem every node shares, and infinity's NVMe directory must exist on every node.
# The peak learning rate as in launch_distributed.sh: GPT-3's for MODEL's size unless --lr is given.
set -euo pipefail
examples="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=../common.sh
source "$examples/common.sh"

if [ "$#" -lt 5 ]; then
  echo "usage: $0 MODEL STRATEGY NUM_NODES GPUS_PER_NODE MICRO_BATCH [TRAIN FLAGS...]" >&2
  echo "  the nodes: \$HOSTFILE (default ./hostfile, lines 'HOST slots=GPUS_PER_NODE'), or" >&2
  echo "  NODE_RANK and MASTER_ADDR set on every node; MICRO_BATCH: per GPU" >&2
  echo "  STRATEGY: $STRATEGY_NAMES" >&2
  echo "  e.g. $0 gpt2 zero2 2 8 8" >&2
  exit 2
fi
model=$1 strategy=$2 num_nodes=$3 gpus_per_node=$4 micro_batch=$5
shift 5
find_shardtrain
multi_node_launch_flags "$num_nodes" "$gpus_per_node"

train=(--model "$model" --dataset wikitext-2 --batch-size "$micro_batch"
  --max-length "${MAX_LENGTH:-1024}" --device "${DEVICE:-auto}"
  --output-dir "${OUTPUT_DIR:-runs/$(basename "$model" .json)-$strategy}")
add_strategy_flags "$strategy" "$examples"
add_gpt3_lr_flag "$model" "$@"

set -x
exec "$bin" launch "${launch[@]}" -- train "${train[@]}" "$@"
