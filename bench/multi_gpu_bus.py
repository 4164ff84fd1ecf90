"""The `bus` suite of bench/bench_multi_gpu.py: the NCCL bus bandwidth of N GPUs of this host
measured with PyTorch (bench/torch_bus_worker.py under torchrun), for the `lm` suite's minimum
communication time and as a table of its own."""
import json
import os

from multi_gpu_common import (COMM_TIMEOUT, HERE, fmt, report_problem, run_cell, run_tagged_job,
                              torchrun)

WORKER = os.path.join(HERE, "torch_bus_worker.py")
SHORT = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
         "all_gather": "all_gather_into_tensor"}


def add_arguments(ap):
    g = ap.add_argument_group("bus suite (NCCL bus bandwidth through torch.distributed)")
    g.add_argument("--bus-sizes", default=None,
                   help="buffer sizes in MiB, comma-separated (default 1,64,512; smoke 0.25,1)")
    g.add_argument("--bus-iters", type=int, default=None,
                   help="timed calls per collective and size (default: 200 small, 20 large; "
                        "smoke 5)")
    g.add_argument("--bus-json", default=None,
                   help="lm without bus: take the bus bandwidth from this earlier --out JSON "
                        "(nodes: its cross-node link, and the bus bandwidth for the flat rows)")


def configure(ap, a):
    a.bus_sizes = a.bus_sizes or ("0.25,1" if a.smoke else "1,64,512")
    if a.bus_iters is None:
        a.bus_iters = 5 if a.smoke else 0


def run(a, budget, env):
    """Runs the worker on --gpus ranks; returns its result (rows per collective and size)."""
    cmd = torchrun(a.python, a.gpus, WORKER, "--sizes-mib", a.bus_sizes, "--device", a.device,
                   "--iters", str(a.bus_iters), "--warmup", "2" if a.smoke else "5",
                   "--comm-timeout", str(COMM_TIMEOUT))
    limit = a.cell_timeout or 120
    r = run_cell(budget, limit, lambda t: run_tagged_job(
        cmd, t, os.path.join(a.workdir, f"bus_{a.gpus}gpu.log"), env))
    r["command"] = " ".join(cmd)
    r["busbw_GBps"] = best_busbw(r)
    rows = r.get("rows") or []
    print(f"[{budget.elapsed():4.0f} s] bus on {a.gpus} GPU(s): "
          + (", ".join(f"{k} {v:.1f} GB/s" for k, v in r["busbw_GBps"].items()) if rows
             else "error: " + r.get("error", "no rows")), flush=True)
    return r


def best_busbw(r):
    """{collective: the highest busbw (GB/s) over the measured sizes}, or None."""
    best = {}
    for row in (r or {}).get("rows") or []:
        best[row["op"]] = max(best.get(row["op"], 0), row["busbw_GBps"])
    return best or None


def load_busbw(path):
    """The bus bandwidths of an earlier bench_multi_gpu.py --out JSON (its `bus` suite)."""
    with open(path) as f:
        res = json.load(f)
    bus = res.get("suites", {}).get("bus") or res.get("bus")
    bw = best_busbw(bus)
    if not bw:
        raise SystemExit(f"--bus-json {path}: no bus suite result in it")
    return bw


def print_problems(r):
    report_problem("bus bandwidth job", r)


def print_tables(r):
    rows = r.get("rows") or []
    if not rows:
        print("\nbus: no result" + (f" ({r['error']})" if "error" in r else ""))
        return
    n = r.get("world")
    print("\n| collective | buffer S | calls | time per call (µs, mean of ranks) | algbw GB/s | "
          "busbw GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        size = f"{row['mib']:g} MiB"
        print(f"| {SHORT[row['op']]} | {size} | {row['iters']} | {fmt(row['time_us'], ',.1f')} | "
              f"{row['algbw_GBps']:.1f} | {row['busbw_GBps']:.1f} |")
    print(f"\n{n} ranks, {r.get('backend')}, {r.get('dtype')} buffers, {r.get('warmup')} untimed "
          f"calls then the timed ones; PyTorch {r.get('torch')}"
          + (f", NCCL {r['nccl']}" if r.get("nccl") else "") + ". S = the full buffer (all_reduce's"
          " tensor, reduce_scatter's input, all_gather's output); algbw = S ÷ time; busbw = algbw ×"
          " 2(n−1)/n (all_reduce) or × (n−1)/n (reduce_scatter, all_gather), as nccl-tests'"
          " PERFORMANCE.md.")
