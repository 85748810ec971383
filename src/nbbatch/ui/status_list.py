"""``nbbatch status`` without an experiment: the experiments (and pipelines) there are, one row each.

Where it looks: the share ``--share`` names; else, in a project, its ``results/`` and the shares its experiments were
submitted to (``.nbbatch/experiments.json``); else (or when those hold none) the shares of the experiments the user
submitted from any folder (the per-user index, :func:`~nbbatch.store.known.user_experiments`). Only reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Collection

from rich.console import Console
from rich.text import Text

from nbbatch.errors import NbbatchError
from nbbatch.results.experiments import ExperimentRow, experiment_rows, experiments_table
from nbbatch.spec.project import Project, find_project
from nbbatch.store.known import project_experiments, user_experiments, user_index_path
from nbbatch.store.share import open_share

Source = tuple[str, Collection[str] | None]  # a share's URL or folder, and the experiments of it to list (None: all)


def status_of_all(args: argparse.Namespace, console: Console) -> int:
    """List the experiments of each share looked in (``args.share``, the project's, the user's); 0, or 2 with where
    it looked when none holds any."""
    if args.watch or args.check or args.all:
        raise NbbatchError("--watch, --check and --all are of one experiment's runs: name it (`nbbatch status "
                           "EXPERIMENT`); `nbbatch status` alone lists the experiments")
    found: list[tuple[str, list[ExperimentRow]]] = []
    looked: list[str] = []
    for sources in _sources(args.share):
        for url, names in sources:
            looked.append(str(url))
            try:
                rows = experiment_rows(open_share(url), names)
            except (NbbatchError, OSError) as exc:  # one share out of reach (credentials, a network): the others
                print(f"nbbatch: warning: could not read {url}: {exc}", file=sys.stderr)
                continue
            if rows:
                found.append((str(url), rows))
        if found:
            break
    if not found:
        raise NbbatchError(_nothing_found(args.share, looked))
    if args.json:
        print(json.dumps([{**row.to_dict(), "share": url} for url, rows in found for row in rows], indent=2))
        return 0
    for url, rows in found:
        console.print(experiments_table(rows, title=f"{len(rows)} experiment(s) in {url}"))
    console.print(Text("one experiment's runs: nbbatch status EXPERIMENT (a pipeline's stage: nbbatch status PIPELINE "
                       "STAGE)"))
    return 0


def _sources(share: str | None) -> list[list[Source]]:
    """Where to look, in turn (the first that lists any experiment is shown)."""
    if share:
        return [[(share, None)]]
    project = find_project()
    places: list[list[Source]] = []
    if _is_project(project):
        by_share: dict[str, set[str]] = {}
        for name, url in project_experiments(project).items():
            by_share.setdefault(url, set()).add(name)
        results = str(project.results_dir)
        places.append([(results, None), *((url, names) for url, names in by_share.items() if url != results)])
    by_share = {}
    for entry in user_experiments():
        by_share.setdefault(entry["share"], set()).add(entry["name"])
    places.append(list(by_share.items()))
    return places


def _is_project(project: Project) -> bool:
    return bool(os.environ.get("NBBATCH_PROJECT")) or (project.root / "frameworks").is_dir() \
        or project.state_dir.is_dir()


def _nothing_found(share: str | None, looked: list[str]) -> str:
    if share:
        return (f"no experiments in {share}: it holds no experiment folders with runs. Check the path, or submit an "
                "experiment there first")
    index = f"the index of the experiments you submitted ({user_index_path()})"
    where = f"in {', '.join(looked)} nor in {index}" if looked else f"in {index}, and this folder is in no nbbatch project"
    return (f"no experiments found {where}. cd into the project you submitted from, or pass the share with --share")
