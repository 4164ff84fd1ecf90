#!/usr/bin/env python3
"""Validation at chance in the first optimizer steps of mobilenet_v2, on CPU ranks: the same
number of optimizer steps, not the same number of epochs, decides when it ends, and batch norm's
running variance (initial value 1, momentum 0.1) is why.

1. Writes a 10-class ImageFolder of 48×48 RGB PNGs (a disk of one of ten hues, random centre and
   radius, on a random gray background with noise; 400 per class: 3,600 training and 400
   held-out images) into --workdir.
2. Trains mobilenet_v2 at --image-size 32 for 8 epochs (shardtrain's defaults otherwise: AdamW
   lr 6e-4, warmup 10%, cosine) with ddp as ranks × micro-batch = 1×256, 4×64, 2×64 and 1×64
   (14, 14, 28 and 56 optimizer steps per epoch), validating every 14 steps; prints top-1 by
   step side by side.
3. Saves checkpoints of 4×64 every 14 steps (56 steps), prints the mean running variance of the
   batch norms after the depthwise convolutions of three blocks beside 0.9^step, then re-estimates
   the statistics of the step-56 weights (40 steps at lr 1e-30 on one rank: the weights do not
   move, the running statistics forget the old ones) and validates again.

Usage (the CPU build; about 15 minutes on 2 cores):
  SHARDTRAIN_DATA_DIR=build/data python3 bench/image_bn_first_steps_cpu.py \\
      --shardtrain build/shardtrain [--workdir /tmp/image_bn_first_steps] [--configs 1x256,4x64]
"""
import argparse
import colorsys
import json
import os
import re
import struct
import subprocess
import sys

import numpy as np

VALIDATION = re.compile(r"^validation \| epoch (\d+) \| step (\d+) \| loss \S+ \| top-1 ([\d.]+)%")
PROBES = ["features.2.conv.1.1", "features.8.conv.1.1", "features.15.conv.1.1"]


def make_folder(root, per_class=400, seed=0):
    from PIL import Image
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:48, 0:48].astype(np.float32)
    for k in range(10):
        d = os.path.join(root, f"class{k}")
        os.makedirs(d, exist_ok=True)
        colour = np.array(colorsys.hsv_to_rgb(k / 10, 0.8, 0.9), np.float32)
        for i in range(per_class):
            cx, cy, r = rng.uniform(14, 34), rng.uniform(14, 34), rng.uniform(7, 14)
            disk = ((xx - cx) ** 2 + (yy - cy) ** 2 < r * r)[..., None]
            img = np.where(disk, colour, rng.uniform(0.1, 0.9)) + rng.normal(0, 0.08, (48, 48, 3))
            Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).save(
                os.path.join(d, f"{i:04d}.png"))


def train(a, name, ranks, micro, extra, threads):
    out = os.path.join(a.workdir, name)
    cmd = [a.shardtrain, "launch", "--nproc-per-node", str(ranks), "--", "train", "--model",
           "mobilenet_v2", "--data-dir", a.folder, "--image-size", "32", "--device", "cpu",
           "--strategy", "ddp", "--batch-size", str(micro), "--log-interval", "14",
           "--output-dir", out, *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    print("$ " + " ".join(cmd), flush=True)
    log = subprocess.run(cmd, capture_output=True, text=True, env=env)
    with open(out + ".log", "w") as f:
        f.write(log.stdout + log.stderr)
    if log.returncode != 0:
        sys.exit(f"{name} failed:\n{(log.stdout + log.stderr)[-2000:]}")
    return {int(m[2]): (int(m[1]), float(m[3])) for m in
            (VALIDATION.match(l) for l in log.stdout.splitlines()) if m}


def buffers(ckpt):
    """Rank 0's batch norm running statistics of a checkpoint: {name: values}."""
    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    with open(os.path.join(ckpt, man["ranks"][0]["file"]), "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8:8 + n])
    s, e = head["buffers"]["data_offsets"]
    flat = np.frombuffer(data[8 + n + s:8 + n + e], dtype=np.float32)
    return {t["name"]: flat[t["offset"]:t["offset"] + t["numel"]]
            for t in man["buffers"]["tensors"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--workdir", default="/tmp/image_bn_first_steps")
    ap.add_argument("--configs", default="1x256,4x64,2x64,1x64", help="RANKSxMICRO,...")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    a.folder = os.path.join(a.workdir, "disks")
    if not os.path.isdir(a.folder):
        make_folder(a.folder)

    curves = {}
    for c in a.configs.split(","):
        ranks, micro = (int(v) for v in c.split("x"))
        curves[c] = train(a, f"run_{c}", ranks, micro,
                          ["--epochs", str(a.epochs), "--eval-interval", "14", "--no-save"],
                          max(1, a.cores // ranks))
    print("\nvalidation top-1 % by optimizer step (e: epoch)")
    print("step  " + "".join(f"{c:>16}" for c in curves))
    for s in sorted(set().union(*curves.values())):
        print(f"{s:4d}  " + "".join(
            f"{f'{curves[c][s][1]:.2f} (e{curves[c][s][0]})' if s in curves[c] else '':>16}"
            for c in curves))

    # Running variance of depthwise batch norms against what is left of their initial 1
    train(a, "bn_4x64", 4, 64, ["--epochs", str(a.epochs), "--max-steps", "56",
                                "--save-interval", "14"], max(1, a.cores // 4))
    ck = {k: buffers(os.path.join(a.workdir, "bn_4x64", f"checkpoint-{k:06d}"))
          for k in (14, 28, 42, 56)}
    after = train(a, "bn_reestimated", 1, 64,
                  ["--init-from", os.path.join(a.workdir, "bn_4x64", "checkpoint-000056"),
                   "--lr", "1e-30", "--warmup-steps", "0", "--lr-schedule", "constant",
                   "--max-steps", "40", "--eval-interval", "40"], a.cores)
    re40 = buffers(os.path.join(a.workdir, "bn_reestimated", "checkpoint-000040"))
    print("\nmean running variance (rank 0) after step k; last column: the variance of the "
          "step-56 weights (re-estimated)")
    print(f"{'0.9^k':32s}" + "".join(f"{0.9 ** k:10.3g}" for k in ck))
    for p in PROBES:
        v = p + ".running_var"
        now = (re40[v] - 0.9 ** 40 * ck[56][v]) / (1 - 0.9 ** 40)
        print(f"{v:32s}" + "".join(f"{ck[k][v].mean():10.3g}" for k in ck) +
              f"  | {now.mean():.3g}")
    print(f"validation top-1 of the step-56 weights with re-estimated statistics: "
          f"{after[max(after)][1]:.2f}%")


if __name__ == "__main__":
    main()
