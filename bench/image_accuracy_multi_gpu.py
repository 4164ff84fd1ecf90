#!/usr/bin/env python3
"""Multi-GPU accuracy parity of the image models: shardtrain ddp against PyTorch
DistributedDataParallel on N GPUs of one host, the same recipe on both sides, validation top-1
after every epoch side by side.

Phase `parity` (default models cnn, mobilenet_v2): Fashion-MNIST resized to 32×32 (bilinear,
half-pixel centres), normalized with the training set's mean/std, random crop with 4 pixels of
black padding, GLOBAL batch 256 (256/N per GPU), AdamW (lr 2e-3, betas 0.9/0.999, weight decay
0.05 on conv/linear weights only), linear warmup over min(1000, 10%) of the steps then cosine to
0.1·lr, gradient clipping at 1.0, bf16 compute (fp32 master weights), `--epochs` epochs
(default 15, as bench/bench_image_models.py --accuracy on one GPU), validation on the whole test
set after every epoch.
  * shardtrain: `shardtrain launch --nproc-per-node N -- train --model M --dataset fashion-mnist
    --strategy ddp ...`; the per-epoch top-1 is parsed from its log ("validation | epoch E | ...
    top-1 X% ..."). Validation divides the test set over the ranks, each rank with its own batch
    norm running statistics.
  * PyTorch: this file under `python3 -m torch.distributed.run --standalone --nproc-per-node N`
    (NCCL), DistributedDataParallel (broadcast_buffers on: every rank trains from rank 0's batch
    norm statistics), DistributedSampler (drop_last), bf16 autocast, channels_last, fused AdamW;
    the model is bench/bench_image_models.py's `build` (torchvision mobilenet_v2 with the first
    convolution re-made for 1 channel and 10 classes; the cnn twin of
    tests/fixtures/make_image_fixtures.py). Rank 0 validates on the whole test set.

Phase `early` (batch norm in the first optimizer steps): mobilenet_v2 on the first 3,584
Fashion-MNIST training images (--early-num-samples) at micro-batch 64 per GPU, on 1 GPU and on N
GPUs (--early-gpus), both frameworks, validated on the whole test set every 14 optimizer steps
(--early-eval-interval), so the curves can be read at equal steps (rows) and at equal epochs (56/N
steps per epoch). Batch norm's running variance starts at 1 and moves by momentum 0.1 per step,
while the depthwise convolutions' outputs have a variance of 1e-4 to 1e-2 at 32×32 (torchvision's
fan-out initialization); until 0.9^step falls below that, evaluation normalizes those channels by
a far too large variance, every image gets nearly the same logits, and top-1 is 10% — after the
same number of steps in both frameworks, whatever the number of GPUs. The PyTorch side also
records the mean running variance of the last depthwise convolution's batch norm at every
validation, next to 0.9^step.

Outputs: --out (JSON: every validation of every run, wall times, commands) and --markdown
(tables: per-epoch top-1 side by side with the difference, final difference, wall times; the
early curves).

Usage (GPU machine, after `source bench/lib/prelude.sh`; estimated 5 minutes on 2 H100s):
  python3 bench/image_accuracy_multi_gpu.py --shardtrain .packed/shardtrain --gpus 2 \\
      --out $OUT/image_accuracy_multi_gpu.json --markdown $OUT/image_accuracy_multi_gpu.md \\
      --workdir $OUT/image_accuracy_multi_gpu
CPU check of the command lines (shardtrain ranks under mpirun; the PyTorch side on gloo when
torch is installed, else skipped):
  python3 bench/image_accuracy_multi_gpu.py --device cpu --gpus 2 --shardtrain build/shardtrain \\
      --epochs 1 --num-samples 2048 --eval-samples 1000 --early-epochs 1 --early-num-samples 1024
Not a test: numbers depend on the GPUs; docs/BENCHMARKS.md records them with GPU and date.
"""
import argparse
import importlib.util
import json
import math
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_TAG = "IMAGE_ACCURACY_RESULT "
VALIDATION = re.compile(r"^validation \| epoch (\d+) \| step (\d+) \| loss ([\d.naif]+) \| "
                        r"top-1 ([\d.]+)% \| top-5 ([\d.]+)%")
STEP_LOSS = re.compile(r"^epoch (\d+) \| step +(\d+)/\d+ \| loss ([\d.naif]+)")
EPOCH_LOSS = re.compile(r"^epoch (\d+)(?: \(partial\))? \| \d+ steps \| avg loss ([\d.naif]+)")
DONE = re.compile(r"^done \| (\d+) steps \| ([\d.]+) s")


# ---------------------------------------------------------------------------------------------
# The PyTorch side: one rank (started by torchrun, or alone as a world of one)
# ---------------------------------------------------------------------------------------------

def worker(a):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    sys.path.insert(0, HERE)
    import bench_image_models as bim  # build(), decay_groups(), read_idx(): the 1-GPU bench's
    from torch_dist_worker import init_process_group

    dev, rank, world = init_process_group(a.device, a.comm_timeout, port="29511")
    local = int(os.environ["LOCAL_RANK"])
    S = a.image_size
    micro = a.micro_batch if a.micro_batch > 0 else a.global_batch // world
    if a.micro_batch <= 0 and a.global_batch % world:
        raise SystemExit(f"--global-batch {a.global_batch} is not a multiple of {world} ranks")

    # ---- data: Fashion-MNIST on the device, x fp32 [N,1,S,S] in [0, 1] ----
    def split(name, n):
        x = torch.from_numpy(bim.read_idx(os.path.join(a.fashion_mnist,
                                                       f"{name}-images-idx3-ubyte.gz")).copy())
        y = torch.from_numpy(bim.read_idx(os.path.join(a.fashion_mnist,
                                                       f"{name}-labels-idx1-ubyte.gz")).copy())
        if n > 0:  # the first n, as shardtrain's --num-samples / --eval-samples
            x, y = x[:n], y[:n]
        x = x.to(dev).float().div_(255.0).unsqueeze(1)
        if S != x.shape[-1]:
            x = F.interpolate(x, size=(S, S), mode="bilinear", align_corners=False)
        return x, y.to(dev).long()

    xtr, ytr = split("train", a.num_samples)
    xte, yte = split("t10k", a.eval_samples)
    mean, std = xtr.mean().item(), xtr.std().item()
    N = xtr.shape[0]

    # ---- model, optimizer, schedule (shardtrain's learning_rate(), optim/adamw.cpp) ----
    torch.manual_seed(a.seed)
    model = bim.build(a.model, 1, 10, S).to(dev).to(memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[local] if a.device == "cuda" else None)
    opt = torch.optim.AdamW(bim.decay_groups(model, a.weight_decay), lr=a.lr,
                            fused=a.device == "cuda")
    torch.manual_seed(a.seed * 1000 + rank)  # each rank's own crops
    sampler = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True,
                                 seed=a.seed, drop_last=True)
    per_epoch = len(sampler) // micro  # = floor(N / (micro · world)), shardtrain's count
    total = per_epoch * a.epochs
    warmup = min(1000, total // 10)

    def lr_at(s):
        if warmup > 0 and s < warmup:
            return a.lr * (s + 1) / warmup
        if total <= warmup:
            return a.lr
        p = min(max((s - warmup) / (total - warmup), 0.0), 1.0)
        return 0.1 * a.lr + 0.5 * (a.lr - 0.1 * a.lr) * (1 + math.cos(math.pi * p))

    # The batch norm after the last depthwise convolution (groups > 1), if any
    probe, prev = None, None
    for name, m in model.named_modules():
        if isinstance(m, nn.BatchNorm2d) and isinstance(prev, nn.Conv2d) and prev.groups > 1:
            probe = (name, m)
        if isinstance(m, (nn.Conv2d, nn.BatchNorm2d)):
            prev = m

    def validate():
        """Rank 0: top-1, top-5 and loss on the test set, eval mode (its running statistics)."""
        model.eval()
        correct1 = correct5 = 0
        loss = 0.0
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
            for b in range(0, xte.shape[0], 1000):
                x = ((xte[b:b + 1000] - mean) / std).contiguous(memory_format=torch.channels_last)
                z = model(x).float()
                y = yte[b:b + 1000]
                loss += F.cross_entropy(z, y, reduction="sum").item()
                top5 = z.topk(5, dim=1).indices
                correct1 += (top5[:, 0] == y).sum().item()
                correct5 += (top5 == y[:, None]).any(1).sum().item()
        model.train()
        n = xte.shape[0]
        return {"top1": correct1 / n, "top5": correct5 / n, "val_loss": loss / n}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    evals, epochs = [], []
    eval_s = 0.0
    step = 0
    pad = 4 if S >= 32 else 2  # black padding, then a random S×S crop (shardtrain's rule)
    ar = torch.arange(S, device=dev)
    bidx = torch.arange(micro, device=dev)[:, None, None, None]
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    sync()
    dist.barrier()
    t0 = time.time()
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(iter(sampler)), device=dev)
        loss_sum = torch.zeros((), device=dev)
        evaluated = False
        for b in range(per_epoch):
            idx = order[b * micro:(b + 1) * micro]
            x = F.pad(xtr[idx], (pad, pad, pad, pad))
            oy = torch.randint(0, 2 * pad + 1, (micro,), device=dev)
            ox = torch.randint(0, 2 * pad + 1, (micro,), device=dev)
            rows = (oy[:, None] + ar)[:, None, :, None]
            cols = (ox[:, None] + ar)[:, None, None, :]
            x = x[bidx, zero, rows, cols]
            x = ((x - mean) / std).contiguous(memory_format=torch.channels_last)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(ddp(x), ytr[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach().float()
            step += 1
            evaluated = False
            due = step % a.eval_interval == 0 if a.eval_interval > 0 else b + 1 == per_epoch
            if due or step == total:
                step_loss = loss.detach().float().clone()
                dist.all_reduce(step_loss)
                sync()
                te = time.time()
                if rank == 0:
                    r = validate()
                    r.update(epoch=epoch + 1, step=step, train_loss=step_loss.item() / world)
                    if probe is not None:
                        r["probe_running_var"] = probe[1].running_var.float().mean().item()
                        r["probe_residual"] = (1 - probe[1].momentum) ** step
                    evals.append(r)
                    print(f"validation | epoch {epoch + 1} | step {step} | top-1 "
                          f"{100 * r['top1']:.2f}% | top-5 {100 * r['top5']:.2f}% | train loss "
                          f"{r['train_loss']:.4f}", flush=True)
                dist.barrier()
                eval_s += time.time() - te
                evaluated = True
        dist.all_reduce(loss_sum)
        epochs.append({"epoch": epoch + 1, "avg_loss": loss_sum.item() / world / per_epoch})
        if rank == 0:
            print(f"epoch {epoch + 1} | {per_epoch} steps | avg loss {epochs[-1]['avg_loss']:.4f}"
                  f" | {time.time() - t0:.1f} s", flush=True)
    sync()
    dist.barrier()
    seconds = time.time() - t0
    if rank == 0:
        res = {"model": a.model, "world": world, "micro_batch": micro, "steps": step,
               "steps_per_epoch": per_epoch, "warmup": warmup, "evals": evals, "epochs": epochs,
               "train_s": seconds, "eval_s": eval_s, "evaluated_at_end": evaluated,
               "probe": probe[0] if probe else None, "torch": torch.__version__,
               "torchvision": torchvision.__version__,
               "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
        print(RESULT_TAG + json.dumps(res), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The driver: jobs of both sides, tables
# ---------------------------------------------------------------------------------------------

def default_fashion_mnist():
    candidates = [os.environ.get("FASHION_MNIST", "")]
    if os.environ.get("SHARDTRAIN_DATA_DIR"):
        candidates.append(os.path.join(os.environ["SHARDTRAIN_DATA_DIR"], "fashion-mnist"))
    candidates += ["/work/main/build/data/fashion-mnist", "/usr/share/datasets/fashion-mnist"]
    for c in candidates:
        if c and os.path.exists(os.path.join(c, "train-images-idx3-ubyte.gz")):
            return c
    return candidates[-1]


def run_job(cmd, timeout, log_path, env):
    """bench_multi_gpu.run_job (cmd in its own process group, output to log_path, stopped with
    its ranks on timeout) timed: (exit code or None on timeout, the log's text, wall seconds)."""
    sys.path.insert(0, HERE)
    from bench_multi_gpu import run_job as run_logged
    t0 = time.time()
    rc, text = run_logged(cmd, timeout, log_path, env)
    return rc, text, time.time() - t0


def num(s):
    return float(s)


def shardtrain_job(a, name, model, gpus, micro, epochs, num_samples, eval_interval):
    out = os.path.join(a.workdir, name)
    a.master_port += 1  # a fresh port per job: the last job's store may linger in TIME_WAIT
    cmd = [a.shardtrain, "launch", "--nproc-per-node", str(gpus), "--master-port",
           str(a.master_port), "--comm-timeout", str(a.comm_timeout), "--", "train",
           "--model", model, "--dataset", "fashion-mnist", "--data-dir", a.fashion_mnist,
           "--image-size", str(a.image_size),
           "--device", a.device, "--strategy", "ddp", "--batch-size", str(micro),
           "--epochs", str(epochs), "--lr", str(a.lr), "--weight-decay", str(a.weight_decay),
           "--seed", str(a.seed), "--log-interval", str(eval_interval or 50), "--no-save",
           "--output-dir", out]
    if a.device == "cuda":
        cmd += ["--precision", "bf16"]
    if num_samples > 0:
        cmd += ["--num-samples", str(num_samples)]
    if a.eval_samples > 0:
        cmd += ["--eval-samples", str(a.eval_samples)]
    if eval_interval:
        cmd += ["--eval-interval", str(eval_interval)]
    rc, log, wall = run_job(cmd, a.job_timeout, os.path.join(a.workdir, name + ".log"), a.env)
    res = {"command": " ".join(cmd), "wall_s": wall, "evals": [], "epochs": []}
    step_loss = {}
    for line in log.splitlines():
        if m := VALIDATION.match(line):
            res["evals"].append({"epoch": int(m[1]), "step": int(m[2]), "val_loss": num(m[3]),
                                 "top1": num(m[4]) / 100, "top5": num(m[5]) / 100})
        elif m := STEP_LOSS.match(line):
            step_loss[int(m[2])] = num(m[3])
        elif m := EPOCH_LOSS.match(line):
            res["epochs"].append({"epoch": int(m[1]), "avg_loss": num(m[2])})
        elif m := DONE.match(line):
            res["steps"], res["train_s"] = int(m[1]), num(m[2])
    for e in res["evals"]:
        if e["step"] in step_loss:
            e["train_loss"] = step_loss[e["step"]]
    if rc != 0 or not res["evals"]:
        res["error"] = ("timed out" if rc is None else f"exit {rc}") + ": " + log[-1500:]
    return res


def torch_job(a, name, model, gpus, micro, epochs, num_samples, eval_interval):
    if not a.have_torch:
        return {"skipped": "PyTorch is not installed here"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={gpus}", os.path.abspath(__file__), "--worker", "--model", model,
           "--device", a.device, "--epochs", str(epochs), "--global-batch", str(a.global_batch),
           "--micro-batch", str(micro), "--lr", str(a.lr), "--weight-decay",
           str(a.weight_decay), "--seed", str(a.seed), "--image-size", str(a.image_size),
           "--fashion-mnist", a.fashion_mnist, "--num-samples", str(num_samples),
           "--eval-samples", str(a.eval_samples), "--eval-interval", str(eval_interval),
           "--comm-timeout", str(a.comm_timeout)]
    rc, log, wall = run_job(cmd, a.job_timeout, os.path.join(a.workdir, name + ".log"), a.env)
    tagged = [l[len(RESULT_TAG):] for l in log.splitlines() if l.startswith(RESULT_TAG)]
    if rc != 0 or not tagged:
        # the first rank's traceback, not torchrun's summary after it
        at = log.find("Traceback")
        detail = log[at:at + 3000] if at >= 0 else log[-1500:]
        print(f"PyTorch job {name} failed:\n{detail}", flush=True)
        return {"command": " ".join(cmd), "wall_s": wall,
                "error": ("timed out" if rc is None else f"exit {rc}") + ": " + detail}
    res = json.loads(tagged[-1])
    res.update(command=" ".join(cmd), wall_s=wall)
    return res


def pct(r, key="top1"):
    return f"{100 * r[key]:.2f}" if r and key in r else "—"


def parity(a, md):
    results = []
    md.append(f"## Per-epoch validation top-1: {a.gpus} GPU{'s' if a.gpus > 1 else ''}, global "
              f"batch {a.global_batch} ({a.global_batch // a.gpus} per GPU), {a.epochs} epochs\n")
    for model in a.models.split(","):
        row = {"model": model, "gpus": a.gpus, "epochs": a.epochs}
        micro = a.global_batch // a.gpus
        if "shardtrain" in a.frameworks:
            row["shardtrain"] = shardtrain_job(a, f"parity_{model}_st", model, a.gpus, micro,
                                               a.epochs, a.num_samples, 0)
        if "pytorch" in a.frameworks:
            row["pytorch"] = torch_job(a, f"parity_{model}_pt", model, a.gpus, micro, a.epochs,
                                       a.num_samples, 0)
        st, pt = row.get("shardtrain", {}), row.get("pytorch", {})
        st_by = {e["epoch"]: e for e in st.get("evals", [])}
        pt_by = {e["epoch"]: e for e in pt.get("evals", [])}
        if st_by and pt_by:
            e = max(set(st_by) & set(pt_by), default=None)
            if e is not None:
                row["final_difference"] = st_by[e]["top1"] - pt_by[e]["top1"]
        results.append(row)
        md.append(f"### {model}\n")
        md.append("| epoch | shardtrain top-1 % | PyTorch DDP top-1 % | difference (points) |")
        md.append("|---|---|---|---|")
        for e in sorted(set(st_by) | set(pt_by)):
            s, p = st_by.get(e), pt_by.get(e)
            d = f"{100 * (s['top1'] - p['top1']):+.2f}" if s and p else "—"
            md.append(f"| {e} | {pct(s)} | {pct(p)} | {d} |")
        md.append("")
        for side, r in (("shardtrain", st), ("PyTorch", pt)):
            if "error" in r or "skipped" in r:
                md.append(f"- {side}: {r.get('skipped') or r['error'][-300:]!r}")
            elif r:
                md.append(f"- {side}: final top-1 {pct(r['evals'][-1])}%, training "
                          f"{r.get('train_s', float('nan')):.1f} s, job {r['wall_s']:.1f} s")
        if "final_difference" in row:
            md.append(f"- final difference (shardtrain − PyTorch): "
                      f"{100 * row['final_difference']:+.2f} points")
        md.append("")
        print(f"{model}: shardtrain {pct(st_by.get(max(st_by, default=0)))}% "
              f"({st.get('wall_s', 0):.0f} s) | PyTorch {pct(pt_by.get(max(pt_by, default=0)))}% "
              f"({pt.get('wall_s', 0):.0f} s)" + (f" | {st.get('error', '')[-400:]}"
                                                  f"{pt.get('error', '')[-400:]}"
                                                  if "error" in st or "error" in pt else ""),
              flush=True)
    return results


def early(a, md):
    model = a.early_model
    gpus_list = sorted({int(g) for g in a.early_gpus.split(",")}) if a.early_gpus else \
        sorted({1, a.gpus})
    runs = {}
    for g in gpus_list:
        for fw in a.frameworks.split(","):
            job = shardtrain_job if fw == "shardtrain" else torch_job
            runs[(g, fw)] = job(a, f"early_{model}_{g}gpu_{fw[:2]}", model, g,
                                a.early_micro_batch, a.early_epochs, a.early_num_samples,
                                a.early_eval_interval)
            r = runs[(g, fw)]
            print(f"early {model} {g} GPU {fw}: " + (
                " ".join(f"{e['step']}:{pct(e)}" for e in r.get("evals", []))
                or r.get("skipped") or r.get("error", "")[-400:]), flush=True)
    n = a.early_num_samples
    md.append(f"## Validation in the first steps: {model}, the first {n} training images, "
              f"micro-batch {a.early_micro_batch} per GPU, {a.early_epochs} epochs\n")
    md.append("Top-1 % on the test set every "
              f"{a.early_eval_interval} optimizer steps (e = epoch of that step). Steps per epoch: "
              + ", ".join(f"{g} GPU{'s' if g > 1 else ''}: "
                          f"{n // (a.early_micro_batch * g)}" for g in gpus_list)
              + ". PyTorch's running variance of the last depthwise batch norm (mean over its "
              "channels) beside 0.9^step, what remains of its initial value 1.\n")
    cols = [(g, fw) for g in gpus_list for fw in a.frameworks.split(",")]
    head = "| step | " + " | ".join(
        f"{g} GPU {'shardtrain' if fw == 'shardtrain' else 'PyTorch'} (e)" for g, fw in cols)
    probes = [g for g in gpus_list if runs.get((g, "pytorch"), {}).get("probe")]
    head += "".join(f" | PyTorch {g} GPU running var" for g in probes) + " | 0.9^step |"
    md.append(head)
    md.append("|---" * (head.count("|") - 1) + "|")
    by = {k: {e["step"]: e for e in r.get("evals", [])} for k, r in runs.items()}
    for s in sorted(set().union(*[set(v) for v in by.values()]) if by else []):
        cells = []
        for k in cols:
            e = by[k].get(s)
            cells.append(f"{pct(e)} (e{e['epoch']})" if e else "")
        for g in probes:
            e = by[(g, "pytorch")].get(s)
            cells.append(f"{e['probe_running_var']:.3g}" if e and "probe_running_var" in e else "")
        md.append(f"| {s} | " + " | ".join(cells) + f" | {0.9 ** s:.3g} |")
    md.append("")
    for k, r in runs.items():
        if "error" in r or "skipped" in r:
            md.append(f"- {k[0]} GPU {k[1]}: {r.get('skipped') or r['error'][-300:]!r}")
    md.append("")
    return [{"gpus": g, "framework": fw, **r} for (g, fw), r in runs.items()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="(internal) one PyTorch rank")
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--gpus", type=int, default=2, help="N: GPUs (or CPU ranks) of both sides")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--phases", default="parity,early")
    ap.add_argument("--models", default="cnn,mobilenet_v2")
    ap.add_argument("--model", default="", help="(worker) the model of this PyTorch job")
    ap.add_argument("--frameworks", default="shardtrain,pytorch")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="(worker) per-rank batch; 0 = global batch / ranks")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--num-samples", type=int, default=-1, help="first N training images")
    ap.add_argument("--eval-samples", type=int, default=-1, help="first N test images")
    ap.add_argument("--eval-interval", type=int, default=0,
                    help="(worker) steps between validations; 0 = after every epoch")
    ap.add_argument("--early-model", default="mobilenet_v2")
    ap.add_argument("--early-gpus", default="", help="GPU counts of phase early (default 1,N)")
    ap.add_argument("--early-num-samples", type=int, default=3584)
    ap.add_argument("--early-micro-batch", type=int, default=64)
    ap.add_argument("--early-epochs", type=int, default=8)
    ap.add_argument("--early-eval-interval", type=int, default=14)
    ap.add_argument("--fashion-mnist", default=default_fashion_mnist(),
                    help="directory of the four .gz IDX files, read by both sides (default: "
                         "$FASHION_MNIST, $SHARDTRAIN_DATA_DIR/fashion-mnist, "
                         "/work/main/build/data/fashion-mnist, /usr/share/datasets/fashion-mnist: "
                         "the first that holds them)")
    ap.add_argument("--master-port", type=int, default=29620, help="shardtrain launch's store")
    ap.add_argument("--comm-timeout", type=int, default=120)
    ap.add_argument("--job-timeout", type=int, default=420, help="seconds per job")
    ap.add_argument("--workdir", default="/tmp/image_accuracy_multi_gpu")
    ap.add_argument("--out", default="image_accuracy_multi_gpu.json")
    ap.add_argument("--markdown", default="image_accuracy_multi_gpu.md")
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    os.makedirs(a.workdir, exist_ok=True)
    a.have_torch = importlib.util.find_spec("torch") is not None
    a.env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    a.env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    a.env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if a.device == "cpu":
        a.env.setdefault("OMP_NUM_THREADS", "1")
    info = {"gpus": a.gpus, "device": a.device, "shardtrain": a.shardtrain,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "recipe": {"global_batch": a.global_batch, "lr": a.lr, "weight_decay": a.weight_decay,
                       "seed": a.seed, "image_size": a.image_size, "epochs": a.epochs}}
    print(json.dumps(info), flush=True)
    md = ["# Image models on several GPUs: shardtrain ddp against PyTorch DDP, same recipe\n"]
    t0 = time.time()
    out = {"info": info}
    phases = a.phases.split(",")
    if "parity" in phases:
        out["parity"] = parity(a, md)
    if "early" in phases:
        out["early"] = early(a, md)
    for r in out.get("parity", []) + out.get("early", []):
        for side in (r.get("pytorch"), r if "torch" in r else None):
            if side and "torch" in side:
                info.update(gpu=side["gpu"], torch=side["torch"], torchvision=side["torchvision"])
    info["total_s"] = time.time() - t0
    md.insert(1, f"{info.get('gpu', a.device)} × {a.gpus}, PyTorch {info.get('torch', '—')}, "
                 f"torchvision {info.get('torchvision', '—')}, {info['date']}; all jobs "
                 f"{info['total_s']:.0f} s.\n")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    with open(a.markdown, "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md), flush=True)


if __name__ == "__main__":
    main()
