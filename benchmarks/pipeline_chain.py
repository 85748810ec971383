"""The cost of a pipeline's chain itself: from a stage's last run ending to the next stage's first run starting.

    python benchmarks/pipeline_chain.py [--chains 5] [--backends local,slurm]

Submits ``--chains`` fresh three-stage pipelines (``api.submit_pipeline``, each its own name, so nothing is skipped)
per backend, every stage on that backend, of notebooks whose one cell does next to nothing (``python3`` kernel)::

    prep  (one run)                                  → records v
    train (two runs: grid X [1, 2]; inputs: DATA_DIR = ${prep.outputs}; select: v max)
    final (one run; parameters: X = ${train.best.parameters.X})

Each chain has two links (prep → train, train → final). A link's cost is the next stage's first run's
``started_at`` minus the stage's last run's ``ended_at`` (their run records), split by the stages' times in
``pipeline.json`` into: *noticed* (the last run ending → the driver seeing the stage end: the stage's submission
returning, on Slurm its polling), *driver* (the stage's end → the next stage started: the driver's loop), and
*started* (the next stage started → its first run executing: resolving references, planning and validating the
stage, the backend starting the run: on Slurm sbatch, scheduling and ``nbbatch run-one`` starting on a node); on
Slurm, how much of *started* passed until sbatch had returned (the job's ``submitted_at``).

The slurm backend runs on the tests' two-node Slurm cluster on this machine (tests/support/slurm.py: needs root and
Debian's slurm and munge), started here: ``backend: {name: slurm, cpus: 1, memory: 256M}``. Prints markdown tables
(what docs/benchmarks.md records): every link, then the median and max per backend against the goal (issue 44:
≤ 2 s locally, ≤ 5 s on Slurm).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml
from machine import describe, load_average, scratch_project

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' Slurm cluster

from support.notebooks import make_notebook  # noqa: E402 - after the path above
from support.slurm import SlurmCluster, slurm_available  # noqa: E402

GOALS_S = {"local": 2.0, "slurm": 5.0}  # issue 44
BACKENDS = {"local": {"name": "local"}, "slurm": {"name": "slurm", "cpus": 1, "memory": "256M"}}
STAGES = ("prep", "train", "final")


def pipeline(name: str, share: Path, backend: dict) -> dict:
    notebook = [{"path": "step.ipynb", "kernel": "python3"}]
    return {"pipeline": name, "share": str(share), "backend": backend, "stages": {
        "prep": {"notebooks": notebook},
        "train": {"notebooks": notebook, "inputs": {"DATA_DIR": "${prep.outputs}"}, "sweep": {"grid": {"X": [1, 2]}},
                  "select": {"metric": "v", "mode": "max"}},
        "final": {"notebooks": notebook, "parameters": {"X": "${train.best.parameters.X}"}},
    }}


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def one_chain(name: str, project: Path, share: Path, backend: dict) -> list[dict[str, float]]:
    """The chain's two links: {total, noticed, driver, started} seconds each."""
    from nbbatch import api

    path = project / f"{name}.yaml"
    path.write_text(yaml.safe_dump(pipeline(name, share, backend), sort_keys=False))
    result = api.submit_pipeline(path, progress=False)
    if not result.ok:
        raise SystemExit(f"{name}: {({n: (s.state, s.reason) for n, s in result.stages.items()})}")
    state = json.loads((share / name / "pipeline.json").read_text())["stages"]
    records = {stage: [json.loads(p.read_text()) for p in (share / f"{name}.{stage}").glob("*/run.json")]
               for stage in STAGES}
    links = []
    for before, after in zip(STAGES, STAGES[1:], strict=False):
        last_end = max(_time(r["ended_at"]) for r in records[before])
        first_start = min(_time(r["started_at"]) for r in records[after])
        stage_end, next_start = _time(state[before]["ended_at"]), _time(state[after]["started_at"])
        submitted = _submitted(share, f"{name}.{after}", [r["run_id"] for r in records[after]])
        links.append({"total": (first_start - last_end).total_seconds(),
                      "noticed": (stage_end - last_end).total_seconds(),
                      "driver": (next_start - stage_end).total_seconds(),
                      "started": (first_start - next_start).total_seconds(),
                      "sbatch": (submitted - next_start).total_seconds() if submitted else None})
    return links


def _submitted(share: Path, experiment: str, run_ids: list[str]) -> datetime | None:
    """When sbatch had taken the stage's first job (the slurm backend notes it after sbatch returns), or None."""
    from nbbatch.backends.slurm import SlurmJob
    from nbbatch.store.share import FileShare

    jobs = [job for run_id in run_ids if (job := SlurmJob.read(FileShare(share), experiment, run_id))]
    return min(_time(job.submitted_at) for job in jobs) if jobs else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, default=5, help="pipelines per backend (default 5)")
    parser.add_argument("--backends", default="local,slurm", help="comma-separated: local, slurm (default both)")
    args = parser.parse_args()
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := [b for b in wanted if b not in BACKENDS]:
        parser.error(f"--backends: {unknown[0]} is not one of {', '.join(BACKENDS)}")
    if "slurm" in wanted and (why := slurm_available()):
        print(f"cannot start a Slurm cluster here: {why}", file=sys.stderr)
        return 2
    root, project = scratch_project("nbbatch-chain-bench-")
    make_notebook(project / "step.ipynb", ["import nbbatch\nnbbatch.record(v=X)"], parameters="X = 0\nDATA_DIR = ''")
    print(describe("Pipeline chain overhead"))
    cluster = None
    if "slurm" in wanted:
        cluster = SlurmCluster(root / "slurm")
        began = time.perf_counter()
        cluster.start()
        os.environ.update(cluster.env)
        print(f"- Slurm cluster (2 slurmd on this host) started in {time.perf_counter() - began:.1f} s; "
              f"{cluster.run('sinfo', '-V').stdout.strip()}")
    print(f"\n{args.chains} chains prep → train (2 runs) → final per backend; seconds\n")
    print("| backend | chain | link | last run ended → next first run started | noticed | driver | started "
          "| of which to sbatch's return | load average before |")
    print("|---|---|---|---|---|---|---|---|---|")
    totals: dict[str, list[float]] = {b: [] for b in wanted}
    try:
        for chain in range(1, args.chains + 1):
            order = wanted if chain % 2 else list(reversed(wanted))  # a machine getting busier affects both alike
            for backend in order:
                load = load_average()
                links = one_chain(f"chain-{backend}-{chain}", project, root / "share", BACKENDS[backend])
                for (before, after), link in zip(zip(STAGES, STAGES[1:], strict=False), links, strict=True):
                    totals[backend].append(link["total"])
                    print(f"| {backend} | {chain} | {before} → {after} | {link['total']:.2f} | "
                          f"{link['noticed']:.2f} | {link['driver']:.2f} | {link['started']:.2f} | "
                          f"{'–' if link['sbatch'] is None else format(link['sbatch'], '.2f')} | {load} |",
                          flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
    print("\n| backend | links | median (s) | max (s) | goal (s) |\n|---|---|---|---|---|")
    for backend, values in totals.items():
        goal = GOALS_S[backend]
        print(f"| {backend} | {len(values)} | **{statistics.median(values):.2f}** | {max(values):.2f} | ≤ {goal:g} "
              f"({'met' if max(values) <= goal else 'median met' if statistics.median(values) <= goal else 'missed'}) |")
    print(f"\nload average at the end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
