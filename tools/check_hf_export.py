#!/usr/bin/env python3
"""Round-trip check of shardtrain's Hugging Face export: `shardtrain consolidate` merges a
checkpoint's shards into a temporary Hugging Face directory, transformers loads it as
GPT2LMHeadModel, reporting any missing or unexpected tensor, then continues a prompt greedily; `shardtrain generate --temperature 0` on
the same checkpoint must print the same text. Usage:
    python3 tools/check_hf_export.py CHECKPOINT_DIR SHARDTRAIN_BINARY [PROMPT]
Tooling only (needs torch + transformers).
"""
import json
import os
import subprocess
import sys
import tempfile

import torch
from transformers import GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))


def bytes_to_unicode():
    """OpenAI gpt-2 encoder.py's byte <-> printable-unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def decode(ids):
    with open(os.path.join(HERE, "..", "data", "gpt2-tokenizer", "encoder.json")) as f:
        inv = {v: k for k, v in json.load(f).items()}
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(byte_of[c] for i in ids for c in inv[i]).decode("utf-8", errors="replace")


def main() -> None:
    ckpt, binary = sys.argv[1], sys.argv[2]
    prompt = sys.argv[3] if len(sys.argv) > 3 else "The game"
    hf_dir = tempfile.mkdtemp(prefix="shardtrain_hf_")
    subprocess.run([binary, "consolidate", ckpt, "--output", hf_dir], check=True,
                   capture_output=True, text=True)
    model, info = GPT2LMHeadModel.from_pretrained(hf_dir, output_loading_info=True)
    model = model.float().eval()
    missing = [k for k in info["missing_keys"] if not k.endswith("attn.bias") and k != "lm_head.weight"]
    assert not missing and not info["unexpected_keys"], info
    # Prompt ids from shardtrain's own tokenizer; HF's output decoded with GPT-2's byte decoder.
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    ids = [int(t) for t in subprocess.run([binary, "tokenize", f.name], check=True,
                                          capture_output=True, text=True).stdout.split()]
    os.unlink(f.name)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    hf_text = decode(out[0].tolist())
    ours = subprocess.run([binary, "generate", "--checkpoint", ckpt, "--prompt", prompt,
                           "--max-new-tokens", "20", "--temperature", "0", "--device", "cpu"],
                          check=True, capture_output=True, text=True).stdout.rstrip("\n")
    print(f"transformers: {hf_text!r}\nshardtrain:   {ours!r}")
    print("MATCH" if hf_text == ours else "DIFFERENT")
    sys.exit(0 if hf_text == ours else 1)


if __name__ == "__main__":
    main()
