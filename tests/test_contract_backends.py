"""The backend contract: what every built-in backend does with a run, written once and run over each of them (like
dask-jobqueue's tests over every cluster class): local, Slurm (the session's two-node cluster), Ray (the session's
two-node cluster on loopback), Azure ML (the protocol-level fake of its control plane, whose jobs the harness runs
here, one at a time, as a one-node cluster would: their command is `nbbatch run-one` against the Azure Files fake) and
Kubernetes (the protocol-level fake API server, whose Job controller makes the pods and whose kubelet runs each pod's
command here, the share volume bound in a mount namespace).

The one fixture, ``harness``, yields a :class:`Harness` per backend: the experiment's ``backend:`` and ``share:``
for it, how to submit without waiting, and how to make a run be lost the way it is lost on that backend. The tests
use the public API only (:func:`nbbatch.api.submit`, ``status``, ``cancel``, and the backend's ``cancel`` with a
pruner's request, as the search driver calls it). A new backend joins the contract with one more ``pytest.param``
in ``harness`` and the few lines that make its harness.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
import yaml
from support.notebooks import make_notebook
from support.waiting import wait_until

from nbbatch import api
from nbbatch.backends import get_backend
from nbbatch.errors import NbbatchError
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import StopRequest
from nbbatch.store.runjson import ErrorKind, RunRecord, Status
from nbbatch.store.share import open_share

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(300)]

PARAMETERS = "A = 1\nSLEEP = 0.0\nFAIL_AT = 0\nDIE_ONCE = ''\nSTEPS = 0"
CELLS = [
    "import os, pathlib, time, nbbatch\nprint('ran', A, flush=True)\n"
    "if DIE_ONCE and not pathlib.Path(DIE_ONCE).exists():  # the kernel dies the first time only\n"
    "    pathlib.Path(DIE_ONCE).write_text('died')\n    os._exit(1)\n"
    "for step in range(1, STEPS + 1):\n    nbbatch.record(step=step, loss=1.0 / step)\n    time.sleep(0.2)\n"
    "time.sleep(SLEEP)",
    "if A == FAIL_AT:\n    raise RuntimeError(f'failed on purpose at A={A}')\nnbbatch.record(twice=A * 2)",
]
PRUNE = StopRequest(Status.PRUNED, "pruned by the contract's pruner at step 2")
START_S = 180  # a run queued to running: seconds here, longer on two cores shared with other work
END_S = 120  # running (or asked to stop) to final


@dataclass
class Harness:
    """One backend under the contract: how an experiment reaches it, and what only it can do to a run."""

    name: str
    project: Path
    share: str
    backend: dict[str, Any]
    lose: Callable[[RunRecord], None]  # make the run's execution vanish, as it does on this backend
    submit_in_a_process: bool = False  # the backend's runs live in the submitting process (`nbbatch submit`)
    drivers: list[subprocess.Popen] = field(default_factory=list)

    def experiment(self, name: str, grid: list[int], **extra: Any) -> dict[str, Any]:
        """An experiment of the contract's notebook over ``A`` in ``grid`` on this backend."""
        parameters = extra.pop("parameters", {})
        return {"experiment": name, "notebooks": [{"path": "nb.ipynb", "kernel": "python3"}],
                "parameters": parameters, "sweep": {"grid": {"A": grid}}, "backend": self.backend,
                "share": self.share, **extra}

    def start(self, experiment: dict[str, Any]) -> None:
        """Submit, returning once the runs are handed over (not waiting for them to end)."""
        if not self.submit_in_a_process:
            api.submit(experiment, wait=False, progress=False)
            return
        path = self.project / f"{experiment['experiment']}.yaml"
        path.write_text(yaml.safe_dump(experiment))
        log = (self.project / f"{experiment['experiment']}.driver.txt").open("w")
        self.drivers.append(subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", str(path)], cwd=self.project,
                                             stdout=subprocess.DEVNULL, stderr=log))

    def records(self, name: str) -> dict[int, RunRecord]:
        """The experiment's records by ``A``, through `nbbatch status` (which asks the backend)."""
        try:
            return {r.parameters["A"]: r for r in api.status(name, share=self.share)}
        except NbbatchError:  # nothing recorded yet
            return {}

    def final(self, name: str, count: int) -> dict[int, RunRecord]:
        """The records once all ``count`` runs are final."""
        def all_final() -> dict[int, RunRecord] | None:
            records = self.records(name)
            return records if len(records) == count and all(r.final for r in records.values()) else None
        return wait_until(all_final, timeout=START_S + END_S, message=f"{count} final run(s) of {name} on {self.name}",
                          interval=0.3)

    def running(self, name: str, a: int = 1) -> RunRecord:
        """Run ``A=a``'s record once its notebook has printed (it is past its first cell's start)."""
        def printed() -> RunRecord | None:
            record = self.records(name).get(a)
            if record is None or record.status != Status.RUNNING:
                return None
            log = run_paths(name, record.run_id).log
            share = open_share(self.share)
            return record if share.exists(log) and f"ran {a}" in share.read_bytes(log).decode() else None
        return wait_until(printed, timeout=START_S, message=f"run A={a} of {name} running on {self.name}",
                          interval=0.3)

    def output(self, record: RunRecord) -> nbformat.NotebookNode:
        """The run's executed notebook on the share."""
        share = open_share(self.share)
        return nbformat.reads(share.read_bytes(run_paths(record.experiment, record.run_id).notebook).decode(),
                              as_version=4)

    def stop(self) -> None:
        for driver in self.drivers:
            if driver.poll() is None:
                driver.kill()
            driver.wait()


# --- the backends ------------------------------------------------------------------------------------------------


def _kill_tree(pid: int | None, *, parent: bool = False) -> None:
    """SIGKILL a process and everything under it (``parent``: its parent's tree: a Ray worker running the run)."""
    try:
        process = psutil.Process(pid)
        if parent:
            process = process.parent()
        for each in [*process.children(recursive=True), process]:
            each.kill()
    except psutil.NoSuchProcess:
        pass


def _local(request, project, tmp_path) -> Iterator[Harness]:
    def lose(record: RunRecord) -> None:  # the submitting process dies: nothing runs the run any more
        os.kill(record.pid, signal.SIGKILL)
        for driver in harness.drivers:
            if driver.pid == record.pid:
                driver.wait()

    harness = Harness("local", project, str(tmp_path / "share"), {"name": "local"}, lose, submit_in_a_process=True)
    yield harness
    harness.stop()


def _slurm(request, project, tmp_path) -> Iterator[Harness]:
    request.getfixturevalue("slurm_cluster")
    backend = {"name": "slurm", "cpus": 1, "memory": "256M", "cancel_grace_s": 5}
    # its launcher dies (its node's processes, not the node): Slurm ends the job with no final record from the run
    yield Harness("slurm", project, str(tmp_path / "share"), backend, lambda record: _kill_tree(record.pid))


def _ray(request, project, tmp_path) -> Iterator[Harness]:
    head = request.getfixturevalue("ray_head")
    backend = {"name": "ray", "address": head.address, "linger_s": 5, "cancel_grace_s": 5}
    # the Ray worker running the run's task dies (as with its node): Ray fails the task
    yield Harness("ray", project, str(tmp_path / "share"), backend, lambda record: _kill_tree(record.pid, parent=True))


def _azureml(request, project, tmp_path) -> Iterator[Harness]:
    pytest.importorskip("azure.ai.ml")
    from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles
    from fakes.azureml_transport import FakeAzureML

    import nbbatch.backends as backends
    from nbbatch.backends.azureml import AzureMLBackend
    from nbbatch.backends.azureml.jobs import RUN_FILES

    monkeypatch = request.getfixturevalue("monkeypatch")
    aml = FakeAzureML()
    aml.register_environment("nbbatch-contract", "1")  # the fake checks a job's environment exists

    def azureml(**settings: Any) -> AzureMLBackend:
        made = AzureMLBackend(ml_client=aml.ml_client(), **settings)
        create = made.ml_client.jobs.create_or_update

        def with_its_code(job: Any) -> Any:  # the node runs the command where it finds the job's run file, as in its code
            shutil.copytree(Path(job.code) / RUN_FILES, project / RUN_FILES, dirs_exist_ok=True)
            return create(job)

        made.ml_client.jobs.create_or_update = with_its_code
        return made

    monkeypatch.setitem(backends._REGISTRY, "azureml", azureml)
    backend = {"name": "azureml", "compute": "gpu-t4", "max_nodes": 1, "poll_seconds": 0, "share_mode": "direct",
               "environments": {"*": "azureml:nbbatch-contract:1"},
               "launcher": f"{shlex.quote(sys.executable)} -m nbbatch"}
    with FakeAzureFiles() as files:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", files.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        node = FakeAzureMLNode(aml, project)
        yield Harness("azureml", project, f"azfiles://{ACCOUNT}/results/nbbatch", backend, node.fail_job_of)
        node.stop()


class FakeAzureMLNode:
    """The one node of the fake's cluster: runs the jobs Azure ML was asked to create, one at a time, by their command
    (`nbbatch run-one ...`), and sets each job's status as the service would (Running, then Completed, Failed or
    Canceled)."""

    def __init__(self, aml: Any, project: Path):
        self.aml, self.project = aml, project
        self.processes: dict[str, subprocess.Popen] = {}
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="fake-azureml-node", daemon=True)
        self.thread.start()

    def _status(self, job: str, status: str | None = None) -> str:
        with self.aml.transport._lock:  # the SDK's requests are answered under it
            if status is not None:
                self.aml.set_job_status(job, status)
            return self.aml.jobs[job]["properties"]["status"]

    def _serve(self) -> None:
        while not self.halt.wait(0.1):
            for job in list(self.aml.jobs):
                process, status = self.processes.get(job), self._status(job)
                if process is None and status == "NotStarted" and all(p.poll() is not None
                                                                      for p in self.processes.values()):
                    command = self.aml.jobs[job]["properties"]["command"]
                    self.processes[job] = subprocess.Popen(command, shell=True, cwd=self.project,
                                                           start_new_session=True, stdout=subprocess.DEVNULL,
                                                           stderr=subprocess.DEVNULL)
                    self._status(job, "Running")
                elif process is not None and process.poll() is not None and status in ("Running", "CancelRequested"):
                    self._status(job, "Canceled" if status == "CancelRequested" else
                                 "Completed" if process.returncode == 0 else "Failed")

    def fail_job_of(self, record: RunRecord) -> None:
        """The run's node is gone: its job's processes die and Azure ML says the job failed."""
        job = next(name for name, job in self.aml.jobs.items() if job["properties"]["displayName"] == record.run_id)
        self._status(job, "Failed")
        os.killpg(self.processes[job].pid, signal.SIGKILL)

    def stop(self) -> None:
        self.halt.set()
        self.thread.join()
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _kubernetes(request, project, tmp_path) -> Iterator[Harness]:
    pytest.importorskip("kubernetes")
    from fakes.kubernetes_api import FakeKubernetes
    from fakes.kubernetes_process import ProcessKubelet

    why = ProcessKubelet.unavailable()
    if why:
        pytest.skip(why)
    share = tmp_path / "share"
    share.mkdir()
    # the fake API server, its pods real processes here: run-one in a mount namespace where the share is the volume
    with FakeKubernetes(kubelet=ProcessKubelet(), namespaces=("default", "ml")) as kube:
        backend = {"name": "kubernetes", "kubeconfig": str(kube.kubeconfig(tmp_path / "kubeconfig", "ml")),
                   "context": "fake", "namespace": "ml", "share": {"host_path": str(share)},
                   "images": {"*": "registry.example.com/nbbatch-contract:1"}, "poll_s": 0.2, "cancel_grace_s": 15,
                   "termination_grace_s": 30}  # a stopped launcher saves its notebook before SIGKILL, on busy cores too
        # its pod's launcher dies (as with its node): the pod fails, and its Job's index with it (no retries left)
        yield Harness("kubernetes", project, str(share), backend, lambda record: _kill_tree(record.pid))


BACKENDS = {"local": _local, "slurm": _slurm, "ray": _ray, "azureml": _azureml, "kubernetes": _kubernetes}


@pytest.fixture(params=[pytest.param("local"),
                        pytest.param("slurm", marks=pytest.mark.slurm),
                        pytest.param("ray", marks=pytest.mark.ray),
                        pytest.param("azureml", marks=pytest.mark.azure),
                        pytest.param("kubernetes")])
def harness(request, project, tmp_path) -> Iterator[Harness]:
    """Each built-in backend, ready, with the contract's notebook in the project."""
    make_notebook(project / "nb.ipynb", CELLS, parameters=PARAMETERS)
    yield from BACKENDS[request.param](request, project, tmp_path)


# --- the contract ------------------------------------------------------------------------------------------------


def test_a_sweep_runs_and_a_failed_run_keeps_its_output(harness):
    harness.start(harness.experiment("sweep", [1, 2], parameters={"FAIL_AT": 2}))
    records = harness.final("sweep", 2)
    done, failed = records[1], records[2]
    assert done.status == Status.SUCCEEDED and done.metrics["twice"] == 2, done.error
    assert {done.backend, failed.backend} == {harness.name}
    assert failed.status == Status.FAILED and failed.error.ename == "RuntimeError", failed.error
    assert "failed on purpose at A=2" in failed.error.evalue and failed.error.kind == ErrorKind.CELL_ERROR
    share = open_share(harness.share)
    assert "ran 1" in share.read_bytes(run_paths("sweep", done.run_id).log).decode()
    outputs = [o for cell in harness.output(failed).cells for o in cell.get("outputs", [])]
    assert any(o.get("text") == "ran 2\n" for o in outputs)  # the cells before the failure, with their outputs
    assert any(o.get("output_type") == "error" and o.get("ename") == "RuntimeError" for o in outputs)


def test_cancel_stops_a_running_and_a_queued_run(harness):
    harness.start(harness.experiment("stop", [1, 2], parameters={"SLEEP": 600.0}, resources={"max_parallel": 1}))
    running = harness.running("stop")
    queued = harness.records("stop")[2]
    assert queued.status == Status.QUEUED  # at most one at a time
    assert sorted(api.cancel("stop", share=harness.share)) == sorted([running.run_id, queued.run_id])
    records = harness.final("stop", 2)
    assert {r.status for r in records.values()} == {Status.CANCELLED}, [r.error for r in records.values()]
    assert records[2].started_at is None  # never started

    def ran_its_first_cell() -> bool:
        try:
            return "ran 1\n" in [o.get("text") for c in harness.output(running).cells for o in c.get("outputs", [])]
        except (OSError, NbbatchError):  # a remote share's notebook may land just after the final record
            return False

    # the running run's partial notebook is kept
    assert wait_until(ran_its_first_cell, timeout=END_S, message="partial output", interval=0.3)


def test_a_lost_run_is_failed_by_status(harness):
    harness.start(harness.experiment("lost", [1], parameters={"SLEEP": 600.0}))
    harness.lose(harness.running("lost"))
    [record] = harness.final("lost", 1).values()
    assert record.status == Status.FAILED and record.error.kind == ErrorKind.INFRA, record.error


def test_a_run_whose_kernel_dies_is_retried(harness, tmp_path):
    flag = tmp_path / "died-once"  # every node of these backends is this machine
    harness.start(harness.experiment("retried", [1], retries=1, parameters={"DIE_ONCE": str(flag)}))
    [record] = harness.final("retried", 1).values()
    assert record.status == Status.SUCCEEDED and record.attempts == 2, record.error  # never shown failed meanwhile
    assert flag.exists() and record.metrics["twice"] == 2


def test_a_pruned_run_stops_pruned_at_its_last_step(harness):
    spec = harness.experiment("pruned", [1], parameters={"STEPS": 1000})
    harness.start(spec)

    def at_step(step: int) -> RunRecord | None:  # its metric history reached ``step``
        record, share = harness.records("pruned").get(1), open_share(harness.share)
        history = run_paths("pruned", record.run_id).metrics if record is not None else None
        return record if history and share.exists(history) and \
            len(share.read_bytes(history).splitlines()) >= step else None

    record = wait_until(lambda: at_step(2), timeout=START_S, message="step 2 recorded", interval=0.3)
    backend = get_backend(harness.name, **{k: v for k, v in harness.backend.items() if k != "name"})
    assert backend.cancel("pruned", open_share(harness.share), [record.run_id], request=PRUNE) == [record.run_id]
    [ended] = harness.final("pruned", 1).values()
    assert ended.status == Status.PRUNED and ended.error.kind == ErrorKind.PRUNED, ended.error
    assert ended.error.reason == PRUNE.reason and ended.metrics["loss"] <= 0.5  # kept at its last step (>= 2)


CONTINUING = ("import os, pathlib, nbbatch\nfolder = pathlib.Path(os.environ['NBBATCH_CHECKPOINT_DIR'])\n"
              "done = int((folder / 'epoch.txt').read_text()) if (folder / 'epoch.txt').exists() else 0\n"
              "for epoch in range(done + 1, EPOCHS + 1):\n    (folder / 'epoch.txt').write_text(str(epoch))\n"
              "    nbbatch.record(step=epoch, loss=1.0 / (epoch * LR))\n"
              "nbbatch.record(loss=1.0 / (EPOCHS * LR), resumed_from=done)")


def test_a_paused_trial_continues_from_its_checkpoint(harness):
    """A search whose trials pause at rungs (ASHA with promotions): the promoted trial's next run, on this backend,
    starts from a copy of its paused run's checkpoints and trains only the epoch after them."""
    make_notebook(harness.project / "resume.ipynb", [CONTINUING], parameters="LR = 1.0\nEPOCHS = 1")
    search = {"metric": "loss", "mode": "min", "trials": 2, "sampler": "random", "seed": 0, "resource": "EPOCHS",
              "pruner": {"asha": {"min_resource": 1, "max_resource": 2, "reduction_factor": 2}},
              "params": {"LR": {"uniform": [0.5, 2.0]}}}
    result = api.submit({"experiment": "promoted", "notebooks": [{"path": "resume.ipynb", "kernel": "python3"}],
                         "search": search, "backend": harness.backend, "share": harness.share,
                         "resources": {"max_parallel": 1}}, progress=False)
    assert result.ok and len(result.records) == 3, [(r.run_id, r.status, r.error) for r in result.records]
    [continued] = [r for r in result.records if r.parameters["EPOCHS"] == 2]
    paused = next(r for r in result.records if r.run_id == continued.trial["continues"])
    assert continued.backend == harness.name and continued.continues["run_id"] == paused.run_id
    assert continued.continues["checkpoint"]["files"] == 1 and continued.metrics["resumed_from"] == 1
    assert paused.trial["state"] == "promoted" and continued.trial["state"] == "complete"
    history = open_share(harness.share).read_bytes(run_paths("promoted", continued.run_id).metrics).decode()
    assert [json.loads(line)["step"] for line in history.splitlines() if '"step"' in line] == [2]
