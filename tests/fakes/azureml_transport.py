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
from urllib.parse import parse_qs, quote, unquote, urlsplit

import requests
from azure.core.credentials import AccessToken, AccessTokenInfo
from azure.core.exceptions import ServiceResponseError
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
        self.slept: list[float] = []  # what the SDK's retry and LRO polling asked to wait, in order
        self.throttles: list[Throttle] = []
        self.dropped: list[Throttle] = []  # requests handled whose answer is lost (a timeout the client sees)
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

    def sleep(self, duration: float) -> None:  # retries and LRO polling: recorded, not waited for
        self.slept.append(float(duration))

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
            throttle = _take(self.throttles, call)
            if throttle is not None:
                return _response(request, *throttle.reply(), stream=bool(kwargs.get("stream")))
            for method, pattern, handler in self.routes:
                match = pattern.match(call.path)
                if method == call.method and match:
                    call.match = match
                    status, payload, headers = handler(call)
                    break
            else:
                self.unmatched.append(call)
                status, payload, headers = 404, _error("NotFound", f"no canned answer for {call.method} {call.path}"), {}
            if _take(self.dropped, call) is not None:
                raise ServiceResponseError(f"the connection was dropped after {call.method} {call.path} was handled")
        return _response(request, status, payload, headers, stream=bool(kwargs.get("stream")))


@dataclass
class Throttle:
    """Answer the next ``left`` requests that ``match`` (all: None) with ``status`` and ``Retry-After``."""

    status: int = 429
    retry_after: float = 1.0
    left: int | None = 1
    match: Callable[[Call], bool] | None = None

    def reply(self) -> Reply:
        if self.status == 429:  # Azure Resource Manager's throttling answer (see THROTTLED_MESSAGE)
            body = _error("SubscriptionRequestsThrottled", THROTTLED_MESSAGE.format(seconds=f"{self.retry_after:g}"))
        else:
            body = _error("ServiceUnavailable", "The service is temporarily unavailable.")
        return self.status, body, {"Retry-After": f"{self.retry_after:g}", "x-ms-error-code": body["error"]["code"]}


def _take(items: list[Throttle], call: Call) -> Throttle | None:
    """The first of ``items`` matching ``call`` (counted down; spent ones dropped)."""
    items[:] = [t for t in items if t.left is None or t.left > 0]
    for item in items:
        if item.match is None or item.match(call):
            if item.left is not None:
                item.left -= 1
            return item
    return None


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
                       404: "Not Found", 409: "Conflict", 429: "Too Many Requests", 500: "Internal Server Error",
                       503: "Service Unavailable"}.get(status, "")
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
# and we tried cancelling it which is an error"). The REST spec (Jobs_Cancel) documents only the answers to a cancel
# it takes (200/202 with a Location header: examples/Job/cancel.json) and, for any other, the shape of ARM's
# ErrorResponse (code, message, target, details, additionalInfo); the service's status and words for this refusal are
# published nowhere. So the fake refuses with that documented shape and no words of its own: a 400 UserError whose
# message only names the job and its state, which nbbatch must never parse (it reads the job's state back instead).
# `make azure-smoke` records the live answer (issue 50's probes).
UNCANCELLABLE = ("Finalizing", "Completed", "Failed", "Canceled")
# ARM's answer over its request limits: 429 with Retry-After (learn.microsoft.com, "Understand how Azure Resource
# Manager throttles requests": "you receive the HTTP status code 429 Too many requests. The response includes a
# Retry-After value"), error code SubscriptionRequestsThrottled, in the words that page quotes.
THROTTLED_MESSAGE = ("Number of 'read' requests for subscription '00000000-0000-0000-0000-000000000000' actor "
                     "'00000000-0000-0000-0000-000000000000' exceeded. Please try again after '{seconds}' seconds "
                     "after additional tokens are available. Refer to https://aka.ms/arm-throttling")
# An environment version is immutable: re-registering one with another definition is refused, in the service's words
# quoted in Azure/azure-cli-extensions#5440 ("(UserError) Environment test_env with version 6 is already registered
# and cannot be changed."). Its description and tags may change (Azure/azure-sdk-for-python#38590).
ENVIRONMENT_FROZEN_MESSAGE = "Environment {name} with version {version} is already registered and cannot be changed."
ENVIRONMENT_MUTABLE = ("description", "tags", "properties", "isArchived", "stage")
# A job name taken: "a job with this ID already exists" (Azure/azureml-previews#37). The status code is not
# published; 409 Conflict is what ARM answers a create of an existing resource that cannot be updated in place.
JOB_EXISTS_MESSAGE = "A job with this ID already exists: {name}."
# A job naming a compute, environment, code snapshot or datastore the workspace lacks. No public quote of these
# refusals was found: the texts are ours, in the service's UserError shape (400 for what the job references, as the
# service answers for a job body it cannot resolve).
MISSING_REFERENCE_MESSAGE = "The job references {what} {name!r}, which does not exist in workspace {workspace}."
# How long an AmlCompute takes to provision: its PUT answers 201 with provisioningState Creating and an
# Azure-AsyncOperation header (examples/Compute/createOrUpdate/BasicAmlCompute.json), whose operation reports
# InProgress until the cluster is made (ARM's async operation pattern: InProgress, then Succeeded or Failed).
COMPUTE_CREATE_POLLS = 3
CANCEL_MESSAGE = "Job {name} is {status}."  # a placeholder in the documented shape (see above), not the service's words
# A cluster that cannot grow: the AmlCompute resource's `properties.errors` (a list of ErrorResponse) with
# allocationState Resizing. The message has the shape of Azure's core quota refusals (hashicorp/terraform#10056).
QUOTA_MESSAGE = ("Operation results in exceeding quota limits of Core. Maximum allowed: 0, Current in use: 0, "
                 "Additional requested: 4.")


def _matcher(method: str | None, path: str | None) -> Callable[[Call], bool]:
    return lambda call: (method is None or call.method == method.upper()) and (path is None or path in call.path)


def _definition(environment: dict[str, Any]) -> dict[str, Any]:
    """What makes an environment version what it is (its image, build, conda file …), without what may change."""
    props = environment.get("properties") or {}
    return {k: v for k, v in props.items() if k not in ENVIRONMENT_MUTABLE and v is not None}


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
    page_size: int = 100  # items per page of a list; the rest behind `nextLink`
    compute_create_polls: int = COMPUTE_CREATE_POLLS  # polls of its async operation a compute is Creating for
    operations: dict[str, list[str]] = field(default_factory=dict)  # async operation -> statuses it answers
    # job name -> GETs answered 404 before it shows (the service's eventual consistency after a create)
    unseen_jobs: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._operation_done: dict[str, Callable[[], None] | None] = {}
        self.transport = CannedTransport()
        self.credential = FakeCredential()
        self._install()

    # helpers for tests -------------------------------------------------------------------------
    @property
    def ws_path(self) -> str:
        return (f"/subscriptions/{self.subscription}/resourceGroups/{self.resource_group}/"
                f"{PROVIDER}/workspaces/{self.workspace}")

    def ml_client(self, retries: bool = False) -> Any:
        """A real MLClient whose every request goes to this fake: failing at once, or with ``retries`` through the
        SDK's own retry policy (its defaults: 429, 5xx and dropped connections retried, ``Retry-After`` honored;
        the waits are recorded in :attr:`CannedTransport.slept`, not slept)."""
        from azure.ai.ml import MLClient

        options = {} if retries else {"retry_total": 0}
        return MLClient(self.credential, self.subscription, self.resource_group, self.workspace,
                        transport=self.transport, **options)

    def throttle(self, requests: int | None = 1, *, status: int = 429, retry_after: float = 5,
                 method: str | None = None, path: str | None = None) -> None:
        """Answer the next ``requests`` requests (``method``, path containing ``path``) with ``status`` and
        ``Retry-After``, as ARM (429) or the service behind it (503) does over its limits."""
        self.transport.throttles.append(Throttle(status, retry_after, requests, _matcher(method, path)))

    def drop_responses(self, requests: int = 1, *, method: str | None = None, path: str | None = None) -> None:
        """Handle the next ``requests`` matching requests but lose their answers (the client sees a dropped
        connection and, with retries on, sends the request again)."""
        self.transport.dropped.append(Throttle(0, 0, requests, _matcher(method, path)))

    def register_environment(self, name: str, version: str, image: str = "mcr.microsoft.com/azureml/base:latest") -> str:
        """An environment the workspace has (as registered by hand); its ``azureml:name:version`` reference."""
        self.environments[(name, version)] = {
            "id": f"{self.ws_path}/environments/{name}/versions/{version}", "name": version,
            "type": "Microsoft.MachineLearningServices/workspaces/environments/versions",
            "properties": {"image": image, "osType": "Linux"}}
        return f"azureml:{name}:{version}"

    def add_compute(self, name: str, vm_size: str = "Standard_NC4as_T4_v3", max_nodes: int = 2) -> None:
        """A cluster the workspace has, provisioned (as made by hand)."""
        self.computes[name] = {
            "id": f"{self.ws_path}/computes/{name}", "name": name, "location": self.location,
            "type": "Microsoft.MachineLearningServices/workspaces/computes",
            "properties": {"computeType": "AmlCompute", "provisioningState": "Succeeded", "properties": {
                "vmSize": vm_size, "vmPriority": "Dedicated", "allocationState": "Steady", "currentNodeCount": 0,
                "targetNodeCount": 0, "scaleSettings": {"minNodeCount": 0, "maxNodeCount": max_nodes,
                                                        "nodeIdleTimeBeforeScaleDown": "PT120S"}}}}

    def add_datastore(self, name: str, account: str = "acct", share: str = "nbbatch") -> None:
        """An Azure File datastore the workspace has (as registered by hand)."""
        self.datastores[name] = {
            "id": f"{self.ws_path}/datastores/{name}", "name": name,
            "type": "Microsoft.MachineLearningServices/workspaces/datastores",
            "properties": {"datastoreType": "AzureFile", "accountName": account, "fileShareName": share,
                           "endpoint": "core.windows.net", "protocol": "https",
                           "credentials": {"credentialsType": "AccountKey"}}}

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
        t.route("GET", ws + r"/jobs", self._list_jobs)
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
    def _operation(self, statuses: list[str] | None = None, then: Callable[[], None] | None = None) -> dict[str, str]:
        """The headers of an accepted long-running operation, whose status walks through ``statuses`` (the last one
        sticks; ``then`` runs when it reaches it)."""
        op = str(len(self.transport.calls))
        self.operations[op] = list(statuses or ["Succeeded"])
        self._operation_done[op] = then
        return {"Azure-AsyncOperation": f"{ARM}/fake-operations/{op}?api-version=2023-08-01"}

    def _get_operation(self, call: Call) -> Reply:
        op = call.match["op"]  # type: ignore[index]
        statuses = self.operations.get(op) or ["Succeeded"]
        status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
        if len(statuses) == 1 and (done := self._operation_done.pop(op, None)) is not None:
            done()
        return 200, {"name": op, "status": status}, {}

    def _put_compute(self, call: Call) -> Reply:
        name = call.match["name"]  # type: ignore[index]
        if self.strict and not COMPUTE_NAME.fullmatch(name):
            return service_error(400, COMPUTE_NAME_MESSAGE, inner="ComputeNameInvalid", location=self.location)
        body = call.json()
        body.update({"id": f"{self.ws_path}/computes/{name}", "name": name,
                     "type": "Microsoft.MachineLearningServices/workspaces/computes"})
        props = body["properties"]
        created = name not in self.computes
        props["provisioningState"] = "Creating" if created else self.computes[name]["properties"]["provisioningState"]
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
        self.computes[name] = body
        if not created:
            return 200, body, self._operation()

        def provisioned() -> None:
            props["provisioningState"] = "Succeeded"

        return 201, body, self._operation(["InProgress"] * self.compute_create_polls + ["Succeeded"], provisioned)

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
        page, next_link = self._page(call, self.nodes.get(name, []))
        return 200, {"nodes": page, "nextLink": next_link}, {}

    # environments -------------------------------------------------------------------------
    def _get_environment(self, call: Call) -> Reply:
        key = (call.match["name"], call.match["version"])  # type: ignore[index]
        if key not in self.environments:
            return _not_found(f"environment {key}")
        return 200, self.environments[key], {}

    def _put_environment(self, call: Call) -> Reply:
        name, version = call.match["name"], call.match["version"]  # type: ignore[index]
        body = call.json()
        existing = self.environments.get((name, version))
        if existing is not None and self.strict and _definition(existing) != _definition(body):
            return service_error(400, ENVIRONMENT_FROZEN_MESSAGE.format(name=name, version=version),
                                 location=self.location)
        body.update({"id": f"{self.ws_path}/environments/{name}/versions/{version}", "name": version,
                     "type": "Microsoft.MachineLearningServices/workspaces/environments/versions"})
        self.environments[(name, version)] = body
        return (200 if existing is not None else 201), body, {}

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
        return self._missing_reference(props)

    def _missing_reference(self, props: dict[str, Any]) -> Reply | None:
        """The refusal of a job naming a compute, environment, code snapshot or datastore the workspace lacks."""
        def missing(what: str, name: str, target: str) -> Reply:
            message = MISSING_REFERENCE_MESSAGE.format(what=what, name=name, workspace=self.workspace)
            return service_error(400, message, location=self.location,
                                 details=[{"code": "NotFound", "target": target, "message": message}])

        compute = str(props.get("computeId") or "").rstrip("/").rsplit("/", 1)[-1]
        if compute and compute not in self.computes:
            return missing("compute", compute, "computeId")
        env = re.search(r"/environments/([^/]+)/versions/([^/]+)$", str(props.get("environmentId") or ""))
        if env and "/registries/" not in str(props.get("environmentId")) and env.groups() not in self.environments:
            return missing("environment", ":".join(env.groups()), "environmentId")
        code = re.search(r"/codes/([^/]+)/versions/([^/]+)$", str(props.get("codeId") or ""))
        if code and code.groups() not in self.codes:
            return missing("code", ":".join(code.groups()), "codeId")
        for kind in ("inputs", "outputs"):
            for key, value in sorted((props.get(kind) or {}).items()):
                store = re.search(r"datastores/([^/]+)/paths/", str((value or {}).get("uri") or ""))
                if store and store.group(1) not in self.datastores:
                    return missing("datastore", store.group(1), f"{kind}.{key}.uri")
        return None

    def _page(self, call: Call, items: list[Any]) -> tuple[list[Any], str | None]:
        """One page of ``items`` from the request's ``$skip`` token, and the ``nextLink`` to the rest (None: none)."""
        start = int((call.query.get("$skip") or ["0"])[0])
        rest = start + self.page_size
        if rest >= len(items):
            return items[start:], None
        query = {k: v[0] for k, v in call.query.items() if k != "$skip"}
        link = f"{ARM}{call.path}?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items())
        return items[start:rest], f"{link}&$skip={rest}"

    def _list_jobs(self, call: Call) -> Reply:
        """Jobs_List: the workspace's jobs, filtered by ``properties`` (``name`` or ``name=value``, comma-separated)
        and ``tag`` (a tag key), a page at a time behind ``nextLink``."""
        wanted = [p.partition("=") for p in (call.query.get("properties") or [""])[0].split(",") if p]
        tag = (call.query.get("tag") or [None])[0]

        def listed(job: dict[str, Any]) -> bool:
            props = job["properties"]
            have = props.get("properties") or {}
            if tag is not None and tag not in (props.get("tags") or {}):
                return False
            return all(k in have and (not eq or have[k] == v) for k, eq, v in wanted)

        jobs = [job for name, job in self.jobs.items() if listed(job) and not self.unseen_jobs.get(name)]
        page, next_link = self._page(call, jobs)
        return 200, {"value": page, "nextLink": next_link}, {}

    def _put_job(self, call: Call) -> Reply:
        name = unquote(call.match["name"])  # type: ignore[index]
        body = call.json()
        refusal = self._job_refusal(name, body.get("properties") or {}) if self.strict else None
        if refusal is not None:
            return refusal
        if name in self.jobs:
            return service_error(409, JOB_EXISTS_MESSAGE.format(name=name), location=self.location)
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
        if self.unseen_jobs.get(name):  # made, but this replica does not know it yet
            self.unseen_jobs[name] -= 1
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
            return service_error(400, CANCEL_MESSAGE.format(name=name, status=status), location=self.location)
        self.cancelled.append(name)
        self.jobs[name]["properties"]["status"] = "CancelRequested"
        # As examples/Job/cancel.json: 202 with a Location (the SDK polls it until the cancel is taken).
        return 202, None, {"Location": f"{ARM}/fake-operations/cancel-{name}?api-version=2023-08-01"}
