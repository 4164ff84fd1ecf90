#!/usr/bin/env bash
# Device calls for issue 13 (two GPUs: nvidia-h200-x2). Usage: bash bench/device_run_issue13.sh PHASE...
# Before the call, here: cmake --build build --target shardtrain test_nccl_comm && \
#   TESTS="test_nccl_comm" bash bench/pack_device.sh build .device   (carry: .device)
#   zero3     bench/bench_multi_gpu.py: zero3 on 1 and 2 GPUs against FSDP2 (fully_shard,
#             reshard_after_forward=True, bf16) on 2, gpt2-medium and gpt2-xl at micro-batch
#             ZERO3_BATCHES (default "4 16") × 512: tokens/s per GPU, scaling, peak memory, estimate
#   zero3trace  zero3 on 2 GPUs (gpt2-medium and gpt2-xl, micro-batch 4) under SHARDTRAIN_COMM_TRACE:
#             how much all-gather time the compute stream waited for (bench/comm_trace_summary.py)
#   dp        dp on 1 and 2 GPUs, gpt2-medium and gpt2-xl at micro-batch 4: the per-GPU scaling,
#             then a traced 2-GPU gpt2-medium run (what of the reductions is exposed)
#   breakdown  --wall-clock-breakdown of zero3 and dp, gpt2-xl mb 4, on BD_GPUS (default 1 and 2)
#             GPUs; unless BD_VARIANTS=0, zero3 on 2 with NCCL's collectives instead of the
#             copy-engine ones, and with GEMMs leaving 16 SMs
#   (zero3trace models: TRACE_MODELS, default "gpt2-medium gpt2-xl")
#   pipesmoke  2-GPU pipeline runs (1f1b, zb-h1; gpt2-xl, M = 8), traced: they run, and the bubble
#   cudatest  .device/test_cuda_backend (one GPU's ops)
#   nccltest  tests/mpi/test_nccl_comm on 2 GPUs (the copy-engine collectives against NCCL)
#   faults    a rank hung or killed inside a zero3 all-gather (collective FAULT_OP) and inside a
#             pipeline transfer (send/recv FAULT_P2P): the other rank stops within the 10 s
#             timeout and names the rank
#   pipeline  bench/bench_pipeline_gpus.py: every schedule on 2 GPUs, gpt2-xl, M = 8 and 16
#             micro-batches of 4 × 512, against torch.distributed.pipelining
# GPUS=1 runs the zero3 and dp phases on one GPU (FSDP2 too): the 1-GPU rows, on a one-GPU kind.
# Back in $OUT: summary.txt, JSON of the benches, traces and timeline pictures, logs.tgz.
LOGS_NAME=i13logs
GPUS=${GPUS:-2}
source bench/device_run_common.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# st_run NAME GPUS STRATEGY MODEL BATCH STEPS [ENV=VALUE...]: a short training run, log in $LOGS
st_run() {
  local name=$1 n=$2 strategy=$3 model=$4 batch=$5 steps=$6; shift 6
  env "$@" timeout 150 $ST launch --nproc-per-node $n --comm-timeout 60 -- train --model $model \
    --dataset wikitext-2 --strategy $strategy --batch-size $batch --max-length 512 \
    --max-steps $steps --log-interval 5 --no-save --eval-samples 8 --output-dir $LOGS/$name \
    $ST_EXTRA > $LOGS/$name.log 2>&1
  say "== $name ($n GPUs, $strategy, $model mb $batch, $*) exit $?: $(grep -E "step +$steps/" $LOGS/$name.log | tail -1)"
}
for phase in "$@"; do
  say "==== $phase $(date -u +%T)"
  case $phase in
    zero3)
      for b in ${ZERO3_BATCHES:-4 16}; do
        timeout ${BENCH_TIMEOUT:-300} python3 bench/bench_multi_gpu.py --shardtrain $ST --gpus $GPUS \
          --pairs zero3 --torch-gpus $GPUS --batch $b --budget ${BENCH_BUDGET:-280} \
          --out $OUT/zero3_mb$b.json --workdir $LOGS/zero3_mb$b > $LOGS/zero3_mb$b.log 2>&1
        say "zero3 bench mb $b exit $?"; tail -n 12 $LOGS/zero3_mb$b.log | tee -a $SUM
      done ;;
    zero3trace)
      for m in ${TRACE_MODELS:-gpt2-medium gpt2-xl}; do
        st_run z3trace_$m 2 zero3 $m 4 20 SHARDTRAIN_COMM_TRACE=$LOGS/z3trace_$m
        python3 bench/comm_trace_summary.py $LOGS/z3trace_$m.rank*.json | tee -a $SUM
      done ;;
    dp)
      timeout ${BENCH_TIMEOUT:-300} python3 bench/bench_multi_gpu.py --shardtrain $ST --gpus $GPUS \
        --pairs dp --torch-gpus none --budget ${BENCH_BUDGET:-280} --out $OUT/dp_scaling.json \
        --workdir $LOGS/dp > $LOGS/dp.log 2>&1
      say "dp bench exit $?"; tail -n 12 $LOGS/dp.log | tee -a $SUM
      if [ "$GPUS" -gt 1 ]; then
        st_run dptrace 2 dp gpt2-medium 4 20 SHARDTRAIN_COMM_TRACE=$LOGS/dptrace
        python3 bench/comm_trace_summary.py $LOGS/dptrace.rank*.json | tee -a $SUM
      fi ;;
    breakdown)  # where 2-GPU zero3 and dp lose time against 1 GPU: phase times, and two suspects
      # (collectives that take SMs from the GEMMs; the copy-engine collectives vs NCCL's kernels)
      ST_EXTRA="--wall-clock-breakdown"
      for s in zero3 dp; do
        for n in ${BD_GPUS:-1 2}; do
          st_run bd_${s}_$n $n $s gpt2-xl 4 30
          say "bd_${s}_$n: $(grep 'device time per step' $LOGS/bd_${s}_$n.log | tail -1)"
        done
      done
      if [ "${BD_VARIANTS:-1}" = 1 ]; then
        st_run bd_zero3_2_nccl 2 zero3 gpt2-xl 4 30 SHARDTRAIN_PEER_COLLECTIVES=0
        st_run bd_zero3_2_margin16 2 zero3 gpt2-xl 4 30 SHARDTRAIN_GEMM_SM_MARGIN=16
        for v in nccl margin16; do say "bd_zero3_2_$v: $(grep 'device time per step' $LOGS/bd_zero3_2_$v.log | tail -1)"; done
      fi
      ST_EXTRA="" ;;
    cudatest)
      run_gtest test_cuda_backend ;;
    pipesmoke)  # one 2-GPU pipeline run of each kind, traced: does it run, and its bubble
      for s in 1f1b zb-h1; do
        ST_EXTRA="--pipeline-stages 2 --pipeline-schedule $s --gradient-accumulation-steps 8 --trace $LOGS/ps_$s/trace" \
          st_run ps_$s 2 pipeline gpt2-xl 4 10
        grep -E "bubble|peak" $LOGS/ps_$s.log | tail -3 | tee -a $SUM
      done ;;
    nccltest)
      SHARDTRAIN_COMM_TIMEOUT=60 timeout 200 mpirun --allow-run-as-root --bind-to none -np 2 \
        .device/test_nccl_comm > $LOGS/test_nccl_comm.log 2>&1
      say "test_nccl_comm exit $?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $LOGS/test_nccl_comm.log | tr '\n' ' ')"
      grep -E "FAILED|rank [0-9]\]" $LOGS/test_nccl_comm.log | head -20 | tee -a $SUM ;;
    faults)
      for f in HANG KILL; do
        for what in zero3 pipeline; do
          start=$(date +%s)
          if [ $what = zero3 ]; then
            fault=(SHARDTRAIN_TEST_FAULT_OP=${FAULT_OP:-200})
            args=(--strategy zero3)
          else
            fault=(SHARDTRAIN_TEST_FAULT_P2P=${FAULT_P2P:-40})
            args=(--strategy pipeline --pipeline-stages 2 --gradient-accumulation-steps 8)
          fi
          env SHARDTRAIN_TEST_${f}_RANK=1 "${fault[@]}" timeout 120 $ST launch --nproc-per-node 2 \
            --comm-timeout 10 -- train --model gpt2-medium --dataset wikitext-2 "${args[@]}" \
            --batch-size 4 --max-length 512 --max-steps 40 --no-save --eval-samples 8 \
            --output-dir $LOGS/fault_${what}_$f > $LOGS/fault_${what}_$f.log 2>&1
          say "== $what, rank 1 ${f}s (${fault[*]}): exit $? after $(( $(date +%s) - start )) s"
          grep -iE "error|rank [0-9]|fault|timed out" $LOGS/fault_${what}_$f.log | tail -4 | tee -a $SUM
        done
      done ;;
    pipeline)
      timeout ${BENCH_TIMEOUT:-480} python3 bench/bench_pipeline_gpus.py --shardtrain $ST \
        --budget ${BENCH_BUDGET:-450} --out $OUT/pipeline.json --svg-dir $OUT/pipeline_svg \
        --workdir $LOGS/pipeline ${PIPE_ARGS:-} > $LOGS/pipeline.log 2>&1
      say "pipeline bench exit $?"; tail -n 30 $LOGS/pipeline.log | tee -a $SUM ;;
    *) say "unknown phase $phase" ;;
  esac
done
mkdir -p $OUT/traces && cp $LOGS/*trace*.rank*.json $OUT/traces/ 2>/dev/null
tar -C /tmp -czf $OUT/logs.tgz $LOGS_NAME 2>/dev/null
