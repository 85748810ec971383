"""9 small GPU notebooks on one GPU: one after another vs. several at a time (``runs_per_gpu``, MPS).

    python benchmarks/gpu_share.py [--steps 1500] [--modes 1,auto,auto,auto+mps] [--gpu 0]   # also k+mps
    python benchmarks/gpu_share.py --simulate        # no GPU: sleeps on a fake GPU (checks the script only)

Each notebook trains a tiny CNN (two conv blocks, two dense layers) on one synthetic CIFAR-sized batch
for ``--steps`` steps, in the ``python3`` kernel: this interpreter, which must import torch (and
ipykernel). All runs ask for one GPU; the local backend is given only GPU ``--gpu``. Each mode of
``--modes`` is one batch of the 9, in this order:

  * ``1``: ``runs_per_gpu: 1``, the 9 notebooks one after another on that GPU (the baseline);
  * ``k``: ``runs_per_gpu: k``, k notebooks at a time;
  * ``auto``: ``runs_per_gpu: auto``, packed by memory. The auto batches share one experiment: the
    first finds nothing measured (its first run runs alone, then the others are packed by what it
    used); later ones start from what the earlier batches measured;
  * ``auto+mps``, ``k+mps``: the same, under a CUDA MPS daemon nbbatch starts for the batch.

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
from datetime import datetime
from pathlib import Path

from gpu_notebooks import find_gpus, isolate, submit_all, torch_version, use_gpus, write_notebook
from machine import describe, median

RUNS = 9


def batch(notebook: Path, share: Path, backend: str, tag: str, runs_per_gpu: int | str, steps: int, runs: int = RUNS,
          mps: bool = False) -> dict:
    spec = {"experiment": f"gpushare-{tag}", "notebooks": [{"path": str(notebook), "kernel": "python3"}],
            "parameters": {"STEPS": steps}, "sweep": {"grid": {"ID": list(range(runs))}},
            "resources": {"gpus": 1, "runs_per_gpu": runs_per_gpu, "mps": mps}, "backend": backend,
            "share": str(share)}
    result, wall = submit_all(spec, tag)
    trained, phases = [], []
    for record in result.records:
        out = (share / record.experiment / record.run_id / "output.ipynb").read_text()
        found = re.search(r"(\d+) steps in ([0-9.]+) s", out)
        if found:
            trained.append(float(found.group(2)))
        phases.append(_phases(json.loads(out), record))
    peaks = [r.telemetry.get("memory_run_max_mb") for r in result.records]
    needs = {r.gpu_share.need_mb if r.gpu_share and r.gpu_share.need_mb is not None else "-" for r in result.records}
    return {"wall": wall, "durations": [r.duration_s for r in result.records], "train": trained, "phases": phases,
            "need_mb": sorted(needs, key=str),
            "peak_mb": max((p for p in peaks if p), default=None),
            "peak_from": sorted({str(r.telemetry.get("memory_run_source")) for r in result.records})}


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
    parser.add_argument("--modes", default="1,auto,auto,auto+mps",
                        help="batches to run, in order: 1 (the baseline), k, auto, auto+mps (default 1,auto,auto,auto+mps)")
    parser.add_argument("--gpu", type=int, default=0, help="the GPU to use (NVML index)")
    parser.add_argument("--simulate", action="store_true", help="no GPU: notebooks sleep on a fake GPU")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m.removesuffix("+mps") != "auto" and not m.removesuffix("+mps").isdigit()]
    if bad or not modes:
        raise SystemExit(f"--modes: {bad or 'none'}: each mode is a number of runs per GPU or auto, "
                         "optionally +mps (e.g. 1,auto,auto+mps,9+mps)")
    gpus = [g for g in find_gpus(simulate=1 if args.simulate else 0) if g.index == (0 if args.simulate else args.gpu)]
    if not gpus:
        raise SystemExit(f"no GPU {args.gpu} here (NVML and nvidia-smi found none); --simulate runs without one")
    gpu = gpus[0]
    print(describe(f"{RUNS} small GPU notebooks on one GPU: {', '.join(modes)}"
                   + (" (SIMULATED: sleeps on a fake GPU)" if args.simulate else "")), end="")
    print(f"- GPU {gpu.index}: {gpu.name}, {gpu.memory_mb} MiB; torch {torch_version()}; {args.steps} steps per notebook\n",
          flush=True)
    import nbformat  # noqa: F401 - imports before timing (nbformat's first import can take seconds: jsonschema)
    import papermill  # noqa: F401

    import nbbatch.api  # noqa: F401

    results: list[tuple[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        isolate(root)
        notebook = write_notebook(root / "tiny_cnn.ipynb", simulate=args.simulate)
        backend = use_gpus([gpu])
        batch(notebook, root / "share", backend, "warmup", 1, args.steps, runs=1)
        autos = 0
        for mode in modes:
            per_gpu, mps = mode.removesuffix("+mps"), mode.endswith("+mps")
            if per_gpu.isdigit():
                label = "sequential (runs_per_gpu 1)" if per_gpu == "1" else f"runs_per_gpu {per_gpu}"
                result = batch(notebook, root / "share", backend, f"share{per_gpu}", int(per_gpu), args.steps, mps=mps)
            else:
                label = "auto" if autos == 0 else "auto, measured before"
                result = batch(notebook, root / "share", backend, "auto", "auto", args.steps, mps=mps)
                autos += 1
            label += " + MPS" if mps else ""
            results.append((label, result))
            print(f"{label}: {result['wall']:.1f} s", file=sys.stderr, flush=True)

    base = results[0][1]["wall"]
    print(f"| {RUNS} notebooks on GPU {gpu.index} | wall | notebooks / min | vs {results[0][0]} | median run | "
          "of which: kernel start-up | setup cell (import torch, CUDA, model) | training loop | reserved / run | "
          "peak / run (measured on) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, r in results:
        start_up, setup, loop = (median([p[i] for p in r["phases"]]) for i in range(3))
        reserved = ", ".join("alone" if n is None else n if isinstance(n, str) else f"{n:.0f} MiB" for n in r["need_mb"])
        peak = f"{r['peak_mb']:.0f} MiB ({', '.join(r['peak_from'])})" if r["peak_mb"] else "-"
        print(f"| {label} | {r['wall']:.1f} s | {RUNS / r['wall'] * 60:.1f} | {base / r['wall']:.2f}× | "
              f"{median(r['durations']):.2f} s | {start_up:.2f} s | {setup:.2f} s | {loop:.2f} s | {reserved} | {peak} |")


if __name__ == "__main__":
    main()
