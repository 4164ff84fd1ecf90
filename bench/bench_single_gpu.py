#!/usr/bin/env python3
"""Single-GPU training benchmark: shardtrain vs PyTorch + transformers on identical shapes.

For each case it trains a fixed number of optimizer steps with
  * shardtrain (`shardtrain train --device cuda`, bf16 compute, fp32 master weights + AdamW),
  * PyTorch eager: transformers GPT2LMHeadModel (SDPA attention), fp32 weights, bf16 autocast,
    torch.optim.AdamW(fused=True),
  * the same model under torch.compile,
and prints tokens/s (steady state: the first `warmup` steps are excluded), MFU
((6N + 12·L·d·T) FLOPs per token against 989 TFLOP/s dense bf16), peak GPU memory (allocated and
reserved) and wall time, with shardtrain / PyTorch ratios. Results also go to a JSON file.

Usage (on the GPU machine):
  python3 bench/bench_single_gpu.py --shardtrain ./shardtrain --cases medium16,tutorial,xl2,xl16ac \
      --out results.json
Not a test: numbers depend on the GPU; docs/BENCHMARKS.md records them with GPU and date.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

PEAK_FLOPS = 989e12
SHAPES = {  # n_layer, n_head, n_embd
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}
# name: (model, micro-batch, seq, steps, warmup steps, activation checkpointing)
CASES = {
    "medium16": ("gpt2-medium", 16, 512, 40, 10, False),
    # DeepSpeed GPT-2 tutorial workload: 1000 samples x 512 tokens, batch 4, one epoch = 250 steps
    "tutorial": ("gpt2-medium", 4, 512, 250, 10, False),
    "xl2": ("gpt2-xl", 2, 512, 20, 5, False),
    "xl16ac": ("gpt2-xl", 16, 512, 12, 4, True),
}


def n_params(model):
    L, H, C = SHAPES[model]
    V, P = 50257, 1024
    return V * C + P * C + L * (12 * C * C + 13 * C) + 2 * C


def flops_per_token(model, T):
    L, _, C = SHAPES[model]
    return 6 * n_params(model) + 12 * L * C * T


def run_shardtrain(binary, case, out_dir, dropout=0.0):
    model, B, T, steps, warm, ac = CASES[case]
    log_every = 5
    cmd = [binary, "train", "--model", model, "--dataset", "wikitext-2", "--device", "cuda",
           "--batch-size", str(B), "--max-length", str(T), "--max-steps", str(steps),
           "--log-interval", str(log_every), "--eval-samples", str(B), "--no-save",
           "--output-dir", out_dir, "--warmup-steps", "5"]
    if ac:
        cmd.append("--activation-checkpointing")
    if dropout > 0:  # embd/attn/resid_pdrop, as the PyTorch side's GPT2Config
        cmd += ["--dropout", str(dropout)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    recs = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]
    steps_recs = [r for r in recs if "loss" in r and "step" in r and r["step"] > warm]
    # windows of log_every steps: average their tokens/s weighted by time
    tok = sum(r["tokens_per_s"] * r["step_time_s"] for r in steps_recs if r["step"] % log_every == 0)
    tim = sum(r["step_time_s"] for r in steps_recs if r["step"] % log_every == 0)
    epoch = [r for r in recs if "peak_memory_bytes" in r][-1]
    losses = [r["loss"] for r in recs if "loss" in r]
    return {"tokens_per_s": tok / tim if tim else float("nan"),
            "peak_allocated": epoch["device_peak_allocated_bytes"],
            "peak_reserved": epoch["device_peak_reserved_bytes"],
            "train_time_s": epoch["time_s"], "wall_s": wall,
            "first_loss": losses[0], "last_loss": losses[-1], "log": proc.stdout[-2500:]}


def run_torch(case, compiled, dropout=0.0):
    from transformers import GPT2Config, GPT2LMHeadModel
    model_name, B, T, steps, warm, ac = CASES[case]
    L, H, C = SHAPES[model_name]
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=L, n_head=H, n_embd=C, vocab_size=50257, n_positions=1024,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    try:  # transformers >= 4.36 takes the attention implementation at construction
        model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").cuda()
    except (TypeError, ValueError):
        cfg._attn_implementation = "sdpa"
        model = GPT2LMHeadModel(cfg).cuda()
    if ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # dropout active (when --dropout > 0), as in shardtrain's training steps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_fn = model
    if compiled:
        step_fn = torch.compile(model)
    data = torch.randint(0, 50257, (steps, B, T + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t_start = time.time()
    t_warm = None
    losses = []
    for s in range(steps):
        if s == warm:
            torch.cuda.synchronize()
            t_warm = time.time()
        x, y = data[s, :, :-1], data[s, :, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = step_fn(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                 y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s in (0, steps - 1):
            losses.append(loss.item())
    torch.cuda.synchronize()
    t_end = time.time()
    res = {"tokens_per_s": (steps - warm) * B * T / (t_end - t_warm),
           "peak_allocated": torch.cuda.max_memory_allocated(),
           "peak_reserved": torch.cuda.max_memory_reserved(),
           "train_time_s": t_end - t_start, "wall_s": t_end - t_start,
           "first_loss": losses[0], "last_loss": losses[-1]}
    del model, opt, step_fn, data
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shardtrain", default="./build/shardtrain")
    ap.add_argument("--cases", default="medium16,tutorial,xl2,xl16ac")
    ap.add_argument("--frameworks", default="shardtrain,eager,compile")
    ap.add_argument("--out", default="bench_single_gpu.json")
    ap.add_argument("--workdir", default="/tmp/bench_single_gpu")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="GPT-2 dropout probability on both sides (shardtrain --dropout; "
                         "PyTorch resid/embd/attn_pdrop), e.g. 0.1 as Hugging Face's configs; "
                         "default 0")
    args = ap.parse_args()
    if not 0.0 <= args.dropout < 1.0:
        ap.error(f"--dropout {args.dropout}: a probability in [0, 1)")
    os.makedirs(args.workdir, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    results = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "dropout": args.dropout, "cases": {}}
    for case in args.cases.split(","):
        model, B, T, steps, warm, ac = CASES[case]
        row = {}
        for fw in args.frameworks.split(","):
            try:
                if fw == "shardtrain":
                    r = run_shardtrain(args.shardtrain, case, os.path.join(args.workdir, case),
                                       args.dropout)
                else:
                    r = run_torch(case, compiled=(fw == "compile"), dropout=args.dropout)
            except torch.cuda.OutOfMemoryError as e:  # a result, not a crash
                r = {"error": f"out of memory: {e}"[:300]}
                gc.collect()
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - report and continue with the next case
                r = {"error": repr(e)[:1000]}
            if "tokens_per_s" in r:
                r["mfu"] = r["tokens_per_s"] * flops_per_token(model, T) / PEAK_FLOPS
            row[fw] = r
            print(json.dumps({case: {fw: {k: v for k, v in r.items() if k != "log"}}}), flush=True)
        results["cases"][case] = row
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    print(f"\n{gpu}, {results['date']}, torch {torch.__version__}")
    print(f"{'case':10} {'framework':10} {'tokens/s':>10} {'MFU':>6} {'peak alloc':>11} "
          f"{'peak rsvd':>10} {'train s':>8} {'ratio':>6}")
    for case, row in results["cases"].items():
        ours = row.get("shardtrain", {})
        for fw, r in row.items():
            if "error" in r:
                print(f"{case:10} {fw:10} {r['error'][:80]}")
                continue
            ratio = ours.get("tokens_per_s", float("nan")) / r["tokens_per_s"] if fw != "shardtrain" else 1.0
            print(f"{case:10} {fw:10} {r['tokens_per_s']:10.0f} {100 * r['mfu']:5.1f}% "
                  f"{r['peak_allocated'] / 2**30:9.2f}Gi {r['peak_reserved'] / 2**30:8.2f}Gi "
                  f"{r['train_time_s']:8.1f} {ratio:6.2f}")


if __name__ == "__main__":
    sys.exit(main())
