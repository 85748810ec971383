"""The drivers (nbbatch.drivers): one owner of a submission, held to its shape with a backend that runs nothing."""

from __future__ import annotations

import json
import shutil
from typing import ClassVar

import pytest
from support.notebooks import make_notebook

from nbbatch.backends.base import Backend, Capabilities, Compute
from nbbatch.drivers import SearchDriver, SubmissionDriver
from nbbatch.errors import NbbatchError
from nbbatch.plan.runs import Plan, Run
from nbbatch.spec.experiment import Experiment
from nbbatch.store import lease as lease_module
from nbbatch.store.layout import experiment_paths, run_paths
from nbbatch.store.share import FileShare


class InstantBackend(Backend):
    """Every run succeeds as it starts; like Azure ML, it cannot hold a batch to max_parallel."""

    name: ClassVar[str] = "instant"
    capabilities: ClassVar[Capabilities] = Capabilities(gpus=False, parallel_limit=False)

    def compute(self) -> Compute:
        return Compute(self.name)

    def start(self, runs, share, options) -> None:
        for run in runs:
            share.write_bytes(run_paths(run.experiment, run.run_id).notebook, b"{}")
            self.finalize(share, run, "succeeded", notify=options.guarded_update)


class VanishingBackend(InstantBackend):
    """The first run succeeds, then the experiment's folder is deleted or renamed under the driver."""

    def __init__(self, vanish) -> None:
        super().__init__()
        self.vanish = vanish

    def start(self, runs, share, options) -> None:
        super().start(runs[:1], share, options)
        self.vanish(share.local_path("e"))
        assert options.halt.wait(10), "the driver's lease noticed"


def _plan(project, **more) -> Plan:
    make_notebook(project / "nb.ipynb", ["print(A)"])
    spec = Experiment.from_dict({"experiment": "e", "notebooks": ["nb.ipynb"], "share": "results", **more})
    runs = [Run(run_id=f"r{i}", experiment="e", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
                kernel="python3", parameters={"A": i}) for i in range(3)]
    return Plan(spec, runs)


def test_a_submission_locks_writes_the_manifest_runs_and_reports(project):
    plan, share = _plan(project, resources={"max_parallel": 2}), FileShare(project / "results")
    seen: list[str] = []
    result = SubmissionDriver(plan, InstantBackend(), share, progress=lambda r: seen.append(r.status)).submit()
    assert result.ok and result.started == ["r0", "r1", "r2"] and not result.skipped and result.waited
    assert "queued" in seen and "succeeded" in seen, "the caller's callback sees each change"
    assert json.loads(share.read_bytes(experiment_paths("e").manifest))["runs"] == ["r0", "r1", "r2"]
    assert any("max_parallel 2 is not applied on backend `instant`" in w for w in result.warnings)
    again = SubmissionDriver(plan, InstantBackend(), share, progress=False, only=["r1"]).submit()  # the lock is free
    assert again.skipped == ["r1"] and not again.started and [r.run_id for r in again.records] == ["r1"]


def test_drivers_refuse_what_they_cannot_do_before_anything_is_locked(project):
    plan, share = _plan(project), FileShare(project / "results")
    with pytest.raises(NbbatchError, match="--only x matches none of the 3 planned runs"):
        SubmissionDriver(plan, InstantBackend(), share, only=["x"])
    searching = _plan(project, search={"metric": "loss", "mode": "min", "trials": 2, "params": {"A": {"randint": [0, 9]}}})
    with pytest.raises(NbbatchError, match="without waiting"):
        SearchDriver(searching, InstantBackend(), share, wait=False)
    with pytest.raises(NbbatchError, match="draws its runs as it goes"):
        SearchDriver(searching, InstantBackend(), share, only=["r0"])
    assert not (project / "results").exists(), "nothing was written"


@pytest.mark.parametrize("vanish", [shutil.rmtree, lambda folder: folder.rename(folder.with_name("e-old"))],
                         ids=["deleted", "renamed"])
def test_a_share_folder_gone_mid_run_stops_the_driver_naming_the_folder(project, monkeypatch, vanish):
    """Issue 45, item 13: not "another driver took over"; the result's last line names the folder that is gone."""
    monkeypatch.setattr(lease_module, "RENEW_EVERY_S", 0.05)
    monkeypatch.setattr(lease_module, "TAKEOVER_SETTLE_S", 0.05)
    share = FileShare(project / "results")
    result = SubmissionDriver(_plan(project), VanishingBackend(vanish), share, progress=False).submit()
    assert not result.ok
    assert result.stopped.startswith("experiment `e`: this driver stopped starting runs: ")
    assert f"{share.url}/e is gone from the share" in result.stopped and "took" not in result.stopped
