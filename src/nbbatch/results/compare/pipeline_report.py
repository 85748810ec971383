"""A pipeline's report: one self-contained page with the stages (their graph and states), where every resolved value
came from (linked to the run it came from), and each stage's runs as an experiment's report shows them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nbbatch import __version__
from nbbatch.errors import NbbatchError
from nbbatch.results.compare.collect import collect
from nbbatch.results.compare.report import _href, report_context
from nbbatch.results.pipeline import read_pipeline_state, stage_rows
from nbbatch.results.render import render_template
from nbbatch.store.layout import run_paths
from nbbatch.store.runjson import utc_now
from nbbatch.store.share import FILE_MODE, Share, write_file_atomic


def render_pipeline_report(share: Share, name: str, report_path: str | os.PathLike[str], **options: Any) -> str:
    """The HTML of pipeline ``name``'s report (``options``: the plots' axes, as :func:`report_context` takes them)."""
    state = read_pipeline_state(share, name)
    if state is None:
        raise NbbatchError(f"`{name}` is no pipeline in the share {share.url} (it has no pipeline.json)")
    report_dir = Path(report_path).resolve().parent
    sections, statuses = [], {}
    for stage, outcome in state["stages"].items():
        experiment = outcome.get("experiment") or f"{name}.{stage}"
        section: dict[str, Any] = {"stage": stage, "experiment": experiment, "state": outcome.get("state"),
                                   "reason": outcome.get("reason"), "total": 0}
        if share.exists(experiment):
            frame = collect(share, [experiment])
            if len(frame):
                section.update(report_context(frame, report_path, share=share, **options))
                for status, count in section["counts"]:
                    statuses[status] = statuses.get(status, 0) + count
        sections.append(section)
    return render_template(
        "pipeline_report.html.j2", title=f"nbbatch report: pipeline {name}", generated=utc_now(),
        version=__version__, state=state.get("state", ""), stages=stage_rows(share, state), sections=sections,
        edges=[(need, stage) for stage, outcome in state["stages"].items() for need in outcome.get("needs") or ()],
        origins=_origins(share, state, report_dir), counts=sorted(statuses.items()))


def _origins(share: Share, state: dict[str, Any], report_dir: Path) -> list[dict[str, Any]]:
    """Every value a stage resolved from a reference: the stage, what it set, the value, and the run it came from."""
    rows = []
    for stage, outcome in state["stages"].items():
        for where, origin in (outcome.get("resolved") or {}).items():
            runs = origin.get("run")
            runs = runs if isinstance(runs, list) else [runs] if runs else []
            links = []
            for run in runs:
                local = share.local_path(run_paths(origin.get("experiment", ""), run).notebook)
                links.append({"run": run, "href": _href(str(local) if local else None, report_dir)})
            value = origin.get("value")
            shown = f"{len(value)} runs" if isinstance(value, list) and where != "frameworks" else str(value)
            rows.append({"stage": stage, "where": where, "value": shown, "reference": origin.get("reference"),
                         "from": origin.get("stage"), "runs": links})
    return rows


def write_pipeline_report(share: Share, name: str, path: str | os.PathLike[str], **options: Any) -> Path:
    """Write :func:`render_pipeline_report` to ``path`` (one self-contained HTML file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(target, render_pipeline_report(share, name, target, **options).encode("utf-8"), FILE_MODE)
    return target
