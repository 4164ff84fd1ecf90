#!/usr/bin/env python3
"""One rank of DeepSpeed ZeRO-3 with CPU offload training a GPT-2 shape: the DeepSpeed peer of
shardtrain's offloaded rows (docs/BENCHMARKS.md, "Offloaded steps at the batch a user picks").

    python3 bench/deepspeed_worker.py --shape 63,24,3072 --batch 4 --grad-accum 8 --seq 512 \
        --steps 4 --warmup 1
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/deepspeed_worker.py ...

What it trains: transformers GPT2LMHeadModel (SDPA attention) of --shape L,H,C (or a --model
preset), built in bf16 on the host with GPT-2's initialization and partitioned by
deepspeed.initialize; ZeRO stage 3 with offload_param and offload_optimizer "cpu" (pinned),
bf16, AdamW (lr 1e-5, no weight decay) stepped on the CPU by DeepSpeedCPUAdam (compiled just in
time on first use: needs g++, ninja and Python.h) or, with --cpu-adam torch, torch.optim.AdamW
on the host parameters (zero_force_ds_cpu_optimizer off); gradient clipping 1.0; activation
checkpointing (Hugging Face gradient checkpointing) unless --no-checkpointing; random tokens;
the loss is cross-entropy over the fp32 logits. Micro-batches of --batch x --seq tokens,
--grad-accum of them per optimizer step.

The first --warmup steps are not timed. Rank 0 prints one line "BENCH_RESULT {json}" as
bench/torch_dist_worker.py does: tokens/s (all ranks and per GPU), the step time, peak GPU
memory (max over ranks), rank 0's peak resident set (host bytes), the losses and versions.
Install DeepSpeed without a network from its sdist: `DS_BUILD_OPS=0 pip install --no-deps
--no-build-isolation deepspeed-X.tar.gz` plus wheels of its requirements (hjson, pydantic,
pydantic-core, annotated-types, typing-inspection, typing-extensions, ninja, psutil,
py-cpuinfo, msgpack, einops, nvidia-ml-py).
"""
import argparse
import json
import os
import resource
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_dist_worker import (CONTEXT, RESULT_TAG, SHAPES, VOCAB, StepClock,  # noqa: E402
                               init_process_group)


def ds_config(a):
    """The DeepSpeed JSON of the run: ZeRO-3, parameters and optimizer state offloaded to the
    host (pinned), bf16, clipping 1.0; DeepSpeed's defaults for everything else."""
    cfg = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": a.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if a.cpu_adam == "ds":
        cfg["optimizer"] = {"type": "AdamW", "params": {
            "lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}
    else:
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-medium", choices=sorted(SHAPES))
    ap.add_argument("--shape", default=None,
                    help="n_layer,n_head,n_embd: train this shape instead of --model's")
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per GPU")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps")
    ap.add_argument("--no-checkpointing", action="store_true",
                    help="keep every block's activations instead of recomputing them")
    ap.add_argument("--cpu-adam", choices=["ds", "torch"], default="ds",
                    help="ds: DeepSpeedCPUAdam (default); torch: torch.optim.AdamW on the host")
    ap.add_argument("--comm-timeout", type=float, default=600)
    a = ap.parse_args()
    if not 0 <= a.warmup < a.steps:
        ap.error("need 0 <= --warmup < --steps")
    L, H, C = tuple(int(x) for x in a.shape.split(",")) if a.shape else SHAPES[a.model]

    import deepspeed
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    device, rank, world = init_process_group("cuda", a.comm_timeout)
    cfg = ds_config(a)
    gcfg = GPT2Config(n_layer=L, n_head=H, n_embd=C, vocab_size=VOCAB, n_positions=CONTEXT,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    # Built whole in bf16 on the host, with GPT-2's initialization (N(0, 0.02), the residual
    # projections scaled by 1/sqrt(2L)); deepspeed.initialize then partitions it and moves the
    # partitions to pinned host memory. (Under deepspeed.zero.Init each parameter would be
    # partitioned as it is made and transformers' initialization would see empty partitions,
    # leaving PyTorch's module defaults: an N(0, 1) embedding and a first loss near 300.)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cpu"):
            model = GPT2LMHeadModel._from_config(gcfg, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to(torch.bfloat16)
    if not a.no_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    opt = None
    if a.cpu_adam == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, foreach=True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           optimizer=opt, config=cfg)

    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    torch.cuda.reset_peak_memory_stats()
    first_loss = loss = None
    clock = StepClock(a.steps, a.warmup, torch.cuda.synchronize)
    for s in clock:
        for _ in range(a.grad_accum):
            data = torch.randint(0, VOCAB, (a.batch, a.seq + 1), generator=g).to(device)
            logits = engine(input_ids=data[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), data[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()  # an optimizer step at the accumulation boundary
        if s == 0:
            first_loss = loss.item()
        if rank == 0:
            print(f"step {s + 1}/{a.steps} loss {loss.item():.4f}", flush=True)
    dt = clock.timed_s
    peak = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
                        device=device, dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        timed = a.steps - a.warmup
        tok = timed * a.grad_accum * a.batch * a.seq * world / dt
        print(RESULT_TAG + json.dumps({
            "peer": "deepspeed-zero3-offload", "tokens_per_s": tok, "per_gpu": tok / world,
            "world": world, "params": n_params, "shape": [L, H, C],
            "peak_allocated": int(peak[0].item()), "peak_reserved": int(peak[1].item()),
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "timed_steps": timed, "timed_s": dt, "total_s": clock.total_s,
            "step_time_s": dt / timed, "grad_accum": a.grad_accum, "batch": a.batch,
            "seq": a.seq, "checkpointing": not a.no_checkpointing, "cpu_adam": a.cpu_adam,
            "first_loss": first_loss, "last_loss": loss.item(),
            "deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device_name": torch.cuda.get_device_name(device)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
