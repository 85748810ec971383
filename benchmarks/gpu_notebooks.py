"""What gpu_share.py and makespan.py run: a tiny PyTorch CNN trained on synthetic data, the GPUs to run
it on, and a local backend placed on exactly those GPUs.

Needs only the standard library and nbbatch (plus, in the kernel, torch). ``--simulate`` swaps the
CNN for ``time.sleep`` and the GPUs for fake ones, so the scheduling can be run on a machine without
a GPU (kernels are pinned through ``CUDA_VISIBLE_DEVICES`` whether or not a GPU is there).

Run as a script, it is the framework-notebook GPU benchmark: the GPU-capable framework notebooks
against raw training loops of the same model.

For each of PyTorch, Lightning, JAX + Flax and Keras 3 on JAX, the script executes the framework's
notebook with papermill (``GPU=True``, CIFAR-shaped synthetic data written with
``nbbatch.data.write_cifar10_batches``) and reads its recorded ``images_per_second``; then it runs a raw
loop of the same model, batch size and precision in a fresh process (a plain PyTorch loop for the two
PyTorch notebooks, a plain ``jax.jit`` loop without Flax or Keras for the two JAX ones) and prints a
markdown table of both speeds and their ratio (target: every notebook >= 0.8x its raw loop). It also
checks that the PyTorch notebook trains 10 epochs of 50,000 images at BATCHSIZE=512 in <= 6 s.

Made for a GPU machine without nbbatch's framework venvs: each notebook's kernel ``nbbatch-<name>`` is
registered here as *this* Python (``sys.executable``) with the framework's ``kernel_env`` from
``frameworks/<name>/framework.yaml``, in a temporary Jupyter path. So this Python needs the frameworks
(torch, pytorch-lightning, jax with CUDA, flax, optax, keras), papermill and ipykernel, and nbbatch
importable (``pip install -e .`` or ``PYTHONPATH=src``). Speeds: steady state, leaving out the first
epoch (compilation, cuDNN autotuning), for the notebooks and the raw loops alike.

    python benchmarks/gpu_notebooks.py                      # all four, 10 epochs of 50,000, batch 512
    python benchmarks/gpu_notebooks.py --frameworks pytorch --epochs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import nbbatch  # noqa: F401
except ImportError:  # a bare checkout: use its src/ (the kernels need only torch and ipykernel)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

CNN_CELLS = [
    # the training setup: a small CNN (two conv blocks, two dense layers) on one synthetic CIFAR-sized batch
    "import os\nimport time\n\nimport torch\nimport torch.nn as nn\n\n"
    "torch.manual_seed(SEED)\n"
    "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
    "model = nn.Sequential(\n"
    "    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),\n"
    "    nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),\n"
    "    nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, N_CLASSES),\n"
    ").to(device)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)\n"
    "loss_fn = nn.CrossEntropyLoss()\n"
    "x = torch.randn(BATCHSIZE, 3, 32, 32, device=device)\n"
    "y = torch.randint(0, N_CLASSES, (BATCHSIZE,), device=device)",
    # the training loop: STEPS steps, or (STEPS = 0) as many as fit in SECONDS
    "start = time.time()\nstep = 0\n"
    "while (step < STEPS) if STEPS else (time.time() - start < SECONDS):\n"
    "    optimizer.zero_grad(set_to_none=True)\n"
    "    loss = loss_fn(model(x), y)\n"
    "    loss.backward()\n"
    "    optimizer.step()\n"
    "    step += 1\n"
    "if device == 'cuda':\n"
    "    torch.cuda.synchronize()\n"
    "train_seconds = time.time() - start\n"
    "print(device, torch.cuda.get_device_name(0) if device == 'cuda' else '', "
    "'CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', ''), "
    "f'{step} steps in {train_seconds:.2f} s, loss {loss.item():.3f}')",
]
CNN_PARAMETERS = "STEPS = 500\nSECONDS = 0.0\nBATCHSIZE = 128\nLR = 0.01\nN_CLASSES = 10\nSEED = 0\nID = 0"
SLEEP_CELLS = ["import os, time\ntime.sleep(SECONDS if SECONDS else STEPS / 1000)\n"
               "print('slept', SECONDS, 'CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', ''))"]


def write_notebook(path: Path, simulate: bool, kernel: str = "python3") -> Path:
    """The benchmark notebook (the CNN, or a sleep with ``simulate``), written with nbformat's JSON layout."""
    cells = [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": CNN_PARAMETERS,
              "outputs": [], "execution_count": None}]
    cells += [{"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None}
              for src in (SLEEP_CELLS if simulate else CNN_CELLS)]
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": kernel, "display_name": kernel, "language": "python"},
                                       "language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"cell-{i}"
    path.write_text(json.dumps(nb, indent=1))
    return path


def find_gpus(simulate: int = 0) -> list:
    """This machine's GPUs: NVML (nvidia-ml-py) if installed, else ``nvidia-smi``; ``simulate`` fake ones."""
    from nbbatch.backends.local.gpus import GpuInfo, detect_gpus

    if simulate:
        return [GpuInfo(i, "simulated GPU", 0) for i in range(simulate)]
    gpus = detect_gpus()
    if gpus:
        return gpus
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    found = []
    for line in out.strip().splitlines():
        index, name, memory = (part.strip() for part in line.split(","))
        found.append(GpuInfo(int(index), name, int(float(memory))))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and all(v.strip().isdigit() for v in visible.split(",")):
        keep = {int(v) for v in visible.split(",")}
        found = [g for g in found if g.index in keep]
    return found


def use_gpus(gpus: list, name: str = "bench-local") -> str:
    """Register a local backend placed on exactly ``gpus`` (NVML may be absent); returns its name."""
    from nbbatch.backends import register_backend
    from nbbatch.backends.local.backend import LocalBackend

    register_backend(name, lambda **settings: LocalBackend(gpus=list(gpus), **settings))
    return name


def submit_all(spec: dict, what: str) -> tuple:
    """Submit ``spec`` (``force``: every run again); its result and wall seconds. Exits naming the first failed
    runs (``what`` says where their logs are)."""
    import nbbatch

    start = time.perf_counter()
    result = nbbatch.submit(spec, progress=False, force=True)
    wall = time.perf_counter() - start
    failed = [(r.run_id, r.error.summary() if r.error else r.status) for r in result.records if r.status != "succeeded"]
    if failed:
        raise SystemExit(f"{what}: runs failed: {failed[:3]} (see {spec['share']}/{spec['experiment']}/<run>/log.txt)")
    return result, wall


def isolate(folder: Path) -> None:
    """Keep the benchmark's experiment registry out of the user's project."""
    os.environ["NBBATCH_PROJECT"] = str(folder)
    (folder / ".nbbatch").mkdir(parents=True, exist_ok=True)


def torch_version() -> str:
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "not importable"


# ==================================================================================================
# The framework-notebook GPU benchmark (run this file as a script).

ROOT = Path(__file__).resolve().parents[1]
FAMILY = {"pytorch": "torch", "lightning": "torch", "jax-flax": "jax", "keras-jax": "jax"}
TARGET_RATIO = 0.8
PYTORCH_TARGET_SECONDS = 6.0


# ----------------------------------------------------------------------------------------------- setup

def write_data(folder: Path, train_images: int, test_images: int) -> Path:
    from nbbatch.data import write_cifar10_batches

    marker = folder / f"written-{train_images}-{test_images}"
    if not marker.exists():
        per_batch = -(-train_images // 5)  # CIFAR-10 has five training batches
        write_cifar10_batches(folder, n_train_per_batch=per_batch, n_test=test_images, seed=0)
        marker.write_text("")
    return folder


def register_kernels(folder: Path, names: list[str]) -> None:
    """Kernel specs ``nbbatch-<name>`` running this Python with each framework's kernel variables."""
    from nbbatch.spec.frameworks import list_frameworks
    from nbbatch.spec.project import Project

    frameworks = list_frameworks(Project(ROOT))
    for name in names:
        fw = frameworks[name]
        spec_dir = folder / "kernels" / fw.kernel_name
        spec_dir.mkdir(parents=True, exist_ok=True)
        spec = {
            "argv": [sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"nbbatch {fw.title} (benchmark: {sys.executable})",
            "language": "python",
            "env": dict(fw.kernel_env),
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=2))
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(folder), *filter(None, [os.environ.get("JUPYTER_PATH")])])


def run_notebook(name: str, parameters: dict, out_dir: Path) -> dict:
    import nbformat
    import papermill

    from nbbatch.metrics import metrics_from_notebook
    from nbbatch.spec.frameworks import list_frameworks
    from nbbatch.spec.project import Project

    fw = list_frameworks(Project(ROOT))[name]
    output = out_dir / f"{fw.notebook.stem}.gpu.ipynb"
    start = time.perf_counter()
    papermill.execute_notebook(str(fw.notebook), str(output), parameters=parameters, kernel_name=fw.kernel_name,
                               cwd=str(out_dir), progress_bar=False, log_output=False)
    metrics = metrics_from_notebook(nbformat.read(output, as_version=4))
    metrics["notebook_seconds"] = time.perf_counter() - start
    return metrics


def run_raw(family: str, args: argparse.Namespace, data: Path) -> dict:
    """The raw loop in a fresh process (so each framework starts with an empty GPU)."""
    cmd = [sys.executable, __file__, "--raw", family, "--epochs", str(args.epochs), "--batch", str(args.batch),
           "--data", str(data)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"raw {family} loop failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------- raw loops

def steady_speed(epoch_seconds: list[float], images_per_epoch: int) -> float:
    steady = epoch_seconds[1:] or epoch_seconds
    return images_per_epoch * len(steady) / sum(steady)


def raw_torch(epochs: int, batch: int, data: Path) -> dict:
    """deep_bait's CNN in the plainest fast PyTorch loop: data on the GPU, bf16 autocast, channels-last."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from nbbatch.data import load_cifar10

    x, y, _, _ = load_cifar10(data)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    amp = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    model = nn.Sequential(
        nn.Conv2d(3, 50, 3, padding=1), nn.ReLU(), nn.Conv2d(50, 50, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Dropout(0.25),
        nn.Conv2d(50, 100, 3, padding=1), nn.ReLU(), nn.Conv2d(100, 100, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(),
        nn.Linear(6400, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, 10),
    ).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    xd = torch.from_numpy(x).to(device).contiguous(memory_format=torch.channels_last)
    yd = torch.from_numpy(y).to(device)
    n = len(yd)
    steps = n // batch
    seconds = []
    for _ in range(epochs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        order = torch.randperm(n, device=device)
        xs, ys = xd[order], yd[order]
        for s in range(steps):
            with torch.autocast("cuda", dtype=amp):
                loss = F.cross_entropy(model(xs[s * batch:(s + 1) * batch]), ys[s * batch:(s + 1) * batch])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"images_per_second": steady_speed(seconds, steps * batch), "train_seconds": sum(seconds),
            "precision": str(amp).replace("torch.", ""), "version": torch.__version__}


def raw_jax(epochs: int, batch: int, data: Path) -> dict:
    """deep_bait's CNN in plain JAX (lax convolutions, a hand-written SGD), one jax.jit step, bf16 compute."""
    from functools import partial

    import jax
    import jax.numpy as jnp

    from nbbatch.data import load_cifar10

    x, y, _, _ = load_cifar10(data, channels_last=True)
    device = jax.devices("gpu")[0]
    dtype = jnp.bfloat16 if float(getattr(device, "compute_capability", "0")) >= 8.0 else jnp.float32
    key = jax.random.key(0)

    def glorot(k, shape, fan_in, fan_out):
        limit = (6.0 / (fan_in + fan_out)) ** 0.5
        return jax.random.uniform(k, shape, jnp.float32, -limit, limit)

    keys = jax.random.split(key, 7)
    shapes = [(3, 50), (50, 50), (50, 100), (100, 100)]
    params = {f"conv{i}": (glorot(keys[i], (3, 3, a, b), 9 * a, 9 * b), jnp.zeros(b)) for i, (a, b) in enumerate(shapes)}
    params["fc1"] = (glorot(keys[4], (6400, 512), 6400, 512), jnp.zeros(512))
    params["fc2"] = (glorot(keys[5], (512, 10), 512, 10), jnp.zeros(10))
    velocity = jax.tree.map(jnp.zeros_like, params)

    def forward(p, xb, k):
        p = jax.tree.map(lambda a: a.astype(dtype), p)
        k1, k2, k3 = jax.random.split(k, 3)

        def conv(h, name):
            w, b = p[name]
            h = jax.lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jax.nn.relu(h + b)

        def pool(h):
            return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

        def dropout(h, rate, k):
            keep = jax.random.bernoulli(k, 1.0 - rate, h.shape)
            return jnp.where(keep, h / (1.0 - rate), 0).astype(h.dtype)

        h = xb.astype(dtype)
        h = dropout(pool(conv(conv(h, "conv0"), "conv1")), 0.25, k1)
        h = dropout(pool(conv(conv(h, "conv2"), "conv3")), 0.25, k2)
        h = h.reshape(h.shape[0], -1)
        h = dropout(jax.nn.relu(h @ p["fc1"][0] + p["fc1"][1]), 0.5, k3)
        return (h @ p["fc2"][0] + p["fc2"][1]).astype(jnp.float32)

    def loss_fn(p, xb, yb, k):
        logits = forward(p, xb, k)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], axis=1).mean()

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(p, v, xs, ys, idx, k):
        loss, g = jax.value_and_grad(loss_fn)(p, xs[idx], ys[idx], k)
        v = jax.tree.map(lambda vi, gi: 0.9 * vi + gi, v, g)
        p = jax.tree.map(lambda pi, vi: pi - 0.01 * vi, p, v)
        return p, v, loss

    xd, yd = jax.device_put(x, device), jax.device_put(y.astype("int32"), device)
    n = len(y)
    steps = n // batch
    seconds = []
    for epoch in range(epochs):
        start = time.perf_counter()
        order = jax.random.permutation(jax.random.fold_in(key, epoch), n)[:steps * batch].reshape(steps, batch)
        step_keys = jax.random.split(jax.random.fold_in(key, 1000 + epoch), steps)
        for s in range(steps):
            params, velocity, loss = step(params, velocity, xd, yd, order[s], step_keys[s])
        float(loss)
        seconds.append(time.perf_counter() - start)
    return {"images_per_second": steady_speed(seconds, steps * batch), "train_seconds": sum(seconds),
            "precision": jnp.dtype(dtype).name, "version": jax.__version__}


# -------------------------------------------------------------------------------------------------- main

def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| notebook | device | notebook images/s | raw loop images/s | ratio | notebook train s | notebook wall s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["notebook_ips"] / r["raw_ips"] if r.get("raw_ips") else float("nan")
        mark = "" if ratio >= TARGET_RATIO else " (below 0.8)"
        lines.append(
            f"| {r['framework']} | {r['device']} | {r['notebook_ips']:,.0f} | {r['raw_ips']:,.0f} ({r['raw_family']}, "
            f"{r['raw_precision']}) | {ratio:.2f}{mark} | {r['train_seconds']:.2f} | {r['notebook_seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="GPU benchmark: the GPU-capable framework notebooks against raw training loops of the same model.")
    parser.add_argument("--frameworks", default=",".join(FAMILY), help="comma-separated, from: " + ", ".join(FAMILY))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--train-images", type=int, default=50_000)
    parser.add_argument("--test-images", type=int, default=10_000)
    parser.add_argument("--workdir", help="where data, kernels and executed notebooks go (default: a temp dir)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--raw", choices=["torch", "jax"], help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.raw:  # the child process of run_raw
        loop = raw_torch if args.raw == "torch" else raw_jax
        print(json.dumps(loop(args.epochs, args.batch, Path(args.data))))
        return 0

    names = [n.strip() for n in args.frameworks.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILY]
    if unknown:
        parser.error(f"unknown framework(s) {unknown}; choose from {list(FAMILY)}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="nbbatch-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    data = write_data(work / "data", args.train_images, args.test_images)
    register_kernels(work / "jupyter", names)
    parameters = {"GPU": True, "DATASET": "cifar10", "DATA_DIR": str(data), "EPOCHS": args.epochs,
                  "BATCHSIZE": args.batch, "MAX_SAMPLES": None}

    rows, raw_results, failures = [], {}, []
    for name in names:
        family = FAMILY[name]
        print(f"[{name}] notebook …", file=sys.stderr, flush=True)
        try:
            metrics = run_notebook(name, parameters, work)
            if family not in raw_results:
                print(f"[{name}] raw {family} loop …", file=sys.stderr, flush=True)
                raw_results[family] = run_raw(family, args, data)
        except Exception as exc:  # report every framework, even when one fails
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[-2000:]}")
            continue
        raw = raw_results[family]
        rows.append({
            "framework": metrics.get("framework", name), "name": name, "device": metrics.get("device", "?"),
            "notebook_ips": metrics["images_per_second"], "train_seconds": metrics["train_seconds"],
            "notebook_seconds": metrics["notebook_seconds"], "raw_ips": raw["images_per_second"],
            "raw_family": family, "raw_precision": raw["precision"], "raw_version": raw["version"],
            "framework_version": metrics.get("framework_version"),
        })

    print(f"\n{args.epochs} epochs × {args.train_images:,} synthetic CIFAR-shaped images, batch {args.batch}, "
          "images/s after the first epoch\n")
    print(markdown_table(rows))
    ok = not failures
    for row in rows:
        ok &= row["notebook_ips"] >= TARGET_RATIO * row["raw_ips"]
    pytorch = next((r for r in rows if r["name"] == "pytorch"), None)
    if pytorch and args.batch == 512 and args.epochs == 10 and args.train_images == 50_000:
        fast = pytorch["train_seconds"] <= PYTORCH_TARGET_SECONDS
        ok &= fast
        print(f"\nPyTorch, 10 epochs × 50,000 at batch 512: {pytorch['train_seconds']:.2f} s "
              f"(target <= {PYTORCH_TARGET_SECONDS:.0f} s: {'met' if fast else 'MISSED'})")
    for failure in failures:
        print(f"\nFAILED {failure}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "failures": failures, "args": vars(args)}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
