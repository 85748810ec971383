"""A run stopped by its search's pruner ends ``pruned``: a final status of its own (not cancelled), kept at its last
step with its partial notebook, and never run again by a resubmit. The pruner asks through the run's cancel marker,
which then says why (:class:`nbbatch.store.runfiles.StopRequest`); every executor reads it."""

from __future__ import annotations

import json
import threading

import nbformat
import pytest
from support.notebooks import make_notebook
from support.waiting import wait_until

from nbbatch.api import submit
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import (
    CANCEL_REQUEST,
    StopRequest,
    read_record,
    requested_outcome,
    stop_request,
    write_cancel_markers,
    write_record,
)
from nbbatch.store.runjson import ErrorKind, RunRecord, Status
from nbbatch.store.share import FileShare

pytestmark = pytest.mark.timeout(180)
PRUNE = StopRequest(Status.PRUNED, "pruned by search lr at step 3: loss 2.5 is worse than the median 1.1")
STEPS = """\
import time, nbbatch
for step in range(1, 400):
    nbbatch.record(step=step, loss=10.0 / step)
    time.sleep(0.1)
"""


def _running(share: FileShare, experiment: str, run_id: str) -> None:
    record = RunRecord(run_id=run_id, experiment=experiment, notebook="nb.ipynb", kernel="python3",
                       status=Status.RUNNING)
    write_record(share, record)


def test_the_marker_says_why_and_an_older_marker_is_a_cancel(tmp_path):
    share = FileShare(tmp_path)
    assert stop_request(share, "e", "r1") is None
    _running(share, "e", "r1")
    assert write_cancel_markers(share, "e", ["r1"], PRUNE) == ["r1"]
    assert stop_request(share, "e", "r1") == PRUNE
    status, error = requested_outcome(share, "e", "r1", "cancelled before it started")
    assert status == Status.PRUNED and error.kind == ErrorKind.PRUNED and error.reason == PRUNE.reason
    share.write_bytes(run_paths("e", "r1").cancel, b"2026-11-27T16:00:00.000+00:00")  # as earlier versions wrote
    assert stop_request(share, "e", "r1") == CANCEL_REQUEST
    status, error = requested_outcome(share, "e", "r1", "cancelled before it started")
    assert status == Status.CANCELLED and error.reason == "cancelled before it started"
    _running(share, "e", "r2")
    write_cancel_markers(share, "e")  # the whole experiment
    assert stop_request(share, "e", "r2") == CANCEL_REQUEST
    assert json.loads(share.read_bytes(run_paths("e", "r2").cancel))["status"] == "cancelled"


def _submit_in_background(exp) -> tuple[threading.Thread, dict]:
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", submit(exp, progress=False)), daemon=True)
    thread.start()
    return thread, box


def _at_step(share: FileShare, experiment: str, step: int) -> str:
    """The run id of the experiment's run once its metric history reached ``step``."""
    def reached():
        for run_id in share.list(experiment):
            path = run_paths(experiment, run_id).metrics
            if share.exists(path) and len(share.read_bytes(path).splitlines()) >= step:
                return run_id
        return None
    return wait_until(reached, timeout=120, message=f"step {step} recorded", interval=0.2)


@pytest.mark.kernel
def test_a_pruned_run_ends_pruned_at_its_last_step_and_is_not_run_again(project, write_experiment):
    make_notebook(project / "nb.ipynb", [STEPS], parameters="LR = 0.1")
    exp = write_experiment("experiment: prune\nnotebooks: [nb.ipynb]\n")
    share = FileShare(project / "results")
    thread, box = _submit_in_background(exp)
    run_id = _at_step(share, "prune", 3)
    assert write_cancel_markers(share, "prune", [run_id], PRUNE) == [run_id]
    thread.join(60)
    [record] = box["result"].records
    assert record.status == "pruned" and box["result"].ok
    assert record.error.kind == ErrorKind.PRUNED and record.error.reason == PRUNE.reason
    history = (project / "results" / "prune" / run_id / "metrics.jsonl").read_text().splitlines()
    last = json.loads(history[-1])["step"]
    assert last >= 3 and record.metrics["loss"] == pytest.approx(10.0 / last)  # kept at its last step
    nb = nbformat.read(project / "results" / "prune" / run_id / "output.ipynb", as_version=4)
    assert "nbbatch stopped this run: pruned by search lr at step 3" in nb.cells[0].source
    log = (project / "results" / "prune" / run_id / "log.txt").read_text()
    assert "=== pruned after" in log
    again = submit(exp, progress=False)  # a resubmit leaves it as it is
    assert again.skipped == [run_id] and not again.started
    assert read_record(share, "prune", run_id).status == "pruned"


@pytest.mark.kernel
def test_a_pruned_distributed_run_ends_pruned_on_every_rank(project, write_experiment):
    """Every rank watches the run's marker: the gang ends pruned, not failed by a rank that lost its peer."""
    make_notebook(project / "nb.ipynb", ["import os\nRANK = int(os.environ['RANK'])", STEPS], parameters="LR = 0.1")
    exp = write_experiment("experiment: prune-ddp\nnotebooks: [nb.ipynb]\n"
                           "resources: {nodes: 1, processes_per_node: 2}\ndistribution: {type: torch}\n")
    share = FileShare(project / "results")
    thread, box = _submit_in_background(exp)
    run_id = _at_step(share, "prune-ddp", 2)
    write_cancel_markers(share, "prune-ddp", [run_id], PRUNE)
    thread.join(60)
    [record] = box["result"].records
    assert record.status == "pruned", record.error
    assert record.error.reason == PRUNE.reason
    assert [r.status for r in record.ranks] == ["pruned", "pruned"]
