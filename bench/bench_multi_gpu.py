#!/usr/bin/env python3
"""Multi-GPU benchmark (issue 4): shardtrain dp / zero1 / zero2 against PyTorch DDP /
ZeroRedundancyOptimizer / FSDP2 (fully_shard, reshard_after_forward=False) on identical shapes, on
1 and N GPUs of one host, in one run: tokens/s per GPU, scaling (per-GPU tokens/s on N GPUs over
that on 1), peak memory per GPU, and the `shardtrain estimate` prediction.

Usage (GPU machine; about 24 short jobs, bounded by --budget seconds in all):
    python3 bench/bench_multi_gpu.py --shardtrain .device/shardtrain --gpus 2 \
        --out $OUT/bench_multi_gpu.json --workdir $OUT/bench_multi_gpu
CPU smoke test of the scripts themselves (gpt2-micro, gloo, shardtrain --device cpu via mpirun):
    python3 bench/bench_multi_gpu.py --smoke --gpus 2

Each cell runs `shardtrain launch --nproc-per-node G -- train ...` and
`python -m torch.distributed.run --nproc-per-node G bench/torch_dist_worker.py ...` in its own
process group with a timeout; a failed or timed-out cell is recorded as an error and the rest
still run. Both sides train the same micro-batch per GPU and sequence length for the same number
of steps and time the steps after the warmup; tokens/s counts the tokens of all ranks.
Peak memory: shardtrain's metrics.jsonl (rank 0's GPU); PyTorch: max over ranks of
torch.cuda.max_memory_allocated / max_memory_reserved (rank 0's also kept in the JSON).
Per-cell logs go to --workdir. Not a test; docs/BENCHMARKS.md records results with GPU and date.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

PAIRS = [("dp", "ddp"), ("zero1", "zero"), ("zero2", "fsdp2"), ("zero3", "fsdp2-reshard")]
# PyTorch sides that are torch_dist_worker.py strategies with extra flags
TORCH_FLAGS = {"fsdp2-reshard": ["fsdp2", "--reshard-after-forward"]}
# model: (optimizer steps, untimed warmup steps); warmup must be a multiple of LOG_INTERVAL
PLAN = {"gpt2-medium": (40, 10), "gpt2-xl": (15, 5)}
SMOKE_PLAN = (15, 5)
LOG_INTERVAL = 5
CELL_TIMEOUT = {"gpt2-xl": 150}  # seconds per job; others: --cell-timeout
COMM_TIMEOUT = 60  # seconds a collective may hang before a job fails by itself
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "torch_dist_worker.py")
RESULT_TAG = "BENCH_RESULT "
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def run_job(cmd, timeout, log_path, env):
    """Runs cmd in its own process group, output to log_path; returns (rc or None on timeout, log)."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(p.pid, sig)  # the launcher and everything of its group
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    pass
    with open(log_path, errors="replace") as f:
        return rc, f.read()


def job_error(rc, text, timeout, log_path):
    what = f"timed out after {timeout:.0f} s" if rc is None else f"exit status {rc}"
    if rc == 0:
        what = "no result line"
    return {"error": what, "log": log_path, "log_tail": text[-2000:]}


def parse_estimate(text):
    """`shardtrain estimate` table -> {strategy: {model_states, activations, buffers, total}} bytes."""
    est = {}
    for line in text.splitlines():
        w = line.split()
        if len(w) < 9 or not all(w[i] in UNITS for i in (2, 4, 6, 8)):
            continue
        try:
            vals = [float(w[i].replace(",", "")) * UNITS[w[i + 1]] for i in (1, 3, 5, 7)]
        except ValueError:
            continue
        est[w[0]] = dict(zip(("model_states", "activations", "buffers", "total"), vals))
    return est


def run_estimate(binary, model, gpus, batch, seq):
    p = subprocess.run([binary, "estimate", "--model", model, "--gpus", str(gpus),
                        "--micro-batch", str(batch), "--max-length", str(seq)],
                       capture_output=True, text=True, timeout=60)
    est = parse_estimate(p.stdout)
    if not est:
        raise RuntimeError(f"cannot parse `shardtrain estimate` output: {(p.stdout + p.stderr)[-500:]}")
    m = re.search(r"\(([\d,]+) parameters", p.stdout)
    est["params"] = int(m.group(1).replace(",", "")) if m else None
    return est


def parse_metrics(path, warmup, smoke):
    """shardtrain metrics.jsonl -> tokens/s (all ranks) over the windows after `warmup` steps."""
    recs = [json.loads(line) for line in open(path) if line.strip()]
    steps = sorted((r for r in recs if "loss" in r and "tokens_per_s" in r and "step_time_s" in r),
                   key=lambda r: r["step"])
    prev, tokens, seconds = 0, 0.0, 0.0
    for r in steps:
        window = r["step"] - prev  # the record averages the steps since the previous one
        if prev >= warmup:
            t = r["step_time_s"] * window
            seconds += t
            tokens += r["tokens_per_s"] * t
        prev = r["step"]
    if seconds <= 0:
        raise RuntimeError(f"no step records after step {warmup} in {path}")
    epoch = [r for r in recs if "peak_memory_bytes" in r]
    if not epoch:
        raise RuntimeError(f"no epoch record (peak memory) in {path}")
    alloc = epoch[-1].get("device_peak_allocated_bytes")
    reserved = epoch[-1].get("device_peak_reserved_bytes")
    if smoke and not alloc:  # CPU backend without device counters: peak resident set
        alloc = reserved = epoch[-1]["peak_memory_bytes"]
    losses = [r["loss"] for r in steps]
    return {"tokens_per_s": tokens / seconds, "timed_steps": prev - warmup, "timed_s": seconds,
            "peak_allocated": alloc, "peak_reserved": reserved,
            "first_loss": losses[0], "last_loss": losses[-1]}


def run_train_job(cmd, metrics, warmup, smoke, timeout, log, env):
    """Runs a `shardtrain ... train` job writing `metrics` (metrics.jsonl); returns (its
    parse_metrics result with wall_s and log, or a job_error when training did not finish, and the
    job's output). A job that finished training and then failed keeps its numbers, with a warning."""
    t0 = time.time()
    rc, text = run_job(cmd, timeout, log, env)
    done = os.path.exists(metrics) and any('"event":"done"' in l.replace(" ", "") for l in open(metrics))
    if not done:  # the run did not finish training
        return job_error(rc, text, timeout, log), text
    r = parse_metrics(metrics, warmup, smoke)
    r.update(wall_s=time.time() - t0, log=log)
    if rc != 0:  # finished and measured, then failed on the way out: keep the numbers
        r["warning"] = job_error(rc, text, timeout, log)["error"] + " after training finished"
    return r, text


def run_tagged_job(cmd, timeout, log, env):
    """Runs a job that prints its result as one "BENCH_RESULT {json}" line (the PyTorch workers);
    returns that dict with wall_s and log, or a job_error. A job that printed its result and then
    failed (seen with gloo in teardown) keeps its numbers, with a warning."""
    t0 = time.time()
    rc, text = run_job(cmd, timeout, log, env)
    lines = [l[len(RESULT_TAG):] for l in text.splitlines() if l.startswith(RESULT_TAG)]
    if not lines:
        return job_error(rc, text, timeout, log)
    r = json.loads(lines[-1])
    r.update(wall_s=time.time() - t0, log=log)
    if rc != 0:
        r["warning"] = job_error(rc, text, timeout, log)["error"] + " after the result line"
    return r


def run_shardtrain(a, strategy, model, gpus, steps, warmup, port, timeout, env):
    name = f"{model}_{strategy}_{gpus}gpu"
    out = os.path.join(a.workdir, name)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # shardtrain appends to it
    cmd = [a.shardtrain, "launch", "--nproc-per-node", str(gpus), "--master-port", str(port),
           "--comm-timeout", str(COMM_TIMEOUT), "--stop-grace", "5", "--",
           "train", "--model", model, "--dataset", "wikitext-2", "--device", a.device,
           "--strategy", strategy, "--batch-size", str(a.batch), "--max-length", str(a.seq),
           "--max-steps", str(steps), "--log-interval", str(LOG_INTERVAL), "--warmup-steps", "5",
           "--eval-samples", str(a.batch), "--no-save", "--output-dir", out]
    r, _ = run_train_job(cmd, metrics, warmup, a.smoke, timeout,
                         os.path.join(a.workdir, name + ".log"), env)
    if "tokens_per_s" in r:
        r["per_gpu"] = r["tokens_per_s"] / gpus
    return r


def run_torch(a, strategy, model, gpus, steps, warmup, timeout, env):
    name = f"{model}_{strategy}_{gpus}gpu"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={gpus}", WORKER, "--strategy",
           *TORCH_FLAGS.get(strategy, [strategy]), "--model", model,
           "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(steps),
           "--warmup", str(warmup), "--device", a.device, "--comm-timeout", str(COMM_TIMEOUT)]
    return run_tagged_job(cmd, timeout, os.path.join(a.workdir, name + ".log"), env)


def progress(r):
    if r.get("skipped"):
        return "not run (" + r["skipped"] + ")"
    if "per_gpu" not in r:
        return "error: " + r["error"]
    return f"{r['per_gpu']:.0f} tok/s/GPU, {human(r.get('peak_allocated'))} (job {r['wall_s']:.0f} s)"


def describe(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return repr(e)


def bench_env(smoke):
    """The environment of every bench job: NVLink multicast off (the device machines' rule),
    unbuffered Python; in smoke mode oneDNN kept off AMX (its bf16 kernels die with SIGILL on VMs
    that do not enable AMX)."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if smoke:
        env.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    return env


def prepare_paths(ap, a):
    """Makes --shardtrain and --workdir absolute, checks that the binary can run (ap.error
    otherwise) and creates the work directory."""
    a.shardtrain = os.path.abspath(a.shardtrain)
    a.workdir = os.path.abspath(a.workdir)
    if not os.access(a.shardtrain, os.X_OK):
        ap.error(f"--shardtrain {a.shardtrain} is not an executable")
    os.makedirs(a.workdir, exist_ok=True)


def result_header(a, **extra):
    """The fields every bench result JSON starts with (date, mode, binary version, GPUs), then
    `extra`; `a` holds the parsed --shardtrain, --smoke and the device."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": a.smoke, "device": a.device,
            "shardtrain_version": describe([a.shardtrain, "--version"]),
            "gpu_names": [] if a.smoke else describe(["nvidia-smi", "-L"]).splitlines(), **extra}


def human(b):
    if b is None:
        return "n/a"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def print_table(res):
    """Problems first, then the table last, so that the tail of the output holds the table."""
    rows = res["rows"]
    one = {(r["model"], r["shardtrain"], r["gpus"]): r for r in rows}

    def label(r, side):
        return f"{r['model']} {r['shardtrain'] if side == 'ours' else r['torch']} on {r['gpus']} GPU(s)"

    for r in rows:
        for side in ("ours", "theirs"):
            e = r[side]
            if "error" in e and not e.get("skipped"):
                tail = [l for l in e.get("log_tail", "").replace("\r", "\n").splitlines() if l.strip()]
                print(f"\nerror: {label(r, side)}: {e['error']}"
                      + (f" ({e['log']})" if "log" in e else ""))
                print("\n".join("    " + l[:160] for l in tail[-4:]))
            if "warning" in e:
                print(f"\nwarning: {label(r, side)}: {e['warning']} ({e.get('log', '')})")

    def per_gpu(r, side):
        return r[side].get("per_gpu") if r else None

    def ratio(x, y):
        return f"{x / y:.2f}" if x and y else "-"

    hdr = (f"{'model':12} {'shardtrain/PyTorch':18} {'GPUs':>4} | {'shardtrain':>10} {'PyTorch':>10}"
           f" {'ratio':>6} | {'scaling':>7} {'scaling':>7} | {'shardtrain':>10} {'PyTorch':>10}"
           f" {'estimate':>10}")
    sub = (f"{'':12} {'':18} {'':>4} | {'tok/s/GPU':>10} {'tok/s/GPU':>10} {'st/pt':>6} |"
           f" {'st':>7} {'pt':>7} | {'peak alloc':>10} {'peak alloc':>10} {'(st)':>10}")
    print("\n" + hdr + "\n" + sub + "\n" + "-" * len(hdr))
    for r in rows:
        o, t = r["ours"], r["theirs"]
        base = one.get((r["model"], r["shardtrain"], 1)) if r["gpus"] > 1 else None
        so, st = per_gpu(r, "ours"), per_gpu(r, "theirs")
        sc_o = ratio(so, per_gpu(base, "ours")) if base else "-"
        sc_t = ratio(st, per_gpu(base, "theirs")) if base else "-"
        est = r.get("estimate", {}).get("total")
        t_cell = "not run" if t.get("skipped") else f"{st:.0f}" if st else "error"
        print(f"{r['model']:12} {r['shardtrain'] + '/' + r['torch']:18} {r['gpus']:4} | "
              f"{f'{so:.0f}' if so else 'error':>10} {t_cell:>10} "
              f"{ratio(so, st):>6} | {sc_o:>7} {sc_t:>7} | "
              f"{human(o.get('peak_allocated')) if so else '-':>10} "
              f"{human(t.get('peak_allocated')) if st else '-':>10} {human(est):>10}")
    print("st = shardtrain, pt = PyTorch; tokens/s per GPU = tokens/s of all ranks / GPUs; scaling"
          " = per-GPU tokens/s on N GPUs / on 1 GPU;\npeak alloc: shardtrain rank 0's GPU, PyTorch"
          " max over ranks (rank 0's and reserved bytes in the JSON); estimate: `shardtrain"
          " estimate` total per rank.")
    if res.get("smoke"):
        print("smoke mode (CPU): peaks are CPU memory (shardtrain's allocator / PyTorch's peak RSS),"
              " estimates are for GPUs; the numbers mean nothing.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--gpus", type=int, default=2, help="N: every cell runs on 1 and on N GPUs")
    ap.add_argument("--models", default=None, help="default gpt2-medium,gpt2-xl (smoke: gpt2-micro)")
    ap.add_argument("--pairs", default="dp,zero1,zero2",
                    help="shardtrain strategies to run (dp, zero1, zero2, zero3)")
    ap.add_argument("--torch-gpus", default="all",
                    help="GPU counts the PyTorch side runs on: all, none, or a list such as 2 "
                         "(our 1-GPU cells give shardtrain's scaling either way)")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch per GPU (default 4, smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 512, smoke 64)")
    ap.add_argument("--steps", type=int, default=None, help="override the per-model step count")
    ap.add_argument("--warmup", type=int, default=None, help="override the untimed steps")
    ap.add_argument("--cell-timeout", type=float, default=90, help="seconds per job (gpt2-xl: 150)")
    ap.add_argument("--budget", type=float, default=500,
                    help="seconds for the whole bench: later jobs are skipped, the table printed")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke test: --device cpu, gloo, tiny model")
    ap.add_argument("--out", default="bench_multi_gpu.json")
    ap.add_argument("--workdir", default="/tmp/bench_multi_gpu")
    a = ap.parse_args()
    a.device = "cpu" if a.smoke else "cuda"
    a.models = a.models or ("gpt2-micro" if a.smoke else "gpt2-medium,gpt2-xl")
    a.batch = a.batch or (2 if a.smoke else 4)
    a.seq = a.seq or (64 if a.smoke else 512)
    prepare_paths(ap, a)
    start = time.time()

    env = bench_env(a.smoke)

    wanted = a.pairs.split(",")
    pairs = [p for p in PAIRS if p[0] in wanted]
    gpu_counts = sorted({1, a.gpus})
    res = result_header(a, batch=a.batch, seq=a.seq, gpus=gpu_counts, rows=[])
    print(f"shardtrain: {res['shardtrain_version']}; GPUs: {res['gpu_names'] or a.device}", flush=True)
    port = 29500 + os.getpid() % 1000  # a fresh rendezvous port per shardtrain job
    for model in a.models.split(","):
        steps, warmup = SMOKE_PLAN if a.smoke else PLAN.get(model, PLAN["gpt2-medium"])
        steps, warmup = a.steps or steps, a.warmup if a.warmup is not None else warmup
        if warmup % LOG_INTERVAL or not 0 <= warmup < steps:
            ap.error(f"need 0 <= warmup < steps and warmup a multiple of {LOG_INTERVAL}")
        limit = CELL_TIMEOUT.get(model, a.cell_timeout)
        for g in gpu_counts:
            try:
                est = run_estimate(a.shardtrain, model, g, a.batch, a.seq)
            except Exception as e:  # noqa: BLE001 - a missing estimate is not fatal
                est = {"error": repr(e)}
            for ours, theirs in pairs:
                row = {"model": model, "gpus": g, "shardtrain": ours, "torch": theirs,
                       "steps": steps, "warmup": warmup,
                       "estimate": est.get(ours) or {"error": est.get("error", "no row for " + ours)}}
                for side in ("ours", "theirs"):
                    if side == "theirs" and not torch_runs(a.torch_gpus, g):
                        row[side] = {"skipped": "--torch-gpus " + a.torch_gpus}
                        continue
                    left = a.budget - (time.time() - start)
                    if left < 15:
                        row[side] = {"error": "skipped: --budget spent"}
                        continue
                    timeout = min(limit, left)
                    port += 1
                    try:
                        if side == "ours":
                            row[side] = run_shardtrain(a, ours, model, g, steps, warmup, port,
                                                       timeout, env)
                        else:
                            row[side] = run_torch(a, theirs, model, g, steps, warmup, timeout, env)
                    except Exception as e:  # noqa: BLE001 - record and go on with the next job
                        row[side] = {"error": repr(e)[-1500:]}
                t_params = row["theirs"].get("params")
                if t_params and est.get("params") and t_params != est["params"]:
                    row["theirs"]["error"] = (f"shape mismatch: PyTorch model has {t_params:,} "
                                              f"parameters, shardtrain {est['params']:,}")
                res["rows"].append(row)
                print(f"[{time.time() - start:4.0f} s] {model} {ours}/{theirs} on {g} GPU(s): "
                      + "; ".join(f"{who} " + progress(row[side])
                                   for who, side in (("st", "ours"), ("pt", "theirs"))), flush=True)
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)
    # rows ordered for the table: model, pair, GPUs
    order = {p[0]: i for i, p in enumerate(PAIRS)}
    res["rows"].sort(key=lambda r: (a.models.split(",").index(r["model"]), order[r["shardtrain"]], r["gpus"]))
    res["wall_s"] = time.time() - start
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print_table(res)
    print(f"\n{len(res['rows'])} cells in {res['wall_s']:.0f} s; JSON: {a.out}; logs: {a.workdir}")
    return 1 if any("error" in r[s] for r in res["rows"] for s in ("ours", "theirs")) else 0


def torch_runs(spec, gpus):
    """Whether --torch-gpus SPEC (all, none, or a comma list of GPU counts) includes `gpus`."""
    if spec in ("all", "none"):
        return spec == "all"
    return str(gpus) in spec.split(",")


if __name__ == "__main__":
    sys.exit(main())
