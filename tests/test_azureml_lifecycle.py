"""The azureml backend against a fake as strict as the service: what Azure ML refuses (with its error body, shown
whole), cancels it refuses, a refused job amid others, CancelRequested, and a job stuck waiting for quota."""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("azure.ai.ml")
pytest.importorskip("azure.storage.fileshare")

from azure.ai.ml import command  # noqa: E402
from azure.ai.ml.entities import AmlCompute  # noqa: E402
from azure.core.exceptions import HttpResponseError  # noqa: E402
from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles  # noqa: E402
from fakes.azureml_transport import (  # noqa: E402
    CANCEL_MESSAGE,
    COMPUTE_NAME_MESSAGE,
    EXPERIMENT_NAME_MESSAGE,
    JOB_NAME_MESSAGE,
    QUOTA_MESSAGE,
    SHM_SIZE_MESSAGE,
    FakeAzureML,
    service_error,
)
from rich.console import Console  # noqa: E402
from support.azure import make_toy_azure_project  # noqa: E402

import nbbatch.backends.azureml.polling as polling_module  # noqa: E402
from nbbatch.backends import SubmitOptions  # noqa: E402
from nbbatch.backends.azureml import JOB_FILE, AzureMLBackend, AzureMLCluster, ClusterSettings  # noqa: E402
from nbbatch.backends.azureml.workspace import error_text  # noqa: E402
from nbbatch.errors import BackendError  # noqa: E402
from nbbatch.plan.runs import Run  # noqa: E402
from nbbatch.results.status import status_rows, status_table  # noqa: E402
from nbbatch.store.azfiles import AzureFileShare  # noqa: E402
from nbbatch.store.layout import run_paths  # noqa: E402
from nbbatch.store.runfiles import StopRequest, read_record, stop_request, write_record  # noqa: E402
from nbbatch.store.runjson import RunRecord, Status  # noqa: E402

pytestmark = [pytest.mark.azure, pytest.mark.timeout(120)]

SHARE_URL = f"azfiles://{ACCOUNT}/results/nbbatch"
ENVIRONMENT = {"*": "azureml:nbbatch-toy:1"}  # an existing environment: nothing is built


@pytest.fixture
def azproject(project):
    return make_toy_azure_project(project, ["print(LR)"], parameters="LR = 0.1")


def _runs(root: Path, experiment: str = "cifar", count: int = 3) -> list[Run]:
    return [Run(run_id=f"toy-00000{i}", experiment=experiment, notebook=str(root / "notebooks" / "Toy.ipynb"),
                notebook_rel="notebooks/Toy.ipynb", kernel="nbbatch-toy", parameters={"LR": 10.0 ** -i},
                framework="toy", gpus=1, timeout_s=900) for i in range(count)]


@pytest.fixture
def share(monkeypatch):
    with FakeAzureFiles() as server:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        yield AzureFileShare(SHARE_URL)


@pytest.fixture
def aml():
    fake = FakeAzureML()
    fake.register_environment("nbbatch-toy", "1")  # ENVIRONMENT: the workspace has it, as the service checks
    return fake


def _backend(aml: FakeAzureML, **settings) -> AzureMLBackend:
    return AzureMLBackend(ml_client=aml.ml_client(), compute="gpu-t4", environments=ENVIRONMENT, poll_seconds=0,
                          **settings)


def _queue(share, runs):
    for run in runs:  # what nbbatch.api.submit does before calling the backend
        write_record(share, RunRecord(run_id=run.run_id, experiment=run.experiment, notebook=run.notebook_rel,
                                      kernel=run.kernel, framework=run.framework, status="queued", backend="azureml"))


def _job_name(share, run: Run) -> str:
    return json.loads(share.read_bytes(run_paths(run.experiment, run.run_id).file(JOB_FILE)))["job_name"]


def _body(exc: HttpResponseError) -> dict:
    return json.loads(exc.response.text())["error"]


# --- the fake refuses what the service refuses, with the service's body ------------------------------------------


@pytest.mark.parametrize(("field", "value", "message"), [
    ("experiment_name", "cifar.v2", EXPERIMENT_NAME_MESSAGE),
    ("name", "toy-000000:1", JOB_NAME_MESSAGE.format(name="toy-000000:1")),
    ("compute", "gpu-", COMPUTE_NAME_MESSAGE),
    ("shm_size", "16 GB", SHM_SIZE_MESSAGE.format(value="16 GB")),
])
def test_the_fake_refuses_a_job_the_service_refuses(aml, field, value, message):
    fields = {"name": "toy-000000-1", "experiment_name": "cifar", "compute": "gpu-t4", "shm_size": "16g"}
    job = command(command="echo", environment="azureml:e:1", **{**fields, field: value})
    with pytest.raises(HttpResponseError) as caught:
        aml.ml_client().jobs.create_or_update(job)
    assert caught.value.status_code == 400 and not aml.jobs
    body = _body(caught.value)
    assert body["code"] == "UserError" and body["message"] == message and body["details"][0]["message"] == message
    assert message in error_text(caught.value)  # what nbbatch shows: the service's words, not "invalid status"
    aml.register_environment("e", "1")
    aml.add_compute("gpu-t4")
    aml.ml_client().jobs.create_or_update(command(command="echo", environment="azureml:e:1", **fields))  # valid: taken


def test_the_fake_refuses_a_bad_compute_name_and_nbbatch_shows_the_body_whole(aml):
    with pytest.raises(HttpResponseError) as caught:
        aml.ml_client().compute.begin_create_or_update(AmlCompute(name="ab", size="Standard_D4s_v5")).result()
    assert _body(caught.value)["message"] == COMPUTE_NAME_MESSAGE and not aml.computes
    cluster = AzureMLCluster(aml.ml_client(), ClusterSettings("gpu-t4"))
    # a name the offline check would refuse (settings are frozen and checked): here the service refuses it
    object.__setattr__(cluster.settings, "compute", "gpu-")
    with pytest.raises(BackendError) as refused:
        cluster.create()
    assert f"(UserError) {COMPUTE_NAME_MESSAGE}" in str(refused.value)
    assert "inner error: BadArgument/ComputeNameInvalid" in str(refused.value)


# --- nbbatch: a refused job fails its run with the service's answer, and strands no other run ---------------------


@pytest.mark.parametrize("bad", ["experiment", "job name", "shm_size"])
def test_jobs_the_service_refuses_fail_their_runs_with_its_answer(aml, share, azproject, monkeypatch, bad):
    runs = _runs(azproject, experiment="cifar.v2" if bad == "experiment" else "cifar", count=2)
    message = {"experiment": EXPERIMENT_NAME_MESSAGE, "job name": JOB_NAME_MESSAGE.format(name="bad:name"),
               "shm_size": SHM_SIZE_MESSAGE.format(value="16 gb")}[bad]
    if bad == "job name":
        monkeypatch.setattr(polling_module, "attempt_job_name", lambda experiment, run_id, attempt: "bad:name")
    backend = _backend(aml, shm_size="16 GB" if bad == "shm_size" else None)
    _queue(share, runs)
    with pytest.raises(BackendError, match=r"Azure ML refused every job \(2\), so nothing runs: run toy-000000: "
                                           r"\(UserError\) .*\(and 1 more"):
        backend.start(runs, share, SubmitOptions())  # as if the offline check had missed it
    for run in runs:
        record = read_record(share, run.experiment, run.run_id)
        assert record.status == "failed" and record.error.ename == "AzureMLJobRefused"
        assert f"(HTTP 400): (UserError) {message}" in record.error.evalue  # the service's answer, whole
        assert backend.job_state(share, run.experiment, run.run_id).status == "failed"
        assert not backend.in_flight(share, record)
    assert not aml.jobs


def _azureml_via(aml, monkeypatch):
    import nbbatch.backends as backends

    monkeypatch.setitem(backends._REGISTRY, "azureml",
                        lambda **settings: AzureMLBackend(ml_client=aml.ml_client(), **settings))


def test_a_refused_job_amid_others_fails_alone(aml, share, azproject, write_experiment, monkeypatch, capsys):
    from nbbatch.api import prepare
    from nbbatch.ui.cli import build_parser

    _azureml_via(aml, monkeypatch)
    exp = write_experiment("experiment: mixed\nframeworks: [toy]\nsweep: {grid: {LR: [0.1, 0.01, 0.001]}}\n"
                           "backend: {name: azureml, compute: gpu-t4, poll_seconds: 0, "
                           "environments: {'*': 'azureml:nbbatch-toy:1'}}\n"
                           f"share: {SHARE_URL}\n")
    run_ids = {run.parameters["LR"]: run.run_id for run in prepare(exp)[0].runs}
    refusal = "The job's environment nbbatch-toy:1 is being deleted."  # a refusal only the service can make
    aml.job_refusals[run_ids[0.01]] = service_error(400, refusal, inner="EnvironmentInvalid")
    args = build_parser().parse_args(["submit", str(exp), "--no-wait", "--quiet"])
    assert args.func(args) == 1  # the command says a run failed, though the others go on
    out = capsys.readouterr().out
    assert "1 failed" in out and "2 queued" in out
    records = {r: read_record(share, "mixed", r) for r in run_ids.values()}
    refused = records.pop(run_ids[0.01])
    assert refused.status == "failed" and f"(UserError) {refusal}" in refused.error.evalue
    assert {r.status for r in records.values()} == {"queued"}
    assert {j["properties"]["displayName"] for j in aml.jobs.values()} == set(records)


def test_runs_left_without_a_job_are_failed_not_left_queued(aml, share, azproject):
    runs = _runs(azproject)
    refusal = service_error(400, "The subscription has no quota for the NCASv3_T4 family.", inner="QuotaExceeded")
    aml.transport.routes.insert(0, ("PUT", re.compile(r".*/computes/[^/]+/?$"), lambda call: refusal))
    _queue(share, runs)
    with pytest.raises(BackendError, match="no quota for the NCASv3_T4 family"):
        _backend(aml).start(runs, share, SubmitOptions())
    for run in runs:
        record = read_record(share, "cifar", run.run_id)
        assert record.status == "failed" and record.error.ename == "NotSubmitted"
        assert "no quota for the NCASv3_T4 family" in record.error.evalue


# --- cancel: the service refuses finished and finalizing jobs; the others are cancelled ----------------------------


def test_cancel_goes_on_past_jobs_that_finished_and_says_which(aml, share, azproject, monkeypatch, capsys):
    runs = _runs(azproject, count=4)
    backend = _backend(aml)
    _queue(share, runs)
    backend.start(runs, share, SubmitOptions())
    names = [_job_name(share, r) for r in runs]
    for name, status in zip(names, ["Finalizing", "Running", "Running", "Queued"], strict=True):
        aml.set_job_status(name, status)
    backend.sync("cifar", share)
    aml.set_job_status(names[2], "Completed")  # between the last look and the cancel
    share.write_bytes(run_paths("cifar", runs[2].run_id).notebook, b"{}")

    with pytest.warns(UserWarning) as caught:
        asked = backend.cancel("cifar", share)
    assert asked == [runs[1].run_id, runs[3].run_id]
    assert sorted(aml.cancelled) == sorted([names[1], names[3]])
    assert all(share.exists(run_paths("cifar", r.run_id).cancel) for r in runs)  # every marker written
    status = {r.run_id: read_record(share, "cifar", r.run_id).status for r in runs}
    assert status == {runs[0].run_id: "running", runs[1].run_id: "cancelled", runs[2].run_id: "succeeded",
                      runs[3].run_id: "cancelled"}
    warned = [str(w.message) for w in caught]
    assert len(warned) == 2
    assert f"run {runs[0].run_id} was not cancelled: its Azure ML job {names[0]} is Finalizing" in warned[0]
    assert CANCEL_MESSAGE.format(name=names[0], status="Finalizing") in warned[0]  # the service's answer
    assert f"run {runs[2].run_id} was not cancelled" in warned[1] and "Completed" in warned[1]

    # the CLI prints the runs it could not cancel, with why
    import nbbatch.api as api
    from nbbatch.ui.cli import cmd_cancel

    aml.set_job_status(names[0], "Failed")
    results = share

    def cancel(experiment, run_ids=None, share=None):  # api.cancel, for this backend and share
        return backend.cancel(experiment, results, run_ids)

    monkeypatch.setattr(api, "cancel", cancel)
    assert cmd_cancel(argparse.Namespace(experiment="cifar", runs=None, share=None)) == 0
    out, err = capsys.readouterr()
    assert "no unfinished runs to cancel" in out
    assert f"nbbatch: warning: run {runs[0].run_id} was not cancelled: its Azure ML job {names[0]} is Failed" in err
    assert read_record(share, "cifar", runs[0].run_id).status == "failed"


def test_a_damaged_record_stops_no_cancel_and_no_sync_and_is_named(aml, share, azproject):
    runs = _runs(azproject, count=3)
    backend = _backend(aml)
    _queue(share, runs)
    backend.start(runs, share, SubmitOptions())
    names = [_job_name(share, r) for r in runs]
    for name in names:
        aml.set_job_status(name, "Running")
    damaged = run_paths("cifar", runs[1].run_id).record
    share.write_bytes(damaged, b'{"run_id": ')  # a hand edit gone wrong

    backend.sync("cifar", share)  # what `status` asks first: the damaged record stops no other
    with pytest.warns(UserWarning) as caught:
        asked = backend.cancel("cifar", share)
    assert asked == [r.run_id for r in runs] and sorted(aml.cancelled) == sorted(names)
    assert [read_record(share, "cifar", r.run_id).status for r in (runs[0], runs[2])] == ["cancelled", "cancelled"]
    assert share.read_bytes(damaged) == b'{"run_id": '  # left as it was, for the user to see
    [warned] = [str(w.message) for w in caught]
    assert f"{damaged} is not valid JSON" in warned and f"run {runs[1].run_id} was asked to stop" in warned



def _running_job(aml, share, azproject):
    """One run queued and started on the fake service, its job Running and seen so: (run, backend, job name)."""
    run = _runs(azproject, count=1)[0]
    backend = _backend(aml)
    _queue(share, [run])
    backend.start([run], share, SubmitOptions())
    name = _job_name(share, run)
    aml.set_job_status(name, "Running")
    backend.refresh("cifar", share)
    return run, backend, name


def test_cancel_requested_then_completed_ends_succeeded(aml, share, azproject):
    run, backend, name = _running_job(aml, share, azproject)
    aml.set_job_status(name, "CancelRequested")  # cancelled in the studio: the job may still finish
    backend.refresh("cifar", share)
    record = read_record(share, "cifar", run.run_id)
    assert record.status == "running" and "cancel requested" in record.note
    assert backend.in_flight(share, record)  # not started again while it may still run
    aml.job_scripts[name] = ["CancelRequested", "Completed"]
    share.write_bytes(run_paths("cifar", run.run_id).notebook, b"{}")
    seen = []
    backend.wait("cifar", share, [run.run_id], lambda r: seen.append(r.status))
    assert seen[-1] == "succeeded" and read_record(share, "cifar", run.run_id).error is None


# --- a job waiting on quota says so in `nbbatch status` ------------------------------------------------------------


def test_a_job_stuck_on_quota_says_so_in_status(aml, share, azproject):
    runs = _runs(azproject, count=2)
    backend = _backend(aml)
    _queue(share, runs)
    backend.start(runs, share, SubmitOptions())
    for run in runs:
        aml.stall_allocation(_job_name(share, run))
    gets = len(aml.transport.calls)
    backend.refresh("cifar", share)
    compute_gets = [c for c in aml.transport.calls[gets:] if "/computes/" in c.path]
    assert len(compute_gets) == 1  # one look at the cluster for both jobs
    records = [read_record(share, "cifar", r.run_id) for r in runs]
    expected = f"waiting for nodes: cluster gpu-t4 cannot allocate: QuotaExceeded: {QUOTA_MESSAGE}"
    assert [r.status for r in records] == ["queued", "queued"] and [r.note for r in records] == [expected] * 2
    assert status_rows(records)[0]["note"] == expected
    text = io.StringIO()
    Console(file=text, width=400).print(status_table(records))
    assert "note" in text.getvalue() and expected in text.getvalue()

    aml.compute_errors, aml.allocation_state = [], "Resizing"  # quota granted: the cluster grows
    backend.refresh("cifar", share)
    assert read_record(share, "cifar", runs[0].run_id).note.startswith("waiting for nodes: cluster gpu-t4 is resizing")
    aml.allocation_state = "Steady"
    for run in runs:
        aml.set_job_status(_job_name(share, run), "Running")
    backend.refresh("cifar", share)
    record = read_record(share, "cifar", runs[0].run_id)
    assert record.status == "running" and record.note is None



# --- a search's pruner stops a run on Azure ML -----------------------------------------------------------------------


def test_a_pruned_runs_job_is_cancelled_and_the_run_ends_pruned(aml, share, azproject):
    """The search's driver stops a run with a pruned request: its marker says so (the executor in the job stops the
    kernel and ends pruned), its job is cancelled, and the record ends pruned, also once the service says Canceled."""
    run, backend, name = _running_job(aml, share, azproject)
    request = StopRequest(Status.PRUNED, "stopped at step 3 by the search's median pruner")
    assert backend.cancel("cifar", share, [run.run_id], request=request) == [run.run_id]
    assert stop_request(share, "cifar", run.run_id) == request
    record = read_record(share, "cifar", run.run_id)
    assert record.status == "pruned" and record.error.kind == "pruned" and record.error.reason == request.reason
    aml.set_job_status(name, "Canceled")
    backend.refresh("cifar", share)
    assert read_record(share, "cifar", run.run_id).status == "pruned"
