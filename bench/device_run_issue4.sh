#!/usr/bin/env bash
# Device call for issue 4 (nvidia-h200-x2): the Done-when command (zero2 on 2 GPUs, defaults: one
# epoch of WikiText-2) and bench/bench_multi_gpu.py (shardtrain dp/zero1/zero2 vs PyTorch DDP /
# ZeroRedundancyOptimizer / FSDP2 on 1 and 2 GPUs). Logs and JSON go to $OUT.
source bench/device_env.sh
ldd .device/shardtrain | grep -q "not found" && export LD_LIBRARY_PATH="$PWD/.device/libfallback:$LD_LIBRARY_PATH"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpus.txt; date -u | tee -a $OUT/gpus.txt
timeout 100 .device/shardtrain launch --nproc-per-node 2 -- train --model gpt2-medium \
  --dataset wikitext-2 --strategy zero2 --output-dir /tmp/zero2 > $OUT/zero2_train.log 2>&1
echo "zero2 exit $?"; grep -E "step +(1|10|500|1000)/|epoch 1 \||validation|done|error" $OUT/zero2_train.log | head -8
timeout ${BENCH_TIMEOUT:-470} python3 bench/bench_multi_gpu.py --shardtrain .device/shardtrain --gpus 2 \
  --budget ${BENCH_BUDGET:-430} --out $OUT/bench_multi_gpu.json --workdir /tmp/bench_multi_gpu \
  > $OUT/bench_multi_gpu.log 2>&1
echo "bench exit $?"; tail -c 9000 $OUT/bench_multi_gpu.log
