"""What a backend with ``container: true`` checks and prepares before its runs start, whichever machine runs them:
runs an image can execute, and each framework's image, built or found by its tag.

The local backend looks on this machine; the slurm backend looks on the machine it submits from, and each node's
``nbbatch run-one`` looks again there (:mod:`nbbatch.containers.node`). With a ``registry:`` every backend looks in the
registry instead (:mod:`nbbatch.containers.registry`), and the machine that runs a run pulls its image.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from nbbatch.containers.engines import Engine, find_engine
from nbbatch.containers.images import ImageSpec, build_image, image_spec, require_image
from nbbatch.containers.registry import pull_image, registry_ref, require_remote_image
from nbbatch.errors import ContainerError, ValidationError
from nbbatch.plan.runs import Run
from nbbatch.spec.frameworks import get_framework
from nbbatch.spec.project import Project

IMAGE_SETTINGS = ("cpu_image", "base_image", "registry")  # backend settings that choose the image of container: true


def refuse_image_settings_without_container(settings: object) -> None:
    """Refuse ``cpu_image``, ``base_image`` or ``registry`` in backend settings without ``container: true``: each would
    be ignored, and the runs would use the framework venvs instead of the images the user asked for."""
    if getattr(settings, "container", False):
        return
    given = [name for name in IMAGE_SETTINGS if getattr(settings, name, None) not in (None, False, "")]
    if given:
        raise ValidationError(f"backend setting{'s' if len(given) > 1 else ''} {', '.join(f'`{n}`' for n in given)} "
                              "choose the framework images of `container: true`, which is not set: add `container: "
                              "true` to run in the images, or drop them to run in the framework venvs")


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
                     known: dict[str, tuple[str, str]] | None = None, registry: str | None = None,
                     pull_here: bool = False) -> dict[str, tuple[str, str]]:
    """Each framework's image, as framework → (ref, image id here or ""). Frameworks already in ``known`` are not
    looked up again.

    Without ``registry``: the image built here, or :class:`ContainerError` naming the command that builds it. With
    ``registry`` (``REGISTRY/nbbatch-<framework>:<fingerprint>``): checked to be in the registry, or an error naming
    the push command or the registry's refusal. ``pull_here`` (the runs execute on this machine): an image already
    here needs no registry, a missing one is pulled now."""
    found = dict(known or {})
    for run in runs:
        if not run.framework or run.framework in found:
            continue
        spec = framework_image_spec(run.framework, Project(run.project_root()), gpu, base)
        if registry is None:
            status = require_image(engine, spec)
            found[run.framework] = (status.ref, status.image_id or "")
            continue
        ref = registry_ref(spec, registry)
        image_id = engine.image_id(ref) if pull_here else None
        if image_id is None:
            require_remote_image(engine, spec, registry)
            if pull_here:
                print(f"pulling the image of {run.framework}: {ref}", file=sys.stderr)
                image_id = pull_image(engine, ref)
        found[run.framework] = (ref, image_id or engine.image_id(ref) or "")
    return found


def build_framework_images(engine: Engine, frameworks: Sequence[str], project: Project, gpu: bool = True,
                           base: str | None = None, progress: bool = True) -> None:
    """Build the frameworks' images that are not ready (``submit --build-envs`` with ``container: true``)."""
    for name in frameworks:
        spec = framework_image_spec(name, project, gpu, base)
        if progress:
            print(f"image of {name}: {spec.ref} (build log: .nbbatch/images/{name}.log)", file=sys.stderr)
        build_image(engine, spec, project)



class NodeImages:
    """``container: true`` of a backend whose nodes start the images (slurm, ray): each framework's image tag found
    here (or, with ``registry``, in the registry the nodes pull from), and built here on request. A node that lacks
    its image says so when its run starts (:mod:`nbbatch.containers.node`)."""

    def __init__(self, backend: str, engine: str, cpu_image: bool = False, base_image: str | None = None,
                 registry: str | None = None, nothing_started: str = "Nothing was queued.") -> None:
        self.backend, self.engine_name, self.registry = backend, engine, registry
        self.gpu, self.base = not cpu_image, base_image
        self.nothing_started = nothing_started
        self._engine: Engine | None = None
        self.found: dict[str, tuple[str, str]] = {}  # framework → (image tag, image id here or "")

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            try:
                self._engine = find_engine(self.engine_name)
            except ContainerError as exc:
                raise ContainerError(f"container: true starts each run's image with {self.engine_name} on its node, and "
                                     f"looks for the images with {self.engine_name} here first, which fails: {exc}") from exc
        return self._engine

    def check(self, runs: Sequence[Run]) -> None:
        """Before queueing: every run has a framework, and each framework's image is here (or in the registry)."""
        refuse_runs_without_image(runs)
        self.refs(runs)

    def refs(self, runs: Sequence[Run]) -> dict[str, str]:
        """The image tag of each framework of ``runs``, or :class:`ContainerError` saying why one is not there."""
        try:
            self.found = framework_images(self.engine, runs, gpu=self.gpu, base=self.base, known=self.found,
                                          registry=self.registry)
        except ContainerError as exc:
            if self.registry:  # the nodes pull from there: the registry's own error says it all
                raise ContainerError(f"{exc}. {self.nothing_started}") from exc
            raise ContainerError(f"{exc}. With the {self.backend} backend every node needs the image as well, under the "
                                 f"same tag (build it there too, push it to a registry and set `registry:`, or "
                                 f"`{self.engine_name} save` it here and `{self.engine_name} load` it there). "
                                 f"{self.nothing_started}") from exc
        return {r.framework: self.found[r.framework][0] for r in runs if r.framework}

    def build(self, frameworks: Sequence[str], project: Project, progress: bool = True) -> None:
        """``submit --build-envs``: the images of ``frameworks`` built here (the nodes need their own copies)."""
        if frameworks:
            build_framework_images(self.engine, frameworks, project, gpu=self.gpu, base=self.base, progress=progress)
