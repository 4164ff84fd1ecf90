#!/usr/bin/env bash
# The measured pipeline bubble of CPU runs (MPI ranks, one per stage) against the simulator's
# prediction for the measured op times of each stage (docs/BENCHMARKS.md, "Pipeline bubble on
# CPU"). Each case trains MODEL (default gpt2-tiny: 4 blocks; 8 for interleaved with 4 stages) on
# WikiText-2 with M = 8 micro-batches of BATCH × LEN tokens (default 8 × 128) for STEPS steps
# (default 6) under --trace, blocks cut by PARTITION (default parameters), and prints the
# trainer's summary of the last step: measured bubble, the simulator's, per-stage utilization.
# Usage: bash bench/pipeline_bubble_cpu.sh SHARDTRAIN OUT_DIR [CASES]
#   CASES: "P:schedule[:V]" items (default: 2 and 4 stages × gpipe 1f1b zb-h1, interleaved V=2)
# THREADS: OpenMP threads per rank (default: shardtrain launch's cores / P). A rank waiting for
# a message busy-polls in MPI and its idle OpenMP threads spin for a while (OMP_WAIT_POLICY), so
# when P × THREADS fills every core the passes' durations depend on which other stages compute at
# the same moment, which no simulator models: leave cores free (e.g. THREADS=2 for 4 stages on
# 16 cores) for a bubble that is the schedule's.
set -u
ST=${1:?usage: pipeline_bubble_cpu.sh SHARDTRAIN OUT_DIR [CASES]}
OUT=${2:?usage: pipeline_bubble_cpu.sh SHARDTRAIN OUT_DIR [CASES]}
CASES=${3:-"2:gpipe 2:1f1b 2:zb-h1 2:interleaved-1f1b:2 4:gpipe 4:1f1b 4:zb-h1 4:interleaved-1f1b:2"}
# Open MPI moves a large message between two processes of one host without the sender's help
# only with a single-copy mechanism (CMA: the receiver reads the sender's memory). Containers
# often turn it off (OMPI_MCA_btl_vader_single_copy_mechanism=none); then each transfer waits
# for the sender's next MPI call and the measured bubble grows by about one pass per transfer.
export OMPI_MCA_btl_vader_single_copy_mechanism=${SINGLE_COPY:-cma}
STEPS=${STEPS:-6}
MODEL=${MODEL:-gpt2-tiny}
BATCH=${BATCH:-8}
LEN=${LEN:-128}
PARTITION=${PARTITION:-parameters}
mkdir -p "$OUT"
# gpt2-tiny's shape with 8 blocks (interleaving 4 stages × 2 chunks needs 8)
cat > "$OUT/gpt2-tiny-8.json" <<'JSON'
{"n_layer": 8, "n_embd": 128, "n_head": 4, "n_positions": 1024, "vocab_size": 50257}
JSON
for c in $CASES; do
  IFS=: read -r P S V <<< "$c"
  V=${V:-1}
  name="p${P}_${S}_v${V}"
  model=$MODEL
  [ "$MODEL" = gpt2-tiny ] && [ "$V" -gt 1 ] && [ "$P" -gt 2 ] && model="$OUT/gpt2-tiny-8.json"
  extra=()
  [ "$V" -gt 1 ] && extra=(--virtual-stages "$V")
  echo "==== $P stages, $S, V=$V ($model)"
  threads=()
  [ -n "${THREADS:-}" ] && threads=(OMP_NUM_THREADS="$THREADS" OMP_WAIT_POLICY=passive)
  env -u OMP_NUM_THREADS "${threads[@]}" "$ST" launch --nproc-per-node "$P" --device cpu -- train --model "$model" \
    --dataset wikitext-2 --strategy pipeline --pipeline-stages "$P" --pipeline-schedule "$S" \
    "${extra[@]}" --gradient-accumulation-steps 8 --batch-size "$BATCH" --max-length "$LEN" \
    --partition-method "$PARTITION" \
    --max-steps "$STEPS" --log-interval "$STEPS" --eval-samples 8 --no-save \
    --trace "$OUT/$name" --output-dir "$OUT/$name-run" > "$OUT/$name.log" 2>&1
  echo "exit $?"
  grep -E "measured bubble|  stage +[0-9]+:|partial" "$OUT/$name.log"
done
