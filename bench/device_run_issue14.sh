#!/usr/bin/env bash
# Device call for issue 14 (see and compare: dropout, TensorBoard, the FLOPs profiler, compare),
# one H100/H200 and its 16 CPU cores.
# Usage: bash bench/device_run_issue14.sh PHASE...
# Before the call, here: cmake --build build && TESTS="test_cuda_backend" bash bench/pack_device.sh
#   build .device   (carry: .device)
#   tests     .device/test_cuda_backend (dropout against the CPU masks among them)
#   profile   the FLOPs profiler's table for gpt2-medium (micro-batch 4 and 16 × 512, step 5)
#   tboard    a GPU run with --tensorboard (gpt2, 40 steps, validation every 20): the event files
#             come back in $OUT/tensorboard and are read with tests/tools/read_tensorboard.py
#   dropout   bench/bench_single_gpu.py medium16 (gpt2-medium, micro-batch 16 × 512): shardtrain
#             and PyTorch eager + torch.compile, with dropout 0 and 0.1 on both sides
#   compare   `shardtrain compare` with its defaults (gpt2-medium, batch 4, 1000 samples × 512,
#             one epoch) for dp, zero1, zero2, zero3 and offload; the runs come back in
#             $OUT/compare (report.md, report.json, runs/*/metrics.jsonl, run.json)
#   infinity  the same for infinity on 48 samples (12 steps: 250 would take ~20 min on this disk)
#   fixtures  tests/fixtures/make_image_fixtures.py: PyTorch/torchvision references for the image
#             models (issue 15), into $OUT/fixtures
# Back in $OUT: summary.txt, logs.tgz and the phases' files.
LOGS_NAME=i14logs
source bench/device_run_common.sh
for phase in "$@"; do
  case $phase in
    tests)
      run_gtest test_cuda_backend ;;
    profile)
      for mb in 4 16; do
        timeout 200 $ST train --model gpt2-medium --dataset wikitext-2 --batch-size $mb \
          --max-length 512 --max-steps 6 --profile-step 5 --eval-samples $mb --no-save \
          --output-dir $LOGS/profile_mb$mb > $OUT/profile_mb$mb.log 2>&1
        say "profile mb$mb exit $?"
      done ;;
    tboard)
      timeout 200 $ST train --model gpt2 --dataset wikitext-2 --batch-size 8 --max-length 512 \
        --max-steps 40 --eval-interval 20 --eval-samples 64 --log-interval 5 --no-save \
        --tensorboard $OUT/tensorboard --output-dir $LOGS/tboard > $LOGS/tboard.log 2>&1
      say "tensorboard run exit $?: $(find $OUT/tensorboard -type f | head -3 | tr '\n' ' ')"
      python3 bench/read_gpu_tensorboard.py $OUT/tensorboard $LOGS/tboard/metrics.jsonl \
        > $OUT/tensorboard_read.txt 2>&1
      say "read back with tensorboard $(python3 -c 'import tensorboard; print(tensorboard.__version__)' 2>/dev/null): exit $?"
      cat $OUT/tensorboard_read.txt | tee -a $SUM
      tar -C $OUT -czf $OUT/tensorboard.tgz tensorboard && rm -rf $OUT/tensorboard ;;
    dropout)
      for p in 0 0.1; do
        timeout 280 python3 bench/bench_single_gpu.py --shardtrain $ST --cases medium16 \
          --frameworks shardtrain,eager,compile --dropout $p --out $OUT/single_gpu_dropout$p.json \
          --workdir /tmp/bsg$p > $OUT/single_gpu_dropout$p.log 2>&1
        say "dropout $p exit $?"; tail -8 $OUT/single_gpu_dropout$p.log | tee -a $SUM
      done ;;
    compare)
      mkdir -p /tmp/nvme
      timeout 560 $ST compare --strategies dp,zero1,zero2,zero3,offload -o $OUT/compare \
        -- --eval-samples 64 > $OUT/compare.log 2>&1
      say "compare exit $?"; tail -15 $OUT/compare.log | tee -a $SUM
      tar -C $OUT -czf $OUT/compare.tgz compare && rm -rf $OUT/compare ;;
    infinity)
      mkdir -p /tmp/nvme
      timeout 400 $ST compare --strategies infinity --num-samples 48 --nvme-path /tmp/nvme -o $OUT/compare_infinity \
        -- --eval-samples 64 > $OUT/compare_infinity.log 2>&1
      say "infinity exit $?"; tail -8 $OUT/compare_infinity.log | tee -a $SUM
      tar -C $OUT -czf $OUT/compare_infinity.tgz compare_infinity && rm -rf $OUT/compare_infinity ;;
    fixtures)
      python3 tests/fixtures/make_image_fixtures.py --out $OUT/fixtures 2>&1 | tee -a $SUM ;;
  esac
done
tar -C /tmp -czf $OUT/logs.tgz i14logs 2>/dev/null
