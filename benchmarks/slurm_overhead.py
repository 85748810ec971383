"""What the slurm backend adds per run, against the local backend: 12 trivial notebooks on each, side by side.

    python benchmarks/slurm_overhead.py [--runs 12] [--rounds 3] [--max-parallel 2]

Starts the tests' two-node Slurm cluster on this machine (tests/support/slurm.py: munged, slurmctld and two slurmd,
on ports of its own; needs root and Debian's slurm and munge), then, each round in alternating order (so a machine
getting busier or quieter affects both alike), submits the same sweep of ``--runs`` runs of a notebook whose one
cell does nothing (``python3`` kernel):

  * local: ``backend: {name: local, max_parallel: K}`` (its defaults otherwise: kernels started ahead);
  * slurm: ``backend: {name: slurm, max_parallel: K, cpus: 1, memory: 256M}``: one job array throttled to K
    (``--array=0-11%K``), every task a ``nbbatch run-one`` in a fresh Python process on a node, its own kernel.

Both wait for every run (``api.submit(wait=True)``). Per backend it reports the wall time from ``submit`` to the
last run's end, and the time from ``submit`` to the first run executing (the earliest ``started_at`` of the run
records minus the moment ``submit`` was called); then medians over the rounds, the per-run overhead
``(slurm wall − local wall) / runs`` and the ratio of the walls. The load average is printed with every round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from machine import describe, load_average, scratch_project

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' Slurm cluster

from support.notebooks import make_notebook  # noqa: E402 - after the path above
from support.slurm import SlurmCluster, slurm_available  # noqa: E402

GOAL_S = 1.5  # issue 29: per-run overhead within 1.5 s of local


def experiment(name: str, share: Path, backend: dict, runs: int) -> dict:
    return {"experiment": name, "notebooks": [{"path": "trivial.ipynb", "kernel": "python3"}],
            "sweep": {"grid": {"SEED": list(range(runs))}}, "backend": backend, "share": str(share)}


def one_batch(name: str, share: Path, backend: dict, runs: int) -> tuple[float, float]:
    """(wall seconds from submit to the last run's end, seconds from submit to the first run executing)."""
    from nbbatch import api

    called = datetime.now(timezone.utc)
    start = time.perf_counter()
    result = api.submit(experiment(name, share, backend, runs), wait=True, progress=False)
    wall = time.perf_counter() - start
    if not result.ok or len(result.records) != runs:
        errors = [f"{r.run_id}: {r.status} {r.error}" for r in result.records if r.status != "succeeded"]
        raise SystemExit(f"{name}: not every run succeeded: {errors}")
    first = min(datetime.fromisoformat(r.started_at) for r in result.records if r.started_at)
    return wall, (first - called).total_seconds()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-parallel", type=int, default=2, help="runs at once on both backends (default 2)")
    args = parser.parse_args()
    why = slurm_available()
    if why:
        print(f"cannot start a Slurm cluster here: {why}", file=sys.stderr)
        return 2
    root, project = scratch_project("nbbatch-slurm-bench-")
    make_notebook(project / "trivial.ipynb", ["pass"], parameters="SEED = 0")
    print(describe("Slurm backend against local"))
    cluster = SlurmCluster(root / "slurm")
    began = time.perf_counter()
    cluster.start()
    print(f"- Slurm cluster (2 slurmd on this host) started in {time.perf_counter() - began:.1f} s; "
          f"{cluster.run('sinfo', '-V').stdout.strip()}\n")
    os.environ.update(cluster.env)
    backends = {
        "local": {"name": "local", "max_parallel": args.max_parallel},
        "slurm": {"name": "slurm", "max_parallel": args.max_parallel, "cpus": 1, "memory": "256M"},
    }
    walls: dict[str, list[float]] = {name: [] for name in backends}
    firsts: dict[str, list[float]] = {name: [] for name in backends}
    print(f"{args.runs} runs of a notebook whose cell does nothing, max_parallel {args.max_parallel} on both\n")
    print("| round | backend | wall (s) | submit → first run executing (s) | load average before (1/5/15 min) |")
    print("|---|---|---|---|---|")
    try:
        for round_ in range(1, args.rounds + 1):
            order = list(backends) if round_ % 2 else list(reversed(backends))
            for name in order:
                load = load_average()
                wall, first = one_batch(f"bench-{name}-{round_}", root / "share", backends[name], args.runs)
                walls[name].append(wall)
                firsts[name].append(first)
                print(f"| {round_} | {name} | {wall:.1f} | {first:.2f} | {load} |", flush=True)
    finally:
        cluster.stop()
    local, slurm = statistics.median(walls["local"]), statistics.median(walls["slurm"])
    per_run = (slurm - local) / args.runs
    print("\n| medians | local | slurm |\n|---|---|---|")
    print(f"| wall for {args.runs} runs (s) | {local:.1f} | {slurm:.1f} |")
    print(f"| submit → first run executing (s) | {statistics.median(firsts['local']):.2f} | "
          f"{statistics.median(firsts['slurm']):.2f} |")
    print(f"\nper-run overhead (slurm − local) / {args.runs}: **{per_run:+.2f} s**; slurm / local wall: "
          f"**{slurm / local:.2f}×** (goal: within {GOAL_S} s per run: {'met' if per_run <= GOAL_S else 'missed'}); "
          f"load average at the end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
