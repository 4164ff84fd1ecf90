#!/usr/bin/env bash
# Device calls for issue 4 (nvidia-h200-x2). Usage: bash bench/device_run_issue4.sh PHASE...
#   train    the Done-when command: zero2 on 2 GPUs, defaults (one epoch of WikiText-2)
#   bench    bench/bench_multi_gpu.py: shardtrain dp/zero1/zero2 vs PyTorch DDP / ZeRO / FSDP2 on
#            1 and 2 GPUs (BENCH_TIMEOUT, BENCH_BUDGET seconds)
#   overlap  why dp's gradient all-reduce does not hide behind backward (docs/BENCHMARKS.md):
#            gpt2-medium mb 4 dp on 1 and 2 GPUs with GEMMs leaving SMs free for NCCL
#            (SHARDTRAIN_GEMM_SM_MARGIN) and with more hardware work queues; a control runs two
#            independent 1-GPU trainings at once (both GPUs busy, no collectives)
#   nccl     dp (and zero2) on 2 GPUs under NCCL settings that leave more SMs to compute: CTA
#            policy, CTA caps, protocol, bucket size; traces of the promising ones
#   breakdown  --wall-clock-breakdown phase times of dp/zero1/zero2 on 1 and 2 GPUs
#   isolate  backward on 2 GPUs with the reduction after it: P2P off, CPU affinity, one queue;
#            GPU contexts and CPU affinity of a running 2-GPU job
#   queues   dp/zero1/zero2 on 1 and 2 GPUs with one hardware work queue vs the default
#   buckets  dp bucket sizes on 2 GPUs, with the phase breakdown
#   traces   traced repeats of dp with the default and the efficiency CTA policy, CTA caps, zero2
#   peer     first copy-engine collectives: tests/mpi/test_nccl_comm (against NCCL, 2 ranks), then
#            dp/zero1/zero2 with SHARDTRAIN_PEER_COLLECTIVES=0 and 1, one and eight work queues
#   peer2    the copy-engine collectives (default) against NCCL: the test, then dp/zero1/zero2
#            phase times, zero2 with 12.5 M-element buckets both ways, traces
#   faults   a rank hangs / is killed at collective 60 of a dp run: the others stop (10 s timeout)
#   trace    SHARDTRAIN_COMM_TRACE timelines of every collective and wait (2 GPUs, gpt2-medium mb 4):
#            dp with default buckets, dp with one bucket after backward, zero2
# Logs and JSON go to $OUT.
source bench/device_env.sh
ldd .device/shardtrain | grep -q "not found" && export LD_LIBRARY_PATH="$PWD/.device/libfallback:$LD_LIBRARY_PATH"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/gpus.txt; date -u | tee -a $OUT/gpus.txt
# dp_run NAME GPUS [ENV=VALUE...]: 40 steps of gpt2-medium mb 4 × 512, steps 30 and 40 shown;
# STRATEGY (default dp) and DP_EXTRA (more train flags) from the caller's environment
dp_run() {
  local name=$1 n=$2; shift 2
  env "$@" timeout 60 .device/shardtrain launch --nproc-per-node $n -- train --model gpt2-medium \
    --dataset wikitext-2 --strategy ${STRATEGY:-dp} --batch-size 4 --max-length 512 --max-steps 40 \
    --log-interval 10 --no-save --eval-samples 8 --output-dir /tmp/ov_$name $DP_EXTRA > $OUT/ov_$name.log 2>&1
  echo "== $name ($n GPUs, $*) rc=$?"; grep -E "step +(30|40)/" $OUT/ov_$name.log
}
solo_pair() {  # the same 40 steps as two independent 1-GPU runs at once, one per GPU: no collectives
  for g in 0 1; do
    CUDA_VISIBLE_DEVICES=$g timeout 60 .device/shardtrain train --model gpt2-medium --device cuda \
      --dataset wikitext-2 --batch-size 4 --max-length 512 --max-steps 40 --log-interval 10 \
      --no-save --eval-samples 8 --output-dir /tmp/ov_solo$g > $OUT/ov_solo$g.log 2>&1 &
  done
  wait; for g in 0 1; do echo "== solo on GPU $g, concurrently"; grep -E "step +(30|40)/" $OUT/ov_solo$g.log; done
}
for phase in "$@"; do
  echo "==== $phase"
  case $phase in
    train)
      timeout 100 .device/shardtrain launch --nproc-per-node 2 -- train --model gpt2-medium \
        --dataset wikitext-2 --strategy zero2 --output-dir /tmp/zero2 > $OUT/zero2_train.log 2>&1
      echo "zero2 exit $?"; grep -E "step +(1|10|500|1000)/|epoch 1 \||validation|done|error" $OUT/zero2_train.log | head -8 ;;
    bench)
      timeout ${BENCH_TIMEOUT:-470} python3 bench/bench_multi_gpu.py --shardtrain .device/shardtrain \
        --gpus 2 --budget ${BENCH_BUDGET:-430} --out $OUT/bench_multi_gpu.json \
        --workdir /tmp/bench_multi_gpu > $OUT/bench_multi_gpu.log 2>&1
      echo "bench exit $?"; tail -c 9000 $OUT/bench_multi_gpu.log ;;
    overlap)
      dp_run one_gpu 1
      dp_run base 2
      solo_pair
      for m in 8 16 32; do dp_run margin$m 2 SHARDTRAIN_GEMM_SM_MARGIN=$m; done
      dp_run queues32 2 CUDA_DEVICE_MAX_CONNECTIONS=32
      dp_run margin16_ch8 2 SHARDTRAIN_GEMM_SM_MARGIN=16 NCCL_MAX_NCHANNELS=8 ;;
    nccl)
      dp_run one_gpu 1
      dp_run base 2
      dp_run eff 2 SHARDTRAIN_NCCL_CTA_POLICY=efficiency SHARDTRAIN_COMM_TRACE=$OUT/trace_eff
      for c in 4 8 16; do dp_run maxctas$c 2 NCCL_MAX_CTAS=$c; done
      dp_run simple 2 NCCL_PROTO=Simple
      dp_run ll128 2 NCCL_PROTO=LL128
      for b in 25 50; do
        echo "{\"zero_optimization\": {\"stage\": 0, \"reduce_bucket_size\": ${b}000000}}" > /tmp/b$b.json
        DP_EXTRA="--deepspeed-config /tmp/b$b.json" dp_run bucket${b}M 2
        DP_EXTRA="--deepspeed-config /tmp/b$b.json" dp_run bucket${b}M_eff 2 SHARDTRAIN_NCCL_CTA_POLICY=efficiency
      done
      dp_run eff_ctas8 2 SHARDTRAIN_NCCL_CTA_POLICY=efficiency NCCL_MAX_CTAS=8
      STRATEGY=zero2 dp_run zero2_one_gpu 1
      STRATEGY=zero2 dp_run zero2 2
      STRATEGY=zero2 dp_run zero2_eff 2 SHARDTRAIN_NCCL_CTA_POLICY=efficiency
      STRATEGY=zero1 dp_run zero1_one_gpu 1
      STRATEGY=zero1 dp_run zero1 2
      STRATEGY=zero1 dp_run zero1_eff 2 SHARDTRAIN_NCCL_CTA_POLICY=efficiency ;;
    breakdown)  # device time per phase (--wall-clock-breakdown), 1 vs 2 GPUs, each strategy
      for st in dp zero1 zero2; do
        for n in 1 2; do
          STRATEGY=$st DP_EXTRA=--wall-clock-breakdown dp_run wcb_${st}_$n $n
          grep -A1 "step 40/" $OUT/ov_wcb_${st}_$n.log | grep "device time"
        done
      done
      STRATEGY=dp DP_EXTRA=--wall-clock-breakdown dp_run wcb_dp_2_ctas4 2 NCCL_MAX_CTAS=4
      grep -A1 "step 40/" $OUT/ov_wcb_dp_2_ctas4.log | grep "device time"
      echo '{"zero_optimization": {"stage": 0, "reduce_bucket_size": 500000000}}' > /tmp/one_bucket.json
      DP_EXTRA="--wall-clock-breakdown --deepspeed-config /tmp/one_bucket.json" dp_run wcb_dp_2_one 2
      grep -A1 "step 40/" $OUT/ov_wcb_dp_2_one.log | grep "device time"
      mkdir -p /tmp/ovlogs && mv $OUT/ov_*.log /tmp/ovlogs/ && tar czf $OUT/logs.tgz -C /tmp ovlogs ;;
    isolate)  # why backward is slower on 2 GPUs even with the reduction after it (one bucket)
      echo '{"zero_optimization": {"stage": 0, "reduce_bucket_size": 500000000}}' > /tmp/one_bucket.json
      W="--wall-clock-breakdown --deepspeed-config /tmp/one_bucket.json"
      show() { grep -A1 "step 40/" $OUT/ov_$1.log | grep "device time"; }
      DP_EXTRA=--wall-clock-breakdown dp_run iso_1gpu 1; show iso_1gpu
      DP_EXTRA="$W" dp_run iso_one 2; show iso_one
      DP_EXTRA="$W" dp_run iso_one_nop2p 2 NCCL_P2P_DISABLE=1; show iso_one_nop2p
      DP_EXTRA="$W" dp_run iso_one_noaff 2 NCCL_IGNORE_CPU_AFFINITY=1; show iso_one_noaff
      DP_EXTRA="$W" dp_run iso_one_conn1 2 CUDA_DEVICE_MAX_CONNECTIONS=1; show iso_one_conn1
      # contexts per GPU and CPU affinity while a 2-GPU run is going
      (.device/shardtrain launch --nproc-per-node 2 -- train --model gpt2-medium --dataset wikitext-2 \
        --batch-size 4 --max-length 512 --max-steps 400 --no-save --eval-samples 8 \
        --output-dir /tmp/iso_long > $OUT/iso_long.log 2>&1 &)
      sleep 15; nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory --format=csv
      for p in $(pgrep -f "shardtrain train"); do echo "pid $p: $(grep Cpus_allowed_list /proc/$p/status) threads $(ls /proc/$p/task | wc -l)"; done
      nproc; sleep 10
      mkdir -p /tmp/ovlogs && mv $OUT/ov_*.log /tmp/ovlogs/ && tar czf $OUT/logs_iso.tgz -C /tmp ovlogs ;;
    queues)  # one hardware work queue (CUDA_DEVICE_MAX_CONNECTIONS=1) vs the default 8
      show() { grep -A1 "step 40/" $OUT/ov_$1.log | grep "device time"; }
      for st in dp zero1 zero2; do
        for n in 1 2; do
          STRATEGY=$st DP_EXTRA=--wall-clock-breakdown dp_run q_${st}_$n $n; show q_${st}_$n
          STRATEGY=$st DP_EXTRA=--wall-clock-breakdown dp_run q1_${st}_$n $n CUDA_DEVICE_MAX_CONNECTIONS=1
          show q1_${st}_$n
        done
      done
      mkdir -p /tmp/ovlogs && mv $OUT/ov_*.log /tmp/ovlogs/ && tar czf $OUT/logs_q.tgz -C /tmp ovlogs ;;
    buckets)  # dp bucket size with the default one work queue (CUDA_DEVICE_MAX_CONNECTIONS=1)
      show() { grep -A1 "step 40/" $OUT/ov_$1.log | grep -E "step 40|device time"; }
      DP_EXTRA=--wall-clock-breakdown dp_run b_default 2 > /dev/null; show b_default
      for b in 25 50 100 500; do
        echo "{\"zero_optimization\": {\"stage\": 0, \"reduce_bucket_size\": ${b}000000}}" > /tmp/b$b.json
        DP_EXTRA="--wall-clock-breakdown --deepspeed-config /tmp/b$b.json" dp_run b_${b}M 2 > /dev/null
        echo "== ${b}M elements"; show b_${b}M
      done
      mkdir -p /tmp/ovlogs && mv $OUT/ov_*.log /tmp/ovlogs/ && tar czf $OUT/logs_b.tgz -C /tmp ovlogs ;;
    traces)  # repeated dp runs, default vs efficiency CTA policy, every one traced; one archive
      mkdir -p /tmp/tr
      for i in 1 2 3; do
        dp_run t_base$i 2 NCCL_DEBUG=INFO SHARDTRAIN_COMM_TRACE=/tmp/tr/base$i
        dp_run t_eff$i 2 NCCL_DEBUG=INFO SHARDTRAIN_NCCL_CTA_POLICY=efficiency SHARDTRAIN_COMM_TRACE=/tmp/tr/eff$i
      done
      dp_run t_ctas4 2 NCCL_MAX_CTAS=4 SHARDTRAIN_COMM_TRACE=/tmp/tr/ctas4
      dp_run t_ctas16 2 NCCL_MAX_CTAS=16 SHARDTRAIN_COMM_TRACE=/tmp/tr/ctas16
      STRATEGY=zero2 dp_run t_zero2 2 SHARDTRAIN_COMM_TRACE=/tmp/tr/zero2
      STRATEGY=zero2 dp_run t_zero2_eff 2 SHARDTRAIN_NCCL_CTA_POLICY=efficiency SHARDTRAIN_COMM_TRACE=/tmp/tr/zero2_eff
      tar czf $OUT/traces.tgz -C /tmp tr && mkdir -p /tmp/ovlogs && mv $OUT/ov_*.log /tmp/ovlogs/ &&
        tar czf $OUT/logs.tgz -C /tmp ovlogs ;;
    peer)
      SHARDTRAIN_COMM_TIMEOUT=60 timeout 200 mpirun --allow-run-as-root --bind-to none -np 2 .device/test_nccl_comm \
        > $OUT/test_nccl_comm.log 2>&1
      echo "test_nccl_comm exit $?"; grep -E "PASSED|FAILED|SKIPPED|rank [0-9]\]|error" $OUT/test_nccl_comm.log | head -20
      losses() { python3 -c "import json,sys; print(' '.join('%.6f' % r['loss'] for r in map(json.loads, open(sys.argv[1])) if 'loss' in r and 'step' in r))" /tmp/ov_$1/metrics.jsonl 2>&1 | head -c 300; echo; }
      show() { grep -A1 "step 40/" $OUT/ov_$1.log | grep -E "step 40|device time"; losses $1; }
      STRATEGY=dp DP_EXTRA=--wall-clock-breakdown dp_run pe_1gpu 1 > /dev/null; echo "== 1 GPU"; show pe_1gpu
      for st in dp zero1 zero2; do
        for v in nccl ce ce_q8; do
          case $v in nccl) e="SHARDTRAIN_PEER_COLLECTIVES=0";; ce) e="CUDA_DEVICE_MAX_CONNECTIONS=1";;
            ce_q8) e="CUDA_DEVICE_MAX_CONNECTIONS=8";; esac
          STRATEGY=$st DP_EXTRA=--wall-clock-breakdown dp_run pe_${st}_$v 2 $e > /dev/null
          echo "== $st $v ($e)"; show pe_${st}_$v
        done
      done
      mkdir -p /tmp/tr_ce
      for st in dp zero2; do
        SHARDTRAIN_COMM_TRACE=/tmp/tr_ce/$st STRATEGY=$st DP_EXTRA=--wall-clock-breakdown \
          dp_run pe_${st}_trace 2 CUDA_DEVICE_MAX_CONNECTIONS=8 > /dev/null
      done
      mkdir -p /tmp/ovlogs && mv $OUT/ov_*.log /tmp/ovlogs/ && cp -r /tmp/tr_ce /tmp/ovlogs/ 2>/dev/null
      tar czf $OUT/logs_peer.tgz -C /tmp ovlogs ;;
    peer2)  # copy-engine collectives (the default) against NCCL, side by side, with phase times
      SHARDTRAIN_COMM_TIMEOUT=60 timeout 200 mpirun --allow-run-as-root --bind-to none -np 2 .device/test_nccl_comm \
        > $OUT/test_nccl_comm.log 2>&1
      echo "test_nccl_comm exit $?"; grep -E "PASSED|FAILED|rank [0-9]\]" $OUT/test_nccl_comm.log | head -20
      show() { grep -A1 "step 40/" $OUT/ov_$1.log | grep -E "step 40|device time"; }
      DP_EXTRA=--wall-clock-breakdown dp_run p2_1gpu 1 > /dev/null; echo "== 1 GPU"; show p2_1gpu
      for st in dp zero1 zero2; do
        STRATEGY=$st DP_EXTRA=--wall-clock-breakdown dp_run p2_${st}_nccl 2 SHARDTRAIN_PEER_COLLECTIVES=0 \
          CUDA_DEVICE_MAX_CONNECTIONS=1 > /dev/null
        echo "== $st nccl"; show p2_${st}_nccl
        STRATEGY=$st DP_EXTRA=--wall-clock-breakdown dp_run p2_${st}_ce 2 > /dev/null
        echo "== $st copy engines (the default)"; show p2_${st}_ce
      done
      echo '{"zero_optimization": {"stage": 2, "reduce_bucket_size": 12500000}}' > /tmp/z2b.json
      for v in 0 1; do
        STRATEGY=zero2 DP_EXTRA="--wall-clock-breakdown --deepspeed-config /tmp/z2b.json" dp_run p2_z2small_$v 2 \
          SHARDTRAIN_PEER_COLLECTIVES=$v > /dev/null
        echo "== zero2 12.5M buckets, peer collectives $v"; show p2_z2small_$v
      done
      mkdir -p /tmp/tr_ce
      for st in dp zero2; do
        SHARDTRAIN_COMM_TRACE=/tmp/tr_ce/$st STRATEGY=$st DP_EXTRA=--wall-clock-breakdown \
          dp_run p2_${st}_trace 2 > /dev/null
      done
      mkdir -p /tmp/ovlogs2 && mv $OUT/ov_*.log /tmp/ovlogs2/ && cp -r /tmp/tr_ce /tmp/ovlogs2/ &&
        tar czf $OUT/logs_peer2.tgz -C /tmp ovlogs2 ;;
    faults)  # a rank that hangs or dies inside the copy-engine collectives: the others stop
      for f in HANG KILL; do
        start=$(date +%s)
        env SHARDTRAIN_TEST_${f}_RANK=1 SHARDTRAIN_TEST_FAULT_OP=60 SHARDTRAIN_COMM_TIMEOUT=10 \
          timeout 120 .device/shardtrain launch --nproc-per-node 2 -- train --model gpt2-medium \
          --dataset wikitext-2 --batch-size 4 --max-length 512 --max-steps 40 --no-save \
          --eval-samples 8 --output-dir /tmp/fault_$f > $OUT/fault_$f.log 2>&1
        rc=$?; echo "== $f rank 1 at collective 60: exit $rc after $(( $(date +%s) - start )) s"
        grep -E "error|rank|fault" $OUT/fault_$f.log | tail -4
      done ;;
    trace)
      echo '{"zero_optimization": {"stage": 0, "reduce_bucket_size": 500000000}}' > /tmp/one_bucket.json
      dp_run trace_dp 2 SHARDTRAIN_COMM_TRACE=$OUT/trace_dp
      DP_EXTRA="--deepspeed-config /tmp/one_bucket.json" dp_run trace_dp_one_bucket 2 SHARDTRAIN_COMM_TRACE=$OUT/trace_one
      STRATEGY=zero2 dp_run trace_zero2 2 SHARDTRAIN_COMM_TRACE=$OUT/trace_zero2
      ls -la $OUT/*.json ;;
  esac
done
