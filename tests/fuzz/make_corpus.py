#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/) from real files: what
shardtrain itself writes (token files, checkpoint manifests, config.json), what other tools write
(safetensors files of Hugging Face's safetensors library in tests/fixtures, Fashion-MNIST's IDX
files from Debian's dataset-fashion-mnist, PNG and JPEG files from Pillow), and the shipped
DeepSpeed configs. Each seed is small (libFuzzer mutates it; at most 64 KiB). Run from the
repository root after a build, then commit the files:

    python3 tests/fuzz/make_corpus.py --shardtrain build/shardtrain

Needs Pillow (pip) for the image seeds. Rewrites the corpus directories it fills.
"""
import argparse
import gzip
import io
import json
import os
import shutil
import struct
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MAX_SEED = 64 * 1024


def out_dir(target):
    d = os.path.join(HERE, "corpus", target)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def put(d, name, data):
    assert len(data) <= MAX_SEED, (name, len(data))
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def safetensors_bytes(tensors, metadata=None):
    """tensors: [(name, dtype, shape, raw bytes)] in the format's own layout."""
    header, offset, data = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data += raw
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def corpus_safetensors():
    d = out_dir("safetensors")
    fixtures = os.path.join(ROOT, "tests", "fixtures", "image_models")
    for name in ("cnn.safetensors", "cnn_lstm.safetensors", "ensemble_cnn_cnn_lstm.safetensors"):
        with open(os.path.join(fixtures, name), "rb") as f:
            put(d, name, f.read())
    put(d, "mixed_dtypes.safetensors", safetensors_bytes(
        [("a", "F32", [2, 3], struct.pack("<6f", *range(6))),
         ("b", "BF16", [4], bytes(8)), ("c", "I64", [1], struct.pack("<q", 7)),
         ("empty", "F16", [0, 5], b""), ("flag", "BOOL", [2], b"\x01\x00")],
        {"format": "pt"}))
    # A real GPT-2 header (the hub's tensor names and shapes) over no data: every range is outside.
    with open(os.path.join(ROOT, "tests", "fixtures", "hf_gpt2_tiny", "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = f.read(n)
    put(d, "gpt2_header_only.safetensors", struct.pack("<Q", n) + head)


def corpus_token_file(shardtrain, tmp):
    d = out_dir("token_file")
    text = os.path.join(tmp, "text.txt")
    with open(os.path.join(ROOT, "build", "data", "wikitext-2", "wiki.valid.tokens"), "rb") as f:
        sample = f.read(20000)
    for name, size in (("short", 200), ("longer", 20000)):
        with open(text, "wb") as f:
            f.write(sample[:size])
        out = os.path.join(tmp, name + ".bin")
        subprocess.run([shardtrain, "tokenize", text, "--output", out], check=True,
                       stdout=subprocess.DEVNULL)
        with open(out, "rb") as f:
            put(d, name + ".tokens.bin", f.read())


def corpus_idx():
    d = out_dir("idx")
    labels = "/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz"
    with open(labels, "rb") as f:
        put(d, "fashion_mnist_t10k_labels.gz", f.read())
    with gzip.open("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz", "rb") as f:
        header, first = f.read(16), f.read(3 * 28 * 28)
    images = bytes([0, 0, 8, 3]) + struct.pack(">III", 3, 28, 28) + first
    assert header[:4] == bytes([0, 0, 8, 3])
    put(d, "fashion_mnist_3_images", images)
    put(d, "fashion_mnist_3_images.gz", gzip.compress(images))
    put(d, "vector", bytes([0, 0, 8, 1]) + struct.pack(">I", 5) + bytes(range(5)))


def corpus_image():
    from PIL import Image
    d = out_dir("image")
    for mode, size in (("L", (8, 6)), ("RGB", (5, 7)), ("RGBA", (4, 4)), ("P", (6, 6)),
                       ("I;16", (3, 3))):
        img = Image.new(mode, size)
        img.putdata([(i * 37) % 251 if mode in ("L", "P", "I;16") else
                     tuple((i * k) % 251 for k in range(3 + (mode == "RGBA")))
                     for i in range(size[0] * size[1])])
        b = io.BytesIO()
        img.save(b, "PNG")
        put(d, "%s.png" % mode.replace(";", "_"), b.getvalue())
    for mode, sub in (("L", 0), ("RGB", 0), ("RGB", 2)):
        img = Image.new(mode, (16, 8), 128 if mode == "L" else (200, 30, 90))
        b = io.BytesIO()
        img.save(b, "JPEG", quality=90, subsampling=sub)
        put(d, "%s_sub%d.jpg" % (mode, sub), b.getvalue())
    b = io.BytesIO()
    Image.new("RGB", (16, 8), (1, 2, 3)).save(b, "JPEG", progressive=True)
    put(d, "progressive.jpg", b.getvalue())


def corpus_manifest(shardtrain, tmp):
    d = out_dir("manifest")
    text = os.path.join(tmp, "small.txt")
    with open(os.path.join(ROOT, "build", "data", "wikitext-2", "wiki.valid.tokens"), "rb") as f:
        data = f.read(100000)
    with open(text, "wb") as f:
        f.write(data)
    runs = {"gpt2": ["--model", "gpt2-micro", "--train-file", text, "--max-length", "16"],
            "image": ["--model", "cnn", "--dataset", "fashion-mnist", "--num-samples", "32"]}
    for name, args in runs.items():
        out = os.path.join(tmp, "out_" + name)
        subprocess.run([shardtrain, "train", *args, "--device", "cpu", "--max-steps", "1",
                        "--batch-size", "2", "--output-dir", out], check=True,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "checkpoint-000001", "manifest.json"), "rb") as f:
            put(d, name + "_manifest.json", f.read())


def corpus_deepspeed_config():
    d = out_dir("deepspeed_config")
    examples = os.path.join(ROOT, "examples")
    for name in sorted(os.listdir(examples)):
        if name.startswith("ds_config_") and name.endswith(".json"):
            with open(os.path.join(examples, name), "rb") as f:
                put(d, name, f.read())
    put(d, "comments.json", b'{\n  // micro-batch\n  "train_micro_batch_size_per_gpu": 4, /* x */\n'
                            b'  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}\n}\n')


def corpus_model_config(shardtrain, tmp):
    d = out_dir("model_config")
    with open(os.path.join(ROOT, "tests", "fixtures", "hf_gpt2_tiny", "config.json"), "rb") as f:
        put(d, "hf_gpt2_tiny_config.json", f.read())
    put(d, "minimal.json", json.dumps({"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128,
                                       "vocab_size": 50257}).encode())
    put(d, "aliases.json", json.dumps({"model_type": "gpt2", "num_hidden_layers": 2,
                                       "hidden_size": 64, "num_attention_heads": 4,
                                       "max_position_embeddings": 64, "vocab_size": 50304,
                                       "n_inner": None, "resid_pdrop": 0.1}).encode())


def corpus_hostfile():
    d = out_dir("hostfile")
    put(d, "two_nodes", b"worker-1 slots=8\nworker-2 slots=8\n")
    put(d, "comments", b"# the cluster\n10.0.0.1 slots=4  # first\n\n10.0.0.2 slots=4\n")
    put(d, "ipv6_user", b"[fe80::1] slots=2\nalice@node-3 slots=1\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shardtrain", default=os.path.join(ROOT, "build", "shardtrain"))
    args = p.parse_args()
    shardtrain = os.path.abspath(args.shardtrain)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SHARDTRAIN_CACHE_DIR"] = tmp
        corpus_safetensors()
        corpus_token_file(shardtrain, tmp)
        corpus_idx()
        corpus_image()
        corpus_manifest(shardtrain, tmp)
        corpus_deepspeed_config()
        corpus_model_config(shardtrain, tmp)
        corpus_hostfile()
    for t in sorted(os.listdir(os.path.join(HERE, "corpus"))):
        files = os.listdir(os.path.join(HERE, "corpus", t))
        print("%-18s %d seeds" % (t, len(files)))


if __name__ == "__main__":
    main()
