#!/usr/bin/env bash
# Sourced by the bench/device_run_issue*.sh scripts on the GPU machine: makes the carried build
# runnable (device_env.sh), and sets OUT (what comes back), SUM ($OUT/summary.txt), ST (the
# binary), LOGS (long logs, tarred into $OUT by the caller) and say() (echo into the summary);
# prints the GPU and CPU into the summary; run_gtest() runs a carried test program. LOGS_NAME names the logs folder (default logs).
source bench/device_env.sh
OUT=${OUT:-/tmp/out}
SUM=$OUT/summary.txt
ST=$PWD/.device/shardtrain
LOGS=/tmp/${LOGS_NAME:-logs}
mkdir -p "$LOGS" "$OUT"
say() { echo "$@" | tee -a "$SUM"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; date -u
  echo "cpu: $(nproc --all) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -1)"; } | tee -a "$SUM"
# run_gtest PROGRAM [PATTERN]: runs .device/PROGRAM (5 minutes at most) with its log in $LOGS,
# says its exit status and GoogleTest's totals, and copies the log's lines matching PATTERN
# (default FAILED) into the summary.
run_gtest() {
  timeout 300 ".device/$1" > "$LOGS/$1.log" 2>&1
  say "$1 exit $?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$LOGS/$1.log" | tr '\n' ' ')"
  grep -E "${2:-FAILED}" "$LOGS/$1.log" | head -30 | tee -a "$SUM"
}
