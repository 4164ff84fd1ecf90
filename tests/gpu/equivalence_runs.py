"""The runs behind the equivalence suite (tests/gpu/equivalence.py): tolerances, reading sharded
checkpoints (safetensors) and metrics.jsonl, comparing parameters and printed losses, and
running shardtrain (RunSpec, Registry, Executor) with each check's result row (Row, Check).
"""

import json
import math
import os
import shutil
import signal
import struct
import subprocess
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- tolerances (the report states them) -------------------------------------------------

PARAM_TOL = 1e-5        # ||a - b||_2 / ||b||_2 over all parameters, b the reference
NOISE_FACTOR = 3        # GPU image rows: at most this × the reference's own run-to-run difference
LOSS_DIGITS = 4         # losses compared as printed: "{:.4f}"
STRADDLE_TOL = 1e-5     # printed digits may differ only across a rounding boundary: |Δ| <= this
BF16_LOSS_TOL = 2e-2    # bf16: max |Δloss| over the steps
ELEMENT_TOL_LR = 0.1    # GPT-2: every parameter within 0.1 x peak lr of the reference's
IMAGE_CLOSE_TOL = 0.05  # image runs over the whole run: mean per-step loss difference, last half
LOCAL_BN_TOL = 0.10     # the same, per-rank batch norm against global-batch batch norm
PEAK_LR = 6e-4          # the trainer's default, used by every run here

# Image models whose dropout (or stochastic depth) stays on: the image trainer ignores --dropout,
# and dropout masks are drawn per rank (seed, rank, step, micro-step), so these models cannot
# equal a run on another number of devices; they are compared for closeness only, and their
# strategies exactly against ddp on the same devices.
IMAGE_DROPOUT_ALWAYS_ON = set()  # --dropout 0 turns every image model's dropout off


def log(msg):
    print(msg, flush=True)


# ---- reading runs --------------------------------------------------------------------------

def read_safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return header, 8 + n


def read_tensor(path, name, header=None, base=None):
    if header is None:
        header, base = read_safetensors_header(path)
    t = header[name]
    if t["dtype"] != "F32":
        raise ValueError(f"{path}: tensor {name} is {t['dtype']}, expected F32")
    begin, end = t["data_offsets"]
    return np.fromfile(path, dtype="<f4", count=(end - begin) // 4, offset=base + begin)


def checkpoint_dir(run_dir, step=None):
    if step is not None:
        return os.path.join(run_dir, f"checkpoint-{step:06d}")
    latest = os.path.join(run_dir, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(run_dir, f.read().strip())
    if os.path.isdir(latest):
        return latest
    raise FileNotFoundError(f"{run_dir}: no checkpoint (no 'latest')")


class Checkpoint:
    """The flat fp32 parameters of a sharded checkpoint (format 2), assembled from every rank's
    ranges, and each rank's batch-norm running statistics ('buffers') where present."""

    def __init__(self, path):
        self.path = path
        with open(os.path.join(path, "manifest.json")) as f:
            m = json.load(f)
        self.manifest = m
        self.numel = int(m["layout"]["numel"])
        self.tensors = [(t["name"], int(t["offset"]), int(t["numel"]))
                        for t in m["layout"]["tensors"]]
        self.step = int(m.get("progress", {}).get("step", -1))
        self.params = np.zeros(self.numel, dtype=np.float32)
        covered = np.zeros(self.numel, dtype=bool)
        self.buffers = {}  # rank -> array
        for r in m["ranks"]:
            file = os.path.join(path, r["file"])
            header, base = read_safetensors_header(file)
            data = read_tensor(file, "params", header, base)
            pos = 0
            for start, count in r["ranges"]:
                start, count = int(start), int(count)
                take = max(0, min(count, self.numel - start))
                self.params[start:start + take] = data[pos:pos + take]
                covered[start:start + take] = True
                pos += count
            if "buffers" in header:
                self.buffers[int(r["rank"])] = read_tensor(file, "buffers", header, base)
        if not covered.all():
            raise ValueError(f"{path}: ranks cover {int(covered.sum())} of {self.numel} elements")
        b = m.get("buffers")
        self.buffer_tensors = ([(t["name"], int(t["offset"]), int(t["numel"])) for t in b["tensors"]]
                               if b else [])


def param_diff(a, ref):
    """Compares two checkpoints' parameters: the norm-based relative difference over all of
    them (the measure held to PARAM_TOL), the worst tensor by the same measure, and the largest
    element difference."""
    if a.numel != ref.numel:
        raise ValueError(f"layouts differ: {a.numel} vs {ref.numel} parameters")
    d = a.params.astype(np.float64) - ref.params.astype(np.float64)
    total = float(np.linalg.norm(d) / max(np.linalg.norm(ref.params.astype(np.float64)), 1e-30))
    worst, worst_name = 0.0, ""
    for name, off, n in ref.tensors:
        rn = float(np.linalg.norm(ref.params[off:off + n].astype(np.float64)))
        dn = float(np.linalg.norm(d[off:off + n]))
        rel = dn / rn if rn > 0 else (0.0 if dn == 0 else math.inf)
        if rel > worst:
            worst, worst_name = rel, name
    return {"rel": total, "worst_tensor": worst_name, "worst_tensor_rel": worst,
            "max_abs": float(np.abs(d).max()) if d.size else 0.0}


def buffer_diff(a, ref):
    """Rank 0's batch-norm running statistics against the reference's: norm-relative."""
    if not a.buffers or not ref.buffers:
        return None
    x = a.buffers[min(a.buffers)].astype(np.float64)
    y = ref.buffers[min(ref.buffers)].astype(np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def read_metrics(run_dir):
    """metrics.jsonl: step -> training loss (step lines), and the last validation loss."""
    losses, val = {}, None
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            o = json.loads(line)
            if "val_loss" in o:
                val = float(o["val_loss"])
            elif "loss" in o and "lr" in o and "step" in o:
                losses[int(o["step"])] = float(o["loss"])
    return losses, val


def printed(x):
    return f"{x:.{LOSS_DIGITS}f}"


def compare_losses(a, ref, steps):
    """Per-step losses of `a` against `ref` over `steps`: max |Δ|, printed mismatches (a
    mismatch within STRADDLE_TOL is a rounding-boundary straddle), missing steps."""
    out = {"max": 0.0, "mismatch": [], "straddle": [], "missing": []}
    for s in steps:
        if s not in a or s not in ref:
            out["missing"].append(s)
            continue
        delta = abs(a[s] - ref[s])
        out["max"] = max(out["max"], delta)
        if printed(a[s]) != printed(ref[s]):
            (out["straddle"] if delta <= STRADDLE_TOL else out["mismatch"]).append(s)
    return out


# ---- runs ----------------------------------------------------------------------------------

class RunSpec:
    def __init__(self, key, world, args, ds=None, resume=None, label="", env=None):
        self.key = key
        self.env = dict(env or {})  # extra environment variables of this run
        self.world = world
        self.args = [str(x) for x in args]
        self.ds = ds
        self.resume = resume  # (run key, step) or None
        self.label = label
        # filled in by the executor
        self.status = "pending"  # pending | running | ok | failed | skipped
        self.error = ""
        self.seconds = 0.0
        self.dir = ""
        self.consumers = 0

    def signature(self):
        return json.dumps([self.world, self.args, self.ds, self.resume, self.env], sort_keys=True)

    def deps(self):
        return [self.resume[0]] if self.resume else []


class Registry:
    """Run specifications by key; identical specifications (same ranks, flags, config and
    resume source) share one run."""

    def __init__(self):
        self.runs = {}
        self.by_signature = {}

    def add(self, spec):
        sig = spec.signature()
        if sig in self.by_signature:
            return self.by_signature[sig]
        if spec.key in self.runs:
            raise ValueError(f"two different runs named {spec.key}")
        self.runs[spec.key] = spec
        self.by_signature[sig] = spec.key
        return spec.key


class Executor:
    def __init__(self, opts, registry, work):
        self.o = opts
        self.reg = registry
        self.work = work
        self.cpu = opts.device == "cpu"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [x for x in visible.split(",") if x.strip()] if visible else []
        self.gpu_ids = ids[:opts.n] if ids else [str(i) for i in range(opts.n)]

    def run_dir(self, key):
        return os.path.join(self.work, "runs", key)

    def command(self, spec, port):
        d = self.run_dir(spec.key)
        train = ["train", "--device", self.o.device, *spec.args, "--output-dir", d,
                 "--comm-timeout", str(self.o.comm_timeout)]
        if spec.ds is not None:
            cfg = os.path.join(d, "ds_config.json")
            with open(cfg, "w") as f:
                json.dump(spec.ds, f, indent=2)
            train += ["--deepspeed-config", cfg]
        if spec.resume:
            src, step = spec.resume
            train += ["--resume", checkpoint_dir(self.run_dir(src), step)]
        if spec.world == 1:
            return [self.o.binary, *train]
        launch = [self.o.binary, "launch", "--nproc-per-node", str(spec.world)]
        if not self.cpu:
            launch += ["--master-port", str(port)]
        return [*launch, "--", *train]

    def reusable(self, spec):
        d = self.run_dir(spec.key)
        try:
            with open(os.path.join(d, "result.json")) as f:
                r = json.load(f)
        except (OSError, ValueError):
            return False
        return (r.get("signature") == spec.signature() and r.get("rc") == 0
                and os.path.exists(os.path.join(d, "latest")))

    def start(self, spec, gpus, port):
        d = self.run_dir(spec.key)
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
        if spec.ds is not None:
            # NVMe swap directories named in a config must exist
            for sec in ("offload_optimizer", "offload_param"):
                p = spec.ds.get("zero_optimization", {}).get(sec, {}).get("nvme_path")
                if p:
                    os.makedirs(p, exist_ok=True)
        cmd = self.command(spec, port)
        env = dict(os.environ)
        if self.cpu:
            env.setdefault("OMP_NUM_THREADS", "1")
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env.update(spec.env)
        with open(os.path.join(d, "command.txt"), "w") as f:
            extra = "" if self.cpu else f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} "
            extra += "".join(f"{k}={v} " for k, v in sorted(spec.env.items()))
            f.write(extra + " ".join(cmd) + "\n")
        logf = open(os.path.join(d, "train.log"), "w")
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, cwd=self.work)
        spec.status, spec.dir = "running", d
        return p, logf

    def execute(self, keys, on_done):
        """Runs `keys` (and what they resume from), several at a time on GPUs when they fit;
        on_done(spec) is called as each finishes."""
        order, seen = [], set()

        def visit(k):
            if k in seen:
                return
            seen.add(k)
            for dep in self.reg.runs[k].deps():
                visit(dep)
            order.append(k)

        for k in keys:
            visit(k)
        if self.o.reuse:
            for k in list(order):
                spec = self.reg.runs[k]
                if self.reusable(spec):
                    spec.status, spec.dir = "ok", self.run_dir(k)
                    log(f"        reuse {k} (finished earlier, same command)")
                    order.remove(k)
                    on_done(spec)
        # fewest devices first: one-device references pair up side by side on GPUs, and every
        # comparison can be made as soon as its strategy run ends (a run waits for its source)
        pending = sorted(order, key=lambda k: self.reg.runs[k].world)
        total = len(order)
        started = 0
        running = {}  # key -> (proc, log, t0, gpus)
        free = list(self.gpu_ids)
        max_jobs = 1 if self.cpu else max(1, self.o.jobs or len(self.gpu_ids))
        try:
            while pending or running:
                progressed = False
                for k in list(pending):
                    if len(running) >= max_jobs:
                        break
                    spec = self.reg.runs[k]
                    deps = [self.reg.runs[d] for d in spec.deps()]
                    if any(d.status in ("failed", "skipped") for d in deps):
                        spec.status = "skipped"
                        spec.error = "its source run failed"
                        pending.remove(k)
                        on_done(spec)
                        progressed = True
                        continue
                    if any(d.status != "ok" for d in deps):
                        continue
                    need = 0 if self.cpu else spec.world
                    if need > len(free):
                        if running:
                            continue  # a later run may fit beside the running ones
                        raise RuntimeError(f"{k} needs {need} GPUs, {len(free)} visible")
                    gpus, free = free[:need], free[need:]
                    started += 1
                    where = (f"{spec.world} rank{'s' if spec.world > 1 else ''}" if self.cpu else
                             f"GPU{'s' if need > 1 else ''} {','.join(gpus)}")
                    log(f"[{started:2d}/{total}] start {k} ({where})")
                    # a fresh store port per run: a killed run's store cannot block the next
                    proc, lf = self.start(spec, gpus, self.o.master_port + 2 * (started % 500))
                    running[k] = (proc, lf, time.time(), gpus)
                    pending.remove(k)
                    progressed = True
                for k in list(running):
                    proc, lf, t0, gpus = running[k]
                    rc = proc.poll()
                    elapsed = time.time() - t0
                    if rc is None and elapsed > self.o.run_timeout:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        rc = -9
                        self.reg.runs[k].error = f"killed after {self.o.run_timeout} s"
                    if rc is None:
                        continue
                    lf.close()
                    spec = self.reg.runs[k]
                    spec.seconds = elapsed
                    with open(os.path.join(spec.dir, "result.json"), "w") as f:
                        json.dump({"signature": spec.signature(), "rc": rc, "seconds": elapsed}, f)
                    if rc == 0:
                        spec.status = "ok"
                    else:
                        spec.status = "failed"
                        spec.error = spec.error or f"exit status {rc}: {last_error(spec.dir)}"
                    free = sorted(free + gpus, key=self.gpu_ids.index)
                    del running[k]
                    log(f"        {'done' if rc == 0 else 'FAILED'} {k} in {elapsed:.1f} s"
                        + ("" if rc == 0 else f" ({spec.error}; log {spec.dir}/train.log)"))
                    on_done(spec)
                    progressed = True
                if not progressed:
                    time.sleep(0.1)
        finally:
            for k, (proc, lf, *_rest) in running.items():
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                lf.close()


def last_error(run_dir):
    try:
        with open(os.path.join(run_dir, "train.log"), errors="replace") as f:
            lines = [l.strip() for l in f if l.strip()]
    except OSError:
        return "no log"
    errs = [l for l in lines if "error" in l.lower()]
    return (errs[0] if errs else (lines[-1] if lines else "empty log"))[:300]


# ---- the checks ----------------------------------------------------------------------------

class Row:
    def __init__(self, status, param="", loss="", note=""):
        self.status, self.param, self.loss, self.note = status, param, loss, note


class Check:
    def __init__(self, name, compared, runs, evaluate, needs=1, gpu_only=False, why=""):
        self.name = name
        self.compared = compared
        self.runs = runs          # role -> run key
        self.evaluate = evaluate  # fn(check, results) -> Row
        self.needs = needs        # devices (GPUs or ranks) needed
        self.gpu_only = gpu_only
        self.why = why            # why it would be skipped
        self.row = None
