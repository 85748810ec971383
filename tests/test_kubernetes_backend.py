"""The kubernetes backend against the fake API server (tests/fakes/kubernetes_api.py), through the official client.

Two kinds of cluster behind the fake: a :class:`ScriptedKubelet`, whose pods follow a script (unschedulable, an image
that cannot be pulled, OOMKilled), for what the backend reads from Jobs and pods; a :class:`ProcessKubelet`, whose
pods really run their container's command (``nbbatch run-one`` executing the notebook, the share bound at its mount
inside a private mount namespace), for what runs end to end. The backend contract (tests/test_contract_backends.py)
runs over the second as over every backend; the pods' specs run for real under podman in
tests/test_kubernetes_podman.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.notebooks import make_notebook
from support.waiting import wait_until

from nbbatch import api
from nbbatch.errors import NbbatchError
from nbbatch.store.layout import run_paths
from nbbatch.store.runjson import ErrorKind, RunRecord, Status
from nbbatch.store.share import open_share

pytest.importorskip("kubernetes")
from fakes.kubernetes_api import FakeKubernetes  # noqa: E402 - needs the client
from fakes.kubernetes_kubelets import Exit, ImagePullError, Pending, Running, ScriptedKubelet, WaitUntilDeleted  # noqa: E402
from fakes.kubernetes_process import ProcessKubelet  # noqa: E402
from kubernetes import client as k8s  # noqa: E402

pytestmark = pytest.mark.timeout(300)
IMAGE = "registry.example.com/ml/nbbatch-contract:1"
PARAMETERS = "A = 1\nSLEEP = 0.0\nSTEPS = 0\nDATA_DIR = ''"
CELLS = ["import os, pathlib, time, nbbatch\nprint('ran', A, flush=True)\ntime.sleep(SLEEP)\n"
         "pathlib.Path(os.environ['NBBATCH_OUTPUT_DIR'], 'made.txt').write_text(str(A))\n"
         "seen = pathlib.Path(DATA_DIR, 'made.txt').read_text() if DATA_DIR else ''\nprint('seen', seen, flush=True)",
         "ckpt = pathlib.Path(os.environ['NBBATCH_CHECKPOINT_DIR']) / 'step.txt'\n"
         "start = int(ckpt.read_text()) if ckpt.exists() else 0\nprint('resumed from', start, flush=True)\n"
         "for step in range(start + 1, STEPS + 1):\n    nbbatch.record(step=step, loss=1.0 / step)\n"
         "    ckpt.write_text(str(step))\n    time.sleep(0.3)\n"
         "nbbatch.record(twice=A * 2, resumed_from=start)"]


class Cluster:
    """A fake cluster and the experiment files that reach it."""

    def __init__(self, kube: FakeKubernetes, project: Path, share: Path):
        self.kube, self.project, self.share = kube, project, share
        self.kubeconfig = kube.kubeconfig(project / "kubeconfig", namespace="ml")
        kube.add_namespace("ml")
        share.mkdir(exist_ok=True)

    def backend(self, **more: Any) -> dict[str, Any]:
        return {"name": "kubernetes", "kubeconfig": str(self.kubeconfig), "context": "fake", "namespace": "ml",
                "share": {"host_path": str(self.share)}, "images": {"*": IMAGE}, "poll_s": 0.2,
                # a stopped pod's launcher saves the notebook so far before its SIGKILL, also on two busy cores
                "cancel_grace_s": 15, "termination_grace_s": 30, **more}

    def experiment(self, name: str, grid: list[int], backend: dict[str, Any] | None = None,
                   **more: Any) -> dict[str, Any]:
        parameters = more.pop("parameters", {})
        return {"experiment": name, "notebooks": [{"path": "nb.ipynb", "kernel": "python3"}],
                "parameters": parameters, "sweep": {"grid": {"A": grid}}, "backend": backend or self.backend(),
                "share": str(self.share), **more}

    def records(self, name: str) -> dict[int, RunRecord]:
        try:
            return {r.parameters["A"]: r for r in api.status(name, share=str(self.share))}
        except NbbatchError:
            return {}

    def final(self, name: str, count: int, timeout: float = 240) -> dict[int, RunRecord]:
        def done() -> dict[int, RunRecord] | None:
            records = self.records(name)
            return records if len(records) == count and all(r.final for r in records.values()) else None
        return wait_until(done, timeout=timeout, message=f"{count} final run(s) of {name}", interval=0.3)


def _cluster(project: Path, tmp_path: Path, kubelet: Any, version: str = "1.31") -> Iterator[Cluster]:
    make_notebook(project / "nb.ipynb", CELLS, parameters=PARAMETERS)
    with FakeKubernetes(version=version, kubelet=kubelet) as kube:
        yield Cluster(kube, project, tmp_path / "share")


@pytest.fixture
def scripted(request, project, tmp_path) -> Iterator[Cluster]:
    """A fake cluster whose pods follow the test's script (``@pytest.mark.parametrize("script", ...)`` or the
    ``script`` marker's function of the pod)."""
    marker = request.node.get_closest_marker("script")
    kubelet = ScriptedKubelet(marker.args[0] if marker else None)
    version = marker.kwargs.get("version", "1.31") if marker else "1.31"
    yield from _cluster(project, tmp_path, kubelet, version)


@pytest.fixture
def processes(project, tmp_path) -> Iterator[Cluster]:
    """A fake cluster whose pods run their container's command here (root, unshare)."""
    why = ProcessKubelet.unavailable()
    if why:
        pytest.skip(why)
    yield from _cluster(project, tmp_path, ProcessKubelet())


def _refused(cluster: Cluster, spec: dict[str, Any]) -> str:
    with pytest.raises(NbbatchError) as refused:
        api.submit(spec, wait=False, progress=False)
    assert cluster.kube.jobs("ml") == [] and cluster.kube.pods("ml") == []  # nothing was made
    assert not list(cluster.share.glob("*/*/run.json"))  # nor recorded
    message = str(refused.value)
    assert "\n" not in message and message.endswith("Nothing was queued.")
    return message


# --- nothing is queued that the cluster would refuse --------------------------------------------------------------


def test_a_quota_the_runs_pods_would_exceed_refuses_the_submission(scripted):
    scripted.kube.add("resourcequotas", "ml", {"metadata": {"name": "gpu-quota"},
                                               "spec": {"hard": {"requests.nvidia.com/gpu": "1"}}})
    message = _refused(scripted, scripted.experiment("quota", [1], resources={"gpus": 2}))
    assert "exceeded quota: gpu-quota" in message and "ask for more quota" in message


def test_an_unknown_priority_class_a_limit_range_and_a_webhook_refuse_before_anything_runs(scripted):
    message = _refused(scripted, scripted.experiment("prio", [1], scripted.backend(priority_class="urgent")))
    assert "no PriorityClass with name urgent was found" in message and "`priority_class:`" in message
    scripted.kube.add("limitranges", "ml", {"metadata": {"name": "caps"}, "spec": {"limits": [
        {"type": "Container", "max": {"memory": "8Gi"}}]}})
    message = _refused(scripted, scripted.experiment("big", [1], scripted.backend(memory="16Gi")))
    assert "maximum memory usage per Container is 8Gi" in message and "LimitRange" in message
    scripted.kube.deny_with_webhook("policy.example.com", "images must come from the company registry")
    message = _refused(scripted, scripted.experiment("hooked", [1]))
    assert 'admission webhook "policy.example.com" denied the request' in message


def test_a_missing_namespace_is_named_with_the_command_that_makes_it(scripted):
    message = _refused(scripted, scripted.experiment("nons", [1], scripted.backend(namespace="research")))
    assert "the namespace `research` does not exist" in message and "kubectl create namespace research" in message


@pytest.mark.script([Running(), WaitUntilDeleted()])
def test_a_namespace_whose_limit_range_gives_defaults_keeps_them(scripted):
    scripted.kube.add("limitranges", "ml", {"metadata": {"name": "caps"}, "spec": {"limits": [
        {"type": "Container", "max": {"memory": "2Gi"}, "defaultRequest": {"cpu": "250m"}}]}})
    api.submit(scripted.experiment("fits", [1]), wait=False, progress=False)
    [job] = scripted.kube.jobs("ml")
    assert not job["spec"]["template"]["spec"]["containers"][0].get("resources")  # nbbatch's 1 CPU, 4Gi: not asked
    [pod] = wait_until(lambda: scripted.kube.pods("ml"), timeout=60, message="the pod made", interval=0.2)
    assert pod["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "250m", "memory": "2Gi"}  # the namespace's
    api.cancel("fits", share=str(scripted.share))


# --- what the Jobs and pods explain ---------------------------------------------------------------------------------


@pytest.mark.script([Pending("Unschedulable", "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."),
                     WaitUntilDeleted()])
def test_an_unschedulable_gpu_request_is_explained_and_cancel_deletes_the_job(scripted):
    api.submit(scripted.experiment("gpu", [1], resources={"gpus": 1}), wait=False, progress=False)
    record = wait_until(lambda: (r := scripted.records("gpu").get(1)) is not None and r.note and r, timeout=60,
                        message="the waiting note", interval=0.3)
    assert record.status == Status.QUEUED
    assert record.note == "waiting for a node: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    [job] = scripted.kube.jobs("ml")
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    api.cancel("gpu", share=str(scripted.share))
    [ended] = scripted.final("gpu", 1).values()
    assert ended.status == Status.CANCELLED and "before it started" in ended.error.reason
    wait_until(lambda: not scripted.kube.jobs("ml"), timeout=60, message="the Job deleted", interval=0.3)


@pytest.mark.script([ImagePullError('rpc error: code = NotFound desc = failed to pull and unpack image '
                                    f'"{IMAGE}": not found')])
def test_an_image_that_cannot_be_pulled_fails_its_runs_naming_image_and_registry(scripted):
    api.submit(scripted.experiment("pull", [1, 2], scripted.backend(registry="registry.example.com/ml")), wait=False,
               progress=False)
    records = scripted.final("pull", 2)
    for record in records.values():
        assert record.status == Status.FAILED and record.error.ename == "ImagePullError", record.error
        assert IMAGE in record.error.reason and "registry registry.example.com/ml" in record.error.reason
        assert "not found" in record.error.evalue and record.error.kind == ErrorKind.INFRA
    wait_until(lambda: not scripted.kube.jobs("ml"), timeout=60, message="the Job deleted", interval=0.3)


@pytest.mark.script([Running(), Exit(137, "OOMKilled")])
def test_an_oom_killed_pod_fails_its_run_naming_the_limit(scripted):
    api.submit(scripted.experiment("oom", [1], scripted.backend(memory="3Gi")), wait=False, progress=False)
    [record] = scripted.final("oom", 1).values()
    assert record.status == Status.FAILED and record.error.ename == "OOMKilled", record.error
    assert "(3Gi)" in record.error.evalue and "`memory:`" in record.error.reason


@pytest.mark.script([Running(), WaitUntilDeleted()], version="1.28")
def test_a_server_without_per_index_limits_gets_the_job_wide_one_and_a_deleted_job_is_named(scripted):
    api.submit(scripted.experiment("old", [1, 2], retries=1), wait=False, progress=False)
    [job] = scripted.kube.jobs("ml")
    assert "backoffLimitPerIndex" not in job["spec"] and job["spec"]["backoffLimit"] == 2
    k8s.BatchV1Api(scripted.kube.client()).delete_namespaced_job(job["metadata"]["name"], "ml",
                                                                 propagation_policy="Background")
    for record in scripted.final("old", 2).values():
        assert record.status == Status.FAILED and record.error.ename == "JobDeleted", record.error


# --- end to end: pods that run the notebook ---------------------------------------------------------------------------


@pytest.mark.kernel  # its pods run the notebook
def test_a_sweep_runs_at_most_its_limit_at_once_and_status_works_from_another_process(processes):
    spec = processes.experiment("six", [1, 2, 3, 4, 5, 6], resources={"max_parallel": 2}, parameters={"SLEEP": 1.0})
    api.submit(spec, wait=False, progress=False)
    [job] = processes.kube.jobs("ml")
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (6, 2)
    records = processes.final("six", 6)
    assert {r.status for r in records.values()} == {Status.SUCCEEDED}, [r.error for r in records.values()]
    spans = sorted((datetime.fromisoformat(r.started_at), datetime.fromisoformat(r.ended_at)) for r in records.values())
    overlap = max(sum(1 for s, e in spans if s <= start < e) for start, _end in spans)
    assert overlap <= 2, spans
    assert {r.metrics["twice"] for r in records.values()} == {2, 4, 6, 8, 10, 12}
    status = subprocess.run([sys.executable, "-m", "nbbatch", "status", "six", "--share", str(processes.share)],
                            capture_output=True, text=True, cwd=processes.project.parent)  # outside the project
    assert status.returncode == 0 and status.stdout.count("succeeded") >= 1, status.stdout + status.stderr


@pytest.mark.kernel  # its pods run the notebook
def test_an_evicted_pod_puts_its_run_back_in_the_queue_and_the_next_pod_resumes_it(processes):
    spec = processes.experiment("evict", [1], parameters={"STEPS": 60})  # 18 s: evicted at step 3
    api.submit(spec, wait=False, progress=False)
    share = open_share(str(processes.share))

    def at_step(step: int) -> RunRecord | None:
        record = processes.records("evict").get(1)
        history = run_paths("evict", record.run_id).metrics if record is not None else None
        return record if history and share.exists(history) and len(share.read_bytes(history).splitlines()) >= step \
            else None

    record = wait_until(lambda: at_step(3), timeout=180, message="step 3 recorded", interval=0.3)
    [pod] = [p for p in processes.kube.pods("ml") if (p.get("status") or {}).get("phase") == "Running"]
    processes.kube.evict(pod["metadata"]["name"])
    [ended] = processes.final("evict", 1, timeout=300).values()
    assert ended.status == Status.SUCCEEDED, ended.error
    assert ended.attempts == 2 and ended.metrics["resumed_from"] >= 3  # from its checkpoint, not from nothing
    assert ended.attempt_log[0].status == "queued", ended.attempt_log  # the interrupted attempt, back in the queue
    [job] = processes.kube.jobs("ml")  # the Job made a new pod for the index; the eviction did not count as a failure
    made = [e for e in processes.kube.events("ml", about=job["metadata"]["name"]) if e["reason"] == "SuccessfulCreate"]
    assert len(made) == 2 and not job["status"].get("failedIndexes"), job["status"]  # a new pod, the index not failed
    assert record.run_id == ended.run_id


@pytest.mark.kernel  # its pods run the notebook
def test_a_search_runs_its_trials_as_kubernetes_jobs(processes):
    pytest.importorskip("optuna")
    spec = processes.experiment("search", [1])
    spec.pop("sweep")
    spec["search"] = {"params": {"A": {"choice": [1, 5, 9]}}, "metric": "twice", "mode": "max", "trials": 2,
                      "sampler": "random", "seed": 3, "pruner": "none"}
    spec["resources"] = {"max_parallel": 1}
    path = processes.project / "search.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "nbbatch", "submit", str(path), "--wait"], capture_output=True,
                          text=True, cwd=processes.project, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    records = api.status("search", share=str(processes.share))
    assert len(records) == 2 and {r.status for r in records} == {Status.SUCCEEDED}
    assert all(r.backend == "kubernetes" and r.trial for r in records)
    assert len(processes.kube.jobs("ml")) == 2  # a trial is a launch of its own: a Job of its own


@pytest.mark.script([Running(), WaitUntilDeleted()])
def test_a_forced_resubmission_deletes_the_runs_earlier_job_and_watches_it_go_first(scripted):
    api.submit(scripted.experiment("again", [1, 2]), wait=False, progress=False)
    [first] = scripted.kube.jobs("ml")
    wait_until(lambda: len(scripted.kube.pods("ml")) == 2, timeout=60, message="the first Job's pods", interval=0.2)
    api.submit(scripted.experiment("again", [1, 2]), wait=False, progress=False, force=True)
    [second] = scripted.kube.jobs("ml")  # the first one was gone before the second was made
    assert second["metadata"]["name"] != first["metadata"]["name"]
    assert any("watch=true" in path and first["metadata"]["name"] in path for _method, path in scripted.kube.requests)
    api.cancel("again", share=str(scripted.share))


@pytest.mark.kernel  # its pods run the notebook
def test_a_pipeline_stage_runs_on_kubernetes_and_its_input_is_the_upstream_outputs_on_the_share(processes):
    backend = processes.backend()
    spec = {"pipeline": "study", "share": str(processes.share), "backend": backend, "stages": {
        "prep": {"notebooks": [{"path": "nb.ipynb", "kernel": "python3"}], "sweep": {"grid": {"A": [2, 3]}},
                 "select": {"metric": "twice", "mode": "max"}},
        "final": {"notebooks": [{"path": "nb.ipynb", "kernel": "python3"}],
                  "parameters": {"A": "${prep.best.parameters.A}", "STEPS": 1},
                  "inputs": {"DATA_DIR": "${prep.best.outputs}"}}}}
    path = processes.project / "study.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "nbbatch", "submit", str(path), "--wait"], capture_output=True,
                          text=True, cwd=processes.project, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    [final] = api.status("study.final", share=str(processes.share))
    assert final.status == Status.SUCCEEDED and final.backend == "kubernetes" and final.parameters["A"] == 3
    log = open_share(str(processes.share)).read_bytes(run_paths("study.final", final.run_id).log).decode()
    assert "seen 3" in log  # the best prep run's outputs/, read in the pod through the share's mount
    assert final.origins and final.inputs["DATA_DIR"]


@pytest.mark.script([Running(), WaitUntilDeleted()])
@pytest.mark.parametrize("name", ["Sweep.LR_final-2026", "a-very-long-experiment-name-" * 3 + "end"])
def test_any_experiment_name_makes_names_and_labels_the_server_takes(scripted, name):
    api.submit(scripted.experiment(name, [1]), wait=False, progress=False)  # the fake refuses what a server refuses
    [job] = scripted.kube.jobs("ml")
    assert job["metadata"]["annotations"]["nbbatch.io/experiment"] == name
    assert scripted.records(name)[1].status == Status.QUEUED  # its pod runs (no launcher writes here)
    api.cancel(name, share=str(scripted.share))
