#!/usr/bin/env python3
"""One rank of the PyTorch side of bench/bench_multi_gpu.py's `image` suite: data-parallel
training speed of a torchvision image classifier. Start it with torchrun:

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/torch_image_worker.py \
        --model mobilenet_v2 --size 224 --batch 64 --channels 3 --classes 1000 \
        --steps 30 --warmup 10

The model is bench/bench_image_models.py's `build` (torchvision's, default dropout, the first
convolution re-made for 1 channel when --channels 1), fp32 weights, channels_last, bf16 autocast,
torch.optim.AdamW(fused=True) (weight decay 0.01 on conv/linear weights only), wrapped in
DistributedDataParallel (25 MiB buckets, broadcast_buffers on: PyTorch's defaults); each rank
trains on one random batch of --batch images already on its GPU (no data pipeline), the same every
step. The first --warmup steps are not timed; the timed ones run between torch.cuda.synchronize +
barrier. Rank 0 prints one line "BENCH_RESULT {json}": images_per_s (all ranks), per_gpu,
params, peak memory (max over ranks of torch.cuda.max_memory_allocated / reserved).
--device cpu (gloo, foreach AdamW) is a smoke test of the script; peaks are then resident sets.
"""
import argparse
import json
import os
import resource
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_dist_worker import RESULT_TAG, StepClock, init_process_group  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--size", type=int, default=32, help="image side in pixels")
    ap.add_argument("--batch", type=int, default=256, help="micro-batch per GPU")
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--comm-timeout", type=float, default=120)
    a = ap.parse_args()
    if not 0 <= a.warmup < a.steps:
        ap.error("need 0 <= --warmup < --steps")
    import bench_image_models as bim  # torchvision and the cnn twins

    cuda = a.device == "cuda"
    dev, rank, world = init_process_group(a.device, a.comm_timeout)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    torch.manual_seed(0)
    model = bim.build(a.model, a.channels, a.classes, a.size).to(dev)
    model = model.to(memory_format=torch.channels_last)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(bim.decay_groups(model, 0.01), lr=1e-3,
                            **({"fused": True} if cuda else {"foreach": True}))
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, device_ids=[dev.index] if cuda else None)
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    x = torch.randn(a.batch, a.channels, a.size, a.size, generator=g).to(dev)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, a.classes, (a.batch,), generator=g).to(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first_loss = None
    clock = StepClock(a.steps, a.warmup, sync)
    for s in clock:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s == 0:
            first_loss = loss.item()
    last_loss = loss.item()
    if cuda:
        mem = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
    else:  # peak resident set of the process (kilobytes on Linux)
        mem = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024] * 2
    peak = torch.tensor(mem, device=dev, dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        import torchvision
        timed = a.steps - a.warmup
        rate = timed * a.batch * world / clock.timed_s
        print(RESULT_TAG + json.dumps({
            "images_per_s": rate, "per_gpu": rate / world, "world": world, "params": n_params,
            "peak_allocated": int(peak[0].item()), "peak_reserved": int(peak[1].item()),
            "timed_steps": timed, "timed_s": clock.timed_s, "step_ms": 1e3 * clock.timed_s / timed,
            "first_loss": first_loss, "last_loss": last_loss, "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "device_name": torch.cuda.get_device_name(dev) if cuda else "cpu"}), flush=True)
    # DDP's reducer freed after the process group could hang in its destructor (seen with gloo)
    del ddp, opt, model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
