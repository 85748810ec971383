"""Fixed cost per notebook: nbbatch vs. a plain papermill loop, measured side by side in one run.

    python benchmarks/overhead.py [--n 50] [--kernel python3] [--rounds 3]

Writes N trivial notebooks (a parameters cell and two tiny cells) and times, alternating rounds:
  * papermill: ``papermill.execute_notebook`` in a loop in this process (the baseline);
  * nbbatch sequential: one run at a time (``max_parallel: 1``): the per-notebook fixed cost;
  * nbbatch parallel: the same N runs with the default parallelism (one per core).
Prints medians and ratios as a markdown table (what docs/benchmarks.md records).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nbformat


def make_notebooks(folder: Path, n: int, kernel: str) -> list[Path]:
    paths = []
    for i in range(n):
        nb = nbformat.v4.new_notebook()
        params = nbformat.v4.new_code_cell("X = 0")
        params.metadata["tags"] = ["parameters"]
        nb.cells = [params, nbformat.v4.new_code_cell("y = X * 2"), nbformat.v4.new_code_cell("print(y)")]
        nb.metadata["kernelspec"] = {"name": kernel, "display_name": kernel, "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        path = folder / f"trivial_{i:03d}.ipynb"
        nbformat.write(nb, path)
        paths.append(path)
    return paths


def papermill_loop(paths: list[Path], out: Path, kernel: str) -> list[float]:
    import papermill

    times = []
    for i, path in enumerate(paths):
        start = time.perf_counter()
        papermill.execute_notebook(str(path), str(out / f"pm_{i:03d}.ipynb"), parameters={"X": i}, kernel_name=kernel,
                                   progress_bar=False)
        times.append(time.perf_counter() - start)
    return times


def nbbatch_batch(paths: list[Path], share: Path, kernel: str, max_parallel: int | None, tag: str) -> tuple[float, list[float]]:
    import nbbatch

    spec = {"experiment": f"bench-{tag}", "notebooks": [{"path": str(p), "kernel": kernel} for p in paths],
            "parameters": {"X": 1}, "share": str(share)}
    if max_parallel:
        spec["resources"] = {"max_parallel": max_parallel}
    start = time.perf_counter()
    result = nbbatch.submit(spec, progress=False, force=True)
    wall = time.perf_counter() - start
    assert result.ok, [r.error for r in result.records if r.error]
    return wall, [r.duration_s for r in result.records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--kernel", default="python3")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = make_notebooks(root, args.n, args.kernel)
        results: dict[str, list[float]] = {"papermill": [], "seq": [], "par": []}
        per_nb: dict[str, list[float]] = {"papermill": [], "seq": []}
        import papermill  # noqa: F401 - import cost is paid once in both cases

        for r in range(args.rounds):
            start = time.perf_counter()
            per_nb["papermill"] += papermill_loop(paths, root, args.kernel)
            results["papermill"].append(time.perf_counter() - start)
            wall, _ = nbbatch_batch(paths, root / "share", args.kernel, 1, f"seq{r}")
            results["seq"].append(wall)
            per_nb["seq"].append(wall / args.n)
            wall, _ = nbbatch_batch(paths, root / "share", args.kernel, None, f"par{r}")
            results["par"].append(wall)
            print(f"round {r}: papermill {results['papermill'][-1]:.1f}s, nbbatch sequential {results['seq'][-1]:.1f}s, "
                  f"nbbatch parallel {results['par'][-1]:.1f}s", file=sys.stderr)
    pm, seq, par = (statistics.median(results[k]) for k in ("papermill", "seq", "par"))
    pm_per = statistics.median(per_nb["papermill"])
    pm_max = max(per_nb["papermill"])
    print(f"\nmachine: {platform.node()} · {os.cpu_count()} cores · Python {platform.python_version()} · "
          f"{args.n} trivial notebooks · kernel {args.kernel} · {args.rounds} rounds (medians)\n")
    print("| what | total for N | per notebook | vs papermill loop |")
    print("|---|---|---|---|")
    print(f"| papermill loop (one process) | {pm:.2f} s | {pm_per:.3f} s median, {pm_max:.2f} s max | 1.00× |")
    print(f"| nbbatch, one at a time | {seq:.2f} s | {seq / args.n:.3f} s | {pm / seq:.2f}× |")
    print(f"| nbbatch, parallel ({os.cpu_count()} at a time) | {par:.2f} s | {par / args.n:.3f} s | {pm / par:.2f}× |")


if __name__ == "__main__":
    main()
