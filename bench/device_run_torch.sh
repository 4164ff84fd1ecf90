#!/usr/bin/env bash
# PyTorch side of the single-GPU benchmark (and shardtrain again in the same run).
source bench/device_env.sh
if ldd .device/shardtrain | grep -q "not found"; then export LD_LIBRARY_PATH="$PWD/.device/libfallback:$LD_LIBRARY_PATH"; fi
export PYTHONUNBUFFERED=1
python3 bench/bench_single_gpu.py --shardtrain .device/shardtrain --cases medium16,xl2,xl16ac \
  --frameworks shardtrain,eager --out $OUT/bench_a.json > $OUT/bench_a.log 2>&1
tail -8 $OUT/bench_a.log
python3 bench/bench_single_gpu.py --shardtrain .device/shardtrain --cases medium16,tutorial \
  --frameworks shardtrain,compile --out $OUT/bench_b.json > $OUT/bench_b.log 2>&1
tail -6 $OUT/bench_b.log
