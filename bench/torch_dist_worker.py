#!/usr/bin/env python3
"""One rank of the PyTorch side of bench/bench_multi_gpu.py; start it with torchrun:

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/torch_dist_worker.py \
        --strategy fsdp2 --model gpt2-medium --batch 4 --seq 512 --steps 30 --warmup 10
        [--grad-accum N]

Strategies, matching shardtrain's: ddp (DistributedDataParallel, 25 MiB buckets) ~ dp;
zero (DDP + torch.distributed.optim.ZeroRedundancyOptimizer) ~ zero1; fsdp2 (fully_shard per
block and at the root, reshard_after_forward=False: parameters stay gathered between forward and
backward, gradients and optimizer state sharded) ~ zero2; with --reshard-after-forward, fsdp2
frees each block's gathered parameters after its forward and gathers them again in backward
~ zero3 (bench/bench_zero3_single_gpu.py); with --hsdp-shard-size K, fsdp2 over a 2-D device
mesh (HSDP: sharded within groups of K ranks, replicated across them) ~ zero3 with
--zero-hpz-partition-size K; with --cpu-offload, fsdp2 keeps the sharded fp32
parameters, their gradients and the AdamW state in pinned host memory (CPUOffloadPolicy(pin_memory=
True)) and AdamW steps on the CPU ~ shardtrain's offload (bench/bench_offload.py); "cpu_step_ms" is
then the host time of opt.step() per step. --shape L,H,C trains a GPT-2 of that shape instead of a
preset (bench_offload.py --largest). transformers GPT2LMHeadModel with SDPA, fp32
parameters, bf16 compute (autocast for ddp/zero, MixedPrecisionPolicy for fsdp2), AdamW (--adamw:
fused, foreach, or auto = fused with a fall back to foreach if fused fails on fsdp2's DTensors),
clipping 1.0, random tokens. The first --warmup steps are not timed ("timed_s"); "total_s" times
all --steps (an epoch, for the tutorial row).

Without torchrun (one process), the rendezvous variables default to a world of one on localhost
(MASTER_ADDR 127.0.0.1, MASTER_PORT 29500 or as set, RANK 0, WORLD_SIZE 1, LOCAL_RANK 0).

Rank 0 prints one line "BENCH_RESULT {json}": tokens/s of the whole job (all ranks) and per GPU,
peak memory (max over ranks of torch.cuda.max_memory_allocated / max_memory_reserved, and rank
0's, which is what shardtrain's metrics report).
--device cpu (smoke test of the script, gloo backend) reports the peak resident set instead.
"""
import argparse
import json
import os
import resource
import time
from datetime import timedelta

import torch
import torch.distributed as dist

SHAPES = {  # n_layer, n_head, n_embd: shardtrain's presets (src/model/gpt2_config.cpp)
    "gpt2-micro": (2, 2, 64),
    "gpt2-tiny": (4, 4, 128),
    "gpt2-mini": (6, 6, 384),
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}
VOCAB, CONTEXT = 50257, 1024
RESULT_TAG = "BENCH_RESULT "


class StepClock:
    """Step indices 0..steps-1 with the time of those from `warmup` on: iterating synchronizes the
    device (`sync`) and all ranks (a barrier) before step `warmup` and after the last step.
    Afterwards `timed_s` is the seconds of the timed steps and `total_s` of all of them."""

    def __init__(self, steps, warmup, sync):
        self.steps, self.warmup, self.sync = steps, warmup, sync
        self.timed_s = self.total_s = None

    def __iter__(self):
        self.sync()
        t_all = t0 = time.perf_counter()
        for s in range(self.steps):
            if s == self.warmup:
                self.sync()
                dist.barrier()
                t0 = time.perf_counter()
            yield s
        self.sync()
        dist.barrier()
        t_end = time.perf_counter()
        self.timed_s, self.total_s = t_end - t0, t_end - t_all



def init_process_group(device, comm_timeout, port="29500"):
    """Joins this worker's torch.distributed process group: NCCL on GPU LOCAL_RANK (set before
    the group, as NCCL binds it) for device "cuda", gloo for "cpu". Started without torchrun it
    is a world of one (MASTER_ADDR 127.0.0.1, MASTER_PORT `port`, RANK 0, WORLD_SIZE 1 unless
    set). Returns (torch.device, rank, world size)."""
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    timeout = timedelta(seconds=comm_timeout)
    if device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev, timeout=timeout)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dev, dist.get_rank(), dist.get_world_size()

def build_model(model_name, device, shape=None):
    from transformers import GPT2Config, GPT2LMHeadModel
    L, H, C = shape or SHAPES[model_name]
    cfg = GPT2Config(n_layer=L, n_head=H, n_embd=C, vocab_size=VOCAB, n_positions=CONTEXT,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    with device:  # initialise on the target device (fast for gpt2-xl)
        try:  # transformers >= 4.36 takes the attention implementation at construction
            model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
        except (TypeError, ValueError):
            cfg._attn_implementation = "sdpa"
            model = GPT2LMHeadModel(cfg)
    model = model.to(device=device, dtype=torch.float32)  # fp32 master weights, as shardtrain
    attn = getattr(model.config, "_attn_implementation", None)
    assert attn == "sdpa", f"attention implementation is {attn}, not sdpa"
    model.train()
    return model


def fully_shard_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return MixedPrecisionPolicy, fully_shard


def cpu_offload_policy():
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import CPUOffloadPolicy
    return CPUOffloadPolicy(pin_memory=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", choices=["ddp", "zero", "fsdp2"], required=True)
    ap.add_argument("--model", default="gpt2-medium", choices=sorted(SHAPES))
    ap.add_argument("--shape", default=None,
                    help="n_layer,n_head,n_embd: train this shape instead of --model's")
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per GPU")
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="micro-batches per optimizer step (gradient accumulation; each loss / N)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--comm-timeout", type=float, default=120,
                    help="seconds a collective may hang before the job fails")
    ap.add_argument("--hsdp-shard-size", type=int, default=0,
                    help="fsdp2: shard within groups of this many consecutive ranks and "
                         "replicate across them (HSDP: a 2-D device mesh, replicate × shard); "
                         "0: shard over every rank")
    ap.add_argument("--reshard-after-forward", action="store_true",
                    help="fsdp2: reshard_after_forward=True on every block (ZeRO-3) instead of False")
    ap.add_argument("--cpu-offload", action="store_true",
                    help="fsdp2: CPUOffloadPolicy(pin_memory=True): parameters, gradients and "
                         "AdamW state on the host, the optimizer step on the CPU")
    ap.add_argument("--adamw", choices=["auto", "fused", "foreach"], default="auto",
                    help="AdamW implementation; auto: fused, foreach if fused fails (default)")
    a = ap.parse_args()
    if not 0 <= a.warmup < a.steps:
        ap.error("need 0 <= --warmup < --steps")
    if a.hsdp_shard_size and a.strategy != "fsdp2":
        ap.error("--hsdp-shard-size needs --strategy fsdp2")
    if a.cpu_offload and a.strategy != "fsdp2":
        ap.error("--cpu-offload needs --strategy fsdp2")
    shape = tuple(int(x) for x in a.shape.split(",")) if a.shape else None
    if shape is not None and len(shape) != 3:
        ap.error("--shape: n_layer,n_head,n_embd")

    cuda = a.device == "cuda"
    device, rank, world = init_process_group(a.device, a.comm_timeout)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    model = build_model(a.model, device, shape)
    n_params = sum(p.numel() for p in model.parameters())  # tied wte/lm_head counted once
    autocast = True
    adamw = "foreach" if a.adamw == "foreach" else "fused"

    def make_adamw(params, impl):
        return torch.optim.AdamW(params, lr=1e-4, **{impl: True})

    if a.strategy == "fsdp2":
        MixedPrecisionPolicy, fully_shard = fully_shard_api()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        extra = {"offload_policy": cpu_offload_policy()} if a.cpu_offload else {}
        if a.hsdp_shard_size and a.hsdp_shard_size < world:
            from torch.distributed.device_mesh import init_device_mesh
            if world % a.hsdp_shard_size:
                ap.error(f"--hsdp-shard-size {a.hsdp_shard_size} does not divide {world} ranks")
            extra["mesh"] = init_device_mesh(
                device.type, (world // a.hsdp_shard_size, a.hsdp_shard_size),
                mesh_dim_names=("replicate", "shard"))
        for block in model.transformer.h:
            fully_shard(block, mp_policy=mp, reshard_after_forward=a.reshard_after_forward, **extra)
        # the root's parameters (embeddings, final LayerNorm, tied LM head) are used first in
        # backward; FSDP2 keeps the root's gathered after forward whatever is asked here
        fully_shard(model, mp_policy=mp, reshard_after_forward=a.reshard_after_forward, **extra)
        train_model, autocast = model, False
        try:
            opt = make_adamw(model.parameters(), adamw)
        except (RuntimeError, TypeError, ValueError) as e:
            if a.adamw != "auto":
                raise
            print(f"fused AdamW refused on DTensor parameters ({e!r:.200}); using foreach", flush=True)
            adamw = "foreach"
            opt = make_adamw(model.parameters(), adamw)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        train_model = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=25)
        if a.strategy == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=1e-4, fused=True)
        else:
            opt = make_adamw(model.parameters(), adamw)

    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    data = torch.randint(0, VOCAB, (a.steps, a.grad_accum, a.batch, a.seq + 1),
                         generator=g).to(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first_loss = last_loss = None
    opt_s = 0.0  # host time of opt.step() over the timed steps
    clock = StepClock(a.steps, a.warmup, sync)
    for s in clock:
        for k in range(a.grad_accum):
            x, y = data[s, k, :, :-1], data[s, k, :, 1:]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = train_model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                     y.reshape(-1))
            (loss / a.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if s == 0 and a.adamw == "auto" and a.strategy == "fsdp2":
            try:  # fused AdamW on DTensors: if it fails it fails in the first step
                opt.step()
            except (RuntimeError, NotImplementedError) as e:
                print(f"fused AdamW failed on DTensor parameters ({e!r:.200}); using foreach",
                      flush=True)
                adamw = "foreach"
                opt = make_adamw(model.parameters(), adamw)
                opt.step()
        else:
            t_opt = time.perf_counter()
            opt.step()
            if s >= a.warmup:
                opt_s += time.perf_counter() - t_opt
        opt.zero_grad(set_to_none=True)
        if s == 0:
            first_loss = loss.item()
    dt = clock.timed_s
    last_loss = loss.item()

    if cuda:
        mem = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
    else:  # peak resident set of the process (kilobytes on Linux)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        mem = [rss, rss]
    host_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident set
    peak = torch.tensor(mem, device=device, dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        import transformers
        tok = (a.steps - a.warmup) * a.grad_accum * a.batch * a.seq * world / dt
        print(RESULT_TAG + json.dumps({
            "tokens_per_s": tok, "per_gpu": tok / world, "world": world, "params": n_params,
            "peak_allocated": int(peak[0].item()), "peak_reserved": int(peak[1].item()),
            "peak_allocated_rank0": int(mem[0]), "peak_reserved_rank0": int(mem[1]),
            "peak_kind": "device" if cuda else "cpu_rss",
            "timed_steps": a.steps - a.warmup, "timed_s": dt, "total_s": clock.total_s,
            "grad_accum": a.grad_accum,
            "adamw": adamw, "reshard_after_forward": a.reshard_after_forward,
            "cpu_offload": a.cpu_offload, "host_peak_rss_bytes": host_rss,
            "opt_step_ms": 1e3 * opt_s / (a.steps - a.warmup),
            "cpu_step_ms": 1e3 * opt_s / (a.steps - a.warmup) if a.cpu_offload else None,
            "step_time_s": dt / (a.steps - a.warmup),
            "first_loss": first_loss, "last_loss": last_loss,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu"}), flush=True)
    dist.barrier()  # no rank tears down while rank 0 still reports (gloo aborted in teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
