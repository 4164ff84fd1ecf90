#!/usr/bin/env python3
"""Multi-GPU speed benchmarks: shardtrain on N GPUs of one host (any N; N = --gpus) against
PyTorch doing the same work, in suites chosen with --suite (a comma list, default lm; `all` =
bus,lm,pipeline,image,nodes; they run in that order, whatever the order given):

  bus       the NCCL bus bandwidth of the N GPUs, measured with PyTorch (torch.distributed)
  lm        GPT-2 data parallelism: shardtrain dp / zero1 / zero2 / zero3 against PyTorch DDP /
            ZeroRedundancyOptimizer / FSDP2 / FSDP2 resharding after forward, per micro-batch,
            with the 1-GPU dp baseline, where the step goes and what its collectives move
  pipeline  shardtrain's pipeline schedules against torch.distributed.pipelining, N stages
  image     image classifiers, shardtrain ddp on 1 and N GPUs against PyTorch DDP on N GPUs
  nodes     GPT-2 across --nodes emulated on this host (a launcher per node, its share of the GPUs
            and its own NCCL_HOSTID): the cross-node NCCL bus bandwidth, then dp / zero2 / zero3
            against DDP / FSDP2 / FSDP2 resharding, dp --hierarchical-all-reduce, gradient
            accumulation and the same strategies on one node, against the step's lower bound

Usage (GPU machine, after `source bench/lib/prelude.sh`; bench/run.sh's multi-gpu, pipeline,
image-models and nodes workloads run it so). A job is mostly start-up (10-30 s), so
the defaults take long: lm about 40 jobs (2 models × 2 micro-batches × 10), pipeline 20, image 18
(24 with --image-nographs). Split so that each command fits its --budget (default 500 s), e.g.:
    python3 bench/bench_multi_gpu.py --shardtrain .packed/shardtrain --gpus 2 --suite bus,lm \\
        --models gpt2-medium --out $OUT/lm_medium.json --workdir $OUT/multi_gpu
    python3 bench/bench_multi_gpu.py --shardtrain .packed/shardtrain --gpus 2 --suite bus,lm \\
        --models gpt2-xl --batches 4 --out $OUT/lm_xl_mb4.json \\
        --workdir $OUT/multi_gpu                      # and again with --batches 16
    python3 bench/bench_multi_gpu.py --shardtrain .packed/shardtrain --gpus 2 --suite pipeline \\
        --micro-batches 8 --svg-dir $OUT/pipeline_svg --out $OUT/pipeline_M8.json \\
        --workdir $OUT/multi_gpu                      # and again with --micro-batches 16
    python3 bench/bench_multi_gpu.py --shardtrain .packed/shardtrain --gpus 2 --suite image \\
        --image-nographs --out $OUT/image.json --workdir $OUT/multi_gpu
nodes: 14 jobs per model and micro-batch (56 with the defaults; gpt2-xl's take about a minute
each), so one command per model and micro-batch (gpt2-xl: and --pairs dp, then zero2,zero3), the
later ones reusing the first one's bus bandwidths (--bus-json). On 2 GPUs, 2 nodes × 1 GPU:
    python3 bench/bench_multi_gpu.py --shardtrain .packed/shardtrain --gpus 2 --suite bus,nodes \\
        --nodes 2 --models gpt2-medium --batches 4 --budget 540 \\
        --out $OUT/nodes_medium_mb4.json --workdir $OUT/multi_gpu
    python3 bench/bench_multi_gpu.py --shardtrain .packed/shardtrain --gpus 2 --suite nodes \\
        --nodes 2 --models gpt2-xl --batches 4 --pairs dp --budget 540 \\
        --bus-json $OUT/nodes_medium_mb4.json --out $OUT/nodes_xl_mb4_dp.json \\
        --workdir $OUT/multi_gpu
On 4 GPUs, 2 nodes × 2 GPUs (the same with --gpus 4 --gpus-per-node 2):
    python3 bench/bench_multi_gpu.py --shardtrain .packed/shardtrain --gpus 4 --suite bus,nodes \\
        --nodes 2 --gpus-per-node 2 --models gpt2-medium --batches 4 --budget 540 \\
        --out $OUT/nodes2x2_medium_mb4.json --workdir $OUT/multi_gpu
(`bus` takes half a minute; `--suite lm --bus-json FILE` instead reuses the bus bandwidth of an
earlier --out JSON. Where the checkout has no git history, --commit names the commit.)
CPU smoke test of the script itself (every suite: shardtrain --device cpu, its ranks under mpirun
through `shardtrain launch`; PyTorch on gloo; tiny models and images, a few steps; about 4 minutes
on 2 cores, nodes alone 1; a Python with torch, torchvision and transformers; set
SHARDTRAIN_DATA_DIR when the binary is not in its build tree):
    PY_WITH_TORCH bench/bench_multi_gpu.py --smoke --gpus 2 --suite all \\
        --shardtrain build/shardtrain
In smoke mode the nodes suite runs shardtrain's node cells as ONE `launch --nproc-per-node N·G`
CPU job (`launch --nnodes` refuses CPU jobs: they start through mpirun with a hostfile), so
shardtrain's side does not emulate nodes there (its table says so); PyTorch's does (gloo).

Every job (a cell) runs in its own process group with a timeout (--cell-timeout, else per suite);
a failed or timed-out cell is recorded as an error and the rest still run. --budget seconds bound
the whole run: a cell that would start with less than 15 s left is skipped and shown as "not run",
and the run says how many were. Every job's environment has NCCL_NVLS_ENABLE=0 (no NVLink
multicast; also TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). --out gets the JSON
(rewritten after every cell: the run's context, then each suite's rows with every job's numbers and
log path); each suite prints a markdown table for docs/BENCHMARKS.md headed by the GPUs (nvidia-smi
or torch.cuda.get_device_name), the date, the commit (git, else --commit) and the command. Logs
and run directories go to --workdir. Not a test: the numbers depend on the GPUs.

What the numbers mean:
bus (bench/torch_bus_worker.py under `python -m torch.distributed.run --standalone
  --nproc-per-node N`): all_reduce, reduce_scatter_tensor and all_gather_into_tensor of bf16
  buffers of S = --bus-sizes MiB (1 for latency, 64 and 512 for bandwidth), 5 untimed calls, then
  200 (small) to 20 (large) timed calls between synchronizations; time per call averaged over the
  ranks; algbw = S / time, busbw = algbw × 2(n−1)/n (all_reduce) or × (n−1)/n (the other two),
  GB/s, as nccl-tests' PERFORMANCE.md defines them.
lm: each (model, micro-batch per GPU in --batches) runs 1-GPU dp and DDP (the scaling baseline),
  then every --pairs strategy on N GPUs against its PyTorch match (bench/torch_dist_worker.py:
  DDP with 25 MiB buckets, DDP + ZeroRedundancyOptimizer, FSDP2 fully_shard per block with
  reshard_after_forward False, and True for zero3): the same sequence length, steps (gpt2-medium
  40, gpt2-xl 15) and untimed warmup (10, 5). tokens/s per GPU = tokens/s of all ranks ÷ GPUs over
  the timed steps (shardtrain: its metrics.jsonl; PyTorch: synchronize + barrier around them);
  scaling = tokens/s per GPU on N GPUs ÷ that of 1-GPU dp (PyTorch: ÷ 1-GPU DDP), same model and
  micro-batch; peak = allocated bytes (shardtrain rank 0, PyTorch the maximum over ranks); estimate
  = `shardtrain estimate`'s total per rank. Every shardtrain job runs with --wall-clock-breakdown:
  its step records then carry forward_ms, backward_ms, reduce_wait_ms, optimizer_ms, the device
  time per step of each phase from CUDA events recorded on the compute stream and read after the
  step's own synchronization (no extra wait inside the step), so the throughput is measured in the
  same run (--no-breakdown measures without). Those are averaged over the timed steps into "where
  the step goes": step ms (wall), compute = forward + backward (backward includes the reductions it
  overlaps), exposed communication = reduce_wait_ms (reductions still running after backward),
  optimizer ms (clipping and update; zero1-3: with the all-gather of the updated parameters).
  Collectives per optimizer step and GPU, from Ψ (the log banner's "(N parameters)") in the compute
  dtype (bf16: 2 bytes; fp32 master weights are not communicated), S = 2Ψ: dp all-reduces S of
  gradients; zero1 and zero2 reduce-scatter S of gradients and all-gather S of updated bf16
  parameters; zero3 all-gathers S in forward and again in backward and reduce-scatters S. Bus bytes
  per GPU = 2(n−1)/n·S (all-reduce) or (n−1)/n·S (the others); the minimum communication time per
  step = Σ bus bytes ÷ busbw of that collective (the best the `bus` suite measured, in the same
  invocation or from --bus-json); min comm ÷ step = the share of the measured step the collectives
  would take if none of them overlapped compute.
pipeline: bench/bench_pipeline_gpus.py (its docstring), N stages on N GPUs; its --model, --batch,
  --steps, --warmup are --pipeline-model, --pipeline-batch, --pipeline-steps, --pipeline-warmup
  here; interleaved-1f1b runs once per --interleaved-partitions method (uniform, parameters).
image: each model in --image-models and shape in --image-shapes (32² micro-batch 256 on
  Fashion-MNIST: 1 channel, 10 classes; 224² micro-batch 64 on synthetic images: 3 channels, 1000
  classes): shardtrain `train --strategy ddp --precision bf16` on 1 GPU and on N GPUs (with
  --image-nographs also on N GPUs with --no-cuda-graphs), PyTorch DDP on N GPUs
  (bench/torch_image_worker.py: the torchvision model of bench/bench_image_models.py, channels_last,
  bf16 autocast, fused AdamW, a random batch already on each GPU), the same micro-batch per GPU;
  60 steps (20 untimed) up to 64², else 30 (10). images/s per GPU (shardtrain: metrics.jsonl's
  images_per_s, its data pipeline included), scaling = shardtrain per GPU on N ÷ on 1 GPU,
  shardtrain ÷ PyTorch on N GPUs, and whether shardtrain's banner said "CUDA graphs: on".
nodes (bench/multi_gpu_nodes.py): N = --nodes (default 2) emulated nodes of G = --gpus-per-node
  GPUs (default: the visible GPUs ÷ N); node n gets GPUs n·G … n·G+G−1 in CUDA_VISIBLE_DEVICES
  and NCCL_HOSTID=node<n>, so NCCL takes them for separate hosts (its network transport between
  them: sockets over this host's interfaces, or InfiniBand where it has some; NVLink within one).
  A job is one launcher per node, all started together, each in its own process group: `shardtrain
  launch --nnodes N --node-rank n --nproc-per-node G --master-addr 127.0.0.1 --master-port P --
  train ...` or `python -m torch.distributed.run --nnodes N --node-rank n ...`; when one fails
  the others are stopped; one timeout per cell (--cell-timeout, else 150 s, gpt2-xl 240 s; × 1.5
  with accumulation). First the link: bench/torch_bus_worker.py (as in `bus`, --bus-sizes: 1 MiB
  for latency, 64 and 512 MiB) across the N × G ranks, and within node 0's G GPUs when G > 1.
  Then per --models (default gpt2-medium,gpt2-xl) and --batches (default 4,16): 1-GPU dp (the
  compute time); each --pairs strategy (default dp,zero2,zero3) across the nodes against PyTorch
  across the same nodes (DDP, FSDP2, FSDP2 resharding after forward; torch_dist_worker.py as in
  lm); and as --node-variants chooses (default all): dp --hierarchical-all-reduce (reduce-scatter
  within the node, all-reduce of each GPU's 1/G across the nodes, all-gather within the node),
  the same with --quantized-gradients (that 1/G crosses as int8 with a scale per 256 elements),
  each strategy with --gradient-accumulation-steps --node-accum (default 4; PyTorch not run so),
  each strategy by one launcher on N·G GPUs of one node (flat). Steps and warmup as lm (with
  accumulation: warmup 5 and 1/A of the timed steps, at least 5). Per row: tokens/s per GPU (as
  lm), step ms (wall time per optimizer step), st ÷ pt, st ÷ flat; the bytes that must cross the
  nodes per GPU and optimizer step, counted as nccl-tests counts bus bytes, S = Ψ × 2 (bf16; Ψ from
  the log banner), n = N·G: dp an all-reduce, 2(n−1)/n·S; hierarchical only its cross-node
  all-reduce, 2(N−1)/N·S/G (int8: an all-gather of (N−1)·Ψ/G·(1 + 4/256)); zero1 a reduce-scatter and an all-gather, (n−1)/n·S each; zero2 the
  reduce-scatter in every micro-batch's backward, the all-gather once per step; zero3 two
  all-gathers and a reduce-scatter every micro-batch (so with accumulation A, dp's gradients
  cross once per A micro-batches). comm ms = those bytes ÷ the measured cross-node busbw of each
  collective (its best size), taking every GPU to have its own path across (where a node's GPUs
  share one, hierarchical's true time is up to G× more); compute ms = the 1-GPU dp step of the
  same model and micro-batch (accumulation A: + (A−1) × its forward + backward); bound = max(comm,
  compute) as tokens/s per GPU; st (pt) ÷ bound = the share of it reached. The flat rows' comm ms
  uses the bus bandwidth of N·G GPUs of one node, when `bus` ran with --gpus N·G (or --bus-json
  has it).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Re-exported: bench_zero3_single_gpu.py, bench_offload.py and image_accuracy_multi_gpu.py import
# these from here.
from multi_gpu_common import (COMM_TIMEOUT, RESULT_TAG, UNITS, WORKER, Budget,  # noqa: E402,F401
                              bench_env, describe, human, job_error, parse_estimate,
                              parse_metrics, prepare_paths, print_context, result_header,
                              run_context, run_estimate, run_job, run_tagged_job, run_train_job,
                              torch_runs)
import bench_pipeline_gpus as pipeline_suite  # noqa: E402
import multi_gpu_bus as bus_suite  # noqa: E402
import multi_gpu_image as image_suite  # noqa: E402
import multi_gpu_lm as lm_suite  # noqa: E402
import multi_gpu_nodes as nodes_suite  # noqa: E402
from multi_gpu_lm import PAIRS  # noqa: E402,F401  (the lm pairs, for older callers)

__all__ = ["COMM_TIMEOUT", "PAIRS", "RESULT_TAG", "UNITS", "WORKER", "bench_env", "describe",
           "human", "job_error", "parse_estimate", "parse_metrics", "prepare_paths",
           "result_header", "run_estimate", "run_job", "run_tagged_job", "run_train_job",
           "torch_runs", "main"]

SUITES = ("bus", "lm", "pipeline", "image", "nodes")
TITLES = {"bus": "NCCL bus bandwidth (PyTorch)",
          "lm": "GPT-2 data parallelism: shardtrain against PyTorch",
          "pipeline": "Pipeline schedules: shardtrain against torch.distributed.pipelining",
          "image": "Image classifiers, data parallel: shardtrain against PyTorch DDP",
          "nodes": "Across emulated nodes"}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="lm",
                    help="comma list of bus, lm, pipeline, image, nodes, or all (default lm)")
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--gpus", type=int, default=2,
                    help="N: the GPUs (ranks) of the multi-GPU cells (default 2)")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python with torch (transformers, torchvision) for the PyTorch jobs")
    ap.add_argument("--cell-timeout", type=float, default=None,
                    help="seconds per job (default: lm 90, gpt2-xl 150; pipeline 150 for gpt2-xl, "
                         "else 90; image 120; bus 120; nodes 150, gpt2-xl 240, its link 180)")
    ap.add_argument("--budget", type=float, default=500,
                    help="seconds for the whole run: later jobs are skipped, the tables printed")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke test of the script: --device cpu, gloo, tiny models, few steps")
    ap.add_argument("--commit", default=None,
                    help="the commit named in the tables (default: this checkout's, from git)")
    ap.add_argument("--out", default="bench_multi_gpu.json")
    ap.add_argument("--workdir", default="/tmp/bench_multi_gpu")
    lm_suite.add_arguments(ap)
    bus_suite.add_arguments(ap)
    pipeline_suite.add_arguments(ap, unified=True)
    image_suite.add_arguments(ap)
    nodes_suite.add_arguments(ap)
    a = ap.parse_args()
    wanted = SUITES if a.suite == "all" else tuple(a.suite.split(","))
    unknown = set(wanted) - set(SUITES)
    if unknown:
        ap.error(f"--suite: unknown {sorted(unknown)}; choose from {', '.join(SUITES)} or all")
    a.suites = [s for s in SUITES if s in wanted]
    if a.gpus < 1:
        ap.error("--gpus must be 1 or more")
    if a.gpus < 2 and {"bus", "pipeline"} & set(a.suites):
        ap.error("the bus and pipeline suites need --gpus 2 or more")
    a.device = "cpu" if a.smoke else "cuda"
    prepare_paths(ap, a)
    a.node_suite = None
    if "nodes" in a.suites:  # its own namespace, taken before lm fills in its defaults
        a.node_suite = argparse.Namespace(**vars(a))
        nodes_suite.configure(ap, a.node_suite)
    if "lm" in a.suites:
        lm_suite.configure(ap, a)
    if "bus" in a.suites:
        bus_suite.configure(ap, a)
    if "image" in a.suites:
        image_suite.configure(ap, a)
    a.pipe = None
    if "pipeline" in a.suites:  # its own namespace: its --steps etc. are not lm's
        a.pipe = argparse.Namespace(**vars(a))
        a.pipe.stages = a.gpus
        a.pipe.seq = a.seq if "lm" in a.suites else None
        pipeline_suite.configure(ap, a.pipe)
    return a


def errors(x):
    """The cells of a result that failed (budget skips not counted), and those skipped."""
    failed = skipped = 0
    if isinstance(x, dict):
        if x.get("budget_skipped"):
            return 0, 1
        if "error" in x:
            return 1, 0
        items = x.values()
    elif isinstance(x, list):
        items = x
    else:
        return 0, 0
    for v in items:
        f, s = errors(v)
        failed, skipped = failed + f, skipped + s
    return failed, skipped


def main():
    a = parse_args()
    budget = Budget(a.budget)
    env = bench_env(a.smoke)
    ctx = run_context(a)
    res = result_header(a, context=ctx, gpus=a.gpus, suites={})
    print(f"shardtrain: {res['shardtrain_version']}; GPUs: {ctx['gpus']}; suites: "
          f"{', '.join(a.suites)}; budget {a.budget:.0f} s", flush=True)

    def saver(name):
        def save(suite_result):
            res["suites"][name] = suite_result
            res["wall_s"] = budget.elapsed()
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return save

    busbw = source = None
    for name in a.suites:
        save = saver(name)
        if name == "bus":
            r = bus_suite.run(a, budget, env)
            busbw, source = r.get("busbw_GBps"), "measured in this run"
        elif name == "lm":
            if busbw is None and a.bus_json:
                busbw, source = bus_suite.load_busbw(a.bus_json), "from " + a.bus_json
            r = lm_suite.run(a, budget, env, busbw, save, source)
        elif name == "pipeline":
            r = pipeline_suite.run(a.pipe, budget, env, save)
        elif name == "nodes":  # the flat rows' bound: the bus bandwidth of N·G GPUs, if known
            flat, flat_source = busbw, source
            if flat is None and a.bus_json:
                flat, flat_source = nodes_suite.from_json(a.bus_json)[0], "from " + a.bus_json
            if a.gpus != a.node_suite.gpus_per_node * a.nodes:
                flat = None
            r = nodes_suite.run(a.node_suite, budget, env, save, flat, flat_source)
        else:
            r = image_suite.run(a, budget, env, save)
        save(r)

    modules = {"bus": bus_suite, "lm": lm_suite, "pipeline": pipeline_suite, "image": image_suite,
               "nodes": nodes_suite}
    for name in a.suites:  # problems first, then the tables, so the output ends with the tables
        modules[name].print_problems(res["suites"][name])
    for name in a.suites:
        print_context(ctx, TITLES[name] + (nodes_suite.layout_title(a.node_suite)
                                           if name == "nodes" else f", {a.gpus} GPUs"))
        modules[name].print_tables(res["suites"][name])
        if a.smoke and name != "pipeline":  # the pipeline's table says it itself
            print("smoke mode (CPU): every number is a CPU process's; they mean nothing.")
    failed, skipped = errors(res["suites"])
    print(f"\n{', '.join(a.suites)} in {budget.elapsed():.0f} s; {failed} cell(s) failed"
          + (f"; {skipped} not run: --budget {a.budget:.0f} s spent" if skipped else "")
          + f"; JSON: {a.out}; logs: {a.workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
