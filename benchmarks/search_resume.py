"""Resuming a search of many finished trials (issue 45): how long ``submit`` takes before it could ask a new trial.

    PYTHONPATH=src python benchmarks/search_resume.py [--trials 3000]

Writes a project with a trivial notebook and a random search whose study (its journal, beside the experiment file)
holds N finished trials, each with its run's record on the share, as a driver leaves them (no kernel runs); its
budget is spent, so ``nbbatch submit`` only resumes: opens the study, reads the records, writes the manifest. Prints
the wall time of that submit (in a process of its own, as a user types it) and how many times it wrote
experiment.json. Run it against two checkouts' ``src`` to compare.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from machine import describe

COUNT_WRITES = """
import sys, nbbatch.store.share as s
from nbbatch.ui.cli import main
real, writes = s.FileShare.write_bytes, []
def counting(self, path, data):
    writes.append(path) if path.endswith("experiment.json") else None
    return real(self, path, data)
s.FileShare.write_bytes = counting
code = main(["submit", "-q", sys.argv[1]])
print(len(writes))
sys.exit(0)
"""


def build(root: Path, trials: int) -> Path:
    """The project, its experiment file and the study of ``trials`` finished trials with their records."""
    import optuna

    from nbbatch.api import prepare
    from nbbatch.search.study import journal_path, open_study, search_fingerprint
    from nbbatch.store.runfiles import new_record, write_record
    from nbbatch.store.runjson import Status

    (root / "frameworks").mkdir(parents=True)
    (root / ".nbbatch").mkdir()
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("LR = 0.1")
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell, nbformat.v4.new_code_cell("import nbbatch\nnbbatch.record(step=1, loss=LR)")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, root / "nb.ipynb")
    exp = root / "resume.yaml"
    exp.write_text(json.dumps({"experiment": "resume", "notebooks": ["nb.ipynb"], "search": {
        "metric": "loss", "mode": "min", "trials": trials, "sampler": "random", "seed": 1, "pruner": "none",
        "params": {"LR": {"loguniform": [1e-4, 1.0]}}}}))
    the_plan, _, share = prepare(exp, progress=False)
    template, search = the_plan.runs[0], the_plan.experiment.search
    label = template.run_id.rsplit("-", 1)[0]
    study = open_study(search, journal_path(root, "resume", label), f"resume/{label}",
                       search_fingerprint(search, template.run_id))
    distribution = {"LR": optuna.distributions.FloatDistribution(1e-4, 1.0, log=True)}
    frozen = []
    for number in range(trials):
        lr = 1e-4 + number * (1.0 - 1e-4) / trials
        run = the_plan.trial(template, {"LR": lr})
        frozen.append(optuna.trial.create_trial(params={"LR": lr}, distributions=distribution, value=lr,
                                                intermediate_values={1: lr}, user_attrs={"run_id": run.run_id}))
        record = new_record(run)
        record.status, record.attempts, record.metrics = Status.SUCCEEDED, 1, {"loss": lr}
        record.trial = {"study": f"resume/{label}", "number": number, "state": "complete", "value": lr}
        write_record(share, record)
    study.add_trials(frozen)
    return exp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "proj"
        exp = build(root, args.trials)
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", COUNT_WRITES, str(exp)], cwd=root, capture_output=True,
                              text=True)
        took = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"submit failed: {done.stderr.strip()[-2000:]}")
    print(describe("search resume"))
    print(f"| resume of {args.trials} finished trials | {took:.1f} s | {done.stdout.split()[-1]} write(s) of "
          "experiment.json |")


if __name__ == "__main__":
    main()
