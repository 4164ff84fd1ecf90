#!/usr/bin/env python3
"""The GPU's measured limits for the per-kernel roofline (bench/kernel_roofline.py): the dense
bf16 GEMM rate (cuBLAS through PyTorch, fp32 accumulation) on large square products and on every
GEMM shape of a GPT-2 training step, and the HBM bandwidth of a device-to-device copy.

    python3 bench/gpu_limits.py --models gpt2-medium,gpt2-xl --rows 8192 --out gpu_limits.json

Each rate is the best of --reps timed repetitions (CUDA events) after a warm-up. A step's GEMMs:
per block the QKV, attention-output, MLP-up and MLP-down products, each forward (x W) and its two
backward products (dY W^T, x^T dY), and the LM head's three, at `--rows` = micro-batch × sequence
rows. Prints one JSON object: {"device", "gemm_peak_tflops", "gemm_square": {size: TFLOP/s},
"hbm_copy_GBps", "models": {model: {gemm_name: {"shape": [M, N, K], "tflops"}}}}.
HBM bandwidth counts the bytes read plus the bytes written. Not a test.
"""
import argparse
import json

import torch

SHAPES = {"gpt2": (12, 768), "gpt2-medium": (24, 1024), "gpt2-large": (36, 1280),
          "gpt2-xl": (48, 1600)}  # n_layer, n_embd
VOCAB_PADDED = 50304  # the LM head's columns, padded to a multiple of 128 as shardtrain does


def time_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


def gemm_tflops(m, n, k, reps):
    """C[m, n] = A[m, k] B[k, n] in bf16."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.matmul(a, b), reps)
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def step_gemms(model, rows):
    """{name: (M, N, K)} of one GPT-2 step's GEMMs (forward, input gradient, weight gradient)."""
    _, d = SHAPES[model]
    out = {}
    for name, k, n in (("qkv", d, 3 * d), ("attn_proj", d, d), ("mlp_up", d, 4 * d),
                       ("mlp_down", 4 * d, d), ("lm_head", d, VOCAB_PADDED)):
        out[f"{name}.fwd"] = (rows, n, k)    # x[rows, k] W[k, n]
        out[f"{name}.dinp"] = (rows, k, n)   # dY[rows, n] W^T[n, k]
        out[f"{name}.dw"] = (k, n, rows)     # x^T[k, rows] dY[rows, n]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2-medium,gpt2-xl")
    ap.add_argument("--rows", type=int, default=8192, help="micro-batch x sequence (16 x 512)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "gemm_square": {}, "models": {}}
    for s in (4096, 8192, 16384):
        res["gemm_square"][s] = gemm_tflops(s, s, s, max(3, a.reps // 4))
    res["gemm_peak_tflops"] = max(res["gemm_square"].values())
    n = int(a.copy_gib * 2 ** 30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), a.reps)
    res["hbm_copy_GBps"] = 2.0 * n / (ms * 1e-3) / 1e9
    del src, dst
    for model in a.models.split(","):
        res["models"][model] = {
            name: {"shape": list(shape), "tflops": gemm_tflops(*shape, a.reps)}
            for name, shape in step_gemms(model, a.rows).items()}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
