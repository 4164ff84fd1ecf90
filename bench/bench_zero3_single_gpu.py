#!/usr/bin/env python3
"""ZeRO-3 on one GPU: shardtrain `--strategy zero3` against `--strategy dp` on the same
shapes, and the reference tutorial's ZeRO-3 row against PyTorch FSDP2 (fully_shard with
reshard_after_forward=True) on transformers' GPT2LMHeadModel, in one run.

Cases (--cases; name: model, micro-batch, sequence, steps, untimed warmup steps):
  medium4   gpt2-medium mb 4 × 512, 40 steps (10 untimed)      zero3 vs dp
  medium16  gpt2-medium mb 16 × 512, 30 steps (10 untimed)     zero3 vs dp
  large2    gpt2-large mb 2 × 512, 40 steps (10 untimed)       zero3 vs dp
  xl2       gpt2-xl mb 2 × 512, 20 steps (5 untimed)           zero3 vs dp
  tutorial  gpt2-large batch 2, 1000 samples × 512, one epoch (`--num-samples 1000 --epochs 1`,
            500 steps; 10 untimed in the steady state): zero3 (and dp) vs FSDP2, time per epoch
Frameworks (--frameworks): dp, zero3 (shardtrain), fsdp2 (bench/torch_dist_worker.py --strategy
fsdp2 --reshard-after-forward, one process, world size 1 over NCCL with env:// rendezvous on
localhost; bf16 parameters, fp32 reduction, AdamW fused, or foreach if fused fails on DTensors).

Usage (GPU machine; bench/run.sh zero3 wraps it):
    python3 bench/bench_zero3_single_gpu.py --shardtrain .packed/shardtrain \
        --cases medium4,medium16,large2,xl2 --out $OUT/zero3.json --workdir /tmp/zero3
CPU smoke test of the harness (gpt2-micro / gpt2-tiny on --device cpu; the FSDP2 peer runs on CPU
with gloo when torch and transformers import here, else it is skipped):
    python3 bench/bench_zero3_single_gpu.py --smoke --shardtrain build-cpu/shardtrain

Measures: tokens/s in the steady state (metrics.jsonl windows after the warmup steps; PyTorch: the
steps after its warmup), the epoch time (shardtrain: the epoch record's time_s; PyTorch: all
steps), peak memory (shardtrain: the epoch record's device_peak_allocated_bytes /
device_peak_reserved_bytes, its caching allocator; PyTorch: torch.cuda.max_memory_allocated /
max_memory_reserved), the first and last loss, and `shardtrain estimate` (its dp and zero3 rows;
zero3 shows "-" while the estimator has no zero3 row). Every job runs in its own process with a
timeout; a failed job is a table entry, not a crash. The JSON (--out) holds everything, the
table is printed last. Exit status 1 if any job failed. Not a test; docs/BENCHMARKS.md records
results with GPU and date.
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
from bench_multi_gpu import (WORKER, bench_env, human, job_error,  # noqa: E402
                             parse_estimate, prepare_paths, parse_metrics, result_header, run_job,
                             run_tagged_job)

LOG_INTERVAL = 5
# name: (model, micro-batch, sequence, steps, untimed warmup steps); warmup a multiple of
# LOG_INTERVAL. "tutorial" trains one epoch of 1000 samples instead of --max-steps.
CASES = {
    "medium4": ("gpt2-medium", 4, 512, 40, 10),
    "medium16": ("gpt2-medium", 16, 512, 30, 10),
    "large2": ("gpt2-large", 2, 512, 40, 10),
    "xl2": ("gpt2-xl", 2, 512, 20, 5),
    "tutorial": ("gpt2-large", 2, 512, 500, 10),
}
SMOKE_CASES = {
    "medium4": ("gpt2-micro", 2, 64, 15, 5),
    "xl2": ("gpt2-tiny", 2, 64, 10, 5),
    "tutorial": ("gpt2-micro", 2, 64, 20, 5),
}
EPOCH_CASES = {"tutorial": 1000}  # case: --num-samples (one epoch); steps = samples / batch
CELL_TIMEOUT = {"gpt2-xl": 150, "tutorial": 240}  # seconds per job; others: --cell-timeout
FRAMEWORKS = ("dp", "zero3", "fsdp2")
DEFAULT_CASES = "medium4,medium16,large2,xl2,tutorial"


def run_estimate(binary, model, batch, seq):
    """`shardtrain estimate` on one GPU -> {strategy: {model_states, activations, buffers, total}}.
    The micro-batch flag is --micro-batch today; --batch-size is tried if that one is refused."""
    out = ""
    for flag in ("--micro-batch", "--batch-size"):
        p = subprocess.run([binary, "estimate", "--model", model, "--gpus", "1", flag, str(batch),
                            "--max-length", str(seq)], capture_output=True, text=True, timeout=60)
        out = p.stdout + p.stderr
        est = parse_estimate(p.stdout) if p.returncode == 0 else None
        if est:
            est["command"] = " ".join(p.args[1:])
            m = re.search(r"\(([\d,]+) parameters", p.stdout)
            est["params"] = int(m.group(1).replace(",", "")) if m else None
            return est
    raise RuntimeError(f"cannot parse `shardtrain estimate` output: {out[-500:]}")


def losses_by_step(path):
    recs = [json.loads(line) for line in open(path) if line.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "step" in r}


def run_shardtrain(a, case, strategy, timeout, env):
    model, B, T, steps, warmup = a.cases[case]
    name = f"{case}_{strategy}"
    out = os.path.join(a.workdir, name)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # shardtrain appends to it
    cmd = [a.shardtrain, "train", "--model", model, "--dataset", "wikitext-2", "--device", a.device,
           "--strategy", strategy, "--batch-size", str(B), "--max-length", str(T),
           "--log-interval", str(LOG_INTERVAL), "--warmup-steps", "5", "--eval-samples", str(B),
           "--no-save", "--output-dir", out]
    if case in EPOCH_CASES:
        cmd += ["--num-samples", str(steps * B), "--epochs", "1"]
    else:
        cmd += ["--max-steps", str(steps)]
    log = os.path.join(a.workdir, name + ".log")
    t0 = time.time()
    rc, text = run_job(cmd, timeout, log, env)
    done = os.path.exists(metrics) and any('"event":"done"' in l.replace(" ", "") for l in open(metrics))
    if not done:
        r = job_error(rc, text, timeout, log)
        # the first error line of shardtrain, for the table
        errs = [l.strip() for l in text.splitlines() if l.lower().startswith(("error", "terminate"))]
        if errs:
            r["error"] += ": " + errs[0][:300]
        return r
    r = parse_metrics(metrics, warmup, a.smoke)
    recs = [json.loads(line) for line in open(metrics) if line.strip()]
    epoch = [x for x in recs if "peak_memory_bytes" in x][-1]
    losses = losses_by_step(metrics)
    r.update(epoch_time_s=epoch["time_s"], epoch_steps=epoch.get("steps"),
             epoch_complete=epoch.get("epoch_complete"), wall_s=time.time() - t0, log=log,
             steps=max(losses), losses=losses)
    if rc != 0:
        r["warning"] = job_error(rc, text, timeout, log)["error"] + " after training finished"
    return r


def run_fsdp2(a, case, timeout, env, port):
    model, B, T, steps, warmup = a.cases[case]
    if not a.torch_ok:
        return {"error": "skipped: torch/transformers not importable here"}
    name = f"{case}_fsdp2"
    cmd = [sys.executable, WORKER, "--strategy", "fsdp2", "--reshard-after-forward",
           "--model", model, "--batch", str(B), "--seq", str(T), "--steps", str(steps),
           "--warmup", str(warmup), "--device", a.device, "--comm-timeout", "60"]
    # one process, world size 1, env:// rendezvous on localhost
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    r = run_tagged_job(cmd, timeout, os.path.join(a.workdir, name + ".log"), env)
    if "error" in r:
        return r
    r["epoch_time_s"] = r.get("total_s")
    ours = a.params.get(case)
    if ours and r.get("params") and r["params"] != ours:
        r["warning"] = f"shape mismatch: PyTorch model has {r['params']:,} parameters, shardtrain {ours:,}"
    return r


def ratio(x, y):
    return x / y if x and y else None


def fmt_ratio(x, digits=3):
    return f"{x:.{digits}f}" if x is not None else "-"


def loss_diff(dp, z3):
    """Largest |loss(zero3) - loss(dp)| over the logged steps both have."""
    a, b = dp.get("losses") or {}, z3.get("losses") or {}
    common = sorted(set(a) & set(b))
    return max(abs(a[s] - b[s]) for s in common) if common else None


def summarize(row):
    dp, z3, fs = row.get("dp", {}), row.get("zero3", {}), row.get("fsdp2", {})
    est = row.get("estimate", {})
    s = {"zero3_over_dp_tokens": ratio(z3.get("tokens_per_s"), dp.get("tokens_per_s")),
         "zero3_over_dp_peak": ratio(z3.get("peak_allocated"), dp.get("peak_allocated")),
         "zero3_over_fsdp2_tokens": ratio(z3.get("tokens_per_s"), fs.get("tokens_per_s")),
         "zero3_over_fsdp2_epoch_speed": ratio(fs.get("epoch_time_s"), z3.get("epoch_time_s")),
         "zero3_over_fsdp2_peak": ratio(z3.get("peak_allocated"), fs.get("peak_allocated")),
         "max_loss_diff_zero3_dp": loss_diff(dp, z3)}
    for st in ("dp", "zero3"):
        e = est.get(st) if isinstance(est.get(st), dict) else None
        peak = row.get(st, {}).get("peak_allocated")
        s[f"estimate_{st}"] = e["total"] if e else None
        s[f"estimate_{st}_over_measured"] = ratio(e["total"], peak) if e else None
    return s


def print_table(res):
    rows = res["rows"]
    for r in rows:  # problems first, the tables last
        for fw in FRAMEWORKS:
            e = r.get(fw)
            if not e:
                continue
            if "error" in e:
                tail = [l for l in e.get("log_tail", "").replace("\r", "\n").splitlines()
                        if l.strip() and not l.startswith("$ ") and l.strip() not in e["error"]]
                print(f"\nerror: {r['case']} {fw}: {e['error'][:400]}" + (f" ({e['log']})" if "log" in e else ""))
                print("\n".join("    " + l[:160] for l in tail[-3:]))
            if "warning" in e:
                print(f"\nwarning: {r['case']} {fw}: {e['warning']}")

    def tok(e):
        return f"{e['tokens_per_s']:,.0f}" if "tokens_per_s" in e else ("skipped" if "skipped" in e.get("error", "") else "error")

    def mem(e, key="peak_allocated"):
        return human(e.get(key)) if e.get(key) else "-"

    print(f"\nzero3 vs dp, one {'CPU (smoke: numbers mean nothing)' if res['smoke'] else 'GPU'}:"
          " tokens/s steady state; peak allocated / reserved; estimate = `shardtrain estimate` total")
    hdr = (f"{'case':9} {'shape':24} | {'dp tok/s':>9} {'zero3':>9} {'z3/dp':>6} | {'dp peak':>9} "
           f"{'z3 peak':>9} {'z3/dp':>6} | {'dp rsvd':>9} {'z3 rsvd':>9} | {'est dp':>9} "
           f"{'est z3':>9} | {'max dloss':>9}")
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        dp, z3, s = r.get("dp", {}), r.get("zero3", {}), r["summary"]
        shape = f"{r['model']} {r['micro_batch']}x{r['seq']} {r['steps']}st"
        dl = s["max_loss_diff_zero3_dp"]
        print(f"{r['case']:9} {shape:24} | {tok(dp):>9} {tok(z3):>9} "
              f"{fmt_ratio(s['zero3_over_dp_tokens']):>6} | {mem(dp):>9} {mem(z3):>9} "
              f"{fmt_ratio(s['zero3_over_dp_peak']):>6} | {mem(dp, 'peak_reserved'):>9} "
              f"{mem(z3, 'peak_reserved'):>9} | {human(s['estimate_dp']) if s['estimate_dp'] else '-':>9} "
              f"{human(s['estimate_zero3']) if s['estimate_zero3'] else '-':>9} | "
              f"{f'{dl:.2e}' if dl is not None else '-':>9}")
    fs_rows = [r for r in rows if r.get("fsdp2")]
    if fs_rows:
        print("\nzero3 vs PyTorch FSDP2 (fully_shard, reshard_after_forward=True, world size 1):"
              " tokens/s steady state, epoch = all steps")
        hdr = (f"{'case':9} | {'z3 tok/s':>9} {'FSDP2':>9} {'z3/F2':>6} | {'z3 epoch':>9} "
               f"{'F2 epoch':>9} {'speed':>6} | {'z3 peak':>9} {'F2 peak':>9} {'z3/F2':>6} | "
               f"{'z3 rsvd':>9} {'F2 rsvd':>9} | {'F2 AdamW':>8}")
        print(hdr + "\n" + "-" * len(hdr))
        for r in fs_rows:
            z3, fs, s = r.get("zero3", {}), r["fsdp2"], r["summary"]
            ep = lambda e: f"{e['epoch_time_s']:.1f} s" if e.get("epoch_time_s") else "-"  # noqa: E731
            print(f"{r['case']:9} | {tok(z3):>9} {tok(fs):>9} {fmt_ratio(s['zero3_over_fsdp2_tokens'], 2):>6} | "
                  f"{ep(z3):>9} {ep(fs):>9} {fmt_ratio(s['zero3_over_fsdp2_epoch_speed'], 2):>6} | "
                  f"{mem(z3):>9} {mem(fs):>9} {fmt_ratio(s['zero3_over_fsdp2_peak']):>6} | "
                  f"{mem(z3, 'peak_reserved'):>9} {mem(fs, 'peak_reserved'):>9} | {fs.get('adamw', '-'):>8}")

    print("\ntargets:")
    for r in rows:
        s = r["summary"]
        if r["case"] not in EPOCH_CASES and (r.get("dp") or r.get("zero3")):
            t, m = s["zero3_over_dp_tokens"], s["zero3_over_dp_peak"]
            print(f"  {r['case']:9} zero3 tokens/s >= 0.97 x dp: {verdict(t, t is not None and t >= 0.97)}"
                  f"; zero3 peak <= dp: {verdict(m, m is not None and m <= 1.0)}")
        if r.get("fsdp2"):
            t, m = s["zero3_over_fsdp2_tokens"], s["zero3_over_fsdp2_peak"]
            print(f"  {r['case']:9} zero3 tokens/s >= 3 x FSDP2: {verdict(t, t is not None and t >= 3.0)}"
                  f"; zero3 peak <= FSDP2: {verdict(m, m is not None and m <= 1.0)}")
    if res["smoke"]:
        print("smoke mode (CPU): peaks are CPU memory (peak resident set), estimates are for GPUs;"
              " the numbers mean nothing.")


def verdict(x, ok):
    return "n/a" if x is None else f"{x:.3f} {'yes' if ok else 'NO'}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--cases", default=None, help=f"default {DEFAULT_CASES} (smoke: medium4,xl2,tutorial)")
    ap.add_argument("--frameworks", default="dp,zero3,fsdp2")
    ap.add_argument("--fsdp-cases", default="tutorial",
                    help="cases that also run the FSDP2 peer ('all' for every case; default tutorial)")
    ap.add_argument("--cell-timeout", type=float, default=100, help="seconds per job (xl 150, tutorial 240)")
    ap.add_argument("--budget", type=float, default=540,
                    help="seconds for the whole bench: later jobs are skipped, the table printed")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke test: --device cpu, tiny models")
    ap.add_argument("--out", default="bench_zero3_single_gpu.json")
    ap.add_argument("--workdir", default="/tmp/bench_zero3")
    a = ap.parse_args()
    a.device = "cpu" if a.smoke else "cuda"
    table = SMOKE_CASES if a.smoke else CASES
    names = (a.cases or ("medium4,xl2,tutorial" if a.smoke else DEFAULT_CASES)).split(",")
    unknown = [c for c in names if c not in table]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(table)}")
    a.cases = {c: table[c] for c in names}
    frameworks = a.frameworks.split(",")
    if any(f not in FRAMEWORKS for f in frameworks):
        ap.error(f"--frameworks: choose from {', '.join(FRAMEWORKS)}")
    fsdp_cases = set(names) if a.fsdp_cases == "all" else set(a.fsdp_cases.split(","))
    prepare_paths(ap, a)
    a.torch_ok = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    start = time.time()

    env = bench_env(a.smoke)
    res = result_header(a, torch_importable=a.torch_ok, rows=[])
    print(f"shardtrain: {res['shardtrain_version']}; GPUs: {res['gpu_names'] or a.device}; "
          f"torch+transformers importable: {a.torch_ok}", flush=True)
    rows, a.params = {}, {}
    for case, (model, B, T, steps, warmup) in a.cases.items():
        row = {"case": case, "model": model, "micro_batch": B, "seq": T, "steps": steps,
               "warmup": warmup, "epoch_samples": EPOCH_CASES.get(case)}
        try:
            row["estimate"] = run_estimate(a.shardtrain, model, B, T)
        except Exception as e:  # noqa: BLE001 - a missing estimate is not fatal
            row["estimate"] = {"error": repr(e)[-500:]}
        rows[case] = row
        a.params[case] = row["estimate"].get("params")
    # shardtrain first (the targets), then the FSDP2 peers, so a spent budget cuts only the peers
    jobs = [(c, f) for c in a.cases for f in frameworks if f != "fsdp2"]
    jobs += [(c, "fsdp2") for c in a.cases if "fsdp2" in frameworks and c in fsdp_cases]
    port = 29500 + os.getpid() % 1000
    for case, fw in jobs:
        row = rows[case]
        left = a.budget - (time.time() - start)
        limit = CELL_TIMEOUT.get(case, CELL_TIMEOUT.get(row["model"], a.cell_timeout))
        if left < 15:
            row[fw] = {"error": "skipped: --budget spent"}
        else:
            port += 1
            try:
                if fw == "fsdp2":
                    row[fw] = run_fsdp2(a, case, min(limit, left), env, port)
                else:
                    row[fw] = run_shardtrain(a, case, fw, min(limit, left), env)
            except Exception as e:  # noqa: BLE001 - record and go on with the next job
                row[fw] = {"error": repr(e)[-1500:]}
        r = row[fw]
        what = (f"{r['tokens_per_s']:,.0f} tokens/s, peak {human(r.get('peak_allocated'))}, "
                f"epoch {r.get('epoch_time_s') or 0:.1f} s, job {r.get('wall_s', 0):.0f} s"
                if "tokens_per_s" in r else "error: " + r["error"][:300])
        print(f"[{time.time() - start:4.0f} s] {case} {fw}: {what}", flush=True)
        res["rows"] = [dict(x, summary=summarize(x)) for x in rows.values()]
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    res["rows"] = [dict(x, summary=summarize(x)) for x in rows.values()]
    res["wall_s"] = time.time() - start
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print_table(res)
    print(f"\n{len(jobs)} jobs in {res['wall_s']:.0f} s; JSON: {a.out}; logs: {a.workdir}")
    failed = any("error" in r[f] and not r[f]["error"].startswith("skipped: torch")
                 for r in res["rows"] for f in FRAMEWORKS if f in r)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
