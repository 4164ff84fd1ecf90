# shellcheck shell=bash
# The `checks` workload of bench/run.sh: correctness that only GPUs can show (NCCL's semantics,
# faults on real devices, every strategy against one GPU), for any GPU count. Each check prints
# one PASS/FAIL line into the summary; run.sh exits non-zero when one failed.
# docs/MULTI_GPU_CHECKS.md has the latest results. Sourced after bench/lib/prelude.sh.
#   nccltest      tests/comm's test_nccl_comm on GPUS ranks (copy-engine collectives against NCCL)
#   pipelines     every schedule on GPUS stages (interleaved with V = 2), M = 2, 4, 8, 16
#                 micro-batches (those the schedule allows), CHECK_PIPE_MODEL (default gpt2; its
#                 blocks must divide into GPUS x 2 chunks: gpt2-medium for 4 GPUs) at 4 x 256, 6
#                 steps, PAR (default 4) jobs at a time: the run finishes and the loss of step 6 is
#                 below step 1's
#   faults        a rank hung and a rank killed inside a pipeline transfer and inside zero1's and
#                 zero2's gradient reduce-scatter: the job stops within --comm-timeout (10 s) plus
#                 start-up and names the rank
#   uneven        validation with sample counts that do not divide over the ranks: zero3 (GPT-2)
#                 and fsdp_stage3 (cnn) with every remainder
#   equivalence   tests/gpu/run_equivalence.sh (every strategy against 1-GPU dp; EQ_ARGS: more
#                 flags of tests/gpu/equivalence.py, e.g. --only image/)
#   image-parity  bench/image_accuracy_multi_gpu.py (ddp against PyTorch DDP, same recipe;
#                 PARITY_ARGS: more flags)

CHECK_FAILS=0
verdict() {  # verdict NAME OK(0/1) DETAIL
  dry && return 0
  if [ "$2" = 1 ]; then say "PASS $1: $3"; else say "FAIL $1: $3"; CHECK_FAILS=$((CHECK_FAILS + 1)); fi
}
# loss_at LOG STEP: the loss printed for step STEP
loss_at() { grep -E "step +$2/" "$1" | head -1 | sed -n 's/.*| loss \([0-9.]*\) .*/\1/p'; }
# in_background CMD...: CMD in the background (in the foreground for a dry run, to print in order)
in_background() { if dry; then "$@"; else "$@" & fi; }

check_nccltest() {
  step test_nccl_comm 300 env SHARDTRAIN_COMM_TIMEOUT=60 "${MPIRUN[@]}" -np "$GPUS" \
    "$PACKED_ABS/test_nccl_comm"
  local rc=$?
  dry && return 0
  verdict "test_nccl_comm ($GPUS ranks)" "$([ $rc = 0 ] && echo 1 || echo 0)" \
    "exit $rc: $(gtest_totals test_nccl_comm)"
  grep -E "FAILED|assert" "$LOGS/test_nccl_comm.log" | sort -u | head -20 | tee -a "$SUM"
}

check_pipelines() {
  # PAR jobs side by side (each on all GPUs, its own rendezvous port): correctness, not speed.
  local jobs=() s M i=0 job extra name first last done_line ok
  for s in gpipe 1f1b interleaved-1f1b zb-h1 2bw; do
    for M in 2 4 8 16; do
      # interleaved needs M a multiple of the stages, 2bw M >= stages (configuration errors)
      [ "$s" = interleaved-1f1b ] && [ $((M % GPUS)) != 0 ] && continue
      [ "$s" = 2bw ] && [ "$M" -lt "$GPUS" ] && continue
      jobs+=("$s $M")
    done
  done
  for job in "${jobs[@]}"; do
    read -r s M <<< "$job"
    extra=()
    [ "$s" != interleaved-1f1b ] || extra=(--virtual-stages 2)
    name=pipe_${s}_M$M
    in_background step "$name" 240 "$ST" launch --nproc-per-node "$GPUS" --master-port $((29600 + i)) \
      --comm-timeout 60 -- train --model "${CHECK_PIPE_MODEL:-gpt2}" --dataset wikitext-2 \
      --strategy pipeline --pipeline-stages "$GPUS" --pipeline-schedule "$s" "${extra[@]}" \
      --gradient-accumulation-steps "$M" --batch-size 4 --max-length 256 --max-steps 6 \
      --log-interval 1 --no-save --eval-samples 9 --output-dir "$LOGS/$name"
    i=$((i + 1))
    if [ $((i % ${PAR:-4})) = 0 ]; then wait; fi
  done
  wait
  dry && return 0
  for job in "${jobs[@]}"; do
    read -r s M <<< "$job"
    name=pipe_${s}_M$M
    first=$(loss_at "$LOGS/$name.log" 1) last=$(loss_at "$LOGS/$name.log" 6)
    done_line=$(grep -E '^done' "$LOGS/$name.log" | cut -c1-60)
    ok=0
    if [ -n "$done_line" ] && [ -n "$first" ] && [ -n "$last" ] &&
       awk -v a="$last" -v b="$first" 'BEGIN { exit !(a < b) }'; then ok=1; fi
    verdict "$s M=$M ($GPUS stages)" "$ok" "loss $first → $last; $(grep -E '^validation' "$LOGS/$name.log" | cut -c1-70)"
    [ "$ok" = 1 ] || grep -E "error|Error" "$LOGS/$name.log" | head -5 | cut -c1-300 | tee -a "$SUM"
  done
}

check_faults() {
  local f what fault args name start rc took named ok
  for f in HANG KILL; do
    for what in pipeline zero1 zero2; do
      if [ "$what" = pipeline ]; then
        fault=(SHARDTRAIN_TEST_FAULT_P2P=40)
        args=(--strategy pipeline --pipeline-stages "$GPUS" --gradient-accumulation-steps 8)
      else
        fault=(SHARDTRAIN_TEST_FAULT_NAME=reduce_scatter SHARDTRAIN_TEST_FAULT_OP=30)
        args=(--strategy "$what")
      fi
      name=fault_${what}_$f
      start=$(date +%s)
      step "$name" 120 env "SHARDTRAIN_TEST_${f}_RANK=1" "${fault[@]}" "$ST" launch \
        --nproc-per-node "$GPUS" --comm-timeout 10 -- train --model gpt2-medium \
        --dataset wikitext-2 "${args[@]}" --batch-size 4 --max-length 512 --max-steps 40 \
        --no-save --eval-samples 8 --output-dir "$LOGS/$name"
      rc=$? took=$(( $(date +%s) - start ))
      dry && continue
      [ $rc = 0 ] || STEP_FAILS=$((STEP_FAILS - 1))  # these runs must fail: the verdict counts
      named=$(grep -cE "rank 1\b" "$LOGS/$name.log")
      ok=$([ $rc != 0 ] && [ $rc != 124 ] && [ "$named" -gt 0 ] && echo 1 || echo 0)
      verdict "$what, rank 1 ${f}s (${fault[*]})" "$ok" "exit $rc after $took s"
      grep -iE "error|rank [0-9]" "$LOGS/$name.log" | tail -3 | cut -c1-300 | tee -a "$SUM"
    done
  done
}

check_uneven() {
  local i=0 n what v d unit
  for n in 9 10 11 12; do
    in_background step "uneven_zero3_$n" 120 "$ST" launch --nproc-per-node "$GPUS" \
      --master-port $((29700 + i)) --comm-timeout 30 -- train --model gpt2 --dataset wikitext-2 \
      --strategy zero3 --batch-size 2 --max-length 128 --max-steps 2 --no-save --eval-samples "$n" \
      --output-dir "$LOGS/uneven_zero3_$n"
    in_background step "uneven_cnn_$n" 120 "$ST" launch --nproc-per-node "$GPUS" \
      --master-port $((29750 + i)) --comm-timeout 30 -- train --model cnn --dataset fashion-mnist \
      --strategy fsdp_stage3 --batch-size 4 --max-steps 2 --no-save --eval-samples "$n" \
      --output-dir "$LOGS/uneven_cnn_$n"
    i=$((i + 1))
  done
  wait
  dry && return 0
  for n in 9 10 11 12; do
    for what in zero3 cnn; do
      v=$(grep -E '^validation' "$LOGS/uneven_${what}_$n.log" | head -1)
      d=$(grep -E '^done' "$LOGS/uneven_${what}_$n.log" | head -1)
      unit=$([ "$what" = cnn ] && echo images || echo samples)
      verdict "$what validation of $n $unit on $GPUS ranks" \
        "$([ -n "$d" ] && echo "$v" | grep -q " $n $unit" && echo 1 || echo 0)" "$v"
      [ -n "$d" ] || tail -3 "$LOGS/uneven_${what}_$n.log" | cut -c1-300 | tee -a "$SUM"
    done
  done
}

check_equivalence() {
  # shellcheck disable=SC2086  # EQ_ARGS: more flags of tests/gpu/equivalence.py
  step equivalence 900 env GPUS="$GPUS" SHARDTRAIN="$ST" WORK="$LOGS/equivalence.work" \
    bash tests/gpu/run_equivalence.sh "$OUT/equivalence.md" ${EQ_ARGS:-}
  local rc=$?
  verdict "GPU equivalence suite" "$([ $rc = 0 ] && echo 1 || echo 0)" "exit $rc"
  grab_tail equivalence 60
}

check_image_parity() {
  # shellcheck disable=SC2086  # PARITY_ARGS: more flags of bench/image_accuracy_multi_gpu.py
  step image_parity 900 python3 bench/image_accuracy_multi_gpu.py --shardtrain "$ST" --gpus "$GPUS" \
    --out "$OUT/image_parity.json" --markdown "$OUT/image_parity.md" \
    --workdir "$LOGS/image_parity" ${PARITY_ARGS:-}
  local rc=$?
  verdict "image accuracy parity" "$([ $rc = 0 ] && echo 1 || echo 0)" "exit $rc"
  grab_tail image_parity 40
}

wl_checks() {
  local c
  need_gpus 2 || return 0
  for c in ${CHECKS:-nccltest pipelines uneven faults equivalence image-parity}; do
    note "==== check $c $(date -u +%T) on $GPUS GPUs"
    case $c in
      nccltest) check_nccltest ;;
      pipelines) check_pipelines ;;
      faults) check_faults ;;
      uneven) check_uneven ;;
      equivalence) check_equivalence ;;
      image-parity) check_image_parity ;;
      *) note "checks: unknown check $c (nccltest pipelines uneven faults equivalence image-parity)" ;;
    esac
  done
  dry || say "==== checks done $(date -u +%T): $CHECK_FAILS failed"
}
