#!/usr/bin/env python3
"""Reads a GPU run's TensorBoard event files with the `tensorboard` package's EventAccumulator and
checks them against the run's metrics.jsonl: every scalar tag with its point count and last
value, train/loss equal (as float32) to metrics.jsonl's loss at each logged step, and the config
text. Usage: python3 bench/read_gpu_tensorboard.py EVENT_DIR METRICS_JSONL
"""
import json
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def main(event_dir, metrics_path):
    acc = EventAccumulator(event_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in sorted(tags["scalars"]):
        ev = acc.Scalars(tag)
        print(f"{tag}: {len(ev)} points, steps {ev[0].step}..{ev[-1].step}, last {ev[-1].value:.6g}")
    print("text:", ", ".join(sorted(tags.get("tensors", []))))
    recs = [json.loads(l) for l in open(metrics_path) if l.strip()]
    losses = {r["step"]: r["loss"] for r in recs if "loss" in r and "grad_norm" in r}
    tb = {e.step: e.value for e in acc.Scalars("train/loss")}
    common = sorted(set(losses) & set(tb))
    bad = [s for s in common if f32(losses[s]) != tb[s]]
    print(f"train/loss vs metrics.jsonl: {len(common)} common steps, {len(bad)} differ")
    return 1 if bad or not common else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
