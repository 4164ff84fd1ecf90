#!/usr/bin/env python3
"""How much of each collective kind hides behind compute, from SHARDTRAIN_COMM_TRACE files.

A run with SHARDTRAIN_COMM_TRACE=PREFIX writes PREFIX.rank<R>.json (Chrome trace format, times in
microseconds; src/comm/nccl_communicator_cuda.cpp, CommTrace): one "comm" event per operation,
from when the communication stream started it to when it ended, and one "compute" event per
Work::wait(), from when the compute stream reached the wait to when it went on. Per rank and
operation kind (all_gather, reduce_scatter, all_reduce, send, recv, ...) this prints:

  ops        operations traced
  comm ms    time the operations ran on the communication stream, summed
  waited ms  time the compute stream stood at waits for them, summed: the exposed part
  hidden     1 − waited / comm: the share of communication time overlapped with compute

Every traced step counts, warm-up steps included: run enough steps that they do not dominate.

Usage: python3 bench/comm_trace_summary.py PREFIX.rank0.json [PREFIX.rank1.json ...]
"""
import collections
import json
import re
import sys


def kind(name):
    """'all_gather #17' -> 'all_gather'; 'wait send #3 to rank 1' -> 'send'."""
    name = name[5:] if name.startswith("wait ") else name
    return re.split(r" #", name, maxsplit=1)[0]


def summarize(path):
    events = json.load(open(path))["traceEvents"]
    comm = collections.defaultdict(float)
    waited = collections.defaultdict(float)
    count = collections.Counter()
    for e in events:
        if e["dur"] < 0:
            continue  # an event that could not be timed
        k = kind(e["name"])
        if e["tid"] == "comm":
            comm[k] += e["dur"] / 1e3
            count[k] += 1
        else:
            waited[k] += e["dur"] / 1e3
    return comm, waited, count


def main(paths):
    if not paths:
        print(__doc__)
        return 2
    print(f"{'file':40} {'op':16} {'ops':>6} {'comm ms':>10} {'waited ms':>10} {'hidden':>7}")
    for p in paths:
        comm, waited, count = summarize(p)
        for k in sorted(comm):
            hidden = 1 - waited[k] / comm[k] if comm[k] > 0 else float("nan")
            print(f"{p[-40:]:40} {k:16} {count[k]:6d} {comm[k]:10.1f} {waited[k]:10.1f} "
                  f"{100 * hidden:6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
