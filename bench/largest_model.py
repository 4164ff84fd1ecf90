#!/usr/bin/env python3
"""The largest GPT one GPU trains, per placement, against the estimate and the machine's limits.

Rows (GPT-2 shapes scaled in depth and width, `train --model config.json`; micro-batch 1 x 512,
activation checkpointing, 10 steps at lr 1e-5 with 3 warmup steps):
  gpu       zero3 on one GPU, everything on it                  --gpu-shapes (first that trains)
  offload   ZeRO-Offload: optimizer state and step on the CPU    --offload-shapes
  infinity  ZeRO-Infinity (DeepSpeed JSON): zero3, offload_optimizer nvme with ratio 0.75 and
            max_in_cpu = what --host-memory-gib holds (the planner's figure), offload_param nvme
                                                                 --infinity-shapes
  auto      `--offload auto --train-batch-size S` (--auto-batch sequences per step over --gpus
            GPUs, bf16 AdamW moments, clipping off): the planner chooses the micro-batch, the
            accumulation and the placement; its predicted tokens/s beside the measured (steps
            3 on, 6 steps)                                       --auto-shapes (first that trains)
  peer      PyTorch FSDP2 + CPUOffloadPolicy (bench/torch_dist_worker.py --cpu-offload --shape),
            4 steps                                              --peer-shapes (first that trains)
For each run: steady step time (steps 3..10), the loss, peak GPU memory, peak host RSS and NVMe
bytes against `shardtrain estimate` (the placement table's row for the run's plan), and the step
against its bound: the slowest of GPU compute, PCIe traffic / pinned bandwidth, CPU AdamW bytes /
its measured rate, swap bytes / disk bandwidth, with the rates bench_host_limits measures first in
the same run (bench/host_limits.cu).

Usage (GPU machine; `bash bench/run.sh largest-model` wraps it):
    python3 bench/largest_model.py --shardtrain .packed/shardtrain --limits-bin .packed/bench_host_limits \
        --nvme-path /tmp/nvme_offload --out largest.json --workdir /tmp/largest
Not a test: the numbers depend on the machine; docs/BENCHMARKS.md records them with GPU and date.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, CONTEXT = 50257, 1024
GIB = 1024 ** 3


def params(L, C):
    return 12 * L * C * C + 13 * L * C + (VOCAB + CONTEXT) * C + 2 * C


def shapes(text):
    """'name:L:C:H,...' -> [(name, L, C, H)]"""
    out = []
    for item in filter(None, text.split(",")):
        name, L, C, H = item.split(":")
        out.append((name, int(L), int(C), int(H)))
    return out


def run(cmd, log, timeout, env=None):
    t0 = time.time()
    with open(log, "w") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                env=env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.time() - t0, open(log).read()


def config_json(workdir, name, L, C, H):
    d = os.path.join(workdir, name)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "config.json")
    json.dump({"model_type": "gpt2", "n_layer": L, "n_embd": C, "n_head": H,
               "vocab_size": VOCAB, "n_positions": CONTEXT}, open(path, "w"))
    return path


def estimate(a, cfg, log):
    """The placement table of `shardtrain estimate`: {row name: {gpu, host, nvme, step_s, bound}}
    and {row name: max_in_cpu}."""
    cmd = [a.shardtrain, "estimate", "--model", cfg, "--micro-batch", "1", "--max-length", "512",
           "--activation-checkpointing", "--gpu-memory", str(a.gpu_memory_gib),
           "--max-host-memory", str(a.host_memory_gib), "--nvme-path", a.nvme_path]
    if a.limits_json:
        cmd += ["--limits", a.limits_json]
    _, _, text = run(cmd, log, 120)
    unit = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": GIB, "TiB": 1024 ** 4}
    size = r"([\d.]+) (B|KiB|MiB|GiB|TiB)"
    rows, mic = {}, {}
    for line in text.splitlines():
        m = re.match(rf"^[* ] (\S+(?: r=[\d.]+)?)\s+{size}\s+{size}\s+{size}\s+{size}\s+{size}\s+"
                     r"([\d.]+)\s+(.*)$", line)
        if m:
            g = m.groups()
            b = [float(g[i]) * unit[g[i + 1]] for i in range(1, 11, 2)]
            rows[g[0]] = {"gpu": b[0], "host": b[1], "nvme": b[2], "pcie_per_step": b[3],
                          "disk_per_step": b[4], "step_s": float(g[11]), "bound": g[12]}
        m = re.match(r"^\s+(\S+ r=[\d.]+): offload_optimizer.max_in_cpu ([\d,]+)", line)
        if m:
            mic[m.group(1)] = int(m.group(2).replace(",", ""))
    return rows, mic


def read_steady(r, out_dir, text):
    """Adds the run's losses, mean step time of steps 3 on and memory peaks (from out_dir's
    metrics.jsonl) to the row `r`, or its error (the log's last lines). Returns False on error."""
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if r["exit"] != 0 or not os.path.exists(metrics):
        r["error"] = "\n".join(text.splitlines()[-6:])
        return False
    recs = [json.loads(x) for x in open(metrics)]
    steps = [x for x in recs if "loss" in x and "step_time_s" in x]
    steady = [x for x in steps if x["step"] >= 3]
    epoch = [x for x in recs if "device_peak_allocated_bytes" in x][-1]
    r.update(losses=[round(x["loss"], 4) for x in steps],
             step_s=sum(x["step_time_s"] for x in steady) / max(1, len(steady)),
             gpu_peak=epoch["device_peak_allocated_bytes"], host_rss=epoch.get("peak_rss_bytes"),
             host_pinned=epoch.get("host_pinned_bytes"), host_pageable=epoch.get("host_pageable_bytes"),
             nvme=epoch.get("nvme_bytes"))
    return True


def train_row(a, row, name, L, C, H):
    cfg = config_json(a.workdir, name, L, C, H)
    est, mic = estimate(a, cfg, os.path.join(a.workdir, f"{row}_{name}.estimate.txt"))
    plan = {"gpu": "zero3", "offload": "offload r=1", "infinity": "infinity r=0.75"}[row]
    out_dir = os.path.join(a.workdir, f"{row}_{name}")
    cmd = [a.shardtrain, "train", "--model", cfg, "--dataset", "wikitext-2", "--batch-size", "1",
           "--max-length", "512", "--max-steps", "10", "--activation-checkpointing", "--no-save",
           "--eval-samples", "2", "--log-interval", "1", "--warmup-steps", "3",
           "--wall-clock-breakdown", "--output-dir", out_dir]
    if row == "gpu":
        cmd += ["--strategy", "zero3", "--lr", "1e-5"]
    elif row == "offload":
        cmd += ["--strategy", "offload", "--lr", "1e-5"]
    else:
        if plan not in est:
            return {"case": name, "error": f"the estimate has no {plan} row (see its log)"}
        ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.95],
                                                        "eps": 1e-8, "weight_decay": 0.1}},
              "zero_optimization": {
                  "stage": 3,
                  "offload_optimizer": {"device": "nvme", "nvme_path": a.nvme_path, "ratio": 0.75,
                                        "max_in_cpu": mic.get(plan, 0)},
                  "offload_param": {"device": "nvme", "nvme_path": a.nvme_path},
                  "overlap_comm": True},
              "aio": {"block_size": 1048576, "queue_depth": 16, "thread_count": 4}}
        path = os.path.join(a.workdir, f"ds_infinity_{name}.json")
        json.dump(ds, open(path, "w"), indent=2)
        cmd += ["--deepspeed-config", path]
    rc, wall, text = run(cmd, os.path.join(a.workdir, f"{row}_{name}.log"), a.timeout)
    r = {"case": name, "shape": f"L{L} d{C} h{H}", "parameters": params(L, C), "plan": plan,
         "command": " ".join(cmd), "exit": rc, "wall_s": round(wall, 1), "estimate": est.get(plan)}
    if not read_steady(r, out_dir, text):
        return r
    m = re.search(r"^done .*$", text, re.M)
    r["done"] = m.group(0) if m else None
    return r


def auto_row(a, name, L, C, H):
    """`--offload auto` given only the global batch: the plan and split it chose, its predicted
    step beside the measured one (mean of steps 3..6)."""
    cfg = config_json(a.workdir, name, L, C, H)
    out_dir = os.path.join(a.workdir, f"auto_{name}")
    cmd = [a.shardtrain]
    if a.gpus > 1:
        cmd += ["launch", "--nproc-per-node", str(a.gpus), "--"]
    cmd += ["train", "--model", cfg, "--dataset", "wikitext-2", "--offload", "auto",
            "--train-batch-size", str(a.auto_batch), "--max-length", "512", "--max-steps", "6",
            "--activation-checkpointing", "--offload-moments-dtype", "bf16", "--grad-clip", "0",
            "--nvme-path", a.nvme_path, "--no-save", "--eval-samples", "2", "--log-interval", "1",
            "--warmup-steps", "0", "--lr", "1e-5", "--wall-clock-breakdown",
            "--output-dir", out_dir]
    rc, wall, text = run(cmd, os.path.join(a.workdir, f"auto_{name}.log"), a.timeout)
    r = {"case": name, "shape": f"L{L} d{C} h{H}", "parameters": params(L, C), "plan": "auto",
         "command": " ".join(cmd), "exit": rc, "wall_s": round(wall, 1)}
    for key, pattern in (("split", r"global batch \d+ sequences: (micro-batch \d+ × accumulation \d+)"),
                         ("chosen", r"; chose ([^:]+):"),
                         ("predicted_step_s", r"predicted step ([\d.]+) s"),
                         ("predicted_tokens_per_s", r"\): ([\d.]+) tokens/s per rank")):
        m = re.search(pattern, text)
        if m:
            r[key] = m.group(1) if key in ("split", "chosen") else float(m.group(1))
    if read_steady(r, out_dir, text):
        r["tokens_per_s"] = a.auto_batch * 512 / r["step_s"]
    return r


def peer_row(a, name, L, C, H, port):
    cmd = [sys.executable, os.path.join(HERE, "torch_dist_worker.py"), "--strategy", "fsdp2",
           "--cpu-offload", "--model", "gpt2", "--shape", f"{L},{H},{C}", "--batch", "1",
           "--seq", "512", "--steps", "4", "--warmup", "1", "--device", "cuda",
           "--comm-timeout", "120"]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    rc, wall, text = run(cmd, os.path.join(a.workdir, f"peer_{name}.log"), a.timeout, env)
    r = {"case": name, "shape": f"L{L} d{C} h{H}", "parameters": params(L, C),
         "command": " ".join(cmd), "exit": rc, "wall_s": round(wall, 1)}
    res = [x for x in text.splitlines() if x.startswith("BENCH_RESULT ")]
    if not res:
        r["error"] = ("killed (exit -9: out of host memory?)" if rc == -9 else
                      "\n".join(text.splitlines()[-4:]))
        return r
    j = json.loads(res[-1][len("BENCH_RESULT "):])
    r.update(step_s=j.get("step_time_s"), gpu_peak=j.get("peak_allocated"),
             host_rss=j.get("host_peak_rss_bytes"), losses=[j.get("first_loss"), j.get("last_loss")])
    return r


def bound(a, r, rates):
    """The step's bound in seconds from the measured rates: the slowest of compute (8 FLOPs per
    parameter and token with activation checkpointing, at --gpu-tflops), PCIe, CPU AdamW, disk."""
    psi, T = r["parameters"], 512
    terms = {"compute": 8 * psi * T / (a.gpu_tflops * 1e12)}
    if r["plan"] == "offload r=1":
        terms["PCIe"] = 4 * psi / rates["pcie"]
        terms["host"] = 28 * psi / rates["adamw"]
    elif r["plan"].startswith("infinity"):
        rr = 0.75
        terms["PCIe"] = (4 * rr * psi + 4 * psi) / rates["pcie"]
        terms["host"] = 28 * rr * psi / rates["adamw"]
        terms["disk"] = 2 * (r.get("nvme") or 0) / rates["disk"]
    key = max(terms, key=terms.get)
    return terms[key], key, terms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--limits-bin", default=None, help="bench_host_limits (default: beside --shardtrain)")
    ap.add_argument("--nvme-path", default="/tmp/nvme_offload")
    ap.add_argument("--out", default="largest_model.json")
    ap.add_argument("--workdir", default="/tmp/largest_model")
    ap.add_argument("--rows", default="gpu,offload,infinity,auto,peer")
    ap.add_argument("--gpu-shapes", default="5.1b:44:3072:24,4.7b:40:3072:24")
    ap.add_argument("--offload-shapes", default="7.3b:63:3072:24")
    ap.add_argument("--infinity-shapes", default="12.2b:84:3456:27")
    ap.add_argument("--auto-shapes", default="12.2b:84:3456:27")
    ap.add_argument("--auto-batch", type=int, default=64,
                    help="auto row: the global batch in sequences of 512 tokens (default 64: 32K tokens)")
    ap.add_argument("--gpus", type=int, default=1, help="auto row: GPUs (shardtrain launch)")
    ap.add_argument("--peer-shapes", default="7.3b:63:3072:24,5.1b:44:3072:24")
    ap.add_argument("--gpu-memory-gib", type=float, default=79)
    ap.add_argument("--host-memory-gib", type=float, default=112,
                    help="host memory the plans may use (the machine's less what the system needs)")
    ap.add_argument("--gpu-tflops", type=float, default=396, help="effective bf16 TFLOP/s (40%% of H100)")
    ap.add_argument("--timeout", type=int, default=560, help="seconds per run")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    os.makedirs(a.nvme_path, exist_ok=True)
    a.limits_bin = a.limits_bin or os.path.join(os.path.dirname(a.shardtrain), "bench_host_limits")
    a.limits_json = None
    rates = {"pcie": 55.0e9, "adamw": 137.5e9, "disk": 1.86e9}
    if os.path.exists(a.limits_bin):
        rc, _, _ = run([a.limits_bin, "--stream-mib", "1024", "--reps", "3", "--copy-reps", "5",
                        "--adamw-elements", "100000000", "--adamw-reps", "3", "--disk-path",
                        a.nvme_path, "--disk-mib", "2048"], os.path.join(a.workdir, "limits.log"), 300)
        text = open(os.path.join(a.workdir, "limits.log")).read()
        j = json.loads(text[text.index("{"):])
        a.limits_json = os.path.join(a.workdir, "limits.json")
        json.dump(j, open(a.limits_json, "w"))
        rates = {"pcie": min(j["pcie"]["h2d_bytes_per_s"], j["pcie"]["d2h_bytes_per_s"]),
                 "adamw": j["cpu_adamw"]["bf16_grads_bf16_params"]["bytes_per_s"],
                 "disk": 2e9 / (1 / j["disk"]["read_GBps"] + 1 / j["disk"]["write_GBps"])}
    res = {"rates": rates, "rows": {}}
    rows = a.rows.split(",")
    for row in ("gpu", "offload", "infinity"):
        if row not in rows:
            continue
        for name, L, C, H in shapes(getattr(a, f"{row}_shapes")):
            r = train_row(a, row, name, L, C, H)
            if "error" not in r:
                r["bound_s"], r["bound"], r["bound_terms"] = bound(a, r, rates)
            res["rows"][row] = r
            print(f"{row} {name}: " + (r.get("done") or r.get("error", "")), flush=True)
            if "error" not in r:
                break
    if "auto" in rows:
        for name, L, C, H in shapes(a.auto_shapes):
            r = auto_row(a, name, L, C, H)
            res["rows"]["auto"] = r
            print(f"auto {name}: " + (f"{r.get('split')}, {r.get('chosen')}: "
                                      f"{r['tokens_per_s']:.0f} tokens/s (predicted "
                                      f"{r.get('predicted_tokens_per_s', 0) * a.gpus:.0f})"
                                      if "error" not in r else r["error"]), flush=True)
            if "error" not in r:
                break
    if "peer" in rows:
        for k, (name, L, C, H) in enumerate(shapes(a.peer_shapes)):
            r = peer_row(a, name, L, C, H, 29600 + k)
            res["rows"]["peer"] = r
            print(f"peer {name}: " + (f"{r['step_s']:.2f} s/step" if "error" not in r else r["error"]),
                  flush=True)
            if "error" not in r:
                break
    json.dump(res, open(a.out, "w"), indent=1)
    print("\n| row | shape | params | step (s) | bound (s) | ratio | GPU peak / est | host RSS / est | NVMe / est | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    g = lambda b: "—" if b is None else f"{b / GIB:.2f} GiB"
    for row, r in res["rows"].items():
        if "error" in r:
            print(f"| {row} | {r.get('shape')} | {r.get('parameters', 0) / 1e9:.2f}B | failed: "
                  f"{r['error'].splitlines()[-1][:80]} |||||||")
            continue
        e = r.get("estimate") or {}
        b = r.get("bound_s")
        bound_txt = "—" if b is None else f"{b:.3f} ({r['bound']})"
        ratio = "—" if b is None else f"{r['step_s'] / b:.2f}×"
        print(f"| {row} | {r['shape']} | {r['parameters'] / 1e9:.2f}B | {r['step_s']:.3f} | "
              f"{bound_txt} | {ratio} | {g(r.get('gpu_peak'))} / {g(e.get('gpu'))} | "
              f"{g(r.get('host_rss'))} / {g(e.get('host'))} | {g(r.get('nvme'))} / "
              f"{g(e.get('nvme'))} | {r['losses'][0]} → {r['losses'][-1]} |")

if __name__ == "__main__":
    main()
