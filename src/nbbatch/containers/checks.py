"""What a backend with ``container: true`` checks and prepares before its runs start, whichever machine runs them:
runs an image can execute, and each framework's image, built or found by its tag.

The local backend looks on this machine; the slurm backend looks on the machine it submits from, and each node's
``nbbatch run-one`` looks again there (:mod:`nbbatch.containers.node`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from nbbatch.containers.engines import Engine
from nbbatch.containers.images import ImageSpec, build_image, image_spec, require_image
from nbbatch.errors import ValidationError
from nbbatch.plan.runs import Run
from nbbatch.spec.frameworks import get_framework
from nbbatch.spec.project import Project


def refuse_runs_without_image(runs: Sequence[Run]) -> None:
    """Refuse a run no framework image can execute: a notebook of no framework, an input that is a share folder
    (the container sees the project read-only, so nothing can be pulled into it)."""
    loose = next((r for r in runs if not r.framework), None)
    if loose is not None:
        raise ValidationError(f"container: true runs each notebook in its framework's image, and {loose.notebook_rel} "
                              f"(kernel {loose.kernel}) belongs to no framework; list it under `frameworks:`, or run "
                              "without containers")
    remote = next(((r, n, u) for r in runs for n, u in r.inputs.items() if "://" in u), None)
    if remote is not None:
        _run, name, url = remote
        raise ValidationError(f"input `{name}` is the share folder {url}, which a container cannot pull into the "
                              f"(read-only) project; bring it here first (`nbbatch data pull {url} ./{name.lower()}`) "
                              f"and name that folder in `inputs:`, or run without containers")


def framework_image_spec(name: str, project: Project, gpu: bool = True, base: str | None = None) -> ImageSpec:
    """The image of framework ``name`` of ``project``: its GPU builds unless ``gpu`` is False, on ``base`` or its own."""
    return image_spec(get_framework(name, project), project.root / "dockerfiles", gpu=gpu, base=base)


def framework_images(engine: Engine, runs: Sequence[Run], gpu: bool = True, base: str | None = None,
                     known: dict[str, tuple[str, str]] | None = None) -> dict[str, tuple[str, str]]:
    """Each framework's ready image, as framework → (tag, image id); :class:`ContainerError` naming the command that
    builds one that is missing. Frameworks already in ``known`` are not looked up again."""
    found = dict(known or {})
    for run in runs:
        if run.framework and run.framework not in found:
            status = require_image(engine, framework_image_spec(run.framework, Project(run.project_root()), gpu, base))
            found[run.framework] = (status.ref, status.image_id or "")
    return found


def build_framework_images(engine: Engine, frameworks: Sequence[str], project: Project, gpu: bool = True,
                           base: str | None = None, progress: bool = True) -> None:
    """Build the frameworks' images that are not ready (``submit --build-envs`` with ``container: true``)."""
    for name in frameworks:
        spec = framework_image_spec(name, project, gpu, base)
        if progress:
            print(f"image of {name}: {spec.ref} (build log: .nbbatch/images/{name}.log)", file=sys.stderr)
        build_image(engine, spec, project)

