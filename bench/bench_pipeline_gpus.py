#!/usr/bin/env python3
"""Pipeline parallelism on 2 GPUs: shardtrain's schedules against torch.distributed.pipelining on
the same GPT-2 (default gpt2-xl), micro-batch and sequence length, for M micro-batches per step:
tokens/s per GPU, peak memory of each stage, and shardtrain's measured pipeline bubble next to
its simulator's prediction for the measured op times of each stage.

Usage (GPU machine with 2 GPUs; 18 short jobs, bounded by --budget seconds in all):
    python3 bench/bench_pipeline_gpus.py --shardtrain .device/shardtrain \
        --out $OUT/bench_pipeline_gpus.json --workdir $OUT/bench_pipeline_gpus --svg-dir $OUT/svg
CPU smoke test of the scripts themselves (gpt2-tiny, the smallest preset whose 4 blocks cut into
2 stages × 2 chunks; M = 4, 2 × 64 tokens, 4 steps; shardtrain --device cpu via mpirun, torch with
gloo; about 2 minutes on 2 cores; run it with a Python that has torch and transformers, and set
SHARDTRAIN_DATA_DIR when the binary is not in its build tree):
    PY_WITH_TORCH bench/bench_pipeline_gpus.py --smoke --shardtrain build-cpu/shardtrain
Sizing: gpt2-xl, 6 steps (2 untimed) per job; a job is mostly start-up (process launch, CUDA and
NCCL init, building the model), so 18 jobs take about 6–9 minutes: --budget (default 480 s)
skips what is left, the larger M first; --micro-batches 8 halves the run.

Pairs (shardtrain --pipeline-schedule ↔ bench/torch_pipeline_worker.py --schedule):
gpipe ↔ gpipe (ScheduleGPipe), 1f1b ↔ 1f1b (Schedule1F1B), interleaved-1f1b with
--virtual-stages 2 ↔ interleaved-1f1b (ScheduleInterleaved1F1B, 2 chunks per rank), zb-h1 ↔ zb
(ScheduleInterleavedZeroBubble, 2 chunks per rank: the closest torch schedule, not the same one),
2bw ↔ none (its ratio is against torch's 1F1B of the same M, marked "vs 1f1b").
Both sides cut the blocks uniformly (shardtrain --partition-method uniform unless --partition
says otherwise) and run M = --gradient-accumulation-steps micro-batches of --batch × --seq tokens
per step on 2 stages, one per GPU; the step's tokens are M × batch × seq. Each cell runs in its own
process group with a timeout; a failed or timed-out cell is recorded as an error and the rest
still run; cells are run M by M, so when --budget runs out the larger M go first.

What is measured:
- tokens/s per GPU: tokens of the timed steps (after --warmup) / their seconds / 2. shardtrain:
  its metrics.jsonl step records (bench_multi_gpu.parse_metrics, --log-interval 1); PyTorch: the
  worker's BENCH_RESULT line (synchronize + barrier around the timed steps).
- peak memory per stage (bytes): shardtrain's epoch record "peak_memory_bytes_per_rank" (the GPU's
  peak allocated bytes of each rank, rank = stage); PyTorch: torch.cuda.max_memory_allocated of
  each rank. In --smoke both are CPU peak resident sets.
- bubble: shardtrain --trace's summary of the last step, "measured bubble X% (simulator, for the
  measured op times of each stage: Y%)"; gap = X − Y in percentage points. The trace's
  timeline.svg / predicted.svg are copied to --svg-dir as measured-<schedule>-M<M>-2gpu.svg /
  predicted-<schedule>-M<M>-2gpu.svg. --trace synchronizes the GPU after every pass (to time it),
  which costs shardtrain a little throughput; --no-trace measures without it (and no bubble).
Differences that stay: PyTorch trains random tokens, shardtrain WikiText-2 (same shapes); the
PyTorch LM head is not tied to wte (one vocab × n_embd matrix more on the last stage), shardtrain
ties them and all-reduces the tied gradient between the first and last stage.
Not a test; docs/BENCHMARKS.md records results with GPU and date.
"""
import argparse
import json
import os
import re
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_multi_gpu import (bench_env, human, prepare_paths, result_header,  # noqa: E402
                             run_tagged_job, run_train_job)

# shardtrain schedule -> (its extra flags, the matching torch_pipeline_worker schedule or None)
PAIRS = [("gpipe", [], "gpipe"), ("1f1b", [], "1f1b"),
         ("interleaved-1f1b", ["--virtual-stages", "2"], "interleaved-1f1b"),
         ("zb-h1", [], "zb"), ("2bw", [], None)]
# (optimizer steps, untimed warmup steps) of each job, on GPUs and in the smoke test
PLAN, SMOKE_PLAN = (6, 2), (4, 1)
CELL_TIMEOUT = {"gpt2-xl": 150}  # seconds per job unless --cell-timeout; others 90
COMM_TIMEOUT = 60  # seconds a collective may hang before a job fails by itself
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "torch_pipeline_worker.py")
STAGES = 2
BUBBLE_RE = re.compile(r"measured bubble ([\d.]+)% \(simulator, for the measured op times of each "
                       r"stage: ([\d.]+)%\) \| step time ([\d.e+-]+) ms \(simulated ([\d.e+-]+) ms\)")
PARAMS_RE = re.compile(r"\(([\d,]+) parameters\)")


def parse_bubble(text):
    """The trainer's --trace summary -> {measured_bubble, predicted_bubble (fractions),
    gap_points, traced_step_ms, simulated_step_ms}, or {} when the log has none."""
    m = None
    for m in BUBBLE_RE.finditer(text):
        pass  # the last summary
    if not m:
        return {}
    meas, pred = float(m.group(1)) / 100, float(m.group(2)) / 100
    return {"measured_bubble": meas, "predicted_bubble": pred, "gap_points": 100 * (meas - pred),
            "traced_step_ms": float(m.group(3)), "simulated_step_ms": float(m.group(4))}


def per_rank_peaks(metrics):
    """The last epoch record's peak_memory_bytes_per_rank (bytes, rank order = stage order)."""
    recs = [json.loads(line) for line in open(metrics) if line.strip()]
    epoch = [r for r in recs if "peak_memory_bytes_per_rank" in r]
    return [int(b) for b in epoch[-1]["peak_memory_bytes_per_rank"]] if epoch else None


def run_shardtrain(a, schedule, extra, M, steps, warmup, port, timeout, env):
    name = f"st_{a.model}_{schedule}_M{M}"
    out = os.path.join(a.workdir, name)
    trace = os.path.join(out, "trace")
    metrics = os.path.join(out, "metrics.jsonl")
    shutil.rmtree(out, ignore_errors=True)  # shardtrain appends to metrics.jsonl
    cmd = [a.shardtrain, "launch", "--nproc-per-node", str(STAGES), "--master-port", str(port),
           "--comm-timeout", str(COMM_TIMEOUT), "--stop-grace", "5", "--",
           "train", "--model", a.model, "--dataset", "wikitext-2", "--device", a.device,
           "--strategy", "pipeline", "--pipeline-stages", str(STAGES),
           "--pipeline-schedule", schedule, *extra, "--partition-method", a.partition,
           "--batch-size", str(a.batch), "--max-length", str(a.seq),
           "--gradient-accumulation-steps", str(M), "--max-steps", str(steps),
           "--log-interval", "1", "--warmup-steps", "1", "--eval-samples", str(a.batch),
           "--no-save", "--output-dir", out] + ([] if a.no_trace else ["--trace", trace])
    r, text = run_train_job(cmd, metrics, warmup, a.smoke, timeout,
                            os.path.join(a.workdir, name + ".log"), env)
    if "tokens_per_s" not in r:
        return r
    r.update(per_gpu=r["tokens_per_s"] / STAGES, peak_allocated_per_stage=per_rank_peaks(metrics),
             **parse_bubble(text))
    m = PARAMS_RE.search(text)
    r["params"] = int(m.group(1).replace(",", "")) if m else None
    svgs = {}
    for src, kind in (("timeline.svg", "measured"), ("predicted.svg", "predicted")):
        path = os.path.join(trace, src)
        if os.path.exists(path):
            dst = os.path.join(a.svg_dir, f"{kind}-{schedule}-M{M}-{STAGES}gpu.svg")
            shutil.copyfile(path, dst)
            svgs[kind] = dst
    r["svg"] = svgs
    if not a.no_trace and "measured_bubble" not in r:
        r["warning"] = "; ".join(filter(None, (r.get("warning"), "no 'measured bubble' line in the log")))
    return r


def run_torch(a, schedule, M, steps, warmup, timeout, env):
    name = f"pt_{a.model}_{schedule}_M{M}"
    cmd = [a.python, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={STAGES}", WORKER, "--schedule", schedule, "--model", a.model,
           "--micro-batch", str(a.batch), "--seq", str(a.seq), "--micro-batches", str(M),
           "--steps", str(steps), "--warmup", str(warmup), "--device", a.device,
           "--comm-timeout", str(COMM_TIMEOUT)]
    return run_tagged_job(cmd, timeout, os.path.join(a.workdir, name + ".log"), env)


def progress(r):
    if r is None:
        return "-"
    if "per_gpu" not in r:
        return "error: " + r["error"]
    b = f", bubble {100 * r['measured_bubble']:.1f}%" if "measured_bubble" in r else ""
    return f"{r['per_gpu']:.0f} tok/s/GPU{b} (job {r['wall_s']:.0f} s)"


def peaks(r):
    """'stage 0 / stage 1' peak bytes, e.g. '21.30 / 18.02 GiB' or '224.6 MiB / 1.21 GiB'."""
    p = (r or {}).get("peak_allocated_per_stage")
    if not p or "per_gpu" not in r:
        return "-"
    if all(b >= 2**30 for b in p):
        return " / ".join(f"{b / 2**30:.2f}" for b in p) + " GiB"
    return " / ".join(human(b) for b in p)


def print_table(res):
    """Problems first, then the markdown table last, so that the tail of the output holds it."""
    rows = res["rows"]
    for r in rows:
        for side, who in (("ours", "shardtrain " + r["shardtrain"]), ("theirs", f"PyTorch {r['torch']}")):
            e = r.get(side)
            if not e or (side == "theirs" and r["torch"] is None):  # 2bw: 1f1b's, shown there
                continue
            if "error" in e:
                tail = [l for l in e.get("log_tail", "").replace("\r", "\n").splitlines() if l.strip()]
                print(f"\nerror: {who} M={r['M']}: {e['error']}" + (f" ({e['log']})" if "log" in e else ""))
                print("\n".join("    " + l[:160] for l in tail[-4:]))
            if "warning" in e:
                print(f"\nwarning: {who} M={r['M']}: {e['warning']} ({e.get('log', '')})")

    def pct(x):
        return f"{100 * x:.1f}%" if x is not None else "-"

    print("\n| schedule (shardtrain / PyTorch) | M | shardtrain tok/s/GPU | PyTorch tok/s/GPU | ratio "
          "| peak alloc per stage, shardtrain | peak alloc per stage, PyTorch | measured bubble "
          "| predicted bubble | gap (points) |")
    print("|---|---:|---:|---:|---:|---|---|---:|---:|---:|")
    for r in rows:
        o, t = r["ours"], r.get("theirs")
        so = o.get("per_gpu")
        st = t.get("per_gpu") if t else None
        ratio = f"{so / st:.2f}" if so and st else "-"
        if r["torch"] is None:
            ratio += " vs 1f1b" if so and st else ""
        theirs = r["torch"] or "none (1f1b for the ratio)"
        gap = o.get("gap_points")
        print(f"| {r['shardtrain']} / {theirs} | {r['M']} | {f'{so:.0f}' if so else 'error'} | "
              f"{f'{st:.0f}' if st else ('error' if t else '-')} | {ratio} | {peaks(o)} | "
              f"{peaks(t)} | {pct(o.get('measured_bubble'))} | {pct(o.get('predicted_bubble'))} | "
              f"{f'{gap:+.1f}' if gap is not None else '-'} |")
    print(f"\n{res['model']}, micro-batch {res['batch']} × {res['seq']} tokens, M micro-batches per "
          f"step, {STAGES} stages on {STAGES} {'processes' if res['smoke'] else 'GPUs'}; tok/s/GPU ="
          " tokens of the timed steps / seconds / 2; ratio = shardtrain / PyTorch; peak alloc:"
          " stage 0 / stage 1 (GPU peak allocated);\nbubble: shardtrain --trace, last step (predicted"
          " = its simulator for the measured op times of each stage); zb-h1 is compared with torch's"
          " ScheduleInterleavedZeroBubble (2 chunks per rank), the closest, not the same schedule.")
    if res.get("smoke"):
        print("smoke mode (CPU): peaks are peak resident sets; the numbers mean nothing.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python with torch and transformers for the PyTorch side (default: this one)")
    ap.add_argument("--model", default=None, help="default gpt2-xl (smoke: gpt2-tiny, the smallest "
                    "preset whose blocks cut into 2 × 2 chunks)")
    ap.add_argument("--micro-batches", default=None, help="M values, comma-separated (default 8,16; smoke 4)")
    ap.add_argument("--schedules", default=",".join(p[0] for p in PAIRS),
                    help="shardtrain schedules to run (default: all five)")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch (default 4, smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 512, smoke 64)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per job (default 6, smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2, smoke 1)")
    ap.add_argument("--partition", default="uniform", choices=["uniform", "parameters", "time"],
                    help="shardtrain --partition-method for gpipe/1f1b/zb-h1/2bw (PyTorch: uniform)")
    ap.add_argument("--no-trace", action="store_true",
                    help="run shardtrain without --trace: no GPU synchronization per pass, no bubble")
    ap.add_argument("--cell-timeout", type=float, default=None,
                    help="seconds per job (default 150 for gpt2-xl, else 90)")
    ap.add_argument("--budget", type=float, default=480,
                    help="seconds for the whole bench: later jobs are skipped, the table printed")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke test: --device cpu, gloo, tiny model")
    ap.add_argument("--out", default="bench_pipeline_gpus.json")
    ap.add_argument("--workdir", default="/tmp/bench_pipeline_gpus")
    ap.add_argument("--svg-dir", default=None, help="where the timelines go (default WORKDIR/svg)")
    a = ap.parse_args()
    a.device = "cpu" if a.smoke else "cuda"
    a.model = a.model or ("gpt2-tiny" if a.smoke else "gpt2-xl")
    a.batch = a.batch or (2 if a.smoke else 4)
    a.seq = a.seq or (64 if a.smoke else 512)
    steps, warmup = SMOKE_PLAN if a.smoke else PLAN
    steps, warmup = a.steps or steps, a.warmup if a.warmup is not None else warmup
    if not 0 <= warmup < steps:
        ap.error("need 0 <= --warmup < --steps")
    Ms = [int(m) for m in (a.micro_batches or ("4" if a.smoke else "8,16")).split(",")]
    if any(m % STAGES for m in Ms):
        ap.error(f"interleaved-1f1b needs M a multiple of {STAGES}")
    wanted = a.schedules.split(",")
    unknown = set(wanted) - {p[0] for p in PAIRS}
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}")
    pairs = [p for p in PAIRS if p[0] in wanted]
    prepare_paths(ap, a)
    a.svg_dir = os.path.abspath(a.svg_dir or os.path.join(a.workdir, "svg"))
    os.makedirs(a.svg_dir, exist_ok=True)
    start = time.time()
    env = bench_env(a.smoke)
    if a.smoke:  # Open MPI's single-copy path, as bench/pipeline_bubble_cpu.sh (docs/PIPELINE.md)
        env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "cma")
    limit = a.cell_timeout or CELL_TIMEOUT.get(a.model, 90)

    res = result_header(a, model=a.model, batch=a.batch, seq=a.seq, stages=STAGES, steps=steps,
                        warmup=warmup, micro_batches=Ms, partition=a.partition,
                        traced=not a.no_trace, rows=[])
    print(f"shardtrain: {res['shardtrain_version']}; GPUs: {res['gpu_names'] or a.device}", flush=True)
    port = 29500 + os.getpid() % 1000  # a fresh rendezvous port per shardtrain job

    def run_cell(fn, *args):
        left = a.budget - (time.time() - start)
        if left < 15:
            return {"error": "skipped: --budget spent"}
        try:
            return fn(*args, timeout=min(limit, left), env=env)
        except Exception as e:  # noqa: BLE001 - record and go on with the next job
            return {"error": repr(e)[-1500:]}

    for M in Ms:
        torch_1f1b = None
        for ours, extra, theirs in pairs:
            port += 1
            row = {"shardtrain": ours, "torch": theirs, "M": M, "steps": steps, "warmup": warmup}
            row["ours"] = run_cell(lambda timeout, env: run_shardtrain(
                a, ours, extra, M, steps, warmup, port, timeout, env))
            if theirs:
                row["theirs"] = run_cell(lambda timeout, env: run_torch(
                    a, theirs, M, steps, warmup, timeout, env))
                if theirs == "1f1b":
                    torch_1f1b = row["theirs"]
            else:  # 2bw: no torch counterpart; the ratio is against torch's 1F1B (or none)
                if torch_1f1b is None and "1f1b" not in wanted:
                    torch_1f1b = run_cell(lambda timeout, env: run_torch(
                        a, "1f1b", M, steps, warmup, timeout, env))
                ok = torch_1f1b is not None and "per_gpu" in torch_1f1b
                row["theirs"] = torch_1f1b if ok else None  # its error is 1f1b's row's
                row["theirs_is"] = "PyTorch 1f1b, for the ratio" if ok else None
            t, o = row.get("theirs") or {}, row["ours"]
            if t.get("params") and o.get("params") and \
                    t["params"] - t.get("untied_head_params", 0) != o["params"]:
                row["shape_warning"] = (f"PyTorch has {t['params']:,} parameters less "
                                        f"{t.get('untied_head_params', 0):,} of its untied head, "
                                        f"shardtrain {o['params']:,}")
            res["rows"].append(row)
            print(f"[{time.time() - start:4.0f} s] M={M} {ours}/{theirs or '-'}: st "
                  + progress(row["ours"]) + "; pt " + progress(row.get("theirs") if theirs else None),
                  flush=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    res["wall_s"] = time.time() - start
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print_table(res)
    print(f"\n{len(res['rows'])} rows in {res['wall_s']:.0f} s; JSON: {a.out}; logs: {a.workdir};"
          f" timelines: {a.svg_dir}")
    failed = any("error" in (r.get(s) or {}) for r in res["rows"] for s in ("ours", "theirs"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
