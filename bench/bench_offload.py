#!/usr/bin/env python3
"""ZeRO-Offload / ZeRO-Infinity on one GPU: shardtrain's offload strategies against our
on-GPU zero2 and PyTorch FSDP2 with CPU offload, side by side in one run.

Frameworks (--frameworks; shardtrain unless said):
  offload        --strategy offload: zero2 with the fp32 master weights, AdamW m and v and the AdamW
                 step on the CPU (exact: the step finishes before the next forward)
  offload-dpu    --strategy offload --offload-delayed-update (ZeRO-Offload's one-step delayed
                 parameter update: the CPU step overlaps the next step's GPU work)
  offload-rNN    --strategy offload --offload-ratio 0.NN (NN % of the optimizer state offloaded)
  zero2          --strategy zero2, everything on the GPU: the "GPU compute" of the targets
  zero3-offload  --deepspeed-config written here: stage 3, offload_optimizer and offload_param "cpu"
  infinity       --deepspeed-config written here: stage 3, both on "nvme" under --nvme-path, aio
  fsdp2-offload  PyTorch FSDP2 (bench/torch_dist_worker.py --strategy fsdp2 --cpu-offload):
                 fully_shard per block and root, CPUOffloadPolicy(pin_memory=True),
                 MixedPrecisionPolicy(bf16 params, fp32 reduce), torch.optim.AdamW(fused=True) on
                 the CPU parameters (foreach if fused is refused), world size 1
Cases (--cases; model, micro-batch × sequence, steps (untimed warmup)):
  tutorial   gpt2-large 2 × 512, one epoch of 1000 samples (500 steps; 10 untimed): time per
             epoch; the PyTorch peer runs --peer-max-steps steps and its epoch is extrapolated
  xl2        gpt2-xl 2 × 512, 20 steps (5)         xl16  gpt2-xl 16 × 512, 15 steps (5)
  sweep2, sweep4, sweep8, sweep16: gpt2-large mb 2/4/8/16 × 512, 20 steps (5): where the CPU
             step of DPU becomes shorter than the GPU step (frameworks offload-dpu, offload, zero2)
--largest: 10 steps (5 untimed) of each --shapes GPT-2 shape (`train --model config.json`, HF
keys) per --largest-frameworks: which train, tokens/s, GPU peak, host and NVMe bytes vs estimate.

Usage (GPU machine; bench/run.sh offload wraps it):
    python3 bench/bench_offload.py --shardtrain .packed/shardtrain --cases tutorial,xl2,xl16 \
        --out $OUT/offload.json --workdir /tmp/offload
    python3 bench/bench_offload.py --shardtrain .packed/shardtrain --cases sweep2,sweep4,sweep8,sweep16
    python3 bench/bench_offload.py --shardtrain .packed/shardtrain --largest --nvme-path /tmp/nvme
CPU smoke test of the harness (gpt2-micro / gpt2-tiny on --device cpu; frameworks the binary lacks
are failed entries; --stand-in zero2 re-runs them as zero2 to exercise the parsing):
    python3 bench/bench_offload.py --smoke --shardtrain build-cpu/shardtrain [--stand-in zero2]

Measures (shardtrain: metrics.jsonl): tokens/s and step time over the steps after the warmup;
epoch time (the epoch record's time_s); peak GPU memory (device_peak_allocated_bytes / reserved;
PyTorch: torch.cuda.max_memory_allocated / reserved); host_pinned_bytes, host_pageable_bytes,
nvme_bytes (epoch record; PyTorch: peak resident set); cpu_step_ms (step records, mean over the
timed windows; PyTorch: host time of opt.step()); `shardtrain estimate` (GPU total, host, NVMe per
rank where it prints them: missing columns are None). Every job runs in its own process with a
timeout; a failure is a table entry. The targets (below) evaluated at the end; the tables are printed
last as markdown, the JSON (--out) holds everything. Exit status 1 if any shardtrain job failed.
"""
import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_multi_gpu import (RESULT_TAG, UNITS, WORKER, bench_env, human, job_error,  # noqa: E402
                             parse_metrics, prepare_paths, result_header, run_job)

LOG_INTERVAL = 5
# name: (model, micro-batch, sequence, steps, untimed warmup steps, epoch samples or None)
CASES = {
    "tutorial": ("gpt2-large", 2, 512, 500, 10, 1000),
    "xl2": ("gpt2-xl", 2, 512, 20, 5, None),
    "xl16": ("gpt2-xl", 16, 512, 15, 5, None),
    "sweep2": ("gpt2-large", 2, 512, 20, 5, None),
    "sweep4": ("gpt2-large", 4, 512, 20, 5, None),
    "sweep8": ("gpt2-large", 8, 512, 20, 5, None),
    "sweep16": ("gpt2-large", 16, 512, 20, 5, None),
}
SMOKE_CASES = {
    "tutorial": ("gpt2-micro", 2, 64, 20, 5, 40),
    "xl2": ("gpt2-tiny", 2, 64, 10, 5, None),
    "xl16": ("gpt2-tiny", 4, 64, 10, 5, None),
    "sweep2": ("gpt2-micro", 2, 64, 10, 5, None),
    "sweep4": ("gpt2-micro", 4, 64, 10, 5, None),
    "sweep8": ("gpt2-micro", 8, 64, 10, 5, None),
    "sweep16": ("gpt2-micro", 16, 64, 10, 5, None),
}
DEFAULT_FRAMEWORKS = "offload,offload-dpu,zero2,fsdp2-offload"
SWEEP_FRAMEWORKS = "offload-dpu,offload,zero2"
CELL_TIMEOUT = {"tutorial": 300, "gpt2-xl": 180, "largest": 300}  # seconds; others --cell-timeout
# `shardtrain estimate` rows that may hold each framework (the estimator's names are not settled)
OFFLOAD_ROWS = ["offload", "zero2-offload", "zero-offload", "zero2_offload"]
EST_ROWS = {"zero2": ["zero2"], "offload": OFFLOAD_ROWS, "offload-dpu": OFFLOAD_ROWS,
            "zero3-offload": ["zero3-offload", "zero3_offload", "offload3", "infinity-cpu",
                              "infinity"],
            "infinity": ["infinity", "infinity-nvme", "zero3-nvme", "nvme"]}
# --largest default shapes: name:n_layer:n_embd:n_head
DEFAULT_SHAPES = "7.3b:63:3072:24,12.2b:84:3456:27"
SMOKE_SHAPES = "s1:2:64:2,s2:4:128:4"
VOCAB, CONTEXT = 50257, 1024


def is_shardtrain(fw):
    return fw != "fsdp2-offload"


def framework_args(a, fw, case):
    """shardtrain arguments of framework fw (None: unknown name)."""
    if fw == "offload":
        return ["--strategy", "offload"]
    if fw == "offload-dpu":
        return ["--strategy", "offload", "--offload-delayed-update"]
    m = re.fullmatch(r"offload-r(\d{1,3})", fw)
    if m and 0 < int(m.group(1)) <= 100:
        return ["--strategy", "offload", "--offload-ratio", f"{int(m.group(1)) / 100:g}"]
    if fw == "zero2":
        return ["--strategy", "zero2"]
    if fw in ("zero3-offload", "infinity"):
        return ["--deepspeed-config", write_ds_config(a, fw, case)]
    return None


def ds_config(fw, micro_batch, nvme_path):
    """The DeepSpeed config of zero3-offload / infinity (as bench/configs/*.json, other batch)."""
    zero = {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": 50000000,
            "stage3_param_persistence_threshold": 100000,
            "stage3_max_live_parameters": 1000000000, "stage3_max_reuse_distance": 1000000000}
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": zero}
    if fw == "zero3-offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    else:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                                     "buffer_count": 4}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                                 "buffer_count": 5, "buffer_size": 100000000,
                                 "max_in_cpu": 1000000000}
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                      "single_submit": False, "overlap_events": True}
    return cfg


def write_ds_config(a, fw, case):
    B = a.cases[case][1] if case in a.cases else a.largest_batch
    nvme = os.path.join(a.nvme_path, f"{case}_{fw}")
    if fw == "infinity":
        os.makedirs(nvme, exist_ok=True)
    path = os.path.join(a.workdir, f"ds_{case}_{fw}.json")
    with open(path, "w") as f:
        json.dump(ds_config(fw, B, nvme), f, indent=1)
    return path


# ---- `shardtrain estimate` ------------------------------------------------------------------------
def parse_estimate_tolerant(text):
    """`shardtrain estimate` table -> {row: {model_states, activations, buffers, total, host, nvme,
    <other header columns>}} in bytes. Rows are "name" then "<number> <unit>" pairs; the header
    line (starting with "strategy") names the columns, split on 2+ spaces. The first four pairs
    are model states, activations, buffers and total (today's format); further columns take their
    header's name, and "host" / "nvme" are the sums of the columns whose name says host / NVMe.
    A missing column is None; a row the estimator marks unavailable is left out."""
    header = []
    est = {}
    for line in text.splitlines():
        if line.lower().startswith("strategy"):
            header = [h.strip().lower().replace(" ", "_") for h in re.split(r"\s{2,}", line.strip())][1:]
            continue
        w = line.split()
        if len(w) < 3:
            continue
        vals = []
        i = 1
        while i + 1 < len(w) and w[i + 1] in UNITS:
            try:
                vals.append(float(w[i].replace(",", "")) * UNITS[w[i + 1]])
            except ValueError:
                break
            i += 2
        if len(vals) < 4:
            continue
        names = ["model_states", "activations", "buffers", "total"]
        extra = [h for h in header if h not in ("model_states", "activations", "buffers", "total")
                 and "formula" not in h]
        names += extra[:len(vals) - 4]
        names += [f"col{k}" for k in range(len(names), len(vals))]
        row = dict(zip(names, vals))
        host = [v for k, v in row.items() if "host" in k or "cpu" in k or "pinned" in k]
        nvme = [v for k, v in row.items() if "nvme" in k or "disk" in k]
        row["host"] = sum(host) if host else None
        row["nvme"] = sum(nvme) if nvme else None
        est[w[0]] = row
    return est


def run_estimate(binary, model, batch, seq):
    out = ""
    for flag in ("--micro-batch", "--batch-size"):
        try:
            p = subprocess.run([binary, "estimate", "--model", model, "--gpus", "1", flag, str(batch),
                                "--max-length", str(seq)], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            return {"error": repr(e)}
        out = p.stdout + p.stderr
        est = parse_estimate_tolerant(p.stdout) if p.returncode == 0 else None
        if est:
            m = re.search(r"\(([\d,]+) parameters", p.stdout)
            return {"rows": est, "params": int(m.group(1).replace(",", "")) if m else None,
                    "command": " ".join(p.args[1:])}
    return {"error": f"cannot parse `shardtrain estimate`: {out[-300:]}"}


def estimate_for(est, fw):
    rows = est.get("rows") or {}
    for name in EST_ROWS.get(fw, OFFLOAD_ROWS if fw.startswith("offload") else [fw]):
        if name in rows:
            return dict(rows[name], row=name)
    return None


# ---- jobs ---------------------------------------------------------------------------------------------
def offload_fields(recs, warmup):
    """Extra fields of the offload strategies from metrics.jsonl records: host/NVMe bytes (epoch record),
    cpu_step_ms and the wall-clock breakdown (step records after the warmup, window-weighted)."""
    epoch = [r for r in recs if "peak_memory_bytes" in r]
    e = epoch[-1] if epoch else {}
    out = {k: e.get(k) for k in ("host_pinned_bytes", "host_pageable_bytes", "nvme_bytes")}
    steps = sorted((r for r in recs if "loss" in r and "step" in r), key=lambda r: r["step"])
    for key in ("cpu_step_ms", "forward_ms", "backward_ms", "reduce_wait_ms", "optimizer_ms"):
        prev, total, n = 0, 0.0, 0
        for r in steps:
            window = r["step"] - prev
            if prev >= warmup and r.get(key) is not None:
                total += r[key] * window
                n += window
            prev = r["step"]
        out[key] = total / n if n else None
    return out


def partial_metrics(metrics, warmup):
    """tokens/s and step time of a run cut by its timeout, from the step records after the
    warmup (no epoch record: no peak memory); None if there are none."""
    try:
        recs = [json.loads(line) for line in open(metrics) if line.strip()]
    except (OSError, ValueError):
        return None
    steps = sorted((r for r in recs if "tokens_per_s" in r and "step_time_s" in r and "loss" in r),
                   key=lambda r: r["step"])
    prev, tokens, seconds, n = 0, 0.0, 0.0, 0
    for r in steps:
        window = r["step"] - prev
        if prev >= warmup:
            seconds += r["step_time_s"] * window
            tokens += r["tokens_per_s"] * r["step_time_s"] * window
            n += window
        prev = r["step"]
    if seconds <= 0:
        return None
    r = {"tokens_per_s": tokens / seconds, "timed_steps": n, "timed_s": seconds,
         "step_time_s": seconds / n, "steps_done": prev, "peak_allocated": None, "peak_reserved": None}
    r.update(offload_fields(recs, warmup))
    return r


def run_shardtrain(a, case, fw, args, timeout, env, model=None, shape_steps=None):
    if case in a.cases:
        model_name, B, T, steps, warmup, epoch_samples = a.cases[case]
    else:  # --largest
        (steps, warmup), B, T, epoch_samples = shape_steps, a.largest_batch, a.largest_seq, None
        model_name = model
    name = f"{case}_{fw}"
    out = os.path.join(a.workdir, name)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # shardtrain appends to it
    cmd = [a.shardtrain, "train", "--model", model_name, "--dataset", "wikitext-2", "--device",
           a.device, *args, "--batch-size", str(B), "--max-length", str(T),
           "--log-interval", str(LOG_INTERVAL), "--warmup-steps", "5", "--eval-samples", str(B),
           "--no-save", "--output-dir", out]
    if a.breakdown:
        cmd.append("--wall-clock-breakdown")
    cmd += (["--num-samples", str(epoch_samples), "--epochs", "1"] if epoch_samples
            else ["--max-steps", str(steps)])
    log = os.path.join(a.workdir, name + ".log")
    t0 = time.time()
    rc, text = run_job(cmd, timeout, log, env)
    done = os.path.exists(metrics) and any('"event":"done"' in l.replace(" ", "") for l in open(metrics))
    if not done:
        r = job_error(rc, text, timeout, log)
        errs = [l.strip() for l in text.splitlines() if l.lower().startswith(("error", "terminate"))
                or "not expected" in l]
        if errs:
            r["error"] += ": " + errs[0][:300]
        r["command"] = " ".join(cmd)
        partial = partial_metrics(metrics, warmup) if rc is None else None
        if partial:  # timed out after the warmup: keep the steady-state numbers, flagged
            partial.update(warning=r["error"] + f"; partial: {partial['steps_done']} steps",
                           partial=True, log=log, command=r["command"], wall_s=time.time() - t0)
            return partial
        return r
    r = parse_metrics(metrics, warmup, a.smoke)
    recs = [json.loads(line) for line in open(metrics) if line.strip()]
    epoch = [x for x in recs if "peak_memory_bytes" in x][-1]
    r.update(offload_fields(recs, warmup))
    r.update(step_time_s=r["timed_s"] / r["timed_steps"] if r["timed_steps"] else None,
             epoch_time_s=epoch.get("time_s"), epoch_complete=epoch.get("epoch_complete"),
             wall_s=time.time() - t0, log=log, command=" ".join(cmd))
    if rc != 0:
        r["warning"] = job_error(rc, text, timeout, log)["error"] + " after training finished"
    return r


def run_peer(a, case, timeout, env, port, shape=None, shape_steps=None):
    """PyTorch FSDP2 with CPU offload: --peer-max-steps at most; an epoch case's epoch time is
    extrapolated from the per-step time of all its steps."""
    if not a.torch_ok:
        return {"error": "skipped: torch/transformers not importable here"}
    if case in a.cases:
        model, B, T, steps, warmup, epoch_samples = a.cases[case]
    else:
        model, (steps, warmup), B, T, epoch_samples = "gpt2", shape_steps, a.largest_batch, a.largest_seq, None
    run_steps = min(steps, a.peer_max_steps)
    run_warmup = min(warmup, max(run_steps // 4, 1))
    cmd = [sys.executable, WORKER, "--strategy", "fsdp2", "--cpu-offload", "--model", model,
           "--batch", str(B), "--seq", str(T), "--steps", str(run_steps), "--warmup", str(run_warmup),
           "--device", a.device, "--comm-timeout", "120"]
    if shape:
        cmd += ["--shape", shape]
    if a.peer_reshard:
        cmd.append("--reshard-after-forward")
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    log = os.path.join(a.workdir, f"{case}_fsdp2-offload.log")
    t0 = time.time()
    rc, text = run_job(cmd, timeout, log, env)
    lines = [l[len(RESULT_TAG):] for l in text.splitlines() if l.startswith(RESULT_TAG)]
    if not lines:
        return dict(job_error(rc, text, timeout, log), command=" ".join(cmd))
    r = json.loads(lines[-1])
    r.update(wall_s=time.time() - t0, log=log, command=" ".join(cmd), ran_steps=run_steps,
             host_pageable_bytes=None, host_pinned_bytes=None, nvme_bytes=None)
    if epoch_samples:
        r["epoch_time_s"] = r["total_s"] / run_steps * steps
        r["epoch_time_extrapolated"] = run_steps < steps
    ours = a.params.get(case)
    if ours and r.get("params") and r["params"] != ours:
        r["warning"] = f"shape mismatch: PyTorch model has {r['params']:,} parameters, shardtrain {ours:,}"
    if rc != 0:
        r["warning"] = job_error(rc, text, timeout, log)["error"] + " after the result line"
    return r


def run_one(a, case, fw, timeout, env, port, model=None, shape=None, shape_steps=None):
    if fw == "fsdp2-offload":
        return run_peer(a, case, timeout, env, port, shape, shape_steps)
    args = framework_args(a, fw, case)
    if args is None:
        return {"error": f"unknown framework {fw}"}
    r = run_shardtrain(a, case, fw, args, timeout, env, model, shape_steps)
    if "error" in r and a.stand_in and fw != a.stand_in and not r["error"].startswith("timed out"):
        # the feature is not in this binary yet: measure the stand-in, marked as such
        s = run_shardtrain(a, case, fw, ["--strategy", a.stand_in], timeout, env, model, shape_steps)
        s["stand_in"] = a.stand_in
        s["error_without_stand_in"] = r["error"]
        return s
    return r


# ---- summary -----------------------------------------------------------------------------------
def ratio(x, y):
    return x / y if x and y else None


def summarize(row):
    """The targets for one case (None where a side is missing)."""
    ex, dpu, z2, fs = (row.get(k, {}) for k in ("offload", "offload-dpu", "zero2", "fsdp2-offload"))
    tok = lambda e: e.get("tokens_per_s") if "error" not in e else None  # noqa: E731
    step = lambda e: e.get("step_time_s") if "error" not in e else None  # noqa: E731
    gpu = step(z2)  # GPU compute: our on-GPU zero2 step on the same workload
    if gpu is None and ex.get("forward_ms") is not None and ex.get("backward_ms") is not None:
        gpu = (ex["forward_ms"] + ex["backward_ms"]) / 1e3  # wall-clock breakdown, if zero2 OOMs
    cpu_ms = ex.get("cpu_step_ms") if ex.get("cpu_step_ms") is not None else dpu.get("cpu_step_ms")
    cpu = cpu_ms / 1e3 if cpu_ms is not None else None
    s = {"gpu_step_s": gpu, "cpu_step_s": cpu,
         "exact_over_fsdp2": ratio(tok(ex), tok(fs)), "dpu_over_fsdp2": ratio(tok(dpu), tok(fs)),
         "dpu_over_zero2": ratio(tok(dpu), tok(z2)), "exact_over_zero2": ratio(tok(ex), tok(z2)),
         "exact_peak_over_fsdp2": ratio(ex.get("peak_allocated"), fs.get("peak_allocated")),
         "dpu_peak_over_fsdp2": ratio(dpu.get("peak_allocated"), fs.get("peak_allocated"))}
    targets = {}
    x = s["exact_over_fsdp2"]
    targets["exact >= 1.3x fsdp2-offload"] = (x, None if x is None else x >= 1.3)
    if step(ex) and gpu and cpu is not None:
        lim = (gpu + cpu) * 1.15
        targets["exact step <= (GPU + CPU step) x 1.15"] = (step(ex) / lim, step(ex) <= lim)
    else:
        targets["exact step <= (GPU + CPU step) x 1.15"] = (None, None)
    x = s["dpu_over_fsdp2"]
    targets["DPU >= 2x fsdp2-offload"] = (x, None if x is None else x >= 2.0)
    if step(dpu) and gpu and cpu is not None:
        if cpu < gpu:
            x = s["dpu_over_zero2"]
            targets["DPU >= 0.85x on-GPU tokens/s (CPU step < GPU step)"] = (
                x, None if x is None else x >= 0.85)
        else:
            lim = max(gpu, cpu) * 1.10
            targets["DPU step <= max(GPU, CPU) x 1.10 (CPU step >= GPU step)"] = (step(dpu) / lim,
                                                                               step(dpu) <= lim)
    else:
        targets["DPU vs on-GPU (0.85x, or max(GPU, CPU) + 10%)"] = (None, None)
    for k, label in (("exact_peak_over_fsdp2", "exact"), ("dpu_peak_over_fsdp2", "DPU")):
        x = s[k]
        targets[f"{label} peak GPU <= fsdp2-offload's"] = (x, None if x is None else x <= 1.0)
    s["targets"] = {k: {"value": v, "pass": p} for k, (v, p) in targets.items()}
    return s


def fmt_tok(e):
    if not e:
        return "-"
    if "error" in e:
        return "skipped" if e["error"].startswith("skipped") else "error"
    return f"{e['tokens_per_s']:,.0f}" + ("†" if e.get("stand_in") else "")


def fmt_bytes(x):
    return human(x) if x else "-"


def fmt(x, spec, unit=""):
    return format(x, spec) + unit if x is not None else "-"


def print_report(res):
    rows, largest = res["rows"], res.get("largest", [])
    for r in rows + largest:  # problems first, the tables last
        for fw, e in r["results"].items():
            if "error" in e and not e["error"].startswith("skipped: torch"):
                tail = [l for l in e.get("log_tail", "").replace("\r", "\n").splitlines()
                        if l.strip() and not l.startswith("$ ") and l.strip() not in e["error"]]
                print(f"\nerror: {r['case']} {fw}: {e['error'][:400]}" + (f" ({e['log']})" if "log" in e else ""))
                print("\n".join("    " + l[:160] for l in tail[-3:]))
            if "warning" in e:
                print(f"\nwarning: {r['case']} {fw}: {e['warning']}")
            if e.get("stand_in"):
                print(f"\nnote: {r['case']} {fw}: measured as --strategy {e['stand_in']} (stand-in;"
                      f" without it: {e['error_without_stand_in'][:200]})")
    smoke = " (smoke, CPU: the numbers mean nothing)" if res["smoke"] else ""

    main_rows = [r for r in rows if not r["case"].startswith("sweep")]
    if main_rows:
        print(f"\n### Targets{smoke}\n")
        print("| case | target | value | pass |\n|---|---|---|---|")
        for r in main_rows:
            for target, v in r["summary"]["targets"].items():
                ok = "n/a" if v["pass"] is None else ("yes" if v["pass"] else "NO")
                print(f"| {r['case']} | {target} | {fmt(v['value'], '.3f')} | {ok} |")

    sweep = [r for r in rows if r["case"].startswith("sweep")]
    if sweep:
        print(f"\n### DPU micro-batch sweep{smoke}: where the CPU step gets shorter than the GPU step\n")
        print("| model, mb | zero2 step (GPU) | CPU step | CPU < GPU | DPU step | exact step |"
              " DPU tok/s | zero2 tok/s | DPU/zero2 |\n|---|---|---|---|---|---|---|---|---|")
        cross = None
        for r in sweep:
            s, res_ = r["summary"], r["results"]
            g, c = s["gpu_step_s"], s["cpu_step_s"]
            below = None if g is None or c is None else c < g
            if below and cross is None:
                cross = r["micro_batch"]
            st = lambda e: fmt(e.get("step_time_s") if "error" not in e else None, ".3f", " s")  # noqa: E731
            print(f"| {r['model']}, {r['micro_batch']} | {fmt(g, '.3f', ' s')} | {fmt(c, '.3f', ' s')} | "
                  f"{'-' if below is None else ('yes' if below else 'no')} | {st(res_.get('offload-dpu', {}))} | "
                  f"{st(res_.get('offload', {}))} | {fmt_tok(res_.get('offload-dpu'))} | "
                  f"{fmt_tok(res_.get('zero2'))} | {fmt(s['dpu_over_zero2'], '.2f')} |")
        print(f"\nsmallest micro-batch where CPU step < GPU step: {cross if cross else 'none measured'}")

    if largest:
        print(f"\n### Largest model{smoke}: {res['largest_steps']} steps of each shape\n")
        print("| shape | params | framework | trains | tok/s | peak GPU | host pinned | host pageable |"
              " NVMe | est GPU | est host | est NVMe |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in largest:
            for fw, e in r["results"].items():
                est = r.get("estimates", {}).get(fw) or {}
                ok = "yes" if "tokens_per_s" in e else ("skipped" if e.get("error", "").startswith("skipped") else "no")
                peak = e.get("peak_allocated")
                print(f"| {r['case']} ({r['shape']}) | {r['params']:,} | {fw} | {ok} | {fmt_tok(e) if ok == 'yes' else '-'} | "
                      f"{fmt_bytes(peak)} | {fmt_bytes(e.get('host_pinned_bytes'))} | "
                      f"{fmt_bytes(e.get('host_pageable_bytes'))} | {fmt_bytes(e.get('nvme_bytes'))} | "
                      f"{fmt_bytes(est.get('total'))} | {fmt_bytes(est.get('host'))} | {fmt_bytes(est.get('nvme'))} |")

    print(f"\n### Offload benchmark, one {'CPU' if res['smoke'] else 'GPU'}{smoke}\n")
    print("| case | framework | tok/s | step | epoch | peak GPU alloc (rsvd) | host pinned | host pageable "
          "| NVMe | CPU step | est GPU | est host | tok/s vs fsdp2-offload |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fs = r["results"].get("fsdp2-offload", {})
        for fw, e in r["results"].items():
            ok = "tokens_per_s" in e
            est = r["estimates"].get(fw) or {}
            ep = e.get("epoch_time_s") if ok and r["epoch_samples"] else None
            ep_s = f"{ep:.1f} s" + ("*" if e.get("epoch_time_extrapolated") else "") if ep else "-"
            host_pg = e.get("host_pageable_bytes") or (e.get("host_peak_rss_bytes") if fw == "fsdp2-offload" else None)
            rsvd = e.get("peak_reserved")
            print(f"| {r['case']} ({r['model']} {r['micro_batch']}x{r['seq']}) | {fw} | {fmt_tok(e)} | "
                  f"{fmt(e.get('step_time_s') if ok else None, '.3f', ' s')} | {ep_s} | "
                  f"{fmt_bytes(e.get('peak_allocated')) if ok else '-'}"
                  f"{' (' + fmt_bytes(rsvd) + ')' if ok and rsvd else ''} | "
                  f"{fmt_bytes(e.get('host_pinned_bytes'))} | {fmt_bytes(host_pg)}"
                  f"{' (RSS)' if fw == 'fsdp2-offload' and host_pg else ''} | {fmt_bytes(e.get('nvme_bytes'))} | "
                  f"{fmt(e.get('cpu_step_ms'), '.1f', ' ms')} | {fmt_bytes(est.get('total'))} | "
                  f"{fmt_bytes(est.get('host'))} | "
                  f"{fmt(ratio(e.get('tokens_per_s') if ok else None, fs.get('tokens_per_s')), '.2f')} |")
    print("\nstep = mean step time after the warm-up; epoch = the epoch record's time_s (* = PyTorch:"
          " extrapolated from --peer-max-steps steps); † = measured as the --stand-in strategy; est"
          " = `shardtrain estimate` per rank (- where it has no such row or column); PyTorch's host"
          " column is its peak resident set.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--cases", default=None,
                    help="default tutorial,xl2,xl16 (smoke: tutorial,xl2,sweep2,sweep4); 'none' with --largest")
    ap.add_argument("--frameworks", default=None,
                    help=f"default {DEFAULT_FRAMEWORKS}; sweep cases {SWEEP_FRAMEWORKS}")
    ap.add_argument("--extra-frameworks", default="",
                    help="added to the non-sweep cases, e.g. offload-r50,zero3-offload,infinity")
    ap.add_argument("--largest", action="store_true", help="also run the --shapes (largest model mode)")
    ap.add_argument("--shapes", default=None, help=f"name:n_layer:n_embd:n_head,... (default {DEFAULT_SHAPES})")
    ap.add_argument("--largest-frameworks", default="offload,offload-dpu,zero3-offload,infinity")
    ap.add_argument("--largest-batch", type=int, default=None, help="micro-batch (default 2)")
    ap.add_argument("--largest-seq", type=int, default=None, help="sequence (default 512, smoke 64)")
    ap.add_argument("--nvme-path", default="/tmp/nvme_offload", help="infinity's nvme_path root")
    ap.add_argument("--stand-in", default=None, metavar="STRATEGY",
                    help="re-run a failed shardtrain framework as this strategy (smoke: zero2)")
    ap.add_argument("--breakdown", action="store_true", help="pass --wall-clock-breakdown")
    ap.add_argument("--peer-max-steps", type=int, default=40,
                    help="fsdp2-offload runs at most this many steps (epoch time extrapolated)")
    ap.add_argument("--peer-reshard", action="store_true",
                    help="fsdp2-offload: reshard_after_forward=True (default False, as zero2)")
    ap.add_argument("--cell-timeout", type=float, default=150,
                    help="seconds per job (tutorial 300, gpt2-xl 180, largest 300)")
    ap.add_argument("--budget", type=float, default=540,
                    help="seconds for the whole bench: later jobs are skipped, the tables printed")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke test: --device cpu, tiny models")
    ap.add_argument("--out", default="bench_offload.json")
    ap.add_argument("--workdir", default="/tmp/bench_offload")
    a = ap.parse_args()
    a.device = "cpu" if a.smoke else "cuda"
    table = SMOKE_CASES if a.smoke else CASES
    names = a.cases or ("tutorial,xl2,sweep2,sweep4" if a.smoke else "tutorial,xl2,xl16")
    names = [] if names == "none" else names.split(",")
    unknown = [c for c in names if c not in table]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(table)}")
    a.cases = {c: table[c] for c in names}
    a.largest_batch = a.largest_batch or 2
    a.largest_seq = a.largest_seq or (64 if a.smoke else 512)
    a.nvme_path = os.path.abspath(a.nvme_path)
    prepare_paths(ap, a)
    a.torch_ok = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    start = time.time()

    env = bench_env(a.smoke)
    res = result_header(a, torch_importable=a.torch_ok, stand_in=a.stand_in, rows=[], largest=[])
    print(f"shardtrain: {res['shardtrain_version']}; GPUs: {res['gpu_names'] or a.device}; "
          f"torch+transformers importable: {a.torch_ok}", flush=True)

    rows, a.params, jobs = {}, {}, []
    for case, (model, B, T, steps, warmup, epoch_samples) in a.cases.items():
        sweep = case.startswith("sweep")
        fws = (a.frameworks or (SWEEP_FRAMEWORKS if sweep else DEFAULT_FRAMEWORKS)).split(",")
        if not sweep and a.extra_frameworks:
            fws += [f for f in a.extra_frameworks.split(",") if f and f not in fws]
        est = run_estimate(a.shardtrain, model, B, T)
        a.params[case] = est.get("params")
        rows[case] = {"case": case, "model": model, "micro_batch": B, "seq": T, "steps": steps,
                      "warmup": warmup, "epoch_samples": epoch_samples, "frameworks": fws,
                      "estimate": est, "estimates": {f: estimate_for(est, f) for f in fws},
                      "results": {}}
        # case by case, every framework (the targets compare within a case); a spent budget cuts
        # whole cases rather than every case's peer
        jobs += [(case, f) for f in fws]

    largest_jobs = []
    if a.largest:
        shapes = (a.shapes or (SMOKE_SHAPES if a.smoke else DEFAULT_SHAPES)).split(",")
        for spec in shapes:
            name, L, C, H = spec.split(":")
            L, C, H = int(L), int(C), int(H)
            params = 12 * L * C * C + 13 * L * C + VOCAB * C + CONTEXT * C + 2 * C
            cfg = os.path.join(a.workdir, f"config_{name}.json")
            with open(cfg, "w") as f:
                json.dump({"model_type": "gpt2", "n_layer": L, "n_embd": C, "n_head": H,
                           "n_positions": CONTEXT, "vocab_size": VOCAB}, f, indent=1)
            fws = a.largest_frameworks.split(",")
            est = run_estimate(a.shardtrain, cfg, a.largest_batch, a.largest_seq)
            res["largest"].append({"case": name, "shape": f"L{L} d{C} h{H}", "config": cfg,
                                   "params": est.get("params") or params, "torch_shape": f"{L},{H},{C}",
                                   "estimate": est, "estimates": {f: estimate_for(est, f) for f in fws},
                                   "results": {}})
            largest_jobs += [(len(res["largest"]) - 1, f) for f in fws]
    res["largest_steps"] = 10

    port = 29500 + os.getpid() % 1000
    for case, fw in jobs:
        row = rows[case]
        left = a.budget - (time.time() - start)
        limit = CELL_TIMEOUT.get(case, CELL_TIMEOUT.get(row["model"], a.cell_timeout))
        port += 1
        if left < 15:
            r = {"error": "skipped: --budget spent"}
        else:
            try:
                r = run_one(a, case, fw, min(limit, left), env, port)
            except Exception as e:  # noqa: BLE001 - record and go on with the next job
                r = {"error": repr(e)[-1500:]}
        row["results"][fw] = r
        what = (f"{r['tokens_per_s']:,.0f} tokens/s, step {r.get('step_time_s') or 0:.3f} s, peak "
                f"{human(r.get('peak_allocated'))}, cpu step {fmt(r.get('cpu_step_ms'), '.1f')} ms, "
                f"job {r.get('wall_s', 0):.0f} s" + (f" (stand-in {r['stand_in']})" if r.get("stand_in") else "")
                if "tokens_per_s" in r else "error: " + r["error"][:300])
        print(f"[{time.time() - start:4.0f} s] {case} {fw}: {what}", flush=True)
        res["rows"] = [dict(x, summary=summarize(x["results"])) for x in rows.values()]
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    for i, fw in largest_jobs:
        lr = res["largest"][i]
        left = a.budget - (time.time() - start)
        port += 1
        if left < 15:
            r = {"error": "skipped: --budget spent"}
        else:
            try:
                r = run_one(a, lr["case"], fw, min(CELL_TIMEOUT["largest"], left), env, port,
                            model=lr["config"], shape=lr["torch_shape"], shape_steps=(10, 5))
            except Exception as e:  # noqa: BLE001
                r = {"error": repr(e)[-1500:]}
        lr["results"][fw] = r
        print(f"[{time.time() - start:4.0f} s] largest {lr['case']} {fw}: "
              + ("trains, " + f"{r['tokens_per_s']:,.0f} tokens/s, peak {human(r.get('peak_allocated'))}"
                 if "tokens_per_s" in r else "error: " + r["error"][:300]), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    res["rows"] = [dict(x, summary=summarize(x["results"])) for x in rows.values()]
    res["wall_s"] = time.time() - start
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print_report(res)
    n = len(jobs) + len(largest_jobs)
    print(f"\n{n} jobs in {res['wall_s']:.0f} s; JSON: {a.out}; logs: {a.workdir}")
    failed = any("error" in e and not e["error"].startswith("skipped")
                 for r in res["rows"] + res["largest"] for fw, e in r["results"].items()
                 if is_shardtrain(fw))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
