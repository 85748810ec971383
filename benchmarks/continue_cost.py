"""What continuing a paused trial costs against restarting it, per backend: seconds from the decision to the next epoch.

    python benchmarks/continue_cost.py [--backends local,slurm] [--paused-at 3] [--epoch-s 1.0] [--checkpoint-mb 50]
                                       [--rounds 3]

A promoting search (``search.resource``) decides that a trial paused at epoch k goes on; its next run starts from the
paused run's checkpoints (``resume_from``) and trains epoch k+1 first. Without that, the trial would start again and
train epochs 1..k+1. This measures both through each backend's own launch, as the search driver launches a trial's
run, with a notebook (``python3`` kernel) whose epochs take ``--epoch-s`` seconds and whose checkpoint is a file of
``--checkpoint-mb`` MB it writes after every epoch and resumes from:

  * paused: a run to epoch k that keeps its checkpoints (as a paused segment does);
  * continue: a run to epoch k+1 with ``resume_from`` the paused run (its checkpoints copied in before it starts);
  * restart: a run to epoch k+1 from nothing.

Each is timed from the backend's ``launch`` call (the decision) to the point of epoch k+1 in the run's
``metrics.jsonl`` (its time stamp). ``continue`` and ``restart`` alternate in order by round. Slurm is the tests'
two-node cluster on this machine (tests/support/slurm.py; root and Debian's slurm and munge). Medians over rounds.
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

from machine import describe, load_average, scratch_project

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' notebook maker and Slurm cluster

from support.notebooks import make_notebook  # noqa: E402 - after the path above
from support.slurm import SlurmCluster, slurm_available  # noqa: E402

TRAIN = """\
import os, time, nbbatch
from pathlib import Path
folder = Path(os.environ["NBBATCH_CHECKPOINT_DIR"])
saved = folder / "model.bin"
start = int((folder / "epoch.txt").read_text()) if (folder / "epoch.txt").exists() else 0
if start:
    weights = saved.read_bytes()  # what a framework would load
for epoch in range(start + 1, EPOCHS + 1):
    time.sleep(EPOCH_S)
    saved.write_bytes(os.urandom(int(CHECKPOINT_MB * 2**20)))
    (folder / "epoch.txt").write_text(str(epoch))
    nbbatch.record(step=epoch, loss=1.0 / epoch)
"""


def plan_of(share: Path, backend: dict, args: argparse.Namespace):
    """The experiment's plan, backend and share, as ``submit`` prepares them."""
    from nbbatch.api import prepare

    spec = {"experiment": "cost", "notebooks": [{"path": "train.ipynb", "kernel": "python3"}],
            "parameters": {"EPOCH_S": args.epoch_s, "CHECKPOINT_MB": float(args.checkpoint_mb)},
            "backend": backend, "share": str(share)}
    return prepare(spec, progress=False)


def launched_to_epoch(backend, share, run, epoch: int) -> float:
    """Seconds from ``backend.launch`` of ``run`` to the time stamp of its point at ``epoch``."""
    from nbbatch.backends.base import SubmitOptions
    from nbbatch.store.jsonl import JsonlTail
    from nbbatch.store.layout import run_paths
    from nbbatch.store.runfiles import read_record_or_none

    called = time.time()
    backend.launch([run], share, SubmitOptions(wait=True))
    record = read_record_or_none(share, run.experiment, run.run_id)
    while record is None or not record.final:  # a detached backend (Slurm) returns once the job is queued
        time.sleep(0.2)
        record = read_record_or_none(share, run.experiment, run.run_id)
    if record is None or record.status != "succeeded":
        raise SystemExit(f"{run.run_id} did not succeed: {record.status if record else 'no record'} "
                         f"{record.error if record else ''}")
    points = JsonlTail(share, run_paths(run.experiment, run.run_id).metrics).read()
    stamp = next(p["time"] for p in points if p["step"] == epoch)
    return datetime.fromisoformat(stamp).timestamp() - called


def measure(name: str, backend: dict, root: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    the_plan, the_backend, share = plan_of(root / f"share-{name}", backend, args)
    template = the_plan.runs[0]
    k = args.paused_at
    seconds: dict[str, list[float]] = {"continue": [], "restart": []}
    for round_ in range(args.rounds):
        params = {"EPOCH_S": args.epoch_s + round_ * 1e-6}  # a run id of its own each round
        paused = the_plan.trial(template, {**params, "EPOCHS": k}, keep_checkpoints=True)
        launched_to_epoch(the_backend, share, paused, k)
        runs = {"continue": the_plan.trial(template, {**params, "EPOCHS": k + 1}, resume_from=paused.run_id),
                "restart": the_plan.trial(template, {**params, "EPOCHS": k + 1})}
        for kind in (("continue", "restart") if round_ % 2 == 0 else ("restart", "continue")):
            seconds[kind].append(launched_to_epoch(the_backend, share, runs[kind], k + 1))
        print(f"{name} round {round_}: continue {seconds['continue'][-1]:.2f} s, restart {seconds['restart'][-1]:.2f} s"
              f" (load {load_average()})", flush=True)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="local,slurm", type=lambda text: text.split(","))
    parser.add_argument("--paused-at", type=int, default=3, help="the epoch the trial paused at (k)")
    parser.add_argument("--epoch-s", type=float, default=1.0)
    parser.add_argument("--checkpoint-mb", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(describe("Continuing a paused trial against restarting it (benchmarks/continue_cost.py)"))
    root, _project = scratch_project("nbbatch-continue-cost-")
    make_notebook(Path("train.ipynb"), [TRAIN], parameters="EPOCHS = 1\nEPOCH_S = 1.0\nCHECKPOINT_MB = 1.0")
    backends = {"local": {"name": "local", "max_parallel": 1}}
    results: dict[str, dict[str, list[float]]] = {}
    cluster = None
    try:
        if "slurm" in args.backends:
            if reason := slurm_available():
                raise SystemExit(f"no Slurm here: {reason}")
            cluster = SlurmCluster(root / "slurm")
            cluster.start()
            os.environ.update(cluster.env)  # SLURM_CONF: the commands of the backend reach this cluster
            backends["slurm"] = {"name": "slurm", "max_parallel": 1, "cpus": 1, "memory": "1G"}
        for name in args.backends:
            results[name] = measure(name, backends[name], root, args)
    finally:
        if cluster is not None:
            cluster.stop()
    print(f"\npaused at epoch {args.paused_at}, epochs of {args.epoch_s} s, a {args.checkpoint_mb:g} MB checkpoint; "
          f"seconds from the decision to epoch {args.paused_at + 1}, medians of {args.rounds} rounds\n")
    print("| backend | continue | restart | saved |\n|---|---|---|---|")
    for name, seconds in results.items():
        cont, restart = statistics.median(seconds["continue"]), statistics.median(seconds["restart"])
        print(f"| {name} | {cont:.2f} s | {restart:.2f} s | {restart - cont:.2f} s |")
    print(json.dumps({name: {k: [round(v, 3) for v in vs] for k, vs in s.items()} for name, s in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
