#!/usr/bin/env python3
"""Multi-GPU speed benchmarks: shardtrain on N GPUs of one host (any N; N = --gpus) against
PyTorch doing the same work, in suites chosen with --suite (a comma list, default lm; `all` =
bus,lm,pipeline,image; they run in that order, whatever the order given):

  bus       the NCCL bus bandwidth of the N GPUs, measured with PyTorch (torch.distributed)
  lm        GPT-2 data parallelism: shardtrain dp / zero1 / zero2 / zero3 against PyTorch DDP /
            ZeroRedundancyOptimizer / FSDP2 / FSDP2 resharding after forward, per micro-batch,
            with the 1-GPU dp baseline, where the step goes and what its collectives move
  pipeline  shardtrain's pipeline schedules against torch.distributed.pipelining, N stages
  image     image classifiers, shardtrain ddp on 1 and N GPUs against PyTorch DDP on N GPUs

Usage (GPU machine, after `source bench/device_env.sh`). A job is mostly start-up (10-30 s), so
the defaults take long: lm about 40 jobs (2 models × 2 micro-batches × 10), pipeline 20, image 18
(24 with --image-nographs). Split so that each command fits its --budget (default 500 s), e.g.:
    python3 bench/bench_multi_gpu.py --shardtrain .device/shardtrain --gpus 2 --suite bus,lm \\
        --models gpt2-medium --out $OUT/lm_medium.json --workdir $OUT/multi_gpu
    python3 bench/bench_multi_gpu.py --shardtrain .device/shardtrain --gpus 2 --suite bus,lm \\
        --models gpt2-xl --batches 4 --out $OUT/lm_xl_mb4.json \\
        --workdir $OUT/multi_gpu                      # and again with --batches 16
    python3 bench/bench_multi_gpu.py --shardtrain .device/shardtrain --gpus 2 --suite pipeline \\
        --micro-batches 8 --svg-dir $OUT/pipeline_svg --out $OUT/pipeline_M8.json \\
        --workdir $OUT/multi_gpu                      # and again with --micro-batches 16
    python3 bench/bench_multi_gpu.py --shardtrain .device/shardtrain --gpus 2 --suite image \\
        --image-nographs --out $OUT/image.json --workdir $OUT/multi_gpu
(`bus` takes half a minute; `--suite lm --bus-json FILE` instead reuses the bus bandwidth of an
earlier --out JSON. Where the checkout has no git history, --commit names the commit.)
CPU smoke test of the script itself (every suite: shardtrain --device cpu, its ranks under mpirun
through `shardtrain launch`; PyTorch on gloo; tiny models and images, a few steps; about 3 minutes
on 2 cores; a Python with torch, torchvision and transformers; set SHARDTRAIN_DATA_DIR when the
binary is not in its build tree):
    PY_WITH_TORCH bench/bench_multi_gpu.py --smoke --gpus 2 --suite all \\
        --shardtrain build/shardtrain

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
from multi_gpu_lm import PAIRS  # noqa: E402,F401  (the lm pairs, for older callers)

__all__ = ["COMM_TIMEOUT", "PAIRS", "RESULT_TAG", "UNITS", "WORKER", "bench_env", "describe",
           "human", "job_error", "parse_estimate", "parse_metrics", "prepare_paths",
           "result_header", "run_estimate", "run_job", "run_tagged_job", "run_train_job",
           "torch_runs", "main"]

SUITES = ("bus", "lm", "pipeline", "image")
TITLES = {"bus": "NCCL bus bandwidth (PyTorch)",
          "lm": "GPT-2 data parallelism: shardtrain against PyTorch",
          "pipeline": "Pipeline schedules: shardtrain against torch.distributed.pipelining",
          "image": "Image classifiers, data parallel: shardtrain against PyTorch DDP"}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="lm",
                    help="comma list of bus, lm, pipeline, image, or all (default lm)")
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--gpus", type=int, default=2,
                    help="N: the GPUs (ranks) of the multi-GPU cells (default 2)")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python with torch (transformers, torchvision) for the PyTorch jobs")
    ap.add_argument("--cell-timeout", type=float, default=None,
                    help="seconds per job (default: lm 90, gpt2-xl 150; pipeline 150 for gpt2-xl, "
                         "else 90; image 120; bus 120)")
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
        else:
            r = image_suite.run(a, budget, env, save)
        save(r)

    modules = {"bus": bus_suite, "lm": lm_suite, "pipeline": pipeline_suite, "image": image_suite}
    for name in a.suites:  # problems first, then the tables, so the output ends with the tables
        modules[name].print_problems(res["suites"][name])
    for name in a.suites:
        print_context(ctx, TITLES[name] + f", {a.gpus} GPUs")
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
