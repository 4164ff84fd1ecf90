#!/usr/bin/env python3
"""Pipeline parallelism on P GPUs (default 2, one stage each): shardtrain's schedules against
torch.distributed.pipelining on the same GPT-2 (default gpt2-xl), micro-batch and sequence length,
for M micro-batches per step: tokens/s per GPU, peak memory of each stage, and shardtrain's
measured pipeline bubble next to its simulator's prediction for the measured op times of each
stage. Also `python3 bench/bench_multi_gpu.py --suite pipeline` (P = --gpus there; --model,
--batch, --steps, --warmup are --pipeline-model, --pipeline-batch, --pipeline-steps,
--pipeline-warmup there).

Usage (GPU machine with 2 GPUs; 20 short jobs, bounded by --budget seconds in all):
    python3 bench/bench_pipeline_gpus.py --shardtrain .packed/shardtrain \
        --out $OUT/bench_pipeline_gpus.json --workdir $OUT/bench_pipeline_gpus --svg-dir $OUT/svg
CPU smoke test of the scripts themselves (gpt2-tiny, the smallest preset whose 4 blocks cut into
2 stages × 2 chunks; M = 4, 2 × 64 tokens, 4 steps; shardtrain --device cpu via mpirun, torch with
gloo; about 2 minutes on 2 cores; run it with a Python that has torch and transformers, and set
SHARDTRAIN_DATA_DIR when the binary is not in its build tree):
    PY_WITH_TORCH bench/bench_pipeline_gpus.py --smoke --shardtrain build-cpu/shardtrain
Sizing: gpt2-xl, 6 steps (2 untimed) per job; a job is mostly start-up (process launch, CUDA and
NCCL init, building the model), so 20 jobs take about 7–10 minutes: --budget (default 480 s)
skips what is left, the larger M first; --micro-batches 8 halves the run.

Pairs (shardtrain --pipeline-schedule ↔ bench/torch_pipeline_worker.py --schedule):
gpipe ↔ gpipe (ScheduleGPipe), 1f1b ↔ 1f1b (Schedule1F1B), interleaved-1f1b with
--virtual-stages 2 ↔ interleaved-1f1b (ScheduleInterleaved1F1B, 2 chunks per rank), zb-h1 ↔ zb
(ScheduleInterleavedZeroBubble, 2 chunks per rank: the closest torch schedule, not the same one),
2bw ↔ none (its ratio is against torch's 1F1B of the same M, marked "vs 1f1b").
Both sides cut the blocks uniformly (shardtrain --partition-method uniform unless --partition
says otherwise) and run M = --gradient-accumulation-steps micro-batches of --batch × --seq tokens
per step on P stages, one per GPU; the step's tokens are M × batch × seq. interleaved-1f1b runs
once per --interleaved-partitions method (default uniform,parameters: the second row cuts the
chunks by parameter count; its ratio is against the same PyTorch run, which always cuts
uniformly); the partition the trainer reports in its log ("..., X partition") is recorded, and a
row whose log names another method than asked gets a warning. Each cell runs in its own
process group with a timeout; a failed or timed-out cell is recorded as an error and the rest
still run; cells are run M by M, so when --budget runs out the larger M go first.

What is measured:
- tokens/s per GPU: tokens of the timed steps (after --warmup) / their seconds / P. shardtrain:
  its metrics.jsonl step records (multi_gpu_common.parse_metrics, --log-interval 1); PyTorch: the
  worker's BENCH_RESULT line (synchronize + barrier around the timed steps).
- peak memory per stage (bytes): shardtrain's epoch record "peak_memory_bytes_per_rank" (the GPU's
  peak allocated bytes of each rank, rank = stage); PyTorch: torch.cuda.max_memory_allocated of
  each rank. In --smoke both are CPU peak resident sets.
- bubble: shardtrain --trace's summary of the last step, "measured bubble X% (simulator, for the
  measured op times of each stage: Y%)"; gap = X − Y in percentage points. The trace's
  timeline.svg / predicted.svg are copied to --svg-dir as measured-<schedule>-M<M>-<P>gpu.svg /
  predicted-<schedule>-M<M>-<P>gpu.svg (<schedule>-<partition> for a partition other than
  --partition). --trace synchronizes the GPU after every pass (to time it), which costs
  shardtrain a little throughput; --no-trace measures without it (and no bubble).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multi_gpu_common import (COMM_TIMEOUT, HERE, Budget, bench_env, free_port, human,  # noqa: E402
                              parse_banner, prepare_paths, report_problem, result_header,
                              run_cell, run_tagged_job, run_train_job, torchrun)

# shardtrain schedule -> (its extra flags, the matching torch_pipeline_worker schedule or None)
PAIRS = [("gpipe", [], "gpipe"), ("1f1b", [], "1f1b"),
         ("interleaved-1f1b", ["--virtual-stages", "2"], "interleaved-1f1b"),
         ("zb-h1", [], "zb"), ("2bw", [], None)]
# (optimizer steps, untimed warmup steps) of each job, on GPUs and in the smoke test
PLAN, SMOKE_PLAN = (6, 2), (4, 1)
CELL_TIMEOUT = {"gpt2-xl": 150}  # seconds per job unless --cell-timeout; others 90
WORKER = os.path.join(HERE, "torch_pipeline_worker.py")
PARTITIONS = ["uniform", "parameters", "time"]
BUBBLE_RE = re.compile(r"measured bubble ([\d.]+)% \(simulator, for the measured op times of each "
                       r"stage: ([\d.]+)%\) \| step time ([\d.e+-]+) ms "
                       r"\(simulated ([\d.e+-]+) ms\)")
PARTITION_RE = re.compile(r"schedule [\w-]+(?: with \d+ virtual stages)?, (\w+) partition")


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


def variant(a, schedule, partition):
    """'' for the --partition rows, '-<partition>' for the others (job and picture names)."""
    return "" if partition == a.partition else "-" + partition


def run_shardtrain(a, schedule, extra, partition, M, steps, warmup, port, timeout, env):
    name = f"st_{a.model}_{schedule}{variant(a, schedule, partition)}_M{M}"
    out = os.path.join(a.workdir, name)
    trace = os.path.join(out, "trace")
    metrics = os.path.join(out, "metrics.jsonl")
    shutil.rmtree(out, ignore_errors=True)  # shardtrain appends to metrics.jsonl
    cmd = [a.shardtrain, "launch", "--nproc-per-node", str(a.stages), "--master-port", str(port),
           "--comm-timeout", str(COMM_TIMEOUT), "--stop-grace", "5", "--",
           "train", "--model", a.model, "--dataset", "wikitext-2", "--device", a.device,
           "--strategy", "pipeline", "--pipeline-stages", str(a.stages),
           "--pipeline-schedule", schedule, *extra, "--partition-method", partition,
           "--batch-size", str(a.batch), "--max-length", str(a.seq),
           "--gradient-accumulation-steps", str(M), "--max-steps", str(steps),
           "--log-interval", "1", "--warmup-steps", "1", "--eval-samples", str(a.batch),
           "--no-save", "--output-dir", out] + ([] if a.no_trace else ["--trace", trace])
    r, text = run_train_job(cmd, metrics, warmup, a.smoke, timeout,
                            os.path.join(a.workdir, name + ".log"), env)
    if "tokens_per_s" not in r:
        return r
    r.update(per_gpu=r["tokens_per_s"] / a.stages, peak_allocated_per_stage=per_rank_peaks(metrics),
             **parse_bubble(text))
    r["params"] = parse_banner(text)["params"]
    m = PARTITION_RE.search(text)
    r["partition_used"] = m.group(1) if m else None
    warnings = [r.get("warning")]
    if r["partition_used"] and r["partition_used"] != partition:
        warnings.append(f"asked --partition-method {partition}, the log says "
                        f"{r['partition_used']} partition")
    svgs = {}
    for src, kind in (("timeline.svg", "measured"), ("predicted.svg", "predicted")):
        path = os.path.join(trace, src)
        if os.path.exists(path):
            dst = os.path.join(a.svg_dir, f"{kind}-{schedule}{variant(a, schedule, partition)}"
                                          f"-M{M}-{a.stages}gpu.svg")
            shutil.copyfile(path, dst)
            svgs[kind] = dst
    r["svg"] = svgs
    if not a.no_trace and "measured_bubble" not in r:
        warnings.append("no 'measured bubble' line in the log")
    if any(warnings):
        r["warning"] = "; ".join(filter(None, warnings))
    return r


def run_torch(a, schedule, M, steps, warmup, timeout, env):
    name = f"pt_{a.model}_{schedule}_M{M}"
    cmd = torchrun(a.python, a.stages, WORKER, "--schedule", schedule, "--model", a.model,
                   "--micro-batch", str(a.batch), "--seq", str(a.seq), "--micro-batches", str(M),
                   "--steps", str(steps), "--warmup", str(warmup), "--device", a.device,
                   "--comm-timeout", str(COMM_TIMEOUT))
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


def print_problems(res):
    for r in res["rows"]:
        label = r["shardtrain"] + (f" ({r['partition']} partition)" if r.get("partition") else "")
        report_problem(f"shardtrain {label} M={r['M']}", r["ours"])
        if not r.get("theirs_reused"):  # a PyTorch run of an earlier row is reported there
            report_problem(f"PyTorch {r['torch'] or '1f1b'} M={r['M']}", r.get("theirs"))


def print_tables(res):
    """The markdown table."""
    rows, P = res["rows"], res["stages"]

    def pct(x):
        return f"{100 * x:.1f}%" if x is not None else "-"

    print("\n| schedule (shardtrain / PyTorch) | partition (shardtrain) | M | shardtrain "
          "tok/s/GPU | PyTorch tok/s/GPU | ratio | peak alloc per stage, shardtrain | peak alloc "
          "per stage, PyTorch | measured bubble | predicted bubble | gap (points) |")
    print("|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|")
    for r in rows:
        o, t = r["ours"], r.get("theirs")
        so = o.get("per_gpu")
        st = t.get("per_gpu") if t else None
        ratio = f"{so / st:.2f}" if so and st else "-"
        if r["torch"] is None:
            ratio += " vs 1f1b" if so and st else ""
        theirs = r["torch"] or "none (1f1b for the ratio)"
        gap = o.get("gap_points")
        part = r.get("partition", "-")
        if o.get("partition_used") and o["partition_used"] != part:
            part += f" (log: {o['partition_used']})"
        o_cell = "not run" if o.get("budget_skipped") else f"{so:.0f}" if so else "error"
        t_cell = "not run" if (t or {}).get("budget_skipped") else \
            f"{st:.0f}" if st else ("error" if t else "-")
        print(f"| {r['shardtrain']} / {theirs} | {part} | {r['M']} | {o_cell} | {t_cell} | "
              f"{ratio} | {peaks(o)} | {peaks(t)} | {pct(o.get('measured_bubble'))} | "
              f"{pct(o.get('predicted_bubble'))} | {f'{gap:+.1f}' if gap is not None else '-'} |")
    print(f"\n{res['model']}, micro-batch {res['batch']} × {res['seq']} tokens, M micro-batches"
          f" per step, {P} stages on {P} {'processes' if res['smoke'] else 'GPUs'}; tok/s/GPU ="
          f" tokens of the timed steps / seconds / {P}; ratio = shardtrain / PyTorch (PyTorch cuts"
          " uniformly); peak alloc: stage 0 / stage 1 / ... (GPU peak allocated);\nbubble:"
          " shardtrain --trace, last step (predicted = its simulator for the measured op times of"
          " each stage); zb-h1 is compared with torch's ScheduleInterleavedZeroBubble (2 chunks"
          " per rank), the closest, not the same schedule.")
    if res.get("smoke"):
        print("smoke mode (CPU): peaks are peak resident sets; the numbers mean nothing.")


def add_arguments(ap, unified=False):
    """The pipeline options. In bench_multi_gpu.py (`unified`) the generic ones are prefixed
    --pipeline- and the shared ones (--shardtrain, --seq, --cell-timeout, --budget, --smoke,
    --out, --workdir, --python; P = --gpus) are that script's."""
    g = ap.add_argument_group("pipeline suite (pipeline schedules against torch.distributed."
                              "pipelining)") if unified else ap
    pre = "--pipeline-" if unified else "--"
    g.add_argument(pre + "model", dest="pipe_model", default=None,
                   help="default gpt2-xl (smoke: gpt2-tiny, the smallest preset whose blocks cut "
                        "into 2 × 2 chunks)")
    g.add_argument("--micro-batches", default=None, help="M values, comma-separated (default 8,16; "
                   "smoke 4); multiples of the stage count")
    g.add_argument("--schedules", default=",".join(p[0] for p in PAIRS),
                   help="shardtrain schedules to run (default: all five)")
    g.add_argument(pre + "batch", dest="pipe_batch", type=int, default=None,
                   help="micro-batch (default 4, smoke 2)")
    g.add_argument(pre + "steps", dest="pipe_steps", type=int, default=None,
                   help="optimizer steps per job (default 6, smoke 4)")
    g.add_argument(pre + "warmup", dest="pipe_warmup", type=int, default=None,
                   help="untimed steps (default 2, smoke 1)")
    g.add_argument("--partition", default="uniform", choices=PARTITIONS,
                   help="shardtrain --partition-method for gpipe/1f1b/zb-h1/2bw (PyTorch: uniform)")
    g.add_argument("--interleaved-partitions", default="uniform,parameters",
                   help="shardtrain --partition-method values interleaved-1f1b runs with, a row "
                        "each (default uniform,parameters)")
    g.add_argument("--no-trace", action="store_true",
                   help="run shardtrain without --trace: no GPU synchronization per pass, no "
                        "bubble")
    g.add_argument("--svg-dir", default=None, help="where the timelines go (default WORKDIR/svg)")
    if unified:
        return
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python with torch and transformers for the PyTorch side "
                         "(default: this one)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages P = GPUs (default 2)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 512, smoke 64)")
    ap.add_argument("--cell-timeout", type=float, default=None,
                    help="seconds per job (default 150 for gpt2-xl, else 90)")
    ap.add_argument("--budget", type=float, default=480,
                    help="seconds for the whole bench: later jobs are skipped, the table printed")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke test: --device cpu, gloo, tiny model")
    ap.add_argument("--out", default="bench_pipeline_gpus.json")
    ap.add_argument("--workdir", default="/tmp/bench_pipeline_gpus")


def configure(ap, a):
    """Fills the defaults (a.model, a.batch, a.steps, a.warmup, a.Ms, a.pairs, ...) and checks
    the options (ap.error); a.stages, a.seq, a.smoke, a.device, a.workdir are set before."""
    a.model = a.pipe_model or ("gpt2-tiny" if a.smoke else "gpt2-xl")
    a.batch = a.pipe_batch or (2 if a.smoke else 4)
    a.seq = a.seq or (64 if a.smoke else 512)
    steps, warmup = SMOKE_PLAN if a.smoke else PLAN
    a.steps = a.pipe_steps or steps
    a.warmup = a.pipe_warmup if a.pipe_warmup is not None else warmup
    if not 0 <= a.warmup < a.steps:
        ap.error("need 0 <= warmup < steps (pipeline)")
    if a.stages < 2:
        ap.error("a pipeline needs 2 or more stages (GPUs)")
    a.Ms = [int(m) for m in (a.micro_batches or ("4" if a.smoke else "8,16")).split(",")]
    if any(m % a.stages for m in a.Ms):
        ap.error(f"interleaved-1f1b needs M a multiple of the {a.stages} stages")
    wanted = a.schedules.split(",")
    unknown = set(wanted) - {p[0] for p in PAIRS}
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}")
    a.wanted = wanted
    a.inter_parts = a.interleaved_partitions.split(",")
    if set(a.inter_parts) - set(PARTITIONS):
        ap.error(f"--interleaved-partitions: each one of {', '.join(PARTITIONS)}")
    a.svg_dir = os.path.abspath(a.svg_dir or os.path.join(a.workdir, "svg"))
    os.makedirs(a.svg_dir, exist_ok=True)


def run(a, budget, env, save=None):
    """Runs the cells within `budget`; returns the result (rows M by M, schedule by schedule);
    save(result so far) after each row."""
    limit = a.cell_timeout or CELL_TIMEOUT.get(a.model, 90)
    res = {"model": a.model, "batch": a.batch, "seq": a.seq, "stages": a.stages,
           "steps": a.steps, "warmup": a.warmup, "micro_batches": a.Ms, "partition": a.partition,
           "interleaved_partitions": a.inter_parts, "traced": not a.no_trace, "smoke": a.smoke,
           "rows": []}
    rows = []  # (schedule, extra flags, torch schedule, partition)
    for ours, extra, theirs in PAIRS:
        if ours in a.wanted:
            parts = a.inter_parts if ours == "interleaved-1f1b" else [a.partition]
            rows += [(ours, extra, theirs, p) for p in parts]
    steps, warmup = a.steps, a.warmup
    for M in a.Ms:
        torch_runs = {}  # PyTorch schedule -> its result for this M
        for ours, extra, theirs, part in rows:
            port = free_port()
            row = {"shardtrain": ours, "partition": part, "torch": theirs, "M": M,
                   "steps": steps, "warmup": warmup}
            row["ours"] = run_cell(budget, limit, lambda t: run_shardtrain(
                a, ours, extra, part, M, steps, warmup, port, t, env))
            want = theirs or "1f1b"  # 2bw: no torch counterpart; the ratio is against 1F1B
            ran_here = want not in torch_runs
            if ran_here:
                torch_runs[want] = row["theirs"] = run_cell(budget, limit, lambda t: run_torch(
                    a, want, M, steps, warmup, t, env))
                if theirs is None:
                    row["theirs_is"] = "PyTorch 1f1b, for the ratio"
            else:  # shown in an earlier row; its error is that row's
                ok = "per_gpu" in torch_runs[want]
                row["theirs"] = torch_runs[want] if ok else None
                row["theirs_is"] = (f"PyTorch {want} of the {want} row" if ok else None)
                row["theirs_reused"] = True
            t, o = row.get("theirs") or {}, row["ours"]
            if t.get("params") and o.get("params") and \
                    t["params"] - t.get("untied_head_params", 0) != o["params"]:
                row["shape_warning"] = (f"PyTorch has {t['params']:,} parameters less "
                                        f"{t.get('untied_head_params', 0):,} of its untied head, "
                                        f"shardtrain {o['params']:,}")
            res["rows"].append(row)
            label = ours + (f" ({part})" if ours == "interleaved-1f1b" else "")
            pt = progress(row.get("theirs")) if ran_here else f"{want} as in its own row"
            print(f"[{budget.elapsed():4.0f} s] pipeline M={M} {label}/{theirs or '-'}: st "
                  + progress(row["ours"]) + "; pt " + pt, flush=True)
            if save:
                save(res)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    a = ap.parse_args()
    a.device = "cpu" if a.smoke else "cuda"
    prepare_paths(ap, a)
    configure(ap, a)
    budget = Budget(a.budget)
    env = bench_env(a.smoke)
    res = result_header(a)

    def save(suite):
        res.update(suite)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    save(run(a, budget, env, save))
    res["wall_s"] = budget.elapsed()
    save({})
    print_problems(res)
    print_tables(res)
    print(f"\n{len(res['rows'])} rows in {res['wall_s']:.0f} s; JSON: {a.out}; logs: {a.workdir};"
          f" timelines: {a.svg_dir}")
    failed = any("error" in (r.get(s) or {}) for r in res["rows"] for s in ("ours", "theirs"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
