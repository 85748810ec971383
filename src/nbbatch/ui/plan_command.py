"""What ``nbbatch plan`` prints of an experiment: its runs, marked where ``submit`` would skip them, or of a search the
trials it would draw.

Only the share is read (the runs' records, by the rule submit skips by: :func:`~nbbatch.store.runfiles.done_before`);
nothing is written, and a share that does not exist yet skips nothing.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.text import Text

from nbbatch.plan.runs import Plan
from nbbatch.results.fitted import ALWAYS, FittedTable, fit_column
from nbbatch.results.status import parameters_text, plan_table
from nbbatch.search.rebuild import recorded_trials
from nbbatch.search.study import study_label
from nbbatch.spec.search import Search
from nbbatch.store.runfiles import load_records, runs_done_before
from nbbatch.store.share import Share

PLAN_ROWS = 50  # runs `nbbatch plan` lists unless --all: a sweep of 10^5 runs is read as its count and first rows


def print_plan(the_plan: Plan, share: Share, console: Console, as_json: bool = False, all_rows: bool = False) -> None:
    """``nbbatch plan``'s output (``as_json``: ``plan --json``'s) for a planned experiment and its share."""
    search = the_plan.experiment.search
    if search is not None:
        trials = _trials_on_share(the_plan, share)
        if as_json:
            _write_json([{**{k: v for k, v in run.to_dict().items() if k != "run_id"}, "study": study,
                          "search": search.to_dict(), "trials_on_share": trials[study]}
                         for run, study in zip(the_plan.runs, trials, strict=True)])
        else:
            _print_search(the_plan, search, trials, share, console)
        return
    runs = the_plan.runs
    skipped = set(runs_done_before(share, the_plan.experiment.name, [r.run_id for r in runs]))
    if as_json:
        _write_json({**run.to_dict(), "skip": run.run_id in skipped} for run in runs)
        return
    shown = len(runs) if all_rows else PLAN_ROWS
    console.print(plan_table(runs, title=f"{the_plan.experiment.name}: {len(runs):,} run(s) → {share.url}",
                             max_rows=shown, skipped=skipped))
    if shown < len(runs):
        console.print(Text(f"… and {len(runs) - shown:,} more run(s): `nbbatch plan --all` lists every one, "
                           "`--json` gives them as data"))
    if skipped:
        console.print(Text(f"submit will skip {len(skipped)} run(s) that already succeeded (--force reruns them)"))


def _write_json(entries: Any) -> None:
    """A JSON list written one entry at a time, not as one string (10^5 runs: 50 MB)."""
    count = 0
    for count, entry in enumerate(entries, 1):
        sys.stdout.write(("[\n  " if count == 1 else ",\n  ") + json.dumps(entry, indent=2).replace("\n", "\n  "))
    print("\n]" if count else "[]")


def _trials_on_share(the_plan: Plan, share: Share) -> dict[str, int]:
    """Each study of the search (``<experiment>/<label>``, one per notebook) → how many trials its runs' records on
    the share hold (what it already has: its journal is rebuilt from them)."""
    name = the_plan.experiment.name
    records = load_records(share, name)[0]
    studies = [f"{name}/{study_label(run.run_id)}" for run in the_plan.runs]
    return {study: len(recorded_trials(records, study)) for study in studies}


def _print_search(the_plan: Plan, search: Search, trials: dict[str, int], share: Share, console: Console) -> None:
    """A search's plan: a row per study (its notebook, kernel and trials so far), the fixed parameters, the search."""
    runs = the_plan.runs
    columns = [fit_column("notebook", [r.notebook_rel for r in runs], ALWAYS),
               fit_column("kernel", [r.kernel for r in runs], 50, cap=24),
               fit_column("study", list(trials), 45, cap=40),
               fit_column("trials", [_trials_text(n, search.trials) for n in trials.values()], ALWAYS)]
    fixed = runs[0].parameters if runs else {}
    caption = "every trial: " + parameters_text(fixed) if fixed else None
    title = f"{the_plan.experiment.name}: a search of {len(runs)} notebook(s) → {share.url}"
    console.print(FittedTable(columns, title=title, caption=caption))
    console.print(Text(f"search: {search.describe()}. Each trial is a run of its own, its id made from the "
                       "parameters it draws"))


def _trials_text(done: int, budget: int) -> str:
    """``no trials yet: submit draws up to 6``, ``2 of 6 trials on the share: submit draws up to 4 more``."""
    if not done:
        return f"no trials yet: submit draws up to {budget}"
    left = max(0, budget - done)
    return f"{done} of {budget} trials on the share: submit draws " + (f"up to {left} more" if left else "none")
