#!/usr/bin/env python3
"""Per-kernel roofline of one GPT-2 training step: each kernel family's device time per steady
step (bench/kernel_trace.cpp's reports of a short and a long run, differenced as
bench/kernel_trace_diff.py does), the work it does (FLOPs or HBM bytes, counted from the model's
shape), the rate that gives, and that rate against the GPU's measured limit (bench/gpu_limits.py:
the bf16 GEMM rate of the same shapes, the largest square GEMM's rate, the HBM copy bandwidth).

    python3 bench/kernel_roofline.py SHORT.tsv LONG.tsv EXTRA_STEPS --model gpt2-medium \
        --batch 16 --seq 512 --limits gpu_limits.json [--activation-checkpointing] [--top 12]

Work per step (B micro-batch, T sequence, L layers, d width, V = 50304 padded vocabulary):
  GEMM        forward 24·B·T·L·d² + 2·B·T·d·V, backward twice that (input and weight gradients),
              the blocks' forward once more with activation checkpointing; the limit is the time
              those products take at the rates gpu_limits.py measured for each shape alone
  attention   causal (only the unmasked half): forward 2·B·T²·d per layer, backward 2.5× that
              (the scores recomputed, four products), the forward again with checkpointing;
              against the largest square GEMM's rate
  layernorm   bf16 in and out: 4·B·T·d bytes forward, 6·B·T·d backward, 2L + 1 of them (the
              blocks' 2L again with checkpointing)
  GELU        4·B·T·d elements, bf16: 4 bytes each forward (read, write), 6 backward
  cross-entropy  the bf16 logits read and their gradient written: 4·B·T·V bytes
  AdamW       28 bytes per parameter (fp32 master, m, v read and written, bf16 gradient read and
              bf16 parameter written)
Byte families are held against the HBM copy bandwidth. Kernels are put in families by name;
`other` is everything unmatched. Prints a Markdown table, then the --top kernels. Not a test.
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_trace_diff import per_step, read, short  # noqa: E402

SHAPES = {"gpt2": (12, 768), "gpt2-medium": (24, 1024), "gpt2-large": (36, 1280),
          "gpt2-xl": (48, 1600)}
VOCAB, VOCAB_PADDED = 50257, 50304
FAMILIES = [  # (family, regular expression on the raw kernel name), first match wins
    ("attention forward", r"flash_forward"),
    ("attention backward", r"flash_backward|flash_dot"),
    ("attention (other)", r"permute|softmax|attention"),
    ("GEMM", r"gemm|xmma|cutlass|nvjet|sm90_|sm100_|cublas|splitk|splitK"),
    ("layernorm", r"layernorm"),
    ("GELU", r"gelu"),
    ("bias", r"bias_"),
    ("cross-entropy", r"cross_entropy|classification_loss"),
    ("residual add", r"add_kernel|accumulate_kernel|dropout"),
    ("embedding", r"embedding"),
    ("AdamW", r"adamw"),
    ("norm and scale", r"sum_squares|sum_partials|sum_final|scale_kernel|reduce"),
    ("conversion", r"convert_kernel"),
    ("copies", r"^memcpy|^memset"),
]


def family_of(kind, name):
    if kind in ("memcpy", "memset"):
        return "copies"
    for fam, pattern in FAMILIES:
        if re.search(pattern, name):
            return fam
    return "other"


def work(a, limits):
    """{family: (amount, unit, limit rate, limit name)}: FLOPs against TFLOP/s, bytes against
    GB/s; the GEMM's limit is the time of its shapes at their measured rates (seconds)."""
    L, d = SHAPES[a.model]
    B, T = a.batch, a.seq
    BT = B * T
    ac = 1 if a.activation_checkpointing else 0
    out = {}
    gemms = limits.get("models", {}).get(a.model, {})
    if gemms:
        t = 0.0
        for name, g in gemms.items():
            M, N, K = g["shape"]
            flops = 2.0 * M * N * K
            layers = 1 if name.startswith("lm_head") else L * (1 + (ac if name.endswith(".fwd") else 0))
            t += layers * flops / (g["tflops"] * 1e12)
        block = 24.0 * BT * L * d * d
        head = 2.0 * BT * d * VOCAB_PADDED
        out["GEMM"] = (3 * (block + head) + ac * block, "FLOP", t, "its shapes alone")
    attn = 2.0 * B * T * T * d * L
    peak = limits.get("gemm_peak_tflops", 0) * 1e12
    out["attention forward"] = (attn * (1 + ac), "FLOP", peak, "square GEMM")
    out["attention backward"] = (2.5 * attn, "FLOP", peak, "square GEMM")
    hbm = limits.get("hbm_copy_GBps", 0) * 1e9
    out["layernorm"] = ((2 * L + 1) * (4.0 + 6.0) * BT * d + ac * 2 * L * 4.0 * BT * d, "B", hbm,
                        "HBM copy")
    out["GELU"] = (L * 4 * d * BT * (4.0 * (1 + ac) + 6.0), "B", hbm, "HBM copy")
    out["cross-entropy"] = (4.0 * BT * VOCAB_PADDED, "B", hbm, "HBM copy")
    n_params = 12 * L * d * d + 13 * L * d + (VOCAB + 1024) * d + 2 * d
    out["AdamW"] = (28.0 * n_params, "B", hbm, "HBM copy")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("short")
    ap.add_argument("long")
    ap.add_argument("extra_steps", type=int)
    ap.add_argument("--model", default="gpt2-medium", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--limits", default=None, help="bench/gpu_limits.py's JSON")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", default=None, help="also write the families as JSON here")
    a = ap.parse_args()
    rows = per_step(read(a.short), read(a.long), a.extra_steps)
    total = sum(r[0] for r in rows)
    fams = {}
    for ms, calls, (kind, name) in rows:
        f = fams.setdefault(family_of(kind, name), [0.0, 0.0])
        f[0] += ms
        f[1] += calls
    limits = json.load(open(a.limits)) if a.limits else {}
    w = work(a, limits)
    print(f"{a.model}, micro-batch {a.batch} x {a.seq}"
          f"{', activation checkpointing' if a.activation_checkpointing else ''}: "
          f"{total:.2f} ms of device time per steady step (sum over kernels, memsets, copies)\n")
    print("| family | ms per step | share | calls | work per step | rate | limit | of limit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    out = {}
    for fam, (ms, calls) in sorted(fams.items(), key=lambda kv: -kv[1][0]):
        cells = ["–", "–", "–", "–"]
        if fam in w and ms > 0:
            amount, unit, lim, lim_name = w[fam]
            sec = ms * 1e-3
            if unit == "FLOP":
                cells[0] = f"{amount / 1e12:.2f} TFLOP"
                cells[1] = f"{amount / sec / 1e12:.0f} TFLOP/s"
                if fam == "GEMM" and lim:
                    cells[2] = f"{lim * 1e3:.2f} ms ({lim_name})"
                    cells[3] = f"{100 * lim / sec:.0f}%"
                elif lim:
                    cells[2] = f"{lim / 1e12:.0f} TFLOP/s ({lim_name})"
                    cells[3] = f"{100 * amount / sec / lim:.0f}%"
            else:
                cells[0] = f"{amount / 1e9:.2f} GB"
                cells[1] = f"{amount / sec / 1e9:.0f} GB/s"
                if lim:
                    cells[2] = f"{lim / 1e9:.0f} GB/s ({lim_name})"
                    cells[3] = f"{100 * amount / sec / lim:.0f}%"
        print(f"| {fam} | {ms:.3f} | {100 * ms / total:.1f}% | {calls:.0f} | " + " | ".join(cells)
              + " |")
        out[fam] = {"ms": ms, "calls": calls, "share": ms / total}
    print(f"\nthe {a.top} longest kernels:\n")
    names = short([key[1] for _, _, key in rows[: a.top]])
    for ms, calls, (kind, name) in rows[: a.top]:
        print(f"{ms:9.3f} ms {calls:7.1f}/step  {family_of(kind, name):18s} {names[name]}")
    if a.json:
        json.dump({"model": a.model, "batch": a.batch, "seq": a.seq, "total_ms": total,
                   "families": out}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
