#!/usr/bin/env python3
"""One rank of the PyTorch side of bench/bench_multi_gpu.py (start it with torchrun).

Strategies, matching shardtrain's: ddp (DistributedDataParallel, 25 MiB buckets) ~ dp;
zero (DDP + torch.distributed.optim.ZeroRedundancyOptimizer) ~ zero1; fsdp2 (fully_shard per
block and at the root, reshard_after_forward=False: parameters stay gathered between forward and
backward, gradients and optimizer state sharded) ~ zero2. transformers GPT2LMHeadModel with SDPA,
bf16 (autocast for ddp/zero, MixedPrecisionPolicy for fsdp2), fused AdamW, clipping 1.0.
Rank 0 prints one JSON line: tokens/s over all ranks (steady state), peak memory (max over ranks).
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

SHAPES = {"gpt2-medium": (24, 16, 1024), "gpt2-xl": (48, 25, 1600)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["ddp", "zero", "fsdp2"], required=True)
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    from transformers import GPT2Config, GPT2LMHeadModel
    L, H, C = SHAPES[a.model]
    cfg = GPT2Config(n_layer=L, n_head=H, n_embd=C, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    try:
        model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").cuda()
    except (TypeError, ValueError):
        cfg._attn_implementation = "sdpa"
        model = GPT2LMHeadModel(cfg).cuda()
    autocast = True
    if a.strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=mp, reshard_after_forward=False)
        fully_shard(model, mp_policy=mp, reshard_after_forward=False)
        train_model, autocast = model, False
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        train_model = DDP(model, bucket_cap_mb=25)
        if a.strategy == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=1e-4, fused=True)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = torch.randint(0, 50257, (a.steps, a.batch, a.seq + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for s in range(a.steps):
        if s == a.warmup:
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.time()
        x, y = data[s, :, :-1], data[s, :, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = train_model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dist.barrier()
    dt = time.time() - t0
    peak = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
                        device="cuda", dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        tok = (a.steps - a.warmup) * a.batch * a.seq * world / dt
        print(json.dumps({"tokens_per_s": tok, "per_gpu": tok / world, "peak_allocated": peak[0].item(),
                          "peak_reserved": peak[1].item(), "world": world}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
