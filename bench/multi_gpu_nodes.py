"""The `nodes` suite of bench/bench_multi_gpu.py: GPT-2 training across N nodes emulated on one
host. Each node is its own launcher (`shardtrain launch --nnodes N --node-rank n`, or torchrun's)
with its G GPUs in CUDA_VISIBLE_DEVICES and NCCL_HOSTID=node<n>, so that NCCL treats the nodes as
hosts (its network transport between them, NVLink within one). First the cross-node link (NCCL
bus bandwidth through PyTorch, bench/torch_bus_worker.py over the same N × G layout, and within
one node when G > 1); then, per model and micro-batch, the 1-GPU dp step (the compute time), every
--pairs strategy across the nodes against its PyTorch match, dp with --hierarchical-all-reduce
(and with --quantized-gradients too), each strategy with gradient accumulation, and each on N·G GPUs of one node (flat), with the lower
bound of the step from the bytes that must cross the nodes at the measured bus bandwidth. See
bench_multi_gpu.py's docstring for what each number means."""
import json
import math
import os
import shlex
import signal
import subprocess
import time

import multi_gpu_bus as bus_suite
import multi_gpu_lm as lm_suite
from multi_gpu_common import (COMM_TIMEOUT, RESULT_TAG, WORKER, describe, fmt, free_port,
                              gpt2_shape_defaults, human_bytes10, parse_banner, parse_metrics,
                              report_problem, run_cell, torch_runs)

DEFAULT_PAIRS = "dp,zero2,zero3"
VARIANTS = ("hierarchical", "quantized", "hybrid", "accum", "flat")
# The PyTorch match of zero3 with hybrid sharding: FSDP2 over a (replicate, shard) device mesh
HSDP = "fsdp2-hsdp"
# seconds per job, others 150, × 1.5 with accumulation (--cell-timeout overrides them all)
CELL_TIMEOUT = {"gpt2-xl": 240}
LINK_TIMEOUT = 180  # seconds per bus bandwidth job
LOG_INTERVAL = lm_suite.LOG_INTERVAL
STOP_GRACE = 20  # seconds between SIGTERM and SIGKILL when a job's launchers are stopped
BY = {"communication": "comm", "compute": "compute"}  # what sets a row's bound


def add_arguments(ap):
    g = ap.add_argument_group(
        "nodes suite (training across nodes emulated on one host; it also takes --models, "
        "--batches, --seq, --steps, --warmup, --pairs (default dp,zero2,zero3), --torch-gpus, "
        "--no-breakdown, --bus-sizes, --bus-iters, and --bus-json: an earlier --out JSON "
        "with a nodes suite lends its cross-node link, with a bus suite of N·G GPUs its "
        "bandwidth for the flat rows)")
    g.add_argument("--nodes", type=int, default=2, help="N: emulated nodes (default 2)")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="G: GPUs of each node (default: the visible GPUs ÷ N; smoke: --gpus ÷ N)")
    g.add_argument("--node-variants", default=",".join(VARIANTS),
                   help="shardtrain rows besides each --pairs strategy across the nodes, comma "
                        "list: hierarchical (--hierarchical-all-reduce; with G > 1 only: with one "
                        "GPU per node it is the plain row), quantized (--hierarchical-all-reduce "
                        "--quantized-gradients), hybrid (zero3 --zero-hpz-partition-size G, "
                        "against FSDP2 HSDP, and with --quantized-gradients; G > 1), accum "
                        "(every strategy with --node-accum), flat (every strategy on N·G GPUs "
                        "of one node); default all, `none` for none")
    g.add_argument("--node-accum", type=int, default=4,
                   help="micro-batches per optimizer step of the accum rows (default 4)")


def configure(ap, a):
    """Fills the suite's defaults into `a`, a namespace of its own (lm's defaults differ)."""
    gpt2_shape_defaults(ap, a)
    wanted = (a.pairs or DEFAULT_PAIRS).split(",")
    unknown = set(wanted) - {p[0] for p in lm_suite.PAIRS}
    if unknown:
        ap.error(f"--pairs: unknown strategies {sorted(unknown)}")
    a.node_pairs = [p for p in lm_suite.PAIRS if p[0] in wanted]
    a.variants = [] if a.node_variants == "none" else a.node_variants.split(",")
    if set(a.variants) - set(VARIANTS):
        ap.error(f"--node-variants: a comma list of {', '.join(VARIANTS)}, or none")
    if a.node_accum < 1:
        ap.error("--node-accum must be 1 or more")
    if a.nodes < 2:
        ap.error("--nodes must be 2 or more")
    if a.smoke:
        a.gpus_per_node = a.gpus_per_node or max(1, a.gpus // a.nodes)
        a.visible = [str(i) for i in range(a.nodes * a.gpus_per_node)]
    else:
        a.visible = visible_gpus(a.python)
        a.gpus_per_node = a.gpus_per_node or len(a.visible) // a.nodes
        if a.gpus_per_node < 1 or a.nodes * a.gpus_per_node > len(a.visible):
            ap.error(f"--nodes {a.nodes} × --gpus-per-node {a.gpus_per_node or '(visible ÷ N)'}"
                     f" needs that many GPUs; {len(a.visible)} visible ({','.join(a.visible)})")
    G = a.gpus_per_node
    a.node_ids = [a.visible[n * G:(n + 1) * G] for n in range(a.nodes)]
    a.bus_sizes = a.bus_sizes or ("0.25,1" if a.smoke else "1,64,512")
    if a.bus_iters is None:
        a.bus_iters = 5 if a.smoke else 0
    for model in a.models.split(","):
        for accum in (1, a.node_accum):
            steps, warmup = plan(a, model, accum)
            if warmup % LOG_INTERVAL or not 0 <= warmup < steps:
                ap.error(f"need 0 <= warmup < steps and warmup a multiple of {LOG_INTERVAL}")


def visible_gpus(python):
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (its list when set, else
    nvidia-smi's indices, else torch's device count)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [x.strip() for x in cvd.split(",") if x.strip()]
    ids = [l.strip() for l in describe(["nvidia-smi", "--query-gpu=index",
                                         "--format=csv,noheader"]).splitlines()
           if l.strip().isdigit()]
    if ids:
        return ids
    n = describe([python, "-c", "import torch; print(torch.cuda.device_count())"]).splitlines()
    return [str(i) for i in range(int(n[-1]))] if n and n[-1].isdigit() else []


def plan(a, model, accum=1):
    """(optimizer steps, untimed warmup steps): lm's, and with accumulation (each step A micro-
    batches) warmup 5 and 1/A of the timed steps (at least 5), unless --steps/--warmup."""
    steps, warmup = lm_suite.plan(a, model)
    if accum == 1:
        return steps, warmup
    timed = steps - warmup
    if a.warmup is None:
        warmup = min(warmup, LOG_INTERVAL)
    if a.steps is None:  # smoke: the tiny model's steps are cheap, the same count
        steps = warmup + (timed if a.smoke else
                          LOG_INTERVAL * max(1, math.ceil(timed / accum / LOG_INTERVAL)))
    return steps, warmup


# --- jobs of several launchers --------------------------------------------------------------------

def stop_all(procs):
    """SIGTERM to the process group of every process still running, SIGKILL after STOP_GRACE."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, 10)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # the launcher and everything of its group
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        while any(p.poll() is None for p in alive) and time.time() < deadline:
            time.sleep(0.2)


def run_group(jobs, timeout):
    """Starts every (cmd, env, log_path, shown) of `jobs` at once, each in its own process group
    with its output in its log (`shown`: the command line written at its top), and waits for all
    of them for at most `timeout` seconds. When one exits with an error, or time runs out, the
    others are stopped. Returns (exit statuses, None for each one stopped; the logs' text; None,
    or what went wrong)."""
    procs, files, rcs, problem = [], [], [], None
    try:
        for cmd, env, log_path, line in jobs:
            f = open(log_path, "w")
            files.append(f)
            f.write("$ " + line + "\n")
            f.flush()
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
        deadline = time.time() + max(timeout, 1)
        while True:
            rcs = [p.poll() for p in procs]
            bad = [i for i, rc in enumerate(rcs) if rc not in (None, 0)]
            if bad:
                problem = f"launcher {bad[0]} ended with exit status {rcs[bad[0]]}"
                if len(procs) > 1:
                    problem += "; the other launchers were stopped"
                break
            if all(rc is not None for rc in rcs):
                break
            if time.time() > deadline:
                problem = f"timed out after {timeout:.0f} s"
                break
            time.sleep(0.5)
    finally:
        stop_all(procs)  # nothing is left running, whatever happened
        for f in files:
            f.close()
    texts = []
    for _, _, log_path, _ in jobs:
        with open(log_path, errors="replace") as f:
            texts.append(f.read())
    return rcs, texts, problem


def group_error(problem, rcs, texts, logs, missing):
    """The error of a job of one or more launchers: what went wrong (else `missing`) with the log
    of the first launcher that failed (else the first one's)."""
    i = next((i for i, rc in enumerate(rcs) if rc not in (None, 0)), 0)
    return {"error": problem or missing, "log": logs[i], "log_tail": texts[i][-2000:],
            "logs": logs}


def shown(cmd, env_vars):
    return " ".join(f"{k}={v}" for k, v in env_vars.items()) + (" " if env_vars else "") \
        + shlex.join(cmd)


def node_env(a, env, n):
    """Node n's environment: its GPUs, its NCCL host id (smoke: no GPUs to split)."""
    extra = {} if a.smoke else {"CUDA_VISIBLE_DEVICES": ",".join(a.node_ids[n])}
    extra["NCCL_HOSTID"] = f"node{n}"
    return dict(env, **extra), extra


def one_node_env(a, env, ids):
    e = {k: v for k, v in env.items() if k != "NCCL_HOSTID"}
    extra = {} if a.smoke else {"CUDA_VISIBLE_DEVICES": ",".join(ids)}
    return dict(e, **extra), extra


def torchrun_nodes(a, n, port, script, *args):
    """Node n's torchrun: N nodes of G ranks, the rendezvous store on node 0 (127.0.0.1)."""
    return [a.python, "-m", "torch.distributed.run", f"--nnodes={a.nodes}", f"--node-rank={n}",
            f"--nproc-per-node={a.gpus_per_node}", "--master-addr=127.0.0.1",
            f"--master-port={port}", script, *args]


def run_torch_group(a, jobs, timeout):
    """A PyTorch job of one or more launchers whose rank 0 prints "BENCH_RESULT {json}"; returns
    that dict with wall_s, log and commands, or an error (as run_tagged_job)."""
    t0 = time.time()
    rcs, texts, problem = run_group(jobs, timeout)
    logs = [j[2] for j in jobs]
    lines = [l[len(RESULT_TAG):] for t in texts for l in t.splitlines()
             if l.startswith(RESULT_TAG)]
    if not lines:
        return group_error(problem, rcs, texts, logs, "no result line")
    r = json.loads(lines[-1])
    r.update(wall_s=time.time() - t0, log=logs[0], logs=logs, commands=[j[3] for j in jobs])
    if problem or any(rcs):
        r["warning"] = (problem or "a launcher failed") + " after the result line"
    return r


# --- the cells ------------------------------------------------------------------------------------

def run_link(a, where, timeout, env):
    """NCCL bus bandwidth (bench/torch_bus_worker.py): `across` the N × G layout of the emulated
    nodes, or `within` node 0's G GPUs."""
    args = ["--sizes-mib", a.bus_sizes, "--device", a.device, "--iters", str(a.bus_iters),
            "--warmup", "2" if a.smoke else "5", "--comm-timeout", str(COMM_TIMEOUT)]
    port = free_port()
    if where == "across":
        jobs = []
        for n in range(a.nodes):
            e, extra = node_env(a, env, n)
            cmd = torchrun_nodes(a, n, port, bus_suite.WORKER, *args)
            jobs.append((cmd, e, os.path.join(a.workdir, f"nodes_link_across_node{n}.log"),
                         shown(cmd, extra)))
    else:
        e, extra = node_env(a, env, 0)
        cmd = [a.python, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={a.gpus_per_node}", bus_suite.WORKER, *args]
        jobs = [(cmd, e, os.path.join(a.workdir, "nodes_link_within.log"), shown(cmd, extra))]
    r = run_torch_group(a, jobs, timeout)
    r["busbw_GBps"] = bus_suite.best_busbw(r)
    return r


def train_args(a, cell, model, batch, steps, out):
    cmd = ["train", "--model", model, "--dataset", "wikitext-2", "--device", a.device,
           "--strategy", cell["strategy"], "--batch-size", str(batch), "--max-length", str(a.seq),
           "--max-steps", str(steps), "--log-interval", str(LOG_INTERVAL), "--warmup-steps", "5",
           "--eval-samples", str(batch), "--no-save", "--output-dir", out]
    if cell["accum"] > 1:
        cmd += ["--gradient-accumulation-steps", str(cell["accum"])]
    if cell["hier"]:
        cmd.append("--hierarchical-all-reduce")
    elif not cell.get("hybrid"):  # one collective over all ranks (the default across nodes of
        cmd.append("--no-hierarchical-all-reduce")  # several GPUs is hierarchical)
    if cell.get("hybrid"):
        cmd += ["--zero-hpz-partition-size", str(a.gpus_per_node)]
    if cell.get("quant"):
        cmd.append("--quantized-gradients")
    if not a.no_breakdown:
        cmd.append("--wall-clock-breakdown")
    return cmd


def launch_args(a, port, nproc, node_rank=None):
    cmd = [a.shardtrain, "launch", "--nproc-per-node", str(nproc)]
    if node_rank is not None:
        cmd += ["--nnodes", str(a.nodes), "--node-rank", str(node_rank),
                "--master-addr", "127.0.0.1"]
    return cmd + ["--master-port", str(port), "--comm-timeout", str(COMM_TIMEOUT),
                  "--stop-grace", "5", "--"]


def run_shardtrain(a, cell, model, batch, steps, warmup, timeout, env):
    """One shardtrain cell: across the emulated nodes (one launch per node; smoke: one CPU launch
    of N·G ranks), flat on N·G GPUs of one node, or on 1 GPU."""
    name = f"nodes_{model}_mb{batch}_{cell['name']}"
    out = os.path.join(a.workdir, name)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # shardtrain appends to it
    targs = train_args(a, cell, model, batch, steps, out)
    port = free_port()
    ranks = cell["gpus"]
    if cell["layout"] == "nodes" and not a.smoke:
        jobs = []
        for n in range(a.nodes):
            e, extra = node_env(a, env, n)
            cmd = launch_args(a, port, a.gpus_per_node, n) + targs
            jobs.append((cmd, e, os.path.join(a.workdir, f"{name}_node{n}.log"),
                         shown(cmd, extra)))
    else:
        ids = a.visible[:ranks]
        e, extra = one_node_env(a, env, ids)
        cmd = launch_args(a, port, ranks) + targs
        jobs = [(cmd, e, os.path.join(a.workdir, name + ".log"), shown(cmd, extra))]
    t0 = time.time()
    rcs, texts, problem = run_group(jobs, timeout)
    logs = [j[2] for j in jobs]
    done = os.path.exists(metrics) and any('"event":"done"' in l.replace(" ", "")
                                           for l in open(metrics))
    if not done:  # the run did not finish training
        return group_error(problem, rcs, texts, logs, "no done record in metrics.jsonl")
    r = parse_metrics(metrics, warmup, a.smoke)
    r.update(wall_s=time.time() - t0, log=logs[0], logs=logs, commands=[j[3] for j in jobs])
    if problem or any(rcs):  # finished and measured, then failed on the way out
        r["warning"] = (problem or "a launcher failed") + " after training finished"
    r["per_gpu"] = r["tokens_per_s"] / ranks
    banner = parse_banner(texts[0])
    r.update(params=banner["params"], precision=banner["precision"])
    return r


def run_torch(a, theirs, model, batch, steps, warmup, timeout, env):
    """The PyTorch match across the emulated nodes: one torchrun per node."""
    name = f"nodes_{model}_mb{batch}_{theirs}_torch"
    flags = ["fsdp2", "--reshard-after-forward", "--hsdp-shard-size", str(a.gpus_per_node)] \
        if theirs == HSDP else lm_suite.TORCH_FLAGS.get(theirs, [theirs])
    args = ["--strategy", *flags, "--model", model,
            "--batch", str(batch), "--seq", str(a.seq), "--steps", str(steps),
            "--warmup", str(warmup), "--device", a.device, "--comm-timeout", str(COMM_TIMEOUT)]
    port = free_port()
    jobs = []
    for n in range(a.nodes):
        e, extra = node_env(a, env, n)
        cmd = torchrun_nodes(a, n, port, WORKER, *args)
        jobs.append((cmd, e, os.path.join(a.workdir, f"{name}_node{n}.log"), shown(cmd, extra)))
    return run_torch_group(a, jobs, timeout)


def cells(a):
    """The shardtrain cells of one model and micro-batch, in table order: (cell, PyTorch name or
    None). The 1-GPU dp cell runs first (the compute time of the bounds)."""
    N, G = a.nodes, a.gpus_per_node
    n = N * G

    def cell(layout, strategy, hier=False, accum=1, quant=False, hybrid=False):
        gpus = 1 if layout == "1gpu" else n
        label = strategy + (" hierarchical" if hier else "") + (" hybrid" if hybrid else "") + \
            (" int8" if quant else "") + (f" accum {accum}" if accum > 1 else "")
        name = label.replace(" ", "_") + {"1gpu": "_1gpu", "flat": f"_flat{n}",
                                          "nodes": f"_{N}x{G}"}[layout]
        return {"layout": layout, "strategy": strategy, "hier": hier, "quant": quant,
                "hybrid": hybrid, "accum": accum,
                "gpus": gpus, "label": label, "name": name}

    out = [(cell("1gpu", "dp"), None)]
    for ours, theirs in a.node_pairs:
        out.append((cell("nodes", ours), theirs))
        if "hierarchical" in a.variants and G > 1:
            out.append((cell("nodes", ours, hier=True), None))
        if "quantized" in a.variants:
            out.append((cell("nodes", ours, hier=True, quant=True), None))
        if ours == "zero3" and "hybrid" in a.variants and G > 1:
            out.append((cell("nodes", ours, hybrid=True), HSDP))
            out.append((cell("nodes", ours, hybrid=True, quant=True), None))
        if "accum" in a.variants and a.node_accum > 1:
            out.append((cell("nodes", ours, accum=a.node_accum), None))
        if "flat" in a.variants:
            out.append((cell("flat", ours), None))
    return out


# --- the bound ------------------------------------------------------------------------------------

def crossing(strategy, params, elem, N, G, hier, accum, quant=False, hybrid=False,
             gathered=None):
    """The collectives of one optimizer step (A = accum micro-batches) whose bytes cross the
    nodes, per GPU, as nccl-tests counts bus bytes (S = Ψ × elem, n = N·G ranks): [(collective,
    calls per step, bus bytes per GPU per call)]. dp: one all-reduce, 2(n−1)/n·S (hierarchical:
    only its cross-node step crosses, 2(N−1)/N·S/G); zero1: reduce-scatter + all-gather,
    (n−1)/n·S each; zero2: the reduce-scatter in every micro-batch's backward, the all-gather once;
    zero3: all-gather in forward and in backward and reduce-scatter, every micro-batch — or,
    given `gathered` (bytes all-gathered per step, the run's epoch summary), gathered ÷ S
    all-gathers (zero3 keeps layers gathered from forward to backward within its live budget)
    (hierarchical: the reduce-scatters cross with (N−1)/N·S/G); zero3 hybrid: only the gradient
    shards' all-reduce across groups once per step, 2(N−1)/N·S/G. Quantized (int8 and one fp32
    scale per 256 elements, Q = Ψ/G·(1 + 4/256) bytes): dp and hybrid all-gather every node's
    slice, (N−1)·Q; the reduce-scatters exchange all-to-all, (N−1)/N·Q."""
    S, n = params * elem, N * G
    f = (n - 1) / n
    Q = params / G * (1 + 4 / 256)
    if hybrid or (strategy == "dp" and hier):  # the all-reduce of a 1/G slice across nodes
        if quant:
            return [("all_gather", 1, (N - 1) * Q)]
        return [("all_reduce", 1, 2 * (N - 1) / N * S / G)]
    if strategy == "dp":
        return [("all_reduce", 1, 2 * f * S)]
    if quant:
        scatter = ("all_to_all", (N - 1) / N * Q)
    elif hier:
        scatter = ("reduce_scatter", (N - 1) / N * S / G)
    else:
        scatter = ("reduce_scatter", f * S)
    if strategy == "zero1":
        return [(scatter[0], 1, scatter[1]), ("all_gather", 1, f * S)]
    if strategy == "zero2":
        return [(scatter[0], accum, scatter[1]), ("all_gather", 1, f * S)]
    gathers = gathered / S if gathered else 2 * accum
    return [("all_gather", gathers, f * S), (scatter[0], accum, scatter[1])]


# The measured bus bandwidth a collective is timed at: all-to-all (not measured) at all-gather's,
# whose bytes on a ring take the same paths
BUSBW_OF = {"all_to_all": "all_gather"}


def add_bounds(res):
    """Per row: the bytes crossing the nodes per GPU and step, their time at the measured
    busbw, the compute time (1-GPU dp of the same model and micro-batch), the bound and the
    ratios."""
    base = {(r["model"], r["batch"]): r["ours"] for r in res["rows"] if r["layout"] == "1gpu"}
    N, G = res["nodes"], res["gpus_per_node"]
    rows = {(r["model"], r["batch"], r["layout"], r["label"]): r for r in res["rows"]}
    for r in res["rows"]:
        o, one = r["ours"], base.get((r["model"], r["batch"])) or {}
        step1, bd = one.get("step_ms"), one.get("breakdown")
        A = r["accum"]
        if step1 and not o.get("skipped"):  # one optimizer step of A micro-batches, 1 GPU
            r["compute_ms"] = step1 + (A - 1) * (bd["forward_ms"] + bd["backward_ms"]) \
                if bd else A * step1
        if r["layout"] == "1gpu" or o.get("skipped"):
            continue
        params = o.get("params") or one.get("params") or (r.get("theirs") or {}).get("params")
        bw = res.get("flat_busbw_GBps") if r["layout"] == "flat" else res.get("busbw_GBps")
        if params:
            elem = lm_suite.DTYPE_BYTES.get(o.get("precision") or one.get("precision"), 2)
            items = crossing(r["strategy"], params, elem, 1 if r["layout"] == "flat" else N,
                             N * G if r["layout"] == "flat" else G, r["hier"], A,
                             r.get("quant", False), r.get("hybrid", False),
                             o.get("gathered_bytes_per_step"))
            ms = [k * b / ((bw or {}).get(BUSBW_OF.get(op, op)) or math.nan) / 1e6
                  for op, k, b in items]
            r["comm"] = {"params": params, "elem_bytes": elem,
                         "collectives": [{"op": op, "calls": k, "bus_bytes": b}
                                         for op, k, b in items],
                         "bus_bytes": sum(k * b for _, k, b in items),
                         "busbw_GBps": bw,
                         "min_ms": sum(ms) if ms and not any(map(math.isnan, ms)) else None}
        comm = (r.get("comm") or {}).get("min_ms")
        if comm is not None and r.get("compute_ms"):
            r["bound_ms"] = max(comm, r["compute_ms"])
            r["bound_by"] = "communication" if comm > r["compute_ms"] else "compute"
            r["bound_per_gpu"] = r["batch"] * res["seq"] * A / (r["bound_ms"] / 1e3)
        theirs = r.get("theirs") or {}
        if r.get("hybrid") and r.get("quant") and not theirs:  # HSDP's row
            theirs = (rows.get((r["model"], r["batch"], "nodes", "zero3 hybrid")) or {}) \
                .get("theirs") or {}
        if (r["hier"] or r.get("quant")) and not theirs:  # the same work: the plain row's match
            theirs = (rows.get((r["model"], r["batch"], "nodes", r["strategy"])) or {}) \
                .get("theirs") or {}
        so, st = o.get("per_gpu"), theirs.get("per_gpu") if A == 1 else None
        flat = rows.get((r["model"], r["batch"], "flat", r["strategy"])) or {}
        fo = (flat.get("ours") or {}).get("per_gpu") if r["layout"] == "nodes" and A == 1 \
            else None
        bound = r.get("bound_per_gpu")
        r["ratio_pt"] = so / st if so and st else None
        r["ratio_bound_st"] = so / bound if so and bound else None
        r["ratio_bound_pt"] = (r.get("theirs") or {}).get("per_gpu") / bound \
            if bound and (r.get("theirs") or {}).get("per_gpu") else None
        r["ratio_flat"] = so / fo if so and fo else None


# --- the suite ------------------------------------------------------------------------------------

def step_ms(r):
    """Wall ms per optimizer step: shardtrain's step_ms, PyTorch's step_time_s."""
    if not r:
        return None
    return r.get("step_ms") or (r["step_time_s"] * 1e3 if r.get("step_time_s") else None)


def progress(r):
    if r is None:
        return "-"
    if r.get("skipped"):
        return "not run (" + r["skipped"] + ")"
    if "per_gpu" not in r:
        return "error: " + r["error"]
    return f"{r['per_gpu']:.0f} tok/s/GPU, step {step_ms(r):.1f} ms (job {r['wall_s']:.0f} s)"


def from_json(path):
    """What an earlier bench_multi_gpu.py --out JSON lends: ({collective: GB/s} of its bus suite
    or None, its nodes suite's cross-node link or None)."""
    with open(path) as f:
        res = json.load(f)
    suites = res.get("suites") or {}
    link = (suites.get("nodes") or {}).get("link")
    ok = link and bus_suite.best_busbw(link.get("across"))
    return bus_suite.best_busbw(suites.get("bus") or res.get("bus")), link if ok else None


def layout_title(a):
    G = a.gpus_per_node
    return f", {a.nodes} nodes × {G} GPU{'s' if G > 1 else ''}"


def run(a, budget, env, save=None, flat_busbw=None, flat_source=None):
    """Runs the suite within `budget` (`a`: its own namespace, see configure); save(result so
    far) after each row. flat_busbw: {collective: GB/s} of N·G GPUs of one node (the `bus` suite
    of the same invocation), for the flat rows' bound."""
    env = dict(env)
    if a.smoke:
        env.setdefault("OMP_NUM_THREADS", "1")  # every rank one core: the host runs all of them
    N, G = a.nodes, a.gpus_per_node
    res = {"nodes": N, "gpus_per_node": G, "gpus": N * G, "node_gpus": a.node_ids,
           "models": a.models.split(","), "batches": a.batches, "seq": a.seq,
           "pairs": [p[0] for p in a.node_pairs], "variants": a.variants, "accum": a.node_accum,
           "breakdown": not a.no_breakdown, "smoke_one_launch": a.smoke,
           "link": {}, "busbw_GBps": None, "busbw_source": None,
           "flat_busbw_GBps": flat_busbw, "flat_busbw_source": flat_source if flat_busbw else None,
           "rows": []}
    link = from_json(a.bus_json)[1] if a.bus_json else None
    if link:
        res["link"], res["busbw_source"] = link, "from " + a.bus_json
    else:
        for where in ("across", "within") if G > 1 else ("across",):
            limit = a.cell_timeout or LINK_TIMEOUT
            r = run_cell(budget, limit, lambda t: run_link(a, where, t, env))
            res["link"][where] = r
            bw = r.get("busbw_GBps")
            ranks = f"{N} nodes × {G}" if where == "across" else f"{G} GPUs of one node"
            print(f"[{budget.elapsed():4.0f} s] nodes link {where} ({ranks}): "
                  + (", ".join(f"{k} {v:.2f} GB/s" for k, v in bw.items()) if bw
                     else "error: " + r.get("error", "no rows")), flush=True)
        res["busbw_source"] = "measured in this run"
    res["busbw_GBps"] = bus_suite.best_busbw(res["link"].get("across"))
    for model in res["models"]:
        for batch in a.batches:
            for cell, theirs in cells(a):
                steps, warmup = plan(a, model, cell["accum"])
                limit = a.cell_timeout or CELL_TIMEOUT.get(model, 150) * (
                    1.5 if cell["accum"] > 1 else 1)
                row = {"key": f"{model}/mb{batch}/{cell['name']}", "model": model,
                       "batch": batch, **{k: cell[k] for k in ("layout", "strategy", "hier",
                                                                 "quant", "hybrid", "accum",
                                                                 "gpus", "label")},
                       "torch": theirs, "steps": steps, "warmup": warmup}
                if a.smoke and cell["layout"] == "flat":
                    row["ours"] = {"skipped": "smoke: the node cells already ran as one launch"}
                else:
                    row["ours"] = run_cell(budget, limit, lambda t: run_shardtrain(
                        a, cell, model, batch, steps, warmup, t, env))
                if theirs and torch_runs(a.torch_gpus, N * G):
                    row["theirs"] = run_cell(budget, limit, lambda t: run_torch(
                        a, theirs, model, batch, steps, warmup, t, env))
                elif theirs:
                    row["theirs"] = {"skipped": "--torch-gpus " + a.torch_gpus}
                else:
                    row["theirs"] = None
                t_params, o_params = (row["theirs"] or {}).get("params"), row["ours"].get("params")
                if t_params and o_params and t_params != o_params:
                    row["theirs"]["error"] = (f"shape mismatch: PyTorch model has {t_params:,} "
                                              f"parameters, shardtrain {o_params:,}")
                res["rows"].append(row)
                print(f"[{budget.elapsed():4.0f} s] nodes {row['key']}: st "
                      + progress(row["ours"]) + "; pt " + progress(row["theirs"]), flush=True)
                add_bounds(res)
                if save:
                    save(res)
    add_bounds(res)
    return res


def print_problems(res):
    for where, r in (res.get("link") or {}).items():
        report_problem(f"nodes: link {where}", r)
    for r in res["rows"]:
        report_problem(f"nodes: shardtrain {r['label']} ({r['layout']}), {r['model']} mb "
                       f"{r['batch']}", r["ours"])
        if r.get("theirs"):
            report_problem(f"nodes: PyTorch {r['torch']}, {r['model']} mb {r['batch']}",
                           r["theirs"])


def cell_text(x, spec=",.0f"):
    if x is None:
        return "-"
    if x.get("budget_skipped") or x.get("skipped"):
        return "not run"
    return fmt(x.get("per_gpu"), spec, "error")


def print_tables(res):
    N, G, n = res["nodes"], res["gpus_per_node"], res["gpus"]
    link = res.get("link") or {}
    print("\n| link | ranks | collective | buffer S | time per call (µs) | algbw GB/s | "
          "busbw GB/s |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for where, ranks in (("across", f"{N} nodes × {G}"), ("within", f"{G}, one node")):
        r = link.get(where)
        if r is None:
            continue
        if not r.get("rows"):
            print(f"| {where} nodes | {ranks} | error | | | | |")
        for row in r.get("rows") or []:
            print(f"| {where} {'nodes' if where == 'across' else 'a node'} | {ranks} | "
                  f"{bus_suite.SHORT[row['op']]} | {row['mib']:g} MiB | "
                  f"{fmt(row['time_us'], ',.1f')} | {row['algbw_GBps']:.2f} | "
                  f"{row['busbw_GBps']:.2f} |")
    across = link.get("across") or {}
    print(f"\nbench/torch_bus_worker.py ({across.get('backend', '?')}, "
          f"{across.get('dtype', 'bf16')}): across = one torchrun per emulated node (--nnodes "
          f"{N}, CUDA_VISIBLE_DEVICES its {G} GPU(s), NCCL_HOSTID=node<n>: NCCL then takes its "
          "network transport between the nodes); within = one torchrun on node 0's GPUs. busbw "
          "= S ÷ time × 2(n−1)/n (all_reduce) or × (n−1)/n, nccl-tests' definition"
          + (f"; {res['busbw_source']}" if res.get("busbw_source") else "") + ".")

    print("\n| model | micro-batch | shardtrain | PyTorch | GPUs | st tok/s/GPU | pt tok/s/GPU | "
          "st ÷ pt | st step ms | pt step ms | crosses per GPU and step | comm ms at busbw | "
          "compute ms | bound tok/s/GPU | st ÷ bound | pt ÷ bound | st ÷ flat |")
    print("|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        o, t = r["ours"], r.get("theirs")
        gpus = {"1gpu": "1", "flat": f"{n}, one node", "nodes": f"{N} × {G}"}[r["layout"]]
        c = r.get("comm") or {}
        pt_name = r["torch"] or ("(its plain row's)" if r["hier"] or r.get("quant") else "-")
        print(f"| {r['model']} | {r['batch']} | {r['label']} | {pt_name} | {gpus} | "
              f"{cell_text(o)} | {cell_text(t)} | {fmt(r.get('ratio_pt'), '.2f')} | "
              f"{fmt(o.get('step_ms'), '.1f')} | "
              f"{fmt(step_ms(t), '.1f')} | {human_bytes10(c.get('bus_bytes')) if c else '-'} | "
              f"{fmt(c.get('min_ms'), '.1f')} | {fmt(r.get('compute_ms'), '.1f')} | "
              f"{fmt(r.get('bound_per_gpu'), ',.0f')}"
              f"{' (' + BY[r['bound_by']] + ')' if r.get('bound_by') else ''} | "
              f"{fmt(r.get('ratio_bound_st'), '.2f')} | "
              f"{fmt(r.get('ratio_bound_pt'), '.2f')} | {fmt(r.get('ratio_flat'), '.2f')} |")
    bw = res.get("busbw_GBps")
    bws = ", ".join(f"{lm_suite.SHORT[k]} {v:.3g}" for k, v in bw.items()) if bw else "not measured"
    fbw = res.get("flat_busbw_GBps")
    fbws = ", ".join(f"{lm_suite.SHORT[k]} {v:.3g}" for k, v in fbw.items()) if fbw else None
    print(f"\nSequence {res['seq']}. Each node is one launcher (`shardtrain launch --nnodes {N} "
          f"--node-rank n --nproc-per-node {G}`, PyTorch: `torch.distributed.run --nnodes {N}`), "
          f"started together; flat = the same strategy by one launcher on all {n} GPUs. "
          "tok/s/GPU = tokens/s of all ranks ÷ GPUs over the timed steps (shardtrain: "
          "metrics.jsonl; PyTorch: bench/torch_dist_worker.py, DDP / FSDP2 / FSDP2 resharding "
          "after forward; FSDP2 HSDP: over a (replicate across nodes, shard within) device "
          "mesh); step ms per optimizer step (accum A: A micro-batches). hierarchical = "
          "--hierarchical-all-reduce, int8 = with --quantized-gradients, hybrid = zero3 "
          "--zero-hpz-partition-size G (their st ÷ pt against the PyTorch match of the row without "
          "them); accum A = --gradient-accumulation-steps A (PyTorch not run so). Crosses = bus "
          "bytes per GPU and optimizer step (flat rows: the same, within one node), as nccl-tests "
          "counts them, S = Ψ × the compute dtype's bytes (bf16: 2; Ψ: the log banner's "
          "parameters), n = N·G: dp an all-reduce, 2(n−1)/n·S, once per step (hierarchical: "
          "2(N−1)/N·S/G, its cross-node step only); zero1 a reduce-scatter and an all-gather, "
          "(n−1)/n·S each; zero2 the reduce-scatter every micro-batch, the all-gather once; zero3 "
          "2 all-gathers + 1 reduce-scatter every micro-batch (the all-gathers: as many as "
          "the run's all-gathered bytes per step ÷ S, its epoch summary; hierarchical: the "
          "reduce-scatter "
          "(N−1)/N·S/G); zero3 hybrid only the all-reduce of the gradient shards across nodes, "
          "2(N−1)/N·S/G once per step; int8: Q = Ψ/G·(1 + 4/256) bytes, all-gathered by dp and "
          "hybrid, (N−1)·Q, exchanged all-to-all by the reduce-scatters, (N−1)/N·Q (timed at the "
          "all-gather's busbw). comm ms = those bytes ÷ the cross-node busbw of each collective (its "
          f"best size, GB/s: {bws}; flat rows: "
          + (f"the {n}-GPU busbw of one node, {fbws}" if fbws else
             f"not measured: run `--suite bus,nodes --gpus {n}`")
          + "), as if every GPU had its own path to the other nodes (where a node's GPUs share "
          "one, hierarchical's time is up to G× more). compute ms = the 1-GPU dp step of the "
          "same model and micro-batch in this run (accum A: + (A−1) × its forward + backward). "
          "bound = the larger of the two (named), as tok/s/GPU; ÷ bound: the share of it reached; "
          "st ÷ flat: across the nodes ÷ the same strategy on one node.")
    if res.get("smoke_one_launch"):
        print("smoke (CPU): shardtrain's node cells ran as ONE `shardtrain launch --nproc-per-node"
              f" {n}` job (CPU jobs over several nodes start through mpirun with a hostfile), so "
              "they do not emulate nodes; PyTorch's and the link's ran as N torchrun launches on "
              "gloo.")
