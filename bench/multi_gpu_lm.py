"""The `lm` suite of bench/bench_multi_gpu.py: GPT-2 data parallelism, shardtrain dp / zero1 /
zero2 / zero3 against PyTorch DDP / ZeroRedundancyOptimizer / FSDP2 (reshard_after_forward False)
/ FSDP2 (reshard_after_forward True), per micro-batch, on 1 GPU (dp / DDP: the scaling baseline)
and on N GPUs; with where the step goes (--wall-clock-breakdown) and the bytes the strategy's
collectives move, against the bus bandwidth the `bus` suite measured. See bench_multi_gpu.py's
docstring for what each number means."""
import os

from multi_gpu_common import (COMM_TIMEOUT, WORKER, fmt, free_port, gpt2_shape_defaults, human,
                              human_bytes10, parse_banner, ratio, report_problem, run_cell,
                              run_estimate, run_tagged_job, run_train_job, shardtrain_job,
                              torch_runs, torchrun)

PAIRS = [("dp", "ddp"), ("zero1", "zero"), ("zero2", "fsdp2"), ("zero3", "fsdp2-reshard")]
# PyTorch sides that are torch_dist_worker.py strategies with extra flags
TORCH_FLAGS = {"fsdp2-reshard": ["fsdp2", "--reshard-after-forward"]}
# model: (optimizer steps, untimed warmup steps); warmup must be a multiple of LOG_INTERVAL
PLAN = {"gpt2-medium": (40, 10), "gpt2-xl": (15, 5)}
SMOKE_PLAN = (15, 5)
LOG_INTERVAL = 5
CELL_TIMEOUT = {"gpt2-xl": 150}  # seconds per job; others 90 (--cell-timeout overrides both)
# The collectives of one optimizer step on each GPU (gradient accumulation 1): (collective, what
# it moves); every buffer is the whole model in the compute dtype, S = Ψ × its bytes.
COLLECTIVES = {
    "dp": [("all_reduce", "gradients")],
    "zero1": [("reduce_scatter", "gradients"), ("all_gather", "updated parameters")],
    "zero2": [("reduce_scatter", "gradients"), ("all_gather", "updated parameters")],
    "zero3": [("all_gather", "parameters, forward"), ("all_gather", "parameters, backward"),
              ("reduce_scatter", "gradients")],
}
SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG"}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def bus_factor(op, n):
    """nccl-tests' bus bandwidth factor (its PERFORMANCE.md): the bytes each GPU puts on the bus
    per byte of the full buffer S."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def add_arguments(ap):
    g = ap.add_argument_group("lm suite (GPT-2 data parallelism)")
    g.add_argument("--models", default=None, help="default gpt2-medium,gpt2-xl (smoke: gpt2-micro)")
    g.add_argument("--pairs", default=None,
                   help="shardtrain strategies to run on N GPUs (dp, zero1, zero2, zero3), each "
                        "against its PyTorch match; 1-GPU dp always runs as the baseline "
                        "(default: all four; the nodes suite: dp,zero2,zero3)")
    g.add_argument("--batches", default=None,
                   help="micro-batches per GPU, comma-separated (default 4,16; smoke 2)")
    g.add_argument("--batch", type=int, default=None,
                   help="one micro-batch per GPU (= --batches B)")
    g.add_argument("--seq", type=int, default=None, help="sequence length (default 512, smoke 64)")
    g.add_argument("--steps", type=int, default=None, help="override the per-model step count")
    g.add_argument("--warmup", type=int, default=None, help="override the untimed steps")
    g.add_argument("--torch-gpus", default="all",
                   help="GPU counts the PyTorch side runs on: all, none, or a list such as 2")
    g.add_argument("--one-gpu", choices=["dp", "all"], default="dp",
                   help="what runs on 1 GPU: the dp / DDP baseline (default), or every pair")
    g.add_argument("--no-breakdown", action="store_true",
                   help="run shardtrain without --wall-clock-breakdown (no step breakdown table)")


def configure(ap, a):
    gpt2_shape_defaults(ap, a)
    a.pairs = a.pairs or ",".join(p[0] for p in PAIRS)
    unknown = set(a.pairs.split(",")) - {p[0] for p in PAIRS}
    if unknown:
        ap.error(f"--pairs: unknown strategies {sorted(unknown)}")
    for model in a.models.split(","):
        steps, warmup = plan(a, model)
        if warmup % LOG_INTERVAL or not 0 <= warmup < steps:
            ap.error(f"need 0 <= warmup < steps and warmup a multiple of {LOG_INTERVAL}")


def plan(a, model):
    steps, warmup = SMOKE_PLAN if a.smoke else PLAN.get(model, PLAN["gpt2-medium"])
    return a.steps or steps, a.warmup if a.warmup is not None else warmup


def run_shardtrain(a, strategy, model, batch, gpus, steps, warmup, port, timeout, env):
    name = f"{model}_mb{batch}_{strategy}_{gpus}gpu"
    out, metrics, cmd = shardtrain_job(a, name, gpus, port)
    cmd += ["--model", model, "--dataset", "wikitext-2", "--device", a.device,
           "--strategy", strategy, "--batch-size", str(batch), "--max-length", str(a.seq),
           "--max-steps", str(steps), "--log-interval", str(LOG_INTERVAL), "--warmup-steps", "5",
           "--eval-samples", str(batch), "--no-save", "--output-dir", out]
    if not a.no_breakdown:
        cmd.append("--wall-clock-breakdown")
    r, text = run_train_job(cmd, metrics, warmup, a.smoke, timeout,
                            os.path.join(a.workdir, name + ".log"), env)
    if "tokens_per_s" in r:
        r["per_gpu"] = r["tokens_per_s"] / gpus
        banner = parse_banner(text)
        r.update(params=banner["params"], precision=banner["precision"])
    return r


def run_torch(a, strategy, model, batch, gpus, steps, warmup, timeout, env):
    name = f"{model}_mb{batch}_{strategy}_{gpus}gpu"
    cmd = torchrun(a.python, gpus, WORKER, "--strategy", *TORCH_FLAGS.get(strategy, [strategy]),
                   "--model", model, "--batch", str(batch), "--seq", str(a.seq),
                   "--steps", str(steps), "--warmup", str(warmup), "--device", a.device,
                   "--comm-timeout", str(COMM_TIMEOUT))
    return run_tagged_job(cmd, timeout, os.path.join(a.workdir, name + ".log"), env)


def comm_model(strategy, params, precision, n, busbw):
    """The collectives of one optimizer step on each of n GPUs for Ψ = params: buffer bytes S,
    bytes on the bus per GPU, and with busbw ({collective: GB/s}) the minimum time at that
    bandwidth (nccl-tests: time = bus bytes / busbw)."""
    elem = DTYPE_BYTES.get(precision, 2)
    items = []
    for op, what in COLLECTIVES[strategy]:
        S = params * elem
        bus = bus_factor(op, n) * S
        bw = (busbw or {}).get(op)
        items.append({"op": op, "moves": what, "buffer_bytes": S, "bus_bytes": bus,
                      "busbw_GBps": bw, "min_ms": 1e3 * bus / (bw * 1e9) if bw else None})
    mins = [i["min_ms"] for i in items]
    return {"params": params, "elem_bytes": elem, "collectives": items,
            "buffer_bytes": sum(i["buffer_bytes"] for i in items),
            "bus_bytes": sum(i["bus_bytes"] for i in items),
            "min_comm_ms": sum(mins) if all(m is not None for m in mins) else None}


def progress(r):
    if r.get("skipped"):
        return "not run (" + r["skipped"] + ")"
    if "per_gpu" not in r:
        return "error: " + r["error"]
    return (f"{r['per_gpu']:.0f} tok/s/GPU, {human(r.get('peak_allocated'))} "
            f"(job {r['wall_s']:.0f} s)")


def run(a, budget, env, busbw=None, save=None, busbw_source=None):
    """Runs the suite's cells within `budget`; returns its result (rows in table order);
    save(result so far) after each row. busbw: {collective: GB/s} of the `bus` suite (measured
    as busbw_source says), or None."""
    wanted = a.pairs.split(",")
    pairs = [p for p in PAIRS if p[0] in wanted]
    res = {"models": a.models.split(","), "batches": a.batches, "seq": a.seq, "gpus": a.gpus,
           "pairs": [p[0] for p in pairs], "breakdown": not a.no_breakdown,
           "busbw_GBps": busbw, "busbw_source": busbw_source if busbw else None,
           "rows": []}
    for model in res["models"]:
        steps, warmup = plan(a, model)
        limit = a.cell_timeout or CELL_TIMEOUT.get(model, 90)
        for batch in a.batches:
            cells = [(1, "dp", "ddp")]  # the baseline of every scaling figure
            if a.one_gpu == "all":
                cells += [(1, o, t) for o, t in pairs if o != "dp"]
            if a.gpus > 1:
                cells += [(a.gpus, o, t) for o, t in pairs]
            estimates = {}
            for g, ours, theirs in cells:
                if g not in estimates:
                    try:
                        estimates[g] = run_estimate(a.shardtrain, model, g, batch, a.seq)
                    except Exception as e:  # noqa: BLE001 - a missing estimate is not fatal
                        estimates[g] = {"error": repr(e)}
                est = estimates[g]
                row = {"key": f"{model}/mb{batch}/{ours}/{g}gpu", "model": model, "batch": batch,
                       "gpus": g, "shardtrain": ours, "torch": theirs, "steps": steps,
                       "warmup": warmup,
                       "estimate": est.get(ours)
                       or {"error": est.get("error", "no row for " + ours)}}
                port = free_port()
                row["ours"] = run_cell(budget, limit, lambda t: run_shardtrain(
                    a, ours, model, batch, g, steps, warmup, port, t, env))
                if torch_runs(a.torch_gpus, g):
                    row["theirs"] = run_cell(budget, limit, lambda t: run_torch(
                        a, theirs, model, batch, g, steps, warmup, t, env))
                else:
                    row["theirs"] = {"skipped": "--torch-gpus " + a.torch_gpus}
                t_params, o_params = row["theirs"].get("params"), est.get("params")
                if t_params and o_params and t_params != o_params:
                    row["theirs"]["error"] = (f"shape mismatch: PyTorch model has {t_params:,} "
                                              f"parameters, shardtrain {o_params:,}")
                params = row["ours"].get("params") or o_params
                if g > 1 and params:
                    row["comm"] = comm_model(ours, params, row["ours"].get("precision"), g, busbw)
                res["rows"].append(row)
                print(f"[{budget.elapsed():4.0f} s] lm {row['key']}: st " + progress(row["ours"])
                      + "; pt " + progress(row["theirs"]), flush=True)
                if save:
                    save(res)
    order = {p[0]: i for i, p in enumerate(PAIRS)}
    res["rows"].sort(key=lambda r: (res["models"].index(r["model"]), a.batches.index(r["batch"]),
                                    r["gpus"] > 1, order[r["shardtrain"]], r["gpus"]))
    add_scaling(res)
    return res


def add_scaling(res):
    """scaling = per-GPU tokens/s on N GPUs ÷ that of 1-GPU dp (PyTorch: ÷ 1-GPU DDP's), of the
    same model and micro-batch."""
    base = {(r["model"], r["batch"]): r for r in res["rows"]
            if r["gpus"] == 1 and r["shardtrain"] == "dp"}
    for r in res["rows"]:
        b = base.get((r["model"], r["batch"]))
        if r["gpus"] == 1 or not b:
            continue
        for side, key in (("ours", "scaling_st"), ("theirs", "scaling_pt")):
            x, y = r[side].get("per_gpu"), b[side].get("per_gpu")
            r[key] = x / y if x and y else None


def print_problems(res):
    for r in res["rows"]:
        for side, who in (("ours", "shardtrain " + r["shardtrain"]),
                          ("theirs", "PyTorch " + r["torch"])):
            report_problem(f"{who}, {r['model']} mb {r['batch']} on {r['gpus']} GPU(s)", r[side])


def print_tables(res):
    """The throughput table, then where the step goes (markdown)."""
    rows = res["rows"]
    print("\n| model | micro-batch | shardtrain / PyTorch | GPUs | shardtrain tok/s/GPU | PyTorch "
          "tok/s/GPU | ratio | scaling st | scaling pt | st peak | pt peak | estimate |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        o, t = r["ours"], r["theirs"]
        so, st = o.get("per_gpu"), t.get("per_gpu")
        t_cell = "not run" if t.get("skipped") or t.get("budget_skipped") else \
            fmt(st, ",.0f", "error")
        o_cell = "not run" if o.get("budget_skipped") else fmt(so, ",.0f", "error")
        print(f"| {r['model']} | {r['batch']} | {r['shardtrain']} / {r['torch']} | {r['gpus']} | "
              f"{o_cell} | {t_cell} | {ratio(so, st)} | {fmt(r.get('scaling_st'), '.3f', '')} | "
              f"{fmt(r.get('scaling_pt'), '.3f', '')} | "
              f"{human(o.get('peak_allocated')) if so else '-'} | "
              f"{human(t.get('peak_allocated')) if st else '-'} | "
              f"{human(r['estimate'].get('total'))} |")
    print(f"\nSequence {res['seq']}; tok/s/GPU = tokens/s of all ranks ÷ GPUs over the timed "
          "steps; ratio = shardtrain ÷ PyTorch; scaling = tok/s/GPU on N GPUs ÷ that of 1-GPU dp "
          "(st) or 1-GPU DDP (pt), same model and micro-batch; peak: allocated bytes, shardtrain "
          "rank 0, PyTorch max over ranks; estimate: `shardtrain estimate` total per rank."
          + (" shardtrain ran with --wall-clock-breakdown (CUDA events on the compute stream, read"
             " after the step's own synchronization)." if res["breakdown"] else ""))
    if not res["breakdown"]:
        return
    bw = res.get("busbw_GBps")
    print("\n| model | micro-batch | strategy | GPUs | step ms | compute ms (fwd + bwd) | exposed "
          "comm ms (reduce wait) | optimizer ms | collectives per step | bus bytes per GPU | min "
          "comm ms at busbw | min comm ÷ step |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        o, c = r["ours"], r.get("comm") or {}
        b = o.get("breakdown")
        if not b:
            continue
        if c:
            parts = {}
            for i in c["collectives"]:
                k = (SHORT[i["op"]], i["buffer_bytes"])
                parts[k] = parts.get(k, 0) + 1
            coll = " + ".join(f"{op} {human_bytes10(S)}" + (f" ×{k}" if k > 1 else "")
                              for (op, S), k in parts.items())
        else:
            coll = "none (1 GPU)"
        mc = c.get("min_comm_ms")
        print(f"| {r['model']} | {r['batch']} | {r['shardtrain']} | {r['gpus']} | "
              f"{o['step_ms']:.2f} | "
              f"{b['forward_ms'] + b['backward_ms']:.2f} ({b['forward_ms']:.2f} + "
              f"{b['backward_ms']:.2f}) | {b['reduce_wait_ms']:.2f} | {b['optimizer_ms']:.2f} | "
              f"{coll} | {human_bytes10(c.get('bus_bytes'))} | {fmt(mc, '.2f')} | "
              f"{ratio(mc, o['step_ms'], '.0%') if mc else '-'} |")
    bws = ", ".join(f"{SHORT[k]} {v:.3g}" for k, v in bw.items()) if bw else None
    if bws and res.get("busbw_source"):
        bws += "; " + res["busbw_source"]
    print("\nms per optimizer step: step = wall time per timed step; the rest is device time per"
          " step from --wall-clock-breakdown, averaged over the same steps (forward, backward with"
          " the reductions it overlaps, the wait for reductions still running after backward, the"
          " optimizer with clipping and, for zero1-3, the all-gather of the updated parameters)."
          " Collectives: AR all-reduce, RS reduce-scatter, AG all-gather, each of S = Ψ × the"
          " compute dtype's bytes (bf16: 2; Ψ from the log's banner); bus bytes per GPU ="
          " 2(n−1)/n·S (AR) or (n−1)/n·S (RS, AG); min comm = bus bytes ÷ busbw "
          + (f"(the `bus` suite's best per collective, GB/s: {bws})" if bws else
             "(not measured: run `--suite bus,lm` or pass --bus-json)")
          + "; min comm ÷ step: the share of the step the collectives would take if none overlapped"
          " compute. dp's tied embedding gradient exchange (a few MB) is not counted.")
