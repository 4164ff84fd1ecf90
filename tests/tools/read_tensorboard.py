#!/usr/bin/env python3
"""Issue 14: a 3-step CPU training run's monitor files, read back by independent readers.

--check tensorboard: `shardtrain train ... --tensorboard DIR`; the event files are read by the
  `tensorboard` Python package's EventAccumulator and must hold train/loss at steps 1, 2, 3 equal
  (as float32) to the losses in metrics.jsonl, the other scalars and the config text.
  Without the tensorboard package the check is skipped (exit 77: CTest's SKIP_RETURN_CODE).
--check csv: the same run configured by a DeepSpeed JSON with "csv_monitor" enabled; the CSV
  files (output_path/job_name/train_loss.csv: step,loss) are read with the csv module.
"""
import argparse
import csv
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

SKIP = 77
STEPS = 3


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def train(binary, workdir, extra):
    out = os.path.join(workdir, "out")
    cmd = [binary, "train", "--model", "gpt2-tiny", "--dataset", "wikitext-2", "--max-steps",
           str(STEPS), "--batch-size", "2", "--max-length", "32", "--device", "cpu", "--no-save", "--eval-samples", "8",
           "--output-dir", out] + extra
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(r.stdout)
    if r.returncode != 0:
        sys.exit(f"shardtrain train failed with exit status {r.returncode}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}
    if not losses or 1 not in losses or STEPS not in losses:
        sys.exit(f"metrics.jsonl has no step records for steps 1 and {STEPS}: {records}")
    return losses, r.stdout


def expect_equal_losses(got, losses, what):
    """got: {step: value}. Every step 1..STEPS is there; metrics.jsonl's steps match as float32."""
    if sorted(got) != list(range(1, STEPS + 1)):
        sys.exit(f"{what}: expected train/loss at steps 1..{STEPS}, got steps {sorted(got)}")
    for step, loss in losses.items():
        if abs(got[step] - f32(loss)) > 1e-6 * max(1.0, abs(loss)):
            sys.exit(f"{what}: train/loss at step {step} is {got[step]}, metrics.jsonl says {loss}")
    print(f"{what}: train/loss {got} matches metrics.jsonl {losses}")


def check_tensorboard(binary, workdir):
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        print(f"SKIP: the tensorboard Python package is not installed ({e}); "
              "scripts/setup.sh installs it with pip")
        return SKIP
    tb_dir = os.path.join(workdir, "tb")
    losses, _ = train(binary, workdir, ["--tensorboard", tb_dir])
    files = [f for f in os.listdir(tb_dir) if f.startswith("events.out.tfevents.")]
    if len(files) != 1 or not files[0].endswith(".v2"):
        sys.exit(f"expected one events.out.tfevents.*.v2 file in {tb_dir}, found {files}")
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    print("tags:", tags)
    scalars = set(tags["scalars"])
    for tag in ["train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
                "memory/host_peak_bytes", "val/loss", "val/perplexity"]:
        if tag not in scalars:
            sys.exit(f"scalar {tag} missing from the event file (scalars: {sorted(scalars)})")
    expect_equal_losses({e.step: e.value for e in acc.Scalars("train/loss")}, losses,
                        "tensorboard")
    if len(acc.Scalars("train/lr")) != STEPS:
        sys.exit(f"train/lr: expected {STEPS} values, got {acc.Scalars('train/lr')}")
    val = acc.Scalars("val/loss")[-1].value
    ppl = acc.Scalars("val/perplexity")[-1].value
    if not (abs(ppl - f32(2.718281828459045 ** val)) <= 1e-3 * ppl):
        sys.exit(f"val/perplexity {ppl} is not exp(val/loss {val})")
    if "config" not in tags["tensors"]:
        sys.exit(f"the config text is missing (tensors: {tags['tensors']})")
    text = acc.Tensors("config")[0].tensor_proto.string_val[0].decode()
    if "gpt2-tiny" not in text or '"tensorboard"' not in text:
        sys.exit(f"the config text does not name the model and the monitor: {text}")
    print("tensorboard: OK")
    return 0


def check_csv(binary, workdir):
    ds = os.path.join(workdir, "ds.json")
    out_path = os.path.join(workdir, "csv")
    with open(ds, "w") as f:
        json.dump({"csv_monitor": {"enabled": True, "output_path": out_path, "job_name": "job"},
                   "wandb": {"enabled": True, "project": "x"}}, f)
    losses, log = train(binary, workdir, ["--deepspeed-config", ds])
    if "wandb" not in log or "not supported offline" not in log:
        sys.exit("no warning about the wandb section")
    job = os.path.join(out_path, "job")
    with open(os.path.join(job, "train_loss.csv"), newline="") as f:
        rows = list(csv.reader(f))
    if rows[0] != ["step", "loss"]:
        sys.exit(f"train_loss.csv header {rows[0]}, expected ['step', 'loss']")
    expect_equal_losses({int(r[0]): f32(float(r[1])) for r in rows[1:]}, losses, "csv")
    for name in ["train_lr.csv", "val_loss.csv", "memory_host_peak_bytes.csv"]:
        if not os.path.exists(os.path.join(job, name)):
            sys.exit(f"{name} missing from {job}: {sorted(os.listdir(job))}")
    print("csv: OK")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--binary", required=True)
    ap.add_argument("--check", choices=["tensorboard", "csv"], required=True)
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix=f"shardtrain_monitor_{args.check}_")
    try:
        check = check_tensorboard if args.check == "tensorboard" else check_csv
        return check(args.binary, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
