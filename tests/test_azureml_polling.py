"""Azure ML at scale and under load, against a fake as strict as the service: throttling (the SDK's retry policy on),
jobs read in one paged list per poll, a create the SDK retried, a job not yet visible after its create, compute that
takes several polls to provision, immutable environment versions, and jobs naming what the workspace lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("azure.ai.ml")
pytest.importorskip("azure.storage.fileshare")

from azure.ai.ml import command  # noqa: E402
from azure.ai.ml.entities import AmlCompute, Environment  # noqa: E402
from azure.core.exceptions import HttpResponseError  # noqa: E402
from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles  # noqa: E402
from fakes.azureml_transport import (  # noqa: E402
    COMPUTE_CREATE_POLLS,
    ENVIRONMENT_FROZEN_MESSAGE,
    JOB_EXISTS_MESSAGE,
    THROTTLED_MESSAGE,
    FakeAzureML,
)
from support.azure import make_toy_azure_project  # noqa: E402

from nbbatch.backends import SubmitOptions  # noqa: E402
from nbbatch.backends.azureml import JOB_FILE, AzureMLBackend, AzureMLCluster, ClusterSettings  # noqa: E402
from nbbatch.plan.runs import Run  # noqa: E402
from nbbatch.store.azfiles import AzureFileShare  # noqa: E402
from nbbatch.store.layout import run_paths  # noqa: E402
from nbbatch.store.runfiles import read_record, write_record  # noqa: E402
from nbbatch.store.runjson import RunRecord  # noqa: E402

pytestmark = [pytest.mark.azure, pytest.mark.timeout(120)]

SHARE_URL = f"azfiles://{ACCOUNT}/results/nbbatch"
ENVIRONMENT = {"*": "azureml:nbbatch-toy:1"}


@pytest.fixture
def azproject(project):
    return make_toy_azure_project(project, ["print(LR)"], parameters="LR = 0.1")


@pytest.fixture
def share(monkeypatch):
    with FakeAzureFiles() as server:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        yield AzureFileShare(SHARE_URL)


@pytest.fixture
def aml():
    fake = FakeAzureML()
    fake.register_environment("nbbatch-toy", "1")
    return fake


def _runs(root: Path, count: int = 3, experiment: str = "cifar") -> list[Run]:
    return [Run(run_id=f"toy-00000{i}", experiment=experiment, notebook=str(root / "notebooks" / "Toy.ipynb"),
                notebook_rel="notebooks/Toy.ipynb", kernel="nbbatch-toy", parameters={"LR": 10.0 ** -i},
                framework="toy", gpus=1, timeout_s=900) for i in range(count)]


def _backend(aml: FakeAzureML, retries: bool = True) -> AzureMLBackend:
    """The backend with the SDK's retry policy on (as nbbatch runs it), unless ``retries`` is False."""
    return AzureMLBackend(ml_client=aml.ml_client(retries=retries), compute="gpu-t4", environments=ENVIRONMENT,
                          poll_seconds=0)


def _started(aml, share, runs, retries: bool = True) -> AzureMLBackend:
    backend = _backend(aml, retries)
    for run in runs:  # what nbbatch.api.submit does before calling the backend
        write_record(share, RunRecord(run_id=run.run_id, experiment=run.experiment, notebook=run.notebook_rel,
                                      kernel=run.kernel, framework=run.framework, status="queued", backend="azureml"))
    backend.start(runs, share, SubmitOptions())
    return backend


def _state(share, run: Run) -> dict:
    return json.loads(share.read_bytes(run_paths(run.experiment, run.run_id).file(JOB_FILE)))


def _job_reads(aml, since: int) -> list:
    return [c for c in aml.transport.calls[since:] if c.method == "GET" and "/jobs" in c.path]


# --- the fake: as strict as the service ---------------------------------------------------------------------------


def test_the_fake_throttles_and_the_sdks_retry_rides_through_as_retry_after_asks(aml):
    aml.add_compute("gpu-t4")
    aml.throttle(2, retry_after=7, method="GET", path="/computes/")
    assert aml.ml_client(retries=True).compute.get("gpu-t4").name == "gpu-t4"
    assert aml.transport.slept == [7, 7]  # the SDK waited what Retry-After asked, twice
    aml.throttle(1, retry_after=3)
    with pytest.raises(HttpResponseError) as caught:  # retries off: the answer itself
        aml.ml_client().compute.get("gpu-t4")
    assert caught.value.status_code == 429 and caught.value.response.headers["Retry-After"] == "3"
    body = json.loads(caught.value.response.text())["error"]
    assert body == {"code": "SubscriptionRequestsThrottled", "message": THROTTLED_MESSAGE.format(seconds="3")}


def test_a_compute_is_creating_over_several_polls_of_its_async_operation(aml):
    poller = aml.ml_client().compute.begin_create_or_update(AmlCompute(name="gpu-t4", size="Standard_NC4as_T4_v3"))
    assert poller.result().provisioning_state == "Succeeded"  # the SDK polled until the operation said so
    polls = [c for c in aml.transport.calls if "/fake-operations/" in c.path]
    assert len(polls) == COMPUTE_CREATE_POLLS + 1  # InProgress, InProgress, InProgress, Succeeded
    # nbbatch waits for it the same way
    AzureMLCluster(aml.ml_client(), ClusterSettings("gpu-a100", "Standard_NC24ads_A100_v4")).create()
    assert aml.computes["gpu-a100"]["properties"]["provisioningState"] == "Succeeded"


def test_an_environment_version_cannot_be_changed(aml):
    client = aml.ml_client()
    client.environments.create_or_update(Environment(name="e", version="1", image="python:3.12"))
    client.environments.create_or_update(Environment(name="e", version="1", image="python:3.12", description="new"))
    with pytest.raises(HttpResponseError) as caught:
        client.environments.create_or_update(Environment(name="e", version="1", image="python:3.13"))
    assert caught.value.status_code == 400
    assert ENVIRONMENT_FROZEN_MESSAGE.format(name="e", version="1") in str(caught.value)


@pytest.mark.parametrize("missing", ["compute", "environment", "datastore"])
def test_a_job_naming_what_the_workspace_lacks_is_refused(aml, missing):
    aml.add_compute("gpu-t4")
    aml.add_datastore("store")
    fields = {"compute": "gpu-t4", "environment": "azureml:nbbatch-toy:1",
              "outputs": {"share": {"type": "uri_folder", "path": "azureml://datastores/store/paths/x/"}}}
    fields.update({"compute": {"compute": "gpu-v100"}, "environment": {"environment": "azureml:other:2"},
                   "datastore": {"outputs": {"share": {"type": "uri_folder",
                                                       "path": "azureml://datastores/gone/paths/x/"}}}}[missing])
    with pytest.raises(HttpResponseError) as caught:
        aml.ml_client().jobs.create_or_update(command(command="echo", experiment_name="cifar", **fields))
    assert caught.value.status_code == 400 and not aml.jobs
    assert f"references {missing}" in str(caught.value)


def test_jobs_are_listed_a_page_at_a_time(aml):
    aml.add_compute("gpu-t4")
    aml.page_size = 2
    client = aml.ml_client()
    for i in range(5):
        client.jobs.create_or_update(command(name=f"job-{i}", command="echo", compute="gpu-t4",
                                             environment="azureml:nbbatch-toy:1", properties={"p": str(i % 2)}))
    assert sorted(j.name for j in client.jobs.list()) == [f"job-{i}" for i in range(5)]
    assert len([c for c in aml.transport.calls if c.method == "GET" and c.path.endswith("/jobs")]) == 3
    assert sorted(j.name for j in client.jobs.list(properties="p=1")) == ["job-1", "job-3"]


# --- nbbatch: one paged list per poll, backing off when throttled (item 7) -----------------------------------------


def test_a_poll_reads_every_job_in_one_paged_list(aml, share, azproject):
    runs = _runs(azproject, count=6)
    aml.page_size = 4
    backend = _started(aml, share, runs)
    for run in runs:
        aml.set_job_status(_state(share, run)["job_name"], "Running")
    since = len(aml.transport.calls)
    backend.sync("cifar", share)
    reads = _job_reads(aml, since)
    assert len(reads) == 2 and all(r.path.endswith("/jobs") for r in reads)  # two pages, no read per job
    assert len(aml.transport.calls) == since + 2  # and nothing else
    assert reads[0].query["properties"] == ["nbbatch_experiment=cifar"]
    assert {read_record(share, "cifar", r.run_id).status for r in runs} == {"running"}


def test_a_throttled_poll_rides_through_or_backs_off_as_retry_after_asks(aml, share, azproject):
    runs = _runs(azproject, count=3)
    backend = _started(aml, share, runs)
    for run in runs:
        aml.set_job_status(_state(share, run)["job_name"], "Running")
    aml.throttle(2, retry_after=4, method="GET", path="/jobs")
    backend.sync("cifar", share)  # the SDK's retries ride through two 429s
    assert aml.transport.slept[-2:] == [4, 4]
    assert {read_record(share, "cifar", r.run_id).status for r in runs} == {"running"}

    now = [1000.0]
    backend._backoff.clock = lambda: now[0]
    aml.throttle(None, retry_after=60, method="GET", path="/jobs")  # throttled past the SDK's retries
    aml.set_job_status(_state(share, runs[0])["job_name"], "Completed")
    backend.sync("cifar", share)  # no error: the records stay as they were
    assert read_record(share, "cifar", runs[0].run_id).status == "running"
    aml.transport.throttles.clear()
    since = len(aml.transport.calls)
    now[0] += 59
    backend.sync("cifar", share)
    assert not aml.transport.calls[since:]  # the service is left alone for as long as it asked
    now[0] += 2
    share.write_bytes(run_paths("cifar", runs[0].run_id).notebook, b"{}")
    backend.sync("cifar", share)
    assert read_record(share, "cifar", runs[0].run_id).status == "succeeded"


# --- nbbatch: a create the SDK retried (item 8) --------------------------------------------------------------------


def test_a_create_the_sdk_retried_keeps_the_job_its_first_try_made(aml, share, azproject):
    runs = _runs(azproject, count=2)
    aml.drop_responses(1, method="PUT", path="/jobs/")  # the job is made, its answer lost; the SDK sends it again
    backend = _started(aml, share, runs)
    assert len(aml.jobs) == 2  # no duplicate, no orphan
    for run in runs:
        state = _state(share, run)
        assert state["job_name"] in aml.jobs and state["status"] == "queued" and state["attempt"] == 1
        assert read_record(share, "cifar", run.run_id).status == "queued", "recorded as refused while its job runs"
    assert backend.in_flight(share, read_record(share, "cifar", runs[0].run_id))


def test_job_names_are_the_same_for_an_attempt_and_differ_across_attempts_and_experiments(aml, share, azproject):
    from nbbatch.backends.azureml.polling import attempt_job_name

    run = _runs(azproject, count=1)[0]
    assert attempt_job_name("cifar", run.run_id, 1) == attempt_job_name("cifar", run.run_id, 1)
    assert len({attempt_job_name(e, run.run_id, a) for e in ("cifar", "mnist") for a in (1, 2)}) == 4
    # a job of an earlier life of the experiment holds attempt 1's name, and has ended: attempt 2 is made
    _started(aml, share, [run])
    old = _state(share, run)["job_name"]
    aml.set_job_status(old, "Completed")
    share.remove(run_paths("cifar", run.run_id).file(JOB_FILE))
    _started(aml, share, [run])
    state = _state(share, run)
    assert state["attempt"] == 2 and state["job_name"] != old and len(aml.jobs) == 2
    # a job name taken by another run's job is the service's refusal, as it came
    other = _runs(azproject, count=2)[1]
    aml.jobs[attempt_job_name("cifar", other.run_id, 1)] = aml.jobs[old]
    with pytest.raises(Exception, match="refused every job"):
        _started(aml, share, [other])
    assert JOB_EXISTS_MESSAGE.format(name=attempt_job_name("cifar", other.run_id, 1)) in (
        read_record(share, "cifar", other.run_id).error.evalue)


# --- nbbatch: a job not yet visible after its create (item 9) ------------------------------------------------------


def test_a_job_not_found_just_after_its_create_is_not_taken_for_gone(aml, share, azproject):
    runs = _runs(azproject, count=1)
    backend = _started(aml, share, runs)
    name = _state(share, runs[0])["job_name"]
    aml.unseen_jobs[name] = 2  # two reads answer 404 before the service shows it
    backend.refresh("cifar", share)
    record = read_record(share, "cifar", runs[0].run_id)
    assert record.status == "queued" and record.note == "created in Azure ML moments ago and not visible yet"
    assert backend.in_flight(share, record)  # so a resubmission does not make a second job
    aml.set_job_status(name, "Running")
    backend.refresh("cifar", share)
    assert read_record(share, "cifar", runs[0].run_id).status == "running"

    # past the grace period, not found is gone
    path = run_paths("cifar", runs[0].run_id).file(JOB_FILE)
    state = json.loads(share.read_bytes(path))
    share.write_bytes(path, json.dumps({**state, "submitted_at": "2020-01-01T00:00:00.000+00:00"}).encode())
    del aml.jobs[name]
    backend.refresh("cifar", share)
    record = read_record(share, "cifar", runs[0].run_id)
    assert record.status == "failed" and "no longer exists" in record.error.reason
