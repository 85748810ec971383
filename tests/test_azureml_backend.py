"""The azureml backend: the real MLClient against canned service answers (azure-core transport), the
entities it builds checked by the SDK's own YAML loaders, and the results share on a fake Azure Files server."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import shlex
from pathlib import Path

import pytest

pytest.importorskip("azure.ai.ml")
pytest.importorskip("azure.storage.fileshare")

from azure.ai.ml import load_compute, load_environment, load_job  # noqa: E402
from azure.ai.ml.entities import Command, Environment  # noqa: E402
from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles  # noqa: E402
from fakes.azureml_transport import FakeAzureML  # noqa: E402
from support.azure import make_toy_azure_project  # noqa: E402
from support.containers import BASE, podman  # noqa: E402
from support.notebooks import make_notebook  # noqa: E402

from nbbatch.backends import SubmitOptions, get_backend  # noqa: E402
from nbbatch.backends.azureml import (  # noqa: E402
    DEFAULT_LAUNCHER,
    JOB_FILE,
    AzureMLBackend,
    AzureMLCluster,
    ClusterSettings,
    build_code_snapshot,
    cli_cluster,
    framework_environment,
    job_yaml,
    map_job_status,
)
from nbbatch.containers.images import copy_sources, image_spec, render  # noqa: E402
from nbbatch.errors import BackendError, ValidationError  # noqa: E402
from nbbatch.execute.launch import LaunchSpec  # noqa: E402
from nbbatch.plan.runs import Run  # noqa: E402
from nbbatch.spec.frameworks import get_framework  # noqa: E402
from nbbatch.spec.project import Project  # noqa: E402
from nbbatch.spec.resources import Distribution  # noqa: E402
from nbbatch.store.azfiles import AzureFileShare  # noqa: E402
from nbbatch.store.layout import run_paths  # noqa: E402
from nbbatch.store.runfiles import read_record, write_record  # noqa: E402
from nbbatch.store.runjson import RunRecord  # noqa: E402

pytestmark = [pytest.mark.azure, pytest.mark.timeout(120)]

SHARE_URL = f"azfiles://{ACCOUNT}/results/nbbatch"
DATASTORE = f"nbbatch_{ACCOUNT}_results"


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def azproject(project):
    return make_toy_azure_project(project, ["print(EPOCHS, LR)"], parameters="EPOCHS = 1\nLR = 0.1")


def _image_version(azproject) -> str:
    return image_spec(get_framework("toy", Project(azproject)), azproject / "dockerfiles", run_as="root").fingerprint


def _run(root, run_id: str, lr: float, gpus: int = 1) -> Run:
    return Run(run_id=run_id, experiment="cifar", notebook=str(root / "notebooks" / "Toy.ipynb"),
               notebook_rel="notebooks/Toy.ipynb", kernel="nbbatch-toy", parameters={"EPOCHS": 1, "LR": lr},
               framework="toy", gpus=gpus, timeout_s=900)


def _launch_in(command: str, code: Path | None = None) -> LaunchSpec:
    """The launch a job's command hands ``run-one`` (its JSON, on the command line), read where the job runs: in its
    code snapshot ``code``, which holds the run's own file; without ``code``, the launch around a stand-in run."""
    words = shlex.split(command)
    data = json.loads(words[words.index("run-one") + 1])
    if code is None:
        data = {key: value for key, value in data.items() if key != "run_file"}
        return LaunchSpec.from_dict({**data, "run": Run("stand-in", "e", "n.ipynb", "n.ipynb", "k").to_dict()})
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(code)  # where Azure ML starts the job's command
        return LaunchSpec.from_dict(data)


@pytest.fixture
def runs(azproject):
    return [_run(azproject, f"toy-00000{i}", lr) for i, lr in enumerate((0.1, 0.01, 0.001))]


@pytest.fixture
def files(monkeypatch):
    with FakeAzureFiles() as server:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        yield server


@pytest.fixture
def share(files):
    return AzureFileShare(SHARE_URL)


@pytest.fixture
def aml():
    return FakeAzureML()


@pytest.fixture
def backend(aml):
    return AzureMLBackend(ml_client=aml.ml_client(), compute="gpu-a100", vm_size="Standard_NC24ads_A100_v4",
                          max_nodes=3, tier="low_priority", idle_time_before_scale_down=600, poll_seconds=0)


@pytest.fixture
def env_upload(monkeypatch):
    """Stand in for the SDK's upload of a Docker build context to blob storage (outside the control plane)."""
    import azure.ai.ml.operations._environment_operations as env_ops

    uploads = []

    def fake_upload(environment, operations, sas_uri=None, show_progress=True):
        if environment.build is None:  # an environment of a registry's image (`image:`): nothing to upload
            return environment
        context = Path(environment.build.path)
        uploads.append(sorted(p.relative_to(context).as_posix() for p in context.rglob("*") if p.is_file()))
        environment.build.path = f"https://fakeblob.blob.core.windows.net/azureml/LocalUpload/{environment.name}/"
        return environment

    monkeypatch.setattr(env_ops, "_check_and_upload_env_build_context", fake_upload)
    return uploads


def _options(**kw) -> SubmitOptions:
    return SubmitOptions(wait=kw.pop("wait", False), **kw)


def _submit(backend, runs, share, options):
    """What the submission driver does with a batch: start the runs that need it, and wait with ``options.wait``."""
    outcome = backend.triage(runs, share, force=options.force)
    started = set(outcome.started)
    backend.launch([r for r in runs if r.run_id in started], share, options)
    return outcome


def _queue(share, runs):
    for run in runs:  # what nbbatch.api.submit does before calling the backend
        write_record(share, RunRecord(run_id=run.run_id, experiment=run.experiment, notebook=run.notebook_rel,
                                      kernel=run.kernel, framework=run.framework, status="queued", backend="azureml"))


def _job_names(share, runs):
    return {r.run_id: json.loads(share.read_bytes(f"{r.experiment}/{r.run_id}/{JOB_FILE}"))["job_name"] for r in runs}


# --- entities round-trip through the SDK's own YAML loaders -----------------------------------


def test_job_yaml_roundtrip(backend, runs, tmp_path):
    code = build_code_snapshot(runs, tmp_path / "code")
    job = backend.build_job(runs[0], "azureml:nbbatch-toy:abc", code, datastore=DATASTORE,
                            share_url=SHARE_URL, share_prefix="nbbatch")
    assert isinstance(job, Command)
    text = job_yaml(job)
    loaded = load_job(source=io.StringIO(text))
    assert loaded._to_job()._to_dict() == job._to_job()._to_dict()
    assert loaded.display_name == "toy-000000" and loaded.experiment_name == "cifar"
    assert loaded.compute == "gpu-a100" and str(loaded.environment).endswith("nbbatch-toy:abc")
    assert loaded.tags["run_id"] == "toy-000000" and loaded.tags["framework"] == "toy"
    assert json.loads(loaded.tags["parameters"]) == {"EPOCHS": 1, "LR": 0.1}
    share_out = loaded.outputs["share"]
    assert share_out.mode == "rw_mount" and share_out.type == "uri_folder"
    assert share_out.path == f"azureml://datastores/{DATASTORE}/paths/nbbatch/"
    assert loaded.command.startswith(f"{DEFAULT_LAUNCHER} run-one '{{")  # the launch JSON, its run in the code
    launch = _launch_in(loaded.command, code)
    assert launch.share == "${{outputs.share}}" and launch.backend == "azureml" and launch.gpus == (0,)
    assert str(tmp_path) not in loaded.command  # the spec names notebooks by their project-relative path
    assert launch.run == Run.from_dict({**runs[0].to_dict(), "notebook": "notebooks/Toy.ipynb",
                                        "tracking": "none"})  # Azure ML tracks only when asked
    assert job.name.startswith("toy-000000-")


def test_every_job_sets_the_mount_settings_nbbatch_relies_on(backend, runs, tmp_path):
    """The data runtime caches a file's attributes for ever and gives unmount 30 s to flush by default: the job would
    never see a cancel marker, and a large output written at the end could be dropped (docs/azure.md)."""
    loaded = load_job(source=io.StringIO(job_yaml(backend.build_job(runs[0], "azureml:e:1", tmp_path,
                                                                     datastore=DATASTORE, share_url=SHARE_URL))))
    env = loaded.environment_variables
    assert 0 < int(env["DATASET_MOUNT_ATTRIBUTE_CACHE_TTL"]) <= 10_000  # milliseconds: markers seen within seconds
    assert int(env["DATASET_UNMOUNT_TIMEOUT_SECONDS"]) >= 600
    assert env["NBBATCH_LOG_ECHO"] == "1"  # the run's log in the job's own stream, which `logs -f` follows
    with_identity = AzureMLBackend(ml_client=backend.ml_client, identity_client_id="0000-id").build_job(
        runs[0], "azureml:e:1", tmp_path, datastore=DATASTORE, share_url=SHARE_URL).environment_variables
    assert with_identity["AZURE_CLIENT_ID"] == "0000-id" and "DATASET_MOUNT_ATTRIBUTE_CACHE_TTL" in with_identity


def test_direct_share_mode_passes_the_url(aml, runs, tmp_path):
    backend = AzureMLBackend(ml_client=aml.ml_client(), share_mode="direct")
    job = backend.build_job(runs[0], "azureml:e:1", tmp_path, datastore=DATASTORE, share_url=SHARE_URL)
    assert _launch_in(job.command).share == SHARE_URL and not job.outputs


def test_compute_yaml_roundtrip():
    compute = ClusterSettings("gpu-t4", "Standard_NC4as_T4_v3", 0, 4, "low_priority", 900).to_compute()
    text = io.StringIO()
    compute.dump(text)
    loaded = load_compute(source=io.StringIO(text.getvalue()))
    assert loaded._to_dict() == compute._to_dict()
    assert (loaded.size, loaded.min_instances, loaded.max_instances, loaded.tier,
            loaded.idle_time_before_scale_down) == ("Standard_NC4as_T4_v3", 0, 4, "low_priority", 900)


def test_cluster_settings_validation():
    with pytest.raises(BackendError, match="tier"):
        ClusterSettings(tier="premium")
    with pytest.raises(BackendError, match="min_nodes"):
        ClusterSettings(min_nodes=3, max_nodes=2)
    assert ClusterSettings(tier="LowPriority").tier == "low_priority"


def test_environment_yaml_roundtrip(azproject):
    framework = get_framework("toy", Project(azproject))
    env = framework_environment(framework, azproject / "dockerfiles")
    assert (env.name, env.version) == ("nbbatch-toy", _image_version(azproject))
    text = io.StringIO()
    env.dump(text)
    loaded = load_environment(source=io.StringIO(text.getvalue()))
    assert loaded._to_dict() == env._to_dict()
    assert loaded.build.dockerfile_path == "Dockerfile"
    (azproject / "frameworks/toy/requirements.txt").write_text("numpy==2.4.7\n")
    changed = get_framework("toy", Project(azproject))
    assert framework_environment(changed, azproject / "dockerfiles").version != env.version


def test_missing_dockerfile_is_reported_before_submitting(aml, azproject, runs):
    (azproject / "dockerfiles/Dockerfile").unlink()
    backend = AzureMLBackend(ml_client=aml.ml_client())
    with pytest.raises(BackendError, match="no Dockerfile for framework `toy`"):
        backend.check(runs)
    assert not aml.transport.calls
    AzureMLBackend(ml_client=aml.ml_client(), environments={"toy": "azureml:pytorch:3"}).check(runs)


def test_status_mapping():
    expect = {
        "NotStarted": "queued", "Queued": "queued", "Preparing": "queued", "Provisioning": "queued",
        "Starting": "queued", "Running": "running", "Finalizing": "running", "Completed": "succeeded",
        "Failed": "failed", "Canceled": "cancelled", "CancelRequested": "running", "NotResponding": "running",
        "Paused": "running",
    }
    for state, status in expect.items():
        assert map_job_status(state)[0] == status, state
    assert map_job_status("NotResponding")[1] and map_job_status("Paused")[1]
    assert map_job_status("Running")[1] is None
    assert map_job_status("CANCEL_REQUESTED")[0] == "running"  # the job may still finish (issue 28)
    assert map_job_status("Bogus") == ("queued", "unknown Azure ML job status 'Bogus'")


def test_registry_and_settings(aml):
    backend = get_backend("azureml", ml_client=aml.ml_client(), compute="gpu", max_nodes=5)
    assert isinstance(backend, AzureMLBackend) and backend.cluster_settings.max_nodes == 5
    with pytest.raises(BackendError, match="did you mean `vm_size`"):
        get_backend("azureml", vm_sise="Standard_NC4as_T4_v3")


# --- the control plane through the real MLClient ------------------------------------------


def test_cluster_lifecycle(aml):
    cluster = AzureMLCluster(aml.ml_client(), ClusterSettings("gpu-t4", "Standard_NC4as_T4_v3", 0, 2, "dedicated"))
    assert not cluster.status().exists
    status = cluster.create()
    assert status.exists and status.vm_size == "Standard_NC4as_T4_v3" and status.max_nodes == 2
    body = aml.computes["gpu-t4"]["properties"]
    assert body["computeType"] == "AmlCompute" and body["properties"]["vmPriority"] == "Dedicated"
    assert body["properties"]["scaleSettings"]["nodeIdleTimeBeforeScaleDown"] == "PT30M"
    aml.nodes["gpu-t4"] = [
        {"nodeId": "tvm-1", "privateIpAddress": "10.0.0.4", "port": 50000, "nodeState": "running", "runId": "job-a"},
        {"nodeId": "tvm-2", "privateIpAddress": "10.0.0.5", "port": 50001, "nodeState": "idle"},
        {"nodeId": "tvm-3", "privateIpAddress": "10.0.0.6", "port": 50002, "nodeState": "preparing"},
    ]
    aml.compute_errors = [{"error": {"code": "QuotaExceeded", "message": "NCasT4_v3 family quota is 0 cores"}}]
    status = cluster.status()
    assert status.nodes_by_state["running"] == 1 and status.nodes_by_state["idle"] == 1
    assert {n["name"]: n["job"] for n in status.nodes}["tvm-1"] == "job-a"
    assert any("QuotaExceeded" in e for e in status.errors)
    assert "QuotaExceeded" in status.summary() and "tvm-1: running running job-a" in status.summary()
    status = cluster.scale(max_nodes=6)
    assert status.max_nodes == 6 and aml.computes["gpu-t4"]["properties"]["properties"]["scaleSettings"][
        "maxNodeCount"] == 6
    with pytest.raises(BackendError):
        cluster.scale(min_nodes=7)
    assert cluster.create().max_nodes == 6  # an existing cluster is kept as it is
    assert cluster.delete() and "gpu-t4" not in aml.computes
    assert not cluster.delete()
    assert not aml.transport.unmatched


def test_cli_cluster(aml, capsys, write_experiment):
    client = aml.ml_client()
    exp = write_experiment("experiment: e\nnotebooks: [nb.ipynb]\nbackend:\n  name: azureml\n  compute: from-spec\n"
                           "  vm_size: Standard_NC4as_T4_v3\n  max_nodes: 3\nshare: azfiles://acct/share\n")

    def ns(action, **kw):
        return argparse.Namespace(action=action, experiment=str(exp), **kw)

    assert cli_cluster(ns("create", no_wait=False), ml_client=client) == 0
    assert "cluster from-spec: Standard_NC4as_T4_v3 × 0–3 nodes" in capsys.readouterr().out
    assert cli_cluster(ns("scale", min_nodes=None, max_nodes=5), ml_client=client) == 0
    assert cli_cluster(ns("status", json=True), ml_client=client) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 2)[-1])["max_nodes"] == 5
    with pytest.raises(BackendError, match="--max-nodes"):
        cli_cluster(ns("scale", min_nodes=None, max_nodes=None), ml_client=client)
    assert cli_cluster(ns("delete"), ml_client=client) == 0
    assert "deleted" in capsys.readouterr().out


def _cluster_parser() -> argparse.ArgumentParser:
    """The real `nbbatch` parser: its `cluster` subcommand feeds cli_cluster."""
    from nbbatch.ui.cli import build_parser

    return build_parser()


def test_cluster_cli_arguments(aml, capsys):
    client = aml.ml_client()
    parse = _cluster_parser().parse_args
    assert cli_cluster(parse(["cluster", "create", "--name", "gpu-t4", "--vm-size", "Standard_NC4as_T4_v3",
                              "--max-nodes", "2", "--tier", "low_priority", "--idle-seconds", "300"]),
                       ml_client=client) == 0
    props = aml.computes["gpu-t4"]["properties"]["properties"]
    assert props["vmPriority"] == "LowPriority" and props["scaleSettings"]["nodeIdleTimeBeforeScaleDown"] == "PT5M"
    assert cli_cluster(parse(["cluster", "scale", "--name", "gpu-t4", "--min-nodes", "1"]), ml_client=client) == 0
    assert aml.computes["gpu-t4"]["properties"]["properties"]["scaleSettings"]["minNodeCount"] == 1
    assert cli_cluster(parse(["cluster", "status", "--name", "gpu-t4", "--json"]), ml_client=client) == 0
    assert cli_cluster(parse(["cluster", "delete", "--name", "gpu-t4", "--no-wait"]), ml_client=client) == 0
    out = capsys.readouterr().out
    assert "cluster gpu-t4: Standard_NC4as_T4_v3" in out and "deleted" in out
    assert "gpu-t4" not in aml.computes


def test_submit_statuses_cancel_resubmit(aml, backend, share, runs, files, env_upload, azproject):
    _queue(share, runs)
    updates = []
    _submit(backend, runs, share, _options(on_update=updates.append))
    # cluster created, datastore registered, environment built once, one job per run
    assert "gpu-a100" in aml.computes
    assert aml.computes["gpu-a100"]["properties"]["properties"]["vmPriority"] == "LowPriority"
    assert aml.datastores[DATASTORE]["properties"]["fileShareName"] == "results"
    assert list(aml.environments) == [("nbbatch-toy", backend._environment_refs["toy"].rsplit(":", 1)[1])]
    # The uploaded build context holds everything the Dockerfile copies (the first real build would fail otherwise).
    [uploaded] = env_upload
    assert {"Dockerfile", "frameworks/toy/framework.yaml", "frameworks/toy/requirements.txt", "context/uv",
            "context/nbbatch-requirements.txt", "src/nbbatch/ui/cli.py"} <= set(uploaded)
    staged_dockerfile = render((azproject / "dockerfiles/Dockerfile").read_text(), image_spec(
        get_framework("toy", Project(azproject)), azproject / "dockerfiles", run_as="root").args)
    for source in copy_sources(staged_dockerfile):
        assert source in uploaded or any(f.startswith(source.rstrip("/") + "/") for f in uploaded), source
    assert len(aml.jobs) == 3 and len(updates) == 3
    names = _job_names(share, runs)
    for run in runs:
        job = aml.jobs[names[run.run_id]]["properties"]
        assert job["displayName"] == run.run_id and job["experimentName"] == "cifar"
        assert job["computeId"].endswith("/computes/gpu-a100")
        assert job["environmentId"].endswith("/environments/nbbatch-toy/versions/" + backend._environment_refs[
            "toy"].rsplit(":", 1)[1])
        assert job["outputs"]["share"]["uri"] == f"azureml://datastores/{DATASTORE}/paths/nbbatch/"
        assert job["outputs"]["share"]["mode"] == "ReadWriteMount"
        assert job["tags"]["run_id"] == run.run_id
        assert read_record(share, "cifar", run.run_id).status == "queued"
    assert len(set(aml.code_hashes)) == 1  # one snapshot, reused by every job
    a, b, c = (names[r.run_id] for r in runs)

    aml.set_job_status(a, "Running")
    aml.set_job_status(b, "Preparing")
    aml.set_job_status(c, "NotResponding")
    backend.refresh("cifar", share)
    records = {r.run_id: read_record(share, "cifar", r.run_id) for r in runs}
    assert [records[r.run_id].status for r in runs] == ["running", "queued", "running"]
    state_c = backend.job_state(share, "cifar", runs[2].run_id)
    assert state_c.job_status == "NotResponding" and "not responding" in state_c.note

    # the executor writes its own final record; a job that ends without one is mapped from the job state
    done = read_record(share, "cifar", runs[0].run_id)
    done.status, done.metrics = "succeeded", {"accuracy": 0.5}
    share.write_bytes(run_paths("cifar", done.run_id).notebook, b"{}")  # its executed notebook, as run-one writes it
    write_record(share, done)
    aml.set_job_status(a, "Completed")
    aml.set_job_status(c, "Failed")
    backend.refresh("cifar", share)
    assert read_record(share, "cifar", runs[0].run_id).metrics == {"accuracy": 0.5}
    failed = read_record(share, "cifar", runs[2].run_id)
    assert failed.status == "failed" and failed.error.ename == "AzureMLJobFailed" and c in failed.error.evalue

    assert backend.cancel("cifar", share) == [runs[1].run_id]  # only the unfinished one
    assert aml.cancelled == [b]
    assert read_record(share, "cifar", runs[1].run_id).status == "cancelled"
    assert share.exists(run_paths("cifar", runs[1].run_id).cancel)

    # resubmitting skips the succeeded run and reuses cluster, datastore and environment
    before = set(aml.jobs)
    puts_before = [c.path for c in aml.transport.calls if c.method == "PUT"]
    _submit(backend, runs, share, _options())
    new_jobs = set(aml.jobs) - before
    assert len(new_jobs) == 2
    assert {aml.jobs[j]["properties"]["displayName"] for j in new_jobs} == {runs[1].run_id, runs[2].run_id}
    puts = [c.path for c in aml.transport.calls if c.method == "PUT"][len(puts_before):]
    assert all("/jobs/" in p for p in puts), puts  # nothing but the two jobs was created again
    assert len(env_upload) == 1

    # a run whose job is still in flight is not submitted twice
    _submit(backend, [runs[1]], share, _options())
    assert len(aml.jobs) == 5

    cluster = backend.cluster
    assert cluster.delete() and "gpu-a100" not in aml.computes
    assert not aml.transport.unmatched, [c.path for c in aml.transport.unmatched]


def _existing_environment(aml, azproject) -> str:
    version = _image_version(azproject)
    aml.environments[("nbbatch-toy", version)] = {
        "id": f"{aml.ws_path}/environments/nbbatch-toy/versions/{version}",
        "name": version, "properties": {"image": "myacr.azurecr.io/nbbatch-toy:1"}}
    return version


def test_submit_and_wait(aml, backend, share, runs, files, env_upload, azproject):
    _existing_environment(aml, azproject)
    run = runs[0]
    _queue(share, [run])
    original_create = backend.ml_client.jobs.create_or_update

    def create(job):
        created = original_create(job)
        aml.job_scripts[created.name] = ["Queued", "Preparing", "Running", "Running", "Completed"]
        return created

    backend.ml_client.jobs.create_or_update = create
    seen = []
    _submit(backend, [run], share, _options(wait=True, on_update=lambda r: seen.append(r.status)))
    assert seen[0] == "queued" and seen[-1] == "succeeded" and "running" in seen
    assert read_record(share, "cifar", run.run_id).status == "succeeded"
    assert env_upload == []  # the environment existed: reused, not rebuilt
    assert not aml.transport.unmatched


MAX_ARG_STRLEN = 128 * 1024  # Linux's bound on one argument of a command (32 pages)


def test_a_run_spec_over_128_kib_reaches_its_job_in_the_code_not_the_command(aml, backend, share, runs, files,
                                                                               env_upload, azproject):
    """Each run's parameters go in a file of the job's code snapshot: its command stays short whatever they hold, and
    all the runs' files are in one snapshot, uploaded once."""
    _existing_environment(aml, azproject)
    big = [dataclasses.replace(r, parameters={**r.parameters, "LABELS": [f"label-{i}-{n}" for n in range(20_000)]})
           for i, r in enumerate(runs)]
    assert all(len(json.dumps(r.to_dict())) > MAX_ARG_STRLEN for r in big)
    _queue(share, big)
    original_create = backend.ml_client.jobs.create_or_update
    received = {}

    def create(job):  # what run-one reads where the job starts: its command, in the code snapshot
        received[job.display_name] = _launch_in(job.command, Path(job.code))
        return original_create(job)

    backend.ml_client.jobs.create_or_update = create
    _submit(backend, big, share, _options())
    for run in big:
        body = aml.jobs[_job_names(share, [run])[run.run_id]]["properties"]
        assert len(body["command"].encode()) < 4096, "the command carries the launch, not the run"
        assert received[run.run_id].run.parameters == run.parameters
    assert len(set(aml.code_hashes)) == 1, "one snapshot for every run's job"


def test_share_must_be_azure_files(aml, runs, tmp_path):
    from nbbatch.store.share import FileShare

    backend = AzureMLBackend(ml_client=aml.ml_client())
    with pytest.raises(BackendError, match="azfiles://"):
        _submit(backend, runs, FileShare(tmp_path), _options())


def test_missing_datastore_without_key_says_how(aml, runs, files, monkeypatch, share):
    monkeypatch.delenv("AZURE_STORAGE_KEY")
    backend = AzureMLBackend(ml_client=aml.ml_client(), poll_seconds=0)
    _queue(share, runs)  # the share object was opened with the key; the backend no longer sees it
    with pytest.raises(BackendError, match="az ml datastore create") as refused:
        _submit(backend, runs, share, _options())
    assert not aml.jobs
    text = str(refused.value)  # Azure File datastores take a key or a SAS only: keyless users go `direct`
    assert "no credentials" not in text and "identity-based access" not in text
    assert "credentials.account_key or credentials.sas_token" in text and "set `share_mode: direct` under `backend:`" in text


def test_an_azure_file_datastore_without_credentials_is_refused(aml, monkeypatch):
    """Issue 50 item 2: Azure ML mounts an Azure File datastore with an account key or SAS only."""
    from nbbatch.backends.azureml import ensure_datastore

    monkeypatch.delenv("AZURE_STORAGE_KEY", raising=False)
    aml.datastores[DATASTORE] = {
        "id": f"{aml.ws_path}/datastores/{DATASTORE}", "name": DATASTORE,
        "type": "Microsoft.MachineLearningServices/workspaces/datastores",
        "properties": {"datastoreType": "AzureFile", "accountName": ACCOUNT, "fileShareName": "results",
                       "endpoint": "core.windows.net", "protocol": "https", "credentials": {"credentialsType": "None"}}}
    with pytest.raises(BackendError, match=rf"datastore `{DATASTORE}` \({ACCOUNT}/results\) has no account key or SAS "
                                           r"token.*every job would fail to mount it.*set `share_mode: direct`"):
        ensure_datastore(aml.ml_client(), DATASTORE, ACCOUNT, "results")
    aml.datastores[DATASTORE]["properties"]["credentials"] = {"credentialsType": "AccountKey"}
    ensure_datastore(aml.ml_client(), DATASTORE, ACCOUNT, "results")  # one with a key is used as it is


def test_stream_log_follows_the_job(aml, backend, share, runs, files, env_upload, monkeypatch):
    import azure.ai.ml.operations._job_ops_helper as helper

    monkeypatch.setattr(helper, "_wait_before_polling", lambda seconds: 0)
    _queue(share, runs[:1])
    _submit(backend, runs[:1], share, _options())
    (name,) = aml.jobs
    aml.set_job_status(name, "Completed")
    aml.run_history[name] = [
        ("Running", {}),
        ("Running", {"user_logs/std_log.txt": "epoch 1 loss 2.3\n"}),
        ("Completed", {"user_logs/std_log.txt": "epoch 1 loss 2.3\nepoch 2 loss 1.9\n"}),
    ]
    assert backend.stream_log("cifar", share, runs[0].run_id, follow=False) is None
    lines = list(backend.stream_log("cifar", share, runs[0].run_id, follow=True))
    text = "".join(lines)
    assert f"RunId: {name}" in text and "epoch 1 loss 2.3" in text and "epoch 2 loss 1.9" in text
    assert "Execution Summary" in text
    assert backend.stream_log("cifar", share, "never-submitted", follow=True) is None


def test_compute_reports_nodes(aml, backend):
    backend.cluster.create()
    aml.nodes["gpu-a100"] = [{"nodeId": "n1", "nodeState": "running"}, {"nodeId": "n2", "nodeState": "idle"}]
    compute = backend.compute()
    assert compute.backend == "azureml" and compute.slots == 3
    assert [(n["name"], n["state"]) for n in compute.nodes] == [("n1", "running"), ("n2", "idle")]
    assert "Standard_NC24ads_A100_v4" in compute.details["summary"]


def test_code_snapshot(runs, azproject, tmp_path):
    code = build_code_snapshot(runs, tmp_path / "code")
    assert (code / "src/nbbatch/ui/cli.py").is_file() and (code / "src/nbbatch/backends/azureml/backend.py").is_file()
    assert (code / "notebooks/Toy.ipynb").read_bytes() == (azproject / "notebooks/Toy.ipynb").read_bytes()
    assert (code / "frameworks/toy/framework.yaml").is_file()
    assert not list(code.rglob("__pycache__"))


# --- secrets ----------------------------------------------------------------------------------


def test_storage_key_never_leaves_the_environment(aml, backend, share, runs, files, env_upload, tmp_path):
    """The planted key signs requests (HMAC) but is written nowhere: not in files, job specs or their YAML."""
    _queue(share, runs)
    _submit(backend, runs, share, _options())
    names = _job_names(share, runs)
    aml.set_job_status(names[runs[0].run_id], "Failed")
    backend.refresh("cifar", share)
    backend.cancel("cifar", share)
    stored = b"".join(files.file_bytes("results", n) for n in files.file_names("results"))
    assert stored and FAKE_KEY.encode() not in stored
    for request in files.requests:  # the key is never sent, only signatures made with it
        assert FAKE_KEY.encode() not in request.body and FAKE_KEY not in json.dumps(request.headers)
    for call in aml.transport.calls:
        if "/datastores/" in call.path and call.method == "PUT":
            continue  # registering the datastore hands the key to the workspace's key vault, by design
        assert FAKE_KEY.encode() not in call.body, call.path
    for job in aml.jobs.values():
        assert FAKE_KEY not in json.dumps(job)
    code = build_code_snapshot(runs, tmp_path / "code")
    dumped = job_yaml(backend.build_job(runs[0], "azureml:e:1", code, datastore=DATASTORE, share_url=SHARE_URL))
    assert "run-one" in dumped and FAKE_KEY not in dumped
    assert not any(FAKE_KEY.encode() in p.read_bytes() for p in code.rglob("*") if p.is_file())


def test_secret_looking_env_is_refused(backend, runs, tmp_path):
    import dataclasses

    leaky = dataclasses.replace(runs[0], env={"WANDB_API_KEY": "abc", "KERAS_BACKEND": "jax"})
    with pytest.raises(BackendError, match="WANDB_API_KEY"):
        backend.build_job(leaky, "azureml:e:1", tmp_path, datastore=DATASTORE, share_url=SHARE_URL)
    assert not (tmp_path / "nbbatch-runs").exists(), "a refused run leaves nothing in the code to upload"
    fine = dataclasses.replace(runs[0], env={"KERAS_BACKEND": "jax"})
    job = backend.build_job(fine, "azureml:e:1", tmp_path, datastore=DATASTORE, share_url=SHARE_URL)
    assert _launch_in(job.command, tmp_path).run.env == {"KERAS_BACKEND": "jax"}


def test_secret_looking_values_are_refused(backend, runs, tmp_path):
    import dataclasses

    by_value = dataclasses.replace(runs[0], env={"DATABASE_URL": "postgres://u:pw@h/db"})
    with pytest.raises(BackendError, match="DATABASE_URL") as caught:
        backend.build_job(by_value, "azureml:e:1", tmp_path, datastore=DATASTORE, share_url=SHARE_URL)
    assert "pw@" not in str(caught.value)
    in_parameters = dataclasses.replace(runs[0], parameters={"INDEX": "https://__token__:abc@host/simple"})
    with pytest.raises(BackendError, match="`INDEX` in its parameters"):
        backend.build_job(in_parameters, "azureml:e:1", tmp_path, datastore=DATASTORE, share_url=SHARE_URL)


def test_a_binding_in_a_parameter_stays_text(backend, runs, tmp_path):
    """``${{…}}`` in a parameter reaches the notebook as written, never as an Azure ML binding of the command."""
    import dataclasses

    text = "costs ${{inputs.price}} in ${{outputs.share}}"
    run = dataclasses.replace(runs[0], parameters={"EPOCHS": 1, "NOTE": text}, env={"LABEL": "${{name}}"})
    code = build_code_snapshot([run], tmp_path / "code")
    job = backend.build_job(run, "azureml:nbbatch-toy:abc", code, datastore=DATASTORE, share_url=SHARE_URL,
                            share_prefix="nbbatch")
    assert job.command.count("${{") == 1 and '"share":"${{outputs.share}}"' in job.command  # the share's own binding
    loaded = load_job(source=io.StringIO(job_yaml(job)))
    spec = _launch_in(loaded.command, code).run
    assert spec.parameters["NOTE"] == text and spec.env == {"LABEL": "${{name}}"}


def test_a_create_that_times_out_is_found_on_resubmit(aml, backend, share, runs, files, env_upload, azproject):
    """Azure ML created the job but the answer never came: submitting again finds that job, makes no second one."""
    from azure.core.exceptions import ServiceRequestError, ServiceResponseError

    _existing_environment(aml, azproject)
    run = runs[0]
    _queue(share, [run])
    original_create = backend.ml_client.jobs.create_or_update

    def created_then_timed_out(job):
        original_create(job)
        raise ServiceResponseError("The read operation timed out")

    backend.ml_client.jobs.create_or_update = created_then_timed_out
    with pytest.raises(BackendError, match="may have been created"):
        _submit(backend, [run], share, _options())
    assert len(aml.jobs) == 1
    backend.ml_client.jobs.create_or_update = original_create
    outcome = _submit(backend, [run], share, _options())
    assert outcome.in_flight == [run.run_id] and len(aml.jobs) == 1, "a second job was created"
    assert _job_names(share, [run])[run.run_id] in aml.jobs

    # a create that failed before Azure ML made the job: the next submission creates one
    other = runs[1]
    _queue(share, [other])

    def never_created(job):
        raise ServiceRequestError("connection refused")

    backend.ml_client.jobs.create_or_update = never_created
    with pytest.raises(BackendError):
        _submit(backend, [other], share, _options())
    backend.ml_client.jobs.create_or_update = original_create
    outcome = _submit(backend, [other], share, _options())
    assert outcome.started == [other.run_id] and len(aml.jobs) == 2
    assert not aml.transport.unmatched


def test_environment_is_reused_when_it_exists(aml, backend, azproject):
    from nbbatch.backends.azureml import ensure_environment

    framework = get_framework("toy", Project(azproject))
    _existing_environment(aml, azproject)

    env = ensure_environment(backend.ml_client, framework, azproject / "dockerfiles")
    assert isinstance(env, Environment) and env.version == _image_version(azproject)
    assert not [c for c in aml.transport.calls if c.method == "PUT"]


def test_through_nbbatch_submit(aml, files, azproject, write_experiment, env_upload, monkeypatch):
    """nbbatch.api.submit with `backend: azureml` + `share: azfiles://…`: the two lines that change."""
    import nbbatch.backends as backends
    from nbbatch.api import submit

    monkeypatch.setitem(backends._REGISTRY, "azureml",
                        lambda **settings: AzureMLBackend(ml_client=aml.ml_client(), **settings))
    exp = write_experiment("experiment: viaapi\nframeworks: [toy]\nsweep: {grid: {LR: [0.1, 0.2]}}\n"
                           "resources: {gpus: 1}\n"
                           "backend: {name: azureml, compute: gpu-t4, max_nodes: 2, poll_seconds: 0}\n"
                           f"share: {SHARE_URL}\n")
    result = submit(exp, progress=False, wait=False)
    assert len(result.started) == 2 and len(aml.jobs) == 2
    assert {r.status for r in result.records} == {"queued"}
    assert {j["properties"]["displayName"] for j in aml.jobs.values()} == set(result.started)
    for job in aml.jobs.values():
        assert _launch_in(job["properties"]["command"]).gpus == (0,)
    share = AzureFileShare(SHARE_URL)
    for name in aml.jobs:  # the executor would write the final records; here the jobs just complete
        aml.set_job_status(name, "Completed")
        share.write_bytes(run_paths("viaapi", aml.jobs[name]["properties"]["displayName"]).notebook, b"{}")
    again = submit(exp, progress=False, wait=False)  # refreshes first: both succeeded, nothing resubmitted
    assert again.skipped == result.started and not again.started and len(aml.jobs) == 2
    assert {read_record(share, "viaapi", r).status for r in result.started} == {"succeeded"}


# --- inputs: share folders mounted read-only, bound to notebook parameters ------------------------------


def test_inputs_are_read_only_mounts_bound_to_their_parameters(backend, runs, tmp_path):
    run = dataclasses.replace(runs[0], inputs={"DATA_DIR": f"azfiles://{ACCOUNT}/results/data/cifar",
                                               "EXTRA": f"azfiles://{ACCOUNT}/other"})
    job = backend.build_job(run, "azureml:nbbatch-toy:abc", tmp_path, datastore=DATASTORE, share_url=SHARE_URL,
                            share_prefix="nbbatch")
    loaded = load_job(source=io.StringIO(job_yaml(job)))
    assert loaded._to_job()._to_dict() == job._to_job()._to_dict()
    data, extra = loaded.inputs["DATA_DIR"], loaded.inputs["EXTRA"]
    assert (data.type, data.mode, data.path) == ("uri_folder", "ro_mount",
                                                 f"azureml://datastores/{DATASTORE}/paths/data/cifar/")
    assert (extra.type, extra.mode) == ("uri_folder", "ro_mount")
    # another share: its own datastore; its root is `paths/./` (the SDK's parser refuses an empty path)
    assert extra.path == f"azureml://datastores/nbbatch_{ACCOUNT}_other/paths/./"
    assert _launch_in(loaded.command).inputs == {"DATA_DIR": "${{inputs.DATA_DIR}}", "EXTRA": "${{inputs.EXTRA}}"}
    assert '"DATA_DIR":"${{inputs.DATA_DIR}}"' in loaded.command  # a binding Azure ML replaces with the mount


def test_a_local_input_is_refused_with_the_push_command(backend, runs, azproject):
    run = dataclasses.replace(runs[0], inputs={"DATA_DIR": str(azproject / "data")})
    with pytest.raises(ValidationError, match=r"input `DATA_DIR` is .*a folder on this machine.*nbbatch data push"):
        backend.check([run], _options())


def test_submit_mounts_a_pushed_input_and_refuses_a_missing_one(aml, files, azproject, write_experiment, env_upload,
                                                                monkeypatch):
    import nbbatch.backends as backends
    from nbbatch.api import submit
    from nbbatch.store.sync import push

    monkeypatch.setitem(backends._REGISTRY, "azureml",
                        lambda **settings: AzureMLBackend(ml_client=aml.ml_client(), **settings))
    make_notebook(azproject / "notebooks" / "Toy.ipynb", ["print(DATA_DIR)"], parameters="EPOCHS = 1\nDATA_DIR = 'd'")
    data_url = f"azfiles://{ACCOUNT}/datasets/cifar"
    exp = write_experiment("experiment: withdata\nframeworks: [toy]\n"
                           f"inputs: {{DATA_DIR: '{data_url}'}}\n"
                           "backend: {name: azureml, compute: gpu-t4, poll_seconds: 0}\n"
                           f"share: {SHARE_URL}\n")
    with pytest.raises(ValidationError, match=f"input `DATA_DIR`: nothing at {data_url}.*nbbatch data push"):
        submit(exp, progress=False, wait=False)
    assert not aml.jobs
    (azproject / "data").mkdir()
    (azproject / "data" / "batch_1").write_bytes(b"\x00" * 1000)
    push(azproject / "data", AzureFileShare(data_url))
    result = submit(exp, progress=False, wait=False)
    (job,) = aml.jobs.values()
    assert job["properties"]["inputs"]["DATA_DIR"]["uri"] == f"azureml://datastores/nbbatch_{ACCOUNT}_datasets/paths/cifar/"
    assert job["properties"]["inputs"]["DATA_DIR"]["mode"] == "ReadOnlyMount"
    assert f"nbbatch_{ACCOUNT}_datasets" in aml.datastores  # the input's share got its datastore
    assert result.started == [job["properties"]["displayName"]]


# --- distributed runs: one job over several nodes, one nbbatch node launcher per node (or per MPI rank) ----------

WORLDS = {  # distribution.type -> (Run.distribution, the SDK class, its counts)
    "torch": ({"type": "torch", "nodes": 2, "processes_per_node": 4, "gpus_per_node": 4},
              "PyTorchDistribution", {"process_count_per_instance": 1}),
    "jax": ({"type": "jax", "nodes": 2, "processes_per_node": 1, "gpus_per_node": 4},
            "PyTorchDistribution", {"process_count_per_instance": 1}),
    "tensorflow": ({"type": "tensorflow", "nodes": 2, "processes_per_node": 1, "gpus_per_node": 4},
                   "TensorFlowDistribution", {"worker_count": 2, "parameter_server_count": 0}),
    "mpi": ({"type": "mpi", "nodes": 2, "processes_per_node": 4, "gpus_per_node": 4},
            "MpiDistribution", {"process_count_per_instance": 4}),
}


@pytest.mark.parametrize("kind", sorted(WORLDS))
def test_distributed_job_yaml_roundtrip(aml, runs, tmp_path, kind):
    world, cls, counts = WORLDS[kind]
    backend = AzureMLBackend(ml_client=aml.ml_client(), compute="gpu-a100", shm_size="16g")
    run = dataclasses.replace(runs[0], distribution=Distribution(**world), gpus=4)
    job = backend.build_job(run, "azureml:nbbatch-toy:abc", tmp_path, datastore=DATASTORE, share_url=SHARE_URL,
                            share_prefix="nbbatch")
    loaded = load_job(source=io.StringIO(job_yaml(job)))
    assert loaded._to_job()._to_dict() == job._to_job()._to_dict()
    assert type(loaded.distribution).__name__ == cls
    assert {k: getattr(loaded.distribution, k) for k in counts} == counts
    assert loaded.resources.instance_count == 2 and loaded.resources.shm_size == "16g"
    launch = _launch_in(loaded.command, tmp_path)
    assert launch.gpus == (0, 1, 2, 3)  # the GPUs of each node
    assert launch.run.distribution.to_dict() == world  # the node launcher reads its gang from the run itself
    assert json.loads(loaded.tags["distribution"]) == world


def test_an_ordinary_run_has_no_distribution(aml, runs, tmp_path):
    backend = AzureMLBackend(ml_client=aml.ml_client(), shm_size="16g")
    loaded = load_job(source=io.StringIO(job_yaml(backend.build_job(
        runs[0], "azureml:e:1", tmp_path, datastore=DATASTORE, share_url=SHARE_URL))))
    assert loaded.distribution is None and "distribution" not in loaded.tags
    assert loaded.resources.instance_count == 1 and loaded.resources.shm_size == "16g"


def test_ordinary_runs_are_checked_offline(aml, backend, runs):
    backend.check(runs, _options())  # one GPU each: no question to Azure ML (`nbbatch plan` needs no login)
    assert not aml.transport.calls


@pytest.fixture
def distproject(azproject):
    (azproject / "frameworks/toy/framework.yaml").write_text(
        "title: Toy\nnotebook: notebooks/Toy.ipynb\ngpu: true\nbase_image: nvidia/cuda:12.8.1-base-ubuntu24.04\n"
        "distribution: [torch, jax, tensorflow, mpi]\nsystem_packages: [openmpi-bin]\n")  # mpi needs an MPI
    return azproject


def _azureml_via(aml, monkeypatch):
    import nbbatch.backends as backends

    monkeypatch.setitem(backends._REGISTRY, "azureml",
                        lambda **settings: AzureMLBackend(ml_client=aml.ml_client(), **settings))


def _dist_experiment(write_experiment, nodes: int, backend: str, gpus: int = 1, kind: str = "torch"):
    return write_experiment(f"experiment: dist\nframeworks: [toy]\n"
                            f"resources: {{nodes: {nodes}, gpus_per_node: {gpus}}}\ndistribution: {{type: {kind}}}\n"
                            f"backend: {{name: azureml, compute: gpu-t4, poll_seconds: 0, {backend}}}\n"
                            f"share: {SHARE_URL}\n")


def test_too_many_nodes_are_refused_before_anything_is_created(aml, files, distproject, write_experiment,
                                                               monkeypatch):
    from nbbatch.api import submit

    _azureml_via(aml, monkeypatch)
    exp = _dist_experiment(write_experiment, 3, "max_nodes: 2")
    with pytest.raises(ValidationError, match=r"spans 3 nodes .* scales to at most 2 .*set `max_nodes: 3` under "
                                              r"`backend:`.*Nothing was submitted"):
        submit(exp, progress=False, wait=False)
    assert not aml.jobs and not aml.computes and not aml.datastores
    assert not [c for c in aml.transport.calls if c.method != "GET"]
    assert not AzureFileShare(SHARE_URL).exists("dist")  # no record, no manifest

    # an existing cluster keeps its own node range: the settings cannot raise it, `nbbatch cluster scale` does
    AzureMLCluster(aml.ml_client(), ClusterSettings("gpu-t4", "Standard_NC4as_T4_v3", 0, 2)).create()
    exp = _dist_experiment(write_experiment, 3, "max_nodes: 4")
    with pytest.raises(ValidationError, match=r"cluster `gpu-t4` scales to at most 2 .*"
                                              r"`nbbatch cluster scale --name gpu-t4 --max-nodes 3`"):
        submit(exp, progress=False, wait=False)
    assert not aml.jobs


def test_more_gpus_per_node_than_the_vm_has_are_refused(aml, backend, runs):
    world = {"type": "torch", "nodes": 2, "processes_per_node": 4, "gpus_per_node": 4}
    wide = dataclasses.replace(runs[0], distribution=Distribution(**world), gpus=4)
    with pytest.raises(ValidationError, match=r"wants 4 GPU\(s\) per node \(resources.gpus_per_node: 4\).*"
                                              r"Standard_NC24ads_A100_v4 with 1; set `vm_size:` under `backend:` .*"
                                              r"Standard_NC24s_v3"):
        backend.check([wide], _options())
    two = dataclasses.replace(runs[0], gpus=2)  # an ordinary run's GPUs are checked the same way
    with pytest.raises(ValidationError, match=r"resources.gpus: 2"):
        backend.check([two], _options())
    assert not [c for c in aml.transport.calls if c.method != "GET"]
    big = AzureMLBackend(ml_client=aml.ml_client(), compute="gpu-a100", vm_size="Standard_NC96ads_A100_v4",
                         max_nodes=2)
    big.check([wide, two], _options())  # a node of four GPUs holds them
    backend.cluster.create()  # one GPU a node
    with pytest.raises(ValidationError, match=r"Standard_NC24ads_A100_v4 with 1; a cluster's VM size cannot change: "
                                              r"delete it \(`nbbatch cluster delete --name gpu-a100`\)"):
        big.check([wide], _options())  # the existing cluster's VM size counts, not the settings'


def test_a_distributed_run_is_one_job_over_its_nodes(aml, files, distproject, write_experiment, env_upload,
                                                     monkeypatch):
    from nbbatch.api import submit

    _azureml_via(aml, monkeypatch)
    exp = _dist_experiment(write_experiment, 2, "max_nodes: 2, shm_size: 8g")
    result = submit(exp, progress=False, wait=False)
    (job,) = aml.jobs.values()
    body = job["properties"]
    assert body["resources"]["instanceCount"] == 2 and body["resources"]["shmSize"] == "8g"
    assert body["distribution"] == {"distributionType": "PyTorch", "processCountPerInstance": 1}
    assert result.started == [body["displayName"]] and _launch_in(body["command"]).gpus == (0,)


def test_its_placement_hook_reads_azure_mls_node_variables():
    """run-one on a node of a gang asks the backend's hook (through the SDK-free reader nbbatch.backends.placement)."""
    from nbbatch.backends.placement import placement_reader
    from nbbatch.execute.placement import NodePlacement
    from nbbatch.spec.resources import Distribution

    run = Run(run_id="r-1", experiment="e", notebook="/nb.ipynb", notebook_rel="nb.ipynb", kernel="k",
              distribution=Distribution("torch", 2, 4, 4))
    environ = {"MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "6105", "NODE_RANK": "1"}
    assert AzureMLBackend.node_placement(run, environ) == NodePlacement(1, ("10.0.0.4:6105",))
    assert placement_reader("azureml")(run, environ) == AzureMLBackend.node_placement(run, environ)
    assert AzureMLBackend.node_placement(run, {}) is None


@pytest.mark.container
def test_an_image_missing_from_the_registry_is_refused_before_submitting(aml, runs, azproject, image_registry,
                                                                        podman_env):
    """With `registry:` the check asks the registry (with the engine here) for each framework's tag: missing, refused
    naming the push; there, accepted; a registry this machine cannot reach, a warning (the workspace may reach it)."""
    registry = f"{image_registry.address}/aml"
    with pytest.raises(BackendError, match=r"not in registry .*nbbatch images push .*nothing was submitted"):
        AzureMLBackend(ml_client=aml.ml_client(), compute="gpu-a100", registry=registry).check(runs)
    ref = f"{registry}/nbbatch-toy:{_image_version(azproject)}"
    podman("tag", BASE, ref)  # any image under the tag: the check reads the tag only
    try:
        podman("push", ref)
        AzureMLBackend(ml_client=aml.ml_client(), compute="gpu-a100", registry=registry).check(runs)
    finally:
        podman("rmi", ref, check=False)
    with pytest.warns(UserWarning, match=r"could not check that 127.0.0.1:9/aml/nbbatch-toy:.*not reachable"):
        AzureMLBackend(ml_client=aml.ml_client(), compute="gpu-a100", registry="127.0.0.1:9/aml").check(runs)


def test_registry_images_are_used_not_built(aml, share, runs, files, env_upload, azproject, monkeypatch):
    """`registry:` makes each framework's environment the image pushed there (`nbbatch images push`): nothing is
    uploaded or built by Azure ML."""
    monkeypatch.setattr("nbbatch.backends.azureml.backend.check_pushed", lambda *args: None)  # asks no registry
    backend = AzureMLBackend(ml_client=aml.ml_client(), compute="gpu-a100", poll_seconds=0,
                             registry="registry.example.com/team")
    _queue(share, runs)
    _submit(backend, runs, share, _options())
    version = _image_version(azproject)
    image = f"registry.example.com/team/nbbatch-toy:{version}"
    assert env_upload == []  # no build context went anywhere
    [(name, registered)] = aml.environments
    assert (name, registered) == ("nbbatch-toy", version)
    properties = aml.environments[(name, registered)]["properties"]
    assert properties["image"] == image and not properties.get("build")
    env = framework_environment(get_framework("toy", Project(azproject)), azproject / "dockerfiles",
                                registry="registry.example.com/team")
    text = io.StringIO()
    env.dump(text)
    assert load_environment(source=io.StringIO(text.getvalue())).image == image
    for job in aml.jobs.values():
        assert job["properties"]["environmentId"].endswith(f"/environments/nbbatch-toy/versions/{version}")
    with pytest.raises(ValidationError, match="has a scheme"):
        AzureMLBackend(ml_client=aml.ml_client(), registry="https://registry.example.com").check(runs)
    assert not aml.transport.unmatched


# --- issue 50 item 11: a user-assigned identity and sovereign clouds reach the job --------------------------------

CLIENT_ID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def test_a_user_assigned_identity_reaches_the_job_as_azure_client_id(aml, runs, tmp_path, monkeypatch):
    """`direct` mode with a user-assigned identity: DefaultAzureCredential in the job picks it by AZURE_CLIENT_ID."""
    monkeypatch.delenv("AZUREML_CURRENT_CLOUD", raising=False)
    backend = AzureMLBackend(ml_client=aml.ml_client(), share_mode="direct", identity_client_id=CLIENT_ID)
    job = backend.build_job(runs[0], "azureml:e:1", tmp_path, datastore="ds", share_url=SHARE_URL)
    loaded = load_job(source=io.StringIO(job_yaml(job)))
    assert loaded.environment_variables["AZURE_CLIENT_ID"] == CLIENT_ID
    plain = AzureMLBackend(ml_client=aml.ml_client(), share_mode="direct")
    monkeypatch.delenv("AZUREML_CURRENT_CLOUD", raising=False)  # MLClient sets it: a job gets only what was asked
    assert "AZURE_CLIENT_ID" not in (plain.build_job(runs[0], "azureml:e:1", tmp_path, datastore="ds",
                                                     share_url=SHARE_URL).environment_variables or {})
    with pytest.raises(ValidationError, match=r"`identity_client_id:` under `backend:` `my-identity` is not a valid "
                                              r"managed identity client id.*clientId"):
        AzureMLBackend(ml_client=aml.ml_client(), identity_client_id="my-identity").check(runs)


@pytest.mark.parametrize(("cloud", "suffix"), [("AzureCloud", "core.windows.net"),
                                               ("AzureChinaCloud", "core.chinacloudapi.cn"),
                                               ("AzureUSGovernment", "core.usgovcloudapi.net")])
def test_a_sovereign_cloud_gives_its_own_azure_files_endpoint(aml, runs, tmp_path, monkeypatch, cloud, suffix):
    from nbbatch.backends.azureml import ensure_datastore
    from nbbatch.store import azfiles_client

    monkeypatch.delenv("NBBATCH_AZFILES_ENDPOINT", raising=False)
    monkeypatch.setenv("AZUREML_CURRENT_CLOUD", cloud)  # what MLClient(cloud=…) sets
    assert azfiles_client.default_endpoint("acct") == f"https://acct.file.{suffix}"
    job = AzureMLBackend(ml_client=aml.ml_client(), share_mode="direct").build_job(
        runs[0], "azureml:e:1", tmp_path, datastore="ds", share_url=SHARE_URL)
    assert job.environment_variables["AZUREML_CURRENT_CLOUD"] == cloud  # the job opens the same cloud's endpoint
    monkeypatch.setenv("AZURE_STORAGE_KEY", "a2V5")
    monkeypatch.setattr("nbbatch.backends.azureml.images.check_account_key", lambda *args: None)
    ensure_datastore(aml.ml_client(), "nbbatch_acct_results", "acct", "results")
    assert aml.datastores["nbbatch_acct_results"]["properties"]["endpoint"] == suffix


def test_an_unknown_cloud_names_the_endpoint_variable(monkeypatch):
    from nbbatch.errors import ShareError
    from nbbatch.store.azfiles_client import default_endpoint

    monkeypatch.delenv("NBBATCH_AZFILES_ENDPOINT", raising=False)
    monkeypatch.setenv("AZUREML_CURRENT_CLOUD", "AzureGermanCloud")
    with pytest.raises(ShareError, match=r"`AzureGermanCloud`.*set NBBATCH_AZFILES_ENDPOINT"):
        default_endpoint("acct")
    monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", "https://{account}.file.core.cloudapi.de")
    assert default_endpoint("acct") == "https://acct.file.core.cloudapi.de"


@pytest.mark.parametrize(("message", "inner", "cause"), [
    ("The subscription has no quota for the NCASv3_T4 family.", "QuotaExceeded", "lacks quota for this VM family"),
    ("The requested VM size Standard_NC4as_T4_v3 is not available in westeurope.", "VmSizeNotSupported",
     "VM size is not offered"),
    ("The client does not have authorization to perform action computes/write.", "AuthorizationFailed",
     "may not create computes"),
    ("Subnet /subscriptions/…/subnets/ml is not found in the virtual network.", "InvalidSubnet", None),
])
def test_a_cluster_create_refusal_names_the_services_cause(aml, message, inner, cause):
    """Issue 50 item 11: not every refusal is VM size or quota: the service's answer, and advice only where it fits."""
    import re as regex

    from fakes.azureml_transport import service_error

    refusal = service_error(400, message, inner=inner)
    aml.transport.routes.insert(0, ("PUT", regex.compile(r".*/computes/[^/]+/?$"), lambda call: refusal))
    with pytest.raises(BackendError) as refused:
        AzureMLCluster(aml.ml_client(), ClusterSettings(compute="gpu-t4")).create()
    text = str(refused.value)
    assert f"cannot create cluster `gpu-t4` (Standard_NC4as_T4_v3), the service answered: (UserError) {message}" in text
    assert f"inner error: BadArgument/{inner}" in text
    if cause:
        assert cause in text.split("Likely cause: ", 1)[1]
    else:
        assert "Likely cause" not in text and "quota" not in text.lower()


def test_base_mirror_reaches_the_environment(aml, runs, azproject):
    from nbbatch.containers.registry import mirrored

    toy = get_framework("toy", Project(azproject))
    backend = AzureMLBackend(ml_client=aml.ml_client(), base_mirror="myacr.azurecr.io")
    expected = image_spec(toy, azproject / "dockerfiles", base=mirrored(toy.base_image, "myacr.azurecr.io") or None,
                          run_as="root")
    assert backend._environment_for(runs[0], register=False) == f"azureml:nbbatch-toy:{expected.fingerprint}"
    assert not [c for c in aml.transport.calls if c.method != "GET"]
