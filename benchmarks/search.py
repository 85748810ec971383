"""What pruning saves: the same LR search of the PyTorch notebook on digits with and without a pruner.

    python benchmarks/search.py [--trials 24] [--epochs 9] [--pruner hyperband[,asha,median,asha+promote,...]]
                                [--rounds 2] [--parallel 2] [--gpus 0] [--max-samples 1797 (0: all)] [--data-dir DIR]
                                [--kernel-here] [--momentum] [--metric loss]

Needs the pytorch framework venv (``nbbatch envs create pytorch``) and Optuna (``nbbatch[search]``); with
``--kernel-here`` (a GPU machine without nbbatch's venvs) the notebook runs in a kernel of this Python instead, which
then needs torch and ipykernel. Each round runs the same search of ``--trials`` trials over LR (loguniform 1e-4..1,
TPE with the round's seed; metric: the training loss each epoch records) with ``pruner: none`` and with each pruner
named, in an order that alternates by round, each a ``nbbatch submit`` in a new process. Hyperband's max_resource is
``--epochs``, its min_resource 1 and its reduction factor 3 (ASHA: min_resource 1, factor 3). Printed as a markdown
table per round and the medians:
- epochs run: the steps the runs' metric histories reached, summed over the trials;
- wall time of the search;
- the best test accuracy of a trial that ran to its end;
- how many trials were pruned, and the epochs they ran after the pruner's decision (while their stop took effect);
- run-seconds: the runs' durations summed (the time they held a run slot, on the GPU with ``--gpus``);
- train-seconds: the epochs' own seconds (the notebook's ``train_seconds``), summed over the trials: run-seconds less
  the kernels' starts, data loading and evaluation.

``hyperband+promote`` and ``asha+promote`` are the same schedules with trials that pause at each rung and continue
from their checkpoints (``search.resource: EPOCHS``); a trial's epochs are then counted once, over its segments.
``--momentum`` searches MOMENTUM (uniform 0.5..0.99) beside LR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import bench_kernel, describe, median

ROOT = Path(__file__).resolve().parents[1]


def experiment_name(pruner: str, round_: int) -> str:
    """The search's experiment name: a folder on the share, so ``asha+promote`` is written ``asha-promote``."""
    return f"search-{pruner.replace('+', '-')}-{round_}"


def experiment(folder: Path, name: str, args: argparse.Namespace, pruner: str, seed: int) -> Path:
    schedule, promote = pruner.removesuffix("+promote"), pruner.endswith("+promote")
    settings = {"hyperband": {"hyperband": {"min_resource": 1, "max_resource": args.epochs, "reduction_factor": 3}},
                "asha": {"asha": {"min_resource": 1, "reduction_factor": 3,
                                  **({"max_resource": args.epochs} if promote else {})}},
                "median": {"median": {"startup_trials": 5, "warmup_steps": 1}}, "none": "none"}[schedule]
    params = {"LR": {"loguniform": [1.0e-4, 1.0]}, **({"MOMENTUM": {"uniform": [0.5, 0.99]}} if args.momentum else {})}
    target = ({"notebooks": [{"path": str(ROOT / "notebooks" / "PyTorch_CIFAR.ipynb"), "kernel": args.kernel,
                              "label": "pytorch"}]} if args.kernel else {"frameworks": ["pytorch"]})
    spec = {"experiment": name, **target,
            "parameters": {**({} if promote else {"EPOCHS": args.epochs}), "MAX_SAMPLES": args.max_samples,
                           **({"DATASET": "cifar10", "DATA_DIR": args.data_dir} if args.data_dir else {"DATASET": "digits"}),
                           **({"GPU": True} if args.gpus else {})},
            "search": {"metric": args.metric, "mode": "max" if args.metric == "accuracy" else "min",
                       "trials": args.trials, "sampler": "tpe", "seed": seed, "pruner": settings, "params": params,
                       **({"resource": "EPOCHS"} if promote else {})},
            "resources": {"max_parallel": args.parallel, "gpus": args.gpus,
                          **({"runs_per_gpu": args.parallel} if args.gpus else {})},
            "share": str(folder / "share")}
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(spec))
    return path


def search(path: Path, name: str, share: Path, full: int) -> dict[str, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "nbbatch", "submit", str(path), "--force"], capture_output=True,
                          text=True, env={**os.environ, "NBBATCH_PROJECT": str(ROOT)})
    wall = time.perf_counter() - started
    records = [json.loads(p.read_text()) for p in (share / name).glob("*/run.json")]
    if done.returncode != 0:
        errors = "\n".join(f"{r['run_id']}: {r.get('error')}" for r in records if r.get("error"))
        raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}\n{errors}")
    epochs = overrun = 0
    for record in records:
        history = share / name / record["run_id"] / "metrics.jsonl"
        steps = {json.loads(line)["step"] for line in history.read_text().splitlines() if line.strip()}
        epochs += len(steps)  # a continued run records only the epochs after the one it resumed from
        if record["status"] == "pruned":  # the epochs a run went on for while its stop took effect
            overrun += max(steps, default=0) - record["trial"]["step"]
    # a trial that ran to its end: a run of all the epochs (the last segment of a promoted trial)
    finished = [r["metrics"].get("accuracy") for r in records
                if r["status"] == "succeeded" and r["parameters"].get("EPOCHS", full) == full]
    trials = {r["trial"]["number"] for r in records}
    trained: dict[int, float] = {}  # a trial's training seconds: its last segment's train_seconds counts them all
    for r in records:
        seconds = r["metrics"].get("train_seconds") or 0.0
        trained[r["trial"]["number"]] = max(trained.get(r["trial"]["number"], 0.0), seconds)
    return {"wall_s": wall, "epochs": epochs, "best_accuracy": max((a for a in finished if a is not None), default=float("nan")),
            "pruned": sum(r["trial"]["state"] == "pruned" for r in records), "overrun": overrun, "trials": len(trials),
            "runs": len(records), "run_s": sum(r.get("duration_s") or 0.0 for r in records),
            "train_s": sum(trained.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=9)
    parser.add_argument("--pruner", default="hyperband", type=lambda text: text.split(","),
                        help="hyperband, asha or median; several, comma-separated, each against the same unpruned runs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--first-seed", type=int, default=0, help="round r's sampler seed is this + r")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=0)
    parser.add_argument("--max-samples", type=int, default=1797, help="digits has 1797 images; 0: all of them")
    parser.add_argument("--data-dir", help="digits written as CIFAR-10 batches here (a machine without scikit-learn)")
    parser.add_argument("--kernel-here", action="store_true", help="run the notebook in a kernel of this Python")
    parser.add_argument("--momentum", action="store_true", help="search MOMENTUM beside LR")
    parser.add_argument("--metric", default="loss", choices=["loss", "accuracy"])
    args = parser.parse_args()
    args.kernel = bench_kernel()[0] if args.kernel_here else None
    print(describe("Search with and without pruning (benchmarks/search.py)"))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in ["none", *args.pruner]}
    with tempfile.TemporaryDirectory(prefix="nbbatch-search-bench-") as tmp:
        folder = Path(tmp)
        for round_ in range(args.rounds):
            order = list(results) if round_ % 2 == 0 else list(results)[::-1]
            for pruner in order:
                name = experiment_name(pruner, round_)
                result = search(experiment(folder, name, args, pruner, seed=args.first_seed + round_), name,
                                folder / "share", args.epochs)
                results[pruner].append(result)
                print(f"round {round_} {pruner}: {json.dumps({k: round(v, 4) for k, v in result.items()})}",
                      flush=True)
    searched = "LR × MOMENTUM" if args.momentum else "LR"
    print(f"\n{args.trials} trials of {searched}, {args.epochs} epochs each at most, {args.parallel} at once, "
          f"MAX_SAMPLES {args.max_samples}, gpus {args.gpus} (runs_per_gpu {args.parallel if args.gpus else '-'}); "
          f"medians of {args.rounds} rounds\n")
    print("| pruner | epochs run | run-seconds | train-seconds | wall time | best accuracy (finished trials) | runs | "
          "pruned | epochs after the decision |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pruner, rows in results.items():
        print(f"| {pruner} | {median([r['epochs'] for r in rows]):.0f} | {median([r['run_s'] for r in rows]):.1f} s | "
              f"{median([r['train_s'] for r in rows]):.1f} s | {median([r['wall_s'] for r in rows]):.1f} s | "
              f"{median([r['best_accuracy'] for r in rows]):.4f} | "
              f"{median([r['runs'] for r in rows]):.0f} | {median([r['pruned'] for r in rows]):.0f} | "
              f"{median([r['overrun'] for r in rows]):.0f} |")
    base = results["none"]
    for name in args.pruner:  # side by side, round by round (each round's seed is the same for every pruner)
        for round_, (row, full) in enumerate(zip(results[name], base, strict=True)):
            lost = row["best_accuracy"] - full["best_accuracy"]
            print(f"round {round_} {name}: epochs saved {1 - row['epochs'] / full['epochs']:.0%}, run-seconds saved "
                  f"{1 - row['run_s'] / full['run_s']:.0%}, train-seconds saved {1 - row['train_s'] / full['train_s']:.0%}, "
                  f"best accuracy − none {lost:+.4f}")


if __name__ == "__main__":
    main()
