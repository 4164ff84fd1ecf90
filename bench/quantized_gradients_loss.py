#!/usr/bin/env python3
"""What int8 cross-node gradients (--quantized-gradients, DeepSpeed ZeRO++'s qgZ) do to the loss
curve: each strategy trains twice across N nodes emulated on one host (one `shardtrain launch
--nnodes N` per node, its G GPUs in CUDA_VISIBLE_DEVICES, NCCL_HOSTID=node<n>, as the nodes suite of
bench_multi_gpu.py), once with the gradients crossing the nodes in the compute dtype (bf16) and
once with --hierarchical-all-reduce --quantized-gradients, from the same initialization on the
same batches; the table gives the mean training loss of the last 50 steps, the validation loss at
the end, their difference in percent, and the step time of each run.

    python3 bench/quantized_gradients_loss.py --shardtrain build/shardtrain --nodes 2 \\
        --gpus-per-node 1 --model gpt2 --steps 500 --strategies dp,zero2,zero3 \\
        --out quantized_loss.json --workdir /tmp/quantized_loss

--smoke: CPU ranks (one launch of N·G ranks: CPU jobs across nodes start through mpirun with a
hostfile, so the nodes are not emulated), the tiny model, few steps.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multi_gpu_common import bench_env, free_port, git_commit  # noqa: E402
from multi_gpu_nodes import launch_args, node_env, run_group, shown  # noqa: E402

LOG_INTERVAL = 10
LAST = 50  # steps whose mean training loss is compared


def run(a, strategy, quantized, env):
    """One training run; returns its losses, validation loss, step time and commands."""
    name = f"{strategy}_{'int8' if quantized else 'bf16'}"
    out = os.path.join(a.workdir, name)
    os.makedirs(out, exist_ok=True)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # shardtrain appends to it
    train = ["train", "--model", a.model, "--dataset", "wikitext-2", "--device", a.device,
             "--strategy", strategy, "--batch-size", str(a.batch), "--max-length", str(a.seq),
             "--max-steps", str(a.steps), "--log-interval", str(LOG_INTERVAL),
             "--eval-samples", str(a.eval_samples), "--seed", "1234", "--no-save",
             "--output-dir", out]
    if quantized:
        train += ["--hierarchical-all-reduce", "--quantized-gradients"]
    port = free_port()
    jobs = []
    launchers = 1 if a.smoke else a.nodes
    for n in range(launchers):
        launch = launch_args(a, port, a.nodes * a.gpus_per_node) if a.smoke else \
            launch_args(a, port, a.gpus_per_node, n)
        e, extra = (dict(env), {}) if a.smoke else node_env(a, env, n)
        cmd = launch + train
        jobs.append((cmd, e, os.path.join(a.workdir, f"{name}_node{n}.log"), shown(cmd, extra)))
    t0 = time.time()
    rcs, texts, problem = run_group(jobs, a.timeout)
    recs = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
    done = [r for r in recs if r.get("event") == "done"]
    if problem or not done:
        return {"error": problem or "no done record", "log_tail": texts[0][-1500:],
                "commands": [j[3] for j in jobs]}
    steps = [r for r in recs if "loss" in r and "step_time_s" in r]
    last = [r["loss"] for r in steps if r["step"] > a.steps - LAST]
    timed = [r["step_time_s"] for r in steps if r["step"] > LOG_INTERVAL]
    return {"losses": [[r["step"], r["loss"]] for r in steps],
            "last_mean": sum(last) / len(last), "val_loss": done[-1]["val_loss"],
            "step_ms": 1e3 * sum(timed) / len(timed) if timed else None,
            "cross_node_bytes_per_step": next((r.get("cross_node_bytes_per_step") for r in recs
                                               if "cross_node_bytes_per_step" in r), None),
            "wall_s": time.time() - t0, "commands": [j[3] for j in jobs]}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=1)
    ap.add_argument("--model", default=None, help="default gpt2 (smoke: gpt2-micro)")
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per GPU")
    ap.add_argument("--seq", type=int, default=None, help="default 512 (smoke: 64)")
    ap.add_argument("--steps", type=int, default=None, help="default 500 (smoke: 60)")
    ap.add_argument("--eval-samples", type=int, default=256)
    ap.add_argument("--strategies", default="dp,zero2,zero3")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="quantized_gradients_loss.json")
    ap.add_argument("--workdir", default="/tmp/quantized_gradients_loss")
    a = ap.parse_args()
    a.device = "cpu" if a.smoke else "cuda"
    a.model = a.model or ("gpt2-micro" if a.smoke else "gpt2")
    a.seq = a.seq or (64 if a.smoke else 512)
    a.steps = a.steps or (60 if a.smoke else 500)
    if a.steps < LAST + LOG_INTERVAL:
        ap.error(f"--steps must be at least {LAST + LOG_INTERVAL}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(a.nodes * a.gpus_per_node)]
    a.node_ids = [ids[n * a.gpus_per_node:(n + 1) * a.gpus_per_node] for n in range(a.nodes)]
    a.shardtrain = os.path.abspath(a.shardtrain)
    os.makedirs(a.workdir, exist_ok=True)
    env = bench_env(a.smoke)
    if a.smoke:
        env.setdefault("OMP_NUM_THREADS", "1")
    res = {"commit": git_commit(a.commit), "nodes": a.nodes, "gpus_per_node": a.gpus_per_node,
           "model": a.model, "batch": a.batch, "seq": a.seq, "steps": a.steps, "rows": []}
    for strategy in a.strategies.split(","):
        row = {"strategy": strategy}
        for quantized in (False, True):
            r = run(a, strategy, quantized, env)
            row["int8" if quantized else "bf16"] = r
            print(f"{strategy} {'int8' if quantized else 'bf16'}: "
                  + (f"last-{LAST} loss {r['last_mean']:.4f}, val {r['val_loss']:.4f}, "
                     f"step {r['step_ms']:.1f} ms" if "error" not in r else "error: "
                     + r["error"]), flush=True)
        res["rows"].append(row)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\n| strategy | {a.nodes} nodes × {a.gpus_per_node} | mean loss, last {LAST} steps | "
          "validation loss | step ms |")
    print("|---|---|---:|---:|---:|")
    for row in res["rows"]:
        for k in ("bf16", "int8"):
            r = row[k]
            if "error" in r:
                print(f"| {row['strategy']} | {k} | error | | |")
                continue
            b = row["bf16"]
            diff = "" if k == "bf16" or "error" in b else \
                f" ({100 * (r['last_mean'] / b['last_mean'] - 1):+.2f}%)"
            vdiff = "" if k == "bf16" or "error" in b else \
                f" ({100 * (r['val_loss'] / b['val_loss'] - 1):+.2f}%)"
            print(f"| {row['strategy']} | {k} | {r['last_mean']:.4f}{diff} | "
                  f"{r['val_loss']:.4f}{vdiff} | {r['step_ms']:.1f} |")
    print(f"\n{a.model}, micro-batch {a.batch} × {a.seq} per GPU, {a.steps} steps, seed 1234; "
          "int8 = --hierarchical-all-reduce --quantized-gradients (every gradient byte that "
          "crosses the nodes as int8 with one fp32 scale per 256 elements); validation on "
          f"{a.eval_samples} samples. Commit {res['commit']}.")


if __name__ == "__main__":
    main()
