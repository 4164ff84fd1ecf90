#!/usr/bin/env bash
# Device calls for issue 10 (ZeRO-3), one H100/H200. Usage: bash bench/device_run_issue10.sh PHASE...
# Before the call, here: cmake --build build && bash bench/pack_device.sh build  (carry: .device)
#   tests     test_cuda_backend, test_hf_parity; `train --model gpt2 --max-steps 20` with dp and
#             with zero3, losses side by side (one GPU: they should be identical); the CPU
#             equivalence test under mpirun -np 2 (dp/zero1/zero2/zero3 vs one rank)
#   bench     bench/bench_zero3_single_gpu.py: zero3 vs dp on gpt2-medium mb 4 and 16, gpt2-large
#             mb 2, gpt2-xl mb 2 (× 512), then FSDP2 (reshard_after_forward=True) on the same
#             shapes while the budget lasts (FSDP_CASES=none to skip them)
#   fsdp      the tutorial's ZeRO-3 row: gpt2-large batch 2, 1000 samples × 512, one epoch, with
#             zero3, dp and PyTorch FSDP2: epoch time, tokens/s, peak memory
#   donewhen  the issue's Done-when command (gpt2-large, zero3, one epoch of 1000 samples × 512),
#             log in $OUT/donewhen.log, loss lines shown
#   all       tests donewhen fsdp bench, in that order (about 7-9 min on an H100; the bench's budget
#             shrinks to what is left of DEADLINE)
# Every timeout is capped by what is left of DEADLINE (default 570 s from the start), so the call
# ends inside the device tool's 10 minutes with the summaries printed. Back in $OUT (at most 8
# files): summary.txt (printed last), bench.json, fsdp.json, donewhen.log, logs.tgz (all logs and
# metrics.jsonl files), gpu.txt.
source bench/device_env.sh
export PYTHONUNBUFFERED=1
T0=$(date +%s)
DEADLINE=${DEADLINE:-570}
LOGS=/tmp/i10logs
mkdir -p $LOGS
SUM=$OUT/summary.txt
ST=.device/shardtrain
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
# cap SECONDS: the smaller of SECONDS and what is left of the deadline minus 15 s (at least 5)
cap() { local l=$(( $(left) - 15 )); [ $l -lt 5 ] && l=5; [ $1 -lt $l ] && echo $1 || echo $l; }
say() { echo "$@" | tee -a $SUM; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
  head -2 .device/MANIFEST 2>/dev/null; } | tee $OUT/gpu.txt
ldd $ST | grep "not found" && echo "warning: $ST still lacks libraries (above)"

# side-by-side losses of two metrics.jsonl files (dp first)
losses_side_by_side() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
def load(p):
    try:
        recs = [json.loads(l) for l in open(p) if l.strip()]
    except OSError as e:
        return {}, {}, str(e)
    steps = {r["step"]: r for r in recs if "loss" in r and "step" in r}
    epoch = [r for r in recs if "peak_memory_bytes" in r]
    return steps, (epoch[-1] if epoch else {}), None
(a, ea, erra), (b, eb, errb) = load(sys.argv[1]), load(sys.argv[2])
if erra or errb:
    print("no losses to compare:", erra or "", errb or ""); sys.exit(0)
print(f"{'step':>5} {'dp loss':>12} {'zero3 loss':>12} {'|diff|':>10} {'dp gnorm':>10} {'z3 gnorm':>10}")
worst = 0.0
for s in sorted(set(a) | set(b)):
    la, lb = a.get(s, {}).get("loss"), b.get(s, {}).get("loss")
    d = abs(la - lb) if la is not None and lb is not None else float("nan")
    worst = max(worst, d) if d == d else worst
    f = lambda x: f"{x:12.6f}" if x is not None else f"{'-':>12}"
    g = lambda r: f"{r['grad_norm']:10.4f}" if "grad_norm" in r else f"{'-':>10}"
    print(f"{s:5d} {f(la)} {f(lb)} {d:10.2e} {g(a.get(s, {}))} {g(b.get(s, {}))}")
same = set(a) == set(b) and all(a[s]["loss"] == b[s]["loss"] for s in a)
gib = lambda e, k: f"{e[k] / 2**30:.2f} GiB" if e.get(k) else "-"
print(f"losses identical: {'yes' if same else 'no'} (max |diff| {worst:.3e} over {len(set(a) & set(b))} steps);"
      f" peak allocated dp {gib(ea, 'device_peak_allocated_bytes')}, zero3 {gib(eb, 'device_peak_allocated_bytes')};"
      f" reserved dp {gib(ea, 'device_peak_reserved_bytes')}, zero3 {gib(eb, 'device_peak_reserved_bytes')}")
EOF
}

phases=("$@")
[ "${phases[*]}" = all ] && phases=(tests donewhen fsdp bench)
for phase in "${phases[@]}"; do
  echo "==== $phase ($(left) s left)"
  case $phase in
    tests)
      timeout $(cap 150) .device/test_cuda_backend > $LOGS/test_cuda_backend.log 2>&1
      say "test_cuda_backend rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' $LOGS/test_cuda_backend.log | tr '\n' ' ')"
      grep -E "^\[  FAILED  \]" $LOGS/test_cuda_backend.log | head -10
      timeout $(cap 60) .device/test_hf_parity > $LOGS/test_hf_parity.log 2>&1
      say "test_hf_parity rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' $LOGS/test_hf_parity.log | tr '\n' ' ')"
      for s in dp zero3; do
        timeout $(cap 90) $ST train --model gpt2 --dataset wikitext-2 --strategy $s --max-steps 20 \
          --device cuda --log-interval 1 --no-save --eval-samples 64 --output-dir /tmp/i10_$s \
          > $LOGS/smoke_$s.log 2>&1
        say "gpt2 20 steps --strategy $s: rc=$? $(grep -E '^error|^done' $LOGS/smoke_$s.log | head -2 | tr '\n' ' ')"
      done
      losses_side_by_side /tmp/i10_dp/metrics.jsonl /tmp/i10_zero3/metrics.jsonl | tee $LOGS/smoke_losses.txt
      tail -1 $LOGS/smoke_losses.txt >> $SUM
      if command -v mpirun > /dev/null; then
        OMP_NUM_THREADS=4 timeout $(cap 150) mpirun --allow-run-as-root --bind-to none -np 2 \
          .device/test_zero_equivalence > $LOGS/test_zero_equivalence.log 2>&1
        say "test_zero_equivalence (CPU, 2 ranks) rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' $LOGS/test_zero_equivalence.log | head -2 | tr '\n' ' ')"
        grep -E "^\[  FAILED  \]" $LOGS/test_zero_equivalence.log | head -10
      else
        say "test_zero_equivalence: no mpirun here, not run"
      fi ;;
    bench)
      b=$(cap ${BENCH_BUDGET:-520})
      timeout $((b + 40)) python3 bench/bench_zero3_single_gpu.py --shardtrain $ST \
        --cases medium4,medium16,large2,xl2 --frameworks dp,zero3,fsdp2 --fsdp-cases ${FSDP_CASES:-all} \
        --budget $b --out $OUT/bench.json --workdir /tmp/i10_bench > $LOGS/bench.log 2>&1
      echo "bench exit $?" | tee -a $SUM
      grep -E "^(error|warning):" $LOGS/bench.log | cut -c1-240 | head -8 | tee -a $SUM
      sed -n '/^zero3 vs dp/,$p' $LOGS/bench.log >> $SUM ;;  # the tables: in the summary below
    fsdp)
      b=$(cap ${FSDP_BUDGET:-520})
      timeout $((b + 40)) python3 bench/bench_zero3_single_gpu.py --shardtrain $ST \
        --cases tutorial --frameworks zero3,dp,fsdp2 --fsdp-cases tutorial \
        --budget $b --out $OUT/fsdp.json --workdir /tmp/i10_fsdp > $LOGS/fsdp.log 2>&1
      echo "fsdp exit $?" | tee -a $SUM
      grep -E "^(error|warning):" $LOGS/fsdp.log | cut -c1-240 | head -8 | tee -a $SUM
      sed -n '/^zero3 vs dp/,$p' $LOGS/fsdp.log >> $SUM ;;  # the tables: in the summary below
    donewhen)
      start=$(date +%s)
      timeout $(cap 240) $ST train --model gpt2-large --dataset wikitext-2 --strategy zero3 \
        --batch-size 2 --max-length 512 --num-samples 1000 --epochs 1 --output-dir /tmp/i10_donewhen \
        > $OUT/donewhen.log 2>&1
      say "Done-when (gpt2-large zero3, 1000 x 512, batch 2, one epoch): rc=$? in $(( $(date +%s) - start )) s"
      grep -E "step +(1|10|100|250|400|500)/|^epoch 1 \||validation|^done|error|saved" $OUT/donewhen.log \
        | head -14 | tee -a $SUM
      du -sh /tmp/i10_donewhen 2>/dev/null | tee -a $SUM
      cp /tmp/i10_donewhen/metrics.jsonl $LOGS/donewhen_metrics.jsonl 2>/dev/null ;;
    *) echo "unknown phase $phase (tests bench fsdp donewhen all)" ;;
  esac
done
# everything else as one archive: the tool brings back at most 8 files
for d in /tmp/i10_dp /tmp/i10_zero3; do [ -f $d/metrics.jsonl ] && cp $d/metrics.jsonl $LOGS/$(basename $d)_metrics.jsonl; done
tar czf $OUT/logs.tgz -C /tmp i10logs $(cd /tmp && ls -d i10_bench i10_fsdp 2>/dev/null) 2>/dev/null
echo; echo "==== summary ($(( $(date +%s) - T0 )) s)"; cat $SUM
