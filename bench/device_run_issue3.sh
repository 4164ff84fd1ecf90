#!/usr/bin/env bash
# One device call for issue 3: parity tests, a gpt2-medium training run + sample + HF export
# check, and the single-GPU benchmark. Results and logs go to $OUT.
source bench/device_env.sh
if ldd .device/shardtrain | grep -q "not found"; then
  export LD_LIBRARY_PATH="$PWD/.device/libfallback:$LD_LIBRARY_PATH"
fi
ldd .device/shardtrain | grep "not found"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
.device/test_hf_parity 2>&1 | tail -4 | tee $OUT/tests.txt
.device/test_cuda_backend 2>&1 | tail -3 | tee -a $OUT/tests.txt
.device/shardtrain train --model gpt2-medium --dataset wikitext-2 --device cuda --batch-size 8 \
  --max-length 512 --max-steps 300 --log-interval 25 --eval-samples 256 --output-dir /tmp/med \
  > $OUT/medium_train.log 2>&1
tail -6 $OUT/medium_train.log
.device/shardtrain generate --checkpoint /tmp/med --prompt "The game" --max-new-tokens 40 \
  --device cuda > $OUT/generate.txt 2>&1; cat $OUT/generate.txt
export PYTHONUNBUFFERED=1
python3 bench/bench_single_gpu.py --shardtrain .device/shardtrain --cases medium16,xl2,xl16ac \
  --frameworks shardtrain,eager --out $OUT/bench_a.json > $OUT/bench_a.log 2>&1
tail -12 $OUT/bench_a.log
python3 bench/bench_single_gpu.py --shardtrain .device/shardtrain --cases tutorial,medium16 \
  --frameworks shardtrain,compile --out $OUT/bench_b.json > $OUT/bench_b.log 2>&1
tail -8 $OUT/bench_b.log
OMP_NUM_THREADS=16 timeout 120 python3 tools/check_hf_export.py /tmp/med/checkpoint-000300 \
  .device/shardtrain > $OUT/hf_export.txt 2>&1; tail -3 $OUT/hf_export.txt
