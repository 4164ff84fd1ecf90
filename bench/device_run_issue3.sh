#!/usr/bin/env bash
# Device calls for issue 3 (one H100/H200). Usage: bash bench/device_run_issue3.sh PHASE...
#   tests    CUDA parity tests (test_cuda_backend, test_hf_parity) + compute-sanitizer on the
#            fused attention tests
#   train    the Done-when command (gpt2-medium, wikitext-2, defaults: 1 epoch), samples, fp16 run
#   eager    bench/bench_single_gpu.py: shardtrain vs PyTorch eager, every case
#   compile  bench/bench_single_gpu.py: shardtrain vs torch.compile, every case
# Logs and JSON go to $OUT.
source bench/device_env.sh
ldd .device/shardtrain | grep -q "not found" && export LD_LIBRARY_PATH="$PWD/.device/libfallback:$LD_LIBRARY_PATH"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
ST=.device/shardtrain
for phase in "$@"; do
  echo "==== $phase"
  case $phase in
    tests)
      timeout 120 .device/test_cuda_backend > $OUT/test_cuda.log 2>&1; echo "test_cuda_backend rc=$?"
      grep -E "FAILED|PASSED|Failure" $OUT/test_cuda.log | head -20
      timeout 60 .device/test_hf_parity 2>&1 | tail -1
      CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      timeout 150 $CS --tool memcheck .device/test_cuda_model --gtest_filter='*Flash*' > $OUT/memcheck.log 2>&1
      echo "memcheck rc=$?"; tail -2 $OUT/memcheck.log
      timeout 150 $CS --tool racecheck .device/test_cuda_model \
        --gtest_filter='*FlashAttentionTest.ForwardBackward*' > $OUT/racecheck.log 2>&1
      echo "racecheck rc=$?"; tail -2 $OUT/racecheck.log ;;
    train)
      timeout 300 $ST train --model gpt2-medium --dataset wikitext-2 --device cuda \
        --output-dir /tmp/med > $OUT/medium_train.log 2>&1
      echo "train rc=$?"; grep -E "step +(10|500|1000|1500|2000)/|epoch 1 \||validation|sample|error" $OUT/medium_train.log | head -12
      for p in "The game" "In 1996 , the" "The city of"; do
        $ST generate --checkpoint /tmp/med --prompt "$p" --max-new-tokens 48 --top-k 40 --device cuda
      done > $OUT/generate.txt 2>&1; cat $OUT/generate.txt
      timeout 120 $ST train --model gpt2-medium --dataset wikitext-2 --device cuda --precision fp16 \
        --batch-size 16 --max-length 512 --max-steps 60 --log-interval 10 --no-save \
        --eval-samples 64 --output-dir /tmp/fp16 > $OUT/fp16_train.log 2>&1
      echo "fp16 rc=$?"; grep -E "step|overflow|scale|validation|peak|error" $OUT/fp16_train.log | tail -9 ;;
    eager|compile)
      timeout 560 python3 bench/bench_single_gpu.py --shardtrain $ST \
        --cases medium16,tutorial,xl2,xl16ac --frameworks shardtrain,$phase \
        --out $OUT/bench_$phase.json > $OUT/bench_$phase.log 2>&1
      tail -14 $OUT/bench_$phase.log ;;
  esac
done
