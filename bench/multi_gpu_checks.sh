#!/usr/bin/env bash
# Correctness checks that need several GPUs (NCCL semantics, faults, equivalence), for any GPU
# count (GPUS, default: all the machine's GPUs). Usage, on the GPU machine, in the repository
# root with the build unpacked in .device (bench/pack_device.sh; see docs/BENCHMARKS.md):
#     bash bench/multi_gpu_checks.sh PHASE...
#   nccltest     tests/mpi/test_nccl_comm on GPUS ranks (copy-engine collectives against NCCL)
#   pipelines    every schedule on GPUS stages (interleaved with V = 2), M = 2, 4, 8, 16
#                micro-batches (those the schedule allows), PIPE_MODEL (default gpt2; its blocks must
#                divide into GPUS × 2 chunks: gpt2-medium for 4 GPUs) at 4 × 256, 6 steps, PAR
#                (default 4) jobs at a time: the run finishes and the loss of step 6 is below step 1's
#   faults       a rank hung and a rank killed inside a pipeline transfer and inside zero1's and
#                zero2's gradient reduce-scatter: the job stops within --comm-timeout (10 s) plus
#                start-up and names the rank
#   uneven       validation with sample counts that do not divide over the ranks: zero3 (GPT-2)
#                and fsdp_stage3 (cnn) with every remainder
#   equivalence  tests/gpu/run_equivalence.sh (every strategy against 1-GPU dp; EQ_ARGS: more
#                flags of tests/gpu/equivalence.py, e.g. --only image/)
#   image-parity bench/image_accuracy_multi_gpu.py (ddp against PyTorch DDP, same recipe)
# What comes back in $OUT: summary.txt (each check's line and verdict), the reports, logs.tgz.
LOGS_NAME=checklogs
source bench/device_run_common.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
FAILS=0
verdict() {  # verdict NAME OK(0/1) DETAIL
  if [ "$2" = 1 ]; then say "PASS $1: $3"; else say "FAIL $1: $3"; FAILS=$((FAILS + 1)); fi
}
# loss_at LOG STEP: the loss printed for step STEP
loss_at() { grep -E "step +$2/" "$1" | head -1 | sed -n 's/.*| loss \([0-9.]*\) .*/\1/p'; }

for phase in "$@"; do
  say "==== $phase $(date -u +%T) on $GPUS GPUs"
  case $phase in
    nccltest)
      SHARDTRAIN_COMM_TIMEOUT=60 timeout 300 mpirun --allow-run-as-root --bind-to none -np "$GPUS" \
        .device/test_nccl_comm > "$LOGS/test_nccl_comm.log" 2>&1
      rc=$?
      verdict "test_nccl_comm ($GPUS ranks)" $([ $rc = 0 ] && echo 1 || echo 0) \
        "exit $rc: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$LOGS/test_nccl_comm.log" | sort -u | tr '\n' ' ')"
      grep -E "FAILED|assert" "$LOGS/test_nccl_comm.log" | sort -u | head -20 | tee -a "$SUM" ;;
    pipelines)
      # PAR jobs side by side (each on all GPUs, its own rendezvous port): correctness, not speed.
      jobs=()
      for s in gpipe 1f1b interleaved-1f1b zb-h1 2bw; do
        for M in 2 4 8 16; do
          # interleaved needs M a multiple of the stages, 2bw M >= stages (configuration errors)
          [ $s = interleaved-1f1b ] && [ $((M % GPUS)) != 0 ] && continue
          [ $s = 2bw ] && [ "$M" -lt "$GPUS" ] && continue
          jobs+=("$s $M")
        done
      done
      i=0
      for job in "${jobs[@]}"; do
        read -r s M <<< "$job"
        extra=()
        [ $s != interleaved-1f1b ] || extra=(--virtual-stages 2)
        name=pipe_${s}_M$M
        timeout 240 "$ST" launch --nproc-per-node "$GPUS" --master-port $((29600 + i)) \
          --comm-timeout 60 -- train --model "${PIPE_MODEL:-gpt2}" --dataset wikitext-2 --strategy pipeline \
          --pipeline-stages "$GPUS" --pipeline-schedule $s "${extra[@]}" \
          --gradient-accumulation-steps $M --batch-size 4 --max-length 256 --max-steps 6 \
          --log-interval 1 --no-save --eval-samples 9 --output-dir "$LOGS/$name" \
          > "$LOGS/$name.log" 2>&1 &
        i=$((i + 1))
        if [ $((i % ${PAR:-4})) = 0 ]; then wait; fi
      done
      wait
      for job in "${jobs[@]}"; do
        read -r s M <<< "$job"
        name=pipe_${s}_M$M
        first=$(loss_at "$LOGS/$name.log" 1) last=$(loss_at "$LOGS/$name.log" 6)
        done_line=$(grep -E '^done' "$LOGS/$name.log" | cut -c1-60)
        ok=$(python3 -c "print(int(bool('$done_line') and '$first' != '' and '$last' != '' and float('${last:-0}') < float('${first:-0}')))")
        verdict "$s M=$M ($GPUS stages)" "$ok" "loss $first → $last; $(grep -E '^validation' "$LOGS/$name.log" | cut -c1-70)"
        [ "$ok" = 1 ] || grep -E "error|Error" "$LOGS/$name.log" | head -5 | cut -c1-300 | tee -a "$SUM"
      done ;;
    faults)
      for f in HANG KILL; do
        for what in pipeline zero1 zero2; do
          if [ $what = pipeline ]; then
            fault=(SHARDTRAIN_TEST_FAULT_P2P=40)
            args=(--strategy pipeline --pipeline-stages "$GPUS" --gradient-accumulation-steps 8)
          else
            fault=(SHARDTRAIN_TEST_FAULT_NAME=reduce_scatter SHARDTRAIN_TEST_FAULT_OP=30)
            args=(--strategy $what)
          fi
          name=fault_${what}_$f
          start=$(date +%s)
          env SHARDTRAIN_TEST_${f}_RANK=1 "${fault[@]}" timeout 120 "$ST" launch \
            --nproc-per-node "$GPUS" --comm-timeout 10 -- train --model gpt2-medium \
            --dataset wikitext-2 "${args[@]}" --batch-size 4 --max-length 512 --max-steps 40 \
            --no-save --eval-samples 8 --output-dir "$LOGS/$name" > "$LOGS/$name.log" 2>&1
          rc=$? took=$(( $(date +%s) - start ))
          named=$(grep -cE "rank 1\b" "$LOGS/$name.log")
          ok=$([ $rc != 0 ] && [ $rc != 124 ] && [ "$named" -gt 0 ] && echo 1 || echo 0)
          verdict "$what, rank 1 ${f}s (${fault[*]})" "$ok" "exit $rc after $took s"
          grep -iE "error|rank [0-9]" "$LOGS/$name.log" | tail -3 | cut -c1-300 | tee -a "$SUM"
        done
      done ;;
    uneven)
      i=0
      for n in 9 10 11 12; do
        timeout 120 "$ST" launch --nproc-per-node "$GPUS" --master-port $((29700 + i)) \
          --comm-timeout 30 -- train --model gpt2 --dataset wikitext-2 --strategy zero3 \
          --batch-size 2 --max-length 128 --max-steps 2 --no-save --eval-samples $n \
          --output-dir "$LOGS/uneven_zero3_$n" > "$LOGS/uneven_zero3_$n.log" 2>&1 &
        timeout 120 "$ST" launch --nproc-per-node "$GPUS" --master-port $((29750 + i)) \
          --comm-timeout 30 -- train --model cnn --dataset fashion-mnist --strategy fsdp_stage3 \
          --batch-size 4 --max-steps 2 --no-save --eval-samples $n \
          --output-dir "$LOGS/uneven_cnn_$n" > "$LOGS/uneven_cnn_$n.log" 2>&1 &
        i=$((i + 1))
      done
      wait
      for n in 9 10 11 12; do
        for what in zero3 cnn; do
          v=$(grep -E '^validation' "$LOGS/uneven_${what}_$n.log" | head -1)
          d=$(grep -E '^done' "$LOGS/uneven_${what}_$n.log" | head -1)
          unit=$([ $what = cnn ] && echo images || echo samples)
          verdict "$what validation of $n $unit on $GPUS ranks" \
            $([ -n "$d" ] && echo "$v" | grep -q " $n $unit" && echo 1 || echo 0) "$v"
          [ -n "$d" ] || tail -3 "$LOGS/uneven_${what}_$n.log" | cut -c1-300 | tee -a "$SUM"
        done
      done ;;
    equivalence)
      timeout 540 bash tests/gpu/run_equivalence.sh "$OUT/equivalence.md" ${EQ_ARGS:-} \
        > "$LOGS/equivalence.log" 2>&1
      rc=$?
      verdict "GPU equivalence suite" $([ $rc = 0 ] && echo 1 || echo 0) "exit $rc"
      tail -n 60 "$LOGS/equivalence.log" | tee -a "$SUM" ;;
    image-parity)
      timeout 560 python3 bench/image_accuracy_multi_gpu.py --shardtrain "$ST" --gpus "$GPUS" \
        --out "$OUT/image_parity.json" --markdown "$OUT/image_parity.md" \
        ${PARITY_ARGS:-} > "$LOGS/image_parity.log" 2>&1
      rc=$?
      verdict "image accuracy parity" $([ $rc = 0 ] && echo 1 || echo 0) "exit $rc"
      tail -n 40 "$LOGS/image_parity.log" | tee -a "$SUM" ;;
    *) say "unknown phase $phase" ;;
  esac
done
tar -C /tmp -czf "$OUT/logs.tgz" "$LOGS_NAME" 2>/dev/null
say "==== done $(date -u +%T): $FAILS failed"
exit $((FAILS > 0))
