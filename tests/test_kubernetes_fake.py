"""The fake Kubernetes API server (tests/fakes/kubernetes_*.py) answers the official client as a real one would:
refusals with the real Status bodies, dry runs, admission, watches, and a Job controller and kubelets behind it."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

kubernetes = pytest.importorskip("kubernetes")

from fakes.kubernetes_api import FakeKubernetes  # noqa: E402 (after the skip)
from fakes.kubernetes_jobs import COMPLETION_INDEX, format_indexes, parse_indexes, pod_for_index  # noqa: E402
from fakes.kubernetes_kubelets import (  # noqa: E402
    Evicted,
    Exit,
    ImagePullError,
    Log,
    Pending,
    Running,
    ScriptedKubelet,
    Wait,
    WaitUntilDeleted,
)
from fakes.kubernetes_process import ProcessKubelet, expand  # noqa: E402
from kubernetes import client, watch  # noqa: E402
from support.kubernetes import (  # noqa: E402
    clients,
    condition,
    condition_of,
    container,
    index_of,
    job_manifest,
    pod_manifest,
    refusal,
    waiting_reason,
)

NS = "ml"


@pytest.fixture
def kube():
    with FakeKubernetes() as fake:
        fake.add_namespace(NS)
        yield fake


# ---------------------------------------------------------------------------------------------- the protocol

def test_the_client_connects_with_the_kubeconfig_and_needs_the_token(kube, tmp_path):
    batch, core = clients(kube, tmp_path)
    assert client.VersionApi(batch.api_client).get_code().minor == "31"
    assert core.read_namespace(NS).status.phase == "Active"
    status = refusal(core.read_namespace, "nope")
    assert (status["code"], status["reason"], status["message"]) == (404, "NotFound", 'namespaces "nope" not found')
    configuration = client.Configuration()
    configuration.host = kube.url
    configuration.api_key = {"authorization": "Bearer wrong"}
    status = refusal(client.CoreV1Api(client.ApiClient(configuration)).list_namespaced_pod, NS)
    assert (status["code"], status["reason"]) == (401, "Unauthorized")


def test_a_missing_namespace_and_a_taken_name_are_refused(kube, tmp_path):
    batch, _ = clients(kube, tmp_path)
    status = refusal(batch.create_namespaced_job, "nope", job_manifest("sweep"))
    assert status["code"] == 404 and status["details"] == {"name": "nope", "kind": "namespaces"}
    batch.create_namespaced_job(NS, job_manifest("sweep"))
    status = refusal(batch.create_namespaced_job, NS, job_manifest("sweep"))
    assert (status["code"], status["reason"], status["message"]) == (409, "AlreadyExists",
                                                                     'jobs.batch "sweep" already exists')
    assert status["details"] == {"name": "sweep", "group": "batch", "kind": "jobs"}


@pytest.mark.parametrize(("name", "completions", "field", "says"), [
    ("Sweep", 1, "metadata.name", "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters"),
    ("sweep.v2", 3, "metadata.name", "will not able to create pod with invalid DNS label: sweep.v2-2"),
    ("s" * 62, 10, "metadata.name", "will not able to create pod with invalid DNS label: " + "s" * 62 + "-9"),
    ("s" * 64, 1, "spec.template.metadata.labels", "must be no more than 63 characters"),
])
def test_job_names_must_make_valid_pod_hostnames_and_labels(kube, tmp_path, name, completions, field, says):
    batch, _ = clients(kube, tmp_path)
    status = refusal(batch.create_namespaced_job, NS, job_manifest(name, completions=completions))
    assert (status["code"], status["reason"]) == (422, "Invalid")
    assert status["message"].startswith(f'Job.batch "{name}" is invalid: ')
    cause = next(c for c in status["details"]["causes"] if c["field"] == field)
    assert cause["reason"] == "FieldValueInvalid" and says in cause["message"]
    assert batch.list_namespaced_job(NS).items == []


def test_service_names_are_dns_1035_labels_and_generate_name_is_checked(kube, tmp_path):
    _, core = clients(kube, tmp_path)
    service = {"metadata": {"name": "0ranks"}, "spec": {"clusterIP": "None", "selector": {"job-name": "x"}}}
    status = refusal(core.create_namespaced_service, NS, service)
    assert status["details"]["causes"][0]["message"].startswith('Invalid value: "0ranks": a DNS-1035 label must')
    made = core.create_namespaced_service(NS, dict(service, metadata={"name": "ranks"}))
    assert made.spec.cluster_ip == "None" and made.spec.type == "ClusterIP"
    status = refusal(core.create_namespaced_pod, NS, {"metadata": {"generateName": "Run_"},
                                                      "spec": pod_manifest("x")["spec"]})
    assert "metadata.generateName" in [c["field"] for c in status["details"]["causes"]]
    made = core.create_namespaced_pod(NS, {"metadata": {"generateName": "run-"}, "spec": pod_manifest("x")["spec"]})
    assert made.metadata.name.startswith("run-") and len(made.metadata.name) == len("run-") + 5


@pytest.mark.parametrize(("labels", "annotations", "field", "says"), [
    ({"run": "x" * 64}, None, "metadata.labels", "must be no more than 63 characters"),
    ({"run": "-x"}, None, "metadata.labels", "a valid label must be an empty string or consist of"),
    ({"Bad_Prefix/run": "x"}, None, "metadata.labels", "prefix part a lowercase RFC 1123 subdomain"),
    ({"r" * 64: "x"}, None, "metadata.labels", "name part must be no more than 63 characters"),
    (None, {"note": "x" * (256 * 1024)}, "metadata.annotations", "Too long: must have at most 262144 bytes"),
])
def test_labels_and_annotations_follow_the_rules(kube, tmp_path, labels, annotations, field, says):
    _, core = clients(kube, tmp_path)
    body = pod_manifest("labelled")
    body["metadata"].update({"labels": labels} if labels else {"annotations": annotations})
    status = refusal(core.create_namespaced_pod, NS, body)
    assert status["code"] == 422
    assert any(c["field"] == field and says in c["message"] for c in status["details"]["causes"]), status


@pytest.mark.parametrize(("resources", "code", "says"), [
    ({"limits": {"memory": "2GB"}}, 400, "quantities must match the regular expression"),
    ({"requests": {"cpu": "abc"}}, 400, "quantities must match the regular expression"),
    ({"limits": {"cpu": "-1"}}, 422, "resources.limits[cpu]: Invalid value: \"-1\": must be greater than or equal to 0"),
    ({"requests": {"cpu": "4"}, "limits": {"cpu": "2"}}, 422, "must be less than or equal to cpu limit of 2"),
    ({"limits": {"nvidia.com/gpu": "0.5"}}, 422, "must be an integer"),
    ({"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "2"}}, 422,
     "must be equal to nvidia.com/gpu limit of 2"),
    ({"requests": {"nvidia.com/gpu": "1"}}, 422, "Limit must be set for non overcommitable resources"),
])
def test_resource_quantities_are_parsed_and_checked(kube, tmp_path, resources, code, says):
    batch, _ = clients(kube, tmp_path)
    status = refusal(batch.create_namespaced_job, NS, job_manifest("sized", containers=[container(resources=resources)]))
    assert status["code"] == code and says in status["message"], status
    if code == 400:
        assert status["reason"] == "BadRequest" and status["message"].startswith(
            'Job in version "v1" cannot be handled as a Job: ')


def test_quantities_are_stored_in_canonical_form(kube, tmp_path):
    batch, _ = clients(kube, tmp_path)
    resources = {"requests": {"cpu": "500m", "memory": "1024Mi"}, "limits": {"cpu": "1.5", "nvidia.com/gpu": "1"}}
    job = batch.create_namespaced_job(NS, job_manifest("sized", containers=[container(resources=resources)]))
    stored = job.spec.template.spec.containers[0].resources
    assert stored.limits == {"cpu": "1500m", "nvidia.com/gpu": "1"} and stored.requests["memory"] == "1Gi"


@pytest.mark.parametrize(("spec", "pod_spec", "field", "says"), [
    ({"completions": None}, {}, "spec.completions", "Required value: when completion mode is Indexed"),
    ({"parallelism": -1}, {}, "spec.parallelism", "must be greater than or equal to 0"),
    ({"indexed": False, "backoffLimitPerIndex": 1}, {}, "spec.backoffLimitPerIndex", "requires indexed completion"),
    ({"podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]}},
     {"restartPolicy": "OnFailure"}, "spec.template.spec.restartPolicy",
     'only "Never" is supported when podFailurePolicy is specified'),
    ({}, {"restartPolicy": "Always"}, "spec.template.spec.restartPolicy", 'Required value: valid values: "OnFailure"'),
    ({"podFailurePolicy": {"rules": [{"action": "FailIndex", "onExitCodes": {"operator": "In", "values": [1]}}]}},
     {}, "spec.podFailurePolicy.rules[0].action", "requires the backoffLimitPerIndex to be set"),
    ({"selector": {"matchLabels": {"team": "a"}}}, {}, "spec.selector", "`selector` not auto-generated"),
])
def test_job_specs_the_server_refuses(kube, tmp_path, spec, pod_spec, field, says):
    batch, _ = clients(kube, tmp_path)
    status = refusal(batch.create_namespaced_job, NS, job_manifest("bad", pod_spec=pod_spec, **spec))
    assert status["code"] == 422
    assert any(c["field"] == field and says in c["message"] for c in status["details"]["causes"]), status


def test_immutable_job_fields_cannot_change_but_suspend_and_parallelism_can(kube, tmp_path):
    kube.kubelet.script = [Running(), WaitUntilDeleted()]
    batch, _ = clients(kube, tmp_path)
    batch.create_namespaced_job(NS, job_manifest("sweep", completions=4, parallelism=2, backoffLimitPerIndex=1))
    for patch, field in [({"spec": {"template": {"spec": {"containers": [container(command=("false",))]}}}},
                          "spec.template"),
                         ({"spec": {"completionMode": "NonIndexed"}}, "spec.completionMode"),
                         ({"spec": {"backoffLimitPerIndex": 3}}, "spec.backoffLimitPerIndex"),
                         ({"spec": {"completions": 5}}, "spec.completions")]:
        status = refusal(batch.patch_namespaced_job, "sweep", NS, patch)
        assert status["code"] == 422
        cause = next(c for c in status["details"]["causes"] if c["field"] == field)
        assert "field is immutable" in cause["message"] or "in tandem with spec.parallelism" in cause["message"]
    batch.patch_namespaced_job("sweep", NS, {"spec": {"completions": 3, "parallelism": 3}})  # elastic Indexed Job
    json_patched = batch.patch_namespaced_job("sweep", NS, [{"op": "replace", "path": "/spec/parallelism", "value": 2}])
    assert json_patched.spec.parallelism == 2
    job = batch.patch_namespaced_job("sweep", NS, {"spec": {"suspend": True, "parallelism": 1}})
    assert job.spec.suspend and job.spec.parallelism == 1 and job.metadata.generation == 4
    kube.wait_for(lambda: condition(kube.job(NS, "sweep"), "Suspended") and not kube.pods(NS, "job-name=sweep"),
                  message="the suspended Job's pods gone")
    assert not kube.job(NS, "sweep")["status"].get("failed")  # pods stopped by a suspension are no failures
    batch.patch_namespaced_job("sweep", NS, {"spec": {"suspend": False}})
    kube.wait_for(lambda: kube.pods(NS, "job-name=sweep"), message="the resumed Job's pod")
    resumed = next(c for c in kube.job(NS, "sweep")["status"]["conditions"] if c["type"] == "Suspended")
    assert (resumed["status"], resumed["reason"]) == ("False", "JobResumed")


@pytest.mark.parametrize("version", ["1.28", "1.29"])
def test_the_server_version_decides_which_job_fields_it_keeps(tmp_path, version):
    with FakeKubernetes(version=version) as kube:
        batch, _ = clients(kube, tmp_path)
        body = job_manifest("probe", completions=3, backoffLimitPerIndex=1, maxFailedIndexes=1)
        job, _code, headers = batch.create_namespaced_job_with_http_info("default", body, dry_run="All")
        failing = job_manifest("probe", completions=3, backoffLimitPerIndex=1, podFailurePolicy={"rules": [
            {"action": "FailIndex", "onExitCodes": {"operator": "In", "values": [1]}}]})
        if version == "1.28":  # an old server drops the fields it does not know: how a client detects it
            assert job.spec.backoff_limit_per_index is None and job.spec.max_failed_indexes is None
            assert 'unknown field \\"spec.backoffLimitPerIndex\\"' in headers["Warning"]
            status = refusal(batch.create_namespaced_job, "default", failing, dry_run="All")
            assert 'Unsupported value: "FailIndex": supported values: "Count", "FailJob", "Ignore"' in status["message"]
        else:
            assert (job.spec.backoff_limit_per_index, job.spec.max_failed_indexes) == (1, 1)
            assert batch.create_namespaced_job("default", failing, dry_run="All").spec.pod_failure_policy
        assert batch.list_namespaced_job("default").items == []


def test_unknown_fields_are_dropped_with_a_warning_or_refused_when_strict(kube):
    """The client's models refuse unknown fields themselves, so this test sends its own request."""
    body = json.dumps(job_manifest("typo", backofflimit=2)).encode()

    def post(query: str) -> tuple[int, dict, str]:
        request = urllib.request.Request(f"{kube.url}/apis/batch/v1/namespaces/{NS}/jobs?{query}", body, method="POST",
                                         headers={"Authorization": f"Bearer {kube.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request) as answer:
                return answer.status, json.loads(answer.read()), answer.headers.get("Warning", "")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read()), ""

    code, job, warning = post("dryRun=All")
    assert code == 201 and "backofflimit" not in job["spec"] and job["spec"]["backoffLimit"] == 6
    assert warning == '299 - "unknown field \\"spec.backofflimit\\""'
    code, status, _ = post("fieldValidation=Strict")
    assert code == 400 and 'strict decoding error: unknown field "spec.backofflimit"' in status["message"]


def test_secrets_and_claims(kube, tmp_path):
    _, core = clients(kube, tmp_path)
    secret = core.create_namespaced_secret(NS, {"metadata": {"name": "azure"}, "stringData": {"key": "s3cret"}})
    assert secret.data == {"key": "czNjcmV0"} and secret.type == "Opaque" and secret.string_data is None
    status = refusal(core.create_namespaced_secret, NS, {"metadata": {"name": "bad"}, "data": {"key": "not base64!"}})
    assert status["code"] == 400 and "illegal base64 data" in status["message"]
    claim = core.create_namespaced_persistent_volume_claim(NS, {"metadata": {"name": "results"}, "spec": {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}}})
    assert claim.status.phase == "Bound" and claim.status.capacity == {"storage": "10Gi"}
    status = refusal(core.create_namespaced_persistent_volume_claim, NS, {"metadata": {"name": "x"}, "spec": {
        "resources": {"requests": {"storage": "1Gi"}}}})
    assert status["details"]["causes"][0] == {"reason": "FieldValueRequired", "field": "spec.accessModes",
                                              "message": "Required value: at least 1 access mode is required"}


def test_dry_runs_fill_defaults_and_store_nothing(kube, tmp_path):
    batch, core = clients(kube, tmp_path)
    job = batch.create_namespaced_job(NS, job_manifest("sweep", completions=3), dry_run="All")
    assert (job.spec.backoff_limit, job.spec.pod_replacement_policy, job.spec.suspend) == (6, "TerminatingOrFailed",
                                                                                          False)
    assert job.spec.template.metadata.labels["batch.kubernetes.io/job-name"] == "sweep"
    assert job.spec.template.spec.termination_grace_period_seconds == 30
    pod = core.create_namespaced_pod(NS, pod_manifest("probe"), dry_run="All")
    assert pod.status.phase == "Pending" and pod.status.qos_class == "BestEffort"
    assert batch.list_namespaced_job(NS).items == [] and core.list_namespaced_pod(NS).items == []
    batch.create_namespaced_job(NS, job_manifest("kept"))
    batch.delete_namespaced_job("kept", NS, dry_run="All", propagation_policy="Background")
    assert batch.read_namespaced_job("kept", NS).metadata.deletion_timestamp is None


def test_pod_admission_quota_limit_range_priority_and_webhooks(kube, tmp_path):
    _, core = clients(kube, tmp_path)
    kube.add("resourcequotas", NS, {"metadata": {"name": "gpus"}, "spec": {"hard": {
        "requests.nvidia.com/gpu": "1", "requests.cpu": "4"}}})
    kube.add("limitranges", NS, {"metadata": {"name": "bounds"}, "spec": {"limits": [
        {"type": "Container", "max": {"cpu": "2"}, "defaultRequest": {"cpu": "500m", "memory": "1Gi"}}]}})
    two_gpus = pod_manifest("big", containers=[container(resources={"limits": {"nvidia.com/gpu": "2", "cpu": "1"}})])
    for dry_run in ("All", None):
        status = refusal(core.create_namespaced_pod, NS, two_gpus, dry_run=dry_run)
        assert (status["code"], status["reason"]) == (403, "Forbidden")
        assert status["message"] == ('pods "big" is forbidden: exceeded quota: gpus, requested: '
                                     'requests.nvidia.com/gpu=2, used: requests.nvidia.com/gpu=0, limited: '
                                     'requests.nvidia.com/gpu=1')
    too_wide = pod_manifest("wide", containers=[container(resources={"limits": {"cpu": "4"}})])
    assert refusal(core.create_namespaced_pod, NS, too_wide, dry_run="All")["message"] == (
        'pods "wide" is forbidden: maximum cpu usage per Container is 2, but limit is 4')
    defaulted = core.create_namespaced_pod(NS, pod_manifest("small"), dry_run="All")
    limits = defaulted.spec.containers[0].resources
    assert limits.limits == {"cpu": "2"} and limits.requests == {"cpu": "500m", "memory": "1Gi"}
    urgent = pod_manifest("urgent", priorityClassName="high")
    assert refusal(core.create_namespaced_pod, NS, urgent, dry_run="All")["message"] == (
        'pods "urgent" is forbidden: no PriorityClass with name high was found')
    kube.add_priority_class("high", 1000)
    assert client.SchedulingV1Api(core.api_client).read_priority_class("high").value == 1000
    assert core.create_namespaced_pod(NS, urgent, dry_run="All").spec.priority == 1000
    runner = pod_manifest("runner", serviceAccountName="runner")
    assert refusal(core.create_namespaced_pod, NS, runner, dry_run="All")["message"] == (
        'pods "runner" is forbidden: error looking up service account ml/runner: serviceaccount "runner" not found')
    core.create_namespaced_service_account(NS, {"metadata": {"name": "runner"}})
    assert core.create_namespaced_pod(NS, runner, dry_run="All").spec.service_account_name == "runner"
    kube.deny_with_webhook("policy.example.com", "images must come from registry.example.com")
    status = refusal(core.create_namespaced_pod, NS, urgent, dry_run="All")
    assert status["code"] == 403 and status["message"] == ('admission webhook "policy.example.com" denied the request: '
                                                           "images must come from registry.example.com")


def test_a_job_count_quota_refuses_the_job_and_a_compute_quota_fails_its_pods(kube, tmp_path):
    batch, _ = clients(kube, tmp_path)
    kube.add("resourcequotas", NS, {"metadata": {"name": "jobs"}, "spec": {"hard": {"count/jobs.batch": "1"}}})
    batch.create_namespaced_job(NS, job_manifest("first"))
    status = refusal(batch.create_namespaced_job, NS, job_manifest("second"), dry_run="All")
    assert status["message"] == ('jobs.batch "second" is forbidden: exceeded quota: jobs, requested: '
                                 "count/jobs.batch=1, used: count/jobs.batch=1, limited: count/jobs.batch=1")
    kube.add("resourcequotas", "default", {"metadata": {"name": "gpus"}, "spec": {"hard": {
        "requests.nvidia.com/gpu": "1"}}})
    hungry = job_manifest("hungry", containers=[container(resources={"limits": {"nvidia.com/gpu": "2"}})])
    batch.create_namespaced_job("default", hungry)  # accepted: quota judges the pods, when the controller makes them
    failed = kube.wait_for(lambda: [e for e in kube.events("default", "hungry") if e["reason"] == "FailedCreate"],
                           message="a FailedCreate event")
    assert failed[0]["type"] == "Warning" and "exceeded quota: gpus, requested: requests.nvidia.com/gpu=2" in \
        failed[0]["message"] and failed[0]["message"].startswith('Error creating: pods "hungry-0-')
    assert kube.pods("default") == []
    kube.add("resourcequotas", "default", {"metadata": {"name": "compute"}, "spec": {"hard": {"limits.cpu": "8"}}})
    status = refusal(client.CoreV1Api(batch.api_client).create_namespaced_pod, "default", pod_manifest(
        "bare", containers=[container("a"), container("b", resources={"limits": {"cpu": "1"}})]), dry_run="All")
    assert status["message"] == 'pods "bare" is forbidden: failed quota: compute: must specify limits.cpu for: a'


def test_an_indexed_job_runs_at_most_parallelism_pods_and_completes(kube, tmp_path):
    kube.kubelet.script = [Running(), Wait(0.02), Exit(0)]
    batch, core = clients(kube, tmp_path)
    since = core.list_namespaced_pod(NS).metadata.resource_version
    batch.create_namespaced_job(NS, job_manifest("sweep", completions=6, parallelism=2))
    active: dict[str, bool] = {}
    most = succeeded = 0
    for event in watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=since, timeout_seconds=30):
        pod = event["object"]
        running = pod.status.phase not in ("Succeeded", "Failed") and event["type"] != "DELETED"
        active[pod.metadata.name] = running and pod.metadata.deletion_timestamp is None
        most = max(most, sum(active.values()))
        succeeded += event["type"] == "MODIFIED" and pod.status.phase == "Succeeded"
        if succeeded == 6:
            break
    assert most == 2
    job = kube.wait_for(lambda: condition(kube.job(NS, "sweep"), "Complete") and kube.job(NS, "sweep"))
    assert job["status"]["completedIndexes"] == "0-5" and job["status"]["succeeded"] == 6
    assert [c["type"] for c in job["status"]["conditions"]] == ["SuccessCriteriaMet", "Complete"]
    pods = sorted(kube.pods(NS, "batch.kubernetes.io/job-name=sweep"), key=index_of)
    assert [index_of(p) for p in pods] == list(range(6))
    first = pods[0]
    assert first["metadata"]["name"].startswith("sweep-0-") and len(first["metadata"]["name"]) == len("sweep-0-") + 5
    assert first["spec"]["hostname"] == "sweep-0" and first["metadata"]["annotations"][COMPLETION_INDEX] == "0"
    assert first["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
        "apiVersion": "v1", "fieldPath": f"metadata.labels['{COMPLETION_INDEX}']"}}} in first["spec"]["containers"][0]["env"]


def test_backoff_limit_per_index_and_pod_failure_policy(kube, tmp_path):
    attempts: Counter = Counter()

    def script(pod):
        index = index_of(pod)
        attempts[index] += 1
        if index == 0:
            return [Running(), Exit(1)]  # FailIndex: the index fails at once
        if index == 1 and attempts[index] == 1:
            return [Running(), WaitUntilDeleted()]  # evicted below: Ignore, recreated, not counted
        if index == 2 and attempts[index] == 1:
            return [Running(), Exit(2)]  # Count: within backoffLimitPerIndex, retried
        return [Running(), Exit(0)]

    kube.kubelet.script = script
    batch, core = clients(kube, tmp_path)
    batch.create_namespaced_job(NS, job_manifest("sweep", completions=3, parallelism=3, backoffLimitPerIndex=1,
                                                 podFailurePolicy={"rules": [
                                                     {"action": "FailIndex",
                                                      "onExitCodes": {"containerName": "main", "operator": "In",
                                                                      "values": [1]}},
                                                     {"action": "Ignore",
                                                      "onPodConditions": [{"type": "DisruptionTarget"}]}]}))
    first = kube.wait_for(lambda: [p for p in kube.pods(NS, f"{COMPLETION_INDEX}=1")
                                   if p["status"]["phase"] == "Running"], message="index 1 running")[0]
    core.create_namespaced_pod_eviction(first["metadata"]["name"], NS, {"metadata": {"name": first["metadata"]["name"],
                                                                                    "namespace": NS}})
    job = kube.wait_for(lambda: condition(kube.job(NS, "sweep"), "Failed") and kube.job(NS, "sweep"))
    status = job["status"]
    assert (status["failedIndexes"], status["completedIndexes"], status["failed"]) == ("0", "1,2", 2)
    assert condition(job, "Failed")["reason"] == "FailedIndexes" and condition(job, "FailureTarget")
    assert attempts == {0: 1, 1: 2, 2: 2}
    assert kube.pod(NS, first["metadata"]["name"]) is None  # an evicted pod goes once it has ended
    retried = [p for p in kube.pods(NS, f"{COMPLETION_INDEX}=2") if p["status"]["phase"] == "Succeeded"][0]
    assert retried["metadata"]["annotations"]["batch.kubernetes.io/job-index-failure-count"] == "1"


def test_backoff_limit_fails_the_whole_job_and_fail_job_names_the_container(kube, tmp_path):
    kube.kubelet.script = [Running(), Exit(137, "OOMKilled")]
    batch, _ = clients(kube, tmp_path)
    batch.create_namespaced_job(NS, job_manifest("oom", completions=4, parallelism=1, backoffLimit=1))
    job = kube.wait_for(lambda: condition(kube.job(NS, "oom"), "Failed") and kube.job(NS, "oom"))
    assert job["status"]["failed"] == 2 and condition(job, "Failed")["reason"] == "BackoffLimitExceeded"
    assert condition(job, "Failed")["message"] == "Job has reached the specified backoff limit"
    ended = kube.pods(NS, "job-name=oom")[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (ended["exitCode"], ended["reason"]) == (137, "OOMKilled")
    kube.kubelet.script = [Running(), Exit(42)]
    batch.create_namespaced_job(NS, job_manifest("fatal", podFailurePolicy={"rules": [
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}]}))
    job = kube.wait_for(lambda: condition(kube.job(NS, "fatal"), "Failed") and kube.job(NS, "fatal"))
    pod = kube.pods(NS, "job-name=fatal")[0]["metadata"]["name"]
    assert condition(job, "Failed")["message"] == (f"Container main for pod {NS}/{pod} failed with exit code 42 "
                                                   "matching FailJob rule at index 0")


def test_foreground_delete_terminates_the_pods_then_removes_the_job(tmp_path):
    with FakeKubernetes(kubelet=ScriptedKubelet([Running(), WaitUntilDeleted()], sigterm_exit_code=None)) as kube:
        batch, core = clients(kube, tmp_path)
        batch.create_namespaced_job("default", job_manifest("sweep", completions=2, parallelism=2,
                                                            pod_spec={"terminationGracePeriodSeconds": 1}))
        job_uid = kube.wait_for(lambda: kube.job("default", "sweep"))["metadata"]["uid"]
        core.create_namespaced_config_map("default", {"metadata": {"name": "inputs", "ownerReferences": [
            {"apiVersion": "batch/v1", "kind": "Job", "name": "sweep", "uid": job_uid}]}, "data": {"a": "1"}})
        kube.wait_for(lambda: len([p for p in kube.pods("default") if p["status"].get("phase") == "Running"]) == 2)
        since = core.list_namespaced_pod("default").metadata.resource_version
        batch.delete_namespaced_job("sweep", "default", propagation_policy="Foreground")
        lingering = batch.read_namespaced_job("sweep", "default")
        assert lingering.metadata.deletion_timestamp and lingering.metadata.finalizers == ["foregroundDeletion"]
        kube.wait_for(lambda: kube.job("default", "sweep") is None, message="the Job gone")
        pods_gone, ended = [], []
        for event in watch.Watch().stream(core.list_namespaced_pod, "default", resource_version=since,
                                          timeout_seconds=1):
            state = event["object"].status.container_statuses[0].state
            if event["type"] == "DELETED":
                pods_gone.append(int(event["object"].metadata.resource_version))
            elif state.terminated:
                ended.append(state.terminated.exit_code)
        job_gone = [int(e["object"].metadata.resource_version) for e in watch.Watch().stream(
            batch.list_namespaced_job, "default", resource_version=since, timeout_seconds=1)
            if e["type"] == "DELETED"]
        assert len(pods_gone) == 2 and ended == [137, 137] and max(pods_gone) < job_gone[0]
        kube.wait_for(lambda: kube.store.get("configmaps", "default", "inputs") is None, message="the ConfigMap gone")


def test_background_delete_removes_the_job_at_once_and_orphan_keeps_the_pods(kube, tmp_path):
    kube.kubelet.script = [Running(), WaitUntilDeleted()]
    batch, core = clients(kube, tmp_path)
    for name in ("background", "orphaned"):
        batch.create_namespaced_job(NS, job_manifest(name))
    kube.wait_for(lambda: len(kube.pods(NS)) == 2)
    assert core.delete_namespaced_pod(kube.pods(NS, "job-name=background")[0]["metadata"]["name"], NS,
                                      grace_period_seconds=0).metadata.deletion_timestamp  # the pod, as it goes
    kube.wait_for(lambda: len([p for p in kube.pods(NS, "job-name=background")
                               if p["status"].get("phase") == "Running"]) == 1, message="the replacement pod")
    batch.delete_namespaced_job("background", NS, propagation_policy="Background")
    assert kube.job(NS, "background") is None
    kube.wait_for(lambda: not kube.pods(NS, "job-name=background"), message="the background Job's pod gone")
    batch.delete_namespaced_job("orphaned", NS)  # no policy: batch/v1 orphans the pods
    kube.wait_for(lambda: kube.job(NS, "orphaned") is None)
    kept = kube.wait_for(lambda: [p for p in kube.pods(NS, "job-name=orphaned")
                                  if not p["metadata"].get("ownerReferences") and not p["metadata"].get("finalizers")])
    assert kept[0]["status"]["phase"] == "Running"


def test_watch_streams_events_in_order_and_answers_410_for_a_too_old_version(tmp_path):
    with FakeKubernetes(history=5, bookmark_seconds=0.1) as kube:
        _, core = clients(kube, tmp_path)
        since = core.list_namespaced_config_map("default").metadata.resource_version
        core.create_namespaced_config_map("default", {"metadata": {"name": "a"}, "data": {"k": "1"}})
        core.patch_namespaced_config_map("a", "default", {"data": {"k": "2"}})
        core.delete_namespaced_config_map("a", "default")
        events = list(watch.Watch().stream(core.list_namespaced_config_map, "default", resource_version=since,
                                           timeout_seconds=1))
        assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
        versions = [int(e["object"].metadata.resource_version) for e in events]
        assert versions == sorted(versions) and events[1]["object"].data == {"k": "2"}
        marks = [e for e in watch.Watch().stream(core.list_namespaced_config_map, "default", timeout_seconds=1,
                                                 resource_version=str(versions[-1]), allow_watch_bookmarks=True)]
        assert marks and {e["type"] for e in marks} == {"BOOKMARK"}
        for i in range(6):
            core.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}})
        with pytest.raises(client.ApiException) as raised:
            list(watch.Watch().stream(core.list_namespaced_config_map, "default", resource_version=since,
                                      timeout_seconds=1))
        assert raised.value.status == 410 and "Expired: too old resource version: " in raised.value.reason


def test_selectors_on_lists(kube, tmp_path):
    _, core = clients(kube, tmp_path)
    for name, labels in (("a", {"run": "1", "tier": "gpu"}), ("b", {"run": "2"}), ("c", {"tier": "cpu"})):
        core.create_namespaced_config_map(NS, {"metadata": {"name": name, "labels": labels}})

    def names(**selectors):
        return [c.metadata.name for c in core.list_namespaced_config_map(NS, **selectors).items]

    assert names(label_selector="run") == ["a", "b"] and names(label_selector="!run") == ["c"]
    assert names(label_selector="tier in (gpu,cpu),run!=2") == ["a", "c"]
    assert names(label_selector="run=2") == ["b"] and names(field_selector="metadata.name=c") == ["c"]
    assert refusal(core.list_namespaced_config_map, NS, field_selector="data.k=1")["message"] == (
        "field label not supported: data.k")


def test_pod_status_explains_waits_and_logs_are_served(kube, tmp_path):
    scripts = {"unplaced": [Pending("Unschedulable", "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")],
               "unpulled": [ImagePullError('failed to resolve reference "registry.example.com/nb:1": not found')],
               "talker": [Running(), Log("hello\n"), Log("world\n"), Exit(0)],
               "evicted": [Running(), Evicted("TerminationByKubelet", "The node was low on resource: memory.")],
               "waiter": [Pending("Unschedulable", "0/1 nodes are available: 1 Insufficient cpu."), WaitUntilDeleted()]}
    kube.kubelet.script = lambda pod: scripts[pod["metadata"]["name"]]
    _, core = clients(kube, tmp_path)
    for name in scripts:
        core.create_namespaced_pod(NS, pod_manifest(name))
    unplaced = kube.wait_for(lambda: condition_of(core.read_namespaced_pod("unplaced", NS), "PodScheduled"))
    assert (unplaced.status, unplaced.reason) == ("False", "Unschedulable") and "nvidia.com/gpu" in unplaced.message
    waiting = kube.wait_for(lambda: waiting_reason(core.read_namespaced_pod("unpulled", NS)) == "ImagePullBackOff")
    assert waiting
    assert refusal(core.read_namespaced_pod_log, "unpulled", NS)["message"] == (
        'container "main" in pod "unpulled" is waiting to start: trying and failing to pull image')
    assert refusal(core.read_namespaced_pod_log, "unplaced", NS)["message"] == "pod unplaced does not have a host assigned"
    kube.wait_for(lambda: core.read_namespaced_pod("talker", NS).status.phase == "Succeeded")
    assert core.read_namespaced_pod_log("talker", NS) == "hello\nworld\n"
    assert core.read_namespaced_pod_log("talker", NS, tail_lines=1) == "world\n"
    assert core.read_namespaced_pod_log("talker", NS, follow=True) == "hello\nworld\n"  # ends with the pod
    evicted = kube.wait_for(lambda: (p := core.read_namespaced_pod("evicted", NS)).status.phase == "Failed" and p)
    assert evicted.status.reason == "Evicted" and condition_of(evicted, "DisruptionTarget").reason == \
        "TerminationByKubelet"
    reasons = [e.reason for e in core.list_namespaced_event(NS, field_selector="involvedObject.name=unpulled").items]
    assert "Failed" in reasons and "BackOff" in reasons
    assert core.read_namespaced_pod("unplaced", NS).status.phase == "Pending"  # as the script left them
    assert waiting_reason(core.read_namespaced_pod("unpulled", NS)) == "ImagePullBackOff"
    kube.wait_for(lambda: condition(kube.pod(NS, "waiter"), "PodScheduled") is None and kube.pod(NS, "waiter")[
        "status"]["conditions"][0]["reason"] == "Unschedulable", message="the waiting pod unscheduled")
    assert not kube.pod(NS, "waiter")["spec"].get("nodeName")


# ------------------------------------------------------------------------------------------ pod_for_index

def test_pod_for_index_is_the_controllers_derivation():
    job = job_manifest("sweep", completions=4, backoffLimitPerIndex=2,
                       pod_spec={"subdomain": "sweep-ranks"},
                       containers=[container(env=[{"name": "A", "value": "1"}]),
                                   container("side", env=[{"name": "JOB_COMPLETION_INDEX", "value": "x"}])])
    job["metadata"].update(namespace="ml", uid="u-1")
    pod = pod_for_index(job, 3, "abcde", failures=1)
    meta = pod["metadata"]
    assert meta["name"] == "sweep-3-abcde" and meta["generateName"] == "sweep-3-"
    assert meta["labels"] == {"batch.kubernetes.io/job-name": "sweep", "job-name": "sweep",
                              "batch.kubernetes.io/controller-uid": "u-1", "controller-uid": "u-1",
                              COMPLETION_INDEX: "3"}
    assert meta["annotations"] == {COMPLETION_INDEX: "3", "batch.kubernetes.io/job-index-failure-count": "1"}
    assert meta["ownerReferences"][0] == {"apiVersion": "batch/v1", "kind": "Job", "name": "sweep", "uid": "u-1",
                                          "controller": True, "blockOwnerDeletion": True}
    assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == ("sweep-3", "sweep-ranks")
    main, side = pod["spec"]["containers"]
    assert [e["name"] for e in main["env"]] == ["A", "JOB_COMPLETION_INDEX"]
    assert side["env"] == [{"name": "JOB_COMPLETION_INDEX", "value": "x"}]  # the template's own is kept
    assert len(job["spec"]["template"]["spec"]["containers"][0]["env"]) == 1  # the Job is not modified
    unstored = pod_for_index(job_manifest("plain"), 0)
    assert "ownerReferences" not in unstored["metadata"] and len(unstored["metadata"]["name"]) == len("plain-0-") + 5
    assert format_indexes({0, 1, 2, 5, 7, 8}) == "0-2,5,7,8" and parse_indexes("0-2,5,7,8") == {0, 1, 2, 5, 7, 8}


def test_dollar_expansion_follows_kubernetes():
    env = {"INDEX": "3", "NAME": "sweep"}
    assert expand("run-$(INDEX) $(NAME) $$(INDEX) $(MISSING) $", env) == "run-3 sweep $(INDEX) $(MISSING) $"


# ---------------------------------------------------------------------------------------------- real processes

def test_the_process_kubelet_runs_pods_with_their_volume_and_sigterms_them(tmp_path):
    if reason := ProcessKubelet.unavailable():
        pytest.skip(reason)
    share = tmp_path / "share"
    share.mkdir()
    with FakeKubernetes(kubelet=ProcessKubelet(volumes={"results": share})) as kube:
        batch, core = clients(kube, tmp_path)
        mount = {"volumes": [{"name": "share", "persistentVolumeClaim": {"claimName": "results"}}],
                 "terminationGracePeriodSeconds": 5, "subdomain": "ranks"}
        core.create_namespaced_secret("default", {"metadata": {"name": "token"}, "stringData": {"value": "t0k"}})
        command = ("sh", "-c", "echo index=$(JOB_COMPLETION_INDEX) pod=$(POD_NAME) cost='$$(JOB_COMPLETION_INDEX)' "
                   "token=$TOKEN >> out-$(JOB_COMPLETION_INDEX) && cat out-$(JOB_COMPLETION_INDEX) && "
                   "python -c 'import socket, sys; print(sys.prefix, socket.gethostbyname(\"sweep-0.ranks\"))'")
        worker = container(command=command, workingDir="/mnt/nbbatch/share/exp",
                           env=[{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "token", "key": "value"}}}],
                           volumeMounts=[{"name": "share", "mountPath": "/mnt/nbbatch/share"}])
        batch.create_namespaced_job("default", job_manifest("sweep", completions=2, parallelism=2,
                                                            containers=[worker], pod_spec=mount))
        kube.wait_for(lambda: condition(kube.job("default", "sweep"), "Complete"), message="the Job complete")
        written = (share / "exp" / "out-1").read_text()
        assert written.startswith("index=1 pod=sweep-1-") and written.endswith(" cost=$(JOB_COMPLETION_INDEX) "
                                                                             "token=t0k\n")
        pod = kube.pods("default", f"{COMPLETION_INDEX}=1")[0]
        log = core.read_namespaced_pod_log(pod["metadata"]["name"], "default")
        assert log == f"{written}{sys.prefix} 127.0.0.1\n"  # the venv's python; rank 0's name resolves
        assert not Path("/mnt/nbbatch").exists()  # the mount stayed in the pod's namespace
        stubborn = container(command=("sh", "-c", "trap 'echo got TERM > /mnt/nbbatch/share/term; exit 3' TERM; "
                                      "echo up; sleep 30 & wait"),
                             volumeMounts=[{"name": "share", "mountPath": "/mnt/nbbatch/share"}])
        batch.create_namespaced_job("default", job_manifest("held", containers=[stubborn], pod_spec=mount))
        kube.wait_for(lambda: [p for p in kube.pods("default", "job-name=held")
                               if "up" in kube.log("default", p["metadata"]["name"])], message="the held pod up")
        since = core.list_namespaced_pod("default").metadata.resource_version
        batch.delete_namespaced_job("held", "default", propagation_policy="Foreground")
        kube.wait_for(lambda: kube.job("default", "held") is None, message="the held Job gone")
        codes = [e["object"].status.container_statuses[0].state.terminated.exit_code
                 for e in watch.Watch().stream(core.list_namespaced_pod, "default", resource_version=since,
                                               timeout_seconds=1)
                 if e["object"].status.container_statuses[0].state.terminated]
        assert codes and set(codes) == {3} and (share / "term").read_text() == "got TERM\n"
