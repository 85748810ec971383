"""A search's study rebuilt from its runs' records, when its journal was lost or damaged beyond reading.

The driver keeps every decision in the trial's run record too (``trial:`` in run.json: the study, the trial's number
and state, its value or the step it was pruned at), and the run's metric history is its ``metrics.jsonl``. Asked to
(``submit --rebuild-search``), :func:`rebuild_journal` replays them into a new journal through Optuna itself, trial
by trial in their numbers' order: each asked with its run's parameters, its points reported as the driver reported
them (the last attempt's value of each step), judged by the pruner where the pruner keeps what it judged (ASHA's and
Hyperband's rungs), and told its decision. The sampler and the pruner then go on as before; an open trial (its run
failed outside the notebook) stays open and runs again. The new journal replaces the old in one rename, the old one
kept beside it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from nbbatch.search.study import (
    FAILURE,
    METRIC_MISSING,
    RUN_ID,
    SearchError,
    failure_of,
    open_study,
    optuna_module,
    report,
    suggest,
)
from nbbatch.spec.search import Search
from nbbatch.store.runjson import RunRecord, Status, utc_now

STATEFUL_PRUNERS = ("asha", "hyperband")  # they keep what they judged in the trials (rungs): judged again here
LOST = "its run's record was not found when the study was rebuilt"


def recorded_trials(records: Iterable[RunRecord], study: str) -> dict[int, RunRecord]:
    """The runs whose records say they are trials of ``study``, by trial number (a run two trials shared, its
    parameters drawn twice, under the later)."""
    trials: dict[int, RunRecord] = {}
    for record in records:
        told = record.trial or {}
        number = told.get("number")
        if told.get("study") == study and isinstance(number, int) and not isinstance(number, bool) and number >= 0:
            trials[number] = record
    return dict(sorted(trials.items()))


def rebuild_journal(search: Search, path: Path, name: str, fingerprint: str, records: Iterable[RunRecord],
                    history: Callable[[str], list[dict[str, Any]]], say: Callable[[str], None] = print) -> None:
    """Write the study ``name`` anew at ``path`` from the trials' run ``records`` (see the module's docstring);
    ``history`` gives a run's metric points by run id. The file at ``path``, if any, is kept beside it."""
    trials = recorded_trials(records, name)
    if not trials:
        raise SearchError(f"no run record on the share names a trial of study `{name}` (`trial:` in run.json), so "
                          f"its journal {path} cannot be rebuilt: submit with --force to start the search afresh")
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f"{path.name}.rebuilding")
    draft.unlink(missing_ok=True)
    study = open_study(search, draft, name, fingerprint)
    states: dict[str, int] = {}
    for number in range(max(trials) + 1):
        state = _replay(study, search, trials.get(number), history)
        states[state] = states.get(state, 0) + 1
    kept = ""
    if path.exists() or path.is_symlink():
        backup = path.with_name(f"{path.name}.before-rebuild-{utc_now().replace(':', '')}")
        path.replace(backup)
        kept = f"; the earlier one is kept as {backup}"
    os.replace(draft, path)
    counts = ", ".join(f"{n} {state}" for state, n in states.items())
    say(f"rebuilt the search journal {path} from {len(trials)} run record(s): {max(trials) + 1} trial(s), {counts}"
        f"{kept}")


def _replay(study: Any, search: Search, record: RunRecord | None, history: Callable[[str], list[dict[str, Any]]]
            ) -> str:
    """Ask, report and tell one trial as its record says; the state it ends in, for people."""
    state = optuna_module().trial.TrialState
    if record is None:  # asked once, its run never recorded it: it counts against the budget, as it did
        trial = study.ask()
        trial.set_user_attr(FAILURE, LOST)
        study.tell(trial, state=state.FAIL)
        return "lost (failed)"
    missing = [p.name for p in search.params if p.name not in record.parameters]
    if missing:
        raise SearchError(f"run {record.run_id}'s record names trial {record.trial['number']} of study "
                          f"`{study.study_name}` but has no value of {', '.join(missing)}: not a trial of this "
                          "search; submit with --force to start the search afresh")
    told = record.trial or {}
    study.enqueue_trial({p.name: record.parameters[p.name] for p in search.params}, user_attrs={RUN_ID: record.run_id})
    trial = study.ask()
    # the enqueued parameters, with their distributions; the grid sampler needs no more: it gives trial N its Nth
    # point, and the trials keep their numbers
    suggest(trial, search)
    _report_history(trial, search, history(record.run_id), told.get("step") if told.get("state") == "pruned" else None)
    decided = told.get("state")
    values = _told_values(search, told)
    if decided == "complete" and values is not None:
        study.tell(trial, values if search.multi else values[0])
    elif decided == "pruned":
        study.tell(trial, state=state.PRUNED)
    elif decided == "failed":
        reason = str(told.get("reason", ""))
        failure = METRIC_MISSING if record.status == Status.SUCCEEDED and "recorded no value" in reason else (
            None if record.status == Status.SUCCEEDED else failure_of(record))
        if failure is not None:
            trial.set_user_attr(FAILURE, failure)
        study.tell(trial, state=state.FAIL)
    else:  # open, or what this nbbatch does not know: the trial runs again
        return "open"
    return str(decided)


def _told_values(search: Search, told: dict[str, Any]) -> list[float] | None:
    """The objectives' values a record's ``trial:`` holds (``value``; ``values`` by metric for several), or None."""
    given = told.get("values") if search.multi else {search.metric: told.get("value")}
    values = [given.get(m) for m in search.metrics] if isinstance(given, dict) else [None]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        return [float(v) for v in values]
    return None


def _report_history(trial: Any, search: Search, points: list[dict[str, Any]], last_step: int | None) -> None:
    """Report the run's points of the search's metric as the driver did: in (attempt, step) order, a later attempt's
    value of a step replacing an earlier one's; a pruned trial's up to the step it was pruned at."""
    if search.multi:  # the driver reports no intermediate value of a multi-objective trial
        return
    judge = search.pruner in STATEFUL_PRUNERS
    reported = (0, -1)
    for point in points:
        step, value, attempt = point.get("step"), point.get(search.metric), point.get("attempt", 0)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (step, attempt)):
            continue
        if (attempt, step) <= reported or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or last_step is not None and step > last_step:
            continue
        report(trial, float(value), step)
        reported = (attempt, step)
        if judge:
            trial.should_prune()
