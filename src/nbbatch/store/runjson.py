"""``run.json``: the record of one run, versioned, written next to its executed notebook.

Every field is typed, the nested entries too (:class:`AttemptEntry`, :class:`RankOutcome`, :class:`GpuSharing`,
:class:`ContainerInfo`, :class:`InputBinding`, an output's :class:`~nbbatch.store.sync.FileEntry`). A record is read
by those types (:meth:`RunRecord.from_dict`): a hand-edited or damaged file is reported with the dotted path of its
wrong value, not as a crash in a table later.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from nbbatch.errors import ShareError
from nbbatch.store.layout import RUN_RECORD
from nbbatch.store.sync import FileEntry

SCHEMA_VERSION = 1


class Status(str, Enum):
    """Where a run stands. A ``str``: ``record.status == "succeeded"`` and JSON hold the plain value."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    PRUNED = "pruned"  # stopped by its search's pruner: final, kept at its last step, never run again

    def __str__(self) -> str:
        return self.value

    @property
    def final(self) -> bool:
        """Whether a run in this status has ended."""
        return self in FINAL_STATUSES


STATUSES = tuple(s.value for s in Status)
FINAL_STATUSES = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.TIMED_OUT, Status.PRUNED})
DONE_STATUSES = frozenset({Status.SUCCEEDED, Status.PRUNED})  # ended as meant: a resubmit leaves them alone


class ErrorKind(str, Enum):
    """Why a run did not succeed, as a value code can branch on (the error's text is for people)."""

    CELL_ERROR = "cell_error"  # an exception in a cell: never retried
    KERNEL_DIED = "kernel_died"  # the kernel process died (OOM kill, segfault): retried
    TIMEOUT = "timeout"  # the run or a cell ran past its timeout
    CANCELLED = "cancelled"  # a cancel request, Ctrl-C, or cancelled in the backend
    PRUNED = "pruned"  # its search's pruner stopped it
    NO_KERNEL = "no_kernel"  # the run's kernel is not installed where it executed
    SHARE = "share"  # the share could not be written
    INFRA = "infra"  # outside the notebook: a lost node, task or job, a dead driver
    INTERNAL = "internal"  # nbbatch itself could not execute the notebook

    def __str__(self) -> str:
        return self.value


def utc_now() -> str:
    """The current time as an ISO-8601 UTC string (what every record stores)."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


# How a field is written, in its metadata (the JSON stays what earlier nbbatch versions wrote):
_OMIT_DEFAULT = "omit_default"  # left out while it has its default: a key written only once it is known
_EMPTY_IS_NONE = "empty_is_none"  # None is written as {}, and {} reads as None


def _written_when_set(default: Any = None) -> Any:
    """A field left out of the JSON while it has ``default``."""
    return field(default=default, metadata={_OMIT_DEFAULT: True})


TRACEBACK_LINES, TRACEBACK_CHARS = 100, 20_000  # what a record keeps of a traceback: its end, nearest the error
_ANSI_COLOURS = re.compile("\x1b\\[(K|.*?m)")  # as papermill's strip_color: IPython colours its tracebacks


def plain_traceback(lines: list[str] | str | None) -> str | None:
    """A kernel's traceback (its ``error`` output's lines) as plain text, colours stripped, bounded to its last
    :data:`TRACEBACK_LINES` lines and :data:`TRACEBACK_CHARS` characters (None: there is none)."""
    text = _ANSI_COLOURS.sub("", lines if isinstance(lines, str) else "\n".join(lines or [])).strip("\n")
    if not text:
        return None
    every = text.splitlines()
    kept = "\n".join(every[-TRACEBACK_LINES:])
    if len(every) <= TRACEBACK_LINES and len(kept) <= TRACEBACK_CHARS:
        return kept
    return "[… the traceback's start is left out]\n" + kept[-TRACEBACK_CHARS:]


def cell_label(number: int | None, source: str | None = None) -> str:
    """How every command names a notebook's cell: ``cell 3 ("model.fit(X, y)")``, numbered as in the user's own
    notebook (1-based, every cell counted, the parameters cell papermill injects not), with its first line."""
    if number is None:
        return ""
    first = next((line.strip() for line in (source or "").splitlines() if line.strip()), "")
    if len(first) > 40:
        first = first[:39] + "…"
    return f"cell {number}" + (f" ({json.dumps(first, ensure_ascii=False)})" if first else "")


def local_clock(when: str, now: datetime | None = None) -> str:
    """A record's UTC time as this machine's local time: ``14:02`` today, ``2026-11-27 14:02`` another day."""
    try:
        moment = datetime.fromisoformat(when.replace("Z", "+00:00"))
    except ValueError:
        return when
    moment = (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).astimezone()
    today = (now or datetime.now(timezone.utc)).astimezone().date()
    return moment.strftime("%H:%M" if moment.date() == today else "%Y-%m-%d %H:%M")


@dataclass
class RunError:
    """Why a run did not succeed: the failing cell and the exception (with the kernel's traceback), or who stopped
    it and when. :meth:`summary` is the one line every command, widget and notification shows."""

    ename: str
    evalue: str
    cell_index: int | None = None  # the cell's number in the user's notebook: 1-based, the injected cell not counted
    cell_source: str | None = None  # the first lines of the failing cell
    reason: str | None = None  # for failures outside a cell: kernel death, timeout, cancel (for people)
    kind: ErrorKind | None = None  # what kind of failure (for code)
    rank: int | None = None  # the rank of a distributed run that failed first
    traceback: str | None = _written_when_set()  # a cell error's traceback as papermill shows it (plain_traceback)
    stopped_by: str | None = _written_when_set()  # a cancel's sender in short: "`nbbatch cancel`", "SIGTERM to …"
    stopped_at: str | None = _written_when_set()  # when that cancel was asked (UTC)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "kind" and value is not None:
            value = ErrorKind(value)
        object.__setattr__(self, name, value)

    def summary(self, cells: tuple[int, int] | None = None, started: bool = True, ended_at: str | None = None,
                with_cell: bool = True, now: datetime | None = None) -> str:
        """The error in one line: ``cell 3 ("model.fit(X, y)"): ValueError: bad (reason)``, or for a cancel
        ``cancelled by `nbbatch cancel` at 14:02 (after 3 of 9 cells)``. ``cells`` (done, of how many), ``started``
        and ``ended_at`` are the record's (:meth:`RunRecord.error_summary` passes them); ``with_cell=False`` leaves
        the cell out, and says a cancel how far first (a narrow column, beside the status)."""
        where = f"rank {self.rank}: " if self.rank is not None else ""
        if self.kind == ErrorKind.CANCELLED:
            return where + self._cancel_text(cells, started, ended_at, now, narrow=not with_cell)
        cell = cell_label(self.cell_index, self.cell_source) if with_cell else ""
        text = f"{where}{cell + ': ' if cell else ''}{self.ename}: {self.evalue}".strip()
        return f"{text} ({self.reason})" if self.reason else text

    def _cancel_text(self, cells: tuple[int, int] | None, started: bool, ended_at: str | None,
                     now: datetime | None, narrow: bool = False) -> str:
        at = self.stopped_at or ended_at
        if self.stopped_by:
            text = f"cancelled by {self.stopped_by}" + (f" at {local_clock(at, now)}" if at else "")
        else:  # a cluster's own cancel (scancel, a stopped container), or a record of an earlier nbbatch
            text = self.reason or "cancelled"
            text = text if text.startswith("cancelled") else f"cancelled: {text}"
        done = self.cell_index - 1 if self.cell_index is not None else cells[0] if cells else 0  # not the stopped one
        how_far = "before it started" if not started else \
            f"after {done} of {cells[1]} cells" if cells is not None and cells[1] else ""
        if not how_far or how_far in text:
            return text
        if narrow:  # what a cut keeps first: how far, then who and when (the status column says "cancelled")
            return f"{how_far}, {text.removeprefix('cancelled').lstrip(': ')}"
        return f"{text[:-1]}, {how_far})" if text.endswith(")") else f"{text} ({how_far})"


@dataclass(frozen=True)
class CheckpointSummary:
    """The checkpoints an attempt resumed from (``NBBATCH_CHECKPOINT_DIR``): how many files, their bytes, the newest."""

    files: int
    bytes: int
    latest: str


@dataclass
class AttemptEntry:
    """One entry of ``attempt_log``: where and when an attempt ran, what it resumed from and how it ended."""

    attempt: int
    host: str | None = None
    started_at: str | None = None
    resumed_from: CheckpointSummary | None = None
    ended_at: str | None = _written_when_set()  # left out while the attempt runs
    status: str | None = _written_when_set()  # a Status's value, or ``lost`` (its node or job was lost)
    kind: ErrorKind | None = None  # the error's kind (``infra`` for a lost attempt)


@dataclass(frozen=True)
class RankOutcome:
    """One entry of a distributed run's ``ranks``: where the rank ran and how it ended."""

    rank: int
    node: int
    host: str | None
    gpus: list[int]
    status: str  # a Status's value, or ``stopped`` (cancelled after another rank failed)
    error: str | None = None  # the summary of its error


@dataclass(frozen=True)
class GpuSharing:
    """``gpu_share``: how a run's GPUs were shared with other runs (see docs/gpus.md)."""

    runs_per_gpu: int | str = 1  # a count, or ``auto``: packed by memory
    shared: bool = False  # other runs were on its GPUs
    exclusive: bool = False  # no other run joined its GPUs
    mps: bool = False  # under CUDA MPS
    need_mb: float | None = _written_when_set()  # with runs_per_gpu auto: the memory reserved for it
    need_from: str | None = _written_when_set()  # where need_mb comes from: measured, measured (running), framework
    # or unknown
    alone_for_s: float | None = _written_when_set()  # need unknown: how long it ran alone before other runs joined it
    alone: bool = _written_when_set(False)  # run again alone, after running out of GPU memory beside others
    retried_after: str | None = _written_when_set()  # the error of that shared attempt
    out_of_memory: str | None = _written_when_set()  # set on the shared attempt that ran out of GPU memory


@dataclass(frozen=True)
class ContainerInfo:
    """``container``: the image a run ran in."""

    engine: str
    image: str
    image_id: str = ""
    name: str | None = _written_when_set()  # the container's name, once one was started


@dataclass(frozen=True)
class InputBinding:
    """One of ``inputs``: the folder an input parameter named (``source``) and where the run read it (``path``)."""

    source: str
    path: str


@dataclass
class RunRecord:
    """Everything known about one run; serialised as ``run.json`` (schema :data:`SCHEMA_VERSION`)."""

    run_id: str
    experiment: str
    notebook: str
    kernel: str
    framework: str | None = None
    recognised_as: str | None = _written_when_set()  # a notebook given by path: the framework whose GPU settings it got
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
    telemetry: dict[str, Any] = field(default_factory=dict)  # the GPU sampler's summary
    gpu_share: GpuSharing | None = field(default=None, metadata={_EMPTY_IS_NONE: True})  # None: no GPUs, or a gang's
    container: ContainerInfo | None = field(default=None, metadata={_EMPTY_IS_NONE: True})  # None: not in a container
    inputs: dict[str, InputBinding] = field(default_factory=dict)  # by parameter: the folders it read
    outputs: list[FileEntry] = field(default_factory=list)  # the files under outputs/
    attempt_log: list[AttemptEntry] = field(default_factory=list)  # one entry per attempt
    world_size: int = 1  # ranks of a distributed run (one kernel each)
    ranks: list[RankOutcome] = field(default_factory=list)  # a distributed run's, one per rank
    rank: int | None = None  # set in ranks/<rank>/run.json: the record of that rank alone
    # what the backend says of a run not final yet (waiting for nodes: quota; cancel requested); shown while not final
    note: str | None = _written_when_set()
    # a search's trial: its study, number and the study's decision (complete with its value, pruned at a step, failed)
    trial: dict[str, Any] | None = _written_when_set()
    # a run started from another's checkpoints (Run.resume_from): {"run_id": that run, "checkpoint": what was copied,
    # as an attempt's resumed_from, or null when that run left none: this one started from scratch}
    continues: dict[str, Any] | None = _written_when_set()
    # a pipeline stage's run: where each value resolved from a reference came from (stage, run id, the reference)
    origins: dict[str, Any] | None = _written_when_set()
    schema_version: int = SCHEMA_VERSION

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "status":  # a status is always a Status, also when code sets the plain text
            value = Status(value)
        object.__setattr__(self, name, value)

    @property
    def final(self) -> bool:
        """Whether the run has ended (succeeded, failed, cancelled or timed out)."""
        return self.status in FINAL_STATUSES

    def error_summary(self, with_cell: bool = True, now: datetime | None = None) -> str:
        """Why the run did not succeed, in one line ("" when it has no error): :meth:`RunError.summary` with how far
        the run got."""
        if self.error is None:
            return ""
        return self.error.summary((self.cells_done, self.cells_total), bool(self.started_at), self.ended_at,
                                  with_cell, now)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON values (new containers: changing them leaves the record as it is)."""
        return to_json_value(self)

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str) + "\n").encode()

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = RUN_RECORD) -> RunRecord:
        """The record in ``data`` (parsed JSON) by the fields' types; raises ShareError naming ``source``."""
        if not isinstance(data, dict):
            raise ShareError(f"{source} is not a run record (expected a JSON object); delete it to rerun that run")
        version = data.get("schema_version", SCHEMA_VERSION)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ShareError(f"{source} has schema_version {version!r}; this nbbatch reads up to {SCHEMA_VERSION}")
        return _read_object(cls, data, "", source)

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


# --- JSON by the fields' types ---------------------------------------------------------------------------------


def to_json_value(value: Any) -> Any:
    """``value`` as JSON values: a record's entries as objects of their fields (by their metadata), containers copied."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        written = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if f.metadata.get(_OMIT_DEFAULT) and item == f.default:
                continue
            written[f.name] = {} if item is None and f.metadata.get(_EMPTY_IS_NONE) else to_json_value(item)
        return written
    if isinstance(value, dict):
        return {k: to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_json_value(v) for v in value)
    return value


def from_json_value(kind: Any, value: Any, source: str, path: str) -> Any:
    """``value`` (parsed JSON) read as type ``kind`` (an entry of a record, say), by the same rules as a record."""
    return _read(kind, value, path, source)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _read_object(cls: type, data: dict[str, Any], path: str, source: str) -> Any:
    """A ``cls`` from the JSON object ``data`` at ``path`` (``""``: the record); unknown keys (a newer nbbatch's) are
    left out."""
    fields = dataclasses.fields(cls)
    missing = [f.name for f in fields if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing and not path:
        raise ShareError(f"{source} lacks {', '.join(missing)}; delete it to rerun that run")
    if missing:
        raise ShareError(f"{source} has a malformed `{path}` (it lacks {', '.join(missing)}); fix it or delete it")
    hints, values = _field_types(cls), {}
    for f in fields:
        if f.name in data:
            value = data[f.name]
            empty = f.metadata.get(_EMPTY_IS_NONE) and value == {}
            values[f.name] = None if empty else _read(hints[f.name], value, f"{path}.{f.name}" if path else f.name, source)
    return cls(**values)


def _read(kind: Any, value: Any, path: str, source: str) -> Any:
    """``value`` (parsed JSON) as type ``kind``; a value of another type raises ShareError naming ``path``."""
    if kind is Any:
        return value
    nullable = _is_union(kind) and type(None) in typing.get_args(kind)
    if value is None and nullable:
        return None
    arms = [a for a in typing.get_args(kind) if a is not type(None)] if _is_union(kind) else [kind]
    arm = next((a for a in arms if _fits(a, value)), None)
    if arm is None:
        enum = next((a for a in arms if isinstance(a, type) and issubclass(a, Enum)), None)
        if enum is not None and nullable and isinstance(value, str):
            return None  # a kind from a newer nbbatch: the text stays, the value is dropped
        if enum is not None and not nullable:
            known = ", ".join(m.value for m in enum)
            raise ShareError(f"{source} has an unknown {path} {value!r} (known: {known})")
        raise ShareError(f"{source} has `{path}` = {reprlib.repr(value)}, which must be {_describe(kind)}; "
                         "fix it or delete it (the run is then treated as never run)")
    origin = typing.get_origin(arm)
    if isinstance(arm, type) and issubclass(arm, Enum):
        return arm(value)
    if dataclasses.is_dataclass(arm):
        return _read_object(arm, value, path, source)
    if origin is list:
        (item,) = typing.get_args(arm)
        return [_read(item, v, f"{path}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(arm)
        return {k: _read(item, v, f"{path}.{k}", source) for k, v in value.items()}
    return value


_SCALARS: dict[Any, tuple[str, str]] = {str: ("a string", "strings"), int: ("an integer", "integers"),
                                        float: ("a number", "numbers"), bool: ("true or false", "booleans")}


def _is_union(kind: Any) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType)


def _fits(kind: Any, value: Any) -> bool:
    """Whether ``value`` is of ``kind`` at its top (a list of scalars: whole; other containers: item by item later)."""
    origin = typing.get_origin(kind) or kind
    if isinstance(kind, type) and issubclass(kind, Enum):
        return isinstance(value, str) and value in {m.value for m in kind}
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float):  # a number also where a float is wanted; never true or false
        return isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(kind)
        return isinstance(value, list) and (item not in _SCALARS or all(_fits(item, v) for v in value))
    return isinstance(value, dict) and (origin is dict or dataclasses.is_dataclass(kind))


def _describe(kind: Any) -> str:
    """What a value of ``kind`` is, for people: ``a string or null``, ``a list of integers``."""
    if _is_union(kind):
        arms = [_describe(a) for a in typing.get_args(kind) if a is not type(None)]
        return " or ".join(arms + (["null"] if type(None) in typing.get_args(kind) else []))
    if isinstance(kind, type) and issubclass(kind, Enum):
        return "a string"
    if kind in _SCALARS:
        return _SCALARS[kind][0]
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return f"a list of {_SCALARS[item][1]}" if item in _SCALARS else "a list"
    return "a JSON object"
