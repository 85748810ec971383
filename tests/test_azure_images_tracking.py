"""Issue 28, images and tracking: MPI in the images of frameworks that offer it, a Dockerfile that works from a
build context without file modes (Azure ML uploads it to blob storage), Azure ML's run token kept from kernels
unless tracking is asked for, and the live smoke driver's logic against the Azure ML fake."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from support.notebooks import make_notebook

from nbbatch.containers.images import image_spec, image_spec_args, instructions, stage_context
from nbbatch.errors import ValidationError
from nbbatch.execute.attempts import execute_run
from nbbatch.execute.context import AttemptContext
from nbbatch.execute.launch import LaunchSpec
from nbbatch.plan.runs import Run
from nbbatch.spec.frameworks import DISTRIBUTION_PACKAGES, list_frameworks
from nbbatch.spec.project import Project
from nbbatch.store.share import FileShare

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ROOT / "dockerfiles"
TEST_BASE = "localhost/nbbatch-test-base:bookworm"  # made by tests/test_containers_real.py (mmdebstrap), never pulled
MPI_PACKAGES = set(DISTRIBUTION_PACKAGES["mpi"])


@pytest.fixture(scope="module")
def frameworks():
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("NBBATCH_FRAMEWORKS_DIR", raising=False)
        return list_frameworks(Project(ROOT))


# --- 4: MPI in the images of the frameworks that offer it ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.parent.name for p in (ROOT / "frameworks").glob("*/framework.yaml")))
def test_a_frameworks_image_holds_mpi_iff_it_offers_mpi(frameworks, name):
    framework = frameworks[name]
    for gpu in (True, False):
        packages = set(image_spec_args(framework, gpu, None)["SYSTEM_PACKAGES"].split())
        assert bool(packages & MPI_PACKAGES) == ("mpi" in framework.distribution), (name, gpu, packages)
    spec = image_spec(framework, DOCKERFILES)  # and the filled-in Dockerfile installs them
    installs = " ".join(args for kw, args in instructions(spec.text) if kw == "RUN" and "apt-get install" in args)
    assert "${SYSTEM_PACKAGES}" in installs
    assert ("openmpi-bin" in spec.text) == ("mpi" in framework.distribution)


def _framework(tmp_path: Path, extra: str) -> Path:
    folder = tmp_path / "frameworks" / "toy"
    folder.mkdir(parents=True)
    (folder / "requirements.txt").write_text("numpy==2.4.6\n")
    (folder / "framework.yaml").write_text(f"notebook: nb.ipynb\n{extra}")
    return folder


def test_a_framework_offering_mpi_without_mpi_in_its_image_is_refused(tmp_path):
    _framework(tmp_path, "distribution: [torch, mpi]\nsystem_packages: [libgomp1]\n")
    with pytest.raises(ValidationError) as refused:
        list_frameworks(Project(tmp_path))
    message = str(refused.value)
    assert "offers `mpi`" in message and "openmpi-bin" in message and "system_packages" in message
    assert "Traceback" not in message


def test_a_framework_offering_mpi_with_an_mpi_package_loads(tmp_path):
    _framework(tmp_path, "distribution: [torch, mpi]\nsystem_packages: [openmpi-bin, openssh-client]\n")
    assert list_frameworks(Project(tmp_path))["toy"].distribution == ("torch", "mpi")


# --- 7: a build context without file modes --------------------------------------------------------------------


def _stand_in_uv(cache: Path) -> None:
    """A stand-in for uv's binary in the project cache (as uv_binary leaves it: 0755): no download."""
    uv = cache / "uv-0.13.8-x86_64" / "uv"
    uv.parent.mkdir(parents=True)
    uv.write_text("#!/bin/sh\necho 'uv 0.13.8 (stand-in)'\n")
    uv.chmod(0o755)


def _blob_round_trip(context: Path) -> None:
    """What blob storage keeps of a folder: the bytes, no modes (every file 0644)."""
    for path in context.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def test_the_dockerfile_makes_executable_what_it_runs_from_the_context(frameworks, tmp_path, monkeypatch):
    monkeypatch.setenv("NBBATCH_CACHE_DIR", str(tmp_path / "cache"))
    _stand_in_uv(tmp_path / "cache")
    spec = image_spec(frameworks["chainer"], DOCKERFILES)
    context = stage_context(spec, tmp_path / "ctx", Project(ROOT), arch="x86_64")
    steps = instructions(spec.text)
    for index, (keyword, args) in enumerate(steps):
        if keyword != "COPY":
            continue
        *sources, dest = args.split()
        staged = [context / s for s in sources if (context / s).is_file() and os.access(context / s, os.X_OK)]
        for _ in staged:  # an executable file: blob storage drops its mode, so a later step must restore it
            later = " ".join(a for k, a in steps[index + 1:] if k == "RUN")
            assert re.search(rf"chmod\s+(0?755|\+x|a\+x)\s+{re.escape(dest)}", later), f"{dest} is never chmod-ed"


def _podman_missing() -> str:
    if os.geteuid() != 0 or not shutil.which("podman"):
        return "needs root and podman"
    found = subprocess.run(["podman", "image", "exists", TEST_BASE], capture_output=True, timeout=60)
    return "" if found.returncode == 0 else f"needs the local base image {TEST_BASE} (tests/test_containers_real.py)"


def _steps_up_to_uv(text: str) -> str:
    """The filled-in Dockerfile's steps up to its first uv command (which is replaced by `uv --version`), without
    the apt-get step (no package mirror needed: the test base holds what the image needs)."""
    kept = []
    for keyword, args in instructions(text):
        if keyword == "RUN" and re.search(r"(^|&&|;)\s*uv\s", args):
            break
        if (keyword == "RUN" and "apt-get" in args) or (keyword == "COPY" and "context/uv" not in args):
            continue
        kept.append(f"{keyword} {args}")
    return "\n".join([*kept, "RUN uv --version"]) + "\n"


@pytest.mark.container  # builds with podman: in the worker of the other image tests
@pytest.mark.timeout(300)
def test_the_image_runs_uv_from_a_context_that_lost_its_file_modes(frameworks, tmp_path, monkeypatch):
    if why := _podman_missing():
        pytest.skip(why)
    monkeypatch.setenv("NBBATCH_CACHE_DIR", str(tmp_path / "cache"))
    _stand_in_uv(tmp_path / "cache")
    spec = image_spec(frameworks["chainer"], DOCKERFILES)
    context = stage_context(spec, tmp_path / "ctx", Project(ROOT), arch="x86_64")
    _blob_round_trip(context)
    assert not os.access(context / "context" / "uv", os.X_OK)
    (context / "Dockerfile.uv").write_text(_steps_up_to_uv(spec.text))
    tag = f"localhost/nbbatch-test-uv-mode:{uuid.uuid4().hex[:8]}"
    try:
        built = subprocess.run(["podman", "build", "--pull=never", "--no-cache", "--build-arg", f"BASE_IMAGE={TEST_BASE}",
                                "--file", str(context / "Dockerfile.uv"), "--tag", tag, str(context)],
                               capture_output=True, text=True, timeout=240)
        assert built.returncode == 0, (built.stdout + built.stderr)[-2000:]
        assert "uv 0.13.8 (stand-in)" in built.stdout  # the build's own `RUN uv …` step ran it
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]  # ulimits this machine lets a container set
        nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)
        limits = ["--ulimit", "nofile={}:{}".format(*resource.getrlimit(resource.RLIMIT_NOFILE)),
                  "--ulimit", f"nproc={nproc}:{nproc}"]
        ran = subprocess.run(["podman", "run", "--rm", *limits, tag, "uv", "--version"], capture_output=True,
                             text=True, timeout=120)
        assert ran.returncode == 0 and "stand-in" in ran.stdout, ran.stderr
    finally:
        subprocess.run(["podman", "rmi", "--force", tag], capture_output=True, timeout=120)


# --- 11: Azure ML's run token reaches a kernel only when tracking is asked for ---------------------------------

AZUREML_JOB_ENV = {  # what Azure ML sets in every job (names from azureml-mlflow; values made up)
    "MLFLOW_TRACKING_URI": "azureml://westeurope.api.azureml.ms/mlflow/v1.0/subscriptions/s/resourceGroups/g/"
                           "providers/Microsoft.MachineLearningServices/workspaces/w",
    "MLFLOW_RUN_ID": "job-1234", "MLFLOW_EXPERIMENT_ID": "exp-1",
    "AZUREML_RUN_TOKEN": "run-token-" + uuid.uuid4().hex, "AZUREML_RUN_TOKEN_EXPIRY": "1900000000",
    "AZUREML_RUN_ID": "job-1234",
}
PROBE = ("import os, nbbatch\n"
         "nbbatch.record(run_token='AZUREML_RUN_TOKEN' in os.environ, mlflow_uri='MLFLOW_TRACKING_URI' in os.environ,\n"
         "               token_text=any(v == os.environ.get('AZUREML_RUN_TOKEN') for v in os.environ.values()\n"
         "                              if 'run-token-' in v))")


def _as_azure_ml_sends_it(run: Run, code: Path) -> Run:
    """The run as the azureml backend hands it to its job (``run-one '<launch JSON>'``, the run in the code ``code``)."""
    pytest.importorskip("azure.ai.ml")
    from nbbatch.backends.azureml import AzureMLBackend  # the azure extra: loaded only when installed

    job = AzureMLBackend().build_job(run, "azureml:e:1", code, datastore="nbbatch_acct_results",
                                     share_url="azfiles://acct/results/nbbatch")
    words = shlex.split(job.command)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(code)  # where Azure ML starts the job's command
        return LaunchSpec.from_json(words[words.index("run-one") + 1]).run


@pytest.mark.kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tracking", [None, "mlflow"])
def test_an_azure_ml_jobs_kernel_sees_the_run_token_only_with_tracking(project, monkeypatch, tracking, tmp_path):
    make_notebook(project / "nb.ipynb", [PROBE])
    run = _as_azure_ml_sends_it(Run(run_id=f"probe-{tracking}", experiment="tokens", notebook=str(project / "nb.ipynb"),
                                    notebook_rel="nb.ipynb", kernel="python3", tracking=tracking), tmp_path / "code")
    for name, value in AZUREML_JOB_ENV.items():
        monkeypatch.setenv(name, value)
    record = execute_run(run, FileShare(project / "results"), AttemptContext(backend="azureml", project_root=project))
    assert record.status == "succeeded", record.error
    asked = tracking == "mlflow"
    assert record.metrics == {"run_token": asked, "mlflow_uri": asked, "token_text": asked}


def test_tracking_none_strips_mlflow_and_the_run_token_from_a_kernel_and_a_container(project, monkeypatch):
    from nbbatch.containers.runner import passed_variables
    from nbbatch.execute.attempts import kernel_launch

    make_notebook(project / "nb.ipynb", ["pass"])
    for name, value in AZUREML_JOB_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "someone")
    run = Run(run_id="r", experiment="e", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3")
    tracked = {"MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_TRACKING_USERNAME",
               "AZUREML_RUN_TOKEN", "AZUREML_RUN_TOKEN_EXPIRY"}
    for tracking, sees in ((None, True), ("mlflow", True), ("none", False)):  # None: the URI the user set decides
        _, env, _ = kernel_launch(dataclasses.replace(run, tracking=tracking), project_root=project)
        assert (tracked <= set(env)) if sees else not (tracked & set(env)), tracking
        assert "AZUREML_RUN_ID" in env  # not a credential: kept
        assert (tracked <= set(passed_variables(tracking=tracking))) if sees else \
            not (tracked & set(passed_variables(tracking=tracking))), tracking


def test_the_experiment_takes_tracking_mlflow_or_none(project, write_experiment):
    from nbbatch.errors import SpecError
    from nbbatch.plan.runs import plan
    from nbbatch.spec.experiment import load_experiment

    make_notebook(project / "nb.ipynb", ["pass"])
    exp = load_experiment(write_experiment("experiment: t\nnotebooks: [nb.ipynb]\ntracking: mlflow\n"))
    assert exp.tracking == "mlflow" and {r.tracking for r in plan(exp).runs} == {"mlflow"}
    with pytest.raises(SpecError, match="tracking"):
        load_experiment(write_experiment("experiment: t\nnotebooks: [nb.ipynb]\ntracking: yes-please\n"))


# --- the live smoke driver (benchmarks/azure_smoke.py), its logic offline ---------------------------------------


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("azure_smoke", ROOT / "benchmarks" / "azure_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["azure_smoke"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("azure_smoke", None)


def test_the_smoke_driver_refuses_to_start_without_the_workspace_variables(smoke, capsys):
    assert smoke.main([], environ={"AZURE_SUBSCRIPTION_ID": "s"}) == 2
    said = capsys.readouterr().err
    assert "AZURE_RESOURCE_GROUP" in said and "NBBATCH_AZURE_SHARE" in said and "AZURE_SUBSCRIPTION_ID" not in said


def test_the_smoke_experiments_are_valid_and_probe_what_the_issue_asks(smoke, project):
    from nbbatch.spec.experiment import Experiment

    checks = smoke.checks
    make_notebook(project / "probe.ipynb", ["pass"])
    specs = checks.smoke_experiments("azfiles://acct/results/nbbatch", "Standard_NC4as_T4_v3", "probe.ipynb")
    # (the names run's odd folder is left out: should nbbatch's rules refuse it, the smoke test skips that row)
    built = {name: Experiment.from_dict(spec, base_dir=project) for name, spec in specs.items() if name != checks.NAMES}
    assert built[checks.ONE_NODE].tracking == "mlflow" and built[checks.TWO_NODES].tracking is None
    assert built[checks.TWO_NODES].world().nodes == 2 and specs[checks.TWO_NODES]["distribution"]["type"] == "mpi"
    assert specs[checks.TWO_NODES]["share"] == "azfiles://acct/results", "the 2-node run mounts the share's root"
    assert " " in specs[checks.NAMES]["share"] and not specs[checks.NAMES]["share"].isascii()
    assert specs[checks.ONE_NODE]["parameters"]["BIG_FILE_BYTES"] == 2 << 30
    one_cluster = {specs[n]["backend"]["compute"] for n in (checks.ONE_NODE, checks.NAMES)}
    assert one_cluster == {checks.ONE_NODE_CLUSTER} != {specs[checks.TWO_NODES]["backend"]["compute"]}


def test_the_cost_estimate_comes_first_and_names_the_quota(smoke, capsys):
    assert smoke.main(["--cost-only"], environ={}) == 0
    said = capsys.readouterr().out
    assert said.startswith("azure-smoke cost estimate:") and "US$" in said and "at most 2 nodes (8 vCPUs" in said
    assert smoke.main([], environ={"AZURE_SUBSCRIPTION_ID": "s"}) == 2
    assert capsys.readouterr().out.startswith("azure-smoke cost estimate:"), "printed before anything is asked"


def test_the_raw_probe_jobs_and_the_cancel_answers_against_the_azure_ml_fake(smoke, tmp_path):
    pytest.importorskip("azure.ai.ml")
    from azure.ai.ml import load_job
    from fakes.azureml_transport import FakeAzureML

    from nbbatch.backends.azureml import job_yaml

    aml = FakeAzureML()
    client = aml.ml_client()
    aml.register_environment("nbbatch-pytorch", "1")  # what the jobs name must exist: the fake checks, as the service
    aml.add_compute(smoke.checks.ONE_NODE_CLUSTER)
    names = {}
    for kind in ("limit", "cancel"):
        job = smoke.raw_job(kind, "azureml:nbbatch-pytorch:1", smoke.checks.ONE_NODE_CLUSTER)
        names[kind] = client.jobs.create_or_update(job).name
        assert load_job(source=io.StringIO(job_yaml(job))).limits.timeout == job.limits.timeout
    assert client.jobs.get(names["limit"]).limits.timeout == smoke.checks.LIMIT_PROBE_S < smoke.checks.HOLD_S
    aml.set_job_status(names["cancel"], "Running")
    assert smoke.cancel_job(client, names["cancel"]).startswith("accepted"), "a running job is cancelled"
    aml.set_job_status(names["limit"], "Completed")
    answer = smoke.cancel_job(client, names["limit"])
    assert answer.startswith("refused: HttpResponseError") and names["limit"] in answer, answer


def _probe_record(experiment, status="succeeded", **metrics):
    from nbbatch.store.runjson import RunRecord

    return RunRecord(run_id=f"{experiment}-1", experiment=experiment, notebook="probe.ipynb", kernel="python3",
                     status=status, metrics=metrics)


def _all_good(checks):
    one = dict(rename="replaces an existing file", o_excl="second create refused (EEXIST)", pwrite="in place",
               driver_marker_s=6.0, input_write="refused: EROFS", user="root", uid=0, uv="uv 0.8.0", home="/root",
               mlflow_uri_in_kernel=True, run_token_in_kernel=True)
    return checks.Observations(
        records={checks.ONE_NODE: [_probe_record(checks.ONE_NODE, **one)],
                 checks.NAMES: [_probe_record(checks.NAMES, input_text=checks.INPUT_TEXT)],
                 checks.TWO_NODES: [_probe_record(checks.TWO_NODES, node1_file_on_node0_s=4.0,
                                                  run_token_in_kernel=False)]},
        log_delay_s=7.0, big_file="ok", limit_probe="Completed", limit_probe_queued_s=700.0, setup_s=900.0,
        cancel={"running": "accepted (job now CancelRequested); Canceled after 40 s",
                "finalizing": "refused: HttpResponseError (HTTP 400): …", "finished": "refused: HttpResponseError …"})


def test_recorded_probe_answers_that_meet_every_threshold_exit_0(smoke):
    checks = smoke.checks
    rows = checks.evaluate(_all_good(checks), margin_s=7200)
    table = checks.format_table(rows)
    assert checks.exit_code(rows) == 0, table
    assert [r.verdict for r in rows].count("FAIL") == 0 and table.splitlines()[-1].startswith(f"{len(rows) - 1} passed")
    assert len(table.splitlines()) == len(rows) + 3 and len(rows) == len(checks.CHECKS) + 1
    verdicts = {r.question: r.verdict for r in rows}
    assert verdicts["a low-priority preemption"] == "skip", "informative: it cannot be provoked"
    assert verdicts["what limits.timeout counts"] == "pass"


def test_each_answer_past_its_threshold_fails_the_smoke_test(smoke):
    import dataclasses

    checks = smoke.checks
    good = _all_good(checks)
    one = good.records[checks.ONE_NODE][0]
    worse = {
        "O_CREAT|O_EXCL on the rw_mount": dict(records={**good.records, checks.ONE_NODE: [dataclasses.replace(
            one, metrics={**one.metrics, "o_excl": "second create succeeded: O_EXCL not honoured"})]}),
        "the driver's cancel marker seen in the job": dict(records={**good.records, checks.ONE_NODE: [
            dataclasses.replace(one, metrics={**one.metrics, "driver_marker_s": -1.0})]}),
        "a logged line on the share while the run goes": dict(log_delay_s=None),
        "a 2 GiB output written at the run's end": dict(big_file="run.json lists big.bin with None bytes, not 2147483648"),
        "the share's root mounted (paths/./), 2-node MPI job": dict(records={**good.records, checks.TWO_NODES: [
            _probe_record(checks.TWO_NODES, status="failed")]}),
        "queue and image build before the run started": dict(setup_s=9000.0),
        "cancelling a finished job": dict(cancel={**good.cancel, "finished": "accepted (job now Completed)"}),
        "cancelling a running job": dict(cancel={k: v for k, v in good.cancel.items() if k != "running"}),
    }
    for question, change in worse.items():
        rows = checks.evaluate(dataclasses.replace(good, **change), margin_s=7200)
        failed = [r.question for r in rows if r.verdict == "FAIL"]
        assert question in failed and checks.exit_code(rows) == 1, (question, failed)
        assert f"FAIL    | {question}" in checks.format_table(rows)


def test_what_the_service_gave_no_occasion_to_ask_is_skipped_not_failed(smoke):
    import dataclasses

    checks = smoke.checks
    good = _all_good(checks)
    odd = dataclasses.replace(good, refused={checks.NAMES: "a folder name holds a space: rename it"},
                              cancel={k: v for k, v in good.cancel.items() if k != "finalizing"},
                              limit_probe_queued_s=100.0)
    rows = {r.question: r for r in checks.evaluate(odd, margin_s=7200)}
    assert rows[f"a folder named `{checks.ODD_FOLDER}` (share and input)"].verdict == "skip"
    assert "refused by nbbatch" in rows[f"a folder named `{checks.ODD_FOLDER}` (share and input)"].answer
    assert rows["cancelling a finalizing job"].verdict == "skip"
    assert rows["what limits.timeout counts"].verdict == "skip", "queued less than its limit: inconclusive"
    assert checks.exit_code(list(rows.values())) == 0


def test_a_non_root_user_passes_only_where_the_mount_and_mpi_work(smoke):
    import dataclasses

    checks = smoke.checks
    good = _all_good(checks)
    one = good.records[checks.ONE_NODE][0]
    as_user = {**good.records, checks.ONE_NODE: [dataclasses.replace(one, metrics={**one.metrics, "uid": 10001,
                                                                                     "user": "nbbatch"})]}
    user = next(r for r in checks.evaluate(dataclasses.replace(good, records=as_user), 7200)
                if r.question == "the job's user")
    assert user.verdict == "pass" and "uid 10001" in user.answer
    broken = {**as_user, checks.TWO_NODES: [_probe_record(checks.TWO_NODES, status="failed")]}
    user = next(r for r in checks.evaluate(dataclasses.replace(good, records=broken), 7200)
                if r.question == "the job's user")
    assert user.verdict == "FAIL"


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_the_probe_answers_every_one_node_question_here(smoke, project):
    from nbbatch.api import submit
    from nbbatch.store.layout import run_paths
    from nbbatch.store.share import FileShare

    checks = smoke.checks
    notebook = smoke.write_probe(project / "probe.ipynb")
    data = project / "input"
    data.mkdir()
    (data / checks.INPUT_FILE).write_text(checks.INPUT_TEXT, encoding="utf-8")
    data.chmod(0o555)
    try:
        outcome = submit({"experiment": checks.ONE_NODE, "notebooks": [notebook.name], "tracking": "none",
                          "parameters": {"MARKER_WAIT_S": 0, "LOG_WAIT_S": 1, "BIG_FILE_BYTES": 3000,
                                         "PROBE_INPUT": str(data)}}, progress=False)
    finally:
        data.chmod(0o755)
    (record,) = outcome.records
    assert record.status == "succeeded", record.error
    metrics = record.metrics
    assert metrics["rename"] == "replaces an existing file" and metrics["pwrite"] == "in place"
    assert metrics["o_excl"] == "second create refused (EEXIST)" and metrics["input_text"] == checks.INPUT_TEXT
    assert metrics["input_write"].startswith("refused") or os.getuid() == 0
    assert metrics["uid"] == os.getuid() and metrics["run_token_in_kernel"] is False
    share = FileShare(project / "results")
    outputs = run_paths(checks.ONE_NODE, record.run_id).outputs
    assert smoke.big_file_on_share(share, outputs, record, size=3000) == "ok"
    assert checks.LOG_LINE in share.read_bytes(run_paths(checks.ONE_NODE, record.run_id).log).decode()
    share.write_bytes(f"{outputs}/{checks.BIG_FILE}", b"\0" * 2999)
    assert "holds 2999 bytes" in smoke.big_file_on_share(share, outputs, record, size=3000)


@pytest.mark.parametrize("probes", [0, 1])
def test_make_azure_smoke_fails_when_a_probe_does_after_deleting_the_probe_clusters(tmp_path, probes):
    """The Makefile's target: the estimate first, then the runs; its exit is the probes' once the clusters are gone."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    stubs, calls = tmp_path / "bin", tmp_path / "calls.txt"
    stubs.mkdir()
    for name, code in (("python", f'[ "$2" = --cost-only ] && exit 0; exit {probes}'), ("nbbatch", "exit 0")):
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n{code}\n')
        (stubs / name).chmod(0o755)
    env = {**os.environ, "AZURE_SUBSCRIPTION_ID": "s", "AZURE_RESOURCE_GROUP": "g", "AZUREML_WORKSPACE": "w",
           "NBBATCH_AZURE_SHARE": "azfiles://acct/results/nbbatch"}
    done = subprocess.run(["make", "-s", "-o", "setup", f"BIN={stubs}", "azure-smoke"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert (done.returncode != 0) == bool(probes), done.stderr
    said = calls.read_text().splitlines()
    assert said[0].endswith("--cost-only --vm-size Standard_NC4as_T4_v3"), "the estimate comes first"
    probe = next(i for i, line in enumerate(said) if line.startswith("python benchmarks/azure_smoke.py --vm-size"))
    deleted = [line for line in said[probe:] if line.startswith("nbbatch cluster delete")]
    assert [line.split("/")[-1] for line in deleted] == ["azure-probe.yaml", "azure-probe-2node.yaml"]


def test_the_probe_inputs_are_written_beside_the_share_on_azure_files(smoke, monkeypatch):
    pytest.importorskip("azure.storage.fileshare")
    from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles

    checks = smoke.checks
    share_url = f"azfiles://{ACCOUNT}/results/nbbatch"
    specs = checks.smoke_experiments(share_url, "Standard_NC4as_T4_v3", "probe.ipynb")
    with FakeAzureFiles() as server:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        obs = checks.Observations()
        shares = smoke.prepare_shares(specs, obs)
        root = shares[checks.ONE_NODE]
        for name in (checks.ONE_NODE, checks.NAMES):
            if name in obs.refused:  # nbbatch's rules refuse the odd folder's name: that row is skipped, not failed
                continue
            folder = specs[name]["inputs"]["PROBE_INPUT"][len(share_url) + 1:]
            assert root.read_bytes(f"{folder}/{checks.INPUT_FILE}").decode() == checks.INPUT_TEXT
        assert checks.ONE_NODE not in obs.refused and set(shares) >= {checks.ONE_NODE, checks.TWO_NODES}


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_an_azure_ml_job_echoes_the_runs_log_to_its_own_stream(project, monkeypatch, capfd, tmp_path):
    """`nbbatch logs -f` follows the job's own output: the run's log lines must be there, not only in log.txt."""
    make_notebook(project / "nb.ipynb", ["print('a line the notebook printed')"])
    run = _as_azure_ml_sends_it(Run(run_id="echo", experiment="logs", notebook=str(project / "nb.ipynb"),
                                    notebook_rel="nb.ipynb", kernel="python3"), tmp_path / "code")
    monkeypatch.setenv("NBBATCH_LOG_ECHO", "1")  # as every Azure ML job of nbbatch sets it (runtime_environment)
    record = execute_run(run, FileShare(project / "results"), AttemptContext(backend="azureml", project_root=project))
    assert record.status == "succeeded", record.error
    assert "a line the notebook printed" in capfd.readouterr().out


class _Refused(Exception):
    status_code = 400


class _SmokeService:
    """The smoke driver's view of Azure ML and nbbatch, scripted tick by tick: job statuses by name, run records."""

    def __init__(self, ticks):
        from types import SimpleNamespace

        self.ticks, self.tick, self.cancelled, self.created = ticks, 0, [], []
        self.ml_client = SimpleNamespace(jobs=SimpleNamespace(get=self.get, create_or_update=self.create,
                                                              begin_cancel=self.cancel))

    def now(self):
        return self.ticks[min(self.tick, len(self.ticks) - 1)]

    def status(self, path):  # api.status of an experiment file
        from types import SimpleNamespace

        name = Path(path).stem
        if name == "azure-probe-names":
            self.tick += 1  # the last experiment of the phase read: the next poll sees the next tick
        final = self.now()["final"]
        return [SimpleNamespace(run_id=f"{name}-1", final=final, status="succeeded" if final else "running")]

    def job_state(self, share, name, run_id):
        from types import SimpleNamespace

        return SimpleNamespace(job_name=f"job-{name}", job_status=self.now()["jobs"].get(f"job-{name}"))

    def get(self, name):
        from types import SimpleNamespace

        return SimpleNamespace(status=self.now()["jobs"].get(name, "Queued"), environment="azureml:nbbatch-pytorch:1")

    def create(self, job):
        self.created.append(job.name.split("-")[2])  # nbbatch-smoke-<kind>-<hex>
        return job

    def cancel(self, name):
        from types import SimpleNamespace

        if self.now()["jobs"].get(name) in ("Finalizing", "Completed"):
            raise _Refused(f"job {name} cannot be cancelled")
        self.cancelled.append(name)
        return SimpleNamespace(result=lambda: None)


def test_the_smoke_driver_probes_as_the_jobs_go(smoke, tmp_path, monkeypatch):
    """The live driver's polling against a scripted service: the marker answered, the log line timed, the raw jobs
    created once the first run's job runs, the running one cancelled, a finalizing job's cancel answer kept."""
    from nbbatch.store.layout import run_paths
    from nbbatch.store.share import FileShare

    checks = smoke.checks
    monkeypatch.setattr(smoke, "POLL_S", 0)
    monkeypatch.setattr(smoke, "raw_job", lambda kind, env, compute: type("Job", (), {"name": f"nbbatch-smoke-{kind}-1"}))
    share = FileShare(tmp_path / "share")
    paths = run_paths(checks.ONE_NODE, f"{checks.ONE_NODE}-1")
    share.write_bytes(f"{paths.outputs}/{checks.WAITING_FILE}", b"waiting")
    share.write_bytes(paths.log, f"=== start\n{checks.LOG_LINE}{time.time() - 3:.3f}\n".encode())
    one, names = f"job-{checks.ONE_NODE}", f"job-{checks.NAMES}"
    service = _SmokeService([
        {"final": False, "jobs": {one: "Running", names: "Queued"}},
        {"final": False, "jobs": {one: "Running", names: "Finalizing", "nbbatch-smoke-cancel-1": "Running"}},
        {"final": True, "jobs": {one: "Completed", names: "Completed", "nbbatch-smoke-cancel-1": "Canceled",
                                 "nbbatch-smoke-limit-1": "Completed"}},
    ])
    obs = checks.Observations()
    files = {checks.ONE_NODE: tmp_path / f"{checks.ONE_NODE}.yaml", checks.NAMES: tmp_path / f"{checks.NAMES}.yaml"}
    phase = smoke.Phase(service, {checks.ONE_NODE: share, checks.NAMES: share}, files, obs, lambda _: None, service)
    phase.follow()
    assert share.exists(f"{paths.outputs}/{checks.MARKER_FILE}"), "the driver answered the probe's wait"
    assert 3 <= obs.log_delay_s < 60
    assert service.created == ["limit", "cancel"] and service.cancelled == ["nbbatch-smoke-cancel-1"]
    assert obs.cancel["running"].startswith("accepted") and "Canceled after" in obs.cancel["running"]
    assert obs.cancel["finalizing"].startswith("refused: _Refused (HTTP 400)")
    assert obs.limit_probe == "Completed" and obs.limit_probe_queued_s is not None
