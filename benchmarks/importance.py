"""Which parameters matter (issue 48, item 4): how long a report's parameter importance takes for a big search.

    PYTHONPATH=src python benchmarks/importance.py [--trials 3000] [--fanova]

Writes a search's run records (as a driver leaves them: parameters, trial, loss; no kernel runs) for N trials of four
parameters, collects them as ``nbbatch compare`` does, and times :func:`parameter_importance` (PED-ANOVA, what the
report and ``compare --json`` show) and its bar chart, against the whole ``write_report`` of the same runs. With
``--fanova``, also Optuna's fANOVA (seed 0) on the same study, the evaluator nbbatch did not choose.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

from machine import describe

from nbbatch.results import compare
from nbbatch.results.compare.importance import parameter_importance
from nbbatch.results.compare.search_plots import plot_importance
from nbbatch.store.runfiles import write_record
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import open_share

SPACE = {"LR": {"loguniform": [1e-4, 1e-1]}, "MOMENTUM": {"uniform": [0.0, 0.99]}, "BATCH": {"choice": [32, 64, 128]},
         "LAYERS": {"randint": [1, 4]}}


def build(root: Path, trials: int) -> None:
    """A search of ``trials`` finished trials whose loss is mostly LR, a little MOMENTUM; one in seven pruned."""
    rng, share, ids = random.Random(0), open_share(root), []
    for number in range(trials):
        params = {"LR": 10 ** rng.uniform(-4, -1), "MOMENTUM": rng.uniform(0, 0.99), "BATCH": rng.choice([32, 64, 128]),
                  "LAYERS": rng.randint(1, 4)}
        loss = abs(math.log10(params["LR"]) + 2) + 0.1 * params["MOMENTUM"] + rng.uniform(0, 0.05)
        pruned = number % 7 == 3
        record = RunRecord(run_id=f"train-{number:06x}", experiment="big", notebook="train.ipynb", kernel="python3",
                           parameters=params, status="pruned" if pruned else "succeeded", metrics={"loss": loss},
                           trial={"study": "big", "number": number, "state": "pruned" if pruned else "complete"})
        write_record(share, record)
        ids.append(record.run_id)
    (root / "big" / "experiment.json").write_text(json.dumps(
        {"runs": ids, "search": {"metric": "loss", "mode": "min", "params": SPACE}}))


def timed(work):  # noqa: ANN001, ANN202 - a benchmark's helper
    start = time.perf_counter()
    result = work()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3000)
    parser.add_argument("--fanova", action="store_true", help="also time fANOVA (minutes at 3,000 trials)")
    args = parser.parse_args()
    print(describe("which parameters matter", ("optuna", "pandas", "matplotlib", "scikit-learn")))
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "share"
        build(root, args.trials)
        frame, collected = timed(lambda: compare.collect(root, "big"))
        importance, computed = timed(lambda: parameter_importance(frame))  # the first: imports optuna.importance
        _, warm = timed(lambda: parameter_importance(frame))
        _, drawn = timed(lambda: plot_importance(importance))
        _, reported = timed(lambda: compare.write_report(frame, Path(folder) / "r.html"))
        print(f"{args.trials} trials ({importance['trials']} finished): collect {collected:.2f} s, importance "
              f"{computed:.2f} s the first time in a process, {warm:.2f} s after; its chart {drawn:.2f} s; the whole "
              f"report {reported:.2f} s")
        print(json.dumps(importance))
        if args.fanova:
            import optuna
            from optuna.importance import FanovaImportanceEvaluator, get_param_importances

            from nbbatch.results.compare import importance as module

            finished = module._finished(frame[frame["trial"].notna()], ["metric.loss"])
            names = [f"param.{n}" for n in SPACE]
            study = optuna.create_study()
            distributions = {n: module._distribution(optuna, finished[n], SPACE[n.removeprefix("param.")])
                             for n in names}
            study.add_trials([optuna.trial.create_trial(
                params={n: module._value(row[n], distributions[n]) for n in names}, distributions=distributions,
                value=float(row["metric.loss"])) for _, row in finished.iterrows()])
            fanova, took = timed(lambda: get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=0)))
            print(f"fANOVA: {took:.1f} s", {k.removeprefix("param."): round(v, 4) for k, v in fanova.items()})


if __name__ == "__main__":
    main()
