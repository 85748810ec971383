"""9 notebooks of uneven lengths on a 4-GPU machine: makespan against its lower bound, without and with history.

    python benchmarks/makespan.py [--gpus 4] [--scale 1.0]
    python benchmarks/makespan.py --simulate [--scale 0.2]   # no GPU: sleeps on 4 fake GPUs

Nine runs of one notebook, one GPU each (``runs_per_gpu: 1``), planned shortest first: the notebook
trains the tiny CNN of ``gpu_notebooks.py`` for ``SECONDS`` = 10, 10, 10, 10, 15, 15, 20, 25, 45
(times ``--scale``) and so runs for that plus its start-up (torch import, CUDA context). Two
submits to the same share:

  1. no history: the runs start in plan order (a run never seen counts as longest), so the longest
     one starts last;
  2. with history (``force``: everything reruns): the local backend starts runs longest first by
     their recorded durations.

For each the makespan (submit to return, and first start to last end from the run records) is
compared with the lower bound max(longest run, total / GPUs) computed from that submit's own run
durations. Prints markdown tables. Needs: nbbatch (installed, or this repo's src, found on its
own), papermill, nbclient, nbformat, jupyter_client, ipykernel (and their dependencies), pyyaml,
torch. Takes about 3 minutes on 4 GPUs with the defaults.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from gpu_notebooks import find_gpus, isolate, submit_all, torch_version, use_gpus, write_notebook
from machine import describe

SECONDS = [10, 10, 10, 10, 15, 15, 20, 25, 45]  # planned shortest first: the worst order for a greedy start


def submit(notebook: Path, share: Path, backend: str, seconds: list[float]) -> dict:
    spec = {"experiment": "makespan", "notebooks": [{"path": str(notebook), "kernel": "python3"}],
            "parameters": {"STEPS": 0}, "sweep": {"zip": {"ID": list(range(len(seconds))), "SECONDS": seconds}},
            "resources": {"gpus": 1, "runs_per_gpu": 1}, "backend": backend, "share": str(share)}
    result, wall = submit_all(spec, "makespan")
    records = sorted(result.records, key=lambda r: r.started_at)
    first = min(datetime.fromisoformat(r.started_at) for r in records)
    last = max(datetime.fromisoformat(r.ended_at) for r in records)
    return {"wall": wall, "span": (last - first).total_seconds(), "records": records}


def report(title: str, result: dict, gpus: int) -> float:
    durations = [r.duration_s for r in result["records"]]
    bound = max(max(durations), sum(durations) / gpus)
    print(f"\n**{title}** — start order (planned seconds, GPU): " + ", ".join(
        f"{r.parameters['SECONDS']:g}s@{','.join(map(str, r.gpu_ids))}" for r in result["records"]))
    print("\n| | seconds | vs bound |")
    print("|---|---|---|")
    print(f"| lower bound max(longest {max(durations):.1f} s, total {sum(durations):.1f} s / {gpus}) | {bound:.1f} | 1.00× |")
    print(f"| makespan, first start to last end | {result['span']:.1f} | {result['span'] / bound:.2f}× |")
    print(f"| makespan, submit to return | {result['wall']:.1f} | {result['wall'] / bound:.2f}× |")
    return result["span"] / bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=4, help="GPUs to use (the first N; default 4)")
    parser.add_argument("--scale", type=float, default=None, help="multiplies the planned seconds (default 1, simulated 0.2)")
    parser.add_argument("--simulate", action="store_true", help="no GPU: notebooks sleep, on fake GPUs")
    args = parser.parse_args()
    scale = args.scale if args.scale is not None else (0.2 if args.simulate else 1.0)
    gpus = find_gpus(simulate=args.gpus if args.simulate else 0)[:args.gpus]
    if len(gpus) < args.gpus:
        raise SystemExit(f"{args.gpus} GPUs wanted, {len(gpus)} found (NVML / nvidia-smi); --simulate runs without any")
    seconds = [round(s * scale, 3) for s in SECONDS]
    print(describe(f"9 notebooks of uneven lengths on {len(gpus)} GPUs: makespan vs lower bound"
                   + (" (SIMULATED: sleeps on fake GPUs)" if args.simulate else "")), end="")
    print(f"- GPUs: {', '.join(f'{g.index} {g.name}' for g in gpus)}; torch {torch_version()}\n"
          f"- planned seconds (plan order): {', '.join(f'{s:g}' for s in seconds)}\n", flush=True)
    import nbformat  # noqa: F401 - imports before timing (nbformat's first import can take seconds: jsonschema)
    import papermill  # noqa: F401

    import nbbatch.api  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        isolate(root)
        notebook = write_notebook(root / "tiny_cnn.ipynb", simulate=args.simulate)
        backend = use_gpus(gpus)
        cold = submit(notebook, root / "share", backend, seconds)
        print(f"no history: {cold['span']:.1f} s", file=sys.stderr, flush=True)
        warm = submit(notebook, root / "share", backend, seconds)
        print(f"with history: {warm['span']:.1f} s", file=sys.stderr, flush=True)
    report("1. no history (plan order)", cold, len(gpus))
    ratio = report("2. with history (longest first by past durations)", warm, len(gpus))
    print(f"\nwith history: makespan {ratio:.2f}× the lower bound (target ≤ 1.15×); "
          f"without: {cold['span'] / warm['span']:.2f}× the makespan with history")


if __name__ == "__main__":
    main()
