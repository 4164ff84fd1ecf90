# shellcheck shell=bash disable=SC2034  # sets bin, launch and train for the scripts that source it
# Sourced by the example scripts (not run by itself): the shardtrain binary, and the DeepSpeed
# config each STRATEGY name stands for.
#
#   STRATEGY                     config (examples/)                  what it runs
#   dp, ddp                      ds_config_dp.json                   ZeRO stage 0: data parallel
#   zero1                        ds_config_zero1.json                ZeRO-1: optimizer state sharded
#   zero2, fsdp_stage2           ds_config_zero2.json                ZeRO-2: + gradients sharded
#   zero3, fsdp_stage3           ds_config_zero3.json                ZeRO-3: + parameters sharded
#   zero2_offload, offload       ds_config_zero2_offload.json        ZeRO-2, optimizer on the CPU
#   zero3_offload                ds_config_zero3_offload.json        ZeRO-3, optimizer + parameters on the CPU
#   infinity                     ds_config_zero3_infinity_nvme.json  ZeRO-3, optimizer on NVMe, parameters on the CPU
#   pipeline                     ds_config_pipeline_1f1b.json        2-stage pipeline, 1F1B, 8 micro-batches
#
# The aliases mean what they mean to `shardtrain train --strategy` (ddp = dp, fsdp_stage2 = zero2,
# fsdp_stage3 = zero3, offload = zero2 with the optimizer on the CPU, infinity = zero3 with the
# optimizer on NVMe and the parameters on the CPU); case and '-' / '_' do not matter.

# Sets `bin`: $SHARDTRAIN, else ./build/shardtrain, else the repository's build/shardtrain, else
# shardtrain on PATH.
find_shardtrain() {
  local here
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
}

STRATEGY_NAMES="dp zero1 zero2 zero3 zero2_offload zero3_offload infinity pipeline (aliases: ddp, fsdp_stage2, fsdp_stage3, offload)"

# The file name (in examples/) of STRATEGY's DeepSpeed config; exits with status 2 on an unknown
# name.
strategy_config() {
  local s
  s=$(printf '%s' "$1" | tr 'A-Z-' 'a-z_')
  case "$s" in
    dp | ddp) echo ds_config_dp.json ;;
    zero1) echo ds_config_zero1.json ;;
    zero2 | fsdp_stage2) echo ds_config_zero2.json ;;
    zero3 | fsdp_stage3) echo ds_config_zero3.json ;;
    zero2_offload | offload) echo ds_config_zero2_offload.json ;;
    zero3_offload) echo ds_config_zero3_offload.json ;;
    infinity) echo ds_config_zero3_infinity_nvme.json ;;
    pipeline) echo ds_config_pipeline_1f1b.json ;;
    *)
      echo "error: unknown STRATEGY '$1': use one of $STRATEGY_NAMES" >&2
      exit 2
      ;;
  esac
}

# The NVMe swap directory of ds_config_zero3_infinity_nvme.json ("nvme_path"); NVME_PATH
# replaces it (passed as --nvme-path).
DEFAULT_NVME_PATH=/tmp/shardtrain_nvme

# Appends to the array `train` the flags that select STRATEGY ($1) from the configs in
# directory $2: --deepspeed-config FILE (DS_CONFIG replaces the file); for infinity --nvme-path
# when NVME_PATH is set, and for pipeline --pipeline-stages when PIPELINE_STAGES is set (both
# over the file's value). For infinity it also creates the swap directory on this host (on
# other hosts it must exist).
add_strategy_flags() {
  local file
  file=$(strategy_config "$1") || exit 2
  train+=(--deepspeed-config "${DS_CONFIG:-$2/$file}")
  if [ "$file" = ds_config_zero3_infinity_nvme.json ] && [ -z "${DS_CONFIG:-}" ]; then
    mkdir -p "${NVME_PATH:-$DEFAULT_NVME_PATH}"
    if [ -n "${NVME_PATH:-}" ]; then train+=(--nvme-path "$NVME_PATH"); fi
  fi
  if [ "$file" = ds_config_pipeline_1f1b.json ] && [ -n "${PIPELINE_STAGES:-}" ]; then
    train+=(--pipeline-stages "$PIPELINE_STAGES")
  fi
}

# GPT-3's peak learning rate for MODEL ($1) (Brown et al. 2020, "Language Models are Few-Shot
# Learners", arXiv 2005.14165, Table 2.1): the row of the GPT-3 size nearest to MODEL's parameter
# count on a log scale (the boundaries are the geometric means of neighbouring sizes).
#
#   GPT-3 size   125M    350M         760M        1.3B     2.7B           6.7B           13B           175B
#   peak lr      6.0e-4  3.0e-4       2.5e-4      2.0e-4   1.6e-4         1.2e-4         1.0e-4        6.0e-5
#   MODEL        gpt2 ¹  gpt2-medium  gpt2-large  gpt2-xl  gpt-2.7b.json  gpt-6.7b.json  gpt-13b.json
#   ¹ and the smaller presets (gpt2-micro, gpt2-tiny, gpt2-mini)
#
# MODEL: a preset, or a config.json (or a directory holding one) with n_layer and n_embd
# (vocab_size and n_positions default to GPT-2's). Prints nothing for a MODEL it cannot size;
# `shardtrain train` then reports the name.
gpt3_lr() {
  local model=$1 params=0 file layers embd vocab positions
  case "$model" in
    gpt2-micro) params=3382080 ;;
    gpt2-tiny) params=7357312 ;;
    gpt2-mini) params=30339456 ;;
    gpt2) params=124439808 ;;
    gpt2-medium) params=354823168 ;;
    gpt2-large) params=774030080 ;;
    gpt2-xl) params=1557611200 ;;
    *)
      file=$model
      if [ -d "$file" ]; then file=$file/config.json; fi
      [ -f "$file" ] || return 0
      json_int() { sed -n "s/.*\"$1\"[[:space:]]*:[[:space:]]*\([0-9][0-9]*\).*/\1/p" "$file" | head -n 1; }
      layers=$(json_int n_layer) embd=$(json_int n_embd)
      vocab=$(json_int vocab_size) positions=$(json_int n_positions)
      [ -n "$layers" ] && [ -n "$embd" ] || return 0
      # 12·d² + 13·d per block (attention, MLP, two LayerNorms), the embeddings, the final LayerNorm.
      params=$((layers * (12 * embd * embd + 13 * embd) + (${vocab:-50257} + ${positions:-1024}) * embd + 2 * embd))
      ;;
  esac
  if ((params < 209165006)); then echo 6e-4      # √(125M · 350M)
  elif ((params < 515751878)); then echo 3e-4    # √(350M · 760M)
  elif ((params < 993981891)); then echo 2.5e-4  # √(760M · 1.3B)
  elif ((params < 1873499399)); then echo 2e-4   # √(1.3B · 2.7B)
  elif ((params < 4253234063)); then echo 1.6e-4 # √(2.7B · 6.7B)
  elif ((params < 9332738076)); then echo 1.2e-4 # √(6.7B · 13B)
  elif ((params < 47696960070)); then echo 1e-4  # √(13B · 175B)
  else echo 6e-5; fi
}

# Appends `--lr` with gpt3_lr MODEL ($1) to the array `train` (the configs' own lr, 6e-4, is
# GPT-3 125M's), unless the TRAIN FLAGS (the other arguments) give --lr or DS_CONFIG names
# another config, whose lr then stands.
add_gpt3_lr_flag() {
  local model=$1 arg lr
  shift
  if [ -n "${DS_CONFIG:-}" ]; then return 0; fi
  for arg in "$@"; do
    case "$arg" in --lr | --lr=*) return 0 ;; esac
  done
  lr=$(gpt3_lr "$model")
  if [ -n "$lr" ]; then train+=(--lr "$lr"); fi
}

# Sets the array `launch` to the flags of `shardtrain launch` for NUM_NODES ($1) nodes of
# GPUS_PER_NODE ($2) ranks: one launch per node when NODE_RANK is set (with MASTER_ADDR), else
# $HOSTFILE (default ./hostfile), which must list $1 hosts of $2 slots each. MASTER_PORT
# (default 29500).
multi_node_launch_flags() {
  local hosts host slots _ hostfile
  launch=(--master-port "${MASTER_PORT:-29500}")
  if [ -n "${NODE_RANK:-}" ]; then
    if [ -z "${MASTER_ADDR:-}" ]; then
      echo "error: NODE_RANK=$NODE_RANK needs MASTER_ADDR, the address of node 0 (reachable from every node)" >&2
      exit 2
    fi
    launch+=(--nnodes "$1" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR"
      --nproc-per-node "$2")
  else
    hostfile="${HOSTFILE:-hostfile}"
    if [ ! -f "$hostfile" ]; then
      echo "error: no hostfile '$hostfile': write one 'HOST slots=$2' line per node (DeepSpeed's format) and set HOSTFILE=PATH, or set NODE_RANK and MASTER_ADDR to start each node yourself" >&2
      exit 2
    fi
    # The hostfile decides the layout; it must be the one the arguments describe.
    hosts=0
    while read -r host slots _; do
      case "$host" in '' | '#'*) continue ;; esac
      hosts=$((hosts + 1))
      if [ "$slots" != "slots=$2" ]; then
        echo "error: $hostfile: '$host $slots' but GPUS_PER_NODE is $2: write '$host slots=$2'" >&2
        exit 2
      fi
    done <"$hostfile"
    if [ "$hosts" != "$1" ]; then
      echo "error: $hostfile lists $hosts host(s) but NUM_NODES is $1: list one 'HOST slots=$2' line per node" >&2
      exit 2
    fi
    launch+=(--hostfile "$hostfile")
    if [ -n "${MASTER_ADDR:-}" ]; then launch+=(--master-addr "$MASTER_ADDR"); fi
  fi
}
