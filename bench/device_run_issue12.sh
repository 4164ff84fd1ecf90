#!/usr/bin/env bash
# Device call for issue 12 (pipeline parallelism), one H100/H200 and its 16 CPU cores.
# Usage: bash bench/device_run_issue12.sh PHASE...
# Before the call, here: cmake --build build --target shardtrain test_cuda_backend
#   && TESTS="test_cuda_backend" bash bench/pack_device.sh build .device   (carry: .device)
#   tests   .device/test_cuda_backend (the split backward and stage parts on the GPU among them)
#   gpu     one-stage pipelines on the GPU (gpt2, micro-batch 8 × 512, M = 8, bf16) for every
#           schedule that runs on one stage, against dp on the same batch: tokens/s and loss —
#           the executor's own overhead (a one-stage pipeline has no bubble and no transfers)
#   cpu     bench/pipeline_bubble_cpu.sh: 2 and 4 CPU stages (MPI ranks on this machine's cores),
#           measured bubble against the simulator's prediction
# Back in $OUT: summary.txt, logs.tgz.
LOGS_NAME=i12logs
source bench/device_run_common.sh
for phase in "$@"; do
  case $phase in
    tests)
      run_gtest test_cuda_model "FAILED|SplitBackward" ;;
    gpu)
      for s in dp gpipe 1f1b zb-h1 2bw interleaved-1f1b; do
        args=(--strategy pipeline --pipeline-stages 1 --pipeline-schedule $s)
        [ $s = dp ] && args=(--strategy dp)
        [ $s = interleaved-1f1b ] && args+=(--virtual-stages 2)
        timeout 240 $ST train --model gpt2 --dataset wikitext-2 "${args[@]}" --batch-size 8 \
          --max-length 512 --gradient-accumulation-steps 8 --max-steps 12 --log-interval 4 \
          --eval-samples 64 --no-save --output-dir $LOGS/gpu_$s > $LOGS/gpu_$s.log 2>&1
        say "gpu $s exit $?: $(grep -E '^epoch 1 \| step 12' $LOGS/gpu_$s.log) | $(grep -E 'partial' $LOGS/gpu_$s.log | grep -oE '[0-9]+ tokens/s|peak memory [^(]*')"
      done ;;
    cpu)
      bash bench/pipeline_bubble_cpu.sh $ST $LOGS/bubble 2>&1 | tee -a $SUM ;;
  esac
done
tar -C /tmp -czf $OUT/logs.tgz i12logs 2>/dev/null
