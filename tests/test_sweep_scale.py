"""Large sweeps: a sweep beyond ``resources.max_runs`` is refused before it is expanded, and a large plan is cheap
to make (memory per run bounded), to triage (no read per run) and to start (the first runs do not wait for every
queued record). Memory is measured with tracemalloc; nothing here asserts on wall-clock time."""

from __future__ import annotations

import io
import threading
import tracemalloc
from pathlib import Path

import pytest
from support.notebooks import make_notebook

from nbbatch.backends.base import QUEUED_FIRST, SubmitOptions
from nbbatch.backends.local.backend import LocalBackend
from nbbatch.errors import SpecError
from nbbatch.plan.runs import Run, plan
from nbbatch.spec.experiment import Experiment
from nbbatch.store.runfiles import new_record, read_record, write_record
from nbbatch.store.runjson import Status
from nbbatch.store.share import FileShare
from nbbatch.ui import cli

TEN_VALUES = list(range(10))


def _experiment(sweep: dict, notebooks: int = 1, **resources: int) -> Experiment:
    return Experiment.from_dict({"experiment": "big", "notebooks": [f"nb{i}.ipynb" for i in range(notebooks)],
                                 "sweep": sweep, "resources": resources}, base_dir=Path.cwd())


def _grid(parameters: int, values: list | None = None) -> dict:
    return {"grid": {name: values or TEN_VALUES for name in "ABCDEFGHIJ"[:parameters]}}


def _refusal(sweep: dict, notebooks: int = 1) -> tuple[SpecError, int]:
    """The error refusing ``sweep``, and the most memory allocated meanwhile (bytes)."""
    _experiment(_grid(1))  # the schema's validator and its imports are made once, outside the measure
    tracemalloc.start()
    try:
        with pytest.raises(SpecError) as refused:
            _experiment(sweep, notebooks)
        return refused.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_sweep_beyond_max_runs_is_refused_with_its_count_before_it_is_expanded() -> None:
    # a size that is safe to expand comes first: were the cap gone, this fails before the huge ones are tried
    error, peak = _refusal({"grid": {"A": list(range(1000)), "B": list(range(200))}})
    assert "200,000 runs" in str(error) and "resources.max_runs (10,000)" in str(error)
    assert "max_runs: 200000" in str(error)  # what to write to mean it
    assert peak < 2_000_000  # 200,000 combinations expanded take ~80 MB
    for sweep, count in ((_grid(10), "10,000,000,000 runs"),
                         ({"random": {"samples": 10**9, "params": {"A": {"uniform": [0, 1]}}}}, "1,000,000,000 runs")):
        error, peak = _refusal(sweep)
        assert count in str(error) and peak < 2_000_000


def test_the_cap_counts_every_framework_and_notebook_and_can_be_raised() -> None:
    error, _peak = _refusal({"random": {"samples": 6000, "params": {"A": [1, 2]}}}, notebooks=2)
    assert "12,000 runs (random 6,000 × 2 frameworks/notebooks)" in str(error)
    raised = _experiment({"random": {"samples": 6000, "params": {"A": [1, 2]}}}, notebooks=2, max_runs=12_000)
    assert len(raised.combinations()) == 6000
    with pytest.raises(SpecError, match="max_runs"):
        _experiment(_grid(1), max_runs=0)


def _plan_peak(folder: Path, runs: int) -> int:
    make_notebook(folder / "nb0.ipynb", ["print(A)"], parameters="A = 0\nB = 0\nC = 0\nD = 0\nMARK = ''")
    experiment = Experiment.from_dict({"experiment": "big", "notebooks": ["nb0.ipynb"], "parameters": {"MARK": "m"},
                                       "sweep": _grid(len(str(runs)) - 1)}, base_dir=folder)
    tracemalloc.start()
    try:
        made = plan(experiment, check_kernels=False)
        assert len(made.runs) == runs
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_plan_of_ten_thousand_runs_costs_little_memory_per_run(project: Path) -> None:
    small, large = _plan_peak(project, 1000), _plan_peak(project, 10_000)
    per_run = (large - small) / 9000
    # a run is its parameters, its id and a slotted Run sharing the rest (~480 B here); it was ~840 B with a copy of
    # the experiment's dicts in each
    assert per_run < 650, f"{per_run:.0f} bytes per planned run"


class CountingShare(FileShare):
    """A folder share that counts the run records read."""

    reads = 0

    def read_bytes(self, path: str) -> bytes:
        if path.endswith("run.json"):
            self.reads += 1
        return super().read_bytes(path)


def _runs(count: int) -> list[Run]:
    return [Run(run_id=f"r{i}", experiment="big", notebook="/x/nb.ipynb", notebook_rel="nb.ipynb", kernel="python3")
            for i in range(count)]


def test_triage_reads_only_the_records_that_exist(tmp_path: Path) -> None:
    share = CountingShare(tmp_path / "share")
    runs = _runs(1000)
    done = new_record(runs[7])
    done.status = Status.SUCCEEDED
    write_record(share, done)
    write_record(share, new_record(runs[9]))  # queued by a driver that is gone: started again
    outcome = LocalBackend(gpus=[]).triage(runs, share)
    assert share.reads == 2  # not one per planned run
    assert outcome.skipped == [] and len(outcome.started) == 1000  # r7 succeeded but has no output.ipynb: rerun
    assert outcome.notes and "r7" in outcome.notes[0]


class HeldShare(FileShare):
    """A folder share on which the background writer of queued records is held (past run r39) until the first run
    executes: were the first runs to wait for every queued record, they would wait for ever (here: 20 s, then fail)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.first_run = threading.Event()
        self.held_too_long = False

    def write_bytes(self, path: str, data: bytes) -> None:
        run = path.split("/")[1] if path.count("/") == 2 else ""
        background = threading.current_thread().name.startswith("queued")
        if background and run.startswith("r") and int(run[1:]) >= 40 and not self.held_too_long:
            self.held_too_long = not self.first_run.wait(20)
        super().write_bytes(path, data)


def test_the_first_runs_start_before_every_queued_record_is_written_and_none_is_overwritten(tmp_path: Path) -> None:
    share, runs = HeldShare(tmp_path / "share"), _runs(200)
    queued_at_first_run: list[int] = []

    def execute(run: Run, share_: FileShare, *args: object, **kwargs: object) -> object:
        if not queued_at_first_run:
            queued_at_first_run.append(sum(1 for _ in (tmp_path / "share" / "big").glob("*/run.json")))
            share.first_run.set()
        record = new_record(run)
        record.status = Status.SUCCEEDED
        write_record(share_, record)
        return record

    backend = LocalBackend(gpus=[], prestart=0, max_parallel=4)
    backend._execute = execute  # type: ignore[method-assign]
    backend.launch(runs, share, SubmitOptions())
    assert not share.held_too_long
    assert QUEUED_FIRST <= queued_at_first_run[0] < 200
    statuses = {read_record(share, "big", r.run_id).status for r in runs}
    assert statuses == {Status.SUCCEEDED}  # no late queued record replaced a run's own


def test_plan_lists_the_first_runs_and_says_how_many_more(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_notebook(project / "nb.ipynb", ["print(A)"], parameters="A = 0\nB = 0")
    (project / "exp.yaml").write_text("experiment: wide\nnotebooks: [nb.ipynb]\nsweep:\n  grid:\n"
                                      f"    A: {list(range(20))}\n    B: {list(range(10))}\n")
    assert cli.main(["plan", "exp.yaml"]) == 0
    shown = capsys.readouterr().out
    assert "200 run(s)" in shown and "… and 150 more run(s)" in shown and "--all" in shown
    assert len(shown.splitlines()) < 70
    assert cli.main(["plan", "--all", "exp.yaml"]) == 0
    assert len(capsys.readouterr().out.splitlines()) >= 200


def test_the_live_table_of_a_large_sweep_shows_a_screenful_running_runs_first() -> None:
    from rich.console import Console

    from nbbatch.results.progress import _screenful

    records = [new_record(run, "local") for run in _runs(5000)]
    for index in (10, 4000):
        records[index].status = Status.RUNNING
    records[4500].status = Status.FAILED
    console = Console(width=120, height=30, record=True, file=io.StringIO())
    console.print(*_screenful(records, "big", console))
    text = console.export_text()
    assert "big: 1 failed, 4997 queued, 2 running" in " ".join(text.split())  # the title counts every run
    shown = [line.split()[0] for line in text.splitlines() if line.split() and line.split()[0][1:].isdigit()]
    assert len(shown) == 22  # the terminal's height less the title, header and notes
    assert {"r10", "r4000", "r4500"} <= set(shown)  # the runs that moved or went wrong, whatever their place
    assert "… and 4978 more run(s) not shown (4978 queued)" in text
