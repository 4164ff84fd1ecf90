"""The `image` suite of bench/bench_multi_gpu.py: data-parallel training speed of image classifiers,
shardtrain `train --strategy ddp` on 1 and N GPUs against PyTorch DistributedDataParallel with the
torchvision model on N GPUs (bench/torch_image_worker.py), the same micro-batch per GPU. See
bench_multi_gpu.py's docstring for what each number means."""
import os

from image_accuracy_multi_gpu import default_fashion_mnist
from multi_gpu_common import (COMM_TIMEOUT, HERE, fmt, free_port, human, parse_banner,
                              report_problem, run_cell, run_tagged_job, run_train_job,
                              shardtrain_job, torchrun)

WORKER = os.path.join(HERE, "torch_image_worker.py")
MODELS = "mobilenet_v2,efficientnet_b0,vgg16_bn"
SHAPES = "32x256:fashion-mnist,224x64:synthetic"
SMOKE_SHAPES = "32x8:fashion-mnist,64x4:synthetic"
CELL_TIMEOUT = 120  # seconds per job unless --cell-timeout


def add_arguments(ap):
    g = ap.add_argument_group("image suite (image classifiers, data parallel)")
    g.add_argument("--image-models", default=None,
                   help=f"default {MODELS} (smoke: mobilenet_v2)")
    g.add_argument("--image-shapes", default=None,
                   help=f"SIZExMICROBATCH:DATASET, comma-separated (default {SHAPES}; smoke "
                        f"{SMOKE_SHAPES}); fashion-mnist: 1 channel, 10 classes; synthetic: 3 "
                        "channels, 1000 classes")
    g.add_argument("--image-steps", default=None,
                   help="STEPS,WARMUP for every job (default 60,20 up to 64 pixels, else 30,10; "
                        "smoke 6,2)")
    g.add_argument("--image-nographs", action="store_true",
                   help="also run shardtrain on N GPUs with --no-cuda-graphs (one more column)")
    g.add_argument("--fashion-mnist", default=None,
                   help="directory of the Fashion-MNIST IDX files (default: $FASHION_MNIST, "
                        "$SHARDTRAIN_DATA_DIR/fashion-mnist, build/data/fashion-mnist, "
                        "/usr/share/datasets/fashion-mnist)")


def configure(ap, a):
    a.image_models = a.image_models or ("mobilenet_v2" if a.smoke else MODELS)
    a.image_shape_list = []
    for spec in (a.image_shapes or (SMOKE_SHAPES if a.smoke else SHAPES)).split(","):
        try:
            shape, _, dataset = spec.partition(":")
            size, batch = (int(x) for x in shape.split("x"))
        except ValueError:
            ap.error(f"--image-shapes: {spec!r} is not SIZExMICROBATCH[:DATASET]")
        dataset = dataset or "synthetic"
        if dataset not in ("fashion-mnist", "synthetic"):
            ap.error(f"--image-shapes: dataset {dataset!r}: fashion-mnist or synthetic")
        a.image_shape_list.append((size, batch, dataset))
    if a.image_steps:
        steps, warmup = (int(x) for x in a.image_steps.split(","))
        if not 0 <= warmup < steps:
            ap.error("--image-steps: need 0 <= WARMUP < STEPS")
    a.fashion_mnist = os.path.abspath(a.fashion_mnist or default_fashion_mnist())


def plan(a, size):
    """(steps, untimed warmup steps, log interval); the warmup is a multiple of the interval."""
    log = 2 if a.smoke else 5
    if a.image_steps:
        steps, warmup = (int(x) for x in a.image_steps.split(","))
        return steps, warmup, log if warmup % log == 0 else 1
    if a.smoke:
        return 6, 2, log
    return (60, 20, log) if size <= 64 else (30, 10, log)


def run_shardtrain(a, model, size, batch, dataset, gpus, graphs, port, timeout, env):
    steps, warmup, log_every = plan(a, size)
    name = f"img_{model}_{size}_mb{batch}_st_{gpus}gpu" + ("" if graphs else "_nographs")
    out, metrics, cmd = shardtrain_job(a, name, gpus, port)
    cmd += ["--model", model, "--dataset", dataset, "--image-size", str(size),
           "--device", a.device, "--strategy", "ddp", "--batch-size", str(batch),
           "--max-steps", str(steps), "--log-interval", str(log_every), "--warmup-steps", "5",
           "--eval-samples", str(batch), "--no-save", "--output-dir", out]
    if dataset == "fashion-mnist":
        cmd += ["--data-dir", a.fashion_mnist]
    else:
        cmd += ["--num-samples", str(steps * batch * gpus)]
    if a.device == "cuda":
        cmd += ["--precision", "bf16"]
    if not graphs:
        cmd.append("--no-cuda-graphs")
    r, text = run_train_job(cmd, metrics, warmup, a.smoke, timeout,
                            os.path.join(a.workdir, name + ".log"), env, unit="images")
    if "images_per_s" in r:
        b = parse_banner(text)
        r.update(per_gpu=r["images_per_s"] / gpus, params=b["params"], cuda_graphs=b["cuda_graphs"],
                 cuda_graphs_on=bool(b["cuda_graphs"] and b["cuda_graphs"].startswith("on")))
    return r


def run_torch(a, model, size, batch, dataset, gpus, timeout, env):
    steps, warmup, _ = plan(a, size)
    channels, classes = (1, 10) if dataset == "fashion-mnist" else (3, 1000)
    name = f"img_{model}_{size}_mb{batch}_pt_{gpus}gpu"
    cmd = torchrun(a.python, gpus, WORKER, "--model", model, "--size", str(size),
                   "--batch", str(batch), "--channels", str(channels), "--classes", str(classes),
                   "--steps", str(steps), "--warmup", str(warmup), "--device", a.device,
                   "--comm-timeout", str(COMM_TIMEOUT))
    return run_tagged_job(cmd, timeout, os.path.join(a.workdir, name + ".log"), env)


def progress(r):
    if "per_gpu" not in r:
        return "error: " + r.get("error", "?")
    g = {True: ", graphs on", False: ", graphs off"}.get(r.get("cuda_graphs_on"), "")
    return f"{r['per_gpu']:.0f} img/s/GPU{g} (job {r['wall_s']:.0f} s)"


def run(a, budget, env, save=None):
    """Runs the suite's cells within `budget`; returns its result (one row per model and shape);
    save(result so far) after each row."""
    n = a.gpus
    limit = a.cell_timeout or CELL_TIMEOUT
    res = {"models": a.image_models.split(","), "gpus": n, "fashion_mnist": a.fashion_mnist,
           "nographs": a.image_nographs, "rows": []}
    for size, batch, dataset in a.image_shape_list:
        steps, warmup, _ = plan(a, size)
        for model in res["models"]:
            row = {"key": f"{model}/{size}px/mb{batch}", "model": model, "size": size,
                   "batch": batch, "dataset": dataset, "steps": steps, "warmup": warmup}
            jobs = [("st_1gpu", 1, True)]
            if n > 1:
                jobs.append((f"st_{n}gpu", n, True))
                if a.image_nographs:
                    jobs.append((f"st_{n}gpu_nographs", n, False))
            row["jobs"] = jr = {}  # job name -> its result
            for key, g, graphs in jobs:
                port = free_port()
                jr[key] = run_cell(budget, limit, lambda t: run_shardtrain(
                    a, model, size, batch, dataset, g, graphs, port, t, env))
            if n > 1:
                jr[f"pt_{n}gpu"] = run_cell(budget, limit, lambda t: run_torch(
                    a, model, size, batch, dataset, n, t, env))
            one, many = jr["st_1gpu"].get("per_gpu"), jr.get(f"st_{n}gpu", {}).get("per_gpu")
            pt = jr.get(f"pt_{n}gpu", {}).get("per_gpu")
            row["scaling_st"] = many / one if one and many else None
            row["st_over_pt"] = many / pt if many and pt else None
            res["rows"].append(row)
            print(f"[{budget.elapsed():4.0f} s] image {row['key']}: "
                  + "; ".join(f"{k} " + progress(v) for k, v in jr.items()), flush=True)
            if save:
                save(res)
    return res


def print_problems(res):
    for row in res["rows"]:
        for k, v in row["jobs"].items():
            report_problem(f"image {row['key']} {k}", v)


def graphs_cell(r):
    on = (r or {}).get("cuda_graphs_on")
    return "-" if on is None else "on" if on else "off"


def print_tables(res):
    n = res["gpus"]
    cols = ["model", "image", "micro-batch per GPU", "shardtrain 1 GPU img/s",
            f"shardtrain {n} GPUs img/s/GPU", "scaling"]
    if res["nographs"]:
        cols.append(f"shardtrain {n} GPUs, --no-cuda-graphs, img/s/GPU")
    cols += [f"PyTorch DDP {n} GPUs img/s/GPU", "shardtrain ÷ PyTorch",
             "CUDA graphs (1 / N GPUs)", f"peak, shardtrain / PyTorch ({n} GPUs)"]
    print("\n| " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * (len(cols) - 4) + "---|---:|")
    for row in res["rows"]:
        jr = row["jobs"]
        one, many = jr["st_1gpu"], jr.get(f"st_{n}gpu", {})
        pt, ng = jr.get(f"pt_{n}gpu", {}), jr.get(f"st_{n}gpu_nographs", {})

        def rate(r):
            return "not run" if r.get("budget_skipped") else fmt(r.get("per_gpu"), ",.0f", "error")

        data = "Fashion-MNIST" if row["dataset"] == "fashion-mnist" else "synthetic"
        cells = [row["model"], f"{row['size']}² {data}", str(row["batch"]), rate(one),
                 rate(many) if n > 1 else "-", fmt(row.get("scaling_st"), ".3f")]
        if res["nographs"]:
            cells.append(rate(ng))
        cells += [rate(pt) if n > 1 else "-", fmt(row.get("st_over_pt"), ".2f"),
                  f"{graphs_cell(one)} / {graphs_cell(many)}",
                  f"{human(many.get('peak_allocated')) if many.get('per_gpu') else '-'} / "
                  f"{human(pt.get('peak_allocated')) if pt.get('per_gpu') else '-'}"]
        print("| " + " | ".join(cells) + " |")
    print("\nimg/s/GPU = images/s of all ranks ÷ GPUs over the timed steps (shardtrain: its"
          " metrics.jsonl images_per_s, with its host-side data pipeline; PyTorch: one random batch"
          " already on each GPU); scaling = shardtrain on N GPUs ÷ on 1 GPU, per GPU; shardtrain"
          " ÷ PyTorch on N GPUs; CUDA graphs: shardtrain's banner (`CUDA graphs: on/off ...`);"
          " peak: allocated bytes, shardtrain rank 0, PyTorch max over ranks. Fashion-MNIST: 1"
          " channel, 10 classes, resized to the size; synthetic: 3 channels, 1000 classes.")
