"""Memory of the local backend's driver while it works through 100 queued runs.

    python benchmarks/memory.py [--runs 100] [--sleep 0.5] [--max-parallel 2]

Submits one experiment of ``--runs`` runs (a notebook that sleeps ``--sleep`` seconds, one run per
value of a swept parameter) with ``max_parallel`` runs at a time, and samples this process (the
driver: nbbatch itself, papermill, nbclient, the worker threads) with psutil every 50 ms. Kernels
are separate processes and are not counted. Prints a markdown table: resident memory (RSS) before
the submit (imports done), its peak, and after; threads and open files at their peak; and the same
for the first and the second half of the runs (what grows with the number of runs done).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import psutil
from machine import describe

MB = 1024 * 1024


class Sampler(threading.Thread):
    def __init__(self, interval: float = 0.05):
        super().__init__(daemon=True)
        self.process = psutil.Process()
        self.interval = interval
        self.samples: list[tuple[float, int, int, int]] = []  # (time, rss, threads, open fds)
        self._done = threading.Event()

    def sample(self) -> tuple[float, int, int, int]:
        return (time.monotonic(), self.process.memory_info().rss, self.process.num_threads(), self.process.num_fds())

    def run(self) -> None:
        while not self._done.is_set():
            self.samples.append(self.sample())
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--sleep", type=float, default=0.5)
    parser.add_argument("--max-parallel", type=int, default=2)
    parser.add_argument("--kernel", default="python3")
    args = parser.parse_args()
    print(describe(f"Driver memory with {args.runs} queued runs, {args.max_parallel} at a time", extra=("psutil",)),
          flush=True)
    import nbbatch
    import nbbatch.api  # noqa: F401 - what a driver imports, before the baseline
    import nbbatch.execute.engine  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        nb = nbformat.v4.new_notebook()
        params = nbformat.v4.new_code_cell("I = 0\nSLEEP = 0.5")
        params.metadata["tags"] = ["parameters"]
        nb.cells = [params, nbformat.v4.new_code_cell("import time\ntime.sleep(SLEEP)\nprint(I)")]
        nb.metadata["kernelspec"] = {"name": args.kernel, "display_name": args.kernel, "language": "python"}
        nbformat.write(nb, root / "sleeper.ipynb")
        spec = {"experiment": "memory", "notebooks": [{"path": str(root / "sleeper.ipynb")}],
                "parameters": {"SLEEP": args.sleep}, "sweep": {"grid": {"I": list(range(args.runs))}},
                "resources": {"max_parallel": args.max_parallel}, "share": str(root / "share")}
        sampler = Sampler()
        before = sampler.sample()
        sampler.start()
        start = time.monotonic()
        result = nbbatch.submit(spec, progress=False)
        wall = time.monotonic() - start
        sampler.stop()
        after = sampler.sample()
        gc.collect()  # event loops and zmq contexts of finished runs close when collected
        collected = sampler.sample()
        failed = [r for r in result.records if r.status != "succeeded"]
        for record in failed[:3]:
            log = root / "share" / "memory" / record.run_id / "log.txt"
            print(f"run {record.run_id} {record.status}: {record.error}\n{log.read_text()[-2000:] if log.exists() else ''}")
        if failed or len(result.records) != args.runs:
            raise SystemExit(f"{len(failed)} of {len(result.records)} runs did not succeed")

    samples = sampler.samples
    half = start + wall / 2
    first = [s for s in samples if s[0] <= half]
    second = [s for s in samples if s[0] > half]
    peak = max(s[1] for s in samples)
    print(f"\n{args.runs} runs of a notebook sleeping {args.sleep:g} s, {args.max_parallel} at a time: {wall:.1f} s; "
          f"{len(samples)} samples of the driver process (kernels not included)\n")
    print("| driver process | RSS | threads | open files |")
    print("|---|---|---|---|")
    print(f"| before submit (imports done) | {before[1] / MB:.0f} MB | {before[2]} | {before[3]} |")
    print(f"| peak, first half of the runs | {max(s[1] for s in first) / MB:.0f} MB | {max(s[2] for s in first)} | "
          f"{max(s[3] for s in first)} |")
    print(f"| peak, second half of the runs | {max(s[1] for s in second) / MB:.0f} MB | {max(s[2] for s in second)} | "
          f"{max(s[3] for s in second)} |")
    print(f"| after submit | {after[1] / MB:.0f} MB | {after[2]} | {after[3]} |")
    print(f"| after submit and gc.collect() | {collected[1] / MB:.0f} MB | {collected[2]} | {collected[3]} |")
    print(f"\npeak RSS {peak / MB:.0f} MB (target ≤ 300 MB)")


if __name__ == "__main__":
    main()
