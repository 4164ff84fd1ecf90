#!/usr/bin/env python3
"""One rank of bench/bench_multi_gpu.py's `bus` suite: the bus bandwidth of this host's GPUs for
all_reduce, reduce_scatter_tensor and all_gather_into_tensor through torch.distributed (NCCL;
gloo with --device cpu, a smoke test of the script). Start it with torchrun, all ranks = the GPUs
to measure:

    NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/torch_bus_worker.py --sizes-mib 1,64,512

For each collective and size S (the full buffer in bytes, bf16 elements: all_reduce's tensor,
reduce_scatter's input, all_gather's output; rounded down to a multiple of the world size in
elements): --warmup untimed calls, then --iters calls between torch.cuda.synchronize + barrier and
a final synchronize; time = the seconds of one call, averaged over the calls and then over the
ranks (nccl-tests' default; the slowest rank's is kept too). Out of place for reduce_scatter and
all_gather, in place for all_reduce. As nccl-tests' PERFORMANCE.md defines them:
algbw = S / time, busbw = algbw × 2(n−1)/n for all_reduce and × (n−1)/n for reduce_scatter and
all_gather (n ranks), in GB/s (1e9 bytes/s); busbw is comparable with the link's peak whatever n.
Rank 0 prints one line "BENCH_RESULT {json}" with a row per (collective, size).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_dist_worker import init_process_group  # noqa: E402

RESULT_TAG = "BENCH_RESULT "
OPS = ("all_reduce", "reduce_scatter", "all_gather")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# collective -> call(full buffer, one rank's part)
CALLS = {"all_reduce": lambda full, part: dist.all_reduce(full),
         "reduce_scatter": lambda full, part: dist.reduce_scatter_tensor(part, full),
         "all_gather": lambda full, part: dist.all_gather_into_tensor(full, part)}


def bus_factor(op, n):
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def default_iters(size_bytes):
    """Enough calls to time a size well and not much more: 200 for ≤ 20 MiB, 20 for ≥ 200 MiB."""
    return max(20, min(200, int(4 * 2**30 // max(size_bytes, 1))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", default="1,64,512",
                    help="buffer sizes S in MiB, comma-separated")
    ap.add_argument("--ops", default=",".join(OPS), help="collectives, comma-separated")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls per collective and size")
    ap.add_argument("--iters", type=int, default=0,
                    help="timed calls per collective and size (0: 200 for small sizes, 20 for "
                         "large)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--comm-timeout", type=float, default=120)
    a = ap.parse_args()
    ops = a.ops.split(",")
    if set(ops) - set(OPS):
        ap.error(f"--ops: one or more of {', '.join(OPS)}")

    cuda = a.device == "cuda"
    dev, rank, n = init_process_group(a.device, a.comm_timeout)
    dtype = DTYPES[a.dtype]
    esize = torch.tensor([], dtype=dtype).element_size()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    rows = []
    for mib in (float(s) for s in a.sizes_mib.split(",")):
        count = int(mib * 2**20) // esize // n * n  # elements of the full buffer
        if count == 0:
            continue
        full = torch.zeros(count, dtype=dtype, device=dev)  # zeros: sums stay finite
        part = torch.zeros(count // n, dtype=dtype, device=dev)
        for op in ops:
            call = CALLS[op]
            iters = a.iters or default_iters(count * esize)
            for _ in range(a.warmup):
                call(full, part)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call(full, part)
            sync()
            t = (time.perf_counter() - t0) / iters
            t_sum = torch.tensor([t], dtype=torch.float64, device=dev)
            t_max = torch.tensor([t], dtype=torch.float64, device=dev)
            dist.all_reduce(t_sum)
            dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
            t_mean, t_max = t_sum.item() / n, t_max.item()
            S = count * esize
            algbw = S / t_mean / 1e9
            rows.append({"op": op, "bytes": S, "mib": S / 2**20, "iters": iters,
                         "time_us": 1e6 * t_mean, "time_us_max": 1e6 * t_max,
                         "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, n)})
        del full, part
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        info = {"world": n, "backend": dist.get_backend(), "dtype": a.dtype, "warmup": a.warmup,
                "rows": rows, "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                "device_name": torch.cuda.get_device_name(dev) if cuda else "cpu"}
        print(RESULT_TAG + json.dumps(info), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
