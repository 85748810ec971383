"""Large sweeps: how long ``nbbatch plan`` and ``nbbatch submit`` take, and how much memory, for 10^4–10^5 runs.

    python benchmarks/large_sweep.py [--runs 10000 100000] [--limit 300] [--skip-submit]

Writes a project with a trivial notebook (a parameters cell and one cell that touches a file) and, for each
size, an experiment whose grid of 10-value parameters makes that many runs (``resources: {max_runs: N}`` so
the cap lets it through). Each command runs in a process of its own, as a user types it:

  * ``nbbatch plan``: wall time, peak RSS, lines printed (to a pipe);
  * ``nbbatch plan --json``: the same;
  * ``nbbatch submit -q`` and ``nbbatch submit`` on a terminal (a pty, so the live table draws): the time
    until the first run's notebook executes (the file it touches appears), the driver's peak RSS by then,
    and the run records written by then; then the submit is interrupted (Ctrl-C).

And sweeps that cannot be meant (a 10^10-run grid, ``random: {samples: 10^9}``): ``nbbatch plan``'s wall
time, peak RSS and the first line it prints. Prints a markdown table (what docs/benchmarks.md records).
"""

from __future__ import annotations

import argparse
import os
import pty
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
from machine import describe

NBBATCH = str(Path(sys.executable).with_name("nbbatch"))
PARAMS = "ABCDEFGHIJ"


def make_project(root: Path) -> Path:
    (root / "frameworks").mkdir(parents=True)
    (root / ".nbbatch").mkdir()
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("\n".join(f"{p} = 0" for p in PARAMS) + "\nMARK = ''")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell("open(MARK, 'a').close()")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "python3", "language": "python"}
    nbformat.write(nb, root / "nb.ipynb")
    return root


def grid_experiment(root: Path, name: str, runs: int, max_runs: int | None) -> Path:
    """An experiment of ``runs`` runs (a power of ten): one 10-value grid parameter per digit."""
    digits = len(str(runs)) - 1
    grid = "\n".join(f"    {p}: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" for p in PARAMS[:digits])
    cap = f"resources: {{max_runs: {max_runs}}}\n" if max_runs else ""
    path = root / f"{name}.yaml"
    path.write_text(f"experiment: {name}\nnotebooks: [nb.ipynb]\nparameters: {{MARK: {str(root / name)}.started}}\n"
                    f"{cap}sweep:\n  grid:\n{grid}\n")
    return path


def random_experiment(root: Path, samples: int) -> Path:
    path = root / "random.yaml"
    path.write_text(f"experiment: random\nnotebooks: [nb.ipynb]\nsweep:\n  random: {{samples: {samples}, "
                    "params: {A: {uniform: [0, 1]}}}\n")
    return path


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_to_end(cmd: list[str], cwd: Path, limit: float, memory_cap_gb: float | None = None) -> dict:
    """Run a command to its end (or ``limit``), stdout to a pipe: wall time, peak RSS, lines, first line.

    ``memory_cap_gb``: its address space is capped, so a sweep expanded in memory fails (MemoryError) instead
    of taking the machine."""
    def cap() -> None:
        if memory_cap_gb:
            size = int(memory_cap_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=cap)
    lines, first, last, peak = 0, "", "", 0.0
    watcher_done = threading.Event()

    def watch_rss() -> None:
        nonlocal peak
        while not watcher_done.is_set():
            peak = max(peak, peak_rss_mb(proc.pid) or 0.0)
            time.sleep(0.05)

    threading.Thread(target=watch_rss, daemon=True).start()
    timer = threading.Timer(limit, proc.kill)
    timer.start()
    assert proc.stdout is not None
    for raw in proc.stdout:
        lines += 1
        text = raw.decode(errors="replace").strip()
        first, last = first or text, text or last
    proc.wait()
    timer.cancel()
    watcher_done.set()
    return {"wall_s": time.perf_counter() - start, "peak_mb": peak, "lines": lines, "first": first[:160], "last": last[:160],
            "rc": proc.returncode}


def submit_until_first_run(cmd: list[str], cwd: Path, mark: Path, experiment: Path, tty: bool, limit: float) -> dict:
    """Start a submit; the time until the first run executes (``mark`` appears), the driver's peak RSS then."""
    start = time.perf_counter()
    if tty:
        master, slave = pty.openpty()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL,
                                env={**os.environ, "COLUMNS": "120", "LINES": "40"})
        os.close(slave)

        def drain() -> None:
            try:
                while os.read(master, 65536):
                    pass
            except OSError:
                pass

        threading.Thread(target=drain, daemon=True).start()
    else:
        log = open(cwd / f"{experiment.stem}.submit.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    peak, first = 0.0, None
    while time.perf_counter() - start < limit and proc.poll() is None:
        peak = max(peak, peak_rss_mb(proc.pid) or 0.0)
        if mark.exists():
            first = time.perf_counter() - start
            break
        time.sleep(0.05)
    records = sum(1 for _ in (cwd / "results" / experiment.stem).glob("*/run.json"))
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if not tty:
        log.close()
        if first is None:
            print((cwd / f"{experiment.stem}.submit.log").read_text()[-3000:], file=sys.stderr)
    return {"first_run_s": first, "peak_mb": peak, "records": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--limit", type=float, default=300.0, help="seconds one command may take")
    parser.add_argument("--skip-submit", action="store_true")
    parser.add_argument("--no-cap", action="store_true", help="write no resources.max_runs (nbbatch before the cap)")
    args = parser.parse_args()
    print(describe("python3"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = make_project(Path(tmp) / "proj")
        for runs in args.runs:
            name = f"sweep{runs}"
            exp = grid_experiment(root, name, runs, None if args.no_cap else runs)
            for cmd in (["plan"], ["plan", "--json"]):
                m = run_to_end([NBBATCH, *cmd, str(exp)], root, args.limit)
                rows.append((f"`nbbatch {' '.join(cmd)}`", runs, f"{m['wall_s']:.1f} s", f"{m['peak_mb']:.0f} MB",
                             f"{m['lines']} lines printed, exit {m['rc']}"))
            if args.skip_submit:
                continue
            for tty in (False, True):
                shutil.rmtree(root / "results", ignore_errors=True)
                mark = root / f"{name}.started"
                mark.unlink(missing_ok=True)
                cmd = [NBBATCH, "submit", str(exp)] + ([] if tty else ["-q"])
                m = submit_until_first_run(cmd, root, mark, exp, tty, args.limit)
                first = f"{m['first_run_s']:.1f} s" if m["first_run_s"] is not None else f"none in {args.limit:.0f} s"
                rows.append((f"`nbbatch submit{'' if tty else ' -q'}` ({'terminal' if tty else 'pipe'})", runs,
                             f"first run executed after {first}", f"{m['peak_mb']:.0f} MB",
                             f"{m['records']} run.json written by then"))
        for label, exp in (("grid of 10^10 runs", grid_experiment(root, "huge", 10**10, None)),
                           ("random samples: 10^9", random_experiment(root, 10**9))):
            m = run_to_end([NBBATCH, "plan", str(exp)], root, args.limit, memory_cap_gb=4)
            rows.append((f"`nbbatch plan`, {label} (4 GiB address space)", "—", f"{m['wall_s']:.1f} s", f"{m['peak_mb']:.0f} MB",
                         f"exit {m['rc']}: {m['last'] if m['lines'] == 1 else m['first'] + ' … ' + m['last']}"))
    print("| command | runs | time | peak RSS | detail |\n|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
