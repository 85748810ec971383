"""The kubernetes backend's pods run for real, with ``podman kube play`` (no cluster can run on these machines).

``nbbatch.submit`` runs as a user runs it, against a stand-in for the backend's API (:class:`TakesEverything`: a
cluster that accepts every object and keeps what it was asked to make), so the launches, the notebook copy and the
queued records are written to the share by the backend's own code and its Jobs are its own manifests. Each Job's
pods are derived as the Job controller derives them (``pod_for_index``) and played on a :class:`support.kubeplay.KubeNode`
(what podman 4.3 does of a Pod and what the node does first: see its docstring): a sweep's index runs its notebook
and records it on the share through the claim's volume; a 2-pod PyTorch gang meets at ``<job>-0.<job>:29500``
through its headless Service's DNS, each pod in its own network namespace, and ends with equal weights on both ranks;
a pod stopped mid-cell (SIGTERM, then SIGKILL after its grace) keeps its notebook so far and ends ``cancelled`` after
``nbbatch cancel``'s marker, or goes back to ``queued`` without one (an eviction). Nothing is left behind.

End to end, the fake API server of issue 47 (``fakes.kubernetes_api``: the official client, its Job controller) with
:class:`support.kubeplay.PodmanKubelet` as its kubelet: ``nbbatch.submit`` of a sweep and of a gang, and ``nbbatch
cancel`` of a running and a queued run, with every pod played for real (skipped until the fake is merged).

The pods run this checkout's nbbatch, mounted over the image's (as the local container runner does): an image is
rebuilt only when its pins change, so the session's image may hold an older nbbatch.

Needs root, podman, runc and mmdebstrap (``.ci/run`` installs them); skipped with the reason otherwise.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import nbformat
import pytest
import yaml
from fakes.kubernetes_api import FakeKubernetes
from fakes.kubernetes_jobs import pod_for_index  # the Job controller's derivation, as the fake API server's
from fakes.kubernetes_kubelets import PodReporter
from support.kubeplay import KubeNode, PodmanKubelet, expand, give_to_group, leftovers, playable, resolved_env
from support.waiting import wait_until

import nbbatch
from nbbatch import api
from nbbatch.backends.kubernetes import backend as kubernetes_backend
from nbbatch.backends.kubernetes.manifests import (
    PodSettings,
    PodShape,
    gang_job,
    gang_service,
    sweep_job,
)
from nbbatch.backends.kubernetes.states import KubernetesJob
from nbbatch.execute.launch import RUN_ONE_NOT_DONE, RUN_ONE_REQUEUED, LaunchSpec
from nbbatch.metrics import metrics_from_notebook
from nbbatch.plan.runs import Run
from nbbatch.spec.resources import Distribution
from nbbatch.store.runfiles import cancel_request, load_records, read_record, write_cancel_markers
from nbbatch.store.share import FileShare

SOURCE = Path(nbbatch.__file__).resolve().parent
IN_IMAGE_SOURCE = "/opt/nbbatch/src/nbbatch"  # the image's nbbatch (dockerfiles/Dockerfile)
CLAIM = "results"
NAMESPACE = "nbbatch-test"
RUN_TIMEOUT_S = 420


def real(test):
    """A test that plays pods of a framework image: marked container and kernel."""
    return pytest.mark.container(pytest.mark.kernel(pytest.mark.timeout(600)(test)))


# --- the translation to what kube play 4.3 takes (no podman needed) -----------------------------------------------


def _job(gang: bool = False) -> dict[str, Any]:
    settings = PodSettings(namespace="ml", share_volume={"persistentVolumeClaim": {"claimName": CLAIM}},
                           share_sub_path="nbbatch", fs_group=10001, env={"MODE": "a$(MODE)b"})
    shape = PodShape("img:1", cpu="1", memory="2Gi")
    run = Run("r1", "exp", "nb.ipynb", "nb.ipynb", "k")
    if gang:
        run = Run("r1", "exp", "nb.ipynb", "nb.ipynb", "k",
                  distribution=Distribution("torch", nodes=2, processes_per_node=1, gpus_per_node=0))
        return gang_job("nb-exp-abc123-0", "exp", "abc123", run, shape, settings, "/mnt/nbbatch/share/l")
    return sweep_job("nb-exp-abc123-0", "exp", "abc123", [run, run], shape, settings, "/mnt/nbbatch/share/l", 2, True)


def test_kubernetes_variable_expansion():
    values = {"A": "1", "EMPTY": ""}
    assert expand("x$(A)y$(EMPTY)z", values) == "x1yz"
    assert expand("$(UNKNOWN) $$(A) $${A} ${A} $ $", values) == "$(UNKNOWN) $(A) ${A} ${A} $ $"
    assert expand("$(A", values) == "$(A"


def test_a_pod_becomes_what_kube_play_takes(tmp_path):
    """The kubelet's part, done before kube play: fieldRefs resolved (podman refuses metadata.namespace), ``$(VAR)``
    expanded, the claim its volume, a subPath its own folder, fsGroup the container's group, emptyDirs the pod's own
    folders (a memory one on a tmpfs), extra mounts read-only, the node's label."""
    pod = pod_for_index(_job(gang=True), 1)
    pod["spec"]["containers"][0]["env"].append({"name": "NS", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.namespace"}}})
    claim = tmp_path / "volume"
    ready = playable(pod, {CLAIM: ("vol-x", claim)}, tmp_path / "scratch", tmp_path / "memory",
                     mounts={"/opt/src": tmp_path / "src"}, labels={"nbbatch.io/kubeplay": "t"})
    spec = ready.manifest["spec"]
    (container,) = spec["containers"]
    env = {v["name"]: v["value"] for v in container["env"]}
    assert env["JOB_COMPLETION_INDEX"] == "1" and env["NS"] == "ml" and env["MODE"] == "a$(MODE)b"
    assert all("valueFrom" not in v for v in container["env"])
    assert "ports" not in container
    assert container["command"] == pod["spec"]["containers"][0]["command"]  # no $(…) in the backend's command
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert volumes["share"] == {"name": "share", "persistentVolumeClaim": {"claimName": "vol-x"}}
    shared = volumes[mounts["/mnt/nbbatch/share"]["name"]]
    assert shared["hostPath"]["path"] == str(claim / "nbbatch") and "subPath" not in mounts["/mnt/nbbatch/share"]
    assert volumes["dshm"]["hostPath"]["path"] == str(tmp_path / "memory" / "dshm")
    assert volumes[mounts["/opt/src"]["name"]]["hostPath"]["path"] == str(tmp_path / "src")
    assert mounts["/opt/src"]["readOnly"] is True
    assert spec["securityContext"] == {"supplementalGroups": [10001]} and ready.fs_group == 10001
    assert ready.owned == [claim] and set(ready.folders) == {claim / "nbbatch", tmp_path / "memory" / "dshm"}
    assert ready.grace_s == 30 and ready.manifest["metadata"]["labels"]["nbbatch.io/kubeplay"] == "t"
    with pytest.raises(ValueError, match="claim 'results', which the node does not have"):
        playable(pod, {"other-claim": ("v", claim)}, tmp_path, tmp_path)


def test_a_gang_pod_is_named_in_dns_only_by_a_headless_service_that_selects_it():
    """As the cluster DNS: ``<hostname>.<subdomain>`` exists when a headless Service named as the subdomain selects
    the pod (the gang's Service selects its Job's pods by the label the Job controller gives them)."""
    job = _job(gang=True)
    job["metadata"]["uid"] = "u1"
    pods = [pod_for_index(job, index) for index in (0, 1)]
    node = KubeNode()
    try:
        assert [node.dns_name(pod) for pod in pods] == [None, None]
        node.serve(gang_service(job))
        assert [node.dns_name(pod) for pod in pods] == ["nb-exp-abc123-0-0.nb-exp-abc123-0", "nb-exp-abc123-0-1.nb-exp-abc123-0"]
        assert node.dns_name({**pods[0], "metadata": {**pods[0]["metadata"], "labels": {}}}) is None
    finally:
        node.close()


def test_the_backends_env_reaches_the_pod_as_written():
    """Kubernetes expands ``$(VAR)`` in env values and makes ``$$`` one ``$``: the backend's ``env:`` values are
    escaped, so the pod gets them as written, as every other backend passes them on."""
    written = {"LITERAL": "a$(JOB_COMPLETION_INDEX)b$$c$d", "PLAIN": "x y"}
    settings = PodSettings(namespace="ml", share_volume={"persistentVolumeClaim": {"claimName": CLAIM}}, env=written)
    run = Run("r1", "exp", "nb.ipynb", "nb.ipynb", "k")
    job = sweep_job("nb-exp-abc123-0", "exp", "abc123", [run, run], PodShape("img:1"), settings, "/mnt/l", 2, True)
    pod = pod_for_index(job, 1)
    env = {v["name"]: v["value"] for v in resolved_env(pod, pod["spec"]["containers"][0])}
    assert {k: env[k] for k in written} == written and env["JOB_COMPLETION_INDEX"] == "1"


def test_what_run_one_loads_in_a_pod_needs_no_kubernetes_client():
    """The images carry nbbatch without the ``kubernetes`` extra: run-one's hooks for the backend (a gang's
    placement, a stop signal's reason) load without the client (seen: a gang's pods failed with "the `kubernetes`
    backend needs its extra")."""
    code = ("import sys; sys.modules['kubernetes'] = None\n"
            "from nbbatch.backends import node_stop_hook\n"
            "from nbbatch.backends.placement import placement_reader\n"
            "placement_reader('kubernetes'); node_stop_hook('kubernetes'); print('loaded')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "loaded", done.stderr[-2000:]


def test_fs_group_ownership_is_the_kubelets(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "f").write_text("x")
    (tmp_path / "a" / "f").chmod(0o600)
    give_to_group(tmp_path / "a", 4242)
    for path, mode in ((tmp_path / "a", 0o2775), (tmp_path / "a" / "b", 0o2775), (tmp_path / "a" / "f", 0o660)):
        assert path.stat().st_gid == 4242 and path.stat().st_mode & 0o7777 == mode, path


# --- for real -------------------------------------------------------------------------------------------------------


class TakesEverything:
    """The backend's ``api`` on a cluster that accepts every object: what it is asked to make, kept with a uid.
    Dry runs are answered as the server answers them (the object, unstored)."""

    server = "https://kubeplay.invalid:6443"

    def __init__(self, namespace: str, *_args: Any, **_kwargs: Any) -> None:
        self.namespace, self.created = namespace, []

    def read_namespace(self) -> dict[str, Any]:
        return {"metadata": {"name": self.namespace}}

    def version(self) -> tuple[int, int]:
        return (1, 30)

    def limit_ranges(self) -> list[dict[str, Any]]:
        return []

    def create(self, manifest: Mapping[str, Any], dry_run: bool = False) -> dict[str, Any]:
        made = copy.deepcopy(dict(manifest))
        if not dry_run:
            made["metadata"]["uid"] = str(uuid.uuid4())
            self.created.append(made)
        return made

    def jobs(self, selector: str) -> list[dict[str, Any]]:
        return [made for made in self.created if made["kind"] == "Job" and _selected(selector, made)]

    def pods(self, selector: str) -> list[dict[str, Any]]:
        return []

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [made for made in self.created if made["kind"] == kind]


def _selected(selector: str, made: Mapping[str, Any]) -> bool:
    labels = made["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in (term.split("=", 1) for term in selector.split(",")))


@pytest.fixture
def cluster(monkeypatch) -> Iterator[list[TakesEverything]]:
    """The APIs the kubernetes backends of the test were given (one per backend made)."""
    made: list[TakesEverything] = []

    def api_of(namespace: str, *args: Any, **kwargs: Any) -> TakesEverything:
        made.append(TakesEverything(namespace))
        return made[-1]

    monkeypatch.setattr(kubernetes_backend, "KubernetesApi", api_of)
    yield made


@pytest.fixture
def volume(tmp_path) -> Path:
    """The claim's folder (its PersistentVolume); the experiment's share is its ``nbbatch`` folder (``share_path``,
    the pods' subPath)."""
    folder = tmp_path / "volume"
    (folder / "nbbatch").mkdir(parents=True)
    return folder


@pytest.fixture
def node(volume) -> Iterator[KubeNode]:
    """A node whose claim ``results`` is ``volume``, with this checkout's nbbatch over the image's; checks at the end
    that it left nothing behind."""
    with KubeNode(claims={CLAIM: volume}, mounts={IN_IMAGE_SOURCE: SOURCE}) as the_node:
        yield the_node
    assert leftovers(the_node.token) == []


def _experiment(tmp_path: Path, volume: Path, name: str, framework: str, image: str, **more: Any) -> Path:
    spec = {"experiment": name, "frameworks": [framework], "share": str(volume / "nbbatch"),
            "backend": {"name": "kubernetes", "namespace": NAMESPACE, "share": {"pvc": CLAIM}, "share_path": "nbbatch",
                        "images": {framework: image}}, **more}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _submitted(cluster: list[TakesEverything], path: Path) -> TakesEverything:
    """Submit the experiment as a user does (``nbbatch.submit``, not waiting: the Jobs are made)."""
    api.submit(str(path), wait=False, progress=False)
    (made,) = cluster
    return made


def _by_index(share: Path, experiment: str, job: Mapping[str, Any]) -> dict[int, LaunchSpec]:
    """The launches of ``job``'s indexes, read where its pods read them (the folder each run's Job file names)."""
    fs, launches = FileShare(share), {}
    for record in load_records(fs, experiment)[0]:
        where = KubernetesJob.read(fs, experiment, record.run_id)
        assert where is not None and where.job == job["metadata"]["name"], record.run_id
        launches[where.index] = LaunchSpec.from_json((share / where.submission / f"{where.index}.json").read_text())
        assert launches[where.index].run.run_id == record.run_id
    return launches


@real
def test_an_index_of_a_sweep_job_runs_its_run_and_records_it_on_the_claim(chainer_image, cluster, node, volume,
                                                                          tmp_path):
    """Index 1 of a 2-run Chainer sweep: its pod reads its launch and the notebook where the backend wrote them,
    runs as the image's user (uid 10001) and writes the run's record, log and notebook to the claim's volume.

    The claim's folder is given to the Job's ``fsGroup`` (10001) before the pod starts, as the kubelet does for a
    volume whose driver supports ownership (a ReadWriteMany claim of e.g. CephFS or a CSI driver with fsGroupPolicy
    File); without it the pod could not write into the run folders the backend made (root's, 0755)."""
    name = "kube-sweep"
    path = _experiment(tmp_path, volume, name, "chainer", chainer_image.ref,
                       parameters={"DATASET": "digits", "EPOCHS": 1, "MAX_SAMPLES": 200},
                       sweep={"grid": {"LR": [0.01, 0.05]}})
    made = _submitted(cluster, path)
    (job,) = made.of_kind("Job")
    assert job["spec"]["completions"] == 2 and job["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001
    share = volume / "nbbatch"
    launches = _by_index(share, name, job)
    assert sorted(launches) == [0, 1]
    with node.play(pod_for_index(job, 1)) as pod:
        code = pod.wait(RUN_TIMEOUT_S)
        log = pod.logs()
    assert code == 0, log[-3000:]
    fs = FileShare(share)
    ran, other = read_record(fs, name, launches[1].run.run_id), read_record(fs, name, launches[0].run.run_id)
    assert ran.status == "succeeded", (ran.error, log[-3000:])
    assert ran.backend == "kubernetes" and ran.metrics["accuracy"] > 0
    assert ran.parameters["LR"] == launches[1].run.parameters["LR"]
    assert other.status == "queued"  # index 0's pod was never played
    folder = share / name / ran.run_id
    notebook = nbformat.read(folder / "output.ipynb", as_version=4)
    assert metrics_from_notebook(notebook)["accuracy"] == ran.metrics["accuracy"]
    assert (folder / "run.json").stat().st_uid == 10001  # the pod's user wrote it


@real
@pytest.mark.parametrize("cancelled", [True, False], ids=["cancel", "eviction"])
def test_a_pod_stopped_mid_cell_keeps_its_notebook(chainer_image, cluster, node, volume, tmp_path, cancelled):
    """SIGTERM to the pod's container mid-cell (SIGKILL after the pod's grace period): run-one stops the kernel and
    saves the notebook as far as it ran. After ``nbbatch cancel``'s marker (then its Job is deleted) the run ends
    ``cancelled``; without one (the cluster took the pod: an eviction, a preemption, a drain) it goes back to
    ``queued``, for a new pod to resume it: run-one exits 1 (not done: never again) or 75 (requeued: run it again)."""
    name = f"kube-stop-{'cancel' if cancelled else 'evicted'}"
    path = _experiment(tmp_path, volume, name, "chainer", chainer_image.ref,
                       parameters={"DATASET": "digits", "EPOCHS": 500, "MAX_SAMPLES": 1000})
    made = _submitted(cluster, path)
    (job,) = made.of_kind("Job")
    fs = FileShare(volume / "nbbatch")
    with node.play(pod_for_index(job, 0)) as pod:
        running = wait_until(lambda: next((r for r in load_records(fs, name)[0]
                                           if r.status == "running" and r.cells_done >= 2), None),
                             timeout=RUN_TIMEOUT_S, message="the run running its cells", interval=0.5)
        if cancelled:
            write_cancel_markers(fs, name, [running.run_id], cancel_request("`nbbatch cancel`"))
        pod.terminate()
        code = pod.wait(120)
        log = pod.logs()
    assert code == (RUN_ONE_NOT_DONE if cancelled else RUN_ONE_REQUEUED), log[-3000:]
    record = read_record(fs, name, running.run_id)
    if cancelled:
        assert record.status == "cancelled" and "nbbatch cancel" in record.error.reason, (record.error, log[-3000:])
    else:
        assert record.status == "queued" and record.error.ename == "PodInterrupted", (record.error, log[-3000:])
    partial = nbformat.read(volume / "nbbatch" / name / running.run_id / "output.ipynb", as_version=4)
    executed = [cell for cell in partial.cells if cell.get("execution_count")]
    assert 2 <= len(executed) < len(partial.cells), "the cells run so far, kept"


def _fake_cluster(node: KubeNode) -> Any:
    """The fake API server with a PodmanKubelet on ``node``."""
    return FakeKubernetes(kubelet=PodmanKubelet(node, PodReporter))


def _submit_to(kube: Any, path: Path, tmp_path: Path, **settings: Any) -> tuple[list[Any], list[dict[str, Any]], dict]:
    """``nbbatch.submit`` (waiting) of ``path`` to the fake server: the records, and the pods and their logs once
    they ended (the records are final first: run-one exits just after writing them)."""
    kube.add_namespace(NAMESPACE)
    spec = yaml.safe_load(path.read_text())
    spec["backend"].update(kubeconfig=str(kube.kubeconfig(tmp_path / "kubeconfig", NAMESPACE)), context="fake",
                           **settings)
    path.write_text(yaml.safe_dump(spec))
    result = api.submit(str(path), wait=True, progress=False)
    pods = kube.wait_for(lambda: (found := kube.pods(NAMESPACE)) and all(
        p["status"].get("phase") in ("Succeeded", "Failed") for p in found) and found, timeout=120,
        message="the pods ended")
    return result.records, pods, {p["metadata"]["name"]: kube.log(NAMESPACE, p["metadata"]["name"]) for p in pods}


@real
def test_submit_against_the_fake_api_server_runs_its_pods_for_real(chainer_image, node, volume, tmp_path):
    """End to end: ``nbbatch.submit`` through the official client to the fake API server, whose Job controller makes
    the sweep's pods, one at a time (``max_parallel: 1``), and whose kubelet plays them for real."""
    path = _experiment(tmp_path, volume, "kube-e2e", "chainer", chainer_image.ref,
                       parameters={"DATASET": "digits", "EPOCHS": 1, "MAX_SAMPLES": 200},
                       sweep={"grid": {"LR": [0.01, 0.05]}})
    with _fake_cluster(node) as kube:
        records, pods, logs = _submit_to(kube, path, tmp_path, max_parallel=1)
    assert [r.status for r in records] == ["succeeded", "succeeded"], ([r.error for r in records], logs)
    assert sorted(pod["status"]["phase"] for pod in pods) == ["Succeeded", "Succeeded"]
    assert all(": succeeded" in log for log in logs.values()), logs  # run-one's last line, in the pod's log


@real
def test_a_gang_job_of_two_pods_meets_through_its_headless_service(pytorch_image, cluster, node, volume, tmp_path):
    """A 2-node PyTorch run (DDP over gloo): its Job's two pods, each in its own network namespace, its ranks meeting
    at ``<job>-0.<job>:29500``, the name its headless Service gives index 0's pod; equal weights on both ranks."""
    name = "kube-gang"
    path = _experiment(tmp_path, volume, name, "pytorch", pytorch_image.ref,
                       parameters={"DATASET": "digits", "EPOCHS": 2, "MAX_SAMPLES": 400},
                       resources={"nodes": 2, "processes_per_node": 1}, distribution={"type": "torch"})
    made = _submitted(cluster, path)
    (job,), (service,) = made.of_kind("Job"), made.of_kind("Service")
    node.serve(service)
    manifests = [pod_for_index(job, index) for index in range(job["spec"]["completions"])]
    assert [node.dns_name(pod) for pod in manifests] == [f"{job['metadata']['name']}-{i}.{job['metadata']['name']}"
                                                         for i in (0, 1)]
    pods = [node.play(pod) for pod in manifests]
    codes = [pod.wait(RUN_TIMEOUT_S) for pod in pods]
    logs = [pod.logs()[-2000:] for pod in pods]
    assert codes == [0, 0], logs
    run_id = _by_index(volume / "nbbatch", name, job)[0].run.run_id
    record = read_record(FileShare(volume / "nbbatch"), name, run_id)
    assert record.status == "succeeded", (record.error, logs)
    assert record.world_size == 2 and [(r.node, r.status) for r in record.ranks] == [(0, "succeeded"), (1, "succeeded")]
    folder = volume / "nbbatch" / name / run_id
    zero, one = (metrics_from_notebook(nbformat.read(folder / "ranks" / str(r) / "output.ipynb", 4)) for r in (0, 1))
    assert zero["world_size"] == one["world_size"] == 2
    assert zero["weights_checksum"] == pytest.approx(one["weights_checksum"], rel=1e-6)
    assert abs(zero["weights_checksum"] - zero["initial_weights_checksum"]) > 1e-3


@real
def test_cancel_through_the_fake_api_server_stops_a_running_pod_and_a_queued_run(chainer_image, node, volume,
                                                                                  tmp_path):
    """``nbbatch cancel`` of a 2-run sweep, one at a time: the queued run (no pod yet) ends at once; the running one
    stops itself through the share's marker, keeping its notebook so far; then the Job goes with its pods."""
    name = "kube-e2e-cancel"
    path = _experiment(tmp_path, volume, name, "chainer", chainer_image.ref,
                       parameters={"DATASET": "digits", "EPOCHS": 500, "MAX_SAMPLES": 1000},
                       sweep={"grid": {"LR": [0.01, 0.05]}})
    fs = FileShare(volume / "nbbatch")
    with _fake_cluster(node) as kube:
        kube.add_namespace(NAMESPACE)
        spec = yaml.safe_load(path.read_text())
        spec["backend"].update(kubeconfig=str(kube.kubeconfig(tmp_path / "kubeconfig", NAMESPACE)), context="fake",
                               max_parallel=1)
        path.write_text(yaml.safe_dump(spec))
        api.submit(str(path), wait=False, progress=False)
        running = wait_until(lambda: next((r for r in load_records(fs, name)[0]
                                           if r.status == "running" and r.cells_done >= 2), None),
                             timeout=RUN_TIMEOUT_S, message="a run running its cells", interval=0.5)
        assert len(api.cancel(name, share=str(volume / "nbbatch"))) == 2
        kube.wait_for(lambda: not kube.jobs(NAMESPACE) and not kube.pods(NAMESPACE), timeout=120,
                      message="the Job and its pods gone")
    records = {r.run_id: r for r in load_records(fs, name)[0]}
    assert {r.status for r in records.values()} == {"cancelled"}, {r.run_id: r.error for r in records.values()}
    partial = nbformat.read(volume / "nbbatch" / name / running.run_id / "output.ipynb", as_version=4)
    assert len([cell for cell in partial.cells if cell.get("execution_count")]) >= 2
    (queued,) = set(records) - {running.run_id}
    assert not (volume / "nbbatch" / name / queued / "output.ipynb").exists()  # it never ran
