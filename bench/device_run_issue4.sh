#!/usr/bin/env bash
# Device calls for issue 4 (nvidia-h200-x2). Usage: bash bench/device_run_issue4.sh PHASE...
#   train    the Done-when command: zero2 on 2 GPUs, defaults (one epoch of WikiText-2)
#   bench    bench/bench_multi_gpu.py: shardtrain dp/zero1/zero2 vs PyTorch DDP / ZeRO / FSDP2 on
#            1 and 2 GPUs (BENCH_TIMEOUT, BENCH_BUDGET seconds)
#   overlap  why dp's gradient all-reduce does not hide behind backward (docs/BENCHMARKS.md):
#            gpt2-medium mb 4 dp on 1 and 2 GPUs with GEMMs leaving SMs free for NCCL
#            (SHARDTRAIN_GEMM_SM_MARGIN) and with more hardware work queues
# Logs and JSON go to $OUT.
source bench/device_env.sh
ldd .device/shardtrain | grep -q "not found" && export LD_LIBRARY_PATH="$PWD/.device/libfallback:$LD_LIBRARY_PATH"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/gpus.txt; date -u | tee -a $OUT/gpus.txt
dp_run() {  # dp_run NAME GPUS [ENV=VALUE...]: 40 steps of gpt2-medium mb 4 × 512, steps 30 and 40 shown
  local name=$1 n=$2; shift 2
  env "$@" timeout 60 .device/shardtrain launch --nproc-per-node $n -- train --model gpt2-medium \
    --dataset wikitext-2 --strategy dp --batch-size 4 --max-length 512 --max-steps 40 \
    --log-interval 10 --no-save --eval-samples 8 --output-dir /tmp/ov_$name > $OUT/ov_$name.log 2>&1
  echo "== $name ($n GPUs, $*) rc=$?"; grep -E "step +(30|40)/" $OUT/ov_$name.log
}
for phase in "$@"; do
  echo "==== $phase"
  case $phase in
    train)
      timeout 100 .device/shardtrain launch --nproc-per-node 2 -- train --model gpt2-medium \
        --dataset wikitext-2 --strategy zero2 --output-dir /tmp/zero2 > $OUT/zero2_train.log 2>&1
      echo "zero2 exit $?"; grep -E "step +(1|10|500|1000)/|epoch 1 \||validation|done|error" $OUT/zero2_train.log | head -8 ;;
    bench)
      timeout ${BENCH_TIMEOUT:-470} python3 bench/bench_multi_gpu.py --shardtrain .device/shardtrain \
        --gpus 2 --budget ${BENCH_BUDGET:-430} --out $OUT/bench_multi_gpu.json \
        --workdir /tmp/bench_multi_gpu > $OUT/bench_multi_gpu.log 2>&1
      echo "bench exit $?"; tail -c 9000 $OUT/bench_multi_gpu.log ;;
    overlap)
      dp_run one_gpu 1
      dp_run base 2
      for m in 8 16 32; do dp_run margin$m 2 SHARDTRAIN_GEMM_SM_MARGIN=$m; done
      dp_run queues32 2 CUDA_DEVICE_MAX_CONNECTIONS=32
      dp_run margin16_ch8 2 SHARDTRAIN_GEMM_SM_MARGIN=16 NCCL_MAX_NCHANNELS=8 ;;
  esac
done
