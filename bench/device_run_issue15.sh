#!/usr/bin/env bash
# Device call for issue 15 (image models on the GPU), one H100/H200.
# Usage: bash bench/device_run_issue15.sh PHASE...
# Before the call, here: cmake --build build && FASHION_MNIST=1 TESTS="test_cuda_image_ops
#   test_image_models test_cuda_backend" bash bench/pack_device.sh build .device   (carry: .device)
#   tests     .device/test_cuda_image_ops (every CUDA image op against the CPU, fp32 and bf16),
#             .device/test_image_models (the models on CUDA fp32 against the PyTorch fixtures)
#   smoke     one epoch of cnn and mobilenet_v2 on Fashion-MNIST on the GPU
#   profile   the FLOPs profiler's per-layer table (PROFILE_MODELS, default mobilenet_v2 vgg11_bn;
#             PROFILE_SIZE 32 (Fashion-MNIST) or e.g. 224 (synthetic), PROFILE_BATCH 256)
#   trace     per-kernel device time of steady steps (TRACE_MODELS, TRACE_SIZES "32 224"); needs
#             .device/libkernel_trace.so (pack with EXTRA_BINS="libkernel_trace.so")
#   ops       .device/bench_image_ops: device time of each image op on MobileNetV2/VGG layer shapes
#   speed     bench/bench_image_models.py: images/s and peak memory, shardtrain vs PyTorch eager
#             and torch.compile (torchvision models, bf16 autocast, channels_last)
#   accuracy  bench/bench_image_models.py --accuracy: the same recipe in both, test top-1
#   donewhen  the commands: shardtrain launch ... fsdp_stage2 --epochs 5, and
#             examples/launch_distributed.sh mobilenet_v2 ddp 1 256 5
# Back in $OUT: summary.txt, logs.tgz and the phases' files.
LOGS_NAME=i15logs
source bench/device_run_common.sh
for phase in "$@"; do
  case $phase in
    tests)
      for t in ${TEST_PROGRAMS:-test_cuda_image_ops test_image_models}; do
        run_gtest $t "FAILED|Failure|error"
      done ;;
    smoke)
      for m in cnn mobilenet_v2; do
        timeout 250 $ST train --model $m --dataset fashion-mnist --device cuda --batch-size 256 \
          --epochs 1 --lr 2e-3 --no-save --output-dir $LOGS/smoke_$m > $LOGS/smoke_$m.log 2>&1
        say "smoke $m exit $?"; grep -v "^step" $LOGS/smoke_$m.log | tail -12 | tee -a $SUM
      done ;;
    profile)
      for m in ${PROFILE_MODELS:-mobilenet_v2 vgg11_bn}; do
        size=${PROFILE_SIZE:-32}
        data="--dataset fashion-mnist"
        [ "$size" = 32 ] || data="--dataset synthetic --num-samples 2048"
        timeout 200 $ST train --model $m $data --image-size $size --device cuda \
          --batch-size ${PROFILE_BATCH:-256} --max-steps 8 --profile-step 6 --eval-samples 256 \
          --no-save --output-dir $LOGS/profile_$m > $OUT/profile_${m}_$size.log 2>&1
        say "profile $m $size exit $?"; grep -A40 -i "profile" $OUT/profile_${m}_$size.log | head -60 | tee -a $SUM
      done ;;
    nsys)
      NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
      say "nsys: ${NSYS:-none}"
      for m in ${PROFILE_MODELS:-mobilenet_v2 vgg11_bn}; do
        [ -n "$NSYS" ] || break
        timeout 200 $NSYS profile -o $LOGS/nsys_$m --force-overwrite true --stats=false \
          $ST train --model $m --dataset fashion-mnist --image-size 32 --device cuda \
          --batch-size 256 --max-steps 30 --eval-samples 256 --no-save \
          --output-dir $LOGS/nsys_run_$m > $LOGS/nsys_$m.log 2>&1
        $NSYS stats -q --report cuda_gpu_kern_sum --format csv $LOGS/nsys_$m.nsys-rep \
          > $OUT/kern_$m.csv 2>&1
        $NSYS stats -q --report cuda_api_sum --format csv $LOGS/nsys_$m.nsys-rep \
          > $OUT/api_$m.csv 2>&1
        say "nsys $m: top kernels"; head -25 $OUT/kern_$m.csv | cut -c1-220 | tee -a $SUM
      done ;;
    trace)
      # Per-kernel device time of steady steps (bench/kernel_trace.cpp through CUDA_INJECTION64_PATH,
      # bench/kernel_trace_diff.py): runs of 5 and 25 steps, the difference per step.
      for m in ${TRACE_MODELS:-mobilenet_v2}; do
        for size in ${TRACE_SIZES:-32 224}; do
          data="--dataset fashion-mnist"; B=256
          [ "$size" = 32 ] || { data="--dataset synthetic --num-samples 2048"; B=64; }
          for steps in 5 25; do
            CUDA_INJECTION64_PATH=$PWD/.device/libkernel_trace.so \
              KERNEL_TRACE_OUT=$LOGS/kern_${m}_${size}_$steps.tsv \
              timeout 200 $ST train --model $m $data --image-size $size --device cuda \
              --batch-size $B --max-steps $steps --eval-samples 256 --no-save \
              --output-dir $LOGS/trace_$m > $LOGS/trace_${m}_${size}_$steps.log 2>&1
          done
          say "trace $m $size: $(grep 'step 25/' $LOGS/trace_${m}_${size}_25.log | tail -1)"
          python3 bench/kernel_trace_diff.py $LOGS/kern_${m}_${size}_5.tsv \
            $LOGS/kern_${m}_${size}_25.tsv 20 --top ${TRACE_TOP:-14} | tee -a $SUM
        done
      done ;;
    ops)
      timeout 120 .device/bench_image_ops ${OPS_REPS:-20} > $OUT/ops.log 2>&1
      say "bench_image_ops exit $?"; cat $OUT/ops.log | tee -a $SUM ;;
    speed)
      timeout 580 python3 bench/bench_image_models.py --shardtrain $ST --out $OUT/speed.json \
        --workdir /tmp/bim ${SPEED_ARGS:-} > $OUT/speed.log 2>&1
      say "speed exit $?"; tail -30 $OUT/speed.log | tee -a $SUM ;;
    accuracy)
      timeout 580 python3 bench/bench_image_models.py --shardtrain $ST --accuracy \
        --out $OUT/accuracy.json --workdir /tmp/bim ${ACCURACY_ARGS:-} > $OUT/accuracy.log 2>&1
      say "accuracy exit $?"; tail -30 $OUT/accuracy.log | tee -a $SUM ;;
    donewhen)
      timeout 300 $ST launch --nproc-per-node 1 -- train --model mobilenet_v2 \
        --dataset fashion-mnist --strategy fsdp_stage2 --batch-size 256 --epochs 5 \
        --output-dir $LOGS/donewhen > $OUT/donewhen_launch.log 2>&1
      say "launch fsdp_stage2 exit $?"; grep -v "^step" $OUT/donewhen_launch.log | tail -15 | tee -a $SUM
      SHARDTRAIN=$ST timeout 280 bash examples/launch_distributed.sh mobilenet_v2 ddp 1 256 5 \
        > $OUT/donewhen_example.log 2>&1
      say "launch_distributed.sh exit $?"; grep -v "^step" $OUT/donewhen_example.log | tail -15 | tee -a $SUM ;;
    *) say "unknown phase $phase" ;;
  esac
done
tar -C /tmp -czf $OUT/logs.tgz ${LOGS_NAME}
