"""The GPU memory one run of each GPU framework notebook needs: where ``gpu_memory_mb`` in
``frameworks/<name>/framework.yaml`` comes from (what ``runs_per_gpu: auto`` reserves for a notebook
that no earlier run measured).

    python benchmarks/gpu_memory.py [--frameworks pytorch,lightning,jax-flax,keras-jax] [--epochs 2]

Submits each framework notebook once through nbbatch on GPU 0 (``runs_per_gpu: auto``: nothing measured
yet, so each run has the GPU to itself, with the frameworks' sharing settings such as
``XLA_PYTHON_CLIENT_PREALLOCATE=false``) on CIFAR-shaped synthetic data, and prints the peak each run's
processes held on the GPU (``memory_run_max_mb`` in run.json: from NVML's process list, or the GPU's used
memory above what it was before the run when the process list is not visible), with 20 % on top,
rounded up to 250 MiB: the suggested estimate. Same needs as ``gpu_notebooks.py`` (this Python runs every
kernel: torch, lightning, jax with CUDA, flax, optax, keras; papermill, ipykernel; nvidia-ml-py).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

from gpu_notebooks import FAMILY, ROOT, find_gpus, isolate, register_kernels, use_gpus, write_data
from machine import describe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frameworks", default=",".join(FAMILY), help="comma-separated, from: " + ", ".join(FAMILY))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-images", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=512, help="BATCHSIZE (default 512, as gpu_notebooks.py)")
    args = parser.parse_args()
    names = [n.strip() for n in args.frameworks.split(",") if n.strip()]
    gpus = [g for g in find_gpus() if g.index == 0]
    if not gpus:
        raise SystemExit("no GPU 0 here")
    import nbbatch
    from nbbatch.spec.frameworks import list_frameworks
    from nbbatch.spec.project import Project

    frameworks = list_frameworks(Project(ROOT))
    print(describe(f"GPU memory of one run of each framework notebook ({args.epochs} epochs of {args.train_images:,}, "
                   f"batch {args.batch})"),
          end="")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        isolate(work)
        data = write_data(work / "data", args.train_images, 2_000)
        register_kernels(work / "jupyter", names)
        sharing: dict[str, str] = {}
        for name in names:
            sharing.update(frameworks[name].shared_gpu_env)
        spec = {"experiment": "gpu-memory", "backend": use_gpus(gpus), "share": str(work / "share"),
                "notebooks": [{"path": str(frameworks[n].notebook), "kernel": frameworks[n].kernel_name, "label": n}
                              for n in names],
                "parameters": {"GPU": True, "DATASET": "cifar10", "DATA_DIR": str(data), "EPOCHS": args.epochs,
                               "BATCHSIZE": args.batch, "MAX_SAMPLES": None},
                "resources": {"gpus": 1, "runs_per_gpu": "auto"}, "env": sharing}
        result = nbbatch.submit(spec, progress=False, force=True)
    print("| framework | status | peak on the GPU (measured on) | run alone? | suggested gpu_memory_mb | now in framework.yaml |")
    print("|---|---|---|---|---|---|")
    for record in sorted(result.records, key=lambda r: r.run_id):
        name = record.run_id.rsplit("-", 1)[0]
        peak = record.telemetry.get("memory_run_max_mb")
        suggested = math.ceil(peak * 1.2 / 250) * 250 if peak else None
        print(f"| {name} | {record.status} | {f'{peak:.0f} MiB' if peak else '-'} "
              f"({record.telemetry.get('memory_run_source')}) | {record.gpu_share.exclusive if record.gpu_share else None} | "
              f"{suggested or '-'} | {frameworks[name].gpu_memory_mb or '-'} |")
        if record.status != "succeeded":
            print(f"  {name}: {record.error.summary() if record.error else ''}", file=sys.stderr)
    return 0 if all(r.status == "succeeded" for r in result.records) else 1


if __name__ == "__main__":
    sys.exit(main())
