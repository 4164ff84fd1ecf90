#!/usr/bin/env python3
"""Tokenization speed: `shardtrain tokenize` against Hugging Face `tokenizers` and `tiktoken`.

All three use GPT-2's byte-level BPE from the same files (encoder.json = vocab.json, vocab.bpe =
merges.txt; no download) on the same text, and every result's ids are compared with
shardtrain's token file. Times are the best of --repeats; shardtrain's include its process start
and loading the tokenizer, the Python libraries' do not (only the encode calls). The libraries
also encode the text cut as shardtrain cuts it (about 1 MiB pieces, before a ' '/'\\n' followed by
printable ASCII other than '<'), which gives the same ids, with their batch calls:
`tokenizers`' encode_batch uses RAYON_NUM_THREADS threads (run this script once per value),
tiktoken's encode_ordinary_batch 1 and 2 threads. tiktoken.get_encoding("gpt2") downloads its
files; offline it fails, and the same encoding is built from the local files instead.

usage: RAYON_NUM_THREADS=N python3 bench/tokenize_speed.py --shardtrain build/shardtrain \\
           --text FILE [--tokenizer-dir build/data/gpt2-tokenizer] [--repeats 3]
Measurement tooling only (pip install tokenizers tiktoken); shardtrain never runs Python.
"""
import argparse
import array
import os
import subprocess
import tempfile
import time


def best(fn, repeats):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def pieces_of(text, target=1 << 20):
    """The text cut at shardtrain's cut points, about `target` characters apart."""
    out, start, pos = [], 0, target
    while pos < len(text) - 1:
        c, n = text[pos], text[pos + 1]
        if c in " \n" and "!" <= n <= "~" and n != "<":
            out.append(text[start:pos])
            start, pos = pos, pos + target
        else:
            pos += 1
    out.append(text[start:])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shardtrain", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokenizer-dir", default="build/data/gpt2-tokenizer")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    nbytes = os.path.getsize(a.text)
    mbs = lambda t: f"{nbytes / 1e6 / t:.1f} MB/s ({t:.2f} s)"
    print(f"text: {a.text}, {nbytes:,} bytes")

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ids.bin")
        for threads in (1, 2):
            cmd = [a.shardtrain, "tokenize", a.text, "--threads", str(threads), "--output", out]
            t, _ = best(lambda: subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL), a.repeats)
            print(f"shardtrain tokenize --threads {threads}: {mbs(t)}")
        with open(out, "rb") as f:
            f.seek(64)
            ref = array.array("H", f.read()).tolist()

    text = open(a.text, "rb").read().decode("utf-8")
    pieces = pieces_of(text)
    vocab = os.path.join(a.tokenizer_dir, "encoder.json")
    merges = os.path.join(a.tokenizer_dir, "vocab.bpe")

    import tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    hf = Tokenizer(models.BPE.from_file(vocab, merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    t, ids = best(lambda: hf.encode(text).ids, a.repeats)
    print(f"tokenizers {tokenizers.__version__} encode(whole text): {mbs(t)}, same ids: {ids == ref}")
    rayon = os.environ.get("RAYON_NUM_THREADS", "unset")
    t, ids = best(lambda: [i for e in hf.encode_batch(pieces) for i in e.ids], a.repeats)
    print(f"tokenizers encode_batch({len(pieces)} pieces, RAYON_NUM_THREADS={rayon}): {mbs(t)}, "
          f"same ids: {ids == ref}")

    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    try:
        tiktoken.get_encoding("gpt2")
        print("tiktoken get_encoding('gpt2') loaded (its download is cached)")
    except Exception as e:  # noqa: BLE001 - any failure to fetch the files
        print(f"tiktoken get_encoding('gpt2') cannot load offline ({type(e).__name__}): the same "
              "encoding is built from the local files")
    tk = tiktoken.Encoding(
        name="gpt2-local",
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=data_gym_to_mergeable_bpe_ranks(merges, vocab),
        special_tokens={"<|endoftext|>": 50256})
    t, ids = best(lambda: tk.encode(text, allowed_special="all"), a.repeats)
    print(f"tiktoken {tiktoken.__version__} encode(whole text): {mbs(t)}, same ids: {ids == ref}")
    for n in (1, 2):
        t, ids = best(lambda: [i for e in tk.encode_ordinary_batch(pieces, num_threads=n) for i in e],
                      a.repeats)
        print(f"tiktoken encode_ordinary_batch({len(pieces)} pieces, num_threads={n}): {mbs(t)}, "
              f"same ids: {ids == ref}")


if __name__ == "__main__":
    main()
