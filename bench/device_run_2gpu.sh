#!/usr/bin/env bash
# 2-GPU smoke run for issue 4: dp and zero2 through `shardtrain launch` (NCCL), gpt2-medium.
source bench/device_env.sh
if ldd .device/shardtrain | grep -q "not found"; then export LD_LIBRARY_PATH="$PWD/.device/libfallback:$LD_LIBRARY_PATH"; fi
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpus.txt
for s in zero2 dp; do
  timeout 80 .device/shardtrain launch --nproc-per-node 2 -- train --model gpt2-medium \
    --dataset wikitext-2 --strategy $s --batch-size 4 --max-length 512 --max-steps 40 \
    --log-interval 10 --eval-samples 16 --no-save --comm-timeout 60 --output-dir /tmp/out_$s \
    > $OUT/launch_$s.log 2>&1
  echo "$s exit $?"; grep -E "step|error|peak|states" $OUT/launch_$s.log | tail -7
done
