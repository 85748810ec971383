"""Distributed runs against one GPU: the framework notebooks through nbbatch's own launcher.

    python benchmarks/distributed.py                                  # pytorch, jax-flax, keras-jax at 1 and 2 GPUs
    python benchmarks/distributed.py --gpus 1,2,4 --frameworks pytorch,lightning,jax-flax,keras-jax --epochs 6
    python benchmarks/distributed.py --cpu-ranks 2 --frameworks pytorch   # CPU ranks over gloo (digits)

Each notebook runs on 50,000 CIFAR-shaped synthetic images (``--train-images``), ``BATCHSIZE`` 512 per GPU,
``GPU=True``. First it runs as an ordinary run on one GPU. Then it runs as a distributed run over N GPUs of
this machine, submitted with ``nbbatch.api.submit``: torch notebooks get N ranks with one GPU each (DDP over
NCCL), JAX notebooks get one process over N GPUs. The script prints a markdown table of
``images_per_second`` as rank 0 records it (the images of all ranks, leaving out the first epoch), the
speed-up over one GPU, and whether the ranks ended with the same weights.

Made for a GPU machine without nbbatch's framework venvs, like gpu_notebooks.py: each notebook's kernel
runs this Python (it needs torch, lightning, jax, flax, optax, keras, papermill, ipykernel). With
``--cpu-ranks`` it uses the project's framework environments on digits instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from machine import describe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
KIND = {"pytorch": "torch", "lightning": "torch", "jax-flax": "jax", "keras-jax": "jax",
        "tensorflow": "tensorflow", "keras-tf": "tensorflow"}


def submit_run(name: str, gpus: int, parameters: dict, folder: Path, backend: str, cpu_ranks: int = 0) -> dict:
    """One run of framework ``name``'s notebook over ``gpus`` GPUs (1: an ordinary run) or ``cpu_ranks`` CPU ranks."""
    from nbbatch.api import submit
    from nbbatch.spec.experiment import Experiment, NotebookEntry, Resources
    from nbbatch.spec.frameworks import get_framework
    from nbbatch.spec.project import Project

    framework = get_framework(name, Project(ROOT))
    kind = KIND[name]
    ranks = cpu_ranks or gpus
    resources = Resources(gpus=gpus)
    if ranks > 1:
        per_node = ranks if kind == "torch" else 1
        resources = Resources.of(kind, gpus_per_node=gpus, processes_per_node=per_node)
    experiment = Experiment(name=f"{name}-{gpus}gpu-{cpu_ranks}cpu", base_dir=folder, share=str(folder / "results"),
                            notebooks=[NotebookEntry(framework.notebook, framework.kernel_name, name)],
                            parameters=parameters, backend=backend, resources=resources)
    (record,) = submit(experiment, force=True, progress=False).records
    if record.status != "succeeded":
        raise SystemExit(f"{name} on {gpus} GPU(s): {record.status}: {record.error.summary() if record.error else ''}\n"
                         f"log: {folder / 'results' / experiment.name / record.run_id / 'log.txt'}")
    checksums = {record.metrics.get("weights_checksum")}
    for rank in range(1, record.world_size):
        import nbformat

        from nbbatch.metrics import metrics_from_notebook

        path = folder / "results" / experiment.name / record.run_id / "ranks" / str(rank) / "output.ipynb"
        checksums.add(metrics_from_notebook(nbformat.read(path, as_version=4)).get("weights_checksum"))
    return {**record.metrics, "world_size": record.world_size, "same_weights": len(checksums) == 1,
            "duration_s": record.duration_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="pytorch,jax-flax,keras-jax")
    parser.add_argument("--gpus", default="1,2", help="GPU counts to compare (the first is the baseline)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--train-images", type=int, default=50_000)
    parser.add_argument("--batchsize", type=int, default=512, help="per GPU")
    parser.add_argument("--cpu-ranks", type=int, default=0, help="CPU ranks over gloo on digits instead of GPUs")
    args = parser.parse_args()
    names = args.frameworks.split(",")
    folder = Path(tempfile.mkdtemp(prefix="nbbatch-bench-distributed-"))
    os.environ["NBBATCH_PROJECT"] = str(folder)
    (folder / ".nbbatch").mkdir()
    if args.cpu_ranks:
        from nbbatch.spec.project import Project

        Project(ROOT).activate_kernels()
        parameters = {"EPOCHS": args.epochs}
        counts, backend = [1, args.cpu_ranks], "local"
        print(describe(f"distributed framework notebooks: {args.cpu_ranks} CPU ranks against 1 (digits)"))
    else:
        from gpu_notebooks import find_gpus, register_kernels, use_gpus, write_data

        register_kernels(folder / "jupyter", names)
        data = write_data(folder / "data", args.train_images, 10_000)
        parameters = {"GPU": True, "DATASET": "cifar10", "DATA_DIR": str(data), "BATCHSIZE": args.batchsize,
                      "EPOCHS": args.epochs}
        gpus = find_gpus()
        counts = [int(n) for n in args.gpus.split(",") if int(n) <= len(gpus)]
        backend = use_gpus(gpus)
        print(describe(f"distributed framework notebooks on {', '.join(g.name for g in gpus)}: "
                       f"{args.train_images} CIFAR-shaped images, batch {args.batchsize} per GPU, "
                       f"{args.epochs} epochs"))
    unit = "CPU ranks" if args.cpu_ranks else "GPUs"
    print(f"\n| framework | {unit} | images/s (after epoch 1) | speed-up | same weights on every rank | "
          "accuracy | run seconds |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        base = None
        for count in counts:
            metrics = submit_run(name, 0 if args.cpu_ranks else count, parameters, folder, backend,
                                 cpu_ranks=count if args.cpu_ranks else 0)
            speed = float(metrics["images_per_second"])
            base = base or speed
            same = "–" if metrics["world_size"] == 1 and count == 1 else ("yes" if metrics["same_weights"] else "NO")
            print(f"| {name} | {count} | {speed:,.0f} | {speed / base:.2f}× | {same} | "
                  f"{metrics.get('accuracy', float('nan')):.3f} | {metrics['duration_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
