"""Reading results back from a share: run records, status tables, log tails and follows.

Reading and refreshing are two steps: :func:`status_view` only reads the share (a :class:`StatusView`, with the
records it could not read as values); :func:`refresh_records` asks the backend about the runs, which may write
records (a run whose job is gone ends as failed), and gives its failure as a value (:class:`RefreshOutcome`).
"""

from __future__ import annotations

import codecs
import json
import math
import numbers
import re
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text

from nbbatch.errors import NbbatchError, did_you_mean
from nbbatch.plan.runs import Run
from nbbatch.results.fitted import ALWAYS, FitColumn, FittedTable, fit_column
from nbbatch.store.layout import MANIFEST, OUTPUT_NOTEBOOK, RUN_RECORD, experiment_paths, run_paths
from nbbatch.store.runfiles import RecordProblem, load_records, read_record, run_ids
from nbbatch.store.runjson import RunRecord, Status
from nbbatch.store.share import RangeStore, Share, poll_interval

if TYPE_CHECKING:
    from nbbatch.backends import Backend

# One colour per status, for every view (terminal tables, widgets, the HTML report).
STATUS_STYLE = {Status.QUEUED: "dim", Status.RUNNING: "bold blue", Status.SUCCEEDED: "green", Status.FAILED: "bold red",
                Status.CANCELLED: "yellow", Status.TIMED_OUT: "magenta", Status.PRUNED: "cyan",
                # a continued trial's segment at its rung: waiting, or continued by a later one
                "paused": "bold cyan", "promoted": "green",
                # what `compare` says of an executed notebook found without a run record
                "incomplete": "yellow", "unreadable": "magenta"}
KEY_METRICS = ("accuracy", "train_seconds", "images_per_second")
REFRESH_EVERY_S = 15.0  # how often a watching view asks the backend about its runs: squeue and clouds, not each redraw


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


def planned_run_ids(share: Share, folder: str) -> list[str] | None:
    """The run ids of the current plan of the experiment in ``folder``: the runs its last submission planned.

    They are in the manifest ``<experiment>/experiment.json`` that every submission writes. Runs in the folder
    that are not in it were planned by an earlier submission (a notebook, the sweep or the experiment file
    changed since): they are superseded, kept on the share, and shown only on request (``--all``).
    None when there is no readable manifest (a folder of runs written otherwise): every run then counts.
    """
    path = experiment_paths(folder).manifest if folder else MANIFEST
    try:
        runs = json.loads(share.read_bytes(path)).get("runs")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError, NbbatchError):
        return None
    if not isinstance(runs, list) or not all(isinstance(r, str) for r in runs):
        return None
    return runs


def search_of(share: Share, experiment: str) -> dict[str, Any] | None:
    """The ``search:`` block the experiment's last submission ran (its manifest's), or None for a batch. Of several
    objectives, ``metric`` and ``mode`` are the first's (what its tables sort by) and ``objectives`` lists them all,
    ``[[metric, mode], ...]``."""
    try:
        search = json.loads(share.read_bytes(experiment_paths(experiment).manifest)).get("search")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError, NbbatchError):
        return None
    if not isinstance(search, dict):
        return None
    metrics, modes = search.get("metric"), search.get("mode")
    if isinstance(metrics, list) and isinstance(modes, list) and len(metrics) == len(modes) > 1 \
            and all(isinstance(m, str) for m in metrics):
        objectives = [list(o) for o in zip(metrics, modes, strict=True)]
        return {**search, "metric": metrics[0], "mode": modes[0], "objectives": objectives}
    return search if isinstance(metrics, str) else None


def searched_metrics(search: Mapping[str, Any] | None) -> list[str]:
    """The metrics a search optimises (:func:`search_of`'s block): its one metric, or every objective's."""
    if not search:
        return []
    return [m for m, _ in search.get("objectives") or [(search["metric"], search.get("mode"))]]


def load_plan_records(share: Share, experiment: str, all_runs: bool = False
                      ) -> tuple[list[RunRecord], list[RecordProblem], list[str] | None]:
    """The records of the experiment's current plan (with ``all_runs``: of every run in its folder), the
    problems found (corrupt records, with their paths), and the planned run ids (None: no plan known)."""
    planned = planned_run_ids(share, experiment)
    if all_runs or planned is None:
        return (*load_records(share, experiment), planned)
    records, problems = load_records(share, experiment, ids=sorted(set(planned).intersection(run_ids(share, experiment))))
    return records, problems, planned


@dataclass(frozen=True)
class RefreshOutcome:
    """How asking the backend about an experiment's runs went (:func:`refresh_records`): ``error`` says why it
    could not (None: it did), and the records on the share may then be behind."""

    backend: str  # the backend's name; empty when it could not even be made
    error: str | None = None

    @property
    def note(self) -> str | None:
        """The line a status table shows under itself when the refresh failed."""
        if self.error is None:
            return None
        asked = f"the `{self.backend}` backend" if self.backend else "the experiment's backend"
        return f"could not ask {asked} about the runs: {self.error}; the records on the share may be behind"


@dataclass
class StatusView:
    """An experiment's runs as its share has them (:func:`status_view`: read, nothing written).

    ``records``: its current plan's (with ``all_runs``: every run's); ``problems``: what could not be read (a
    damaged ``run.json``, named by its path); ``refresh``: how the last ask of the backend went, when one was made.
    """

    experiment: str
    records: list[RunRecord]
    problems: list[str] = field(default_factory=list)
    refresh: RefreshOutcome | None = None

    @property
    def footer(self) -> list[str]:
        """The lines shown under the table: each record that could not be read, then a failed refresh."""
        note = self.refresh.note if self.refresh is not None else None
        return [*self.problems, *([note] if note else [])]


def status_view(share: Share, experiment: str, all_runs: bool = False) -> StatusView:
    """The runs of ``experiment`` on ``share``: its current plan's (with ``all_runs``: every run's). Only reads.

    A :class:`NbbatchError` when there is nothing to show (no run at all, or none of the last submission's yet).
    """
    records, problems, planned = load_plan_records(share, experiment, all_runs)
    if not records and not problems:
        if planned is not None and not all_runs and load_records(share, experiment)[0]:
            raise NbbatchError(f"none of the {len(planned)} run(s) of experiment `{experiment}`'s last submission has "
                               f"a run record in {share.url} yet (it may still be starting, or it was stopped "
                               f"before they were queued); `nbbatch status {experiment} --all` shows the runs of "
                               "earlier submissions")
        raise NbbatchError(no_runs_message(share, experiment))
    return StatusView(experiment, records, problems)


_NOT_EXPERIMENTS = {".ipynb_checkpoints", "__pycache__", ".git"}


def experiment_names(share: Share) -> list[str]:
    """The experiments (and pipelines) a share holds: its top-level folders with something in them (sorted)."""
    return [n for n in share.list("") if n not in _NOT_EXPERIMENTS and not n.endswith(".ipynb") and share.list(n)]


def no_runs_message(share: Share, experiment: str) -> str:
    """What ``status`` and ``compare`` say of an experiment without runs: the same line, with the closest name
    (did you mean) and the experiments the share holds."""
    known = experiment_names(share)
    where = f"experiment `{experiment}` has no runs in {share.url}"
    if share.exists(experiment):
        where += f" (the folder `{experiment}` holds no {RUN_RECORD}, {OUTPUT_NOTEBOOK} or executed .ipynb)"
    listing = f"; experiments there: {', '.join(known[:20])}{'…' if len(known) > 20 else ''}" if known else \
        "; that share holds no experiments yet"
    return (f"{where}{did_you_mean(experiment, known)}{listing}. Submit it first (`nbbatch submit`) or pass the "
            "share with --share.")


def refresh_records(backend: Callable[[], Backend], experiment: str, share: Share) -> RefreshOutcome:
    """Ask the experiment's backend (made by ``backend()``) to bring its records on ``share`` up to date
    (:meth:`~nbbatch.backends.base.Backend.refresh`: it may end lost runs as failed). A failure is the outcome's
    ``error``, never raised: the records are still worth showing."""
    try:
        made = backend()
    except NbbatchError as exc:  # e.g. a backend not installed on this machine
        return RefreshOutcome("", str(exc))
    try:
        made.refresh(experiment, share)
    except (NbbatchError, OSError) as exc:  # the scheduler cannot be reached, the share is read-only, …
        return RefreshOutcome(made.name, str(exc) or type(exc).__name__)
    return RefreshOutcome(made.name)


def format_metric(value: Any) -> str:
    """A metric or parameter value, short: floats to 4 significant digits, ``12346`` rather than ``1.235e+04``."""
    if isinstance(value, float):
        if math.isfinite(value) and 1e4 <= abs(value) < 1e6:
            return f"{value:.0f}"
        return f"{value:.4g}"
    return "" if value is None else str(value)


def parameters_text(parameters: Mapping[str, Any]) -> str:
    """``ALPHA=0.001305, DEPTH=4``: parameters as every view prints a run's (floats to 4 significant digits)."""
    return ", ".join(f"{name}={format_metric(value)}" for name, value in parameters.items())


def order_value(value: Any) -> tuple[int, Any]:
    """How a parameter's value sorts in every table: numbers by value, before anything else (by its JSON text)."""
    if _is_number(value) and not (isinstance(value, float) and math.isnan(value)):
        return (0, float(value))
    return (1, json.dumps(value, sort_keys=True, default=str))


def search_rank(status: Any, value: Any, mode: str) -> tuple[bool, bool, float]:
    """Where a search's run goes in every table: the runs that succeeded first, best first by the searched metric
    (``mode`` min or max), then the others (a pruned run at the value it was stopped at) the same way."""
    number = float(value) if _is_number(value) and not math.isnan(float(value)) else None
    return (str(status) != Status.SUCCEEDED, number is None,
            0.0 if number is None else number if mode == "min" else -number)


# what a continued trial's segment's recorded state says of its trial, as a status the views know; a state missing
# here (``open``, ``promoted``, ``failed``) leaves the run's own status
_STATE_STATUS = {"complete": "succeeded", "pruned": "pruned", "paused": "paused"}


def trial_status(run_status: Any, state: Any) -> str:
    """The status a trial's latest segment stands for: ``succeeded`` once it completed, ``pruned`` when the search
    ended without continuing it, ``paused`` while it waits at its rung; else its run's status (running, failed…)."""
    return _STATE_STATUS.get(str(state), str(run_status))


def segment_of(record: RunRecord) -> int | None:
    """Which segment of its trial a run is (``trial.segment``: 0, 1, … for a trial continued over several runs);
    None for a run that is all of its trial, or no trial."""
    segment = (record.trial or {}).get("segment")
    return segment if isinstance(segment, int) and not isinstance(segment, bool) else None


def _search_order(records: Sequence[RunRecord], search: Mapping[str, Any]) -> list[RunRecord]:
    """A search's runs by :func:`search_rank`; a continued trial's segments together, in order, where its latest
    segment ranks."""
    mode, metric = search.get("mode", "min"), search["metric"]
    latest: dict[tuple[str, Any], RunRecord] = {}
    for record in records:
        if segment_of(record) is not None:
            key = (str(record.trial.get("study")), record.trial.get("number"))
            if key not in latest or (segment_of(latest[key]) or 0) < (segment_of(record) or 0):
                latest[key] = record

    def rank(record: RunRecord) -> tuple[Any, ...]:
        segment = segment_of(record)
        if segment is None:
            return (search_rank(record.status, record.metrics.get(metric), mode), "", 0, 0)
        key = (str(record.trial.get("study")), record.trial.get("number"))
        trial = latest[key]
        status = trial_status(trial.status, trial.trial.get("state"))
        return (search_rank(status, trial.metrics.get(metric), mode), *map(str, key), segment)

    return sorted(records, key=rank)


def order_caption(by: Sequence[str] = (), search: Mapping[str, Any] | None = None) -> str | None:
    """The line under a runs table that says its row order (``rows by framework, C, PENALTY``; of a search
    ``rows by loss, lowest first``); None when nothing orders the rows."""
    if search:
        return f"rows by {search['metric']}, {'lowest' if search.get('mode', 'min') == 'min' else 'highest'} first"
    return f"rows by {', '.join(by)}" if by else None


def ordered_records(records: Sequence[RunRecord], search: Mapping[str, Any] | None = None
                    ) -> tuple[list[RunRecord], str | None]:
    """The records in the order every table shows runs (``compare``'s too), and the caption that says it: by
    framework (when they differ), then by each parameter that varies (by name); a search's by :func:`search_rank`."""
    if search:
        return _search_order(records, search), order_caption(search=search)
    varying = sorted(varying_parameters(records))
    several = len({_label(r) for r in records}) > 1
    ordered = sorted(records, key=lambda r: (_label(r), [order_value(r.parameters.get(k)) for k in varying],
                                             r.run_id))
    return ordered, order_caption([*(["framework"] if several else []), *varying])


def status_rows(records: list[RunRecord], search: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """One plain dict per run (what the tables, the widgets and ``--json`` show), in :func:`ordered_records`'s order."""
    rows = []
    for r in ordered_records(records, search)[0]:
        progress = f"{r.cells_done}/{r.cells_total}" if r.cells_total and r.status == Status.RUNNING else ""
        rows.append({
            "run_id": r.run_id, "framework": r.framework or r.notebook, "parameters": r.parameters,
            "status": r.status, "attempts": r.attempts, "progress": progress,
            "duration_s": r.duration_s, "gpu_ids": r.gpu_ids, "world_size": r.world_size, "metrics": r.metrics,
            "error": r.error_summary() if r.error and not _pruned(r) else "",
            "traceback": (r.error.traceback or "") if r.error else "",  # a cell error's, as papermill shows it
            "note": _pruned_reason(r) if _pruned(r) else (r.note or "") if not r.final else "",
        })
    return rows


def status_json_rows(view: StatusView, search: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """What ``status --json`` prints: :func:`status_rows`, a record read with a problem (it names another run) saying
    it as its row's ``problem``, and a row of status ``unreadable`` for each record that could not be read, naming its
    file (``record``) and why (``problem``)."""
    said = {p.run_id: p for p in view.problems if isinstance(p, RecordProblem)}
    rows = [{**row, "problem": str(said[row["run_id"]])} if row["run_id"] in said else row
            for row in status_rows(view.records, search)]
    for problem in said.values():
        if problem.damaged:
            rows.append({"run_id": problem.run_id, "framework": "", "parameters": {}, "status": "unreadable",
                         "attempts": 0, "progress": "", "duration_s": None, "gpu_ids": [], "world_size": 1,
                         "metrics": {}, "error": "", "note": "", "problem": str(problem), "record": problem.path})
    return rows


def varying_parameters(records: Sequence[RunRecord | Run]) -> list[str]:
    """Parameter names whose values differ between runs (what tells the runs apart), in first-seen order."""
    names: list[str] = []
    for record in records:
        names.extend(k for k in record.parameters if k not in names)
    return [n for n in names
            if len({json.dumps(r.parameters.get(n), sort_keys=True, default=str) for r in records}) > 1]


def shown_metrics(records: list[RunRecord], limit: int = 4) -> list[str]:
    """The metrics a table shows: the key ones any run has, then other numeric ones (also live ones, e.g. ``loss``)."""
    names = [k for k in KEY_METRICS if any(k in r.metrics for r in records)]
    for record in records:
        names.extend(k for k, v in record.metrics.items() if k not in names and _is_number(v))
    return names[:limit]


def status_table(records: list[RunRecord], title: Any = None, max_metrics: int = 4,
                 now: datetime | None = None, search: Mapping[str, Any] | None = None) -> FittedTable:
    """The runs table: one row per run, one or two lines each, at any terminal width.

    Columns: the run id (never cut: people copy it), the framework (only where the run id does not
    already say it), one column per parameter that varies across the runs, status, attempts (only
    when a run was retried), duration (elapsed, with ``…``, while running; taken when the table is
    drawn unless ``now`` is given), GPUs (only when a run had one), one column per shown metric, and
    the error, which gets the width left (two lines at most, then ``…``; the whole error is in
    ``nbbatch logs`` and ``run.json``). A search's table (``search`` given) starts with the run id, its status, the
    trial number and the searched metric, shown at any width; a pruned run's status says the step it was stopped at
    (``pruned at step 4``): being pruned is no error. When the width runs out, the least useful columns are left
    out and named under the table (see :mod:`nbbatch.results.fitted`). The rows are in :func:`ordered_records`'s
    order (``compare``'s; a search's, given its ``search:`` block, best first), said under the table.
    """
    records, caption = ordered_records(records, search)
    return FittedTable(lambda: _columns(records, max_metrics, now or datetime.now(timezone.utc), search),
                       title=title, caption=caption)


def plan_table(runs: Sequence[Run], title: Any = None, max_rows: int | None = None,
               skipped: Collection[str] = ()) -> FittedTable:
    """The runs ``nbbatch plan`` would start, laid out like :func:`status_table` (the run id never cut).

    Columns: the run id, ``submit`` (``skip`` for the runs in ``skipped``, those a submission leaves alone; only when
    there are some), one per parameter that varies across the runs, the kernel, the notebook and the GPUs (when a run
    asks for one); the parameters every run gets alike are named once, under the table.
    """
    runs = list(runs)
    varying = varying_parameters(runs)
    runs = runs[:max_rows]  # the first runs as rows; the columns and the caption are of all of them
    columns = [fit_column("run", [r.run_id for r in runs], ALWAYS)]
    if skipped:
        columns.append(fit_column("submit", ["skip" if r.run_id in skipped else "run" for r in runs], ALWAYS))
    for index, name in enumerate(varying):
        values = [r.parameters.get(name) for r in runs]
        columns.append(fit_column(name, [format_metric(v) if name in r.parameters else "" for v, r in
                                         zip(values, runs, strict=True)], 80 - index,
                                  numeric=all(_is_number(v) for v in values)))
    columns.append(fit_column("kernel", [r.kernel for r in runs], 50, cap=24))
    columns.append(fit_column("notebook", [r.notebook_rel for r in runs], 45, cap=40))
    if any(r.gpus for r in runs):
        columns.append(fit_column("GPUs", [str(r.gpus) for r in runs], 40, numeric=True))
    alike = {k: v for k, v in (runs[0].parameters if runs else {}).items() if k not in varying}
    caption = "every run: " + parameters_text(alike) if alike else None
    return FittedTable(columns, title=title, caption=caption)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def format_duration(seconds: float | None) -> str:
    """``4.2s``, ``3m 05s``, ``1h 02m``; empty for None."""
    if seconds is None:
        return ""
    if not 0 <= seconds < 1e12:  # NaN, ±inf, negative or absurd: a hand-edited record
        return str(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def _elapsed(record: RunRecord, now: datetime) -> float | None:
    try:
        started = datetime.fromisoformat(str(record.started_at))
    except ValueError:
        return None
    if started.tzinfo is None:
        started = started.replace(tzinfo=timezone.utc)
    return max(0.0, (now - started).total_seconds())


def _label(record: RunRecord) -> str:
    return record.framework or record.notebook


def _slug(text: str) -> str:
    """How a run id spells its framework or notebook (as nbbatch.plan.runs makes it)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "run"


def _pruned(record: RunRecord) -> bool:
    return record.status == Status.PRUNED


def _pruned_reason(record: RunRecord) -> str:
    """Why the search's pruner stopped a run, as its record says (what ``status --json`` gives as its note)."""
    return (record.error.reason or record.error.evalue or "") if record.error else ""


# a continued trial's segment that stopped at its rung: what became of it there (its run's status says less)
SEGMENT_STATES = ("promoted", "paused", "pruned")


def _status_text(record: RunRecord) -> str:
    """The status cell: ``running 5/12`` (cells done of all), ``pruned at step 4``, a continued trial's segment
    ``paused at step 9`` (or promoted, or pruned, at its rung), else the status."""
    if record.cells_total and record.status == Status.RUNNING:
        return f"{record.status} {record.cells_done}/{record.cells_total}"
    state = _segment_state(record)
    if state:
        rung = record.trial.get("resource", record.trial.get("step"))
        return f"{state} at step {rung}" if rung is not None else state
    step = (record.trial or {}).get("step") if _pruned(record) else None
    return f"{record.status} at step {step}" if step is not None else str(record.status)


def _segment_state(record: RunRecord) -> str | None:
    """A segment's state at its rung (:data:`SEGMENT_STATES`), or None (no segment, or one running or ended)."""
    state = (record.trial or {}).get("state") if segment_of(record) is not None else None
    return state if state in SEGMENT_STATES else None


def _columns(records: list[RunRecord], max_metrics: int, now: datetime,
             search: Mapping[str, Any] | None = None) -> list[FitColumn]:
    """Every column worth showing for ``records``, in display order, with its widths and priority."""
    varying = varying_parameters(records)
    columns: list[FitColumn] = []
    searched = searched_metrics(search)

    def add(header: str, texts: list[str], keep: int, cap: int = 20, **kind: bool) -> FitColumn:
        columns.append(fit_column(header, texts, keep, cap, **kind))
        return columns[-1]

    add("run", [r.run_id for r in records], ALWAYS)
    first = len(columns)  # a search's status, trial and metric go here, whatever comes between
    if any(not r.run_id.startswith(_slug(Path(_label(r)).stem) + "-") for r in records):
        add("framework", [_label(r) for r in records], 50, cap=16)
    for index, name in enumerate(varying):
        values = [r.parameters.get(name) for r in records]
        add(name, [format_metric(v) if name in r.parameters else "" for v, r in zip(values, records, strict=True)],
            80 - index, numeric=all(_is_number(v) for v in values))
    status = add("status", [_status_text(r) for r in records], ALWAYS)
    for cell, record in zip(status.cells, records, strict=True):
        cell.stylize(STATUS_STYLE.get(_segment_state(record) or record.status, ""))
    if searched:  # what a search is about comes first and is never left out: its trials and the metric it optimises
        columns.insert(first, columns.pop())
        trials = [(r.trial or {}).get("number") for r in records]
        if any(t is not None for t in trials):
            columns.insert(first + 1, _trial_column(records))
        for index, metric in enumerate(searched):  # every objective's value, the first first
            values = [r.metrics.get(metric) for r in records]
            columns.insert(first + 1 + any(t is not None for t in trials) + index,
                           fit_column(metric, [format_metric(v) for v in values], ALWAYS,
                                      numeric=all(v is None or _is_number(v) for v in values)))
    if any(r.attempts > 1 for r in records):  # only retries make the attempt count worth a column
        add("try", [str(r.attempts) for r in records], 45, numeric=True)
    times = []
    for r in records:
        if r.duration_s is None and r.status == Status.RUNNING and r.started_at:
            elapsed = _elapsed(r, now)
            times.append(format_duration(elapsed) + "…" if elapsed is not None else "")
        else:
            times.append(format_duration(r.duration_s))
    if any(times):
        add("time", times, 65, numeric=True)
    if any(r.world_size > 1 for r in records):  # a distributed run: how many ranks (kernels) it has
        add("ranks", [str(r.world_size) for r in records], 44, numeric=True)
    if any(r.gpu_ids for r in records):
        add("GPU", [",".join(map(str, r.gpu_ids)) or "cpu" for r in records], 40, cap=8)
    for index, name in enumerate(n for n in shown_metrics(records, max_metrics + len(searched)) if n not in searched):
        values = [r.metrics.get(name) for r in records]
        add(name, [format_metric(v) for v in values], 70 if index == 0 else 60 - index,
            numeric=all(v is None or _is_number(v) for v in values))
    # a run's error, or while it is not final the backend's note on it (waiting for nodes, cancel requested)
    # (a pruned run's reason is no error: its status cell says the step, `status --json` the reason)
    failed = [r.error if r.error and not _pruned(r) else None for r in records]
    errors = [" ".join(r.error_summary().splitlines()) if e else (r.note or "") if not r.final else ""
              for e, r in zip(failed, records, strict=True)]
    if any(errors):
        noted = any(r.note and not e and not r.final for e, r in zip(failed, records, strict=True))
        header = ("error / note" if any(failed) else "note") if noted else "error"
        error = add(header, errors, 90, flexible=True)
        # where the error does not fit one line, the exception matters more than the cell it came from
        error.short = [Text(" ".join(r.error_summary(with_cell=False).splitlines()) if e else text)
                       for text, e, r in zip(errors, failed, records, strict=True)]
    return columns


def _trial_column(records: list[RunRecord]) -> FitColumn:
    """A search's trial numbers; where a trial continued over several runs, ``7·1``: trial 7, its segment 1."""
    segmented = any(segment_of(r) is not None for r in records)
    texts = []
    for record in records:
        number, segment = (record.trial or {}).get("number"), segment_of(record)
        texts.append("" if number is None else f"{number}·{segment}" if segment is not None else str(number))
    return fit_column("trial·segment" if segmented else "trial", texts, ALWAYS, numeric=True)


def summary_counts(records: Iterable[RunRecord]) -> dict[str, int]:
    """How many runs have each status, by the status's text."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.status.value] = counts.get(r.status.value, 0) + 1
    return counts


def read_log(share: Share, experiment: str, run_id: str, tail: int | None = None, rank: int | None = None) -> str:
    """A run's log (with ``rank``: that rank's of a distributed run), or its last ``tail`` lines."""
    try:
        text = share.read_bytes(run_paths(experiment, run_id, rank).log).decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    if tail:
        text = "\n".join(text.splitlines()[-tail:]) + "\n"
    return text


def follow_log(share: Share, experiment: str, run_id: str, poll: float | None = None,
               timeout: float | None = None, rank: int | None = None) -> Iterator[str]:
    """Yield the log as it grows until the run is final (``logs -f``).

    Only the new bytes are read each time (a ranged read on shares that can, see
    :class:`~nbbatch.store.share.RangeStore`): following a long log costs what it grows, not its square.
    """
    offset = 0
    log_path = run_paths(experiment, run_id, rank).log
    ranged = isinstance(share, RangeStore)
    if poll is None:
        poll = poll_interval(share, local=0.5, remote=2.0)
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
