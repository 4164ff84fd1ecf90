#!/usr/bin/env bash
# Benchmarks and GPU checks of shardtrain, each named by what it measures, side by side with
# PyTorch where there is a PyTorch way to do the same work. Run on the GPU machine, in the root of
# the checkout, after the packed build is there (bench/pack_build.sh says how to pack and copy it):
#
#     bash bench/run.sh [OPTIONS] WORKLOAD...
#
# Options:
#   --peers torch|none   torch (default): run the PyTorch side of each workload that has one;
#                        none: shardtrain alone (bench_single_gpu.py and bench_image_models.py
#                        still import torch; `limits` still measures the bus bandwidth with it)
#   --gpus N             GPUs to use (GPUS; default: as many as CUDA_VISIBLE_DEVICES names, else
#                        every GPU of the machine); the one-GPU workloads use the first
#   --out DIR            results (OUT; default ./bench-out): summary.txt, the harnesses' JSON,
#                        steps.jsonl (every command with its exit status and seconds), logs.tgz
#                        (every command's log and run folder; KEEP_LOGS=1 also keeps the folder)
#   --packed DIR         the packed build (PACKED; default .packed)
#   --deadline SECONDS   stop starting work SECONDS after the start and cut time limits to fit
#                        (DEADLINE; default none), so the summary is written in time
#   --dry-run            print every command the workloads would run, change nothing (no GPU,
#                        no packed build needed; GPUS defaults to 1: pass --gpus N)
#   --list               the workloads, one a line
# Exit status: 0 when every command exited 0, 1 when one did not (a harness exits non-zero when
# one of its cells failed, e.g. a PyTorch peer out of memory) or a check of `checks` failed,
# 2 on a usage error.
#
# Workloads (peer: what runs beside shardtrain; variables: what sets the work, defaults after =):
#   limits          the machine's limits: STREAM copy/triad, pinned H2D/D2H/both, shardtrain's CPU
#                   AdamW on ADAMW_N=200000000 elements, O_DIRECT write/read of DISK_MIB=4096 MiB
#                   on NVME_PATH=/tmp/nvme_offload (bench_host_limits), dd on the same path; on 2+
#                   GPUs the NCCL bus bandwidth (all-reduce, reduce-scatter, all-gather, measured
#                   through torch.distributed). Peer: torch.optim.AdamW foreach and fused on the
#                   same shard (bench/bench_cpu_adamw.py). OMP threads: OMP_NUM_THREADS, else all.
#   tests           every packed GPU test program (TEST_PROGRAMS=all packed test_*):
#                   test_nccl_comm under mpirun on all GPUs (2+), test_zero_equivalence on 2 CPU
#                   ranks, the others as they are; compute-sanitizer memcheck and racecheck on
#                   the fused attention tests (SANITIZE=1; 0 skips them)
#   single-gpu      tokens/s, MFU and peak memory of GPT-2 training on one GPU
#                   (bench/bench_single_gpu.py, SG_CASES=medium16,tutorial,xl2,xl16ac). Peer:
#                   transformers' GPT2LMHeadModel in PyTorch eager and under torch.compile, one
#                   run each (SG_PEERS="eager compile")
#   strategies      `shardtrain compare`: the DeepSpeed tutorial's matrix, dp/zero1/zero2/zero3/
#                   offload (COMPARE_STRATEGIES) on COMPARE_MODELS=gpt2-medium, micro-batch
#                   COMPARE_BATCH=4, 1000 samples x 512, one epoch, COMPARE_GPUS=1 GPU; then
#                   infinity on COMPARE_INFINITY_SAMPLES=48 samples (0 skips it). Report in
#                   compare.md/.json and compare.tgz. No peer.
#   zero3           zero3 against dp and PyTorch FSDP2 (fully_shard, reshard_after_forward=True)
#                   on one GPU: the tutorial's gpt2-large epoch, then Z3_CASES=medium4,medium16,
#                   large2,xl2 (bench/bench_zero3_single_gpu.py; Z3_BUDGET=520 s each). Peer: FSDP2
#   offload         ZeRO-Offload and ZeRO-Infinity on one GPU, OFFLOAD_PARTS="runs bench sweep"
#                   (and `largest`): runs = one epoch of gpt2-large, batch 2, 1000 x 512 with each
#                   of OFFLOAD_RUNS="offload stage3 infinity" (bench/configs/*.json; at most
#                   OFFLOAD_RUN_TIMEOUT=400 s each); bench = bench/bench_offload.py per item of
#                   OFFLOAD_CASES="tutorial xl2,xl16" (offload, offload with delayed update, zero2;
#                   OFFLOAD_EXTRA_FW adds e.g. offload-r50,zero3-offload,infinity); sweep = gpt2-
#                   large micro-batch 2..16 (OFFLOAD_SWEEP); largest = OFFLOAD_SHAPES (7.3B, 12.2B)
#                   with OFFLOAD_LARGEST_FW. OFFLOAD_BUDGET=520 s per harness run. OMP threads:
#                   OMP_NUM_THREADS, else all. Peer: FSDP2 + CPUOffloadPolicy (bench, not sweep)
#   pipeline        on 2+ GPUs: every schedule on GPUS stages, PIPE_MODEL=gpt2-xl, micro-batch 4
#                   x 512, M = PIPE_MICRO_BATCHES="8 16": tokens/s per GPU, peak per stage,
#                   measured bubble against the simulator's, timelines in pipeline_svg/ (bench/
#                   bench_multi_gpu.py --suite pipeline, PIPE_BUDGET=480 s per M; PIPE_ARGS: more
#                   flags). Peer: torch.distributed.pipelining; --peers none runs shardtrain's
#                   schedules alone, traced. On one GPU (or PIPE_ONE_STAGE=1): one-stage pipelines
#                   of every schedule against dp on the same batch (gpt2, 8 x 512, M = 8): the
#                   executor's own cost
#   multi-gpu       GPT-2 data parallelism on all GPUS: dp/zero1/zero2/zero3 (MG_PAIRS) against
#                   DDP / DDP + ZeroRedundancyOptimizer / FSDP2 / FSDP2 resharding after forward,
#                   with the 1-GPU dp baseline (scaling), where the step goes, the collectives'
#                   bytes against the bus bandwidth each run measures first; one run of bench/
#                   bench_multi_gpu.py --suite bus,lm per MG_MODELS="gpt2-medium gpt2-xl" x
#                   MG_BATCHES="4 16" (MG_BUDGET=500 s each; MG_ARGS: more flags). Peer: as
#                   listed (--peers none: --torch-gpus none)
#   nodes           NODES=2 nodes emulated on this host (a launcher per node, GPUS_PER_NODE=GPUS/
#                   NODES GPUs each, its own NCCL_HOSTID: TCP between them): the link's bus
#                   bandwidth, then dp/zero2/zero3 (NODE_PAIRS) across the nodes and the
#                   NODE_VARIANTS (1 GPU per node: quantized,accum; more: hierarchical,quantized,
#                   hybrid) against the bound from the bytes that cross; per NODE_MODELS=
#                   "gpt2-medium gpt2-xl" x NODE_BATCHES="4 16" (bench/multi_gpu_nodes.py through
#                   bench_multi_gpu.py; NODE_BUDGET=540 s each; NODE_ARGS: more flags). Peer: DDP /
#                   FSDP2 / HSDP across the same nodes
#   image-models    images/s and peak memory of the image classifiers on one GPU (bench/
#                   bench_image_models.py: IMG_MODELS=all six, IMG_SIZES=32,224); on 2+ GPUs
#                   also shardtrain ddp on 1 and GPUS GPUs, CUDA graphs on and off (IMG_MODELS,
#                   else mobilenet_v2,efficientnet_b0,vgg16_bn), per IMG_SHAPES="32x256:fashion-
#                   mnist 224x64:synthetic" (bench_multi_gpu.py --suite image, IMG_BUDGET=500 s
#                   each; always with its PyTorch DDP side, so left out with --peers none).
#                   Fashion-MNIST: packed (FASHION_MNIST=1 bench/pack_build.sh) or
#                   FASHION_MNIST=DIR. Peer: torchvision models, eager and torch.compile / DDP
#   checks          correctness on 2+ GPUs, PASS/FAIL per check (bench/lib/checks.sh says each):
#                   CHECKS="nccltest pipelines uneven faults equivalence image-parity";
#                   CHECK_PIPE_MODEL=gpt2, PAR=4, EQ_ARGS, PARITY_ARGS. No peer (image-parity:
#                   PyTorch DDP, same recipe)
# More workloads, each named by what it measures:
#   dropout         single-gpu's speed with dropout DROPOUT_RATES="0 0.1" (DROPOUT_CASES=medium16).
#                   Peer: eager and torch.compile with the same dropout
#   image-accuracy  test top-1 of the image models with one recipe on both sides: on one GPU
#                   bench_image_models.py --accuracy (IMG_EPOCHS=15), on 2+ GPUs bench/
#                   image_accuracy_multi_gpu.py (IMG_ACC_ARGS: more flags). Peer: PyTorch (DDP)
#   pipeline-cpu    pipeline bubble on CPU ranks (MPI, one per stage) against the simulator's
#                   prediction: bench/pipeline_bubble_cpu.sh with PIPE_CPU_CASES and its MODEL,
#                   BATCH, LEN, STEPS, PARTITION, THREADS. No peer
#   comm-trace      how much of each collective hides behind compute: SHARDTRAIN_COMM_TRACE
#                   timelines of TRACE_STRATEGIES="dp zero2 zero3" on all GPUS (TRACE_MODELS=
#                   gpt2-medium, TRACE_BATCH=4, TRACE_STEPS=20), summarized by bench/
#                   comm_trace_summary.py; traces in comm_traces.tgz. No peer
#   quantized-loss  the loss of int8 cross-node gradients against bf16 over QL_STEPS=500 steps of
#                   QL_MODEL=gpt2 on NODES emulated nodes (bench/quantized_gradients_loss.py,
#                   QL_STRATEGIES=dp,zero2). No peer
#   profile         the FLOPs profiler's per-module table (params, FLOPs, latency, TFLOP/s, MFU)
#                   of PROFILE_MODEL=gpt2-medium at micro-batch PROFILE_BATCHES="4 16" x 512; and
#                   of PROFILE_IMAGE_MODELS (none by default) at 32x32, batch 256. No peer
#   kernel-trace    device time per kernel of steady training steps of KT_MODELS=mobilenet_v2 at
#                   KT_SIZES="32 224", the KT_TOP=14 largest (needs libkernel_trace.so packed:
#                   EXTRA_BINS). No peer
#   kernel-roofline each kernel family's device time in a steady GPT-2 step against its work
#                   (FLOPs or HBM bytes) and the GPU's measured limits (bench/gpu_limits.py: bf16
#                   GEMM rate per shape and at its largest, HBM copy bandwidth), for RF_CASES=
#                   "gpt2-medium:16:0 gpt2-xl:16:0" (model:micro-batch:activation checkpointing;
#                   bench/kernel_roofline.py; needs libkernel_trace.so packed: EXTRA_BINS).
#                   Peer: PyTorch's attention kernels (SDPA cuDNN, FlashAttention-2,
#                   memory-efficient) on the same shapes (bench/attention_peers.py)
#   image-ops       device time of each CUDA image op on MobileNetV2/VGG layer shapes, OPS_REPS=20
#                   repetitions (needs bench_image_ops packed: EXTRA_BINS). No peer
#   largest-model   the largest GPT one GPU trains per placement, 10 steps each (bench/
#                   largest_model.py, LM_ROWS=gpu,offload,infinity,auto,peer): everything on the
#                   GPU, ZeRO-Offload, ZeRO-Infinity (the 12.2B shape), against the estimate and
#                   the bound from the limits it measures first; LM_HOST_GIB=112 of host memory
#                   for the plans; auto: `--offload auto` given only the global batch
#                   (LM_AUTO_BATCH=64 sequences, LM_AUTO_SHAPES=12.2b:84:3456:27, on --gpus N),
#                   predicted against measured. Peer: FSDP2 + CPUOffloadPolicy's largest
#
# Examples:
#   bash bench/run.sh tests single-gpu                 # one GPU
#   bash bench/run.sh --gpus 2 multi-gpu pipeline checks
#   MG_MODELS=gpt2-medium MG_BATCHES=4 bash bench/run.sh --peers none multi-gpu
#   bash bench/run.sh --dry-run --gpus 2 multi-gpu     # the commands, without running them
# bench/README.md: what each workload measures, its run time, and the pack -> copy -> run recipe.

WORKLOADS=(limits tests single-gpu strategies zero3 offload pipeline multi-gpu nodes image-models checks
           dropout image-accuracy pipeline-cpu comm-trace quantized-loss profile kernel-trace
           kernel-roofline image-ops largest-model)

is_workload() { local w; for w in "${WORKLOADS[@]}"; do [ "$w" = "$1" ] && return 0; done; return 1; }
usage() {
  sed -n '2,/^$/p' "$0" | sed -e '/^$/d' -e 's/^# \{0,1\}//'
}

PEERS=${PEERS:-torch}
DRY_RUN=${DRY_RUN:-0}
todo=()
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --list) printf '%s\n' "${WORKLOADS[@]}"; exit 0 ;;
    --dry-run) DRY_RUN=1 ;;
    --peers|--gpus|--out|--packed|--deadline)
      [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }
      case $1 in
        --peers) PEERS=$2 ;;
        --gpus) GPUS=$2 ;;
        --out) OUT=$2 ;;
        --packed) PACKED=$2 ;;
        --deadline) DEADLINE=$2 ;;
      esac
      shift ;;
    --peers=*) PEERS=${1#*=} ;;
    --gpus=*) GPUS=${1#*=} ;;
    --out=*) OUT=${1#*=} ;;
    --packed=*) PACKED=${1#*=} ;;
    --deadline=*) DEADLINE=${1#*=} ;;
    -*) echo "run.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
    *) is_workload "$1" ||
         { echo "run.sh: unknown workload $1; one of: ${WORKLOADS[*]}" >&2; exit 2; }
       todo+=("$1") ;;
  esac
  shift
done
case $PEERS in torch|none) ;; *) echo "run.sh: --peers torch or none, not $PEERS" >&2; exit 2 ;; esac
if [ -n "${GPUS:-}" ] && ! [ "$GPUS" -ge 1 ] 2>/dev/null; then
  echo "run.sh: --gpus needs a count of 1 or more, not $GPUS" >&2; exit 2
fi
if [ -n "${DEADLINE:-}" ] && ! [ "$DEADLINE" -ge 1 ] 2>/dev/null; then
  echo "run.sh: --deadline needs seconds, not $DEADLINE" >&2; exit 2
fi
[ ${#todo[@]} -gt 0 ] || { usage >&2; exit 2; }
if [ ! -f bench/lib/prelude.sh ]; then
  echo "run.sh: run it in the repository root (bench/lib/prelude.sh not found here)" >&2; exit 2
fi
[ -z "${OUT:-}" ] || [ "${OUT#/}" != "$OUT" ] || [ "$DRY_RUN" = 1 ] || OUT=$PWD/$OUT
export PEERS DRY_RUN
[ -z "${GPUS:-}" ] || export GPUS
T0=$(date +%s)

# shellcheck source=bench/lib/prelude.sh
source bench/lib/prelude.sh || exit 1
# shellcheck source=bench/lib/workloads.sh
source bench/lib/workloads.sh
# shellcheck source=bench/lib/checks.sh
source bench/lib/checks.sh

# the logs and run folders into $OUT/logs.tgz (not checkpoints and swap files); a temporary LOGS
# is removed unless KEEP_LOGS=1
finish() {
  dry && return
  tar -C "$(dirname "$LOGS")" -czf "$OUT/logs.tgz" --exclude='*.safetensors' --exclude='*.bin' \
    "$(basename "$LOGS")" 2>/dev/null &&
    if [ "${KEEP_LOGS:-0}" != 1 ] && [ -n "${LOGS_TMP:-}" ]; then rm -rf "$LOGS_TMP"; fi
  echo "results in $OUT: $(find "$OUT" -mindepth 1 -maxdepth 1 -printf '%f ')"
}
trap finish EXIT

for WORKLOAD in "${todo[@]}"; do
  if [ -n "${DEADLINE:-}" ] && [ $(( $(date +%s) - T0 )) -ge "$DEADLINE" ]; then
    note "==== $WORKLOAD: not started, --deadline $DEADLINE s spent"
    continue
  fi
  note "==== $WORKLOAD ($GPUS GPU(s), peers: $PEERS) $(date -u +%T)"
  "wl_${WORKLOAD//-/_}"
done
dry && exit 0
say "==== done in $(( $(date +%s) - T0 )) s: $STEP_FAILS command(s) exited non-zero, $CHECK_FAILS check(s) failed"
[ "$STEP_FAILS" = 0 ] && [ "$CHECK_FAILS" = 0 ]
