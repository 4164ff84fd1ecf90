#!/usr/bin/env python3
"""Per-step device time of each kernel, memset and memcpy in steady training steps: the difference
of two bench/kernel_trace.cpp reports of the same run with different --max-steps (a short and a
long one), divided by the extra steps, so the first steps' one-time work (cuDNN's algorithm
searches, allocation, warm-up) cancels out.

Usage: kernel_trace_diff.py SHORT.tsv LONG.tsv EXTRA_STEPS [--top N]
Prints: ms per step, calls per step, kind, name (shortened), sorted by time, and their sum.
"""
import argparse
import subprocess


def read(path):
    rows = {}
    with open(path) as f:
        for line in f:
            if line.startswith("#") or line.startswith("total_ms"):
                continue
            ms, calls, _, kind, name = line.rstrip("\n").split("\t", 4)
            rows[(kind, name)] = (float(ms), int(calls))
    return rows


def short(names):
    """Readable kernel names: demangled (c++filt, where installed), without template arguments,
    parameters or namespaces."""
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        out = list(names)
    result = {}
    for raw, dem in zip(names, out):
        # Keep what is outside <...> and before the parameter list's '('.
        depth, base = 0, ""
        for ch in dem.replace("(anonymous namespace)", "anon"):
            if ch == "<":
                depth += 1
            elif ch == ">":
                depth -= 1
            elif ch == "(" and depth == 0:
                break
            elif depth == 0:
                base += ch
        result[raw] = base.split("::")[-1].split(" ")[-1].strip() or raw[:60]
    return result


def per_step(short_rows, long_rows, extra_steps):
    """[(ms per step, calls per step, (kind, name))] of the activities in `long_rows`, the
    difference from `short_rows` divided by `extra_steps`, longest first."""
    out = []
    for key, (ms, calls) in long_rows.items():
        ms0, calls0 = short_rows.get(key, (0.0, 0))
        out.append(((ms - ms0) / extra_steps, (calls - calls0) / extra_steps, key))
    out.sort(reverse=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("short")
    ap.add_argument("long")
    ap.add_argument("extra_steps", type=int)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    out = per_step(read(a.short), read(a.long), a.extra_steps)
    total = sum(o[0] for o in out)
    print(f"device time per steady step: {total:.3f} ms (sum over kernels, memsets, copies)")
    names = short([key[1] for _, _, key in out[: a.top]])
    for ms, calls, (kind, name) in out[: a.top]:
        print(f"{ms:9.3f} ms {calls:7.1f}/step  {kind:6s} {names[name]}")


if __name__ == "__main__":
    main()
