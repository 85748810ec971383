"""``run.json``: the record of one run, versioned, written next to its executed notebook."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .errors import ShareError

SCHEMA_VERSION = 1
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled", "timed_out")
FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "timed_out"})

OUTPUT_NOTEBOOK = "output.ipynb"
RUN_RECORD = "run.json"
LOG_FILE = "log.txt"


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
    reason: str | None = None  # for failures outside a cell: kernel death, timeout, cancel

    def summary(self) -> str:
        where = f"cell {self.cell_index}: " if self.cell_index is not None else ""
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
    status: str = "queued"
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
    schema_version: int = SCHEMA_VERSION

    @property
    def final(self) -> bool:
        """Whether the run has ended (succeeded, failed, cancelled or timed out)."""
        return self.status in FINAL_STATUSES

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str) + "\n").encode()

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "run.json") -> RunRecord:
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
        if isinstance(values.get("error"), dict):
            try:
                values["error"] = RunError(**values["error"])
            except TypeError as exc:
                raise ShareError(f"{source} has a malformed `error`: {exc}") from exc
        try:
            return cls(**values)
        except TypeError as exc:  # pragma: no cover - defensive
            raise ShareError(f"{source} is malformed: {exc}") from exc

    @classmethod
    def from_json(cls, text: bytes | str, source: str = "run.json") -> RunRecord:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ShareError(
                f"{source} is not valid JSON ({exc}); it was hand-edited or truncated. "
                "Fix it or delete it (the run is then treated as never run)."
            ) from exc
        return cls.from_dict(data, source)
