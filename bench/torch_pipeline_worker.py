#!/usr/bin/env python3
"""One rank of the PyTorch side of bench/bench_pipeline_gpus.py; start it with torchrun:

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/torch_pipeline_worker.py \
        --schedule 1f1b --model gpt2-xl --micro-batch 4 --seq 512 --micro-batches 8 --steps 6 --warmup 2

A pipeline of P = world size ranks over torch.distributed.pipelining, with stage modules cut by
hand (no tracing) from the same GPT-2 as bench/torch_dist_worker.py builds (shardtrain's preset
shapes, transformers' GPT2 blocks with SDPA, dropout 0, fp32 parameters, bf16 autocast on cuda,
fused AdamW lr 1e-4, random tokens):

- V virtual stages per rank: 1 for gpipe (ScheduleGPipe) and 1f1b (Schedule1F1B), 2 for
  interleaved-1f1b (ScheduleInterleaved1F1B) and zb (ScheduleInterleavedZeroBubble, the closest
  torch schedule to shardtrain's zb-h1, not the same one). The L blocks are cut into P·V
  contiguous chunks of L / (P·V) blocks (uniform, as shardtrain's interleaved partition); chunk 0
  also holds wte + wpe, the last chunk ln_f + the LM head. Rank r holds chunks r, r + P, ...
  (torch's "loop" placement, which its Interleaved schedules expect).
- The LM head's weight is a copy of wte, NOT tied to it: the first and last chunk each own and
  update their own (one vocab × n_embd matrix more in the parameter count). shardtrain ties them
  and sends the head's wte gradient to stage 0, adding it to the embedding's, every step.
- Loss: cross-entropy over the vocabulary, the mean over the micro-batch's tokens, as the
  schedule's loss_fn; the schedule sums the micro-batches' gradients and (scale_grads, its
  default) divides them by M, so the gradient is that of the mean over the step's tokens.
- Each step: schedule.step(inputs on the first stage's rank, target on the last's),
  gradient clipping to a global L2 norm of 1.0 (one all-reduce of the stages' squared norms),
  optimizer.step(), zero_grad. step(return_outputs=False) where torch has it (2.11 and 2.15
  do): the last stage does not concatenate the micro-batches' logits into an unused output.
  Activations cross stages in fp32 (the residual stream under autocast stays fp32, as in DDP +
  autocast).

The step's batch is M × --micro-batch sequences of --seq tokens. The first --warmup steps are not
timed; the timed steps run between torch.cuda.synchronize + barrier. Rank 0 prints one line
"BENCH_RESULT {json}": tokens_per_s (all tokens of the timed steps / their seconds), per_gpu
(÷ world), peak_allocated_per_stage / peak_reserved_per_stage (bytes, torch.cuda.max_memory_*
of each rank, rank = stage index of its first chunk), params_per_rank, last_loss (mean of the
last step's micro-batch losses, from the last stage), step_time_s.
--device cpu: gloo, fp32, no autocast (a smoke test of the script); peaks are then each process's
peak resident set (bytes).
"""
import argparse
import inspect
import json
import os
import resource
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_dist_worker import (RESULT_TAG, SHAPES, VOCAB, StepClock, build_model,  # noqa: E402
                               init_process_group)

# schedule -> (torch.distributed.pipelining class name, virtual stages per rank)
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
             "zb": ("ScheduleInterleavedZeroBubble", 2)}


class Chunk(nn.Module):
    """Blocks [lo, hi) of a GPT2LMHeadModel; the first chunk adds wte + wpe, the last ln_f and an
    untied copy of the LM head. forward(token ids or hidden states) -> hidden states or logits,
    fp32."""

    def __init__(self, model, lo, hi, first, last, autocast):
        super().__init__()
        t = model.transformer
        self.first, self.last, self.autocast = first, last, autocast
        self.wte = t.wte if first else None
        self.wpe = t.wpe if first else None
        self.blocks = nn.ModuleList(t.h[lo:hi])
        self.ln_f = t.ln_f if last else None
        if last:  # untied: its own parameter, initialised from wte
            self.head = nn.Linear(t.wte.weight.shape[1], t.wte.weight.shape[0], bias=False,
                                  device=t.wte.weight.device)
            with torch.no_grad():
                self.head.weight.copy_(t.wte.weight)
        else:
            self.head = None

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            if self.first:
                pos = torch.arange(x.shape[1], device=x.device)
                h = self.wte(x) + self.wpe(pos)
            else:
                h = x
            for b in self.blocks:
                out = b(h)
                h = out[0] if isinstance(out, tuple) else out
            if self.last:
                h = self.head(self.ln_f(h))
        # fp32 out: what shape inference (run on meta tensors, which autocast leaves alone in some
        # torch versions) expects; the loss takes the logits in fp32 anyway
        return h.float()


def loss_fn(logits, target):
    """Mean cross-entropy over the micro-batch's tokens (fp32 logits)."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       target.reshape(-1))


def clip_grad_norm_across_stages(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ over the parameters of all ranks (stages): one all-reduce of
    the squared norms. Returns the global norm (a tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    dev = grads[0].device if grads else next(iter(params)).device
    sq = (torch.stack(torch._foreach_norm(grads)).float().pow(2).sum() if grads
          else torch.zeros((), device=dev))
    dist.all_reduce(sq)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
    ap.add_argument("--model", default="gpt2-xl", choices=sorted(SHAPES))
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--micro-batches", type=int, default=8, help="M: micro-batches per step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--comm-timeout", type=float, default=120,
                    help="seconds a collective or transfer may hang before the job fails")
    ap.add_argument("--no-clip", action="store_true", help="skip the gradient clipping")
    a = ap.parse_args()
    if not 0 <= a.warmup < a.steps:
        ap.error("need 0 <= --warmup < --steps")

    import torch.distributed.pipelining as pp
    cls_name, V = SCHEDULES[a.schedule]
    cuda = a.device == "cuda"
    device, rank, P = init_process_group(a.device, a.comm_timeout)
    n_chunks = P * V
    L = SHAPES[a.model][0]
    if L % n_chunks:
        ap.error(f"{a.model}'s {L} blocks do not cut into {n_chunks} equal chunks")
    per = L // n_chunks

    model = build_model(a.model, device)
    chunk_ids = [rank + i * P for i in range(V)]  # the loop placement
    chunks = [Chunk(model, c * per, (c + 1) * per, c == 0, c == n_chunks - 1, cuda)
              for c in chunk_ids]
    del model  # the blocks of other ranks' chunks go with it
    if cuda:
        torch.cuda.empty_cache()
    params = [p for c in chunks for p in c.parameters()]
    n_params = sum(p.numel() for p in params)
    stages = [pp.PipelineStage(c, c_id, n_chunks, device) for c, c_id in zip(chunks, chunk_ids)]
    cls = getattr(pp, cls_name)
    kw = {"loss_fn": loss_fn}
    if "scale_grads" in inspect.signature(cls.__init__).parameters:
        kw["scale_grads"] = True  # the default where it exists: gradient of the mean over M
    sched = cls(stages[0] if V == 1 else stages, a.micro_batches, **kw)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    # the last stage would otherwise concatenate the M micro-batches' logits (M × batch × seq ×
    # vocab fp32) into one output tensor every step, which this benchmark does not use
    step_kw = ({"return_outputs": False}
               if "return_outputs" in inspect.signature(sched.step).parameters else {})

    has_first, has_last = 0 in chunk_ids, n_chunks - 1 in chunk_ids
    g = torch.Generator(device="cpu").manual_seed(1234)  # the same tokens on every rank
    B = a.micro_batches * a.micro_batch
    data = torch.randint(0, VOCAB, (a.steps, B, a.seq + 1), generator=g).to(device)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    last_loss = float("nan")
    clock = StepClock(a.steps, a.warmup, sync)
    for s in clock:
        # contiguous: torch 2.11 checks the micro-batches' strides against shape inference's
        x, y = data[s, :, :-1].contiguous(), data[s, :, 1:].contiguous()
        args = (x,) if has_first else ()
        losses = [] if has_last else None
        kwargs = {"target": y, "losses": losses} if has_last else {}
        kwargs.update(step_kw)
        sched.step(*args, **kwargs)
        if not a.no_clip:
            clip_grad_norm_across_stages(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if has_last and s == a.steps - 1:
            last_loss = torch.stack([l.detach().float() for l in losses]).mean().item()
    dt = clock.timed_s

    if cuda:
        mem = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
    else:  # peak resident set of the process (kilobytes on Linux)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        mem = [rss, rss]
    mine = torch.tensor([*mem, n_params, last_loss], device=device, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(P)]
    dist.all_gather(every, mine)
    every = [t.tolist() for t in every]
    if rank == 0:
        import transformers
        timed = a.steps - a.warmup
        tok = timed * B * a.seq / dt
        print(RESULT_TAG + json.dumps({
            "schedule": a.schedule, "torch_schedule": cls_name, "virtual_stages": V,
            "micro_batches": a.micro_batches, "micro_batch": a.micro_batch, "seq": a.seq,
            "tokens_per_s": tok, "per_gpu": tok / P, "world": P,
            "params_per_rank": [int(e[2]) for e in every], "params": int(sum(e[2] for e in every)),
            "untied_head_params": VOCAB * SHAPES[a.model][2],
            "peak_allocated_per_stage": [int(e[0]) for e in every],
            "peak_reserved_per_stage": [int(e[1]) for e in every],
            "peak_allocated": int(max(e[0] for e in every)),
            "peak_kind": "device" if cuda else "cpu_rss",
            "last_loss": next(e[3] for e in every if e[3] == e[3]),  # the last stage's rank
            "grad_clip": None if a.no_clip else 1.0, "lm_head_tied": False,
            "timed_steps": timed, "timed_s": dt, "step_time_s": dt / timed,
            "total_s": clock.total_s,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu"}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
