"""The kubernetes backend's pure parts: its settings, the manifests it makes, and what it reads from Jobs and pods.

What the API server does with these manifests is tests/test_kubernetes_backend.py's (against the fake API server);
what a container does with them is tests/test_kubernetes_podman.py's (``podman kube play``).
"""

from __future__ import annotations

import re
import subprocess

import pytest

from nbbatch.backends import get_backend
from nbbatch.backends.kubernetes.backend import _refusal_words
from nbbatch.backends.kubernetes.cluster import KubernetesRefusal
from nbbatch.backends.kubernetes.manifests import (
    SHARE_MOUNT,
    PodSettings,
    PodShape,
    check_pod,
    experiment_selector,
    gang_job,
    gang_service,
    job_name,
    label_value,
    sweep_job,
)
from nbbatch.backends.kubernetes.settings import share_volume
from nbbatch.backends.kubernetes.states import (
    ended_without_record,
    evicted,
    indexes,
    pods_of_index,
    start_failure,
    waiting_note,
)
from nbbatch.errors import NbbatchError
from nbbatch.plan.runs import Run
from nbbatch.spec.resources import Distribution

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
PODS = PodSettings(namespace="ml", share_volume={"persistentVolumeClaim": {"claimName": "results"}},
                   node_selector={"pool": "gpu"}, tolerations=[{"key": "gpu", "operator": "Exists"}],
                   priority_class="batch", service_account="nbbatch", image_pull_secrets=["regcred"], fs_group=10001)


def _run(run_id: str = "pytorch-abc123", **more) -> Run:
    return Run(run_id=run_id, experiment="Sweep.LR", notebook="/p/notebooks/nb.ipynb", notebook_rel="notebooks/nb.ipynb",
               kernel="nbbatch-pytorch", framework="pytorch", **more)


# --- settings ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("share", "volume"), [
    ({"pvc": "results"}, {"persistentVolumeClaim": {"claimName": "results"}}),
    ({"nfs": "nfs.lab:/export/results"}, {"nfs": {"server": "nfs.lab", "path": "/export/results"}}),
    ({"azfiles": {"share_name": "results", "secret_name": "azure-files"}},
     {"csi": {"driver": "file.csi.azure.com", "volumeAttributes": {"shareName": "results", "secretName": "azure-files"}}}),
    ({"host_path": "/data/results"}, {"hostPath": {"path": "/data/results", "type": "Directory"}}),
])
def test_each_share_setting_is_a_pod_volume(share, volume):
    assert share_volume(share) == volume


@pytest.mark.parametrize(("settings", "words"), [
    ({}, "needs `share:`"),
    ({"share": {"s3": "bucket"}}, "exactly one of `pvc: CLAIM`"),
    ({"share": {"nfs": "no-path"}}, "`nfs: SERVER:/PATH`"),
    ({"share": {"azfiles": {"share_name": "x"}}}, "secret_name"),
    ({"share": {"pvc": "r"}, "namespace": "ML_Team"}, "not a Kubernetes namespace name"),
    ({"share": {"pvc": "r"}, "memory": "4GB"}, "`memory: 4GB` is not a Kubernetes quantity"),
    ({"share": {"pvc": "r"}, "cpu": "two"}, "`cpu: two` is not a Kubernetes quantity"),
    ({"share": {"pvc": "r"}, "env": {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz123456"}}, "looks like a secret"),
    ({"share": {"pvc": "r"}, "namspace": "ml"}, "did you mean `namespace`"),
])
def test_a_bad_setting_is_one_line_naming_the_fix(settings, words):
    with pytest.raises(NbbatchError) as refused:
        get_backend("kubernetes", **settings)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    assert "hf_abcdefghijklmnopqrstuvwxyz123456" not in str(refused.value)


# --- names --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("experiment", ["Sweep.LR", "a" * 200, "数据-sweep", "--", "x_y z/w", "MNIST"])
def test_names_and_labels_are_what_kubernetes_takes_whatever_the_experiment(experiment):
    name = job_name(experiment, "3f9a1c", 12)
    assert DNS_LABEL.match(name) and len(name) <= 47  # <job>-<index>-<5> stays a 63-character host name
    value = label_value(experiment)
    assert LABEL_VALUE.match(value) and len(value) <= 63
    assert label_value("Sweep.LR") == "Sweep.LR"  # a value Kubernetes takes is kept as it is
    assert label_value("a" * 200) != label_value("a" * 199)  # cut names stay apart by their hash
    assert experiment_selector(experiment).endswith(f"nbbatch.io/experiment={value}")


# --- a sweep's Job --------------------------------------------------------------------------------------------------


def test_a_sweep_is_one_indexed_job_holding_the_parallel_limit():
    runs = [_run(f"pytorch-{i}") for i in range(6)]
    job = sweep_job("nb-sweep-lr-3f9a1c-0", "Sweep.LR", "3f9a1c", runs, PodShape("reg/nbbatch-pytorch:fp", gpus=1,
                    cpu="4", memory="16Gi", retries=2), PODS, f"{SHARE_MOUNT}/Sweep.LR/.kubernetes/3f9a1c/j", 2, True)
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 6, 2)
    assert spec["backoffLimitPerIndex"] == 2  # pod deaths (OOMKilled, a crash) retried per run
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1]["action"] == "FailIndex" and rules[1]["onExitCodes"]["values"] == [1]  # recorded: never again
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["securityContext"] == {"fsGroup": 10001}
    assert (pod["nodeSelector"], pod["priorityClassName"], pod["serviceAccountName"]) == ({"pool": "gpu"}, "batch",
                                                                                           "nbbatch")
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["tolerations"][0]["key"] == "gpu"
    container = pod["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                                      "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"}}
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {SHARE_MOUNT, "/dev/shm"}
    assert job["metadata"]["labels"]["nbbatch.io/experiment"] == "Sweep.LR"
    assert spec["template"]["metadata"]["labels"] == job["metadata"]["labels"]


def test_a_server_without_per_index_limits_gets_a_job_wide_one():
    job = sweep_job("j", "e", "s", [_run("a"), _run("b")], PodShape("i", retries=1), PODS, "/x", None, False)
    assert "backoffLimitPerIndex" not in job["spec"] and job["spec"]["backoffLimit"] == 2
    assert [r["action"] for r in job["spec"]["podFailurePolicy"]["rules"]] == ["Ignore"]
    assert job["spec"]["parallelism"] == 2  # no limit: every run at once


def test_the_pods_command_runs_run_one_on_its_own_index_through_a_shell(tmp_path):
    folder = f"{SHARE_MOUNT}/it's a sweep/.kubernetes/s/j"  # quotes and spaces survive the shell
    job = sweep_job("j", "e", "s", [_run()], PodShape("i"), PodSettings("ml", {"emptyDir": {}}, python="echo"),
                    folder, None, True)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    said = subprocess.run(command, env={"JOB_COMPLETION_INDEX": "7", "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, check=True).stdout.split()
    assert said[:3] == ["-m", "nbbatch", "run-one"] and " ".join(said[3:]) == f"{folder}/7.json"


# --- a distributed run's gang ---------------------------------------------------------------------------------------


def test_a_gang_is_an_indexed_job_of_one_pod_per_node_behind_a_headless_service():
    run = _run(distribution=Distribution(nodes=2, processes_per_node=1, gpus_per_node=0, type="torch"))
    job = gang_job("nb-ddp-3f9a1c-1", "ddp", "3f9a1c", run, PodShape("i", gpus=2), PODS, "/m/j")
    spec = job["spec"]
    assert (spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (2, 2, 0)  # one failed node ends it
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "nb-ddp-3f9a1c-1"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["NBBATCH_ENDPOINTS"] == "nb-ddp-3f9a1c-1-0.nb-ddp-3f9a1c-1:29500,nb-ddp-3f9a1c-1-1.nb-ddp-3f9a1c-1:29500"
    echoed = gang_job("nb-ddp-3f9a1c-1", "ddp", "3f9a1c", run, PodShape("i"), PodSettings("ml", {}, python="echo"), "/m/j")
    said = subprocess.run(echoed["spec"]["template"]["spec"]["containers"][0]["command"], capture_output=True,
                          env={"JOB_COMPLETION_INDEX": "1", "PATH": "/usr/bin:/bin"}, text=True, check=True)
    assert said.stdout.split()[-1] == "/m/j/0.json"  # every node reads the run's one launch
    assert 'export NBBATCH_NODE_RANK="${JOB_COMPLETION_INDEX}"' in pod["containers"][0]["command"][-1]
    service = gang_service({**job, "metadata": {**job["metadata"], "uid": "u-1"}})
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": "nb-ddp-3f9a1c-1"}
    assert service["metadata"]["ownerReferences"][0]["uid"] == "u-1"  # it goes with its Job
    checked = check_pod(job)
    assert checked["kind"] == "Pod" and checked["spec"] == pod  # the pod the quota and admission judge


# --- what Jobs and pods say ------------------------------------------------------------------------------------------


def _pod(index: int, created: str = "2026-11-28T10:00:00Z", **status) -> dict:
    return {"metadata": {"name": f"j-{index}-abcde", "creationTimestamp": created,
                         "labels": {"batch.kubernetes.io/job-name": "j"},
                         "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}},
            "spec": {"containers": [{"image": "reg/nbbatch-pytorch:fp", "resources": {"limits": {"memory": "4Gi"}}}]},
            "status": status}


def test_the_indexes_of_a_job_status():
    assert indexes("0-2,5,7-8") == {0, 1, 2, 5, 7, 8} and indexes("") == set() and indexes(None) == set()


def test_pods_of_an_index_oldest_first():
    pods = [_pod(1, "2026-11-28T10:05:00Z"), _pod(2), _pod(1, "2026-11-28T10:00:00Z")]
    assert [p["metadata"]["creationTimestamp"] for p in pods_of_index(pods, "j", 1)] == ["2026-11-28T10:00:00Z",
                                                                                          "2026-11-28T10:05:00Z"]


def test_why_a_pod_waits_and_why_it_never_starts():
    unschedulable = _pod(0, phase="Pending", conditions=[{"type": "PodScheduled", "status": "False", "reason":
                         "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}])
    assert waiting_note(unschedulable) == "waiting for a node: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    pull = _pod(0, phase="Pending", containerStatuses=[{"state": {"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "reg/nbbatch-pytorch:fp"'}}}])
    error = start_failure(pull, "reg")
    assert error.ename == "ImagePullError" and "reg/nbbatch-pytorch:fp" in error.reason and "registry reg" in error.reason
    assert start_failure(unschedulable, "reg") is None


def test_a_pod_that_ended_without_a_record_says_why():
    oom = _pod(0, phase="Failed", containerStatuses=[{"state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}])
    error = ended_without_record(oom, "j", 0, "Killed\n")
    assert error.ename == "OOMKilled" and "4Gi" in error.evalue and "`memory:`" in error.reason and "Killed" in error.evalue
    gone = _pod(0, phase="Failed", reason="Evicted", conditions=[{"type": "DisruptionTarget", "status": "True",
                "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"}])
    assert evicted(gone) == "EvictionByEvictionAPI: Eviction API: evicting"
    crashed = _pod(0, phase="Failed", containerStatuses=[{"state": {"terminated": {"reason": "Error", "exitCode": 2}}}])
    assert "exit code 2 (Error)" in ended_without_record(crashed, "j", 0).evalue
    assert ended_without_record(None, "j", 3).ename == "PodLost"


@pytest.mark.parametrize(("message", "hint"), [
    ('pods "x" is forbidden: exceeded quota: gpu-quota, requested: requests.nvidia.com/gpu=2, used: '
     'requests.nvidia.com/gpu=0, limited: requests.nvidia.com/gpu=1', "ask for more quota"),
    ('pods "x" is forbidden: no PriorityClass with name urgent was found', "`priority_class:`"),
    ('pods "x" is forbidden: maximum memory usage per Container is 8Gi, but limit is 16Gi', "LimitRange"),
    ('admission webhook "policy.example.com" denied the request: no latest tags', "ask its admins"),
])
def test_a_refusal_is_the_servers_words_and_the_fix(message, hint):
    words = _refusal_words(KubernetesRefusal(403, "Forbidden", message))
    assert words.startswith(message) and hint in words
