"""The framework notebooks as users give them (by path, in the ``python3`` kernel) sharing one GPU.

    python benchmarks/gpu_share_frameworks.py                        # both batches, modes 1,auto,auto,auto+mps
    python benchmarks/gpu_share_frameworks.py --batches pytorch9 --modes 1,auto --samples 2000
    python benchmarks/gpu_share_frameworks.py --cpu --kernels own --samples 300 --epochs 1   # no GPU: checks the script

Two batches of 9 runs, each a sweep over ``SEED`` of notebooks from ``notebooks/`` given as
``notebooks: [{path: ..., kernel: python3}]``, on CIFAR-shaped synthetic data (``--samples`` images, ``--epochs``,
``--batchsize``):

  * ``pytorch9``: 9 × PyTorch_CIFAR;
  * ``mixed``: 3 × (PyTorch_CIFAR, Lightning_CIFAR, JAX_Flax_CIFAR);
  * ``pytorch18``: 18 × PyTorch_CIFAR, 9 at a time (``max_parallel: 9``) with 9 kernels started ahead
    (``prestart: 9``), so that the second 9 start warm under 9-way concurrency.

By default (``--where user``) the notebooks are copied to a folder of their own outside any project, as a user
keeps them: they are recognised by their imports against the frameworks nbbatch ships. ``--where project``
recognises them against this repo's ``frameworks/`` (``NBBATCH_FRAMEWORKS_DIR``), as in a project that has them.

Each mode of ``--modes`` is one submission of the batch, in order: ``1`` (``runs_per_gpu: 1``, one after
another: the baseline), ``auto`` (the first ``auto`` of a batch finds nothing measured: only what nbbatch
recognises from the notebook; later ones start from what it measured), ``+mps`` under CUDA MPS. Prints one
markdown table: wall time, the ratio to the batch's sequential time, the median setup (every cell up to the
training loop: imports, CUDA context, data on the GPU, the model), the median setup of runs that got a kernel
started ahead with its framework imported, and the memory reserved per run. Needs this repo's src (found on its
own), papermill and ipykernel, and in this Python torch, pytorch_lightning, jax with CUDA, flax and optax.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from gpu_notebooks import ROOT, find_gpus, isolate, submit_all, use_gpus, write_data
from machine import describe, median

BATCHES = {"pytorch9": ["PyTorch_CIFAR"] * 9, "mixed": ["PyTorch_CIFAR", "Lightning_CIFAR", "JAX_Flax_CIFAR"] * 3,
           "pytorch18": ["PyTorch_CIFAR"] * 18}  # 9 at a time: the second 9 get kernels started ahead (warm)
AT_A_TIME = {"pytorch18": 9}
OWN_KERNELS = {"PyTorch_CIFAR": "nbbatch-pytorch", "Lightning_CIFAR": "nbbatch-lightning",
               "JAX_Flax_CIFAR": "nbbatch-jax-flax"}
WARM = "=== nbbatch: kernel started ahead, "  # log.txt of a run given a kernel started ahead, its framework imported
FORKED = "; forked from a process that had imported"  # ... and forked from a fork server (docs/gpus.md)


def submit_batch(names: list[str], tag: str, mode: str, args: argparse.Namespace, share: Path, data: Path,
                 backend: str) -> dict:

    per_gpu, mps = mode.removesuffix("+mps"), mode.endswith("+mps")
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    notebooks = [{"path": str(args.notebook_dir / f"{n}.ipynb"),
                  "kernel": OWN_KERNELS[n] if args.kernels == "own" else "python3"} for n in counts]
    spec = {"experiment": f"share-{tag}-{'seq' if per_gpu == '1' else 'auto'}", "notebooks": notebooks,
            "parameters": {"EPOCHS": args.epochs, "BATCHSIZE": args.batchsize, "MAX_SAMPLES": args.samples,
                           "DATASET": "cifar10", "DATA_DIR": str(data), "GPU": not args.cpu},
            "sweep": {"grid": {"SEED": list(range(max(counts.values())))}},
            "resources": {"gpus": 0 if args.cpu else 1, "runs_per_gpu": int(per_gpu) if per_gpu.isdigit() else per_gpu,
                          "mps": mps, "max_parallel": AT_A_TIME.get(tag)},
            "backend": {"name": backend, "prestart": AT_A_TIME.get(tag, 2)}, "share": str(share)}
    result, wall = submit_all(spec, f"{tag} {mode}")
    setups, warm_setups, imports, warm_imports, needs, forked = [], [], [], [], set(), 0
    for record in result.records:
        folder = share / record.experiment / record.run_id
        setup, first = setup_seconds(json.loads((folder / "output.ipynb").read_text()))
        setups.append(setup)
        imports.append(first)
        log = (folder / "log.txt").read_text()
        forked += FORKED in log
        if WARM in log:
            warm_setups.append(setup)
            warm_imports.append(first)
            if args.cells:  # where a warm run's setup goes: each cell's seconds
                print(f"{record.run_id}: " + ", ".join(f"{t:.2f}" for t in cell_seconds(
                    json.loads((folder / "output.ipynb").read_text()))), file=sys.stderr)
        share_info = record.gpu_share
        needs.add(f"{share_info.need_mb:.0f} MiB ({share_info.need_from})" if share_info and share_info.need_mb
                  else "alone first" if share_info and share_info.exclusive else "-")
    return {"wall": wall, "setup": median(setups), "imports": median(imports),
            "warm": (median(warm_setups), median(warm_imports), len(warm_setups)) if warm_setups else None, "forked": forked,
            "needs": ", ".join(sorted(needs))}


def cell_seconds(nb: dict) -> list[float]:
    """Each code cell's seconds, the parameters cells left out."""
    return [c.get("metadata", {}).get("papermill", {}).get("duration") or 0.0 for c in nb["cells"]
            if c["cell_type"] == "code" and not {"parameters", "injected-parameters"} & set(c["metadata"].get("tags", []))]


def setup_seconds(nb: dict) -> tuple[float, float]:
    """Seconds of the cells before the training loop (up to the one defining ``summarize_epochs``), and of the
    first of them, the imports cell."""
    spans = []
    for cell in nb["cells"]:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code" or "parameters" in tags or "injected-parameters" in tags:
            continue
        spans.append(cell.get("metadata", {}).get("papermill", {}).get("duration") or 0.0)
        if "def summarize_epochs" in "".join(cell["source"]):
            break
    return sum(spans), spans[0] if spans else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="pytorch9,mixed", help="of: " + ", ".join(BATCHES))
    parser.add_argument("--modes", default="1,auto,auto,auto+mps", help="1, k, auto, each optionally +mps")
    parser.add_argument("--samples", type=int, default=10000, help="training images (default 10000)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batchsize", type=int, default=256)
    parser.add_argument("--gpu", type=int, default=0, help="the GPU to use (NVML index)")
    parser.add_argument("--kernels", choices=["python3", "own"], default="python3",
                        help="python3 (this Python; default) or the frameworks' own nbbatch-<name> kernels")
    parser.add_argument("--where", choices=["user", "project"], default="user",
                        help="user: the notebooks copied to a folder outside any project (default); project: beside "
                             "this repo's frameworks/")
    parser.add_argument("--cells", action="store_true", help="print each cell's seconds for runs that started warm")
    parser.add_argument("--cpu", action="store_true", help="no GPU: runs on the CPU (checks the script only)")
    args = parser.parse_args()
    batches = [b.strip() for b in args.batches.split(",") if b.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(batches) <= set(BATCHES) or not modes:
        raise SystemExit(f"--batches: choose from {', '.join(BATCHES)}; --modes: e.g. 1,auto,auto+mps")
    gpus = [] if args.cpu else [g for g in find_gpus() if g.index == args.gpu]
    if not gpus and not args.cpu:
        raise SystemExit(f"no GPU {args.gpu} here; --cpu checks the script without one")
    where = f"GPU {gpus[0].index}: {gpus[0].name}, {gpus[0].memory_mb} MiB" if gpus else "CPU only (a check, not a measurement)"
    print(describe(f"framework notebooks by path sharing one GPU: {', '.join(batches)} × {', '.join(modes)}"), end="")
    print(f"- {where}; {args.samples} images × {args.epochs} epochs, batch {args.batchsize}; kernels: {args.kernels}; "
          f"notebooks in: {args.where} folder\n",
          flush=True)
    import papermill  # noqa: F401 - imported before timing

    import nbbatch.api  # noqa: F401

    if args.kernels == "own":
        from nbbatch.spec.project import Project
        Project(ROOT).activate_kernels()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        isolate(root)
        args.notebook_dir = ROOT / "notebooks"
        if args.where == "project":
            os.environ["NBBATCH_FRAMEWORKS_DIR"] = str(ROOT / "frameworks")  # recognised as in a project that has them
        else:  # a folder of the user's own: recognised against the frameworks nbbatch ships
            args.notebook_dir = root / "my-notebooks"
            args.notebook_dir.mkdir()
            for name in {n for tag in batches for n in BATCHES[tag]}:
                shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", args.notebook_dir)
        data = write_data(root / "data", args.samples, 1000)
        backend = use_gpus(gpus)
        for tag in batches:
            base = None
            for mode in modes:
                result = submit_batch(BATCHES[tag], tag, mode, args, root / "share", data, backend)
                base = base or result["wall"]
                rows.append((tag, mode, result, base))
                print(f"{tag} {mode}: {result['wall']:.1f} s", file=sys.stderr, flush=True)
    print("| batch | mode | wall | vs sequential | median setup (imports cell) | warm runs: median setup (imports cell), "
          "runs | reserved / run |")
    print("|---|---|---|---|---|---|---|")
    for tag, mode, r, base in rows:
        warm = f"{r['warm'][0]:.2f} s ({r['warm'][1]:.2f} s), {r['warm'][2]} ({r['forked']} forked)" if r["warm"] else "-"
        print(f"| {tag} | {mode} | {r['wall']:.1f} s | {base / r['wall']:.2f}× | {r['setup']:.2f} s ({r['imports']:.2f} s) | "
              f"{warm} | {r['needs']} |")


if __name__ == "__main__":
    main()
