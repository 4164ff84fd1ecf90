#!/usr/bin/env python3
"""Equivalence suite for shardtrain's parallel strategies on N GPUs (or N CPU ranks).

Trains small GPT-2 and image models under every strategy with the same global batch as a
one-device data-parallel reference, reads the final (sharded) checkpoints and metrics.jsonl of
each run, and writes a Markdown report with one row per comparison. Exit status 1 when any
check fails.

Checks (all with the same global batch, seed and learning-rate schedule as their reference):
  gpt2-fp32/*   --precision fp32: dp, zero1, zero2, zero3 (prefetch on / off, persistence
                threshold), ZeRO-Offload (ratio 1 and 0.5), ZeRO-Infinity (NVMe), pipeline
                (gpipe, 1f1b, interleaved-1f1b, zb-h1 at 2 stages; 2 stages x 2 replicas when
                N >= 4) equal to 1-device dp: parameters and printed losses. PipeDream-2BW
                uses one-step-stale weights by design: it is only checked to train.
  gpt2-bf16/*   bf16 (GPU only): loss curves within a stated tolerance of 1-GPU dp's.
  image/*       cnn and mobilenet_v2 on Fashion-MNIST (32x32, fp32) under ddp, fsdp_stage2 and
                fsdp_stage3, with and without --sync-batchnorm, against the 1-device run whose
                batch norm sees the same samples (the whole global batch with it, one rank's
                micro-batch without): equal through an early step, then close in loss over the
                whole run (rounding differences grow chaotically in training); ZeRO stages equal
                to ddp on the same devices; without --sync-batchnorm also close in loss to the
                global-batch run (the one difference by design). mobilenet_v2 keeps its dropout,
                whose masks are drawn per rank, so against 1 device it is only held close.
  resume/*      a sharded checkpoint of N ranks resumes on 1 (and one of 1 on N) and continues
                the same loss trajectory.

Run (the report is Markdown; the work directory keeps every run's command, log, metrics and,
with --keep-checkpoints, its checkpoints):
    python3 tests/gpu/equivalence.py --device cuda --gpus 2 --report report.md
    python3 tests/gpu/equivalence.py --device cpu --ranks 2 --report report-cpu.md
    python3 tests/gpu/equivalence.py --list                # the checks and what N allows
    python3 tests/gpu/equivalence.py --only 'gpt2-fp32/zero3'   # a regular expression
tests/gpu/run_equivalence.sh wraps the GPU form. The binary is --binary, else $SHARDTRAIN,
else build/shardtrain of this repository, else `shardtrain` on the PATH. Needs Python 3.8+
and numpy only (safetensors files are read directly).
"""
import argparse
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np

from equivalence_runs import (  # noqa: E402 (tests/gpu is on sys.path: this script's folder)
    REPO,
    PARAM_TOL,
    NOISE_FACTOR,
    LOSS_DIGITS,
    STRADDLE_TOL,
    BF16_LOSS_TOL,
    ELEMENT_TOL_LR,
    IMAGE_CLOSE_TOL,
    LOCAL_BN_TOL,
    PEAK_LR,
    IMAGE_DROPOUT_ALWAYS_ON,
    log,
    read_safetensors_header,
    read_tensor,
    checkpoint_dir,
    Checkpoint,
    param_diff,
    buffer_diff,
    read_metrics,
    printed,
    compare_losses,
    RunSpec,
    Registry,
    Executor,
    Row,
    Check,
)


class Suite:
    def __init__(self, opts):
        self.o = opts
        self.reg = Registry()
        self.checks = []
        self.ckpt_cache = {}
        self.work = os.path.abspath(opts.work_dir)
        n = opts.n
        cpu = opts.device == "cpu"
        self.unit = "rank" if cpu else "GPU"
        # GPT-2: micro-batch b everywhere; global batch G = b * 2 * N
        self.b = 2
        self.G = self.b * 2 * n
        self.k = opts.steps // 2  # resume point
        self.define_gpt2_fp32()
        if not cpu:
            self.define_gpt2_bf16()
        self.define_images()
        self.define_resume()
        self.checks.append(Check(
            "reader/consolidate",
            f"the parameters this program reads from the shards of zero2 on {self.units(n)} vs "
            "`shardtrain consolidate`'s model.safetensors (Conv1D weights transposed back)",
            {"run": self.fp32_zero2}, self.eval_reader, needs=n))
        if cpu:
            self.checks.append(Check("gpt2-bf16/*", "bf16 loss curves", {}, None, gpu_only=True,
                                     why="bf16 needs a GPU"))

    # -- helpers
    def units(self, w):
        return f"{w} {self.unit}{'s' if w != 1 else ''}"

    def gpt2_args(self, steps, precision, b, a, extra=()):
        return ["--model", self.o.model, "--dataset", "wikitext-2", "--max-length", self.o.max_length,
                "--max-steps", steps, "--warmup-steps", 2, "--seed", 1234, "--log-interval", 1,
                "--eval-samples", 16, "--precision", precision,
                "--batch-size", b, "--gradient-accumulation-steps", a, *extra]

    def add_run(self, key, world, args, ds=None, resume=None, env=None):
        return self.reg.add(RunSpec(key, world, args, ds, resume, env=env))

    def nvme(self, key):
        return os.path.join(self.work, "nvme", key)

    def strategies(self, prefix, precision):
        """(name, world, args, ds, description) of every strategy of the GPT-2 groups."""
        n = self.o.n
        b = self.b
        a_n = self.G // (b * n)
        a_pipe = self.G // b  # 2 stages x 1 replica
        out = [
            ("dp", n, ["--strategy", "dp"], None, "dp"),
            ("zero1", n, ["--strategy", "zero1"], None, "zero1"),
            ("zero2", n, ["--strategy", "zero2"], None, "zero2"),
            ("zero3", n, ["--strategy", "zero3"], None,
             "zero3, prefetch on (stage3_prefetch_bucket_size 5e7, persistence 1e5)"),
        ]
        if precision == "fp32":
            out.insert(1, ("dp-no-overlap", n, [], {"zero_optimization": {
                "stage": 0, "overlap_comm": False}}, "dp with overlap_comm false (DeepSpeed config)"))
            out += [
                ("zero3-noprefetch", n, [], {"zero_optimization": {
                    "stage": 3, "stage3_prefetch_bucket_size": 0,
                    "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}},
                 "zero3, prefetch off, nothing persistent, released after each use"),
                ("zero3-persist", n, [], {"zero_optimization": {
                    "stage": 3, "stage3_param_persistence_threshold": 2000000}},
                 "zero3, stage3_param_persistence_threshold 2e6 (every block resident)"),
            ]
        out += [
            ("offload", n, [], {"zero_optimization": {"stage": 2, "offload_optimizer": {
                "device": "cpu"}}}, "ZeRO-Offload: stage 2, offload_optimizer cpu"),
        ]
        if precision == "fp32":
            out.append(("offload-r0.5", n, [], {"zero_optimization": {"stage": 2, "offload_optimizer": {
                "device": "cpu", "ratio": 0.5}}}, "ZeRO-Offload, offload_optimizer.ratio 0.5"))
        out.append(("infinity", n, [], {"zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": self.nvme(f"{prefix}-infinity")},
            "offload_param": {"device": "cpu"}}},
            "ZeRO-Infinity: stage 3, offload_optimizer nvme, offload_param cpu"))
        out = [(nm, w, args + ["_a", a_n], ds, desc) for nm, w, args, ds, desc in out]
        schedules = (["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "2bw"] if precision == "fp32"
                     else ["1f1b", "zb-h1"])
        for s in schedules:
            v = ["--virtual-stages", 2] if s == "interleaved-1f1b" else []
            out.append((f"pipeline-{s}", 2, ["--strategy", "pipeline", "--pipeline-stages", 2,
                                             "--pipeline-schedule", s, *v, "_a", a_pipe], None,
                        f"pipeline {s}, 2 stages{' x 2 virtual' if v else ''}"))
        out.append(("pipeline-1f1b-2x2", 4, ["--strategy", "pipeline", "--pipeline-stages", 2,
                                             "--pipeline-schedule", "1f1b", "--zero-stage", 1,
                                             "_a", self.G // (2 * b)], None,
                    "pipeline 1f1b, 2 stages x 2 replicas, ZeRO-1 across replicas"))
        return out

    def split_a(self, args):
        i = args.index("_a")
        return args[:i] + args[i + 2:], args[i + 1]

    def batch_text(self, world, a, stages=1):
        d = world // stages
        return f"{self.b}x{a}x{d}" if stages == 1 else f"{self.b}x{a}x{d} ({stages} stages)"

    def define_gpt2_fp32(self):
        o, n, steps = self.o, self.o.n, self.o.steps
        ref_a = self.G // self.b
        ref = self.add_run("gpt2-fp32-ref", 1, self.gpt2_args(steps, "fp32", self.b, ref_a,
                                                            ["--save-interval", self.k]))
        self.fp32_ref = ref
        ref_text = f"dp on 1 {self.unit} ({self.b}x{ref_a}x1)"
        for name, world, args, ds, desc in self.strategies("gpt2-fp32", "fp32"):
            args, a = self.split_a(args)
            extra = ["--save-interval", self.k] if name == "zero2" else []
            key = self.add_run(f"gpt2-fp32-{name}", world, self.gpt2_args(steps, "fp32", self.b, a, args + extra), ds)
            if name == "zero2":
                self.fp32_zero2 = key
            stages = 2 if name.startswith("pipeline") else 1
            compared = (f"{desc} on {self.units(world)} ({self.batch_text(world, a, stages)}) "
                        f"vs {ref_text}, {steps} steps")
            if name == "pipeline-2bw":
                ev = self.eval_trains
                compared = (f"{desc} on {self.units(world)}: loss falls (one-step-stale weights by "
                            f"design, so not equal to dp; difference shown), {steps} steps")
            else:
                ev = self.eval_exact
            self.checks.append(Check(f"gpt2-fp32/{name}", compared, {"run": key, "ref": ref}, ev,
                                     needs=world, why=f"needs {self.units(world)}"))

    def define_gpt2_bf16(self):
        n, steps = self.o.n, self.o.bf16_steps
        ref_a = self.G // self.b
        ref = self.add_run("gpt2-bf16-ref", 1, self.gpt2_args(steps, "bf16", self.b, ref_a))
        for name, world, args, ds, desc in self.strategies("gpt2-bf16", "bf16"):
            args, a = self.split_a(args)
            key = self.add_run(f"gpt2-bf16-{name}", world, self.gpt2_args(steps, "bf16", self.b, a, args), ds)
            stages = 2 if name.startswith("pipeline") else 1
            compared = (f"{desc} on {self.units(world)} ({self.batch_text(world, a, stages)}) vs "
                        f"dp on 1 GPU ({self.b}x{ref_a}x1), bf16, {steps} steps")
            self.checks.append(Check(f"gpt2-bf16/{name}", compared, {"run": key, "ref": ref},
                                     self.eval_bf16, needs=world, gpu_only=True,
                                     why=f"needs {self.units(world)}"))

    def image_args(self, model, b, a, extra=()):
        o = self.o
        g = o.image_batch * o.n
        # --dropout 0: no classifier dropout or stochastic depth (their masks are drawn per rank)
        return ["--model", model, "--dataset", "fashion-mnist", "--image-size", 32, "--precision", "fp32",
                "--max-steps", o.image_steps, "--num-samples", o.image_steps * g,
                "--eval-samples", o.image_eval, "--warmup-steps", 2, "--seed", 1234, "--dropout", 0,
                "--log-interval", 1, "--save-interval", self.image_exact_step(),
                "--batch-size", b, "--gradient-accumulation-steps", a, *extra]

    def image_exact_step(self):
        return min(self.o.image_exact_step, self.o.image_steps)

    def define_images(self):
        o, n, bi = self.o, self.o.n, self.o.image_batch
        e = self.image_exact_step()
        for model in ("cnn", "mobilenet_v2"):
            ref_g = self.add_run(f"image-{model}-ref-global", 1, self.image_args(model, bi * n, 1))
            ref_l = self.add_run(f"image-{model}-ref-local", 1, self.image_args(model, bi, n))
            # The floor: the reference against itself with another summation order — on GPUs the
            # same command again (cuDNN's algorithms add in a varying order), on CPUs with 2
            # OpenMP threads instead of 1.
            again = self.add_run(f"image-{model}-ref-global-again", 1,
                                 self.image_args(model, bi * n, 1),
                                 env={"OMP_NUM_THREADS": "2"} if self.o.device == "cpu"
                                 else {"SHARDTRAIN_EQUIVALENCE_RERUN": "1"})
            self.checks.append(Check(
                f"image/{model}-noise", f"{model} dp on 1 {self.unit}, run again "
                + ("with 2 OpenMP threads" if self.o.device == "cpu" else "(the same command)"),
                {"run": again, "ref": ref_g}, self.eval_image_noise, needs=1))
            noise = {"noise": again, "noise_ref": ref_g}
            dropout = model in IMAGE_DROPOUT_ALWAYS_ON
            for sync in (True, False):
                tag = "syncbn" if sync else "localbn"
                ddp = None
                for strat in ("ddp", "fsdp_stage2", "fsdp_stage3"):
                    extra = ["--strategy", strat] + (["--sync-batchnorm"] if sync else [])
                    key = self.add_run(f"image-{model}-{strat}-{tag}", n, self.image_args(model, bi, 1, extra))
                    what = f"{model} {strat}{' --sync-batchnorm' if sync else ''} on {self.units(n)} ({bi}x1x{n})"
                    if dropout:
                        how = (f"close over {o.image_steps} steps (not equal: its dropout, always on, "
                               "draws masks per rank)")
                    else:
                        how = f"equal through step {e}, close over {o.image_steps} steps"
                    ref_text = (f"({bi * n}x1x1: batch norm over the global batch)" if sync else
                                f"({bi}x{n}x1: batch norm over one rank's micro-batch)")
                    # On GPUs a --sync-batchnorm run convolves per-GPU batches of bi images
                    # against the reference's bi·n: cuDNN times and picks its algorithms per
                    # geometry (cudnnFind), and they sum in other orders.
                    geometry = sync and self.o.device == "cuda" and n > 1
                    if geometry:
                        how = (f"close over {o.image_steps} steps (cuDNN picks other convolution "
                               f"algorithms for batches of {bi} than of {bi * n})")
                    self.checks.append(Check(
                        f"image/{model}-{strat}-{tag}", f"{what} vs dp on 1 {self.unit} {ref_text}, {how}",
                        {"run": key, "ref": ref_g if sync else ref_l, **noise},
                        self.eval_image_close if dropout or geometry else self.eval_image_exact,
                        needs=n))
                    if strat == "ddp":
                        ddp = key
                    else:
                        self.checks.append(Check(
                            f"image/{model}-{strat}-{tag}-vs-ddp",
                            f"{what} vs ddp{' --sync-batchnorm' if sync else ''} on {self.units(n)}, "
                            f"equal through step {e}, close over {o.image_steps} steps",
                            {"run": key, "ref": ddp, **noise}, self.eval_image_exact, needs=n))
                    if not sync:
                        self.checks.append(Check(
                            f"image/{model}-{strat}-localbn-vs-global",
                            f"{what} vs dp on 1 {self.unit} ({bi * n}x1x1): per-rank batch-norm statistics "
                            f"differ by design; loss must stay close over {o.image_steps} steps",
                            {"run": key, "ref": ref_g}, self.eval_local_vs_global, needs=max(2, n),
                            why="needs 2 or more devices (one device has no per-rank statistics)"))

    def define_resume(self):
        n, steps, k = self.o.n, self.o.steps, self.k
        if n < 2 or k < 1:
            self.checks.append(Check("resume/*", "checkpoint resharding", {}, None, needs=2,
                                     why=f"needs 2 or more {self.unit}s" if n < 2 else "needs 2+ steps"))
            return
        ref_a = self.G // self.b
        down = self.add_run(f"resume-zero2x{n}-to-dp1", 1,
                            self.gpt2_args(steps, "fp32", self.b, ref_a, ["--strategy", "dp"]),
                            resume=(self.fp32_zero2, k))
        self.checks.append(Check(
            f"resume/zero2x{n}-to-dp1",
            f"zero2 checkpoint of {self.units(n)} at step {k}, resumed by dp on 1 {self.unit} "
            f"({self.b}x{ref_a}x1), vs the uninterrupted zero2 run, steps {k + 1}-{steps}",
            {"run": down, "ref": self.fp32_zero2}, self.eval_resume, needs=2))
        up = self.add_run(f"resume-dp1-to-zero3x{n}", n,
                          self.gpt2_args(steps, "fp32", self.b, 2, ["--strategy", "zero3"]),
                          resume=(self.fp32_ref, k))
        self.checks.append(Check(
            f"resume/dp1-to-zero3x{n}",
            f"dp checkpoint of 1 {self.unit} at step {k}, resumed by zero3 on {self.units(n)} "
            f"({self.b}x2x{n}), vs the uninterrupted 1-{self.unit} run, steps {k + 1}-{steps}",
            {"run": up, "ref": self.fp32_ref}, self.eval_resume, needs=2))

    # -- evaluation
    def ckpt(self, key, step=None):
        ck = (key, step)
        if ck not in self.ckpt_cache:
            self.ckpt_cache[ck] = Checkpoint(checkpoint_dir(self.reg.runs[key].dir, step))
        return self.ckpt_cache[ck]

    def metrics(self, key):
        return read_metrics(self.reg.runs[key].dir)

    def exact_parts(self, c, steps, step=None, element_bar=True, val=True, tol=PARAM_TOL):
        """Parameters (at `step`, default the last; relative difference ≤ `tol`) and printed
        losses over `steps` of the run against its reference: the problems that fail the row, and
        notes."""
        run, ref = c.runs["run"], c.runs["ref"]
        pd = param_diff(self.ckpt(run, step), self.ckpt(ref, step))
        la, va = self.metrics(run)
        lb, vb = self.metrics(ref)
        cl = compare_losses(la, lb, steps)
        problems = []
        if not pd["rel"] <= tol:
            problems.append(f"parameters differ by {pd['rel']:.2e} > {tol:.2g}")
        bar = ELEMENT_TOL_LR * PEAK_LR
        if element_bar and not pd["max_abs"] <= bar:
            problems.append(f"an element differs by {pd['max_abs']:.1e} > {ELEMENT_TOL_LR:g} lr ({bar:.0e})")
        if cl["missing"]:
            problems.append(f"steps missing from metrics.jsonl: {cl['missing']}")
        if cl["mismatch"]:
            s = cl["mismatch"][0]
            problems.append(f"printed losses differ at {len(cl['mismatch'])} step(s), first step {s}: "
                            f"{printed(la[s])} vs {printed(lb[s])}")
        notes = ([f"worst tensor {pd['worst_tensor']} {pd['worst_tensor_rel']:.1e}",
                  f"max |Δparam| {pd['max_abs']:.1e}"] if pd["max_abs"] > 0 else
                 ["parameters bit-identical"])
        if cl["straddle"]:
            notes.append(f"steps {cl['straddle']} straddle a rounding boundary (|Δ| ≤ {STRADDLE_TOL:g})")
        if val and va is not None and vb is not None:
            if printed(va) != printed(vb) and abs(va - vb) > STRADDLE_TOL:
                problems.append(f"validation loss {printed(va)} vs {printed(vb)}")
            notes.append(f"val loss {printed(va)} vs {printed(vb)}")
        return pd, cl, problems, notes

    def eval_exact(self, c):
        steps = range(1, self.o.steps + 1)
        pd, cl, problems, notes = self.exact_parts(c, steps)
        return Row("FAIL" if problems else "PASS", f"{pd['rel']:.2e}", f"{cl['max']:.1e}",
                   "; ".join(problems + notes))

    def closeness(self, c, tol):
        """Image runs over the whole run: the mean of the per-step training-loss differences over
        the last half of the steps must be within `tol`, or within 3 standard errors of those
        differences where the steps are noisier than that (a paired test: runs that drifted apart
        by rounding differ by noise around 0, a real difference shifts the mean). The held-out
        loss (one evaluation, no noise estimate) is shown. Returns (problems, notes, |mean|)."""
        la, va = self.metrics(c.runs["run"])
        lb, vb = self.metrics(c.runs["ref"])
        steps = self.o.image_steps
        first = steps // 2 + 1
        half = [s for s in range(first, steps + 1) if s in la and s in lb]
        problems, notes = [], []
        if len(half) != steps - steps // 2:
            problems.append("steps missing from metrics.jsonl")
        d = [la[s] - lb[s] for s in half]
        dmean = abs(sum(d) / max(len(d), 1))
        se = (float(np.std(d, ddof=1)) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
        bound = max(tol, 3 * se) if math.isfinite(se) else tol
        if not dmean <= bound:
            problems.append(f"mean loss over steps {first}-{steps} differs by {dmean:.3f} > {bound:.3f}")
        ma = sum(la[s] for s in half) / max(len(half), 1)
        mb = sum(lb[s] for s in half) / max(len(half), 1)
        notes.append(f"mean loss over steps {first}-{steps} {ma:.4f} vs {mb:.4f} (bound {bound:.3f}: "
                     f"{tol:g} or 3 standard errors of the per-step differences, {se:.1e} each)")
        if va is not None and vb is not None:
            notes.append(f"held-out loss {va:.4f} vs {vb:.4f}")
        dmax = max((abs(la[s] - lb[s]) for s in la if s in lb), default=float("nan"))
        notes.append(f"largest per-step |Δloss| {dmax:.1e}")
        return problems, notes, dmean

    def image_end_notes(self, c):
        notes = []
        end = param_diff(self.ckpt(c.runs["run"]), self.ckpt(c.runs["ref"]))
        notes.append(f"final parameters {end['rel']:.1e} apart")
        bd = buffer_diff(self.ckpt(c.runs["run"]), self.ckpt(c.runs["ref"]))
        if bd is not None:
            per_rank = "localbn" in c.name and not c.name.endswith("-vs-ddp")
            notes.append(f"running statistics (rank 0) {bd:.1e} apart"
                         + (" (per-rank by design)" if per_rank else ""))
        return notes

    def image_tolerance(self, c):
        """PARAM_TOL, or NOISE_FACTOR × the parameter difference of the model's 1-device
        reference from its own rerun with another summation order at the exact step, when that
        is larger: a change of rounding grows through batch norm and AdamW's normalized updates of
        near-zero gradients (mobilenet_v2's 1-rank run with 2 OpenMP threads instead of 1 prints a
        different loss from step 3 on), so that is the scale on which two runs can agree."""
        if "noise" not in c.runs:
            return PARAM_TOL, None
        e = self.image_exact_step()
        noise = param_diff(self.ckpt(c.runs["noise"], e), self.ckpt(c.runs["noise_ref"], e))["rel"]
        return max(PARAM_TOL, NOISE_FACTOR * noise), noise

    def eval_image_exact(self, c):
        e = self.image_exact_step()
        tol, noise = self.image_tolerance(c)
        pd, cl, problems, notes = self.exact_parts(c, range(1, e + 1), step=e, element_bar=False,
                                                   val=False, tol=tol)
        close_tol = IMAGE_CLOSE_TOL
        if noise is not None:
            notes.append(f"bound {tol:.2g} = max({PARAM_TOL:g}, {NOISE_FACTOR:g} × the reference's "
                         f"own difference from its rerun, {noise:.2e})")
            # Printed losses and the run's mean loss are held to the same scale: a step whose
            # printed loss differs is a problem only where the rerun's differs NOISE_FACTOR times
            # less, and the mean over the last half within NOISE_FACTOR × the rerun's.
            la, _ = self.metrics(c.runs["run"])
            lb, _ = self.metrics(c.runs["ref"])
            ln, _ = self.metrics(c.runs["noise"])
            lr, _ = self.metrics(c.runs["noise_ref"])
            allowed = [s_ for s_ in cl["mismatch"] if s_ in ln and s_ in lr and
                       abs(la[s_] - lb[s_]) <= NOISE_FACTOR * abs(ln[s_] - lr[s_])]
            if allowed:
                problems = [p_ for p_ in problems if not p_.startswith("printed losses differ")]
                rest = [s_ for s_ in cl["mismatch"] if s_ not in allowed]
                if rest:
                    problems.append(f"printed losses differ at step(s) {rest} beyond the rerun's")
                notes.append(f"printed losses at steps {allowed} differ as the rerun's do")
            pseudo = Check(c.name + "/noise", "", {"run": c.runs["noise"], "ref": c.runs["noise_ref"]},
                           None)
            _, _, noise_mean = self.closeness(pseudo, float("inf"))
            close_tol = max(IMAGE_CLOSE_TOL, NOISE_FACTOR * abs(noise_mean))
        notes = [f"step {e}: " + ", ".join(notes)]
        more, close_notes, _ = self.closeness(c, close_tol)
        notes.append(f"over {self.o.image_steps} steps: "
                     + ", ".join(close_notes + self.image_end_notes(c)))
        return Row("FAIL" if problems + more else "PASS", f"{pd['rel']:.2e} @{e}",
                   f"{cl['max']:.1e} @1-{e}", "; ".join(problems + more + notes))

    def eval_image_close(self, c):
        problems, notes, dmean = self.closeness(c, IMAGE_CLOSE_TOL)
        la, _ = self.metrics(c.runs["run"])
        lb, _ = self.metrics(c.runs["ref"])
        first = (f"step 1 loss {printed(la.get(1, float('nan')))} vs {printed(lb.get(1, float('nan')))}")
        notes = [first] + notes + self.image_end_notes(c)
        notes.append("not held equal: the convolutions run other cuDNN algorithms at the per-GPU "
                     "batch than at the reference's (their rounding grows through batch norm and "
                     "AdamW); the -vs-ddp rows check the strategies exactly, the localbn rows "
                     "(equal per-device batch) and the CPU ranks the synchronized statistics")
        end = param_diff(self.ckpt(c.runs["run"]), self.ckpt(c.runs["ref"]))
        return Row("FAIL" if problems else "PASS", f"{end['rel']:.2e} (info)", f"{dmean:.1e} (mean)",
                   "; ".join(problems + notes))

    def eval_reader(self, c):
        """The instrument: the flat parameters assembled from every rank's ranges must equal,
        tensor by tensor, what `shardtrain consolidate` writes (Hugging Face layout)."""
        run = self.reg.runs[c.runs["run"]]
        out = os.path.join(run.dir, "consolidated")
        cmd = [self.o.binary, "consolidate", run.dir, "--output", out]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return Row("FAIL", note=f"{' '.join(cmd)} failed: {(r.stderr or r.stdout).strip()[-300:]}")
        ck = self.ckpt(c.runs["run"])
        path = os.path.join(out, "model.safetensors")
        header, base = read_safetensors_header(path)
        bad, worst = [], 0.0
        for name, off, n in ck.tensors:
            if name not in header:
                bad.append(f"{name} missing")
                continue
            hf = read_tensor(path, name, header, base).reshape(header[name]["shape"])
            mine = ck.params[off:off + n]
            same = np.array_equal(mine, hf.reshape(-1)) or (
                hf.ndim == 2 and np.array_equal(mine, hf.T.reshape(-1)))
            if not same:
                bad.append(name)
        extra = [k for k in header if k != "__metadata__" and k not in {t[0] for t in ck.tensors}]
        shutil.rmtree(out, ignore_errors=True)
        note = (f"{len(ck.tensors)} tensors, {ck.numel:,} parameters bit-identical"
                + (f"; also in model.safetensors: {', '.join(extra[:3])}" if extra else ""))
        if bad:
            return Row("FAIL", "", "", f"differ: {', '.join(bad[:5])}; {note}")
        return Row("PASS", f"{worst:.2e}", "", note)

    def eval_resume(self, c):
        steps = range(self.k + 1, self.o.steps + 1)
        pd, cl, problems, notes = self.exact_parts(c, steps)
        la, _ = self.metrics(c.runs["run"])
        early = [s for s in la if s <= self.k]
        if early:
            problems.append(f"the resumed run logged steps {early} (should start at {self.k + 1})")
        return Row("FAIL" if problems else "PASS", f"{pd['rel']:.2e}", f"{cl['max']:.1e}",
                   "; ".join(problems + notes))

    def eval_trains(self, c):
        la, va = self.metrics(c.runs["run"])
        lb, vb = self.metrics(c.runs["ref"])
        steps = self.o.steps
        pd = param_diff(self.ckpt(c.runs["run"]), self.ckpt(c.runs["ref"]))
        problems = []
        missing = [s for s in range(1, steps + 1) if s not in la]
        if missing:
            problems.append(f"steps missing: {missing}")
        if not all(math.isfinite(v) for v in la.values()):
            problems.append("non-finite loss")
        nan = float("nan")
        drop = la.get(1, nan) - la.get(steps, nan)
        ref_drop = lb.get(1, nan) - lb.get(steps, nan)
        if not (drop > 0 and drop >= 0.5 * ref_drop):
            problems.append(f"loss fell by {drop:.4f}, less than half the reference's {ref_drop:.4f}")
        if printed(la.get(1, nan)) != printed(lb.get(1, nan)):
            problems.append(f"step 1 loss {printed(la.get(1, nan))} != reference {printed(lb.get(1, nan))} "
                            "(same initial weights)")
        dl = max((abs(la[s] - lb[s]) for s in la if s in lb), default=nan)
        notes = [f"loss {printed(la.get(1, nan))} → {printed(la.get(steps, nan))} (reference → "
                 f"{printed(lb.get(steps, nan))}); pass: step 1 equal, then falls by at least half the "
                 "reference's drop; parameters and losses shown for information"]
        if va is not None and vb is not None:
            notes.append(f"val loss {printed(va)} vs {printed(vb)}")
        return Row("FAIL" if problems else "PASS", f"{pd['rel']:.2e} (info)", f"{dl:.1e} (info)",
                   "; ".join(problems + notes))

    def eval_bf16(self, c):
        la, va = self.metrics(c.runs["run"])
        lb, vb = self.metrics(c.runs["ref"])
        steps = range(1, self.o.bf16_steps + 1)
        problems = []
        missing = [s for s in steps if s not in la or s not in lb]
        if missing:
            problems.append(f"steps missing: {missing}")
        deltas = [(abs(la[s] - lb[s]), s) for s in steps if s in la and s in lb]
        worst, at = max(deltas) if deltas else (float("nan"), 0)
        if not worst <= BF16_LOSS_TOL:
            problems.append(f"|Δloss| {worst:.1e} at step {at} > {BF16_LOSS_TOL:g}")
        pd = param_diff(self.ckpt(c.runs["run"]), self.ckpt(c.runs["ref"]))
        notes = [f"largest at step {at}", f"tolerance {BF16_LOSS_TOL:g}"]
        if va is not None and vb is not None:
            notes.append(f"val loss {printed(va)} vs {printed(vb)}")
        return Row("FAIL" if problems else "PASS", f"{pd['rel']:.2e} (info)", f"{worst:.1e}",
                   "; ".join(problems + notes))

    def eval_local_vs_global(self, c):
        """The stated difference (per-rank batch-norm statistics against the global batch's):
        measured and reported, not held to a bound."""
        problems, notes, dmean = self.closeness(c, LOCAL_BN_TOL)
        pd = param_diff(self.ckpt(c.runs["run"]), self.ckpt(c.runs["ref"]))
        bd = buffer_diff(self.ckpt(c.runs["run"]), self.ckpt(c.runs["ref"]))
        if bd is not None:
            notes.append(f"running statistics {bd:.1e} apart")
        notes = [p.replace(" > ", " (informative bound ") + ")" for p in problems] + notes
        return Row("INFO", f"{pd['rel']:.2e} (info)", f"{dmean:.1e} (mean)", "; ".join(notes))

    def eval_image_noise(self, c):
        """The 1-GPU reference against its own rerun: the floor the image rows are held to."""
        e = self.image_exact_step()
        pd = param_diff(self.ckpt(c.runs["run"], e), self.ckpt(c.runs["ref"], e))
        return Row("INFO", f"{pd['rel']:.2e} @{e}", "", "run-to-run difference of the 1-GPU "
                   "reference (same command twice)")

    # -- selection and running
    def skip_reason(self, c):
        if c.evaluate is None:
            return c.why
        if c.gpu_only and self.o.device == "cpu":
            return "needs a GPU"
        if c.needs > self.o.n:
            return c.why or f"needs {self.units(c.needs)}"
        return ""

    def selected(self):
        pat = re.compile(self.o.only) if self.o.only else None
        return [c for c in self.checks if not pat or pat.search(c.name)]

    def run(self):
        checks = self.selected()
        active = [c for c in checks if not self.skip_reason(c)]
        for c in checks:
            if self.skip_reason(c):
                c.row = Row("SKIP", note=self.skip_reason(c))
        keys = []
        for c in active:
            for k in c.runs.values():
                if k not in keys:
                    keys.append(k)
        # reference counts: a run's checkpoints go once every check and resume using it is done
        for c in active:
            for k in set(c.runs.values()):
                self.reg.runs[k].consumers += 1
        for k in keys:
            for d in self.reg.runs[k].deps():
                self.reg.runs[d].consumers += 1
        os.makedirs(os.path.join(self.work, "runs"), exist_ok=True)
        ex = Executor(self.o, self.reg, self.work)
        waiting = list(active)

        def release(key):
            spec = self.reg.runs[key]
            spec.consumers -= 1
            if spec.consumers <= 0:
                for ck in [ck for ck in self.ckpt_cache if ck[0] == key]:
                    del self.ckpt_cache[ck]
                if not self.o.keep_checkpoints and spec.dir and os.path.isdir(spec.dir):
                    for name in os.listdir(spec.dir):
                        if name.startswith("checkpoint-") or name == "latest":
                            p = os.path.join(spec.dir, name)
                            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
                    nv = self.nvme(key)
                    if os.path.isdir(nv):
                        shutil.rmtree(nv)

        def on_done(spec):
            for d in spec.deps():
                release(d)
            for c in list(waiting):
                runs = [self.reg.runs[k] for k in c.runs.values()]
                if any(r.status in ("pending", "running") for r in runs):
                    continue
                waiting.remove(c)
                bad = [r for r in runs if r.status != "ok"]
                if bad:
                    c.row = Row("FAIL", note="; ".join(f"run {r.key} {r.status}: {r.error}" for r in bad))
                else:
                    try:
                        c.row = c.evaluate(c)
                    except Exception as e:  # a malformed checkpoint or metrics file
                        c.row = Row("FAIL", note=f"could not compare: {type(e).__name__}: {e}")
                log(f"  {c.row.status:4s} {c.name}: param {c.row.param or '-'}, loss {c.row.loss or '-'}"
                    + (f" — {c.row.note}" if c.row.status == "FAIL" else ""))
                for k in set(c.runs.values()):
                    release(k)

        ex.execute(keys, on_done)
        return checks


# ---- report --------------------------------------------------------------------------------

def md(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def describe_device(opts):
    if opts.device == "cpu":
        return f"CPU, {opts.n} MPI rank{'s' if opts.n != 1 else ''} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')})"
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split("\n")
        names = [x.strip() for x in names if x.strip()]
    except (OSError, subprocess.SubprocessError):
        names = []
    kinds = sorted(set(names))
    return f"{opts.n} GPU{'s' if opts.n != 1 else ''}" + (f" ({', '.join(kinds)})" if kinds else "")


def binary_version(binary):
    try:
        return subprocess.run([binary, "--version"], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_report(path, opts, suite, checks, seconds):
    runs = [r for r in suite.reg.runs.values() if r.status != "pending"]
    n_fail = sum(1 for c in checks if c.row and c.row.status == "FAIL")
    n_pass = sum(1 for c in checks if c.row and c.row.status == "PASS")
    n_skip = sum(1 for c in checks if c.row and c.row.status == "SKIP")
    o = opts
    lines = [
        "# shardtrain equivalence report",
        "",
        f"- device: {describe_device(o)}",
        f"- binary: `{o.binary}` ({binary_version(o.binary)})",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; host {socket.gethostname()}",
        f"- result: **{'FAIL' if n_fail else 'PASS'}** — {n_pass} passed, {n_fail} failed, "
        f"{n_skip} skipped; {len(runs)} runs in {seconds:.0f} s",
        f"- GPT-2: `{o.model}`, WikiText-2, {o.max_length} tokens per sample, seed 1234, AdamW "
        f"(lr 6e-4, 2 warmup steps, cosine), micro-batch {suite.b}, global batch {suite.G} samples; "
        f"fp32 {o.steps} steps, bf16 {o.bf16_steps} steps",
        f"- images: Fashion-MNIST at 32×32, fp32, {o.image_steps} steps, {o.image_batch} images per "
        f"{suite.unit} and micro-batch ({o.image_batch * o.n} per step), {o.image_eval} held-out images",
        f"- work directory: `{suite.work}` (each run's command.txt, train.log, metrics.jsonl)",
        "",
        "Batch shapes are written micro-batch × accumulation × data-parallel replicas.",
        "",
        "| check | compared | rel. param diff | max Δloss | result | notes |",
        "|---|---|---:|---:|---|---|",
    ]
    for c in checks:
        r = c.row or Row("SKIP", note="not run")
        lines.append(f"| {md(c.name)} | {md(c.compared)} | {md(r.param)} | {md(r.loss)} | "
                     f"**{r.status}** | {md(r.note)} |")
    lines += [
        "",
        "## Measures and tolerances",
        "",
        f"- **rel. param diff**: ‖a − b‖₂ / ‖b‖₂ over all parameters of the final checkpoints "
        f"(read from the sharded checkpoint files), b the reference; equal runs must be ≤ {PARAM_TOL:g}. "
        f"GPT-2 runs must also have every element within {ELEMENT_TOL_LR:g} × the peak lr "
        f"({ELEMENT_TOL_LR * PEAK_LR:.0e}) of the reference's, so that an element that missed an "
        "update (about lr off) cannot hide in the norm. The notes give the worst single tensor by "
        "the norm measure and the largest element difference: AdamW divides by √v, so an element "
        "whose true gradient is ~0 (attention key biases) moves by a different fraction of lr "
        "under another summation order, and a single small tensor can be 1e-4 apart while the "
        "whole is 1e-7 apart.",
        f"- **max Δloss**: the largest |Δ| of the per-step training losses in metrics.jsonl. Equal "
        f"runs must print the same losses ({LOSS_DIGITS} decimals, as the console shows them); a "
        f"printed mismatch with |Δ| ≤ {STRADDLE_TOL:g} is a value straddling a rounding boundary and "
        "is noted, not failed. The final validation loss is held to the same rule.",
        f"- **bf16** (gpt2-bf16/*): max |Δloss| over the {o.bf16_steps} steps ≤ {BF16_LOSS_TOL:g}: "
        "bf16 compute with fp32 master weights; other reduction orders and bf16 gradient buckets "
        "round differently, and AdamW's normalized steps propagate those differences. The "
        "parameter difference is shown for information.",
        f"- **image** (*-syncbn*, *-localbn*, *-vs-ddp*): equal runs, held to the norm and printed-"
        f"loss rules above through step {suite.image_exact_step()} (a checkpoint is saved there; the "
        "columns say @step). Training these models with AdamW and batch norm on small batches "
        "amplifies rounding differences: measured on the CPU, a 1e-8 loss difference grew to 1e-5 "
        "within 1 to 6 steps, so after a few dozen steps no two runs that sum in different orders "
        "agree to 1e-5 — the 1-rank reference run itself with 2 OpenMP threads instead of 1 drifts "
        "just as far (1e-5 in the loss by step 13, 1e-4 by step 28). Over the whole run "
        f"({o.image_steps} steps) the mean of the per-step training-loss differences over its last "
        f"half must stay within {IMAGE_CLOSE_TOL:g}, or within 3 standard errors of those "
        "differences where the steps are noisier (a paired test: runs that drifted apart by "
        "rounding differ by noise around 0; a real difference shifts the mean); the held-out loss "
        "and the final parameter difference are shown for information. Without --sync-batchnorm "
        "the reference is the 1-device run whose micro-batch "
        "is one rank's, with N accumulation steps: batch norm then normalizes the same samples; "
        "each rank keeps its own running statistics (shown for information). "
        f"{', '.join(sorted(IMAGE_DROPOUT_ALWAYS_ON))}: its dropout stays on (the image trainer "
        "ignores --dropout) and draws its masks per rank, so it cannot equal a run on another "
        "number of devices: its rows against the 1-device runs check closeness only, and its "
        "-vs-ddp rows check the ZeRO strategies exactly against ddp on the same devices.",
        f"- **image, without --sync-batchnorm, against the global-batch run** (*-localbn-vs-global*): "
        f"batch norm normalizes each rank's micro-batch instead of the global batch, by design, so "
        f"the runs are not equal; the same paired measure must stay within {LOCAL_BN_TOL:g} (or 3 "
        "standard errors).",
        "- **pipeline 2bw**: PipeDream-2BW computes with one-step-stale weights, so it is not equal "
        "to dp by design: its step-1 loss must equal the reference's (same initial weights) and the "
        "loss must fall by at least half as much as the reference's over the run.",
        "- **resume**: the resumed run's losses after the checkpoint step and its final parameters "
        "against the uninterrupted run's.",
        "",
        "## Runs",
        "",
        "| run | ranks | seconds | status |",
        "|---|---:|---:|---|",
    ]
    for r in runs:
        lines.append(f"| {md(r.key)} | {r.world} | {r.seconds:.1f} | {md(r.status + (': ' + r.error if r.error else ''))} |")
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


# ---- main ----------------------------------------------------------------------------------

def find_binary(arg):
    for cand in (arg, os.environ.get("SHARDTRAIN"), os.path.join(REPO, "build", "shardtrain")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    found = shutil.which("shardtrain")
    if found:
        return found
    sys.exit("equivalence: no shardtrain binary: pass --binary PATH, set $SHARDTRAIN, or build "
             "build/shardtrain")


def count_gpus():
    if os.environ.get("GPUS"):
        return int(os.environ["GPUS"])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        return len([x for x in visible.split(",") if x.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
        return len([l for l in out.splitlines() if l.startswith("GPU ")])
    except (OSError, subprocess.SubprocessError):
        return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpus", "--ranks", dest="n", type=int, default=None,
                   help="devices N: GPUs (default $GPUS, else every visible GPU) or CPU ranks "
                        "(default 2)")
    p.add_argument("--binary", default=None, help="the shardtrain binary")
    p.add_argument("--work-dir", default="equivalence-work", help="runs go to WORK/runs/NAME")
    p.add_argument("--report", default=None, help="Markdown report to write (default WORK/report.md)")
    p.add_argument("--only", default=None, help="regular expression: run the checks whose name it matches")
    p.add_argument("--list", action="store_true", help="list the checks (and what N skips) and exit")
    p.add_argument("--jobs", type=int, default=0,
                   help="GPU runs at a time when they fit side by side (default: up to N GPUs' worth)")
    p.add_argument("--reuse", action="store_true",
                   help="reuse runs of an earlier invocation in the same work directory that finished "
                        "with the same command and still have their checkpoints")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep every run's checkpoints (default: removed once compared)")
    p.add_argument("--run-timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--comm-timeout", type=float, default=120)
    p.add_argument("--master-port", type=int, default=29600)
    p.add_argument("--model", default=None, help="GPT-2 model (default gpt2-tiny)")
    p.add_argument("--max-length", type=int, default=None, help="tokens per sample (default 128 GPU, 64 CPU)")
    p.add_argument("--steps", type=int, default=8, help="fp32 GPT-2 steps (default 8)")
    p.add_argument("--bf16-steps", type=int, default=20)
    p.add_argument("--image-steps", type=int, default=None, help="image steps (default 200 GPU, 60 CPU)")
    p.add_argument("--image-batch", type=int, default=None, help="images per device per step (default 32 GPU, 8 CPU)")
    p.add_argument("--image-eval", type=int, default=None, help="held-out images (default 1000 GPU, 512 CPU)")
    p.add_argument("--image-exact-step", type=int, default=4,
                   help="image runs are held equal to their reference through this step (default 4)")
    o = p.parse_args()
    cpu = o.device == "cpu"
    if o.n is None:
        o.n = 2 if cpu else count_gpus()
    if o.n < 1:
        sys.exit("equivalence: no GPU found (nvidia-smi -L): give --gpus N, or --device cpu")
    o.model = o.model or "gpt2-tiny"  # 4 blocks: 2 stages × 2 virtual stages divide them
    o.max_length = o.max_length or (64 if cpu else 128)
    o.image_steps = o.image_steps or (60 if cpu else 200)
    o.image_batch = o.image_batch or (8 if cpu else 32)
    o.image_eval = o.image_eval or (512 if cpu else 1000)
    if o.steps < 2:
        sys.exit("equivalence: --steps must be at least 2")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not cpu and visible and len([x for x in visible.split(",") if x.strip()]) < o.n:
        sys.exit(f"equivalence: --gpus {o.n} but CUDA_VISIBLE_DEVICES={visible} names fewer")
    suite = Suite(o)
    if o.list:
        for c in suite.selected():
            why = suite.skip_reason(c)
            print(f"{c.name:40s} {'skip: ' + why if why else c.compared}")
        return 0
    o.binary = find_binary(o.binary)
    os.makedirs(o.work_dir, exist_ok=True)
    report = o.report or os.path.join(o.work_dir, "report.md")
    log(f"equivalence: {describe_device(o)}, binary {o.binary}, work {os.path.abspath(o.work_dir)}")
    t0 = time.time()
    checks = suite.run()
    seconds = time.time() - t0
    write_report(report, o, suite, checks, seconds)
    fails = [c for c in checks if c.row and c.row.status == "FAIL"]
    log(f"equivalence: {sum(1 for c in checks if c.row and c.row.status == 'PASS')} passed, "
        f"{len(fails)} failed, {sum(1 for c in checks if c.row and c.row.status == 'SKIP')} skipped "
        f"in {seconds:.0f} s; report {report}")
    for c in fails:
        log(f"  FAIL {c.name}: {c.row.note}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
