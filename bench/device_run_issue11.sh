#!/usr/bin/env bash
# Device calls for issue 11 (ZeRO-Offload / ZeRO-Infinity), one H100/H200.
# Usage: bash bench/device_run_issue11.sh PHASE...
# Before the call, here: cmake --build build --target shardtrain bench_host_limits test_cuda_backend
#   && bash bench/pack_device.sh build   (carry: .device; bench_host_limits travels by default)
#   limits    .device/bench_host_limits (STREAM copy/triad, pinned H2D/D2H/both, shardtrain's CPU
#             AdamW on ADAMW_N elements (default 200M), O_DIRECT write/read on NVME_PATH) and
#             bench/bench_cpu_adamw.py (torch.optim.AdamW foreach/fused, same shard) -> limits.json;
#             dd oflag=direct / iflag=direct on NVME_PATH as a cross-check
#   tests     every carried .device/test_* that runs on one GPU (test_nccl_comm needs two,
#             test_zero_equivalence mpirun: both left out), gtest PASSED/FAILED lines
#   donewhen  the issue's Done-when commands (gpt2-large, 1000 samples × 512, batch 2, one epoch):
#             --strategy offload; --deepspeed-config bench/configs/ds_stage3_cpu_offload.json;
#             --deepspeed-config bench/configs/ds_infinity_nvme.json (NVMe under /tmp/nvme_offload).
#             DW="offload stage3 infinity" picks them (one or two per call fit the 10 minutes)
#   bench     bench/bench_offload.py --cases BENCH_CASES (default tutorial; then a second call
#             with BENCH_CASES=xl2,xl16) with offload, offload-dpu, zero2, fsdp2-offload
#             (+ EXTRA_FW, e.g. offload-r50,zero3-offload,infinity)
#   sweep     bench/bench_offload.py --cases sweep2,sweep4,sweep8,sweep16 (DPU vs zero2 vs exact)
#   largest   bench/bench_offload.py --largest --shapes SHAPES (default 7.3B and 12.2B) with
#             LARGEST_FW (default offload,offload-dpu,zero3-offload,infinity), 10 steps each
#   all       limits tests donewhen bench, in that order, while DEADLINE lasts (the rest: more calls)
# Every timeout is capped by what is left of DEADLINE (default 570 s from the start), so the call
# ends inside the device tool's 10 minutes with the summaries printed. OMP_NUM_THREADS defaults to
# the machine's cores here (the CPU AdamW is bandwidth-bound). Back in $OUT (at most 8 files):
# summary.txt (printed last), gpu.txt, limits.json, bench.json, sweep.json, largest.json,
# donewhen.log, logs.tgz (all logs and metrics.jsonl files).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
source bench/device_env.sh
export PYTHONUNBUFFERED=1
T0=$(date +%s)
DEADLINE=${DEADLINE:-570}
LOGS=/tmp/i11logs
NVME=${NVME_PATH:-/tmp/nvme_offload}
mkdir -p $LOGS "$NVME"
SUM=$OUT/summary.txt
ST=.device/shardtrain
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
# cap SECONDS: the smaller of SECONDS and what is left of the deadline minus 15 s (at least 5)
cap() { local l=$(( $(left) - 15 )); [ $l -lt 5 ] && l=5; [ $1 -lt $l ] && echo $1 || echo $l; }
say() { echo "$@" | tee -a $SUM; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
  echo "cpu: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -1); OMP_NUM_THREADS=$OMP_NUM_THREADS"
  free -g | sed -n 2p | awk '{print "host memory: " $2 " GiB"}'
  echo "nvme path $NVME: $(df -h "$NVME" | tail -1) ($(findmnt -n -o FSTYPE -T "$NVME" 2>/dev/null))"
  head -2 .device/MANIFEST 2>/dev/null; } | tee $OUT/gpu.txt
ldd $ST | grep "not found" && echo "warning: $ST still lacks libraries (above)"

# the issue's Done-when run $1 (offload | stage3 | infinity)
donewhen() {
  local what=$1 out=/tmp/i11_dw_$1 args start
  case $what in
    offload) args=(--strategy offload) ;;
    stage3) args=(--deepspeed-config bench/configs/ds_stage3_cpu_offload.json) ;;
    infinity) mkdir -p /tmp/nvme_offload; args=(--deepspeed-config bench/configs/ds_infinity_nvme.json) ;;
    *) say "donewhen: unknown run $what (offload stage3 infinity)"; return ;;
  esac
  start=$(date +%s)
  rm -rf $out
  echo "==== Done-when $what: ${args[*]}" >> $OUT/donewhen.log
  timeout $(cap ${DW_TIMEOUT:-400}) $ST train --model gpt2-large --dataset wikitext-2 "${args[@]}" \
    --batch-size 2 --max-length 512 --num-samples 1000 --epochs 1 --output-dir $out \
    > $LOGS/donewhen_$what.log 2>&1
  say "Done-when $what (gpt2-large, ${args[*]}, 1000 x 512, batch 2, one epoch): rc=$? in $(( $(date +%s) - start )) s"
  cat $LOGS/donewhen_$what.log >> $OUT/donewhen.log
  grep -E "step +(1|10|100|250|400|500)/|^epoch 1 \||validation|^done|error|saved|host|nvme" \
    $LOGS/donewhen_$what.log | head -14 | tee -a $SUM
  [ -f $out/metrics.jsonl ] && python3 - $out/metrics.jsonl <<'EOF' | tee -a $SUM
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
e = [r for r in recs if "peak_memory_bytes" in r]
cpu = [r["cpu_step_ms"] for r in recs if r.get("cpu_step_ms") is not None]
g = lambda k: f"{e[-1][k] / 2**30:.2f} GiB" if e and e[-1].get(k) is not None else "-"
print(f"  peak GPU {g('device_peak_allocated_bytes')} (reserved {g('device_peak_reserved_bytes')}),"
      f" host pinned {g('host_pinned_bytes')}, pageable {g('host_pageable_bytes')}, NVMe {g('nvme_bytes')},"
      f" epoch {e[-1]['time_s']:.1f} s" if e else "  no epoch record",
      f"cpu step {sum(cpu) / len(cpu):.1f} ms" if cpu else "")
EOF
  du -sh $out /tmp/nvme_offload 2>/dev/null | tee -a $SUM
  cp $out/metrics.jsonl $LOGS/donewhen_${what}_metrics.jsonl 2>/dev/null
}

# bench/bench_offload.py with its budget capped; $1: the JSON's name in $OUT, the rest its flags
offload_bench() {
  local name=$1 b
  shift
  b=$(cap ${BENCH_BUDGET:-520})
  timeout $((b + 40)) python3 bench/bench_offload.py --shardtrain $ST --budget $b \
    --nvme-path "$NVME" --out $OUT/$name.json --workdir /tmp/i11_$name "$@" > $LOGS/$name.log 2>&1
  echo "$name exit $?" | tee -a $SUM
  grep -E "^(error|warning|note):" $LOGS/$name.log | cut -c1-240 | head -10 | tee -a $SUM
  sed -n '/^### /,$p' $LOGS/$name.log >> $SUM  # the tables: in the summary below
}

phases=("$@")
[ "${phases[*]}" = all ] && phases=(limits tests donewhen bench)
for phase in "${phases[@]}"; do
  echo "==== $phase ($(left) s left)"
  case $phase in
    limits)
      HL=.device/bench_host_limits
      [ -x $HL ] || HL=$(ls build/bench_host_limits 2>/dev/null)
      if [ -n "$HL" ]; then
        timeout $(cap 180) $HL --adamw-elements ${ADAMW_N:-200000000} --disk-path "$NVME" \
          --disk-mib ${DISK_MIB:-4096} > $LOGS/limits_host.json 2> $LOGS/limits_host.err
        say "bench_host_limits rc=$?"; cat $LOGS/limits_host.err | tee -a $SUM
      else
        say "bench_host_limits: not carried (bash bench/pack_device.sh with a CUDA build)"
      fi
      timeout $(cap 180) python3 bench/bench_cpu_adamw.py --elements ${ADAMW_N:-200000000} \
        --host-limits-json $LOGS/limits_host.json --out $OUT/limits.json > $LOGS/limits.log 2>&1
      echo "bench_cpu_adamw exit $?" | tee -a $SUM
      sed -n '/^| CPU AdamW/,$p' $LOGS/limits.log | tee -a $SUM
      # dd as a cross-check of the O_DIRECT numbers (one thread, 1 MiB blocks)
      f="$NVME/dd_check.bin"
      w=$(timeout $(cap 60) dd if=/dev/zero of="$f" bs=1M count=${DD_MIB:-2048} oflag=direct conv=fsync 2>&1 | tail -1)
      r=$(timeout $(cap 60) dd if="$f" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1)
      rm -f "$f"
      say "dd on $NVME: write: $w"
      say "dd on $NVME: read:  $r" ;;
    tests)
      for t in .device/test_*; do
        [ -x "$t" ] || continue
        case $(basename $t) in test_nccl_comm|test_zero_equivalence) continue ;; esac
        timeout $(cap 150) $t > $LOGS/$(basename $t).log 2>&1
        say "$(basename $t) rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' $LOGS/$(basename $t).log | tr '\n' ' ')"
        grep -E "^\[  FAILED  \]" $LOGS/$(basename $t).log | head -10
      done ;;
    donewhen)
      for w in ${DW:-offload stage3 infinity}; do donewhen $w; done ;;
    bench)
      offload_bench bench --cases ${BENCH_CASES:-tutorial} ${EXTRA_FW:+--extra-frameworks $EXTRA_FW} ;;
    sweep)
      offload_bench sweep --cases ${SWEEP_CASES:-sweep2,sweep4,sweep8,sweep16} ;;
    largest)
      offload_bench largest --cases none --largest ${SHAPES:+--shapes $SHAPES} \
        --largest-frameworks ${LARGEST_FW:-offload,offload-dpu,zero3-offload,infinity} ;;
    *) echo "unknown phase $phase (limits tests donewhen bench sweep largest all)" ;;
  esac
done
# everything else as one archive: the tool brings back at most 8 files
tar czf $OUT/logs.tgz --exclude='*.bin' -C /tmp i11logs \
  $(cd /tmp && ls -d i11_bench i11_sweep i11_largest 2>/dev/null) 2>/dev/null
rm -rf "$NVME"/*_infinity 2>/dev/null  # bench_offload.py's swap folders
echo; echo "==== summary ($(( $(date +%s) - T0 )) s)"; cat $SUM
