"""A batch's first wave, cold or warm: from "kernel wanted" to the notebook's imports cell done, N kernels at once.

    python benchmarks/warm_start.py NOTEBOOK [--kernel nbbatch-pytorch] [--preload torch] [--n 1 4] [--lead 0 1]
                                    [--rounds 3] [--modes cold pool fork]

The kernel, preload list and working directory come from the notebook (its kernelspec, its folder) unless given.
Each round, for each N, lead and mode (in turns, so that a machine getting busier affects each alike), the batch
"starts" at t0 and its N runs want their kernels at t0 + lead (what the driver does in between: plan, records):

  * cold: each run starts its own kernel when it wants it (nbbatch before the warm first wave);
  * pool: the N kernels are started at t0 and import the preload list (KernelPool's kernels started ahead);
  * fork: a fork server is started at t0, imports the preload list once, and the N kernels started at t0 are forked
    from it (what nbbatch does now for a first wave whose framework has ``preload``).

The time of a run is from t0 + lead until the notebook's first code cell that imports a preload module (else its
first code cell) has run in its kernel; the wave's time is its slowest run. Prints a markdown table of medians.
Run from the project root with nbbatch importable (``PYTHONPATH=src``) and ``JUPYTER_PATH`` naming the kernels.

``--batch`` measures the same through nbbatch itself instead: ``nbbatch submit`` of N runs of the notebook at once
(``max_parallel: N``), with ``prestart: 0`` (every kernel started cold) and with the default (the first wave forked),
in the current project (its results folder gets the experiments ``warm-start-cold-N`` and ``warm-start-warm-N``); a
run's time is from its start (run.json ``started_at``) until its imports cell ended (the output notebook's
``papermill.end_time``). The notebook's framework must be recognised (its kernel, its ``preload``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager

from nbbatch.execute.forkserver import ForkServer, split_command
from nbbatch.execute.kernels import KERNEL_ARGUMENTS, BatchKernelManager, reap_kernel
from nbbatch.execute.prestart import PrestartedKernel


def imports_cell(path: Path, preload: list[str]) -> str:
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code" and c.source.strip()]
    return next((c for c in cells if any(f"import {m}" in c for m in preload)), cells[0] if cells else "pass")


async def _run_cell(km: BatchKernelManager, code: str) -> None:
    client = km.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=120)
        asked = client.execute(code)
        while (reply := await client.get_shell_msg(timeout=300))["parent_header"].get("msg_id") != asked:
            pass
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"the cell failed: {reply['content'].get('ename')}: {reply['content'].get('evalue')}")
    finally:
        client.stop_channels()


def one_run(mode: str, kernel: str, cwd: str, code: str, want_at: float, prestarted: PrestartedKernel | None,
            server: ForkServer | None, times: list[float]) -> None:
    time.sleep(max(0.0, want_at - time.monotonic()))
    km = prestarted.claim(None, wait=300) if prestarted is not None else None
    if km is None:
        km = BatchKernelManager(kernel_name=kernel)
        km.fork_server = server
        asyncio.run(km.start_kernel(cwd=cwd, extra_arguments=list(KERNEL_ARGUMENTS)))
    try:
        asyncio.run(_run_cell(km, code))
        times.append(time.monotonic() - want_at)
    finally:
        reap_kernel(km)
        if prestarted is not None:
            prestarted.release_output()


def wave(mode: str, n: int, lead: float, kernel: str, cwd: str, preload: list[str], code: str) -> float:
    t0 = time.monotonic()
    server = ForkServer(_kernel_python(kernel), preload, dict(os.environ)) if mode == "fork" else None
    prestarted = [PrestartedKernel(kernel, dict(os.environ), cwd, preload, fork_server=server)
                  if mode in ("pool", "fork") else None for _ in range(n)]
    times: list[float] = []
    threads = [threading.Thread(target=one_run, args=(mode, kernel, cwd, code, t0 + lead, p, server, times))
               for p in prestarted]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if server is not None:
        server.close()
    if len(times) != n:
        raise SystemExit(f"{mode}: {n - len(times)} of {n} runs failed")
    return max(times)


def _kernel_python(kernel: str) -> list[str]:
    split = split_command(KernelSpecManager().get_kernel_spec(kernel).argv)
    if split is None:
        raise SystemExit(f"kernel {kernel} is not `python [options] -m ipykernel_launcher`: it cannot be forked")
    return split[0]


def batch_wave(notebook: Path, n: int, prestart: int, name: str, preload: list[str]) -> float:
    """Submit N runs of ``notebook`` at once; the slowest run's time from its start to its imports cell's end."""

    experiment = Path.cwd() / f".{name}.yaml"  # in the project: its frameworks, its results folder
    try:
        experiment.write_text(f"experiment: {name}\nnotebooks: [{json.dumps(str(notebook.resolve()))}]\n"
                              f"sweep: {{grid: {{warm_start_run: {list(range(n))}}}}}\nresources: {{max_parallel: {n}}}\n"
                              f"backend: {{name: local, prestart: {prestart}}}\n")
        done = subprocess.run([sys.executable, "-m", "nbbatch", "submit", str(experiment), "-q", "--force"],
                              capture_output=True, text=True)
    finally:
        experiment.unlink(missing_ok=True)
    if done.returncode != 0:
        raise SystemExit(f"nbbatch submit failed:\n{done.stdout}{done.stderr}")
    results = Path("".join(done.stdout.rsplit("results in ", 1)[-1].split()))  # the console may wrap the path
    records = list(results.glob("*/run.json"))
    if len(records) != n:
        raise SystemExit(f"{len(records)} run records in {results}, not {n}")
    slowest = 0.0
    for record_path in records:
        started = datetime.fromisoformat(json.loads(record_path.read_text())["started_at"])
        cells = nbformat.read(record_path.with_name("output.ipynb"), as_version=4).cells
        cell = next((c for c in cells if c.cell_type == "code" and any(f"import {m}" in c.source for m in preload)),
                    next(c for c in cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", [])))
        ended = datetime.fromisoformat(cell.metadata["papermill"]["end_time"])
        slowest = max(slowest, (ended - started).total_seconds())
    return slowest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--kernel", default=None, help="kernel name (default: the notebook's kernelspec)")
    parser.add_argument("--preload", nargs="*", default=["torch"])
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--lead", type=float, nargs="+", default=[0.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["cold", "pool", "fork"], choices=["cold", "pool", "fork"])
    parser.add_argument("--batch", action="store_true", help="through `nbbatch submit`: prestart 0 vs the default")
    args = parser.parse_args()
    if args.batch:
        rows: dict[int, dict[str, list[float]]] = {}
        for round_ in range(args.rounds):
            for n in args.n:
                for mode, prestart in (("cold", 0), ("warm", 2)):
                    seconds = batch_wave(args.notebook, n, prestart, f"warm-start-{mode}-{n}", args.preload)
                    rows.setdefault(n, {}).setdefault(mode, []).append(seconds)
                    print(f"round {round_ + 1}: n={n} {mode}: {seconds:.2f} s", file=sys.stderr)
        print(f"\nnbbatch submit, run start → imports cell done (slowest run), median of {args.rounds}\n")
        print("| runs at once | prestart 0 (cold) | default (warm first wave) |\n|---|---|---|")
        for n, modes in rows.items():
            print(f"| {n} | {statistics.median(modes['cold']):.2f} s | {statistics.median(modes['warm']):.2f} s |")
        return
    nb = nbformat.read(args.notebook, as_version=4)
    kernel = args.kernel or nb.metadata.get("kernelspec", {}).get("name", "python3")
    code = imports_cell(args.notebook, args.preload)
    cwd = str(args.notebook.resolve().parent)
    results: dict[tuple[int, float, str], list[float]] = {}
    for round_ in range(args.rounds):
        for n in args.n:
            for lead in args.lead:
                for mode in args.modes:
                    seconds = wave(mode, n, lead, kernel, cwd, args.preload, code)
                    results.setdefault((n, lead, mode), []).append(seconds)
                    print(f"round {round_ + 1}: n={n} lead={lead:g} s {mode}: {seconds:.2f} s", file=sys.stderr)
    print(f"\nkernel `{kernel}`, preload {args.preload}, cell: {code.splitlines()[0]!r}…, median of {args.rounds}\n")
    print("| runs at once | lead (s) | " + " | ".join(args.modes) + " |")
    print("|---|---|" + "---|" * len(args.modes))
    for n in args.n:
        for lead in args.lead:
            cells = [f"{statistics.median(results[(n, lead, m)]):.2f} s" for m in args.modes]
            print(f"| {n} | {lead:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
