"""Reading results back from a share: run records, status tables, log tails and follows."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from nbbatch.errors import NbbatchError, did_you_mean
from nbbatch.store.layout import run_paths
from nbbatch.store.records import read_record, run_ids
from nbbatch.store.runrecord import RunRecord, Status
from nbbatch.store.share import RangeStore, Share

# One colour per status, for every view (terminal tables, widgets, the HTML report).
STATUS_STYLE = {Status.QUEUED: "dim", Status.RUNNING: "bold blue", Status.SUCCEEDED: "green", Status.FAILED: "bold red",
                Status.CANCELLED: "yellow", Status.TIMED_OUT: "magenta",
                # what `compare` says of an executed notebook found without a run record
                "incomplete": "yellow", "unreadable": "magenta"}
KEY_METRICS = ("accuracy", "train_seconds", "images_per_second")


def resolve_run_id(share: Share, experiment: str, ref: str) -> str:
    """A full run id from an id or a unique prefix of one."""
    ids = [r for r in run_ids(share, experiment) if share.exists(run_paths(experiment, r).record)
           or share.exists(run_paths(experiment, r).log)]
    if ref in ids:
        return ref
    matches = [r for r in ids if r.startswith(ref)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NbbatchError(f"no run `{ref}` in experiment `{experiment}` at {share.url}{did_you_mean(ref, ids)}; "
                           f"runs: {', '.join(ids) or '(none)'}")
    raise NbbatchError(f"`{ref}` matches {len(matches)} runs ({', '.join(matches)}); give more of the run id")


def format_metric(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def status_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    """One plain dict per run (what the tables, the widgets and ``--json`` show)."""
    rows = []
    for r in sorted(records, key=lambda rec: (rec.framework or "", rec.run_id)):
        progress = f"{r.cells_done}/{r.cells_total}" if r.cells_total and r.status == Status.RUNNING else ""
        rows.append({
            "run_id": r.run_id, "framework": r.framework or r.notebook, "parameters": r.parameters,
            "status": r.status, "attempts": r.attempts, "progress": progress,
            "duration_s": r.duration_s, "gpu_ids": r.gpu_ids, "metrics": r.metrics,
            "error": r.error.summary() if r.error else "",
        })
    return rows


def status_table(records: list[RunRecord], title: Any = None, max_params: int = 4) -> Any:
    """A rich table of runs: status, duration, GPU, key metrics, error.

    Every cell and a ``str`` title are :class:`rich.text.Text`: run data (an error such as
    ``KeyError: "[/x] missing"``, a parameter or metric name) is shown as it is, never read as rich markup.
    """
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title) if isinstance(title, str) else title, header_style="bold", expand=False)
    for column in ("run", "framework", "parameters", "status", "try", "duration", "GPU", "metrics", "error"):
        table.add_column(column, overflow="fold")
    for row in status_rows(records):
        params = ", ".join(f"{k}={format_metric(v)}" for k, v in list(row["parameters"].items())[:max_params])
        metrics = row["metrics"]
        shown = [k for k in KEY_METRICS if k in metrics] or [k for k, v in metrics.items()
                                                               if isinstance(v, (int, float))][:3]
        status = str(row["status"]) + (f" {row['progress']}" if row["progress"] else "")
        cells = (
            row["run_id"], str(row["framework"]), params, status, str(row["attempts"]),
            f"{row['duration_s']:.1f}s" if row["duration_s"] is not None else "",
            ",".join(map(str, row["gpu_ids"])) or "cpu",
            ", ".join(f"{k}={format_metric(metrics[k])}" for k in shown), row["error"][:120],
        )
        texts = [Text(str(cell)) for cell in cells]
        texts[3].stylize(STATUS_STYLE.get(row["status"], ""))
        table.add_row(*texts)
    return table


def summary_counts(records: list[RunRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.status] = counts.get(r.status, 0) + 1
    return counts


def read_log(share: Share, experiment: str, run_id: str, tail: int | None = None) -> str:
    try:
        text = share.read_bytes(run_paths(experiment, run_id).log).decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    if tail:
        text = "\n".join(text.splitlines()[-tail:]) + "\n"
    return text


def follow_log(share: Share, experiment: str, run_id: str, poll: float | None = None,
               timeout: float | None = None) -> Iterator[str]:
    """Yield the log as it grows until the run is final (``logs -f``).

    Only the new bytes are read each time (a ranged read on shares that can, see
    :class:`~nbbatch.store.share.RangeStore`): following a long log costs what it grows, not its square.
    """
    import codecs

    offset = 0
    log_path = run_paths(experiment, run_id).log
    ranged = isinstance(share, RangeStore)
    if poll is None:
        poll = 0.5 if share.local_path("") is not None else 2.0
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character split across two reads stays whole
    started = time.monotonic()
    final = False
    while True:
        try:
            chunk = share.read_range(log_path, offset) if ranged else share.read_bytes(log_path)[offset:]
        except FileNotFoundError:
            chunk = b""
        if chunk:
            offset += len(chunk)
            text = decoder.decode(chunk)
            if text:
                yield text
            continue
        if final:
            return
        record = read_record(share, experiment, run_id)
        if record is not None and record.final:
            final = True  # read once more: the last lines were written just before the record
            continue
        if timeout is not None and time.monotonic() - started > timeout:
            return
        time.sleep(poll)
