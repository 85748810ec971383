"""Faults with real processes: a killed driver, dying kernels, timeouts, two drivers, a full share,
corrupt run records. Nothing is mocked at the process level; see docs/reliability.md for the table of
what each scenario does and which test proves it."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.notebooks import make_notebook
from support.processes import gone
from support.tmpfs import mounted_tmpfs

from nbbatch.api import submit
from nbbatch.errors import LockedError
from nbbatch.results.status import status_rows, status_table
from nbbatch.store.lock import ExperimentLock
from nbbatch.store.runfiles import load_records
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import FileShare
from nbbatch.ui import cli

pytestmark = pytest.mark.timeout(180)


def nbbatch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nbbatch", *args], cwd=cwd, capture_output=True, text=True, timeout=150)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def records_on_disk(folder: Path) -> dict[str, dict]:
    """run id → run.json (parsed), for every run folder of an experiment."""
    return {p.parent.name: json.loads(p.read_text()) for p in folder.glob("*/run.json")}


def assert_share_intact(root: Path) -> None:
    """Every file a reader sees is whole: notebooks parse with nbformat, run records parse, no temp files."""
    notebooks = list(root.rglob("output.ipynb"))
    for path in notebooks:
        nbformat.validate(nbformat.read(path, as_version=4))
    for path in root.rglob("run.json"):
        RunRecord.from_json(path.read_bytes(), source=str(path))
    for path in root.rglob("*.json"):
        json.loads(path.read_bytes())
    assert not list(root.rglob("*.part")), "temporary files left in the share"
    assert notebooks


# --- the driver is killed -------------------------------------------------------------------------

BLOCKING_CELLS = [
    "import os, pathlib, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "pathlib.Path(f'pids-{A}-{os.getpid()}').write_text(f'{os.getpid()} {child.pid}')",
    "while A > 2 and not pathlib.Path('release').exists():\n    time.sleep(0.1)\nprint('done', A)",
]


def _pids(project: Path, a: int) -> list[int]:
    return [int(p) for f in project.glob(f"pids-{a}-*") for p in f.read_text().split()]


@pytest.mark.kernel
def test_sigkilled_submit_loses_nothing_and_leaks_no_process(project, write_experiment):
    """kill -9 of `nbbatch submit` mid-batch: kernels and their children die, every file stays whole, and
    resubmitting skips the runs that succeeded and reruns the interrupted ones. Meanwhile a second submit
    of the same experiment is refused, naming the holder; after the kill, the stale lock is taken over."""
    make_notebook(project / "nb.ipynb", BLOCKING_CELLS, parameters="A = 1")
    write_experiment("experiment: killed\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3, 4]}}\n"
                     "resources: {max_parallel: 2}\n")
    folder = project / "results" / "killed"
    driver = subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", "exp.yaml", "-q"], cwd=project,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def midway():
            recs = records_on_disk(folder).values()
            done = [r for r in recs if r["status"] == "succeeded"]
            return len(done) == 2 and _pids(project, 3) and _pids(project, 4)

        wait_for(midway, 120, "two runs succeeded and two running")
        before = records_on_disk(folder)
        succeeded = {k for k, r in before.items() if r["status"] == "succeeded"}
        assert {before[k]["parameters"]["A"] for k in succeeded} == {1, 2}

        second = nbbatch("submit", "exp.yaml", "-q", cwd=project)
        assert second.returncode == 2, second.stderr
        assert f"already being run by process {driver.pid}" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)

    processes = [pid for a in (1, 2, 3, 4) for pid in _pids(project, a)]
    assert len(processes) == 8  # a kernel and a child process per run
    wait_for(lambda: all(gone(p) for p in processes), 15, "the orphaned kernels and their children to die")

    assert_share_intact(folder)
    left = records_on_disk(folder)
    assert sorted(r["status"] for r in left.values()) == ["running", "running", "succeeded", "succeeded"]

    interrupted = sorted(k for k, r in left.items() if r["status"] == "running")
    (folder / interrupted[0] / ".output.ipynb.x1y2z3.part").write_bytes(b'{"cells": [')  # as a kill mid-write leaves
    (project / "release").write_text("go")
    again = nbbatch("submit", "exp.yaml", "-q", cwd=project)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "skipped 2 run(s)" in again.stdout
    assert f"left locked by process {driver.pid}" in again.stdout.replace("\n", " ")
    after = records_on_disk(folder)
    assert all(r["status"] == "succeeded" for r in after.values()) and len(after) == 4
    for run_id in succeeded:  # untouched: not rerun
        assert after[run_id] == before[run_id]
    for run_id in set(after) - succeeded:
        assert after[run_id]["attempts"] == 1 and after[run_id]["started_at"] != before[run_id]["started_at"]
        nb = nbformat.read(folder / run_id / "output.ipynb", as_version=4)
        assert "done" in nb.cells[-1].outputs[0].text
    assert_share_intact(folder)
    processes = [pid for a in (1, 2, 3, 4) for pid in _pids(project, a)]
    wait_for(lambda: all(gone(p) for p in processes), 15, "the rerun's kernels and children to end")


def test_stale_lock_of_a_killed_process_is_detected_and_taken_over(tmp_path):
    path = tmp_path / ".lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom nbbatch.store.lock import ExperimentLock\n"
         f"with ExperimentLock(Path({str(path)!r}), 'exp'):\n    print('held', flush=True)\n    time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockedError, match=rf"already being run by process {holder.pid} on .*command: "):
            ExperimentLock(path, "exp").__enter__()
    finally:
        holder.kill()
        holder.wait(10)
    with ExperimentLock(path, "exp") as lock:
        assert lock.recovered_from and lock.recovered_from["pid"] == holder.pid
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert path.read_text() == ""  # released cleanly: the next holder finds nothing stale
    with ExperimentLock(path, "exp") as lock:
        assert lock.recovered_from is None


# --- kernels die ----------------------------------------------------------------------------------

@pytest.mark.kernel
def test_kernel_deaths_fail_their_run_only_with_reason_partial_notebook_and_retries(project, write_experiment):
    make_notebook(project / "exit_once.ipynb", [
        "import os, pathlib\nflag = pathlib.Path('died-once')\nif not flag.exists():\n"
        "    flag.write_text('x')\n    os._exit(1)\nprint('second attempt')"])
    make_notebook(project / "segv.ipynb", ["print('before the crash')", "import ctypes\nctypes.string_at(0)"])
    make_notebook(project / "memory.ipynb", [
        "print('before the limit')",
        "import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_AS)\n"
        "size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (size + 64 * 2**20, hard))\n"
        "try:\n    block = bytearray(2 * 2**30)\nfinally:\n    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))",
    ])
    make_notebook(project / "fine.ipynb", ["print('fine')"])
    exp = write_experiment("experiment: deaths\nnotebooks: [exit_once.ipynb, segv.ipynb, memory.ipynb, fine.ipynb]\n"
                           "retries: 1\nresources: {max_parallel: 2}\n")
    result = submit(exp, progress=False)
    by_name = {r.notebook: r for r in result.records}
    assert by_name["exit_once.ipynb"].status == "succeeded" and by_name["exit_once.ipynb"].attempts == 2
    assert by_name["fine.ipynb"].status == "succeeded" and by_name["fine.ipynb"].attempts == 1

    segv = by_name["segv.ipynb"]
    assert segv.status == "failed" and segv.error.reason == "kernel died" and segv.attempts == 2
    assert segv.error.ename == "DeadKernelError"
    nb = nbformat.read(project / "results/deaths" / segv.run_id / "output.ipynb", as_version=4)
    before = next(c for c in nb.cells if c.source == "print('before the crash')")
    assert before.outputs[0].text == "before the crash\n"  # partial notebook: the cells before the death
    log = (project / "results/deaths" / segv.run_id / "log.txt").read_text()
    assert "attempt 2" in log and "kernel died" in log

    memory = by_name["memory.ipynb"]  # a tight address-space limit: the allocation fails, the kernel lives
    assert memory.status == "failed" and memory.attempts == 1
    assert memory.error.ename == "MemoryError" and "RLIMIT_AS" in memory.error.cell_source
    assert_share_intact(project / "results" / "deaths")


def _memory_cgroup(limit: int) -> Path | None:
    """A memory cgroup (v1 or v2) with ``limit`` bytes and no swap, or None when this machine has none for us."""
    name = f"nbbatch-test-oom-{os.getpid()}-{time.monotonic_ns()}"
    for root, limit_file in ((Path("/sys/fs/cgroup"), "memory.max"), (Path("/sys/fs/cgroup/memory"),
                                                                        "memory.limit_in_bytes")):
        if not (root / limit_file).parent.is_dir() or (limit_file == "memory.max" and "memory" not in (
                (root / "cgroup.controllers").read_text() if (root / "cgroup.controllers").exists() else "")):
            continue
        try:
            (root / name).mkdir()
            (root / name / limit_file).write_text(str(limit))
            if (root / name / "memory.swap.max").exists():
                (root / name / "memory.swap.max").write_text("0")
            return root / name
        except OSError:
            if (root / name).exists():
                (root / name).rmdir()
    return None


@pytest.mark.kernel
def test_oom_killed_kernel_is_a_failed_run(project, write_experiment):
    """A real OOM kill: the kernel moves itself into a memory cgroup of 96 MiB and allocates 400 MiB."""
    group = _memory_cgroup(96 * 2**20)
    if group is None:
        pytest.skip("no writable memory cgroup here (needs root and a cgroup memory controller)")
    try:
        make_notebook(project / "oom.ipynb", [
            "import os\nopen(CGROUP + '/cgroup.procs', 'w').write(str(os.getpid()))\nprint('in the cgroup')",
            "block = bytearray(400 * 2**20)\nprint('survived')",
        ], parameters="CGROUP = ''")
        make_notebook(project / "fine.ipynb", ["print('fine')"], parameters="CGROUP = ''")
        exp = write_experiment(f"experiment: oom\nnotebooks: [oom.ipynb, fine.ipynb]\nparameters: {{CGROUP: '{group}'}}\n"
                               "resources: {max_parallel: 2}\n")
        result = submit(exp, progress=False)
        by_name = {r.notebook: r for r in result.records}
        oom = by_name["oom.ipynb"]
        assert oom.status == "failed" and oom.error.reason == "kernel died", oom.error
        nb = nbformat.read(project / "results/oom" / oom.run_id / "output.ipynb", as_version=4)
        moved = next(c for c in nb.cells if "cgroup.procs" in c.source)
        assert moved.outputs[0].text == "in the cgroup\n"
        assert by_name["fine.ipynb"].status == "succeeded"
        events = (group / "memory.events") if (group / "memory.events").exists() else (group / "memory.oom_control")
        assert "oom_kill 1" in events.read_text()
    finally:
        wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), 10, "the cgroup to empty")
        group.rmdir()


# --- the share fills up ---------------------------------------------------------------------------

@pytest.fixture
def small_share(project):
    """A tmpfs of 3 MiB as the share (root only: mount -t tmpfs); skipped where mounting is not allowed."""
    with mounted_tmpfs(project / "share", "3m") as mountpoint:
        yield mountpoint


@pytest.mark.kernel
def test_share_out_of_space_for_a_notebook_fails_that_run_and_keeps_its_last_whole_version(
        project, write_experiment, small_share):
    """The log (2 MiB) fits in the 3 MiB share but the notebook holding the same output does not."""
    make_notebook(project / "big.ipynb", ["print('small')", "print('x' * 2_000_000)"])
    make_notebook(project / "fine.ipynb", ["print('fine')"])
    exp = write_experiment("experiment: full\nnotebooks: [big.ipynb, fine.ipynb]\nshare: share\n"
                           "resources: {max_parallel: 1}\n")
    result = submit(exp, progress=False)
    by_name = {r.notebook: r for r in result.records}
    big = by_name["big.ipynb"]
    assert big.status == "failed" and big.error.reason == "the share could not be written"
    assert "out of space while writing `full/" in big.error.evalue and "output.ipynb" in big.error.evalue
    assert by_name["fine.ipynb"].status == "succeeded"
    output = small_share / "full" / big.run_id / "output.ipynb"
    if output.exists():  # an earlier checkpoint, if one was due before the big output arrived, stays whole
        kept = nbformat.read(output, as_version=4)
        assert not any("x" * 1000 in str(c.get("outputs")) for c in kept.cells)
    assert (small_share / "full" / big.run_id / "log.txt").stat().st_size > 2_000_000  # the log has it all
    assert_share_intact(small_share / "full")
    done = nbbatch("status", "full", "--check", "--json", cwd=project)
    assert done.returncode == 1 and not done.stderr
    assert any("out of space" in row["error"] for row in json.loads(done.stdout))


@pytest.mark.kernel
def test_share_full_even_for_run_records_is_one_clear_error_and_resubmit_recovers(
        project, write_experiment, small_share):
    """A 4 MiB log fills the whole share: not even run.json can be written. `submit` stops with one
    message (exit 2); once there is room, resubmitting reruns the run."""
    make_notebook(project / "flood.ipynb", ["print('start')",
                                            "import sys\nfor _ in range(40):\n    sys.stdout.write('y' * 99_999 + '\\n')"])
    make_notebook(project / "later.ipynb", ["print('later')"])
    write_experiment("experiment: flood\nnotebooks: [flood.ipynb, later.ipynb]\nshare: share\n"
                     "resources: {max_parallel: 1}\n")
    done = nbbatch("submit", "exp.yaml", "-q", cwd=project)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("nbbatch: error: the share at ") and "is out of space while writing" in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    records = {r["notebook"]: r for r in records_on_disk(small_share / "flood").values()}
    assert records["flood.ipynb"]["status"] != "succeeded"
    assert records["later.ipynb"]["status"] in ("queued", "cancelled")  # not started once the share was full
    assert not list(small_share.rglob("*.part"))
    subprocess.run(["mount", "-o", "remount,size=32m", str(small_share)], check=True)
    assert submit(project / "exp.yaml", progress=False).ok
    assert all(r["status"] == "succeeded" for r in records_on_disk(small_share / "flood").values())
    assert_share_intact(small_share / "flood")


# --- corrupt and hand-edited run records ------------------------------------------------------------

@pytest.mark.kernel
def test_corrupt_and_hand_edited_run_json_are_reported_with_their_path(project, write_experiment, capsys):
    make_notebook(project / "nb.ipynb", ["print(A)"])
    exp = write_experiment("experiment: edited\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3]}}\n")
    assert submit(exp, progress=False).ok
    paths = sorted((project / "results" / "edited").glob("*/run.json"))
    truncated, typed, fine = paths
    truncated.write_bytes(truncated.read_bytes()[:100])
    data = json.loads(typed.read_text())
    data["duration_s"], data["error"] = "slow", "it broke"
    typed.write_text(json.dumps(data))

    assert cli.main(["status", "edited", "--json"]) == 0
    out, err = capsys.readouterr()
    assert f"nbbatch: warning: {truncated} is not valid JSON" in err
    assert f"nbbatch: warning: {typed} has `duration_s` = 'slow', which must be a number or null" in err
    rows = json.loads(out)  # the damaged records are rows too, saying so (issue 45)
    assert [row["run_id"] for row in rows] == [fine.parent.name, truncated.parent.name, typed.parent.name]
    assert [row["status"] for row in rows] == ["succeeded", "unreadable", "unreadable"]
    assert cli.main(["status", "edited", "--check"]) == 1
    capsys.readouterr()

    assert cli.main(["submit", "exp.yaml", "-q"]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("nbbatch: error: ") and (str(truncated) in err or str(typed) in err)
    done = nbbatch("status", "edited", cwd=project)  # the real process: no traceback either
    assert done.returncode == 0 and "Traceback" not in done.stderr and str(truncated) in done.stderr


# texts that mean something to rich or a browser, often: run data must be shown as it is (issue 13)
MARKUP = st.sampled_from(["[bold]", "[/]", "[/x]", "[link=x]", "[bold red]", "[", "]", "\\[/]", "[/x] missing",
                          "<script>alert(1)</script>", '"><img src=x onerror=alert(1)>', ":smile:", "%s", "{0}"])
TEXT = (MARKUP | st.text(max_size=5) | st.text(alphabet="[]/\\=<>\"' abx", max_size=8)
        | st.lists(MARKUP | st.text(max_size=3), min_size=2, max_size=4).map("".join))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=5)
VALID = RunRecord(run_id="nb-0123456789", experiment="e", notebook="nb.ipynb", kernel="python3", status="failed",
                  attempts=1, duration_s=1.5, metrics={"accuracy": 0.9}).to_dict()
VALID["error"] = {"ename": "KeyError", "evalue": "x", "cell_index": 2, "cell_source": "d['x']", "reason": None}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(edits=st.dictionaries(st.sampled_from([*VALID, "error"]), JSON, min_size=1, max_size=3),
       error_edits=st.dictionaries(st.sampled_from(list(VALID["error"])), JSON, max_size=2))
def test_any_hand_edited_run_json_is_a_record_or_a_reported_problem(tmp_path_factory, edits, error_edits):
    root = tmp_path_factory.mktemp("share")
    data = {**VALID, "error": {**VALID["error"], **error_edits}, **edits}
    (root / "e" / "nb-0123456789").mkdir(parents=True)
    path = root / "e" / "nb-0123456789" / "run.json"
    path.write_text(json.dumps(data))
    records, problems = load_records(FileShare(root), "e")
    if problems and problems[0].damaged:
        assert not records and len(problems) == 1 and str(path) in problems[0]
    else:  # whatever passed is shown without a crash, and its texts as they are, as its folder's run (issue 45)
        assert [r.run_id for r in records] == ["nb-0123456789"] and all(str(path) in p for p in problems)
        status_rows(records)
        from rich.console import Console

        with open(os.devnull, "w") as sink:
            Console(file=sink).print(status_table(records))
        console = Console(width=10_000, record=True, file=io.StringIO())
        console.print(status_table(records, title="[/]"))
        shown = console.export_text()
        error = records[0].error.summary()[:120] if records[0].error else ""
        assert "[/]" in shown and (not (error.isascii() and error.isprintable()) or error.strip() in shown)

