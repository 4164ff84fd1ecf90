#!/usr/bin/env bash
# The measured pipeline bubble of CPU runs (MPI ranks, one per stage) against the simulator's
# prediction for the measured op times of each stage (docs/BENCHMARKS.md, "Pipeline bubble on
# CPU"). Each case trains gpt2-tiny (4 blocks; 8 for interleaved with 4 stages) on WikiText-2
# with M = 8 micro-batches of 8 × 128 tokens for STEPS steps under --trace, and prints the
# trainer's summary of the last step: measured bubble, the simulator's, per-stage utilization.
# Usage: bash bench/pipeline_bubble_cpu.sh SHARDTRAIN OUT_DIR [CASES]
#   CASES: "P:schedule[:V]" items (default: 2 and 4 stages × gpipe 1f1b zb-h1, interleaved V=2)
# The ranks share the machine's cores (shardtrain launch gives each cores / P threads): run it
# where P ranks do not oversubscribe the cores, or the passes' durations depend on which other
# stages compute at the same moment, which no simulator models.
set -u
ST=${1:?usage: pipeline_bubble_cpu.sh SHARDTRAIN OUT_DIR [CASES]}
OUT=${2:?usage: pipeline_bubble_cpu.sh SHARDTRAIN OUT_DIR [CASES]}
CASES=${3:-"2:gpipe 2:1f1b 2:zb-h1 2:interleaved-1f1b:2 4:gpipe 4:1f1b 4:zb-h1 4:interleaved-1f1b:2"}
STEPS=${STEPS:-6}
mkdir -p "$OUT"
# gpt2-tiny's shape with 8 blocks (interleaving 4 stages × 2 chunks needs 8)
cat > "$OUT/gpt2-tiny-8.json" <<'JSON'
{"n_layer": 8, "n_embd": 128, "n_head": 4, "n_positions": 1024, "vocab_size": 50257}
JSON
for c in $CASES; do
  IFS=: read -r P S V <<< "$c"
  V=${V:-1}
  name="p${P}_${S}_v${V}"
  model=gpt2-tiny
  [ "$V" -gt 1 ] && [ "$P" -gt 2 ] && model="$OUT/gpt2-tiny-8.json"
  extra=()
  [ "$V" -gt 1 ] && extra=(--virtual-stages "$V")
  echo "==== $P stages, $S, V=$V ($model)"
  env -u OMP_NUM_THREADS "$ST" launch --nproc-per-node "$P" --device cpu -- train --model "$model" \
    --dataset wikitext-2 --strategy pipeline --pipeline-stages "$P" --pipeline-schedule "$S" \
    "${extra[@]}" --gradient-accumulation-steps 8 --batch-size 8 --max-length 128 \
    --max-steps "$STEPS" --log-interval "$STEPS" --eval-samples 8 --no-save \
    --trace "$OUT/$name" --output-dir "$OUT/$name-run" > "$OUT/$name.log" 2>&1
  echo "exit $?"
  grep -E "measured bubble|  stage +[0-9]+:|partial" "$OUT/$name.log"
done
