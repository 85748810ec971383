"""``run.json``: the record of one run, versioned, written next to its executed notebook."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from nbbatch.errors import ShareError
from nbbatch.store.layout import RUN_RECORD

SCHEMA_VERSION = 1


class Status(str, Enum):
    """Where a run stands. A ``str``: ``record.status == "succeeded"`` and JSON hold the plain value."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    def __str__(self) -> str:
        return self.value

    @property
    def final(self) -> bool:
        """Whether a run in this status has ended."""
        return self in FINAL_STATUSES


STATUSES = tuple(s.value for s in Status)
FINAL_STATUSES = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.TIMED_OUT})


class ErrorKind(str, Enum):
    """Why a run did not succeed, as a value code can branch on (the error's text is for people)."""

    CELL_ERROR = "cell_error"  # an exception in a cell: never retried
    KERNEL_DIED = "kernel_died"  # the kernel process died (OOM kill, segfault): retried
    TIMEOUT = "timeout"  # the run or a cell ran past its timeout
    CANCELLED = "cancelled"  # a cancel request, Ctrl-C, or cancelled in the backend
    NO_KERNEL = "no_kernel"  # the run's kernel is not installed where it executed
    SHARE = "share"  # the share could not be written
    INFRA = "infra"  # outside the notebook: a lost node, task or job, a dead driver
    INTERNAL = "internal"  # nbbatch itself could not execute the notebook

    def __str__(self) -> str:
        return self.value


def utc_now() -> str:
    """The current time as an ISO-8601 UTC string (what every record stores)."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class RunError:
    """Why a run did not succeed: the failing cell and the exception, not a bare traceback."""

    ename: str
    evalue: str
    cell_index: int | None = None
    cell_source: str | None = None  # the first lines of the failing cell
    reason: str | None = None  # for failures outside a cell: kernel death, timeout, cancel (for people)
    kind: ErrorKind | None = None  # what kind of failure (for code)
    rank: int | None = None  # the rank of a distributed run that failed first

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "kind" and value is not None:
            value = ErrorKind(value)
        object.__setattr__(self, name, value)

    def summary(self) -> str:
        where = f"cell {self.cell_index}: " if self.cell_index is not None else ""
        where = f"rank {self.rank}: {where}" if self.rank is not None else where
        text = f"{where}{self.ename}: {self.evalue}".strip()
        return f"{text} ({self.reason})" if self.reason else text


@dataclass
class RunRecord:
    """Everything known about one run; serialised as ``run.json`` (schema :data:`SCHEMA_VERSION`)."""

    run_id: str
    experiment: str
    notebook: str
    kernel: str
    framework: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    status: Status = Status.QUEUED
    attempts: int = 0
    queued_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    duration_s: float | None = None
    host: str | None = None
    pid: int | None = None
    backend: str = "local"
    gpu_ids: list[int] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    error: RunError | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    cells_done: int = 0
    cells_total: int = 0
    timeout_s: float | None = None
    telemetry: dict[str, Any] = field(default_factory=dict)
    gpu_share: dict[str, Any] = field(default_factory=dict)  # how its GPUs were shared: runs_per_gpu, shared, mps…
    container: dict[str, Any] = field(default_factory=dict)  # the image it ran in: engine, image, image_id, name
    inputs: dict[str, Any] = field(default_factory=dict)  # parameter -> {source, path}: the folders it read
    outputs: list[dict[str, Any]] = field(default_factory=list)  # {name, bytes, sha256} under outputs/
    attempt_log: list[dict[str, Any]] = field(default_factory=list)  # one entry per attempt: how it ended, resumed_from
    world_size: int = 1  # ranks of a distributed run (one kernel each)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # a distributed run's {rank, host, gpus, status, error}
    rank: int | None = None  # set in ranks/<rank>/run.json: the record of that rank alone
    schema_version: int = SCHEMA_VERSION

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "status":  # a status is always a Status, also when code sets the plain text
            value = Status(value)
        object.__setattr__(self, name, value)

    @property
    def final(self) -> bool:
        """Whether the run has ended (succeeded, failed, cancelled or timed out)."""
        return self.status in FINAL_STATUSES

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str) + "\n").encode()

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = RUN_RECORD) -> RunRecord:
        if not isinstance(data, dict):
            raise ShareError(f"{source} is not a run record (expected a JSON object); delete it to rerun that run")
        version = data.get("schema_version", SCHEMA_VERSION)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ShareError(f"{source} has schema_version {version!r}; this nbbatch reads up to {SCHEMA_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        missing = [k for k in ("run_id", "experiment", "notebook", "kernel") if k not in values]
        if missing:
            raise ShareError(f"{source} lacks {', '.join(missing)}; delete it to rerun that run")
        if values.get("status", "queued") not in STATUSES:
            raise ShareError(f"{source} has an unknown status {values.get('status')!r} (known: {', '.join(STATUSES)})")
        _check_types(values, _FIELD_TYPES, source, "")
        if isinstance(values.get("error"), dict):
            error = values["error"]
            _check_types(error, _ERROR_TYPES, source, "error.")
            missing = [k for k in ("ename", "evalue") if k not in error]
            if missing:
                raise ShareError(f"{source} has a malformed `error` (it lacks {', '.join(missing)}); fix it or delete it")
            if error.get("kind") is not None and error["kind"] not in {k.value for k in ErrorKind}:
                error = {**error, "kind": None}  # a kind from a newer nbbatch: keep the text, drop the kind
            values["error"] = RunError(**{k: v for k, v in error.items() if k in _ERROR_TYPES})
        try:
            return cls(**values)
        except TypeError as exc:  # pragma: no cover - defensive
            raise ShareError(f"{source} is malformed: {exc}") from exc

    @classmethod
    def from_json(cls, text: bytes | str, source: str = RUN_RECORD) -> RunRecord:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ShareError(
                f"{source} is not valid JSON ({exc}); it was hand-edited or truncated. "
                "Fix it or delete it (the run is then treated as never run)."
            ) from exc
        return cls.from_dict(data, source)


_STR, _OPT_STR, _INT, _OPT_INT = ("a string", str), ("a string or null", (str, type(None))), ("an integer", int), \
    ("an integer or null", (int, type(None)))
_OPT_NUM = ("a number or null", (int, float, type(None)))
_DICT = ("a JSON object", dict)
_FIELD_TYPES: dict[str, tuple[str, Any]] = {
    "run_id": _STR, "experiment": _STR, "notebook": _STR, "kernel": _STR, "framework": _OPT_STR,
    "parameters": _DICT, "status": _STR, "attempts": _INT, "queued_at": _OPT_STR, "started_at": _OPT_STR,
    "ended_at": _OPT_STR, "duration_s": _OPT_NUM, "host": _OPT_STR, "pid": _OPT_INT, "backend": _STR,
    "gpu_ids": ("a list of integers", list), "environment": _DICT, "error": ("a JSON object or null", (dict, type(None))),
    "metrics": _DICT, "cells_done": _INT, "cells_total": _INT, "timeout_s": _OPT_NUM, "telemetry": _DICT,
    "gpu_share": _DICT, "container": _DICT, "inputs": _DICT, "outputs": ("a list", list),
    "attempt_log": ("a list", list), "world_size": _INT, "ranks": ("a list", list), "rank": _OPT_INT,
    "schema_version": _INT,
}
_ERROR_TYPES: dict[str, tuple[str, Any]] = {
    "ename": _STR, "evalue": _STR, "cell_index": _OPT_INT, "cell_source": _OPT_STR, "reason": _OPT_STR,
    "kind": _OPT_STR, "rank": _OPT_INT,
}


def _check_types(values: dict[str, Any], types: dict[str, tuple[str, Any]], source: str, prefix: str) -> None:
    """A hand-edited record with a wrong type is reported here (with its path), not as a crash in a table later."""
    for name, value in values.items():
        if name not in types:
            continue
        what, kinds = types[name]
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and kinds is not bool)
        if ok and name == "gpu_ids":
            ok = all(isinstance(g, int) and not isinstance(g, bool) for g in value)
        if not ok:
            import reprlib

            raise ShareError(f"{source} has `{prefix}{name}` = {reprlib.repr(value)}, which must be {what}; "
                             "fix it or delete it (the run is then treated as never run)")
