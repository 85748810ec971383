"""9 small GPU notebooks on one GPU: one after another vs. several at a time (``runs_per_gpu``).

    python benchmarks/gpu_share.py [--steps 1500] [--shares 3,5,9] [--gpu 0]
    python benchmarks/gpu_share.py --simulate        # no GPU: sleeps on a fake GPU (checks the script only)

Each notebook trains a tiny CNN (two conv blocks, two dense layers) on one synthetic CIFAR-sized batch
for ``--steps`` steps, in the ``python3`` kernel: this interpreter, which must import torch (and
ipykernel). All runs ask for one GPU; the local backend is given only GPU ``--gpu``, so:

  * sequential: ``runs_per_gpu: 1``, the 9 notebooks one after another on that GPU;
  * shared: ``runs_per_gpu: k`` for each k of ``--shares``, k notebooks at a time on the same GPU.

A warm-up notebook runs first (file caches, CUDA's caches). Prints a markdown table: wall time for
the 9, throughput (notebooks per minute), the ratio to sequential, and the median run and training
times. Needs: nbbatch (installed, or this repo's src, found on its own), papermill, nbclient, nbformat, jupyter_client,
ipykernel (and their dependencies), pyyaml, torch. Takes about 3 minutes on an H100 or H200 with the defaults.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from gpu_notebooks import find_gpus, isolate, torch_version, use_gpus, write_notebook
from machine import describe, median

RUNS = 9


def batch(notebook: Path, share: Path, backend: str, tag: str, runs_per_gpu: int, steps: int, runs: int = RUNS) -> dict:
    import nbbatch

    spec = {"experiment": f"gpushare-{tag}", "notebooks": [{"path": str(notebook), "kernel": "python3"}],
            "parameters": {"STEPS": steps}, "sweep": {"grid": {"ID": list(range(runs))}},
            "resources": {"gpus": 1, "runs_per_gpu": runs_per_gpu}, "backend": backend, "share": str(share)}
    start = time.perf_counter()
    result = nbbatch.submit(spec, progress=False, force=True)
    wall = time.perf_counter() - start
    failed = [(r.run_id, r.error.summary() if r.error else r.status) for r in result.records if r.status != "succeeded"]
    if failed:
        raise SystemExit(f"{tag}: runs failed: {failed[:3]} (see {share}/gpushare-{tag}/<run>/log.txt)")
    trained, phases = [], []
    for record in result.records:
        out = (share / record.experiment / record.run_id / "output.ipynb").read_text()
        found = re.search(r"(\d+) steps in ([0-9.]+) s", out)
        if found:
            trained.append(float(found.group(2)))
        phases.append(_phases(json.loads(out), record))
    return {"wall": wall, "durations": [r.duration_s for r in result.records], "train": trained, "phases": phases}


def _phases(nb: dict, record) -> tuple[float, float, float]:
    """(run start to first cell: kernel start-up; the setup cell: torch import, CUDA context, model; the loop cell)."""
    def at(text: str) -> datetime:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))

    cells = [c for c in nb["cells"] if c.get("metadata", {}).get("papermill", {}).get("start_time")]
    started = at(record.started_at)
    first = at(cells[0]["metadata"]["papermill"]["start_time"])
    spans = [c["metadata"]["papermill"].get("duration") or 0.0 for c in cells]
    return (first - started).total_seconds(), spans[-2], spans[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500, help="training steps per notebook (default 1500)")
    parser.add_argument("--shares", default="3,5,9", help="runs_per_gpu values to compare with 1 (default 3,5,9)")
    parser.add_argument("--gpu", type=int, default=0, help="the GPU to use (NVML index)")
    parser.add_argument("--simulate", action="store_true", help="no GPU: notebooks sleep on a fake GPU")
    args = parser.parse_args()
    shares = [int(k) for k in args.shares.split(",") if k.strip()]
    gpus = [g for g in find_gpus(simulate=1 if args.simulate else 0) if g.index == (0 if args.simulate else args.gpu)]
    if not gpus:
        raise SystemExit(f"no GPU {args.gpu} here (NVML and nvidia-smi found none); --simulate runs without one")
    gpu = gpus[0]
    print(describe(f"{RUNS} small GPU notebooks on one GPU: sequential vs runs_per_gpu {args.shares}"
                   + (" (SIMULATED: sleeps on a fake GPU)" if args.simulate else "")), end="")
    print(f"- GPU {gpu.index}: {gpu.name}, {gpu.memory_mb} MiB; torch {torch_version()}; {args.steps} steps per notebook\n",
          flush=True)
    import nbformat  # noqa: F401 - imports before timing (nbformat's first import can take seconds: jsonschema)
    import papermill  # noqa: F401

    import nbbatch.api  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        isolate(root)
        notebook = write_notebook(root / "tiny_cnn.ipynb", simulate=args.simulate)
        backend = use_gpus([gpu])
        batch(notebook, root / "share", backend, "warmup", 1, args.steps, runs=1)
        results = {1: batch(notebook, root / "share", backend, "seq", 1, args.steps)}
        print(f"sequential: {results[1]['wall']:.1f} s", file=sys.stderr, flush=True)
        for k in shares:
            results[k] = batch(notebook, root / "share", backend, f"share{k}", k, args.steps)
            print(f"runs_per_gpu {k}: {results[k]['wall']:.1f} s", file=sys.stderr, flush=True)

    seq = results[1]["wall"]
    print(f"| {RUNS} notebooks on GPU {gpu.index} | wall | notebooks / min | throughput vs sequential | "
          "median run | of which: kernel start-up | setup cell (import torch, CUDA, model) | training loop |")
    print("|---|---|---|---|---|---|---|---|")
    for k, r in results.items():
        label = "sequential (runs_per_gpu 1)" if k == 1 else f"runs_per_gpu {k}"
        start_up, setup, loop = (median([p[i] for p in r["phases"]]) for i in range(3))
        print(f"| {label} | {r['wall']:.1f} s | {RUNS / r['wall'] * 60:.1f} | {seq / r['wall']:.2f}× | "
              f"{median(r['durations']):.2f} s | {start_up:.2f} s | {setup:.2f} s | {loop:.2f} s |")
    best = max(seq / results[k]["wall"] for k in shares) if shares else 1.0
    print(f"\nbest throughput ratio {best:.2f}× (target ≥ 3×)")


if __name__ == "__main__":
    main()
