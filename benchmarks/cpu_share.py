"""The demo's submit with each CPU run on its share of the cores, against every kernel on all of them (before).

    python benchmarks/cpu_share.py [--rounds 2] [--frameworks all] [--max-parallel N]

Submits the demo experiment (experiments/digits.yaml: the framework notebooks on digits, locally, on the CPU) in
rounds, the two ways in turn (A B A B …, so a drift of the machine's speed falls on both):

* **shared** — as nbbatch runs it now: the runs at once each pinned to cores of their own, with as many threads
  (``NBBATCH_CPUS``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``);
* **all cores** — as before: no run pinned, each told to use every core (what torch, TensorFlow and JAX do
  unless told otherwise), set through the experiment's ``env:``.

Each submission is a fresh experiment on a scratch share (nothing skipped), with the project's framework envs
(``make envs`` first). Prints a markdown table: each round's wall seconds of the whole submit and the ratio, then
the medians, and the runs' accuracies (the same work both ways).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from machine import describe, load_average, usable_cores

REPO = Path(__file__).resolve().parents[1]
THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def experiment(name: str, share: Path, frameworks: list[str] | str, all_cores: bool, max_parallel: int | None) -> dict:
    spec = yaml.safe_load((REPO / "experiments" / "digits.yaml").read_text())
    spec.update(experiment=name, share=str(share), frameworks=frameworks)
    if max_parallel:
        spec["resources"] = {"max_parallel": max_parallel}
    if all_cores:  # before: unpinned, every kernel sized to the whole machine
        spec["env"] = {"NBBATCH_CPUS": "", **{name: str(usable_cores()) for name in THREADS}}
    return spec


def submit_once(name: str, share: Path, frameworks: list[str] | str, all_cores: bool,
                max_parallel: int | None) -> tuple[float, dict[str, float]]:
    from nbbatch.api import submit

    path = REPO / "experiments" / f".bench-{name}.yaml"
    path.write_text(yaml.safe_dump(experiment(name, share, frameworks, all_cores, max_parallel)))
    try:
        began = time.perf_counter()
        result = submit(path, progress=False)
        wall = time.perf_counter() - began
    finally:
        path.unlink()
    failed = [r.run_id for r in result.records if r.status != "succeeded"]
    if failed:
        raise SystemExit(f"{name}: runs did not succeed: {failed}")
    return wall, {r.framework or r.run_id: float(r.metrics.get("accuracy", float("nan"))) for r in result.records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--frameworks", default="all", help="all, or a comma-separated list")
    parser.add_argument("--max-parallel", type=int, default=None, help="runs at once (default: nbbatch's)")
    args = parser.parse_args()
    frameworks = "all" if args.frameworks == "all" else args.frameworks.split(",")
    for name in (*THREADS, "NBBATCH_CPUS"):
        os.environ.pop(name, None)
    os.chdir(REPO)
    share = Path(tempfile.mkdtemp(prefix="nbbatch-cpu-share-"))
    print(describe("CPU runs on their share of the cores vs. every kernel on all of them (the demo's submit)"))
    rows, shared_s, all_s = [], [], []
    accuracy: dict[str, dict[str, float]] = {"shared": {}, "all cores": {}}
    for index in range(args.rounds):
        for label, all_cores in (("shared", False), ("all cores", True)):
            wall, acc = submit_once(f"cpu-share-{index}-{'all' if all_cores else 'shared'}", share, frameworks,
                                    all_cores, args.max_parallel)
            (all_s if all_cores else shared_s).append(wall)
            accuracy[label] = acc
        rows.append(f"| {index + 1} | {shared_s[-1]:.1f} | {all_s[-1]:.1f} | {all_s[-1] / shared_s[-1]:.2f} |")
    print("| round | shared (s) | all cores (s) | all cores ÷ shared |\n|---|---|---|---|")
    print("\n".join(rows))
    print(f"| median | {statistics.median(shared_s):.1f} | {statistics.median(all_s):.1f} | "
          f"{statistics.median(all_s) / statistics.median(shared_s):.2f} |\n")
    for label, values in accuracy.items():
        print(f"- accuracy ({label}, last round): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(values.items())))
    print(f"- load average at the end: {load_average()}")


if __name__ == "__main__":
    sys.exit(main())
