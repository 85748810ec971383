"""The CLI's pipeline side: ``submit``, ``plan`` and ``status`` of a pipeline file or name.

``nbbatch submit``, ``plan`` and ``status`` take an experiment or a pipeline; they hand a pipeline here.
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from nbbatch import api
from nbbatch.errors import NbbatchError
from nbbatch.results.pipeline import read_pipeline_state, stage_rows, stage_table
from nbbatch.store.share import Share


def forced_stages(args: argparse.Namespace) -> tuple[list[str], bool]:
    """``--force`` as given: the stages named (``--force STAGE``, repeatable), and whether a bare ``--force`` was."""
    given = args.force or []
    return [f for f in given if isinstance(f, str)], any(f is True for f in given)


def file_after_force(args: argparse.Namespace) -> None:
    """``submit --force FILE``: argparse reads FILE as ``--force``'s stage; it is the file (as before stages)."""
    given = args.force or []
    if args.experiment is None and given and isinstance(given[-1], str) and given[-1].endswith((".yaml", ".yml")):
        args.experiment, given[-1] = given[-1], True
    if args.experiment is None:
        raise NbbatchError("nbbatch submit: name the experiment or pipeline file (nbbatch submit FILE.yaml)")


def submit_pipeline_command(args: argparse.Namespace, console: Console) -> int:
    """``nbbatch submit PIPELINE.yaml``: every stage in order; one line per stage start and end, then the table."""
    stages, force_all = forced_stages(args)
    spec = api.load_pipeline(args.experiment)
    if force_all:
        stages = list(spec.stages)
    result = api.submit_pipeline(spec, force=stages, build_envs=args.build_envs, progress=not args.quiet)
    for warning in result.warnings:
        console.print(Text.assemble(("warning:", "yellow"), " ", warning))
    share = api.open_share(spec.share)
    state = read_pipeline_state(share, spec.name) or {"stages": {}}
    console.print(stage_table(spec.name, state, stage_rows(share, state)))
    console.print(Text(f"pipeline {spec.name}: {result.state} — results in {result.share}/{spec.name}.<stage>"))
    return 0 if result.ok else 1


def plan_pipeline_command(args: argparse.Namespace, console: Console) -> int:
    """``nbbatch plan PIPELINE.yaml``: the stages in order, their runs and what they need, which are done."""
    stages = api.plan_pipeline(args.experiment)
    if args.json:
        print(json.dumps([{"stage": s.name, "experiment": s.experiment.name, "backend": s.experiment.backend,
                           "needs": s.needs, "done": s.done, "search": s.experiment.search is not None,
                           "runs": [r.to_dict() for r in s.plan.runs]} for s in stages], indent=2, default=str))
        return 0
    table = Table(title=Text(f"pipeline {api.load_pipeline(args.experiment).name}: {len(stages)} stage(s)"),
                  title_justify="left", pad_edge=False)
    for column in ("stage", "backend", "runs", "needs", "state"):
        table.add_column(column, overflow="fold")
    for stage in stages:
        runs = (f"search, {stage.experiment.search.trials} trials" if stage.experiment.search
                else str(len(stage.plan.runs)))
        table.add_row(Text(stage.name), Text(stage.experiment.backend), Text(runs), Text(", ".join(stage.needs)),
                      Text("done (skipped)" if stage.done else "will run"))
    console.print(table)
    for stage in stages:
        for warning in stage.plan.warnings:
            console.print(Text.assemble(("warning:", "yellow"), f" stage {stage.name}: ", warning))
    return 0


def pipeline_status(args: argparse.Namespace, name: str, share: Share, console: Console) -> int | None:
    """``nbbatch status PIPELINE``: the stages' table (None when ``name`` is no pipeline on ``share``)."""
    state = read_pipeline_state(share, name)
    if state is None:
        return None
    if args.json:
        print(json.dumps({**state, "rows": [row.__dict__ for row in stage_rows(share, state)]}, indent=2,
                         default=str))
    elif args.watch:
        with Live(stage_table(name, state, stage_rows(share, state)), console=console) as live:
            while state.get("state") == "running":
                time.sleep(args.interval)
                state = read_pipeline_state(share, name) or state
                live.update(stage_table(name, state, stage_rows(share, state)))
    else:
        console.print(stage_table(name, state, stage_rows(share, state)))
        console.print(Text(f"one stage's runs: nbbatch status {name} STAGE"))
    if args.check:
        return 0 if state.get("state") == "succeeded" else 1
    return 0


def stage_experiment(name: str, stage: str | None) -> str:
    """``status NAME STAGE``: the stage's experiment; a stage name with a dot is refused (stages have none)."""
    if stage is None:
        return name
    if "." in stage:
        raise NbbatchError(f"stage `{stage}`: stage names have no '.'; give the pipeline and the stage: "
                           f"nbbatch status PIPELINE STAGE")
    return f"{name}.{stage}"
