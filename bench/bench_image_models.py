#!/usr/bin/env python3
"""Image-model training benchmark: shardtrain vs PyTorch (torchvision models) on one GPU.

Speed (default): for each model and shape, images/s (steady state: the first `warm` steps are
excluded) and peak GPU memory of
  * shardtrain (`shardtrain train --device cuda`: bf16 compute, fp32 master weights, AdamW), on
    Fashion-MNIST resized to 32×32 (1 channel, 10 classes) or `--dataset synthetic` at 224×224
    (3 channels, 1000 classes: ImageNet-shaped random images); its images/s include its host-side
    data pipeline (normalize, crop),
  * PyTorch eager: the torchvision model (the first convolution re-made for 1 channel at 32×32),
    fp32 weights, bf16 autocast, channels_last, torch.optim.AdamW(fused=True), random input
    already on the GPU (no data pipeline),
  * the same model under torch.compile,
with shardtrain / PyTorch ratios. Shapes: 32×32 batch 256 and 224×224 batch 64 (vgg: 64 too).

Accuracy (--accuracy): the same recipe on both sides — Fashion-MNIST resized to 32×32
(--accuracy-size; bilinear, half-pixel centres, on both sides),
normalized with the training set's mean/std, random crop with 4 pixels of black padding (2 below
32×32: shardtrain's rule), batch
256, AdamW (lr 2e-3, betas 0.9/0.999, weight decay 0.05 on conv/linear weights only), linear
warmup over 10% of the steps from 0 then cosine to 0.1·lr, gradient clipping at 1.0, bf16 —
for `--epochs` epochs; test-set top-1 after the last epoch.

Usage (on the GPU machine):
  python3 bench/bench_image_models.py --shardtrain ./shardtrain [--models cnn,mobilenet_v2]
      [--sizes 32,224] [--frameworks shardtrain,eager,compile(,shardtrain_nographs)] [--accuracy --epochs 15 [--accuracy-size 64]] --out r.json
Not a test: numbers depend on the GPU; docs/BENCHMARKS.md records them with GPU and date.
"""
import argparse
import gzip
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "fixtures"))
import make_image_fixtures as twins  # noqa: E402  (cnn and cnn_lstm as PyTorch modules)

MODELS = ["cnn", "mobilenet_v2", "efficientnet_b0", "vgg11_bn", "vgg16_bn", "cnn_lstm"]
BATCH = {32: 256, 224: 64}


def build(name, channels, classes, size):
    """The torchvision model (default dropout) or shardtrain's cnn / cnn_lstm twin."""
    if name == "cnn":
        return twins.cnn(channels, classes)
    if name == "cnn_lstm":
        return twins.CnnLstm(channels, classes, width=size)
    m = getattr(torchvision.models, name)(num_classes=classes)
    if channels != 3:
        if name.startswith("vgg"):
            m.features[0] = nn.Conv2d(channels, 64, 3, padding=1)
        else:
            m.features[0][0] = nn.Conv2d(channels, 32, 3, 2, 1, bias=False)
    return m


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_mnist(root, size):
    """(train x, train y, test x, test y) on the GPU: x fp32 [N,1,size,size] in [0, 1]."""
    out = []
    for split in ("train", "t10k"):
        x = torch.from_numpy(read_idx(os.path.join(root, f"{split}-images-idx3-ubyte.gz")).copy())
        y = torch.from_numpy(read_idx(os.path.join(root, f"{split}-labels-idx1-ubyte.gz")).copy())
        x = x.cuda().float().div_(255.0).unsqueeze(1)
        if size != x.shape[-1]:
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        out += [x, y.cuda().long()]
    return out


def steady_rate(recs, warm, log_every, unit="images_per_s"):
    steps = [r for r in recs if "loss" in r and "step" in r and r["step"] > warm
             and r["step"] % log_every == 0]
    num = sum(r[unit] * r["step_time_s"] for r in steps)
    den = sum(r["step_time_s"] for r in steps)
    return num / den if den else float("nan")


def run_train(cmd, out_dir):
    """Runs a `shardtrain train` command: (its metrics.jsonl records, wall seconds), or (the end
    of its output, wall seconds) when it failed."""
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        return (proc.stdout + proc.stderr)[-2000:], wall
    return [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))], wall


def run_shardtrain(binary, name, size, steps, warm, workdir, extra=()):
    B = BATCH[size]
    out_dir = os.path.join(workdir, f"st_{name}_{size}")
    log_every = 5
    cmd = [binary, "train", "--model", name, "--device", "cuda", "--image-size", str(size),
           "--batch-size", str(B), "--max-steps", str(steps), "--log-interval", str(log_every),
           "--eval-samples", str(B), "--no-save", "--output-dir", out_dir, "--warmup-steps", "5",
           *extra]
    if size == 32:
        cmd += ["--dataset", "fashion-mnist"]
    else:
        cmd += ["--dataset", "synthetic", "--num-samples", str(steps * B)]
    recs, wall = run_train(cmd, out_dir)
    if isinstance(recs, str):
        return {"error": recs}
    epoch = [r for r in recs if "device_peak_allocated_bytes" in r][-1]
    return {"images_per_s": steady_rate(recs, warm, log_every),
            "peak_allocated": epoch["device_peak_allocated_bytes"],
            "peak_reserved": epoch.get("device_peak_reserved_bytes"), "wall_s": wall}


def decay_groups(model, wd):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def run_torch(name, size, steps, warm, compiled):
    torch.manual_seed(0)
    B = BATCH[size]
    channels, classes = (1, 10) if size == 32 else (3, 1000)
    model = build(name, channels, classes, size).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(decay_groups(model, 0.01), lr=1e-3, fused=True)
    fwd = torch.compile(model) if compiled else model
    x = torch.randn(B, channels, size, size, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (B,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    t1 = time.time()
    for _ in range(steps - warm):
        step()
    torch.cuda.synchronize()
    t2 = time.time()
    res = {"images_per_s": B * (steps - warm) / (t2 - t1),
           "peak_allocated": torch.cuda.max_memory_allocated(),
           "peak_reserved": torch.cuda.max_memory_reserved(), "warmup_s": t1 - t0}
    del model, opt, fwd
    torch.cuda.empty_cache()
    return res


def speed(args):
    results = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for name in args.models.split(","):
            if name == "cnn_lstm" and size == 224:
                continue  # a row-sequence LSTM over 224 rows is not an ImageNet model
            steps, warm = (60, 20) if size == 32 else (30, 10)
            row = {"model": name, "size": size, "batch": BATCH[size]}
            for fw in args.frameworks.split(","):
                try:
                    if fw == "shardtrain":
                        row[fw] = run_shardtrain(args.shardtrain, name, size, steps, warm,
                                                 args.workdir)
                    elif fw == "shardtrain_nographs":  # the memory and speed without graphs
                        row[fw] = run_shardtrain(args.shardtrain, name, size, steps, warm,
                                                 args.workdir, extra=("--no-cuda-graphs",))
                    else:
                        row[fw] = run_torch(name, size, steps, warm, fw == "compile")
                except Exception as e:  # report and go on with the other rows
                    row[fw] = {"error": repr(e)[-2000:]}
                    torch.cuda.empty_cache()
            results.append(row)
            line = f"{name:16s} {size:3d}x{size:<3d} b{BATCH[size]:<4d}"
            for fw in args.frameworks.split(","):
                r = row[fw]
                line += (f" | {fw} {r['images_per_s']:9.0f} img/s {r['peak_allocated'] / 2**20:7.0f}"
                         f" MiB ({(r.get('peak_reserved') or 0) / 2**20:.0f} reserved)"
                         if "images_per_s" in r else f" | {fw} ERROR")
            st = row.get("shardtrain", {})
            for fw in ("eager", "compile"):
                if "images_per_s" in st and "images_per_s" in row.get(fw, {}):
                    line += f" | ×{fw} {st['images_per_s'] / row[fw]['images_per_s']:.2f}"
            print(line, flush=True)
            for fw in args.frameworks.split(","):
                if "error" in row[fw]:
                    print(f"  {fw} error: {row[fw]['error'][-600:]}", flush=True)
    return results


def torch_accuracy(name, data, epochs, lr, wd, seed):
    """The recipe of the module docstring in PyTorch; returns (top-1, seconds)."""
    torch.manual_seed(seed)
    xtr, ytr, xte, yte = data
    mean, std = xtr.mean().item(), xtr.std().item()
    model = build(name, 1, 10, xtr.shape[-1]).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(decay_groups(model, wd), lr=lr, fused=True)
    B, N, S = 256, xtr.shape[0], xtr.shape[-1]
    per_epoch = N // B
    total = per_epoch * epochs
    warmup = total // 10

    def lr_at(s):
        if s < warmup:
            return lr * (s + 1) / warmup
        t = (s - warmup) / max(1, total - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    t0 = time.time()
    step = 0
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(N, device="cuda")
        for b in range(per_epoch):
            idx = perm[b * B:(b + 1) * B]
            pad = 4 if S >= 32 else 2  # black padding, then a random S×S crop
            x = F.pad(xtr[idx], (pad, pad, pad, pad))
            oy = torch.randint(0, 2 * pad + 1, (B,), device="cuda")
            ox = torch.randint(0, 2 * pad + 1, (B,), device="cuda")
            rows = (oy[:, None] + torch.arange(S, device="cuda"))[:, None, :, None]
            cols = (ox[:, None] + torch.arange(S, device="cuda"))[:, None, None, :]
            zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device="cuda")
            x = x[torch.arange(B, device="cuda")[:, None, None, None], zero, rows, cols]
            x = ((x - mean) / std).contiguous(memory_format=torch.channels_last)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), ytr[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
    model.eval()
    correct = 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for b in range(0, xte.shape[0], 1000):
            x = ((xte[b:b + 1000] - mean) / std).contiguous(memory_format=torch.channels_last)
            correct += (model(x).argmax(1) == yte[b:b + 1000]).sum().item()
    torch.cuda.synchronize()
    return correct / xte.shape[0], time.time() - t0


def shardtrain_accuracy(binary, name, size, epochs, lr, wd, seed, workdir):
    out_dir = os.path.join(workdir, f"acc_{name}_{size}")
    cmd = [binary, "train", "--model", name, "--dataset", "fashion-mnist", "--image-size", str(size),
           "--device", "cuda", "--batch-size", "256", "--epochs", str(epochs), "--lr", str(lr),
           "--weight-decay", str(wd), "--seed", str(seed), "--log-interval", "50", "--no-save",
           "--output-dir", out_dir]
    recs, wall = run_train(cmd, out_dir)
    if isinstance(recs, str):
        return {"error": recs}
    evals = [r for r in recs if "val_top1" in r]
    return {"top1": evals[-1]["val_top1"], "top1_by_epoch": [r["val_top1"] for r in evals],
            "wall_s": wall}


def accuracy(args):
    size = args.accuracy_size
    data = fashion_mnist(args.fashion_mnist, size)
    results = []
    for name in args.models.split(","):
        row = {"model": name, "epochs": args.epochs, "size": size}
        if "shardtrain" in args.frameworks:
            row["shardtrain"] = shardtrain_accuracy(args.shardtrain, name, size, args.epochs,
                                                    args.lr, args.weight_decay, args.seed,
                                                    args.workdir)
        if "eager" in args.frameworks:
            top1, secs = torch_accuracy(name, data, args.epochs, args.lr, args.weight_decay,
                                        args.seed)
            row["pytorch"] = {"top1": top1, "wall_s": secs}
        results.append(row)
        st, pt = row.get("shardtrain", {}), row.get("pytorch", {})
        print(f"{name:16s} {size}x{size} {args.epochs} epochs | shardtrain "
              f"{100 * st['top1']:.2f}% ({st.get('wall_s', 0):.0f} s)" if "top1" in st else
              f"{name:16s} shardtrain ERROR {st.get('error', '')[-600:]}", end="")
        print(f" | pytorch {100 * pt['top1']:.2f}% ({pt['wall_s']:.0f} s)" if pt else "", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sizes", default="32,224")
    ap.add_argument("--frameworks", default="shardtrain,eager,compile")
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--accuracy-size", type=int, default=32,
                    help="--accuracy: Fashion-MNIST resized (bilinear) to this many pixels a side")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fashion-mnist", default=os.environ.get(
        "FASHION_MNIST", "/work/main/build/data/fashion-mnist"))
    ap.add_argument("--workdir", default="/tmp/bench_image_models")
    ap.add_argument("--out", default="bench_image_models.json")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}
    print(json.dumps(info), flush=True)
    results = accuracy(args) if args.accuracy else speed(args)
    with open(args.out, "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
