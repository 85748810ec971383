"""``nbbatch images build | list | context``: the framework images, as ``nbbatch envs`` does the venvs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from nbbatch.containers.engines import Engine, find_engine
from nbbatch.containers.images import ImageSpec, build_image, image_spec, image_status, stage_context
from nbbatch.errors import NbbatchError
from nbbatch.spec.frameworks import get_framework, list_frameworks
from nbbatch.spec.project import find_project


def add_images_parser(sub: Any) -> None:
    p = sub.add_parser("images", help="framework images (Docker or Podman): build | list | context")
    p.add_argument("action", choices=["build", "list", "context"])
    p.add_argument("names", nargs="*", help="frameworks (default for build and list: all); context: FRAMEWORK DIR")
    p.add_argument("--all", action="store_true")
    p.add_argument("--engine", default="auto", help="auto (Docker when its daemon runs, else Podman), docker or podman")
    p.add_argument("--force", action="store_true", help="rebuild even if ready")
    p.add_argument("--cpu", action="store_true",
                   help="the CPU image: the pins as the local environment has them, on a CPU base (default ubuntu:24.04)")
    p.add_argument("--base", help="build on this base image instead of framework.yaml's base_image")
    p.add_argument("-q", "--quiet", action="store_true", help="do not echo the engine's build output")
    p.set_defaults(func=cmd_images)


def cmd_images(args: argparse.Namespace) -> int:
    project = find_project()
    dockerfiles = project.root / "dockerfiles"
    if args.action == "context":
        if len(args.names) != 2:
            raise NbbatchError("usage: nbbatch images context FRAMEWORK DIR (writes the build context of its image to DIR)")
        spec = image_spec(get_framework(args.names[0], project), dockerfiles, gpu=not args.cpu, base=args.base)
        dest = stage_context(spec, Path(args.names[1]), project)
        print(f"wrote the build context of {spec.ref} to {dest}: "
              f"`{args.engine if args.engine != 'auto' else 'docker'} build -t {spec.ref} {dest}`")
        return 0
    names = list(list_frameworks(project)) if args.all or not args.names else args.names
    specs = [image_spec(get_framework(n, project), dockerfiles, gpu=not args.cpu, base=args.base) for n in names]
    engine = find_engine(args.engine)
    if args.action == "list":
        _print_table(engine, specs)
        return 0
    failures = []
    for spec in specs:
        print(f"{spec.framework.name}: {spec.ref} on {spec.args['BASE_IMAGE']} ({engine.name})")
        try:
            status = build_image(engine, spec, project, force=args.force,
                                 on_line=None if args.quiet else lambda line: print(f"  {line}"))
        except NbbatchError as exc:
            failures.append(str(exc))
            continue
        print(f"{spec.framework.name}: {status.state} ({status.ref}, id {(status.image_id or '')[:12]})")
    if failures:
        raise NbbatchError("\n".join(failures))
    return 0


def _print_table(engine: Engine, specs: list[ImageSpec]) -> None:
    table = Table(title=f"framework images ({engine.name})")
    for col in ("framework", "state", "image", "id", "base", "older builds"):
        table.add_column(col, overflow="fold")
    style = {"ready": "green", "stale": "yellow", "missing": "red"}
    for spec in specs:
        status = image_status(engine, spec)
        cells = [Text(str(c)) for c in (spec.framework.name, status.state, status.ref, (status.image_id or "")[:12],
                                        spec.args["BASE_IMAGE"], ", ".join(status.older))]
        cells[1].stylize(style[status.state])
        table.add_row(*cells)
    Console(width=200).print(table)
