"""``nbbatch images build | list | push | context``: the framework images, as ``nbbatch envs`` does the venvs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from nbbatch.containers.engines import Engine, find_engine
from nbbatch.containers.images import (
    LABEL_FRAMEWORK,
    LABEL_VARIANT,
    ImageSpec,
    build_image,
    image_spec,
    image_spec_args,
    image_status,
    stage_context,
)
from nbbatch.containers.registry import check_registry, push_image
from nbbatch.errors import NbbatchError
from nbbatch.spec.frameworks import get_framework, list_frameworks
from nbbatch.spec.project import Project, find_project


def add_images_parser(sub: Any) -> None:
    p = sub.add_parser("images", help="framework images (Docker or Podman): build | list | push | context")
    p.add_argument("action", choices=["build", "list", "push", "context"],
                   help="build images, list them, push them to a registry, or write a build context")
    p.add_argument("names", nargs="*", help="frameworks (default for build and list: all); context: FRAMEWORK DIR; "
                   "push: REGISTRY [FRAMEWORK ...] (default: every image built here)")
    p.add_argument("--all", action="store_true", help="every framework")
    p.add_argument("--engine", default="auto", help="auto (Docker when its daemon runs, else Podman), docker or podman")
    p.add_argument("--force", action="store_true", help="rebuild even if ready")
    p.add_argument("--cpu", action="store_true",
                   help="the CPU image: the pins as the local environment has them, on a CPU base (default ubuntu:24.04)")
    p.add_argument("--base", help="build on this base image instead of framework.yaml's base_image")
    p.add_argument("--run-as", metavar="USER", default=None,
                   help="the user the image runs as (default nbbatch, uid 10001); `root` for Azure ML, whose jobs "
                   "expect it (the azureml backend builds and wants its images so: docs/containers.md)")
    p.add_argument("--find-links", action="append", default=[], type=Path, metavar="DIR",
                   help="build and context: a folder of wheel files (*.whl) the framework's pins may install from "
                   "(uv's --find-links), e.g. a local CPU torch wheel; repeatable. The image's tag stays the same")
    p.add_argument("-q", "--quiet", action="store_true", help="do not echo the engine's build output")
    p.set_defaults(func=cmd_images)


def cmd_images(args: argparse.Namespace) -> int:
    project = find_project()
    dockerfiles = project.root / "dockerfiles"
    if args.action == "context":
        if len(args.names) != 2:
            raise NbbatchError("usage: nbbatch images context FRAMEWORK DIR (writes the build context of its image to DIR)")
        spec = image_spec(get_framework(args.names[0], project), dockerfiles, gpu=not args.cpu, base=args.base,
                          find_links=args.find_links, run_as=args.run_as)
        dest = stage_context(spec, Path(args.names[1]), project)
        print(f"wrote the build context of {spec.ref} to {dest}: "
              f"`{args.engine if args.engine != 'auto' else 'docker'} build -t {spec.ref} {dest}`")
        return 0
    if args.action == "push":
        return _push(args, project)
    names = list(list_frameworks(project)) if args.all or not args.names else args.names
    find_links = args.find_links if args.action == "build" else []  # the tag is the same: list needs no wheels
    specs = [image_spec(get_framework(n, project), dockerfiles, gpu=not args.cpu, base=args.base,
                        find_links=find_links, run_as=args.run_as) for n in names]
    engine = find_engine(args.engine)
    if args.action == "list":
        _print_table(engine, specs)
        return 0
    failures = []
    for spec in specs:
        count = len(spec.wheels)
        wheels = f", {count} wheel{'' if count == 1 else 's'} from --find-links" if count else ""
        print(f"{spec.framework.name}: {spec.ref} on {spec.args['BASE_IMAGE']} ({engine.name}{wheels})")
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


def _push(args: argparse.Namespace, project: Project) -> int:
    """``images push REGISTRY [FRAMEWORK ...]``: the images built here, as REGISTRY/nbbatch-<fw>:<fingerprint>.
    Named frameworks (or ``--all``) must be built; with none named, every framework whose image is ready goes."""
    if not args.names:
        raise NbbatchError("usage: nbbatch images push REGISTRY [FRAMEWORK ...] (REGISTRY as host[:port][/path]; log "
                           "in with `podman login` / `docker login` first if it needs credentials)")
    registry = check_registry(args.names[0])
    named = args.names[1:] or (list(list_frameworks(project)) if args.all else [])
    candidates = named or list(list_frameworks(project))
    specs = [image_spec(get_framework(n, project), project.root / "dockerfiles", gpu=not args.cpu, base=args.base,
                        run_as=args.run_as) for n in candidates]
    engine = find_engine(args.engine)
    built = {spec.framework.name for spec in specs if image_status(engine, spec).state == "ready"}
    ready = [spec for spec in specs if spec.framework.name in built]
    unbuilt = [spec for spec in specs if spec.framework.name not in built]
    if (named and unbuilt) or not ready:
        which = unbuilt if named else specs
        raise NbbatchError(f"not built here ({engine.name}): " + ", ".join(f"{s.framework.name} ({s.ref})" for s in which)
                           + ". Build first: " + "; ".join(f"`{s.build_command}`" for s in which)
                           + "".join(_other_builds(engine, s) for s in which))
    for spec in ready:
        ref, seconds = push_image(engine, spec, registry)
        print(f"{spec.framework.name}: pushed {ref} in {seconds:.1f} s")
    if unbuilt:
        print(f"not pushed (not built here): {', '.join(s.framework.name for s in unbuilt)}")
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


def _other_builds(engine: Engine, spec: ImageSpec) -> str:
    """A sentence naming the build options of the framework's images of other variants here (other ``--cpu`` /
    ``--base`` / ``--run-as``), which a push of ``spec``'s variant does not take; empty when there are none."""
    options = set()
    for ref, _ in engine.images_labelled({LABEL_FRAMEWORK: spec.framework.name}):
        variant = engine.query("image", "inspect", "--format", f'{{{{index .Labels "{LABEL_VARIANT}"}}}}', ref).stdout.strip()
        if variant and variant != spec.variant:
            kind, _, rest = variant.partition(":")
            base, _, user = rest.partition(" as ")
            gpu = kind == "gpu"
            default = image_spec_args(spec.framework, gpu, None)["BASE_IMAGE"]
            options.add(("--cpu " if spec.framework.gpu and not gpu else "") + (f"--base {base} " if base != default else "")
                        + (f"--run-as {user}" if user else ""))
    if not options:
        return ""
    said = " or ".join(f"`{o.strip()}`" if o.strip() else "no options" for o in sorted(options))
    return (f". {spec.framework.name} is built here with other options ({said}): push with the options it was "
            "built with")
