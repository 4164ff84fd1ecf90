#!/bin/bash
# Peak resident memory of every rank of a CPU run: each rank runs under /usr/bin/time -v, and the
# script prints each rank's "Maximum resident set size" and their sum.
#
# usage: bench/rank_memory.sh RANKS OUT_DIR shardtrain train ARGS...
#   RANKS 1 runs the command directly; more run it under
#   mpirun --oversubscribe --allow-run-as-root -np RANKS (as shardtrain launch --device cpu does).
# Writes OUT_DIR/log.txt (the run's output) and OUT_DIR/rank<R>.txt (time -v of rank R).
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 RANKS OUT_DIR COMMAND ARGS..." >&2
  exit 2
fi
ranks=$1 out=$2
shift 2
mkdir -p "$out"
out=$(cd "$out" && pwd)
wrap=(bash -c 'exec /usr/bin/time -v -o "$0/rank${OMPI_COMM_WORLD_RANK:-0}.txt" "$@"' "$out")
if [ "$ranks" = 1 ]; then
  "${wrap[@]}" "$@" >"$out/log.txt" 2>&1
else
  mpirun --oversubscribe --allow-run-as-root -np "$ranks" "${wrap[@]}" "$@" >"$out/log.txt" 2>&1
fi
grep -H "Maximum resident set size" "$out"/rank*.txt |
  sed -E 's|.*/rank([0-9]+)\.txt:.*: ([0-9]+)|rank \1: \2 kB|'
grep -h "Maximum resident set size" "$out"/rank*.txt |
  awk '{s += $NF} END {printf "sum over %d ranks: %d kB (%.2f GB)\n", NR, s, s / 1e6}'
