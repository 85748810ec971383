"""A 40-cell notebook end to end: papermill's default engine (a save before and after every cell) vs nbbatch.

    python benchmarks/many_cells.py [--cells 40] [--rounds 7] [--kernel python3]

Alternating each round, in this process:

  * papermill: ``papermill.execute_notebook(..., progress_bar=False)``, its default engine: the output
    notebook is rewritten in place (validated, then truncated and written) before and after each cell;
  * nbbatch: ``nbbatch.run_notebook(...)`` (engine ``nbbatch``): the output is written to a temporary file
    and renamed over the target, at most once a second while cells run, and once at the end.

Then, untimed, each runner executes the notebook once more, each cell sleeping a little so that
checkpoints happen, while a reader process reads the output file as fast as it can: a read that is
not a whole notebook (invalid JSON) is a torn read, what a user or a status command would see
mid-write. Prints a markdown table: medians, the ratio, saves per run, and torn reads.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from machine import describe, median

READER = """
import json, os, sys, time
path, stop = sys.argv[1], sys.argv[2]
whole = torn = 0
while not os.path.exists(stop):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        continue
    try:
        json.loads(data)
        whole += 1
    except ValueError:
        torn += 1
print(whole, torn)
"""


def make_notebook(path: Path, cells: int, kernel: str, sleep: float = 0.0) -> Path:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("N = 1000")
    params.metadata["tags"] = ["parameters"]
    pause = f"\nimport time; time.sleep({sleep})" if sleep else ""
    nb.cells = [params] + [nbformat.v4.new_code_cell(f"x{i} = sum(range(N))\nprint('cell {i}:', x{i}){pause}")
                           for i in range(cells - 1)]
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": kernel, "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, path)
    return path


class SaveCounter:
    """Counts the output writes of both runners (papermill's write_ipynb, nbbatch's atomic writer)."""

    def __init__(self) -> None:
        import papermill.engines

        import nbbatch.store.notebook_io

        self.count = 0
        for module, name in ((papermill.engines, "write_ipynb"), (nbbatch.store.notebook_io, "write_notebook_atomic")):
            original = getattr(module, name)

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)

            setattr(module, name, counted)


def run_papermill(src: Path, out: Path, kernel: str) -> None:
    import papermill

    papermill.execute_notebook(str(src), str(out), parameters={"N": 500}, kernel_name=kernel, progress_bar=False)


def run_nbbatch(src: Path, out: Path, kernel: str) -> None:
    import nbbatch

    nbbatch.run_notebook(src, out, parameters={"N": 500}, kernel=kernel, log_output=False)


RUNNERS = {"papermill": run_papermill, "nbbatch": run_nbbatch}


def torn_reads(runner, src: Path, out: Path, kernel: str) -> tuple[int, int]:
    stop = out.with_suffix(".stop")
    reader = subprocess.Popen([sys.executable, "-c", READER, str(out), str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        runner(src, out, kernel)
    finally:
        stop.touch()
    whole, torn = map(int, reader.communicate(timeout=30)[0].split())
    stop.unlink()
    return whole, torn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kernel", default="python3")
    parser.add_argument("--read-check-sleep", type=float, default=0.05,
                        help="seconds each cell sleeps in the (untimed) torn-read check, so that checkpoints happen")
    args = parser.parse_args()
    print(describe(f"A {args.cells}-cell notebook end to end: papermill default engine vs nbbatch, {args.rounds} rounds"),
          flush=True)
    import papermill  # noqa: F401

    import nbbatch.api  # noqa: F401
    import nbbatch.execute.engine  # noqa: F401

    counter = SaveCounter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = make_notebook(root / "many_cells.ipynb", args.cells, args.kernel)
        for name, runner in RUNNERS.items():  # warm-up
            runner(src, root / f"warm_{name}.ipynb", args.kernel)
        times: dict[str, list[float]] = {name: [] for name in RUNNERS}
        saves: dict[str, list[int]] = {name: [] for name in RUNNERS}
        names = list(RUNNERS)
        for rnd in range(args.rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                out = root / f"{name}_{rnd}.ipynb"
                before = counter.count
                start = time.perf_counter()
                RUNNERS[name](src, out, args.kernel)
                times[name].append(time.perf_counter() - start)
                saves[name].append(counter.count - before)
                executed = nbformat.read(out, as_version=4)
                assert all(c.outputs for c in executed.cells if "print(" in c.source), f"{name}: missing outputs"
            print(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), file=sys.stderr, flush=True)
        slow = make_notebook(root / "many_cells_slow.ipynb", args.cells, args.kernel, args.read_check_sleep)
        reads = {name: torn_reads(RUNNERS[name], slow, root / f"read_{name}.ipynb", args.kernel) for name in names}

    pm, nbb = median(times["papermill"]), median(times["nbbatch"])
    print(f"\nmedians over {args.rounds} rounds\n")
    print("| runner | end to end | min – max | output writes per run | how it writes | reads of the output while "
          f"running (cells sleeping {args.read_check_sleep:g} s): whole / torn | speed vs papermill |")
    print("|---|---|---|---|---|---|---|")
    how = {"papermill": "in place (truncate + write), before and after each cell",
           "nbbatch": "temporary file + rename, ≤ 1 per second + final"}
    for name, ratio in (("papermill", 1.0), ("nbbatch", pm / nbb)):
        whole, torn = reads[name]
        print(f"| {name} | {median(times[name]):.3f} s | {min(times[name]):.2f} – {max(times[name]):.2f} s | "
              f"{median([float(s) for s in saves[name]]):.0f} | {how[name]} | {whole} / {torn} | {ratio:.2f}× |")
    print("\nper round (s): " + "; ".join(f"{k}: " + ", ".join(f"{x:.2f}" for x in v) for k, v in times.items()))


if __name__ == "__main__":
    main()
