#!/usr/bin/env python3
"""Multi-GPU benchmark (issue 4): shardtrain dp / zero1 / zero2 against PyTorch DDP /
ZeroRedundancyOptimizer / FSDP2 (reshard_after_forward=False) on identical shapes, on 1 and N GPUs
of one host, in one run: tokens/s per GPU, scaling N vs 1 GPU, peak memory per GPU, and the
`shardtrain estimate` prediction next to shardtrain's measured peak.

    NCCL_NVLS_ENABLE=0 python3 bench/bench_multi_gpu.py --shardtrain ./build/shardtrain --gpus 2
Not a test; docs/BENCHMARKS.md records results with GPU and date.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

PAIRS = [("dp", "ddp"), ("zero1", "zero"), ("zero2", "fsdp2")]
HERE = os.path.dirname(os.path.abspath(__file__))


def run_shardtrain(binary, strategy, model, gpus, batch, seq, steps, workdir):
    out = os.path.join(workdir, f"{model}_{strategy}_{gpus}")
    cmd = [binary, "launch", "--nproc-per-node", str(gpus), "--", "train", "--model", model,
           "--dataset", "wikitext-2", "--device", "cuda", "--strategy", strategy,
           "--batch-size", str(batch), "--max-length", str(seq), "--max-steps", str(steps),
           "--log-interval", "5", "--warmup-steps", "5", "--eval-samples", str(batch),
           "--no-save", "--output-dir", out]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": (p.stdout + p.stderr)[-1500:]}
    recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    win = [r for r in recs if "loss" in r and r.get("step", 0) > 10 and r["step"] % 5 == 0]
    tok = sum(r["tokens_per_s"] * r["step_time_s"] for r in win) / sum(r["step_time_s"] for r in win)
    ep = [r for r in recs if "peak_memory_bytes" in r][-1]
    est = subprocess.run([binary, "estimate", "--model", model, "--gpus", str(gpus),
                          "--micro-batch", str(batch), "--max-length", str(seq)],
                         capture_output=True, text=True).stdout
    m = re.search(rf"^{strategy}\s+\S+ \S+\s+\S+ \S+\s+\S+ \S+\s+([\d.]+) GiB", est, re.M)
    return {"tokens_per_s": tok, "per_gpu": tok / gpus, "peak_allocated": ep["device_peak_allocated_bytes"],
            "peak_reserved": ep["device_peak_reserved_bytes"],
            "estimate_gib": float(m.group(1)) if m else None}


def run_torch(strategy, model, gpus, batch, seq, steps):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           os.path.join(HERE, "torch_dist_worker.py"), "--strategy", strategy, "--model", model,
           "--batch", str(batch), "--seq", str(seq), "--steps", str(steps)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (p.stdout + p.stderr)[-1500:]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--models", default="gpt2-medium,gpt2-xl")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="bench_multi_gpu.json")
    ap.add_argument("--workdir", default="/tmp/bench_multi_gpu")
    a = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.makedirs(a.workdir, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d"), "rows": []}
    for model in a.models.split(","):
        for ours, theirs in PAIRS:
            for g in sorted({1, a.gpus}):
                r_ours = run_shardtrain(a.shardtrain, ours, model, g, a.batch, a.seq, a.steps, a.workdir)
                r_torch = run_torch(theirs, model, g, a.batch, a.seq, a.steps)
                row = {"model": model, "gpus": g, "shardtrain": ours, "torch": theirs,
                       "ours": r_ours, "theirs": r_torch}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)
    print(f"\n{'model':12} {'gpus':>4} {'strategy':14} {'ours tok/s/GPU':>14} {'torch':>10} {'ratio':>6} "
          f"{'ours peak':>10} {'torch peak':>10} {'estimate':>9}")
    for r in res["rows"]:
        o, t = r["ours"], r["theirs"]
        if "error" in o or "error" in t:
            print(f"{r['model']:12} {r['gpus']:4} {r['shardtrain']}/{r['torch']}: error")
            continue
        print(f"{r['model']:12} {r['gpus']:4} {r['shardtrain'] + '/' + r['torch']:14} {o['per_gpu']:14.0f} "
              f"{t['per_gpu']:10.0f} {o['per_gpu'] / t['per_gpu']:6.2f} {o['peak_allocated'] / 2**30:9.2f}G "
              f"{t['peak_allocated'] / 2**30:9.2f}G {o['estimate_gib'] or float('nan'):8.2f}G")


if __name__ == "__main__":
    sys.exit(main())
