"""50 trivial notebooks on this machine's cores: nbbatch vs. ploomber's parallel executor vs. a papermill loop.

    python benchmarks/ploomber_compare.py [--n 50] [--rounds 3] [--ploomber-python PATH]

All three run the same notebooks (those of ``overhead.py``) in the same kernel: a kernelspec
``nbbatch-bench`` made for the run, starting ipykernel in this interpreter. Alternating each round:

  * papermill: ``papermill.execute_notebook`` in a loop in this process;
  * nbbatch: ``nbbatch.submit`` with the local backend's defaults (one run per core) and ``prestart: 2``;
  * ploomber: a DAG of one ``NotebookRunner`` per notebook (ploomber's defaults: papermill executor,
    static analysis of the parameters cell) built with ``ploomber.executors.Parallel()`` (one process
    per core), timed around ``dag.build(force=True)`` in a separate interpreter: ``--ploomber-python``
    (default: this one) must import ploomber. Installing ploomber beside nbbatch adds Jupyter server
    extensions (jupytext, nbclassic, ploomber's); a separate virtual environment keeps them away.

Prints a markdown table: medians over rounds and ratios to the papermill loop and to ploomber.
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

from machine import bench_kernel, describe, median, usable_cores
from overhead import make_notebooks, nbbatch_batch, papermill_loop

PLOOMBER_BUILD = """
import json, os, sys, time
from pathlib import Path
os.environ.setdefault("PLOOMBER_STATS_ENABLED", "false")
from ploomber import DAG
from ploomber.executors import Parallel
from ploomber.products import File
from ploomber.tasks import NotebookRunner

folder, kernel, out = sys.argv[1], sys.argv[2], sys.argv[3]
paths = sorted(p for p in os.listdir(folder) if p.endswith(".ipynb"))
dag = DAG(executor=Parallel())
for i, name in enumerate(paths):
    NotebookRunner(Path(folder, name), File(os.path.join(out, f"ploomber_{i:03d}.ipynb")), dag=dag,
                   name=f"nb{i:03d}", params={"X": i}, kernelspec_name=kernel)
start = time.perf_counter()
report = dag.build(force=True)
wall = time.perf_counter() - start
ran = sum(1 for row in report.to_dict()["Ran?"] if row)
print(json.dumps({"wall": wall, "ran": ran, "processes": os.cpu_count()}))
"""


def ploomber_build(python: str, folder: Path, kernel: str, out: Path) -> dict:
    out.mkdir(exist_ok=True)
    start = time.perf_counter()
    done = subprocess.run([python, "-c", PLOOMBER_BUILD, str(folder), kernel, str(out)], capture_output=True, text=True,
                          env=dict(os.environ, PLOOMBER_STATS_ENABLED="false", TQDM_DISABLE="1"))
    if done.returncode != 0:
        raise SystemExit(f"ploomber failed ({python}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_wall"] = time.perf_counter() - start
    return result


def ploomber_version(python: str) -> str:
    done = subprocess.run([python, "-c", "import ploomber; print(ploomber.__version__)"], capture_output=True, text=True)
    return done.stdout.strip() or f"not importable from {python}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ploomber-python", default=sys.executable,
                        help="an interpreter that imports ploomber (default: this one)")
    args = parser.parse_args()
    kernel, _ = bench_kernel()
    version = ploomber_version(args.ploomber_python)
    print(describe(f"{args.n} trivial notebooks, {usable_cores()} cores: nbbatch vs ploomber vs papermill loop, "
                   f"{args.rounds} rounds"), end="")
    print(f"- ploomber {version} (in a separate interpreter: {'yes' if args.ploomber_python != sys.executable else 'no'})\n",
          flush=True)
    import papermill  # noqa: F401

    import nbbatch.api  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        nb_folder = root / "notebooks"
        nb_folder.mkdir()
        paths = make_notebooks(nb_folder, args.n, kernel)
        papermill_loop(paths[:2], root, kernel)  # warm the file cache
        nbbatch_batch(paths[:2], root / "share", kernel, "warm")
        walls: dict[str, list[float]] = {"papermill": [], "nbbatch": [], "ploomber": []}
        ploomber_process: list[float] = []
        order = list(walls)
        for rnd in range(args.rounds):
            for runner in order[rnd % 3:] + order[:rnd % 3]:
                if runner == "papermill":
                    walls[runner].append(papermill_loop(paths, root, kernel).wall)
                elif runner == "nbbatch":
                    walls[runner].append(nbbatch_batch(paths, root / "share", kernel, f"par-{rnd}", prestart=2).wall)
                else:
                    result = ploomber_build(args.ploomber_python, nb_folder, kernel, root / "ploomber")
                    assert result["ran"] == args.n, result
                    walls[runner].append(result["wall"])
                    ploomber_process.append(result["process_wall"])
            print(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.1f}s" for k, v in walls.items()), file=sys.stderr, flush=True)

    pm, nbb, plo = (median(walls[k]) for k in ("papermill", "nbbatch", "ploomber"))
    print(f"\nmedians over {args.rounds} rounds (ploomber: `dag.build`; with its interpreter's start-up and imports "
          f"{median(ploomber_process):.2f} s)\n")
    print("| runner | wall for N | per notebook | vs papermill loop | vs ploomber |")
    print("|---|---|---|---|---|")
    print(f"| papermill loop (one process) | {pm:.2f} s | {pm / args.n:.3f} s | 1.00× | {plo / pm:.2f}× |")
    print(f"| ploomber `Parallel()` ({usable_cores()} processes) | {plo:.2f} s | {plo / args.n:.3f} s | "
          f"{pm / plo:.2f}× | 1.00× |")
    print(f"| nbbatch local backend (defaults) | {nbb:.2f} s | {nbb / args.n:.3f} s | {pm / nbb:.2f}× | {plo / nbb:.2f}× |")
    print("\nper round (s): " + "; ".join(f"{k}: " + ", ".join(f"{x:.1f}" for x in v) for k, v in walls.items()))


if __name__ == "__main__":
    main()
