"""A pipeline in the control notebook: the table of its stages, then each stage's jobs table."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from html import escape
from typing import Any

from rich.console import Console

import nbbatch.ui.widgets.display as display
from nbbatch import api
from nbbatch.errors import NbbatchError
from nbbatch.results.pipeline import read_pipeline_state, stage_rows, stage_table
from nbbatch.store.share import Share
from nbbatch.ui.widgets.jobs import JobsSummary, print_jobs_summary


@dataclass
class PipelineSummary:
    """What :func:`print_pipeline_summary` showed: the stages' text table and each started stage's jobs summary."""

    pipeline: str
    text: str
    stages: dict[str, JobsSummary] = field(default_factory=dict)


def print_pipeline_summary(pipeline: str, share: str | Share | None = None, interval: float | None = None,
                           metric: str | None = None) -> PipelineSummary:
    """Show a pipeline (its name, or its file): the stages (state, runs done, best so far, what each waits for),
    then each started stage's runs as :func:`print_jobs_summary` shows an experiment's (live in JupyterLab)."""
    name, the_share = api.open_experiment_share(pipeline, share)
    state = read_pipeline_state(the_share, name)
    if state is None:
        raise NbbatchError(f"`{name}` is no pipeline in {the_share.url}: submit its file with `nbbatch submit` "
                           "first (an experiment's runs: print_jobs_summary)")
    buffer = io.StringIO()
    Console(file=buffer, width=100, color_system=None).print(stage_table(name, state, stage_rows(the_share, state)))
    summary = PipelineSummary(name, buffer.getvalue())
    if display.display_mode() == "widgets":
        display.show(_Preformatted(summary.text))
    else:
        print(summary.text)
    for stage, outcome in state["stages"].items():
        if the_share.exists(outcome.get("experiment", "")):
            summary.stages[stage] = print_jobs_summary(outcome["experiment"], the_share, interval, metric)
    return summary


class _Preformatted:
    """Text shown as it is (the stage table's columns line up) in the notebook."""

    def __init__(self, text: str):
        self.text = text

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        return {"text/plain": self.text, "text/html": f"<pre>{escape(self.text)}</pre>"}
