"""Shared pieces of the multi-GPU benches (bench/bench_multi_gpu.py and its suites,
bench/bench_pipeline_gpus.py, bench/bench_zero3_single_gpu.py, bench/bench_offload.py): jobs run
in their own process group with a timeout, shardtrain's metrics.jsonl and log banner, the PyTorch
workers' result line, the environment of every job, the time budget, and the context a result
table is printed with (GPUs, date, commit, command)."""
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

COMM_TIMEOUT = 60  # seconds a collective may hang before a job fails by itself
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "torch_dist_worker.py")
RESULT_TAG = "BENCH_RESULT "
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# --wall-clock-breakdown's keys of a metrics.jsonl step record (device ms per step of its window)
BREAKDOWN_KEYS = ("forward_ms", "backward_ms", "reduce_wait_ms", "optimizer_ms")
PARAMS_RE = re.compile(r"\(([\d,]+) parameters\)")  # the banner: "train M (N parameters)"
PRECISION_RE = re.compile(r"^\s+precision: (\w+)", re.M)
CUDA_GRAPHS_RE = re.compile(r"^\s+CUDA graphs: (.*)$", re.M)
MIN_LEFT_S = 15  # a job is not started with less of --budget left



def free_port():
    """A TCP port no process listens on now (the kernel's pick for a bound, then closed, socket):
    each shardtrain job's rendezvous port, so that benches running side by side (one per pair of
    GPUs) do not collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shardtrain_job(a, name, gpus, port):
    """A shardtrain job of the benches: its run directory WORKDIR/NAME (emptied: shardtrain
    appends to metrics.jsonl), that directory's metrics.jsonl, and the command's start —
    `shardtrain launch` of `gpus` ranks on rendezvous port `port`, stopping by itself when a
    collective hangs (COMM_TIMEOUT), up to `train`. Returns (out_dir, metrics_path, argv)."""
    out = os.path.join(a.workdir, name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [a.shardtrain, "launch", "--nproc-per-node", str(gpus), "--master-port", str(port),
           "--comm-timeout", str(COMM_TIMEOUT), "--stop-grace", "5", "--", "train"]
    return out, os.path.join(out, "metrics.jsonl"), cmd


def gpt2_shape_defaults(ap, a):
    """--models, --batch / --batches and --seq of the GPT-2 suites, defaults filled in (the smoke
    test: gpt2-micro, micro-batch 2, 64 tokens; else gpt2-medium and gpt2-xl, 4 and 16, 512)."""
    a.models = a.models or ("gpt2-micro" if a.smoke else "gpt2-medium,gpt2-xl")
    if a.batch and a.batches:
        ap.error("--batch and --batches: give one")
    a.batches = [a.batch] if a.batch else [
        int(b) for b in (a.batches or ("2" if a.smoke else "4,16")).split(",")]
    a.seq = a.seq or (64 if a.smoke else 512)

def run_job(cmd, timeout, log_path, env):
    """Runs cmd in its own process group, output to log_path; returns (rc or None on timeout,
    log)."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(p.pid, sig)  # the launcher and everything of its group
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    pass
    with open(log_path, errors="replace") as f:
        return rc, f.read()


def job_error(rc, text, timeout, log_path):
    what = f"timed out after {timeout:.0f} s" if rc is None else f"exit status {rc}"
    if rc == 0:
        what = "no result line"
    return {"error": what, "log": log_path, "log_tail": text[-2000:]}


def parse_estimate(text):
    """`shardtrain estimate` table -> {strategy: {model_states, activations, buffers, total}}
    in bytes."""
    est = {}
    for line in text.splitlines():
        w = line.split()
        if len(w) < 9 or not all(w[i] in UNITS for i in (2, 4, 6, 8)):
            continue
        try:
            vals = [float(w[i].replace(",", "")) * UNITS[w[i + 1]] for i in (1, 3, 5, 7)]
        except ValueError:
            continue
        est[w[0]] = dict(zip(("model_states", "activations", "buffers", "total"), vals))
    return est


def run_estimate(binary, model, gpus, batch, seq):
    p = subprocess.run([binary, "estimate", "--model", model, "--gpus", str(gpus),
                        "--micro-batch", str(batch), "--max-length", str(seq)],
                       capture_output=True, text=True, timeout=60)
    est = parse_estimate(p.stdout)
    if not est:
        raise RuntimeError("cannot parse `shardtrain estimate` output: "
                           + (p.stdout + p.stderr)[-500:])
    m = re.search(r"\(([\d,]+) parameters", p.stdout)
    est["params"] = int(m.group(1).replace(",", "")) if m else None
    return est


def parse_metrics(path, warmup, smoke, unit="tokens"):
    """shardtrain metrics.jsonl -> {unit}_per_s (all ranks) over the windows after `warmup` steps
    (each step record averages the steps since the previous record), step_ms (wall time per timed
    step), peaks from the last epoch record, first/last loss; with --wall-clock-breakdown also
    "breakdown": forward_ms, backward_ms, reduce_wait_ms, optimizer_ms (device ms per step)
    averaged over the same timed steps."""
    rate = unit + "_per_s"
    recs = [json.loads(line) for line in open(path) if line.strip()]
    steps = sorted((r for r in recs if "loss" in r and rate in r and "step_time_s" in r),
                   key=lambda r: r["step"])
    prev, units, seconds = 0, 0.0, 0.0
    phases, phase_steps = dict.fromkeys(BREAKDOWN_KEYS, 0.0), 0
    for r in steps:
        window = r["step"] - prev  # the record averages the steps since the previous one
        if prev >= warmup:
            t = r["step_time_s"] * window
            seconds += t
            units += r[rate] * t
            if all(k in r for k in BREAKDOWN_KEYS):
                for k in BREAKDOWN_KEYS:
                    phases[k] += r[k] * window
                phase_steps += window
        prev = r["step"]
    if seconds <= 0:
        raise RuntimeError(f"no step records after step {warmup} in {path}")
    epoch = [r for r in recs if "peak_memory_bytes" in r]
    if not epoch:
        raise RuntimeError(f"no epoch record (peak memory) in {path}")
    alloc = epoch[-1].get("device_peak_allocated_bytes")
    reserved = epoch[-1].get("device_peak_reserved_bytes")
    if smoke and not alloc:  # CPU backend without device counters: peak resident set
        alloc = reserved = epoch[-1]["peak_memory_bytes"]
    losses = [r["loss"] for r in steps]
    out = {rate: units / seconds, "timed_steps": prev - warmup, "timed_s": seconds,
           "step_ms": 1e3 * seconds / max(prev - warmup, 1),
           "peak_allocated": alloc, "peak_reserved": reserved,
           "first_loss": losses[0], "last_loss": losses[-1]}
    for k in ("gathered_bytes_per_step", "cross_node_bytes_per_step"):  # the epoch summary's
        if epoch[-1].get(k):
            out[k] = epoch[-1][k]
    if phase_steps:
        out["breakdown"] = {k: v / phase_steps for k, v in phases.items()}
        out["breakdown"]["steps"] = phase_steps
    return out


def parse_banner(text):
    """From a shardtrain train log: params (the banner's "(N parameters)"), precision (its compute
    dtype: bf16, fp32, ...) and cuda_graphs (image models: the "  CUDA graphs: ..." line), each
    None when the log has no such line."""
    m = PARAMS_RE.search(text)
    p = PRECISION_RE.search(text)
    g = CUDA_GRAPHS_RE.search(text)
    return {"params": int(m.group(1).replace(",", "")) if m else None,
            "precision": p.group(1) if p else None,
            "cuda_graphs": g.group(1).strip() if g else None}


def run_train_job(cmd, metrics, warmup, smoke, timeout, log, env, unit="tokens"):
    """Runs a `shardtrain ... train` job writing `metrics` (metrics.jsonl); returns (its
    parse_metrics result with wall_s and log, or a job_error when training did not finish, and the
    job's output). A job that finished training and then failed keeps its numbers, with a
    warning."""
    t0 = time.time()
    rc, text = run_job(cmd, timeout, log, env)
    done = os.path.exists(metrics) and any('"event":"done"' in l.replace(" ", "")
                                           for l in open(metrics))
    if not done:  # the run did not finish training
        return job_error(rc, text, timeout, log), text
    r = parse_metrics(metrics, warmup, smoke, unit)
    r.update(wall_s=time.time() - t0, log=log)
    if rc != 0:  # finished and measured, then failed on the way out: keep the numbers
        r["warning"] = job_error(rc, text, timeout, log)["error"] + " after training finished"
    return r, text


def run_tagged_job(cmd, timeout, log, env):
    """Runs a job that prints its result as one "BENCH_RESULT {json}" line (the PyTorch workers);
    returns that dict with wall_s and log, or a job_error. A job that printed its result and then
    failed (seen with gloo in teardown) keeps its numbers, with a warning."""
    t0 = time.time()
    rc, text = run_job(cmd, timeout, log, env)
    lines = [l[len(RESULT_TAG):] for l in text.splitlines() if l.startswith(RESULT_TAG)]
    if not lines:
        return job_error(rc, text, timeout, log)
    r = json.loads(lines[-1])
    r.update(wall_s=time.time() - t0, log=log)
    if rc != 0:
        r["warning"] = job_error(rc, text, timeout, log)["error"] + " after the result line"
    return r


def torchrun(python, gpus, script, *args):
    """The command that starts `script` on `gpus` ranks of this host with torchrun."""
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
            script, *args]


def describe(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return repr(e)


def bench_env(smoke):
    """The environment of every bench job: NVLink multicast off (NCCL_NVLS_ENABLE=0, and the same
    for PyTorch's symmetric memory and NVSHMEM), unbuffered Python; in smoke mode oneDNN kept off
    AMX (its bf16 kernels die with SIGILL on VMs that do not enable AMX) and Open MPI's
    single-copy path set to CMA (the CPU ranks of `shardtrain launch` run under mpirun)."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if smoke:
        env.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
        env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "cma")
    return env


def prepare_paths(ap, a):
    """Makes --shardtrain and --workdir absolute, checks that the binary can run (ap.error
    otherwise) and creates the work directory."""
    a.shardtrain = os.path.abspath(a.shardtrain)
    a.workdir = os.path.abspath(a.workdir)
    if not os.access(a.shardtrain, os.X_OK):
        ap.error(f"--shardtrain {a.shardtrain} is not an executable")
    os.makedirs(a.workdir, exist_ok=True)


def result_header(a, **extra):
    """The fields every bench result JSON starts with (date, mode, binary version, GPUs), then
    `extra`; `a` holds the parsed --shardtrain, --smoke and the device."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": a.smoke, "device": a.device,
            "shardtrain_version": describe([a.shardtrain, "--version"]),
            "gpu_names": [] if a.smoke else describe(["nvidia-smi", "-L"]).splitlines(), **extra}


def gpu_name(smoke, python=sys.executable):
    """'2 × NVIDIA H100 80GB HBM3' (nvidia-smi, else torch.cuda.get_device_name), or 'CPU'."""
    if smoke:
        return "CPU (smoke test)"
    names = [l.strip() for l in describe(["nvidia-smi", "--query-gpu=name",
                                          "--format=csv,noheader"]).splitlines()
             if l.strip() and not re.search(r"Error|not found|failed", l)]
    if not names:
        names = describe([python, "-c", "import torch; n = torch.cuda.device_count(); "
                          "print('\\n'.join(torch.cuda.get_device_name(i) for i in range(n)))"
                          ]).splitlines()
    if not names:
        return "unknown GPU"
    return ", ".join(f"{names.count(n)} × {n}" for n in dict.fromkeys(names))


def git_commit(flag=None):
    """--commit when given, else the checkout's short commit (with "+ uncommitted changes" when
    its tracked files differ), else 'unknown (pass --commit)'."""
    if flag:
        return flag
    repo = os.path.dirname(HERE)
    head = describe(["git", "-C", repo, "rev-parse", "--short", "HEAD"])
    if not re.fullmatch(r"[0-9a-f]{6,40}", head):
        return "unknown (pass --commit)"
    dirty = describe(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"])
    return head + (" + uncommitted changes" if dirty else "")


def run_context(a):
    """What a table is pasted with: GPUs, date (UTC), commit, the command line, PyTorch version."""
    python = getattr(a, "python", sys.executable)
    torch_version = describe([python, "-c", "import torch; print(torch.__version__)"])
    return {"gpus": gpu_name(a.smoke, python),
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": git_commit(getattr(a, "commit", None)),
            "command": "python3 " + shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            "torch": torch_version.splitlines()[-1] if torch_version else "not installed"}


def print_context(ctx, title):
    print(f"\n### {title}\n\n- **GPUs**: {ctx['gpus']}, {ctx['date_utc']}, `NCCL_NVLS_ENABLE=0`; "
          f"shardtrain at commit {ctx['commit']}; PyTorch {ctx['torch']}.\n"
          f"- **Command**: `{ctx['command']}`\n")


class Budget:
    """--budget seconds for the whole run: `timeout(limit)` is the seconds a job may take now
    (at most `limit`), or None when less than MIN_LEFT_S is left (the job is skipped)."""

    def __init__(self, seconds):
        self.seconds, self.start = seconds, time.time()

    def elapsed(self):
        return time.time() - self.start

    def timeout(self, limit):
        left = self.seconds - self.elapsed()
        return None if left < MIN_LEFT_S else min(limit, left)


SKIPPED = {"error": "skipped: --budget spent", "budget_skipped": True}


def run_cell(budget, limit, fn):
    """fn(timeout) within the budget: its result, SKIPPED when the budget is spent, or the
    exception as an error (a failing cell is recorded and the rest go on)."""
    timeout = budget.timeout(limit)
    if timeout is None:
        return dict(SKIPPED)
    try:
        return fn(timeout)
    except Exception as e:  # noqa: BLE001 - record and go on with the next job
        return {"error": repr(e)[-1500:]}


def report_problem(label, e):
    """Prints a cell's error (with the end of its log) or warning; budget skips are counted
    elsewhere."""
    if not e or e.get("budget_skipped") or e.get("skipped"):
        return
    if "error" in e:
        tail = [l for l in e.get("log_tail", "").replace("\r", "\n").splitlines() if l.strip()]
        print(f"\nerror: {label}: {e['error']}" + (f" ({e['log']})" if "log" in e else ""))
        print("\n".join("    " + l[:160] for l in tail[-4:]))
    if "warning" in e:
        print(f"\nwarning: {label}: {e['warning']} ({e.get('log', '')})")


def human(b):
    if b is None:
        return "n/a"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def human_bytes10(b):
    """Decimal units, as bandwidths are given (GB/s): '1.42 GB', '105 MB'."""
    if b is None:
        return "-"
    if b >= 1e9:
        return f"{b / 1e9:.2f} GB"
    return f"{b / 1e6:.0f} MB" if b >= 1e6 else f"{b / 1e3:.0f} kB"


def fmt(x, spec=".0f", none="-"):
    return none if x is None else format(x, spec)


def ratio(x, y, spec=".2f"):
    return format(x / y, spec) if x and y else "-"


def torch_runs(spec, gpus):
    """Whether --torch-gpus SPEC (all, none, or a comma list of GPU counts) includes `gpus`."""
    if spec in ("all", "none"):
        return spec == "all"
    return str(gpus) in spec.split(",")
