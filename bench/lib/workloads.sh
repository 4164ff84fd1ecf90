# shellcheck shell=bash
# The workloads of bench/run.sh, one function each (wl_NAME; NAME with '-' as '_'). Sourced after
# bench/lib/prelude.sh; bench/run.sh's header says what each measures and which variables set it.
# Every command goes through step/step_out (bench/lib/prelude.sh), so --dry-run prints them all.

peers() { [ "${PEERS:-torch}" = torch ]; }
# bench/pack_build.sh's default TESTS (what a dry run of `tests` lists without a packed build)
PACK_DEFAULT_TESTS="test_cuda_backend test_cuda_model test_hf_parity test_nccl_comm test_zero_equivalence"
# need_gpus N: true when GPUS >= N, else says the workload is skipped
need_gpus() {
  [ "$GPUS" -ge "$1" ] && return 0
  note "$WORKLOAD: needs $1 GPUs or more ($GPUS here): skipped"
  return 1
}
# budget SECONDS: a harness's --budget (capped by DEADLINE); its step gets 60 s more
budget() { cap "$1"; }
nvme_dir() { dry || mkdir -p "$NVME_PATH"; }
NVME_PATH=${NVME_PATH:-/tmp/nvme_offload}

# ---- limits --------------------------------------------------------------------------------------
wl_limits() {
  local hl=$PACKED_ABS/bench_host_limits threads=${USER_OMP:-$NCORES} f=$NVME_PATH/dd_check.bin
  nvme_dir
  if [ -x "$hl" ] || dry; then
    step_out host_limits 240 "$LOGS/host_limits.json" env OMP_NUM_THREADS="$threads" "$hl" \
      --adamw-elements "${ADAMW_N:-200000000}" --disk-path "$NVME_PATH" --disk-mib "${DISK_MIB:-4096}"
    say "bench_host_limits exit $? ($threads threads)"
    grab host_limits '^[^+]' 40
    dry || cp "$LOGS/host_limits.json" "$OUT/host_limits.json"
    if peers; then
      step cpu_adamw 240 env OMP_NUM_THREADS="$threads" python3 bench/bench_cpu_adamw.py \
        --elements "${ADAMW_N:-200000000}" --host-limits-json "$LOGS/host_limits.json" \
        --out "$OUT/limits.json"
      say "bench_cpu_adamw.py exit $? (torch.optim.AdamW foreach and fused on the same shard)"
      grab_from cpu_adamw '^\| CPU AdamW'
    fi
  else
    say "bench_host_limits: not packed (bench/pack_build.sh carries it from a CUDA build by default)"
  fi
  # dd as a cross-check of the O_DIRECT figures (one thread, 1 MiB blocks)
  step dd_write 90 dd if=/dev/zero of="$f" bs=1M count="${DD_MIB:-2048}" oflag=direct conv=fsync
  step dd_read 90 dd if="$f" of=/dev/null bs=1M iflag=direct
  dry || { rm -f "$f"; say "dd on $NVME_PATH: write: $(tail -1 "$LOGS/dd_write.log")"
           say "dd on $NVME_PATH: read:  $(tail -1 "$LOGS/dd_read.log")"; }
  if [ "$GPUS" -ge 2 ]; then  # NCCL bus bandwidth of the GPUs, measured through PyTorch
    step bus $(( $(budget 300) + 60 )) python3 bench/bench_multi_gpu.py --shardtrain "$ST" \
      --gpus "$GPUS" --suite bus --budget "$(budget 300)" --out "$OUT/bus.json" \
      --workdir "$LOGS/bus" "${COMMIT_ARGS[@]}"
    say "NCCL bus bandwidth ($GPUS GPUs) exit $?"
    grab_tail bus 12
  fi
}

# ---- tests ---------------------------------------------------------------------------------------
wl_tests() {
  local t name progs=() cs rc
  if [ -n "${TEST_PROGRAMS:-}" ]; then
    for t in $TEST_PROGRAMS; do progs+=("$PACKED_ABS/$t"); done
  else
    progs=("$PACKED_ABS"/test_*)
    # a dry run without a packed build: bench/pack_build.sh's default TESTS
    [ -e "${progs[0]}" ] || ! dry || for t in $PACK_DEFAULT_TESTS; do progs+=("$PACKED_ABS/$t"); done
  fi
  for t in "${progs[@]}"; do
    name=$(basename "$t")
    [ -x "$t" ] || dry || { [ "$name" = "test_*" ] || say "$name: not packed"; continue; }
    [ "$name" != "test_*" ] || continue
    case $name in
      test_nccl_comm)
        if [ "$GPUS" -ge 2 ]; then
          step test_nccl_comm 300 env SHARDTRAIN_COMM_TIMEOUT=60 "${MPIRUN[@]}" -np "$GPUS" "$t"
          rc=$?
          say "test_nccl_comm ($GPUS ranks) exit $rc: $(gtest_totals test_nccl_comm)"
          grab test_nccl_comm '^\[  FAILED  \] [A-Za-z]' 20
        else
          note "test_nccl_comm: needs 2 GPUs, left out"
        fi ;;
      test_zero_equivalence)  # CPU ranks: every strategy against one rank
        step test_zero_equivalence 300 env OMP_NUM_THREADS=4 "${MPIRUN[@]}" -np 2 "$t"
        rc=$?
        say "test_zero_equivalence (CPU, 2 ranks) exit $rc: $(gtest_totals test_zero_equivalence)"
        grab test_zero_equivalence '^\[  FAILED  \] [A-Za-z]' 20 ;;
      *) run_gtest "$name" ;;
    esac
  done
  # compute-sanitizer on the fused attention kernels (memcheck, racecheck)
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ "${SANITIZE:-1}" = 1 ] && { [ -x "$PACKED_ABS/test_cuda_model" ] || dry; }; then
    if [ -x "$cs" ] || dry; then
      step memcheck 300 "$cs" --tool memcheck "$PACKED_ABS/test_cuda_model" --gtest_filter='*Flash*'
      say "compute-sanitizer memcheck exit $?"; grab_tail memcheck 2
      step racecheck 300 "$cs" --tool racecheck "$PACKED_ABS/test_cuda_model" \
        --gtest_filter='*FlashAttentionTest.ForwardBackward*'
      say "compute-sanitizer racecheck exit $?"; grab_tail racecheck 2
    else
      note "compute-sanitizer: not found here, not run"
    fi
  fi
}

# ---- single-gpu ----------------------------------------------------------------------------------
wl_single_gpu() {
  local p cases=${SG_CASES:-medium16,tutorial,xl2,xl16ac} list=(none)
  peers && read -r -a list <<< "${SG_PEERS:-eager compile}"
  for p in "${list[@]}"; do
    local fw=shardtrain
    [ "$p" = none ] || fw=shardtrain,$p
    step "single_gpu_$p" 600 python3 bench/bench_single_gpu.py --shardtrain "$ST" --cases "$cases" \
      --frameworks "$fw" --out "$OUT/single_gpu_$p.json" --workdir "$LOGS/single_gpu_$p"
    say "single-gpu ($fw) exit $?"
    grab_tail "single_gpu_$p" 14
  done
}

# ---- dropout -------------------------------------------------------------------------------------
wl_dropout() {
  local p fw=shardtrain
  peers && fw=shardtrain,eager,compile
  for p in ${DROPOUT_RATES:-0 0.1}; do
    step "dropout_$p" 400 python3 bench/bench_single_gpu.py --shardtrain "$ST" \
      --cases "${DROPOUT_CASES:-medium16}" --frameworks "$fw" --dropout "$p" \
      --out "$OUT/dropout_$p.json" --workdir "$LOGS/dropout_$p"
    say "dropout $p exit $?"
    grab_tail "dropout_$p" 8
  done
}

# ---- strategies ----------------------------------------------------------------------------------
wl_strategies() {
  local common=(--models "${COMPARE_MODELS:-gpt2-medium}" --batch-sizes "${COMPARE_BATCH:-4}"
                --gpus "${COMPARE_GPUS:-1}")
  step compare 1200 "$ST" compare "${common[@]}" \
    --strategies "${COMPARE_STRATEGIES:-dp,zero1,zero2,zero3,offload}" -o "$LOGS/compare" \
    -- --eval-samples 64
  say "compare exit $?"
  grab_tail compare 15
  dry || { cp "$LOGS/compare/report.json" "$OUT/compare.json" 2>/dev/null
           cp "$LOGS/compare/report.md" "$OUT/compare.md" 2>/dev/null
           tar -C "$LOGS" -czf "$OUT/compare.tgz" compare; }
  # ZeRO-Infinity on fewer samples: each step moves 12 bytes per parameter in and out of the disk
  if [ "${COMPARE_INFINITY_SAMPLES:-48}" != 0 ]; then
    nvme_dir
    step compare_infinity 600 "$ST" compare "${common[@]}" --strategies infinity \
      --num-samples "${COMPARE_INFINITY_SAMPLES:-48}" --nvme-path "$NVME_PATH" \
      -o "$LOGS/compare_infinity" -- --eval-samples 64
    say "compare infinity exit $?"
    grab_tail compare_infinity 8
    dry || { cp "$LOGS/compare_infinity/report.json" "$OUT/compare_infinity.json" 2>/dev/null
             tar -C "$LOGS" -czf "$OUT/compare_infinity.tgz" compare_infinity; }
  fi
}

# ---- zero3 ---------------------------------------------------------------------------------------
wl_zero3() {
  local b fw=dp,zero3 fsdp=none tut_fw=zero3,dp tut_fsdp=none
  b=$(budget "${Z3_BUDGET:-520}")
  peers && { fw=dp,zero3,fsdp2; fsdp=all; tut_fw=zero3,dp,fsdp2; tut_fsdp=tutorial; }
  # the tutorial's ZeRO-3 row: gpt2-large batch 2, 1000 samples x 512, one epoch
  step zero3_tutorial $((b + 60)) python3 bench/bench_zero3_single_gpu.py --shardtrain "$ST" \
    --cases tutorial --frameworks "$tut_fw" --fsdp-cases "$tut_fsdp" \
    --budget "$b" --out "$OUT/zero3_tutorial.json" --workdir "$LOGS/zero3_tutorial"
  say "zero3 tutorial exit $?"
  grab zero3_tutorial '^(error|warning):' 8
  grab_from zero3_tutorial '^zero3 vs dp'
  b=$(budget "${Z3_BUDGET:-520}")
  step zero3_shapes $((b + 60)) python3 bench/bench_zero3_single_gpu.py --shardtrain "$ST" \
    --cases "${Z3_CASES:-medium4,medium16,large2,xl2}" --frameworks "$fw" --fsdp-cases "$fsdp" \
    --budget "$b" --out "$OUT/zero3.json" --workdir "$LOGS/zero3_shapes"
  say "zero3 shapes exit $?"
  grab zero3_shapes '^(error|warning):' 8
  grab_from zero3_shapes '^zero3 vs dp'
}

# ---- offload -------------------------------------------------------------------------------------
# one epoch of the tutorial's gpt2-large (batch 2, 1000 samples x 512) with $1: offload (ZeRO-Offload,
# stage 2), stage3 (optimizer and parameters on the CPU), infinity (both on NVMe)
offload_run() {
  local what=$1 args out=$LOGS/offload_run_$1
  case $what in
    offload) args=(--strategy offload) ;;
    stage3) args=(--deepspeed-config bench/configs/ds_stage3_cpu_offload.json) ;;
    infinity) dry || mkdir -p /tmp/nvme_offload  # the config's nvme_path
              args=(--deepspeed-config bench/configs/ds_infinity_nvme.json) ;;
    *) note "offload: unknown run $what (offload stage3 infinity)"; return ;;
  esac
  step "offload_run_$what" "${OFFLOAD_RUN_TIMEOUT:-400}" "$ST" train --model gpt2-large \
    --dataset wikitext-2 --device cuda "${args[@]}" --batch-size 2 --max-length 512 \
    --num-samples 1000 --epochs 1 --no-save --output-dir "$out"
  say "offload run $what (gpt2-large, ${args[*]}, 1000 x 512, batch 2, one epoch) exit $?"
  grab "offload_run_$what" \
    '^epoch 1 (\(partial\) )?\| [0-9]+ steps|step +(1|10|100|500)/|^validation|^done|error|host|nvme' 12
  dry || [ ! -f "$out/metrics.jsonl" ] || python3 - "$out/metrics.jsonl" <<'EOF' | tee -a "$SUM"
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
}
# bench/bench_offload.py NAME FLAGS...: one invocation within OFFLOAD_BUDGET
offload_bench() {
  local name=$1 b
  shift
  b=$(budget "${OFFLOAD_BUDGET:-520}")
  step "$name" $((b + 60)) python3 bench/bench_offload.py --shardtrain "$ST" --budget "$b" \
    --nvme-path "$NVME_PATH" --out "$OUT/$name.json" --workdir "$LOGS/$name" "$@"
  say "$name exit $?"
  grab "$name" '^(error|warning|note):' 10
  grab_from "$name" '^### '
}
wl_offload() {
  local part c i=0 fw_args=()
  local threads=${USER_OMP:-$NCORES}
  local OMP_NUM_THREADS=$threads  # the host AdamW is bound by memory bandwidth: every core
  export OMP_NUM_THREADS
  nvme_dir
  peers || fw_args=(--frameworks "offload,offload-dpu,zero2")
  for part in ${OFFLOAD_PARTS:-runs bench sweep}; do
    case $part in
      runs) for c in ${OFFLOAD_RUNS:-offload stage3 infinity}; do offload_run "$c"; done ;;
      bench)
        for c in ${OFFLOAD_CASES:-tutorial xl2,xl16}; do
          i=$((i + 1))
          offload_bench "offload_$i" --cases "$c" "${fw_args[@]}" \
            ${OFFLOAD_EXTRA_FW:+--extra-frameworks "$OFFLOAD_EXTRA_FW"}
        done ;;
      sweep) offload_bench offload_sweep --cases "${OFFLOAD_SWEEP:-sweep2,sweep4,sweep8,sweep16}" ;;
      largest) offload_bench offload_largest --cases none --largest \
                 ${OFFLOAD_SHAPES:+--shapes "$OFFLOAD_SHAPES"} \
                 --largest-frameworks "${OFFLOAD_LARGEST_FW:-offload,offload-dpu,zero3-offload,infinity}" ;;
      *) note "offload: unknown part $part (runs bench sweep largest)" ;;
    esac
  done
  dry || rm -rf "$NVME_PATH"/*_infinity 2>/dev/null  # bench_offload.py's swap folders
}

# ---- largest-model -------------------------------------------------------------------------------
wl_largest_model() {
  local threads=${USER_OMP:-$NCORES} rows=${LM_ROWS:-gpu,offload,infinity,auto,peer}
  local OMP_NUM_THREADS=$threads  # the CPU AdamW is bound by memory bandwidth: every core
  export OMP_NUM_THREADS
  peers || rows=${rows//,peer/}
  nvme_dir
  step largest_model 1800 python3 bench/largest_model.py --shardtrain "$ST" \
    --limits-bin "$PACKED_ABS/bench_host_limits" --nvme-path "$NVME_PATH" --rows "$rows" \
    --gpus "$GPUS" ${LM_AUTO_SHAPES:+--auto-shapes "$LM_AUTO_SHAPES"} \
    ${LM_AUTO_BATCH:+--auto-batch "$LM_AUTO_BATCH"} --host-memory-gib "${LM_HOST_GIB:-112}" --out "$OUT/largest_model.json" --workdir "$LOGS/largest_model"
  say "largest-model exit $?"
  grab_from largest_model '^| row'
  dry || rm -rf "$NVME_PATH"/shardtrain-swap-* "$NVME_PATH"/shardtrain-params-* 2>/dev/null
}

# ---- pipeline ------------------------------------------------------------------------------------
# one-stage pipelines on one GPU against dp on the same batch: the executor's own cost
pipeline_one_stage() {
  local s args
  for s in dp gpipe 1f1b zb-h1 2bw interleaved-1f1b; do
    args=(--strategy pipeline --pipeline-stages 1 --pipeline-schedule "$s")
    [ "$s" = dp ] && args=(--strategy dp)
    [ "$s" = interleaved-1f1b ] && args+=(--virtual-stages 2)
    step "pipeline_1stage_$s" 240 "$ST" train --model gpt2 --dataset wikitext-2 --device cuda \
      "${args[@]}" --batch-size 8 --max-length 512 --gradient-accumulation-steps 8 --max-steps 12 \
      --log-interval 4 --eval-samples 64 --no-save --output-dir "$LOGS/pipeline_1stage_$s"
    local rc=$?
    dry || say "one stage, $s: exit $rc: $(grep -E '^epoch 1 \| step +12/' "$LOGS/pipeline_1stage_$s.log" | tail -1)" \
      "| $(grep -E 'partial' "$LOGS/pipeline_1stage_$s.log" | grep -oE '[0-9]+ tokens/s|peak memory [^(]*' | tr '\n' ' ')"
  done
}
wl_pipeline() {
  local m b s name
  if [ "${PIPE_ONE_STAGE:-auto}" = 1 ] || { [ "${PIPE_ONE_STAGE:-auto}" = auto ] && [ "$GPUS" -lt 2 ]; }; then
    pipeline_one_stage
  fi
  [ "$GPUS" -ge 2 ] || return 0
  for m in ${PIPE_MICRO_BATCHES:-8 16}; do
    if peers; then  # against torch.distributed.pipelining, one stage per GPU
      b=$(budget "${PIPE_BUDGET:-480}")
      # shellcheck disable=SC2086  # PIPE_ARGS: more flags of bench_multi_gpu.py
      step "pipeline_M$m" $((b + 60)) python3 bench/bench_multi_gpu.py --shardtrain "$ST" \
        --gpus "$GPUS" --suite pipeline --pipeline-model "${PIPE_MODEL:-gpt2-xl}" --micro-batches "$m" \
        --svg-dir "$OUT/pipeline_svg" --budget "$b" --out "$OUT/pipeline_M$m.json" \
        --workdir "$LOGS/pipeline_M$m" "${COMMIT_ARGS[@]}" ${PIPE_ARGS:-}
      say "pipeline M=$m ($GPUS stages) exit $?"
      grab_tail "pipeline_M$m" 30
    else  # shardtrain alone: every schedule, traced (measured bubble against the simulator's)
      for s in gpipe 1f1b interleaved-1f1b zb-h1 2bw; do
        local extra=()
        [ "$s" = interleaved-1f1b ] && { [ $((m % GPUS)) = 0 ] || continue; extra=(--virtual-stages 2); }
        [ "$s" = 2bw ] && [ "$m" -lt "$GPUS" ] && continue
        name=pipeline_${s}_M$m
        step "$name" 240 "$ST" launch --nproc-per-node "$GPUS" --comm-timeout 60 -- train \
          --model "${PIPE_MODEL:-gpt2-xl}" --dataset wikitext-2 --strategy pipeline \
          --pipeline-stages "$GPUS" --pipeline-schedule "$s" "${extra[@]}" \
          --gradient-accumulation-steps "$m" --batch-size 4 --max-length 512 --max-steps 6 \
          --log-interval 2 --eval-samples 8 --no-save --trace "$LOGS/$name/trace" \
          --output-dir "$LOGS/$name"
        say "$s M=$m ($GPUS stages) exit $?"
        grab "$name" 'measured bubble|^epoch 1 \| step +6/|partial' 6
      done
    fi
  done
}

# ---- pipeline-cpu --------------------------------------------------------------------------------
wl_pipeline_cpu() {
  # shellcheck disable=SC2086  # PIPE_CPU_CASES: one argument, the script's CASES
  step pipeline_cpu 1800 bash bench/pipeline_bubble_cpu.sh "$ST" "$LOGS/pipeline_cpu" \
    ${PIPE_CPU_CASES:+"$PIPE_CPU_CASES"}
  say "pipeline bubble on CPU ranks exit $?"
  grab pipeline_cpu '^====|^exit|measured bubble|  stage +[0-9]+:|partial' 200
}

# ---- multi-gpu -----------------------------------------------------------------------------------
wl_multi_gpu() {
  local m b name torch=all
  need_gpus 2 || return 0
  peers || torch=none
  for m in ${MG_MODELS:-gpt2-medium gpt2-xl}; do
    for b in ${MG_BATCHES:-4 16}; do
      name=multi_gpu_${m}_mb$b
      local bud
      bud=$(budget "${MG_BUDGET:-500}")
      # shellcheck disable=SC2086  # MG_ARGS: more flags of bench_multi_gpu.py
      step "$name" $((bud + 60)) python3 bench/bench_multi_gpu.py --shardtrain "$ST" --gpus "$GPUS" \
        --suite bus,lm --models "$m" --batches "$b" --pairs "${MG_PAIRS:-dp,zero1,zero2,zero3}" \
        --torch-gpus "$torch" --budget "$bud" --out "$OUT/$name.json" \
        --workdir "$LOGS/$name" "${COMMIT_ARGS[@]}" ${MG_ARGS:-}
      say "multi-gpu $m mb $b ($GPUS GPUs) exit $?"
      grab_tail "$name" 40
    done
  done
}

# ---- comm-trace ----------------------------------------------------------------------------------
wl_comm_trace() {
  local m s name
  need_gpus 2 || return 0
  for m in ${TRACE_MODELS:-gpt2-medium}; do
    for s in ${TRACE_STRATEGIES:-dp zero2 zero3}; do
      name=comm_trace_${s}_$m
      dry || mkdir -p "$LOGS/traces"
      step "$name" 180 env SHARDTRAIN_COMM_TRACE="$LOGS/traces/$name" "$ST" launch \
        --nproc-per-node "$GPUS" --comm-timeout 60 -- train --model "$m" --dataset wikitext-2 \
        --strategy "$s" --batch-size "${TRACE_BATCH:-4}" --max-length 512 \
        --max-steps "${TRACE_STEPS:-20}" --log-interval 5 --no-save --eval-samples 8 \
        --output-dir "$LOGS/$name"
      say "== $s, $m mb ${TRACE_BATCH:-4}, $GPUS GPUs: exit $?"
      step "${name}_summary" 60 python3 bench/comm_trace_summary.py "$LOGS/traces/$name".rank*.json
      grab_tail "${name}_summary" 40
    done
  done
  dry || tar -C "$LOGS" -czf "$OUT/comm_traces.tgz" traces 2>/dev/null
}

# ---- nodes and quantized-loss --------------------------------------------------------------------
nodes_layout() {  # sets NN (nodes) and GPN (GPUs per node)
  NN=${NODES:-2}
  GPN=${GPUS_PER_NODE:-$(( GPUS / NN ))}
}
wl_nodes() {
  local m b suite=bus,nodes bus=() name torch=all variants steps
  need_gpus 2 || return 0
  nodes_layout
  peers || torch=none
  variants=${NODE_VARIANTS:-$( [ "$GPN" -gt 1 ] && echo hierarchical,quantized,hybrid || echo quantized,accum)}
  for m in ${NODE_MODELS:-gpt2-medium gpt2-xl}; do
    steps=(--steps 15 --warmup 5)
    [ "$m" = gpt2-xl ] && steps=(--steps 10 --warmup 5)
    for b in ${NODE_BATCHES:-4 16}; do
      name=nodes_${m}_mb$b
      local bud
      bud=$(budget "${NODE_BUDGET:-540}")
      # shellcheck disable=SC2086  # NODE_ARGS: more flags of bench_multi_gpu.py
      step "$name" $((bud + 60)) python3 bench/bench_multi_gpu.py --shardtrain "$ST" \
        --gpus $((NN * GPN)) --suite "$suite" --nodes "$NN" --gpus-per-node "$GPN" \
        --node-variants "$variants" ${NODE_PAIRS:+--pairs "$NODE_PAIRS"} --torch-gpus "$torch" \
        --models "$m" --batches "$b" "${steps[@]}" --budget "$bud" "${bus[@]}" \
        --out "$OUT/$name.json" --workdir "$LOGS/$name" "${COMMIT_ARGS[@]}" ${NODE_ARGS:-}
      say "nodes $m mb $b ($NN nodes x $GPN GPUs) exit $?"
      grab_tail "$name" 40
      [ "$suite" = nodes ] || { suite=nodes; bus=(--bus-json "$OUT/$name.json"); }
    done
  done
}
wl_quantized_loss() {
  need_gpus 2 || return 0
  nodes_layout
  step quantized_loss 3000 python3 bench/quantized_gradients_loss.py --shardtrain "$ST" \
    --nodes "$NN" --gpus-per-node "$GPN" --model "${QL_MODEL:-gpt2}" --steps "${QL_STEPS:-500}" \
    --strategies "${QL_STRATEGIES:-dp,zero2}" --out "$OUT/quantized_loss.json" \
    --workdir "$LOGS/quantized_loss" "${COMMIT_ARGS[@]}"
  say "quantized-loss ($NN nodes x $GPN GPUs) exit $?"
  grab_tail quantized_loss 20
}

# ---- image-models, image-accuracy ----------------------------------------------------------------
wl_image_models() {
  local fw=shardtrain shape i=0
  peers && fw=shardtrain,eager,compile
  step image_speed 1200 python3 bench/bench_image_models.py --shardtrain "$ST" \
    ${IMG_MODELS:+--models "$IMG_MODELS"} --sizes "${IMG_SIZES:-32,224}" --frameworks "$fw" \
    --out "$OUT/image_speed.json" --workdir "$LOGS/image_speed"
  say "image models, one GPU ($fw) exit $?"
  grab_tail image_speed 30
  [ "$GPUS" -ge 2 ] || return 0
  if ! peers; then  # the image suite always runs PyTorch DDP beside shardtrain
    note "image models on $GPUS GPUs: the suite runs PyTorch DDP beside shardtrain;" \
      "left out with --peers none"
    return 0
  fi
  for shape in ${IMG_SHAPES:-32x256:fashion-mnist 224x64:synthetic}; do
    i=$((i + 1))
    local b
    b=$(budget "${IMG_BUDGET:-500}")
    step "image_multi_gpu_$i" $((b + 60)) python3 bench/bench_multi_gpu.py --shardtrain "$ST" \
      --gpus "$GPUS" --suite image ${IMG_MODELS:+--image-models "$IMG_MODELS"} \
      --image-shapes "$shape" --image-nographs --budget "$b" \
      --out "$OUT/image_multi_gpu_$i.json" --workdir "$LOGS/image_multi_gpu_$i" "${COMMIT_ARGS[@]}"
    say "image models, $GPUS GPUs, $shape exit $?"
    grab_tail "image_multi_gpu_$i" 20
  done
}
wl_image_accuracy() {
  local fw
  if [ "$GPUS" -ge 2 ]; then
    fw=shardtrain; peers && fw=shardtrain,pytorch
    # shellcheck disable=SC2086  # IMG_ACC_ARGS: more flags of the script
    step image_accuracy 3000 python3 bench/image_accuracy_multi_gpu.py --shardtrain "$ST" \
      --gpus "$GPUS" --frameworks "$fw" --out "$OUT/image_accuracy.json" \
      --markdown "$OUT/image_accuracy.md" --workdir "$LOGS/image_accuracy" ${IMG_ACC_ARGS:-}
    say "image accuracy, $GPUS GPUs ($fw) exit $?"
  else
    fw=shardtrain; peers && fw=shardtrain,eager
    # shellcheck disable=SC2086
    step image_accuracy 3000 python3 bench/bench_image_models.py --shardtrain "$ST" --accuracy \
      ${IMG_MODELS:+--models "$IMG_MODELS"} --epochs "${IMG_EPOCHS:-15}" --frameworks "$fw" \
      --out "$OUT/image_accuracy.json" --workdir "$LOGS/image_accuracy" ${IMG_ACC_ARGS:-}
    say "image accuracy, one GPU ($fw) exit $?"
  fi
  grab_tail image_accuracy 40
}

# ---- profile, kernel-trace, image-ops ------------------------------------------------------------
wl_profile() {
  local mb m
  for mb in ${PROFILE_BATCHES:-4 16}; do
    m=${PROFILE_MODEL:-gpt2-medium}
    step "profile_${m}_mb$mb" 240 "$ST" train --model "$m" --dataset wikitext-2 --device cuda \
      --batch-size "$mb" --max-length 512 --max-steps 6 --profile-step 5 --eval-samples "$mb" \
      --no-save --output-dir "$LOGS/profile_${m}_mb$mb"
    say "FLOPs profile, $m micro-batch $mb x 512, step 5: exit $?"
    grab "profile_${m}_mb$mb" '^(module|embedding|block 0 |head|optimizer|gradient|total|achieved)' 12
  done
  for m in ${PROFILE_IMAGE_MODELS:-}; do  # image models at 32x32 (Fashion-MNIST), batch 256
    step "profile_$m" 240 "$ST" train --model "$m" --dataset fashion-mnist --image-size 32 \
      --device cuda --batch-size 256 --max-steps 8 --profile-step 6 --eval-samples 256 --no-save \
      --output-dir "$LOGS/profile_$m"
    say "FLOPs profile, $m 32x32 batch 256, step 6: exit $?"
    grab "profile_$m" '^(module|total|achieved)' 6
  done
}
wl_kernel_trace() {
  local m size steps data b lib=$PACKED_ABS/libkernel_trace.so
  if [ ! -f "$lib" ] && ! dry; then
    say "kernel-trace: $PACKED/libkernel_trace.so not packed" \
      "(EXTRA_BINS=\"bench_host_limits libkernel_trace.so\" bash bench/pack_build.sh)"
    return 0
  fi
  for m in ${KT_MODELS:-mobilenet_v2}; do
    for size in ${KT_SIZES:-32 224}; do
      data=(--dataset fashion-mnist); b=256
      [ "$size" = 32 ] || { data=(--dataset synthetic --num-samples 2048); b=64; }
      for steps in 5 25; do  # the difference of the two, per step: steady steps only
        step "kernel_trace_${m}_${size}_$steps" 240 env CUDA_INJECTION64_PATH="$lib" \
          KERNEL_TRACE_OUT="$LOGS/kern_${m}_${size}_$steps.tsv" "$ST" train --model "$m" "${data[@]}" \
          --image-size "$size" --device cuda --batch-size "$b" --max-steps "$steps" --eval-samples 256 \
          --no-save --output-dir "$LOGS/kernel_trace_$m"
      done
      dry || say "kernel trace $m ${size}x$size: $(grep 'step 25/' "$LOGS/kernel_trace_${m}_${size}_25.log" | tail -1)"
      step "kernel_trace_${m}_$size" 60 python3 bench/kernel_trace_diff.py \
        "$LOGS/kern_${m}_${size}_5.tsv" "$LOGS/kern_${m}_${size}_25.tsv" 20 --top "${KT_TOP:-14}"
      grab_tail "kernel_trace_${m}_$size" 40
    done
  done
}
wl_kernel_roofline() {
  local case m b ac steps lib=$PACKED_ABS/libkernel_trace.so acflag
  if [ ! -f "$lib" ] && ! dry; then
    say "kernel-roofline: $PACKED/libkernel_trace.so not packed" \
      "(EXTRA_BINS=\"bench_host_limits libkernel_trace.so\" bash bench/pack_build.sh)"
    return 0
  fi
  step gpu_limits 180 python3 bench/gpu_limits.py --models "${RF_MODELS:-gpt2-medium,gpt2-xl}" \
    --out "$OUT/gpu_limits.json"
  grab_tail gpu_limits 4
  for case in ${RF_CASES:-gpt2-medium:16:0 gpt2-xl:16:0}; do
    IFS=: read -r m b ac <<< "$case"
    acflag=(); [ "$ac" = 1 ] && acflag=(--activation-checkpointing)
    for steps in 5 25; do  # the difference of the two, per step: steady steps only
      step "roofline_${m}_b${b}_$steps" 240 env CUDA_INJECTION64_PATH="$lib" \
        KERNEL_TRACE_OUT="$LOGS/roof_${m}_b${b}_$steps.tsv" "$ST" train --model "$m" \
        --dataset wikitext-2 --device cuda --batch-size "$b" --max-length 512 \
        --max-steps "$steps" --log-interval 5 --eval-samples "$b" --warmup-steps 5 --no-save \
        "${acflag[@]}" --output-dir "$LOGS/roofline_$m"
    done
    dry || say "kernel roofline $m micro-batch $b: $(grep 'step 25/' "$LOGS/roofline_${m}_b${b}_25.log" | tail -1)"
    step "roofline_${m}_b$b" 60 python3 bench/kernel_roofline.py "$LOGS/roof_${m}_b${b}_5.tsv" \
      "$LOGS/roof_${m}_b${b}_25.tsv" 20 --model "$m" --batch "$b" --seq 512 "${acflag[@]}" \
      --limits "$OUT/gpu_limits.json" --top "${RF_TOP:-12}" --json "$OUT/roofline_${m}_b$b.json"
    grab_tail "roofline_${m}_b$b" 40
  done
  # PyTorch's attention kernels (cuDNN, FlashAttention-2, memory-efficient) on the same shapes.
  peers || return 0
  step attention_peers 120 python3 bench/attention_peers.py \
    --models "${RF_MODELS:-gpt2-medium,gpt2-xl}" --batch 16 --seq 512 --roofline-dir "$OUT" \
    --out "$OUT/attention_peers.json"
  grab_tail attention_peers 12
}
wl_image_ops() {
  if [ ! -x "$PACKED_ABS/bench_image_ops" ] && ! dry; then
    say "image-ops: $PACKED/bench_image_ops not packed" \
      "(EXTRA_BINS=\"bench_host_limits bench_image_ops\" bash bench/pack_build.sh)"
    return 0
  fi
  step image_ops 180 "$PACKED_ABS/bench_image_ops" "${OPS_REPS:-20}"
  say "bench_image_ops exit $?"
  grab image_ops '.' 200
}
