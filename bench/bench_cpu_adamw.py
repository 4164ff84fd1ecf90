#!/usr/bin/env python3
"""PyTorch's CPU AdamW on a shard of N elements: the peer of bench_host_limits'
cpu_adamw (shardtrain's CPU AdamW). torch.optim.AdamW with foreach=True and with fused=True on fp32
parameters and fp32 gradients in host memory, what FSDP2's CPUOffloadPolicy steps; params/s and
bytes/s counted as for ours (reads p, g, m, v 4+4+4+4, writes p, m, v 4+4+4 = 28 bytes per element).

    python3 bench/bench_cpu_adamw.py --elements 200000000 --tensors 64 \
        [--host-limits-json limits_host.json] --out cpu_adamw.json

--tensors splits the shard into that many equal parameters (FSDP2 steps one local shard per
parameter). With --host-limits-json (bench_host_limits' output), the table puts ours beside
PyTorch's and the JSON written to --out holds both ({"host_limits": ..., "torch_adamw": ...}).
Threads: torch.get_num_threads() (OMP_NUM_THREADS). Without torch the result is an error entry.
"""
import argparse
import json
import sys
import time


def measure(torch, n, tensors, impl, reps):
    sizes = [n // tensors + (1 if i < n % tensors else 0) for i in range(tensors)]
    params = [torch.nn.Parameter(torch.empty(s, dtype=torch.float32).uniform_(-0.02, 0.02))
              for s in sizes]
    for p in params:
        p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            **{impl: True})
    opt.step()  # the state (m, v) is allocated in the first step: untimed
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    del opt, params
    best = min(times)
    return {"best_s": best, "mean_s": sum(times) / len(times), "params_per_s": n / best,
            "bytes_per_s": 28 * n / best, "GBps": 28 * n / best / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=200_000_000)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--impls", default="foreach,fused")
    ap.add_argument("--host-limits-json", default=None, help="bench_host_limits output to compare with")
    ap.add_argument("--out", default="cpu_adamw.json")
    a = ap.parse_args()
    res = {"elements": a.elements, "tensors": a.tensors, "reps": a.reps, "bytes_per_element": 28}
    try:
        import torch
        res.update(torch=torch.__version__, threads=torch.get_num_threads())
        for impl in a.impls.split(","):
            try:
                res[impl] = measure(torch, a.elements, a.tensors, impl, a.reps)
            except Exception as e:  # noqa: BLE001 - e.g. fused not supported on CPU in old torch
                res[impl] = {"error": repr(e)[:500]}
            print(f"torch AdamW {impl}: {res[impl]}", file=sys.stderr, flush=True)
    except ImportError as e:
        res["error"] = f"torch not importable: {e}"
    out = {"torch_adamw": res}
    ours = None
    if a.host_limits_json:
        try:
            with open(a.host_limits_json) as f:
                out["host_limits"] = json.load(f)
            ours = out["host_limits"].get("cpu_adamw", {})
        except (OSError, ValueError) as e:
            out["host_limits"] = {"error": repr(e)}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)

    hl = out.get("host_limits", {})
    triad = (hl.get("stream") or {}).get("triad_bytes_per_s")
    print("\n| CPU AdamW | elements | threads | best step | M params/s | GB/s (28 B/elem) | of triad |")
    print("|---|---|---|---|---|---|---|")

    def line(label, n, threads, r):
        if not r or "error" in r:
            print(f"| {label} | {n:,} | {threads} | error: {(r or {}).get('error', 'not run')[:80]} | | | |")
            return
        frac = f"{r['bytes_per_s'] / triad:.0%}" if triad else "-"
        print(f"| {label} | {n:,} | {threads} | {r['best_s'] * 1e3:.1f} ms | {r['params_per_s'] / 1e6:,.0f} |"
              f" {r['bytes_per_s'] / 1e9:.1f} | {frac} |")

    if ours and "error" not in ours:
        for k, label in (("bf16_grads_bf16_params", "shardtrain cpu_adamw, bf16 grad + bf16 params out"),
                         ("fp32_grads_no_copy", "shardtrain cpu_adamw, fp32 grad (as PyTorch)")):
            line(f"{label} ({ours.get('simd')})", ours["elements"], ours.get("threads"), ours.get(k))
    elif ours:
        print(f"| shardtrain cpu_adamw | | | error: {ours['error'][:80]} | | | |")
    for impl in a.impls.split(","):
        line(f"torch.optim.AdamW({impl}=True), fp32", a.elements, res.get("threads", "-"),
             res.get(impl) or {"error": res.get("error", "not run")})
    if triad:
        print(f"\nSTREAM triad {triad / 1e9:.1f} GB/s, copy "
              f"{hl['stream'].get('copy_bytes_per_s', 0) / 1e9:.1f} GB/s"
              f" ({hl['stream'].get('threads')} threads, {hl['stream'].get('array_bytes', 0) >> 20} MiB arrays)")
    pc = hl.get("pcie") or {}
    if pc.get("available"):
        print(f"pinned H2D {pc['h2d_GBps']:.1f} GB/s, D2H {pc['d2h_GBps']:.1f} GB/s, both at once "
              f"{pc['bidir_GBps']:.1f} GB/s; pageable H2D {pc['pageable_h2d_GBps']:.1f} GB/s ({pc.get('gpu')})")
    dk = hl.get("disk") or {}
    if dk and "error" not in dk:
        print(f"disk {dk['path']} ({'O_DIRECT' if dk['direct'] else 'buffered'}, {dk['block_bytes'] >> 10} KiB "
              f"blocks): write {dk['write_GBps']:.2f} GB/s, read {dk['read_GBps']:.2f} GB/s; "
              f"{dk['jobs']} jobs: {dk['write_jobs_GBps']:.2f} / {dk['read_jobs_GBps']:.2f} GB/s")
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
