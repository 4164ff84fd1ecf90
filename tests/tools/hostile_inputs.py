#!/usr/bin/env python3
"""Hostile but fair inputs to the `shardtrain` binary, end to end: each case builds a bad file (or
flag, or fault), runs the program, and checks that it ends with a clean error — the expected exit
status, one bounded `error:` line naming what is wrong, no crash or traceback — and that nothing
is left on disk (swap files, partial checkpoints). Cases that must run (the no-validation summary,
ZeRO-Infinity's exit) check their output instead.

    python3 tests/tools/hostile_inputs.py --binary build/shardtrain [--data-dir build/data] [-k NAME]

Exit status 0 when every case holds, 1 otherwise (a table of the cases is printed either way).
CTest runs it as `hostile_inputs` (tests/CMakeLists.txt). Every case is a few seconds on 2 cores.
"""
import argparse
import functools
import gzip
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

MAX_LINE = 1500  # the longest error line accepted: a bounded excerpt, never the input itself


class Case:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn


CASES = []


def case(fn):
    CASES.append(Case(fn.__name__, fn))
    return fn


class Ctx:
    def __init__(self, binary, data_dir, work):
        self.binary, self.data_dir, self.work = binary, data_dir, work
        self.small = os.path.join(work, "small.txt")

    def path(self, *parts):
        return os.path.join(self.work, *parts)

    def run(self, *args, timeout=300, env=None):
        e = dict(os.environ, SHARDTRAIN_CACHE_DIR=self.path("cache"), OMP_NUM_THREADS="2")
        e.update(env or {})
        r = subprocess.run([self.binary, *args], cwd=self.work, capture_output=True, text=True,
                           errors="replace", timeout=timeout, env=e)
        return r.returncode, r.stdout, r.stderr

    def train_args(self, *extra):
        return ["train", "--model", "gpt2-micro", "--train-file", self.small, "--device", "cpu",
                "--max-steps", "2", "--max-length", "32", "--batch-size", "2", "--no-save", *extra]


class Failure(Exception):
    pass


def expect_error(result, statuses, *needles):
    """The run failed cleanly: status in `statuses`, stderr's last line is one bounded 'error:'
    line holding every needle, no signal, no sanitizer or library trace."""
    status, out, err = result
    last = err.strip().splitlines()[-1] if err.strip() else ""
    if status < 0 or status > 128:
        raise Failure(f"died (status {status}): {last[:300]}")
    if status not in statuses:
        raise Failure(f"exit status {status}, expected {statuses}: {last[:300]}")
    if not last.startswith("error: "):
        raise Failure(f"no 'error:' line: {last[:300]}")
    if len(last) > MAX_LINE:
        raise Failure(f"error line of {len(last)} characters")
    for bad in ("terminate called", "json.exception", "AddressSanitizer", "this is a bug",
                "Segmentation", "Aborted"):
        if bad in err:
            raise Failure(f"stderr holds '{bad}'")
    for n in needles:
        if n not in last:
            raise Failure(f"error line lacks '{n}': {last[:400]}")
    return last


def expect_success(result):
    """The run finished: exit status 0. Returns its stdout."""
    status, out, err = result
    if status != 0:
        raise Failure(f"exit status {status}: {err.strip()[-200:]}")
    return out


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return h


def token_file(path, ids):
    payload = struct.pack("<%dH" % len(ids), *ids)
    with open(path, "wb") as f:
        f.write(b"STTOKENS" + struct.pack("<IIQQQQ", 1, 2, len(ids), 0, 0, fnv1a64(payload)) +
                bytes(16) + payload)


def safetensors(path, header, data=b""):
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


@functools.lru_cache(maxsize=None)
def checkpoint(ctx):
    """A real 2-step gpt2-micro checkpoint of this binary (copied by the cases that edit it)."""
    out = ctx.path("ck_base")
    expect_success(ctx.run(*ctx.train_args()[:-1], "--output-dir", out))
    return out


def edited_checkpoint(ctx, name, edit):
    dst = ctx.path(name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(checkpoint(ctx), dst)
    manifest = os.path.join(dst, "checkpoint-000002", "manifest.json")
    with open(manifest) as f:
        m = json.load(f)
    edit(m)
    with open(manifest, "w") as f:
        json.dump(m, f)
    return dst


# ---- safetensors (--init-from) -----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def hf_model(ctx):
    """The bytes of a real model.safetensors (`consolidate` of the base checkpoint): its header
    (as a dict) and its data section."""
    out = ctx.path("hf")
    expect_success(ctx.run("consolidate", checkpoint(ctx), "--output", out))
    with open(os.path.join(out, "model.safetensors"), "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n]), b[8 + n:]


def edited_model(ctx, name, edit):
    header, data = hf_model(ctx)
    header = json.loads(json.dumps(header))
    header = edit(header) or header
    safetensors(ctx.path(name), header, data)
    return name


@case
def safetensors_offsets_past_the_shape(ctx):
    """The issue's reproduction: wte's data_offsets span the whole data section."""
    size = len(hf_model(ctx)[1])
    f = edited_model(ctx, "evil.safetensors",
                     lambda h: h["transformer.wte.weight"].update(data_offsets=[0, size]))
    expect_error(ctx.run(*ctx.train_args("--init-from", f)), (2,), "data_offsets")
    f = edited_model(ctx, "evil2.safetensors",  # a smaller overrun, into the next tensor
                     lambda h: h["transformer.wte.weight"].update(
                         data_offsets=[64, 64 + 50257 * 64 * 4]))
    expect_error(ctx.run(*ctx.train_args("--init-from", f)), (2,), "overlap")


@case
def safetensors_empty_range(ctx):
    f = edited_model(ctx, "zero.safetensors",
                     lambda h: h["transformer.wte.weight"].update(data_offsets=[0, 0]))
    expect_error(ctx.run(*ctx.train_args("--init-from", f)), (2,), "span 0 bytes")


@case
def safetensors_header_not_an_object(ctx):
    f = edited_model(ctx, "array.safetensors", lambda h: [h])
    expect_error(ctx.run(*ctx.train_args("--init-from", f)), (2,), "not an object")
    f = edited_model(ctx, "meta.safetensors", lambda h: h.update({"__metadata__": [1]}))
    expect_error(ctx.run(*ctx.train_args("--init-from", f)), (2,), "__metadata__")


# ---- token files ---------------------------------------------------------------------------

@case
def token_ids_beyond_the_vocabulary(ctx):
    for bad in (65535, 52000, 50257):
        token_file(ctx.path("bad.bin"), [bad] * 4000)
        expect_error(ctx.run(*ctx.train_args()[:4], "bad.bin", *ctx.train_args()[5:]), (2,),
                     f"token id {bad}", "vocabulary")


@case
def train_file_that_is_a_directory_or_a_device(ctx):
    os.makedirs(ctx.path("a_dir"), exist_ok=True)
    args = ctx.train_args()
    expect_error(ctx.run(*args[:4], "a_dir", *args[5:]), (2,), "is a directory")
    expect_error(ctx.run(*args[:4], "/dev/zero", *args[5:]), (2,), "not a regular file")


# ---- IDX -----------------------------------------------------------------------------------

@case
def idx_dimensions_that_overflow(ctx):
    d = ctx.path("idx")
    os.makedirs(d, exist_ok=True)
    for split in ("train", "t10k"):  # 4 × 2^31 × 2^31 wraps to 0 in 64 bits
        with open(os.path.join(d, f"{split}-images-idx3-ubyte"), "wb") as f:
            f.write(bytes([0, 0, 8, 3]) + struct.pack(">III", 4, 2**31, 2**31) + bytes(100))
        with open(os.path.join(d, f"{split}-labels-idx1-ubyte"), "wb") as f:
            f.write(bytes([0, 0, 8, 1]) + struct.pack(">I", 4) + bytes(4))
    expect_error(ctx.run("train", "--model", "cnn", "--dataset", "fashion-mnist", "--data-dir", d,
                         "--device", "cpu", "--max-steps", "1", "--no-save"), (2,),
                 "too many to be real")


# ---- images --------------------------------------------------------------------------------

def jpeg_bytes(width, height):
    """A baseline JPEG (gray, one 8×8 block of data) whose header claims width × height."""
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    dqt = b"\xff\xdb" + struct.pack(">H", 67) + b"\x00" + bytes([1] * 64)
    dht_dc = b"\xff\xc4" + struct.pack(">H", 20) + b"\x00" + bytes([1] + [0] * 15) + b"\x00"
    dht_ac = b"\xff\xc4" + struct.pack(">H", 20) + b"\x10" + bytes([1] + [0] * 15) + b"\x00"
    sos = b"\xff\xda" + struct.pack(">HB", 8, 1) + b"\x01\x00\x00\x3f\x00"
    return b"\xff\xd8" + dqt + sof + dht_dc + dht_ac + sos + b"\x00" * 4 + b"\xff\xd9"


def good_jpeg():
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "corpus",
                           "image", "RGB_sub2.jpg"), "rb") as f:
        return f.read()


def image_folder(ctx, name, files):
    """Two classes of six good images each (enough for the held-out split), plus `files`."""
    root = ctx.path(name)
    shutil.rmtree(root, ignore_errors=True)
    for cls in ("a", "b"):
        os.makedirs(os.path.join(root, cls))
        for i in range(6):
            with open(os.path.join(root, cls, f"good{i}.jpg"), "wb") as f:
                f.write(good_jpeg())
    for rel, data in files.items():
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    return root


@case
def jpeg_claiming_65000_pixels_a_side(ctx):
    root = image_folder(ctx, "huge_jpeg", {"a/big.jpg": jpeg_bytes(65000, 65000)})
    expect_error(ctx.run("train", "--model", "cnn", "--data-dir", root, "--image-size", "32",
                         "--device", "cpu", "--max-steps", "1", "--no-save"), (2,), "big.jpg",
                 "declares 65000×65000")


@case
def truncated_jpeg(ctx):
    # Cut inside the entropy-coded data: libjpeg fills the missing rows with grey and warns.
    root = image_folder(ctx, "cut_jpeg", {"b/cut.jpg": good_jpeg()[:-6]})
    expect_error(ctx.run("train", "--model", "cnn", "--data-dir", root, "--device", "cpu",
                         "--max-steps", "1", "--no-save"), (2,), "cut.jpg", "truncated")


@case
def image_size_beyond_memory(ctx):
    expect_error(ctx.run("train", "--model", "cnn", "--dataset", "fashion-mnist", "--image-size",
                         "3000", "--device", "cpu", "--max-steps", "1", "--no-save"), (2,),
                 "--image-size")


# ---- checkpoint manifests ------------------------------------------------------------------

@case
def manifest_with_zero_heads(ctx):
    def zero_heads(m):
        m["model"]["n_head"] = 0
        m.pop("manifest_fnv1a64", None)  # as a hand-edited manifest of an older checkpoint
    ck = edited_checkpoint(ctx, "ck_heads", zero_heads)
    commands = [ctx.train_args()[:1] + ctx.train_args()[3:] + ["--resume", ck],
                ["generate", "--checkpoint", ck, "--prompt", "hi", "--max-new-tokens", "2"],
                ["export", "--checkpoint", ck, "--output", ctx.path("exported")],
                ["consolidate", ck, "--output", ctx.path("consolidated")]]
    for c in commands:
        expect_error(ctx.run(*c), (2,), "n_head")


@case
def manifest_edited_step(ctx):
    ck = edited_checkpoint(ctx, "ck_step", lambda m: m["progress"].update(step=1))
    expect_error(ctx.run(*ctx.train_args()[:1], *ctx.train_args()[3:], "--resume", ck), (2,),
                 "checksum")


# ---- DeepSpeed and model JSON ----------------------------------------------------------------

@case
def deepspeed_json_nested_200000_deep(ctx):
    with open(ctx.path("deep.json"), "w") as f:
        f.write('{"train_batch_size": ' + "[" * 200000 + "]" * 200000 + "}")
    expect_error(ctx.run(*ctx.train_args("--deepspeed-config", "deep.json")), (2,),
                 "nested deeper")


@case
def deepspeed_json_number_overflow(ctx):
    with open(ctx.path("big.json"), "w") as f:
        f.write('{"optimizer": {"type": "AdamW", "params": {"lr": 1e309}}}')
    expect_error(ctx.run(*ctx.train_args("--deepspeed-config", "big.json")), (2,),
                 "optimizer.params.lr", "out of range")


@case
def deepspeed_json_huge_unknown_key(ctx):
    with open(ctx.path("key.json"), "w") as f:
        f.write('{"' + "k" * 50_000_000 + '": 1}')
    t0 = time.time()
    last = expect_error(ctx.run(*ctx.train_args("--deepspeed-config", "key.json"), timeout=60),
                        (2,), "unknown key", "bytes")
    if time.time() - t0 > 30:
        raise Failure("took more than 30 s")
    return last


@case
def deepspeed_json_value_with_a_nul(ctx):
    with open(ctx.path("nul.json"), "w") as f:
        f.write('{"optimizer": {"type": "Ad\\u0000amW"}}')
    expect_error(ctx.run(*ctx.train_args("--deepspeed-config", "nul.json")), (2,), "\\0amW")


@case
def model_json_nested_and_overflowing(ctx):
    with open(ctx.path("model_deep.json"), "w") as f:
        f.write('{"n_layer": ' + "[" * 100000 + "]" * 100000 + "}")
    args = ctx.train_args()
    expect_error(ctx.run(args[0], "--model", "model_deep.json", *args[3:]), (2,), "nested deeper")
    with open(ctx.path("model_big.json"), "w") as f:
        f.write('{"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 1e999}')
    expect_error(ctx.run(args[0], "--model", "model_big.json", *args[3:]), (2,),
                 "n_positions", "out of range")


# ---- flags ---------------------------------------------------------------------------------

@case
def numbers_a_flag_cannot_hold(ctx):
    for flag, value in (("--comm-timeout", "nan"), ("--offload-ratio", "nan"), ("--lr", "inf"),
                        ("--seed", "99999999999999999999"), ("--seed", "-5"),
                        ("--max-steps", "1e23")):
        status, _, err = ctx.run(*ctx.train_args(flag, value))
        if status == 0 or status > 128 or flag not in err:
            raise Failure(f"{flag} {value}: exit status {status}: {err.strip()[-200:]}")
    status, _, err = ctx.run("estimate", "--model", "gpt2", "--gpu-memory", "nan")
    if status == 0 or "--gpu-memory" not in err:
        raise Failure(f"estimate --gpu-memory nan: exit status {status}: {err.strip()[-200:]}")


# ---- hostfiles -----------------------------------------------------------------------------

@case
def hostfile_host_that_is_an_option(ctx):
    with open(ctx.path("hostfile"), "w") as f:
        f.write("-oProxyCommand=touch%20pwned slots=1\n")
    expect_error(ctx.run("launch", "--hostfile", "hostfile", "--device", "cpu", "--dry-run",
                         "--", "train"), (2,), "not a host name")


# ---- faults --------------------------------------------------------------------------------

def infinity_args(ctx, nvme, steps):
    return ctx.train_args()[:5] + ["--device", "cpu", "--max-steps", str(steps), "--max-length",
                                   "32", "--batch-size", "2", "--no-save", "--strategy",
                                   "infinity", "--nvme-path", nvme]


@case
def swap_files_after_sigterm_and_sigkill(ctx):
    nvme = ctx.path("nvme")
    os.makedirs(nvme, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        p = subprocess.Popen([ctx.binary, *infinity_args(ctx, nvme, 100000)], cwd=ctx.work,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=dict(os.environ, SHARDTRAIN_CACHE_DIR=ctx.path("cache")))
        for line in p.stdout:  # until it trains
            if "step" in line and "loss" in line:
                break
        p.send_signal(sig)
        p.wait(timeout=60)
        left = os.listdir(nvme)
        if left:
            raise Failure(f"{signal.Signals(sig).name} left {left}")


@case
def infinity_run_ends_cleanly(ctx):
    nvme = ctx.path("nvme_end")
    os.makedirs(nvme, exist_ok=True)
    for _ in range(3):
        expect_success(ctx.run(*infinity_args(ctx, nvme, 3)))
    if os.listdir(nvme):
        raise Failure(f"left {os.listdir(nvme)}")


@case
def partial_checkpoints_cleared_at_the_next_start(ctx):
    out = ctx.path("out_partial")
    os.makedirs(os.path.join(out, ".checkpoint-000001.tmp.4242", "x"), exist_ok=True)
    os.makedirs(os.path.join(out, ".checkpoint-000001.old.4243"), exist_ok=True)
    expect_success(ctx.run(*ctx.train_args()[:-1], "--output-dir", out))
    left = [n for n in os.listdir(out) if n.startswith(".")]
    if left:
        raise Failure(f"left {left}")


@case
def metrics_on_a_full_disk(ctx):
    out = ctx.path("out_full")
    os.makedirs(out, exist_ok=True)
    link = os.path.join(out, "metrics.jsonl")
    if not os.path.lexists(link):
        os.symlink("/dev/full", link)
    expect_error(ctx.run(*ctx.train_args()[:-1], "--output-dir", out), (1,), "metrics.jsonl",
                 "No space left")


@case
def summary_without_validation(ctx):
    out = expect_success(ctx.run(*ctx.train_args()))
    done = [line for line in out.splitlines() if line.startswith("done |")]
    if not done:
        raise Failure("no 'done |' line")
    if "nan" in done[0] or "0.00" in done[0].split("perplexity")[-1]:
        raise Failure(done[0])


@case
def ranks_with_different_settings(ctx):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return "skipped: no mpirun"
    a = [ctx.binary, *ctx.train_args()]
    cmd = [mpirun, "--oversubscribe", "--allow-run-as-root", "-np", "1", *a, "--lr", "0.001",
           ":", "-np", "1", *a, "--lr", "0.002"]
    r = subprocess.run(cmd, cwd=ctx.work, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, SHARDTRAIN_CACHE_DIR=ctx.path("cache")))
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    if r.returncode == 0 or len(lines) != 1 or "lr" not in lines[0] or "rank 1" not in lines[0]:
        raise Failure(f"exit status {r.returncode}, error lines {lines[:3]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--binary", required=True)
    p.add_argument("--data-dir", help="build/data (WikiText-2), default: next to the binary")
    p.add_argument("-k", action="append", help="run only the cases whose name holds this")
    args = p.parse_args()
    binary = os.path.abspath(args.binary)
    data_dir = args.data_dir or os.path.join(os.path.dirname(binary), "data")
    cases = [c for c in CASES if not args.k or any(k in c.name for k in args.k)]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="hostile-") as work:
        ctx = Ctx(binary, data_dir, work)
        with open(os.path.join(data_dir, "wikitext-2", "wiki.valid.tokens"), "rb") as f:
            with open(ctx.small, "wb") as g:
                g.write(f.read(300_000))
        for c in cases:
            t0 = time.time()
            try:
                note = c.fn(ctx) or "ok"
                verdict = "PASS"
            except Failure as e:
                note, verdict = str(e), "FAIL"
                failed += 1
            except subprocess.TimeoutExpired as e:
                note, verdict = f"timed out ({e.timeout} s): a hang", "FAIL"
                failed += 1
            print(f"{verdict} {c.name} ({time.time() - t0:.1f} s): {note[:300]}", flush=True)
    print(f"{len(cases) - failed} of {len(cases)} cases hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
