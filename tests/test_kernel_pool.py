"""Kernels started ahead of their runs: each used only by its own run, with that run's settings, and
never left behind (run finished, cancelled, or settings changed)."""

from __future__ import annotations

import os
import threading
import time

import nbformat
import psutil
import pytest
from support.notebooks import make_notebook

import nbbatch
from nbbatch.api import submit

pytestmark = [pytest.mark.timeout(180), pytest.mark.kernel]  # every test starts kernels


def _kernels_of_this_process(experiment: str | None = None) -> list[psutil.Process]:
    """The live kernels this test process started (only those of ``experiment``'s runs, when given: a worker of
    pytest-xdist runs test after test, and an earlier test's kernel may still be on its way out)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "ipykernel_launcher" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE and \
                    (experiment is None or child.environ().get("NBBATCH_EXPERIMENT") == experiment):
                found.append(child)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _wait_no_kernels(timeout: float = 10.0) -> list[psutil.Process]:
    deadline = time.time() + timeout
    while (left := _kernels_of_this_process()) and time.time() < deadline:
        time.sleep(0.1)
    return left


def test_prestarted_kernels_serve_only_their_own_run(project, write_experiment):
    make_notebook(project / "nb.ipynb", [
        "import os, logging\nprint(os.environ['NBBATCH_RUN_ID'], os.getpid(), os.getcwd())\n"
        "get_ipython().kernel.log.warning('kernel-process-output %s', A)",
    ])
    exp = write_experiment("experiment: pool\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3, 4, 5]}}\n"
                           "resources: {max_parallel: 1}\nbackend: {name: local, prestart: 2}\n")
    result = submit(exp, progress=False)
    assert result.ok and len(result.records) == 5
    pids = set()
    for record in result.records:
        folder = project / "results" / "pool" / record.run_id
        nb = nbformat.read(folder / "output.ipynb", as_version=4)
        run_id, pid, cwd = nb.cells[-1].outputs[0].text.split()
        assert run_id == record.run_id and cwd == str(project)
        pids.add(pid)
        log = (folder / "log.txt").read_text()
        # the kernel process's own output (here its logger) reaches the run's log, after the run's header
        assert log.index("=== nbbatch run") < log.index(f"kernel-process-output {record.parameters['A']}")
    assert len(pids) == 5, "a kernel ran more than one notebook"
    assert not _wait_no_kernels(), "kernels were left running"


def test_prestart_zero_starts_no_kernel_ahead(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["import time; time.sleep(1)"])
    exp = write_experiment("experiment: nopool\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3]}}\n"
                           "resources: {max_parallel: 1}\nbackend: {name: local, prestart: 0}\n")
    counts = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            counts.append(len(_kernels_of_this_process("nopool")))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert submit(exp, progress=False).ok
    finally:
        stop.set()
        watcher.join()
    assert max(counts) <= 1


def test_cancel_kills_kernels_started_for_queued_runs(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["import time; time.sleep(60)"])
    exp = write_experiment("experiment: poolcancel\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3, 4]}}\n"
                           "resources: {max_parallel: 1}\nbackend: {name: local, prestart: 2}\n")
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", submit(exp, progress=False)))
    thread.start()
    deadline = time.time() + 60
    while time.time() < deadline and len(_kernels_of_this_process()) < 3:  # the running one + 2 ahead
        time.sleep(0.2)
    assert len(_kernels_of_this_process()) >= 3
    nbbatch.cancel("poolcancel")
    thread.join(60)
    assert sorted(r.status for r in box["result"].records) == ["cancelled"] * 4
    assert not _wait_no_kernels(), "kernels started ahead were left running"


def test_a_kernel_started_with_other_settings_is_not_used(tmp_path):
    from nbbatch.execute.prestart import KernelPool

    pool = KernelPool(1)
    env = dict(os.environ, NBBATCH_RUN_ID="a")
    assert pool.prestart("a", "python3", env, str(tmp_path))
    assert not pool.prestart("b", "python3", env, str(tmp_path)), "the pool holds at most `size` kernels"
    assert pool.take("a", "python3", dict(env, NBBATCH_RUN_ID="other"), str(tmp_path)) is None
    assert len(pool) == 0
    assert not _wait_no_kernels(), "the mismatched kernel was left running"
    assert pool.prestart("c", "python3", env, str(tmp_path))
    pool.close()
    assert not pool.prestart("d", "python3", env, str(tmp_path)), "a closed pool starts nothing"
    assert not _wait_no_kernels()
