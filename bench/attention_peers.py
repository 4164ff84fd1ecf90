"""PyTorch's attention kernels on the shapes of the per-kernel roofline, beside shardtrain's.

Times torch.nn.functional.scaled_dot_product_attention (causal, bf16, [B, heads, T, 64]) with
each backend PyTorch offers on the GPU -- cuDNN (FlashAttention-style fused kernels),
FlashAttention-2 and memory-efficient attention -- forward alone and forward + backward, per
layer; and, given the roofline's JSON (bench/kernel_roofline.py --json), shardtrain's
"attention forward" and "attention backward" families of the same step divided by the layers.
FLOPs count the causal half: forward 4·B·heads·T²·d / 2, backward 2.5× that (the roofline's).

    python3 bench/attention_peers.py --models gpt2-medium,gpt2-xl --batch 16 --seq 512 \
        [--roofline-dir OUT]   # OUT/roofline_<model>_b<batch>.json
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# layers, heads (head size 64) of the GPT-2 sizes
SHAPES = {"gpt2": (12, 12), "gpt2-medium": (24, 16), "gpt2-large": (36, 20), "gpt2-xl": (48, 25)}
BACKENDS = [("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FlashAttention-2", SDPBackend.FLASH_ATTENTION),
            ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION)]


def time_ms(fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def bench(batch, heads, seq, backend, reps):
    q, k, v = (torch.randn(batch, heads, seq, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    grad = torch.ones(batch, heads, seq, 64, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([backend]):
        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            fwd().backward(grad)

        for _ in range(5):
            fwd_bwd()
        torch.cuda.synchronize()
        f = time_ms(fwd, reps)
        return f, time_ms(fwd_bwd, reps) - f


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2-medium,gpt2-xl")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--roofline-dir", default=None)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args()
    print(f"PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}; causal bf16, head size 64, per layer\n")
    print("| model | kernels | forward µs | TFLOP/s | backward µs | TFLOP/s |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    for model in a.models.split(","):
        layers, heads = SHAPES[model]
        flops = 4 * a.batch * heads * a.seq * a.seq * 64 / 2
        found = []
        path = os.path.join(a.roofline_dir or "", f"roofline_{model}_b{a.batch}.json")
        if a.roofline_dir and os.path.exists(path):
            fams = json.load(open(path))["families"]
            ours = [fams.get(f, {}).get("ms", 0) / layers for f in
                    ("attention forward", "attention backward")]
            found.append(("shardtrain (this step, roofline trace)", *ours))
        for name, backend in BACKENDS:
            try:
                found.append((f"PyTorch SDPA {name}", *bench(a.batch, heads, a.seq, backend,
                                                             a.reps)))
            except RuntimeError as e:
                print(f"| {model} | PyTorch SDPA {name} | not available: {str(e)[:60]} | | | |")
        for name, f, b in found:
            print(f"| {model} | {name} | {f * 1e3:.1f} | {flops / f / 1e9:.0f} | {b * 1e3:.1f} | "
                  f"{2.5 * flops / b / 1e9:.0f} |")
            rows.append({"model": model, "kernels": name, "forward_ms": f, "backward_ms": b})
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
