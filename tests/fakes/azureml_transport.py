"""A fake Azure ML control plane behind azure-core's ``transport=`` hook.

The real :class:`azure.ai.ml.MLClient` builds real HTTP requests; :class:`CannedTransport` hands
them to :class:`FakeAzureML`, which routes them by method and URL to small handlers that keep state
(computes, environments, code assets, datastores, jobs) and answer with the JSON bodies the
service sends. Nothing leaves the process. Requests no handler knows are answered 404 and kept in
:attr:`CannedTransport.unmatched`, so a test can assert that the SDK asked only for what was canned.

The fake is as strict as the service (``strict=True``, the default): it refuses what the live service
refuses, with the service's error body (:func:`service_error`), so the refusal paths are tested too:
a job whose experiment name, job name, compute name or ``shmSize`` breaks the service's rules, a cancel of
a job that is finalizing or already finished, a compute whose name breaks the rules. Each rule below
says where its text comes from.
"""

from __future__ import annotations

import io
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import requests
from azure.core.credentials import AccessToken, AccessTokenInfo
from azure.core.pipeline.transport import HttpTransport
from azure.core.pipeline.transport._requests_basic import RequestsTransportResponse
from azure.core.rest._requests_basic import RestRequestsTransportResponse
from requests.structures import CaseInsensitiveDict
from urllib3 import HTTPResponse

ARM = "https://management.azure.com"
PROVIDER = "providers/Microsoft.MachineLearningServices"

Reply = tuple[int, Any, dict[str, str]]
Handler = Callable[["Call"], Reply]


class FakeCredential:
    """A TokenCredential that hands out a constant token and counts the scopes asked for."""

    def __init__(self) -> None:
        self.scopes: list[str] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.scopes.extend(scopes)
        return AccessToken("fake-aad-token", int(time.time()) + 3600)

    def get_token_info(self, *scopes: str, options: Any = None) -> AccessTokenInfo:
        self.scopes.extend(scopes)
        return AccessTokenInfo("fake-aad-token", int(time.time()) + 3600)


@dataclass
class Call:
    """One request the SDK sent, as the handlers see it."""

    method: str
    url: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    match: re.Match[str] | None = None

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def _request_body(request: Any) -> bytes:
    for attr in ("content", "data", "body"):
        value = getattr(request, attr, None)
        if value is None:
            continue
        if isinstance(value, str):
            return value.encode()
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        if isinstance(value, (dict, list)):
            return json.dumps(value).encode()
    return b""


class CannedTransport(HttpTransport):
    """An azure-core transport that answers every request from a routing table, in process."""

    def __init__(self) -> None:
        self.routes: list[tuple[str, re.Pattern[str], Handler]] = []
        self.calls: list[Call] = []
        self.unmatched: list[Call] = []
        self._lock = threading.Lock()

    def route(self, method: str, pattern: str, handler: Handler) -> None:
        """Answer ``method`` requests whose URL path matches ``pattern`` (a regex, anchored) with ``handler``."""
        self.routes.append((method.upper(), re.compile(pattern + r"/?$"), handler))

    # HttpTransport -------------------------------------------------------------------------
    def open(self) -> None:
        return None

    def close(self) -> None:
        return None

    def __enter__(self) -> CannedTransport:
        return self

    def __exit__(self, *args: Any) -> None:
        return None

    def sleep(self, duration: float) -> None:  # LRO polling: no need to wait in tests
        return None

    def send(self, request: Any, **kwargs: Any) -> Any:
        parts = urlsplit(request.url)
        call = Call(
            method=request.method.upper(),
            url=request.url,
            path=parts.path,
            query=parse_qs(parts.query),
            headers=dict(request.headers),
            body=_request_body(request),
        )
        with self._lock:
            self.calls.append(call)
            for method, pattern, handler in self.routes:
                match = pattern.match(call.path)
                if method == call.method and match:
                    call.match = match
                    status, payload, headers = handler(call)
                    break
            else:
                self.unmatched.append(call)
                status, payload, headers = 404, _error("NotFound", f"no canned answer for {call.method} {call.path}"), {}
        return _response(request, status, payload, headers, stream=bool(kwargs.get("stream")))


def _response(request: Any, status: int, payload: Any, headers: dict[str, str], stream: bool = False) -> Any:
    if isinstance(payload, bytes):
        raw = payload
    elif payload is None:
        raw = b""
    else:
        raw = json.dumps(payload).encode()
    internal = requests.Response()
    internal.status_code = status
    internal.headers = CaseInsensitiveDict({"Content-Type": "application/json; charset=utf-8", **headers})
    internal._content = raw
    internal.raw = HTTPResponse(body=io.BytesIO(raw), preload_content=False, status=status)
    internal.reason = {200: "OK", 201: "Created", 202: "Accepted", 204: "No Content", 400: "Bad Request",
                       404: "Not Found", 409: "Conflict", 500: "Internal Server Error"}.get(status, "")
    internal.url = request.url
    internal.encoding = "utf-8"
    if type(request).__module__.startswith("azure.core.rest"):
        response = RestRequestsTransportResponse(request=request, internal_response=internal)
        if not stream:  # as azure-core's RequestsTransport does for non-streamed responses
            response.read()
        return response
    return RequestsTransportResponse(request, internal)


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def service_error(status: int, message: str, code: str = "UserError", inner: str | None = None,
                  details: list[dict[str, Any]] | None = None, location: str = "westeurope") -> Reply:
    """A refusal as Azure ML's management front end writes it: the ``error`` object azure-core parses
    (``code``, ``message``, ``details``, nested ``innerError`` codes) and the correlation envelope.

    The shape is that of the UserError bodies quoted in Azure/azure-sdk-for-python#11368 and
    Azure/MachineLearningNotebooks#700 (``code``, ``message``, ``details``, ``innerError``, ``debugInfo``).
    """
    inner_error = {"code": "BadArgument", "innerError": {"code": inner}} if inner else None
    body = {
        "error": {"code": code, "severity": None, "message": message, "messageFormat": None,
                  "messageParameters": None, "referenceCode": None, "detailsUri": None, "target": None,
                  "details": details or [], "innerError": inner_error, "debugInfo": None, "additionalInfo": None},
        "correlation": {"operation": "00000000000000000000000000000000", "request": "0000000000000000"},
        "environment": location, "location": location, "time": "2025-01-01T00:00:00.0000000+00:00",
        "componentName": "managementfrontend",
    }
    return status, body, {"x-ms-error-code": code}


# --- the service's rules (what `strict` refuses) ------------------------------------------------------------
# Experiment names: the service's own text, quoted in microsoft/dstoolkit-mlops-v2#180 and
# dotnet/machinelearning-modelbuilder#1773 (a 400 on job creation).
EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,255}")
EXPERIMENT_NAME_MESSAGE = ("Experiment name must be 1-256 characters, start with a letter or a number, and can only "
                           "contain letters, numbers, underscores, and dashes.")
# Job names are run ids: the pattern azure-ai-ml's own run history client puts on `runId`
# (_restclient/runhistory/operations/_runs_operations.py). No public quote of the refusal was found: the text is ours.
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,255}")
JOB_NAME_MESSAGE = ("Job name {name!r} is invalid: it must be 1-256 characters, start with a letter or a number, and "
                    "can only contain letters, numbers, underscores, and dashes.")
# Compute names: the service's text, quoted in MicrosoftLearning/DP100#50 and augerai/a2ml#65 (then 2-16 characters);
# clusters now take 3-32 (Microsoft's resource naming rules for Microsoft.MachineLearningServices computes).
COMPUTE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9-]{1,30}[A-Za-z0-9]")
COMPUTE_NAME_MESSAGE = ("Compute name is invalid. It can include letters, digits and dashes. It must start with a "
                        "letter, end with a letter or digit, and be between 3 and 32 characters in length.")
# shmSize: the REST model's own description (azure-ai-ml JobResourceConfiguration.shm_size, and the command job
# YAML reference): "(number)(unit) where number as to be greater than 0 and the unit can be one of b, k, m, g".
SHM_SIZE = re.compile(r"0*[1-9][0-9]*[bkmgBKMG]")
SHM_SIZE_MESSAGE = ("Invalid shmSize {value!r}: it must be in the format (number)(unit) where number has to be "
                    "greater than 0 and the unit is one of b(bytes), k(kilobytes), m(megabytes) or g(gigabytes).")
# Cancelling a job that is finalizing or has ended is an error (Azure/azureml-assets#2496: "the job was finalizing
# and we tried cancelling it which is an error"). The service's exact status and words are not quoted publicly;
# this 400 UserError is our stand-in until `make azure-smoke` records the live answer.
UNCANCELLABLE = ("Finalizing", "Completed", "Failed", "Canceled")
CANCEL_MESSAGE = "Cannot cancel job {name} because it is in {status} state; only a job that has not ended can be canceled."
# A cluster that cannot grow: the AmlCompute resource's `properties.errors` (a list of ErrorResponse) with
# allocationState Resizing. The message has the shape of Azure's core quota refusals (hashicorp/terraform#10056).
QUOTA_MESSAGE = ("Operation results in exceeding quota limits of Core. Maximum allowed: 0, Current in use: 0, "
                 "Additional requested: 4.")


def _not_found(what: str) -> Reply:
    return 404, _error("UserError", f"{what} not found"), {"x-ms-error-code": "ResourceNotFound"}


@dataclass
class FakeAzureML:
    """State and canned answers of one workspace's control plane (ARM + run history)."""

    subscription: str = "00000000-0000-0000-0000-000000000000"
    resource_group: str = "rg-nbbatch"
    workspace: str = "ws-nbbatch"
    location: str = "westeurope"
    computes: dict[str, dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    environments: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    codes: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    datastores: dict[str, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    compute_errors: list[dict[str, Any]] = field(default_factory=list)
    code_uploaded: bool = True  # answer "this snapshot hash exists" so the SDK skips the blob upload
    code_hashes: list[str] = field(default_factory=list)
    # job name -> statuses its GETs walk through (the last one sticks), to let `wait` see progress
    job_scripts: dict[str, list[str]] = field(default_factory=dict)
    # job name -> (status, {log name: text}) steps of the run history's details (the last one sticks)
    run_history: dict[str, list[tuple[str, dict[str, str]]]] = field(default_factory=dict)
    log_texts: dict[tuple[str, str], str] = field(default_factory=dict)
    # refuse what the live service refuses (see the rules above); False: accept anything, as the fake once did
    strict: bool = True
    allocation_state: str = "Steady"  # what every compute reports (Resizing while it waits for nodes)
    # display name (run id) -> the answer to creating its job: a refusal only the service can make
    job_refusals: dict[str, Reply] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.transport = CannedTransport()
        self.credential = FakeCredential()
        self._install()

    # helpers for tests -------------------------------------------------------------------------
    @property
    def ws_path(self) -> str:
        return (f"/subscriptions/{self.subscription}/resourceGroups/{self.resource_group}/"
                f"{PROVIDER}/workspaces/{self.workspace}")

    def ml_client(self) -> Any:
        """A real MLClient whose every request goes to this fake, failing at once (no retries)."""
        from azure.ai.ml import MLClient

        return MLClient(
            self.credential, self.subscription, self.resource_group, self.workspace,
            transport=self.transport, retry_total=0,
        )

    def set_job_status(self, name: str, status: str, error: str | None = None) -> None:
        self.jobs[name]["properties"]["status"] = status
        if error:
            self.jobs[name]["properties"].setdefault("properties", {})["azureml.nbbatch.fake-error"] = error

    def stall_allocation(self, job: str | None = None, code: str = "QuotaExceeded", message: str = QUOTA_MESSAGE) -> None:
        """Make the clusters unable to get nodes (resizing, with ``code: message`` in their ``errors``), and ``job``
        (when given) wait in Queued for them, as a job does on a cluster whose VM family has no quota."""
        self.allocation_state = "Resizing"
        self.compute_errors = [{"error": {"code": code, "message": message, "details": [], "additionalInfo": []}}]
        if job is not None:
            self.set_job_status(job, "Queued")

    def forget_code_snapshots(self) -> None:
        """Make the service answer that no snapshot was uploaded yet (the SDK then uploads to blob storage)."""
        self.code_uploaded = False

    # routing ------------------------------------------------------------------------------------
    def _install(self) -> None:
        ws = re.escape(self.ws_path)
        t = self.transport
        t.route("GET", ws, self._get_workspace)
        t.route("GET", r"/discovery", self._discovery)
        t.route("PUT", ws + r"/computes/(?P<name>[^/]+)", self._put_compute)
        t.route("GET", ws + r"/computes/(?P<name>[^/]+)", self._get_compute)
        t.route("PATCH", ws + r"/computes/(?P<name>[^/]+)", self._patch_compute)
        t.route("DELETE", ws + r"/computes/(?P<name>[^/]+)", self._delete_compute)
        t.route("POST", ws + r"/computes/(?P<name>[^/]+)/listNodes", self._list_nodes)
        t.route("GET", r"/fake-operations/(?P<op>[^/]+)", self._get_operation)
        t.route("GET", ws + r"/environments/(?P<name>[^/]+)/versions/(?P<version>[^/]+)", self._get_environment)
        t.route("PUT", ws + r"/environments/(?P<name>[^/]+)/versions/(?P<version>[^/]+)", self._put_environment)
        t.route("GET", ws + r"/codes/(?P<name>[^/]+)/versions", self._list_codes)
        t.route("GET", ws + r"/codes/(?P<name>[^/]+)/versions/(?P<version>[^/]+)", self._get_code)
        t.route("GET", ws + r"/datastores/(?P<name>[^/]+)", self._get_datastore)
        t.route("PUT", ws + r"/datastores/(?P<name>[^/]+)", self._put_datastore)
        t.route("PUT", ws + r"/jobs/(?P<name>[^/]+)", self._put_job)
        t.route("GET", ws + r"/jobs/(?P<name>[^/]+)", self._get_job)
        t.route("POST", ws + r"/jobs/(?P<name>[^/]+)/cancel", self._cancel_job)
        t.route("GET", r"/history/v1\.0" + ws + r"/runs/(?P<name>[^/]+)/details", self._run_details)
        t.route("GET", r"/fake-logs/(?P<name>[^/]+)/(?P<file>.+)", self._log_file)

    # workspace ------------------------------------------------------------------------------
    def _get_workspace(self, call: Call) -> Reply:
        return 200, {
            "id": self.ws_path, "name": self.workspace, "location": self.location,
            "type": "Microsoft.MachineLearningServices/workspaces",
            "properties": {
                "friendlyName": self.workspace,
                "discoveryUrl": f"https://{self.location}.api.azureml.ms/discovery",
                "mlFlowTrackingUri": f"azureml://{self.location}.api.azureml.ms/mlflow/v1.0{self.ws_path}",
                "workspaceId": "11111111-1111-1111-1111-111111111111",
            },
        }, {}

    def _discovery(self, call: Call) -> Reply:
        base = f"https://{self.location}.api.azureml.ms"
        return 200, {"api": base, "catalog": base, "experimentation": base, "history": base, "modelmanagement": base,
                     "pipelines": base, "studiometadata": base}, {}

    # computes --------------------------------------------------------------------------------
    def _operation(self) -> dict[str, str]:
        return {"Azure-AsyncOperation": f"{ARM}/fake-operations/{len(self.transport.calls)}?api-version=2023-08-01"}

    def _get_operation(self, call: Call) -> Reply:
        return 200, {"status": "Succeeded"}, {}

    def _put_compute(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        if self.strict and not COMPUTE_NAME.fullmatch(name):
            return service_error(400, COMPUTE_NAME_MESSAGE, inner="ComputeNameInvalid", location=self.location)
        body = call.json()
        body.update({"id": f"{self.ws_path}/computes/{name}", "name": name,
                     "type": "Microsoft.MachineLearningServices/workspaces/computes"})
        props = body["properties"]
        props["provisioningState"] = "Succeeded"
        inner = props.setdefault("properties", {})
        scale = inner.get("scaleSettings") or {}
        inner.update({
            "allocationState": self.allocation_state,
            "currentNodeCount": scale.get("minNodeCount", 0),
            "targetNodeCount": scale.get("minNodeCount", 0),
            "nodeStateCounts": {"idleNodeCount": scale.get("minNodeCount", 0), "runningNodeCount": 0,
                                "preparingNodeCount": 0, "unusableNodeCount": 0, "leavingNodeCount": 0,
                                "preemptedNodeCount": 0},
            "errors": self.compute_errors or None,
        })
        created = name not in self.computes
        self.computes[name] = body
        return (201 if created else 200), body, self._operation()

    def _get_compute(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        if name not in self.computes:
            return _not_found(f"compute {name}")
        body = self.computes[name]
        body["properties"]["properties"]["errors"] = self.compute_errors or None
        body["properties"]["properties"]["allocationState"] = self.allocation_state
        return 200, body, {}

    def _patch_compute(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        if name not in self.computes:
            return _not_found(f"compute {name}")
        patch = call.json() or {}
        scale = (patch.get("properties", {}).get("scaleSettings")) or {}
        inner = self.computes[name]["properties"]["properties"]
        inner.setdefault("scaleSettings", {}).update(scale)
        return 200, self.computes[name], self._operation()

    def _delete_compute(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        if name not in self.computes:
            return 204, None, {}
        del self.computes[name]
        return 202, None, self._operation()

    def _list_nodes(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        if name not in self.computes:
            return _not_found(f"compute {name}")
        return 200, {"nodes": self.nodes.get(name, []), "nextLink": None}, {}

    # environments -------------------------------------------------------------------------
    def _get_environment(self, call: Call) -> Reply:
        key = (call.match["name"], call.match["version"])  # type: ignore[index]
        if key not in self.environments:
            return _not_found(f"environment {key}")
        return 200, self.environments[key], {}

    def _put_environment(self, call: Call) -> Reply:
        name, version = call.match["name"], call.match["version"]  # type: ignore[index]
        body = call.json()
        body.update({"id": f"{self.ws_path}/environments/{name}/versions/{version}", "name": version,
                     "type": "Microsoft.MachineLearningServices/workspaces/environments/versions"})
        self.environments[(name, version)] = body
        return 201, body, {}

    # code ------------------------------------------------------------------------------------------
    def _code_body(self, name: str, version: str) -> dict[str, Any]:
        return {
            "id": f"{self.ws_path}/codes/{name}/versions/{version}", "name": version,
            "type": "Microsoft.MachineLearningServices/workspaces/codes/versions",
            "properties": {"codeUri": f"https://fakeblob.blob.core.windows.net/azureml-blobstore/LocalUpload/{name}",
                           "isAnonymous": True},
        }

    def _list_codes(self, call: Call) -> Reply:
        # The SDK names an anonymous snapshot with a fresh uuid and asks whether any code asset has
        # its content hash; answering with one lets it reuse that asset (no blob upload).
        digest = (call.query.get("hash") or [""])[0]
        self.code_hashes.append(digest)
        if not self.code_uploaded or not digest:
            return 200, {"value": []}, {}
        key = (f"snapshot-{digest[:12]}", "1")
        self.codes.setdefault(key, self._code_body(*key))
        return 200, {"value": [self.codes[key]]}, {}

    def _get_code(self, call: Call) -> Reply:
        key = (call.match["name"], call.match["version"])  # type: ignore[index]
        if key not in self.codes:
            return _not_found(f"code {key}")
        return 200, self.codes[key], {}

    # datastores -------------------------------------------------------------------------
    def _get_datastore(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        if name not in self.datastores:
            return _not_found(f"datastore {name}")
        return 200, self.datastores[name], {}

    def _put_datastore(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        body = call.json()
        body.update({"id": f"{self.ws_path}/datastores/{name}", "name": name,
                     "type": "Microsoft.MachineLearningServices/workspaces/datastores"})
        stored = json.loads(json.dumps(body))
        stored["properties"]["credentials"] = {"credentialsType": "AccountKey"}  # the service never returns secrets
        self.datastores[name] = stored
        return 201, stored, {}

    # jobs -----------------------------------------------------------------------------------------
    def _job_refusal(self, name: str, props: dict[str, Any]) -> Reply | None:
        """The service's answer to a job it refuses, or None: it takes it."""
        def refuse(message: str, inner: str, target: str) -> Reply:
            return service_error(400, message, inner=inner, location=self.location,
                                 details=[{"code": "Invalid", "target": target, "message": message}])

        if props.get("displayName") in self.job_refusals:
            return self.job_refusals[props["displayName"]]
        if not JOB_NAME.fullmatch(name):
            return refuse(JOB_NAME_MESSAGE.format(name=name), "JobNameInvalid", "name")
        experiment = props.get("experimentName") or "Default"
        if not EXPERIMENT_NAME.fullmatch(experiment):
            return refuse(EXPERIMENT_NAME_MESSAGE, "ExperimentNameInvalid", "experimentName")
        compute = str(props.get("computeId") or "").rstrip("/").rsplit("/", 1)[-1]
        if compute and not COMPUTE_NAME.fullmatch(compute):
            return refuse(COMPUTE_NAME_MESSAGE, "ComputeNameInvalid", "computeId")
        shm_size = (props.get("resources") or {}).get("shmSize")
        if shm_size is not None and not SHM_SIZE.fullmatch(str(shm_size)):
            return refuse(SHM_SIZE_MESSAGE.format(value=shm_size), "ShmSizeInvalid", "resources.shmSize")
        return None

    def _put_job(self, call: Call) -> Reply:
        name = unquote(call.match["name"])  # type: ignore[index]
        body = call.json()
        refusal = self._job_refusal(name, body.get("properties") or {}) if self.strict else None
        if refusal is not None:
            return refusal
        body.update({"id": f"{self.ws_path}/jobs/{name}", "name": name,
                     "type": "Microsoft.MachineLearningServices/workspaces/jobs"})
        props = body["properties"]
        props["status"] = "NotStarted"
        props["services"] = {"Studio": {"jobServiceType": "Studio",
                                        "endpoint": f"https://ml.azure.com/runs/{name}?wsid={self.ws_path}"}}
        self.jobs[name] = body
        return 201, body, {}

    def _get_job(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        if name not in self.jobs:
            return _not_found(f"job {name}")
        script = self.job_scripts.get(name)
        if script:
            self.jobs[name]["properties"]["status"] = script.pop(0) if len(script) > 1 else script[0]
        return 200, self.jobs[name], {}

    # run history (log streaming) -------------------------------------------------------------------
    def _run_details(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        if name not in self.jobs:
            return _not_found(f"run {name}")
        steps = self.run_history.get(name) or [(self.jobs[name]["properties"]["status"], {})]
        status, logs = steps.pop(0) if len(steps) > 1 else steps[0]
        files = {log: f"https://fakelogs.blob.core.windows.net/fake-logs/{name}/{log}?sig=fake" for log in logs}
        self.log_texts.update({(name, log): text for log, text in logs.items()})
        return 200, {"runId": name, "runUuid": "22222222-2222-2222-2222-222222222222", "status": status,
                     "logFiles": files, "warnings": []}, {}

    def _log_file(self, call: Call) -> Reply:
        key = (call.match["name"], call.match["file"])  # type: ignore[index]
        if key not in self.log_texts:
            return _not_found(f"log {key}")
        return 200, self.log_texts[key].encode(), {"Content-Type": "text/plain"}

    def _cancel_job(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        if name not in self.jobs:
            return _not_found(f"job {name}")
        status = self.jobs[name]["properties"]["status"]
        if self.strict and status in UNCANCELLABLE:
            return service_error(400, CANCEL_MESSAGE.format(name=name, status=status), inner="JobInTerminalState",
                                 location=self.location)
        self.cancelled.append(name)
        self.jobs[name]["properties"]["status"] = "CancelRequested"
        return 202, None, {"Location": f"{ARM}/fake-operations/cancel-{name}?api-version=2023-08-01"}
