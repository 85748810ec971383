"""What checkpointing every epoch costs the framework notebooks, and what resuming saves.

    python benchmarks/checkpoints.py [--frameworks pytorch,lightning,jax-flax,keras-jax,keras-tf] [--rounds 2]
    python benchmarks/checkpoints.py --gpu --frameworks pytorch,lightning,jax-flax,keras-jax --epochs 6

Each framework's notebook runs on digits (its defaults, ``EPOCHS`` 4) with papermill in its kernel, in
alternating order: without ``NBBATCH_CHECKPOINT_DIR`` (no checkpoints) and with it (one checkpoint per
epoch, a fresh folder each time). Then once more with EPOCHS 4 on the checkpoint of epoch 2 (what the
attempt after a kernel death at epoch 3 does). Prints a markdown table: medians of ``train_seconds`` as
the notebook records it, the checkpoint's size, and the resumed attempt's training time.
Needs the framework environments (``nbbatch envs create``). With ``--gpu`` (a GPU machine without the
framework venvs, like benchmarks/gpu_notebooks.py): the kernels run this Python, on CIFAR-shaped synthetic
data (``--train-images``, ``--batchsize``), with ``GPU=True``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from machine import describe, median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def execute(notebook: Path, kernel: str, work: Path, checkpoints: Path | None, epochs: int,
            parameters: dict | None = None) -> dict:
    import papermill

    from nbbatch.metrics import metrics_from_notebook

    env = {"NBBATCH_OUTPUT_DIR": str(work / "outputs")}
    if checkpoints is not None:
        env["NBBATCH_CHECKPOINT_DIR"] = str(checkpoints)
    saved = {k: os.environ.get(k) for k in ("NBBATCH_OUTPUT_DIR", "NBBATCH_CHECKPOINT_DIR")}
    os.environ.pop("NBBATCH_CHECKPOINT_DIR", None)
    os.environ.update(env)
    try:
        out = work / "out.ipynb"
        nb = papermill.execute_notebook(str(notebook), str(out), parameters={**(parameters or {}), "EPOCHS": epochs},
                                        kernel_name=kernel,
                                        cwd=str(work), progress_bar=False, log_output=False)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
    return metrics_from_notebook(nb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="pytorch,lightning,jax-flax,keras-jax,keras-tf")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--gpu", action="store_true", help="GPU=True on CIFAR-shaped data, kernels on this Python")
    parser.add_argument("--train-images", type=int, default=50_000)
    parser.add_argument("--batchsize", type=int, default=512)
    args = parser.parse_args()
    from nbbatch.spec.frameworks import get_framework
    from nbbatch.spec.project import Project

    project = Project(ROOT)
    project.activate_kernels()
    parameters: dict = {}
    names = args.frameworks.split(",")
    if args.gpu:
        from gpu_notebooks import register_kernels, write_data

        scratch = Path(tempfile.mkdtemp(prefix="nbbatch-bench-ckpt-gpu-"))
        register_kernels(scratch / "jupyter", names)
        data = write_data(scratch / "data", args.train_images, 10_000)
        parameters = {"GPU": True, "DATASET": "cifar10", "DATA_DIR": str(data), "BATCHSIZE": args.batchsize}
    print(describe("checkpoints of the framework notebooks " +
                   (f"(GPU, {args.train_images} CIFAR-shaped images, batch {args.batchsize})" if args.gpu else "(digits)")))
    print(f"\n| framework | train_seconds, no checkpoints | with a checkpoint per epoch | checkpoint size | "
          f"resumed at epoch {args.epochs // 2} of {args.epochs}: train_seconds of that attempt |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="nbbatch-bench-ckpt-") as tmp:
        os.environ.setdefault("KERAS_HOME", str(Path(tmp) / "keras"))
        for name in names:
            framework = get_framework(name, project)
            plain, checkpointed, size = [], [], 0
            for round_ in range(args.rounds):
                for with_checkpoints in ((False, True) if round_ % 2 == 0 else (True, False)):
                    work = Path(tmp) / f"{name}-{round_}-{with_checkpoints}"
                    work.mkdir()
                    folder = work / "checkpoints" if with_checkpoints else None
                    metrics = execute(framework.notebook, framework.kernel_name, work, folder, args.epochs, parameters)
                    (checkpointed if with_checkpoints else plain).append(metrics["train_seconds"])
                    if folder is not None:
                        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            half = Path(tmp) / f"{name}-half"
            half.mkdir()
            execute(framework.notebook, framework.kernel_name, half, half / "checkpoints", args.epochs // 2, parameters)
            resumed = Path(tmp) / f"{name}-resumed"
            shutil.copytree(half / "checkpoints", resumed / "checkpoints")
            metrics = execute(framework.notebook, framework.kernel_name, resumed, resumed / "checkpoints", args.epochs,
                              parameters)
            assert metrics.get("resumed_from_epoch") == args.epochs // 2, metrics
            # train_seconds of a resumed run includes the saved epochs' times; this attempt's are the rest
            device = f" ({metrics.get('device')})" if args.gpu else ""
            print(f"| {name}{device} | {median(plain):.2f} s | {median(checkpointed):.2f} s "
                  f"({median(checkpointed) / median(plain):.2f}×) | {size / 2**20:.1f} MiB | "
                  f"{metrics['train_seconds'] - _saved_seconds(half):.2f} s |", flush=True)


def _saved_seconds(half: Path) -> float:
    import nbformat

    from nbbatch.metrics import metrics_from_notebook

    return float(metrics_from_notebook(nbformat.read(half / "out.ipynb", as_version=4))["train_seconds"])


if __name__ == "__main__":
    main()
