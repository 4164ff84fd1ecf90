#!/usr/bin/env bash
# The examples/slurm batch scripts, run as written on a one-host SLURM cluster with CPU tasks
# (scripts/slurm_single_host.sh): `sbatch --wait` each with DEVICE=cpu, 2 tasks on one node and a
# few steps, and check that every task trained (the job succeeds, the log ends with "done |")
# with the strategy of the STRATEGY it was given (through examples/ds_config_*.json).
# Exits 77 (CTest's "skipped"), printing why, where this machine cannot host SLURM (no root, no
# slurm-wlm/munge, or a daemon that does not start).
#
#   tests/slurm/test_examples.sh SHARDTRAIN_BINARY SOURCE_DIR
set -uo pipefail
bin=$1
src=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/shardtrain_slurm.XXXXXX")
cleanup() {
  bash "$src/scripts/slurm_single_host.sh" stop "$work/cluster" > /dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT
if ! started=$(bash "$src/scripts/slurm_single_host.sh" start "$work/cluster" 2>&1); then
  echo "SKIPPED: this machine cannot host a one-host SLURM: $started"
  exit 77
fi
echo "$started"
export SLURM_CONF=$work/cluster/slurm.conf
cd "$src" || exit 1  # sbatch from the repository root: the image script's configs are found there
common=(--wait --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 --time=10
  "--chdir=$work")
status=0
run() {  # NAME SCRIPT BANNER VAR=VALUE...: BANNER is the strategy the log must name
  local name=$1 script=$2 banner=$3
  shift 3
  echo "== sbatch $script (${*})"
  env DEVICE=cpu SHARDTRAIN="$bin" "$@" sbatch "${common[@]}" "--output=$work/$name.out" \
    "$script"
  local rc=$?
  cat "$work/$name.out" 2> /dev/null
  if [ $rc -ne 0 ]; then
    echo "FAILED: $script: sbatch --wait exited with status $rc"
    status=1
  elif [ "$(grep -c '^done |' "$work/$name.out")" -ne 1 ]; then
    echo "FAILED: $script: no 'done |' line from rank 0 in its log"
    status=1
  elif ! grep -q "| $banner | cpu (1 threads) × 2 ranks" "$work/$name.out"; then
    echo "FAILED: $script: the log does not name '$banner' on 2 ranks"
    status=1
  fi
}
run gpt2 examples/slurm/train_gpt2.sbatch "strategy zero3" MODEL=gpt2-micro STRATEGY=zero3 \
  BATCH_SIZE=2 MAX_LENGTH=32 "TRAIN_ARGS=--max-steps 3 --num-samples 64 --eval-samples 8 --no-save"
run image examples/slurm/train_image.sbatch "strategy dp" MODEL=cnn STRATEGY=ddp BATCH_SIZE=16 \
  EPOCHS=1 "TRAIN_ARGS=--max-steps 3 --num-samples 96 --eval-samples 32 --no-save"
exit $status
