"""Fixed cost per notebook: nbbatch vs. a plain papermill loop, measured side by side in one run.

    python benchmarks/overhead.py [--n 50] [--rounds 3] [--kernel python3]

Writes N trivial notebooks (a parameters cell and two tiny cells) and times, in alternating order
each round (so that a machine getting busier or quieter affects every runner alike):

  * papermill: ``papermill.execute_notebook`` in a loop in this process (the baseline);
  * nbbatch 1 at a time, no prestart: ``max_parallel: 1``, ``prestart: 0`` (each kernel started when its run starts);
  * nbbatch 1 at a time: ``max_parallel: 1`` with ``prestart: 2`` (two kernels started ahead);
  * nbbatch parallel: the default parallelism (one run per core) and ``prestart: 2``;
  * nbbatch CLI: ``nbbatch submit exp.yaml -q --force`` in a new process, with the defaults (one run
    per core, two kernels started ahead): the interpreter's start-up and nbbatch's imports included.

Per notebook, papermill's figures are per call; nbbatch's are the gaps between consecutive run
completions (the first from the submit), i.e. what each notebook adds to the batch. CPU is the
driver's (this process) and the kernels' (reaped children) per notebook. Prints markdown tables
(what docs/benchmarks.md records): medians over rounds, and the ratios to the papermill loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from machine import describe, median, usable_cores

OUTLIER_S = 2.5  # a notebook this slow is an outlier (papermill's graceful shutdown waits up to 3 s)


def make_notebooks(folder: Path, n: int, kernel: str, prefix: str = "trivial") -> list[Path]:
    paths = []
    for i in range(n):
        nb = nbformat.v4.new_notebook()
        params = nbformat.v4.new_code_cell("X = 0")
        params.metadata["tags"] = ["parameters"]
        nb.cells = [params, nbformat.v4.new_code_cell("y = X * 2"), nbformat.v4.new_code_cell("print(y)")]
        nb.metadata["kernelspec"] = {"name": kernel, "display_name": kernel, "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        path = folder / f"{prefix}_{i:03d}.ipynb"
        nbformat.write(nb, path)
        paths.append(path)
    return paths


class Measured:
    """Wall time, per-notebook times and CPU (this process, and the kernels it reaped) of one batch."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.per_notebook: list[float] = []
        self.cpu_driver = 0.0
        self.cpu_kernels = 0.0

    def __enter__(self) -> Measured:
        self._t = time.perf_counter()
        self._times = os.times()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t
        now = os.times()
        self.cpu_driver = (now.user + now.system) - (self._times.user + self._times.system)
        self.cpu_kernels = (now.children_user + now.children_system) - (self._times.children_user
                                                                         + self._times.children_system)


def papermill_loop(paths: list[Path], out: Path, kernel: str) -> Measured:
    import papermill

    with Measured() as m:
        for i, path in enumerate(paths):
            start = time.perf_counter()
            papermill.execute_notebook(str(path), str(out / f"pm_{i:03d}.ipynb"), parameters={"X": i},
                                       kernel_name=kernel, progress_bar=False)
            m.per_notebook.append(time.perf_counter() - start)
    return m


def nbbatch_batch(paths: list[Path], share: Path, kernel: str, tag: str, max_parallel: int | None = None,
                  prestart: int | None = None, backend: str = "local") -> Measured:
    import nbbatch

    spec: dict = {"experiment": f"bench-{tag}", "notebooks": [{"path": str(p), "kernel": kernel} for p in paths],
                  "parameters": {"X": 1}, "share": str(share)}
    if max_parallel:
        spec["resources"] = {"max_parallel": max_parallel}
    if prestart is not None:
        spec["backend"] = {"name": backend, "prestart": prestart}
    started = datetime.now(timezone.utc)
    with Measured() as m:
        result = nbbatch.submit(spec, progress=False, force=True)
    assert result.ok, [r.error for r in result.records if r.error]
    ends = sorted(datetime.fromisoformat(r.ended_at) for r in result.records)
    m.per_notebook = [(b - a).total_seconds() for a, b in zip([started, *ends], ends, strict=False)]
    return m


def nbbatch_cli(paths: list[Path], root: Path, kernel: str, tag: str) -> Measured:
    """``nbbatch submit`` as a user types it: a new Python process, nbbatch's defaults."""
    from nbbatch.store.runfiles import load_records
    from nbbatch.store.share import open_share

    experiment = root / f"cli-{tag}.yaml"
    experiment.write_text(json.dumps({"experiment": f"bench-cli-{tag}", "parameters": {"X": 1},
                                      "notebooks": [{"path": str(p), "kernel": kernel} for p in paths],
                                      "share": str(root / "share")}))  # JSON is YAML
    (root / ".nbbatch").mkdir(exist_ok=True)  # the project the CLI records the experiment in
    env = {**os.environ, "NBBATCH_PROJECT": str(root)}
    started = datetime.now(timezone.utc)
    with Measured() as m:
        done = subprocess.run([sys.executable, "-m", "nbbatch", "submit", str(experiment), "-q", "--force"], cwd=root,
                              env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    records, _ = load_records(open_share(str(root / "share")), f"bench-cli-{tag}")
    ends = sorted(datetime.fromisoformat(r.ended_at) for r in records if r.ended_at)
    m.per_notebook = [(b - a).total_seconds() for a, b in zip([started, *ends], ends, strict=False)]
    return m


RUNNERS = {
    "papermill": "papermill loop (one process)",
    "seq0": "nbbatch, 1 at a time, no prestart",
    "seq": "nbbatch, 1 at a time",
    "par": "nbbatch, parallel",
    "cli": "`nbbatch submit` (new process, defaults)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50, help="notebooks per batch (default 50)")
    parser.add_argument("--kernel", default="python3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(RUNNERS), help=f"runners to time, of {','.join(RUNNERS)}")
    args = parser.parse_args()
    chosen = [r for r in args.only.split(",") if r in RUNNERS]
    print(describe(f"Fixed overhead per trivial notebook: {args.n} notebooks, kernel {args.kernel}, "
                   f"{args.rounds} rounds"), flush=True)
    import papermill  # noqa: F401 - import costs are paid once, before timing

    import nbbatch.api  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = make_notebooks(root, args.n, args.kernel)
        papermill_loop(paths[:2], root, args.kernel)  # warm the file cache for every runner
        nbbatch_batch(paths[:2], root / "share", args.kernel, "warm")
        results: dict[str, list[Measured]] = {r: [] for r in chosen}
        for rnd in range(args.rounds):
            order = chosen[rnd % len(chosen):] + chosen[:rnd % len(chosen)]
            line = []
            for runner in order:
                if runner == "papermill":
                    m = papermill_loop(paths, root, args.kernel)
                elif runner == "seq0":
                    m = nbbatch_batch(paths, root / "share", args.kernel, f"seq0-{rnd}", max_parallel=1, prestart=0)
                elif runner == "seq":
                    m = nbbatch_batch(paths, root / "share", args.kernel, f"seq-{rnd}", max_parallel=1, prestart=2)
                elif runner == "cli":
                    m = nbbatch_cli(paths, root, args.kernel, str(rnd))
                else:
                    m = nbbatch_batch(paths, root / "share", args.kernel, f"par-{rnd}", prestart=2)
                results[runner].append(m)
                line.append(f"{runner} {m.wall:.1f}s")
            print(f"round {rnd}: " + ", ".join(line), file=sys.stderr, flush=True)

    base = median([m.wall for m in results["papermill"]]) if "papermill" in results else None
    print(f"\n{args.n} notebooks; medians over {args.rounds} rounds; parallel = {usable_cores()} at a time "
          f"(one per usable core); per notebook: papermill per call, nbbatch gap between completions\n")
    print("| runner | total for N | wall / N | median per notebook | max per notebook | "
          f"notebooks > {OUTLIER_S:g} s | CPU per notebook: driver + kernels | speed vs papermill loop |")
    print("|---|---|---|---|---|---|---|---|")
    for runner, ms in results.items():
        wall = median([m.wall for m in ms])
        every = [t for m in ms for t in m.per_notebook]
        cpu_d = median([m.cpu_driver for m in ms]) / args.n
        cpu_k = median([m.cpu_kernels for m in ms]) / args.n
        ratio = f"{base / wall:.2f}×" if base else "–"
        print(f"| {RUNNERS[runner]} | {wall:.2f} s | {wall / args.n:.3f} s | {median(every):.3f} s | {max(every):.2f} s | "
              f"{sum(t > OUTLIER_S for t in every)} of {len(every)} | {cpu_d:.3f} + {cpu_k:.3f} s | {ratio} |")
    print("\nper round (s): " + "; ".join(f"{r}: " + ", ".join(f"{m.wall:.1f}" for m in ms) for r, ms in results.items()))


if __name__ == "__main__":
    main()
