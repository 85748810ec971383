"""Framework images: one Dockerfile template filled from ``framework.yaml``, one build context for every builder.

A framework's image is ``dockerfiles/Dockerfile`` (or the framework's own ``dockerfiles/<name>/Dockerfile``)
with its ARGs given the framework's values as defaults, built from a staged context that holds exactly
what the Dockerfile copies: nbbatch's source, ``frameworks/<name>/``, uv's binary and nbbatch's
requirements. Local builds (Docker, Podman) and Azure ML's image build use the same context. An image
is tagged ``<repository>:<fingerprint>``, the fingerprint covering the pins, the filled-in Dockerfile,
uv's version and nbbatch's requirements: ``ready`` when that tag exists, ``stale`` when only older
builds of the framework do, else ``missing``.

A wheelhouse (``nbbatch images build --find-links DIR``) stages DIR's wheel files into the context
(``context/wheelhouse``) and gives them to the framework step, ``nbbatch envs create``, as uv's
``--find-links`` (``UV_FIND_LINKS``) through a bind mount of that step alone, so no wheel stays in a
layer: e.g. a local ``torch-…+cpu`` wheel, which satisfies the ``torch==…`` pin without PyPI's Linux
wheel and its 4 GB of CUDA libraries. Without one the Dockerfile is the template's, byte for byte.
The wheelhouse leaves the fingerprint as it is: the pins, and so the promise the tag makes, are the
same (as they are whichever index serves them); the label ``nbbatch.wheelhouse`` names the wheels a
build used, and ``--force`` rebuilds an image that is ready without them.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from itertools import takewhile
from pathlib import Path

import nbbatch
from nbbatch.containers.engines import Engine, build_ca_bundle
from nbbatch.errors import ContainerError
from nbbatch.spec.frameworks import Framework
from nbbatch.spec.project import Project
from nbbatch.store.share import write_file_atomic

TEMPLATE = "Dockerfile"  # in the project's dockerfiles/ folder
UV_VERSION = "0.13.8"  # the uv an image installs with (its PyPI wheel carries the binary)
CPU_BASE_IMAGE = "ubuntu:24.04"  # the base of a CPU image (``--cpu``) unless another is named
IMAGE_USER = "nbbatch"  # the user an image runs as (the Dockerfile's ARG RUN_AS) unless built ``--run-as`` another
LABEL_FRAMEWORK = "nbbatch.framework"
LABEL_FINGERPRINT = "nbbatch.fingerprint"
LABEL_VARIANT = "nbbatch.variant"  # GPU builds or not, and the base: builds of one variant replace each other
LABEL_ENV = "nbbatch.env"  # the fingerprint of the framework environment inside (its pins; GPU builds included)
LABEL_WHEELHOUSE = "nbbatch.wheelhouse"  # the wheel files a build was given (--find-links), comma-separated
WHEELHOUSE = "context/wheelhouse"  # where the staged wheels lie in the build context
WHEELHOUSE_MOUNT = "/run/nbbatch/wheelhouse"  # where the framework step sees them (a bind mount, in no layer)
ENV_STEP = "nbbatch envs create"  # the command of the framework step, the one that takes the wheelhouse
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", ".ipynb_checkpoints")
_ARG = re.compile(r"^(\s*ARG\s+)([A-Za-z_][A-Za-z0-9_]*)(=.*)?$")
_RUN = re.compile(r"^(\s*)RUN\s+(.*)$", re.IGNORECASE)
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class ImageSpec:
    """What one framework image is built from: the Dockerfile filled in, and the tag that names it."""

    framework: Framework
    dockerfile: Path  # the template (or the framework's own Dockerfile)
    args: dict[str, str]  # the ARG values written into it
    gpu: bool  # with the framework's GPU builds
    fingerprint: str = ""
    text: str = field(default="", repr=False)  # the Dockerfile with the values filled in
    wheels: tuple[Path, ...] = ()  # the wheelhouse (--find-links): staged into context/wheelhouse

    @property
    def repository(self) -> str:
        image = self.framework.image or f"nbbatch/{self.framework.name}"
        return image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image

    @property
    def ref(self) -> str:
        """The image's tag: ``<repository>:<fingerprint>``."""
        return f"{self.repository}:{self.fingerprint}"

    @property
    def build_command(self) -> str:
        """The command that builds this image."""
        default = image_spec_args(self.framework, self.gpu, None)["BASE_IMAGE"]
        return (f"nbbatch images build {self.framework.name}" + ("" if self.gpu or not self.framework.gpu else " --cpu")
                + ("" if self.args["BASE_IMAGE"] == default else f" --base {self.args['BASE_IMAGE']}")
                + ("" if self.user == IMAGE_USER else f" --run-as {self.user}"))

    @property
    def user(self) -> str:
        """The user the image runs as (its Dockerfile's ``ARG RUN_AS``)."""
        return self.args.get("RUN_AS", IMAGE_USER)

    @property
    def labels(self) -> dict[str, str]:
        labels = {LABEL_FRAMEWORK: self.framework.name, LABEL_VARIANT: self.variant,
                  LABEL_FINGERPRINT: self.fingerprint, LABEL_ENV: self.framework.fingerprint(gpu=self.gpu)}
        if self.wheels:
            labels[LABEL_WHEELHOUSE] = ",".join(wheel.name for wheel in self.wheels)
        return labels

    @property
    def variant(self) -> str:
        """``gpu:<base>`` or ``cpu:<base>``, and `` as <user>`` when the image runs as another than :data:`IMAGE_USER`."""
        user = "" if self.user == IMAGE_USER else f" as {self.user}"
        return f"{'gpu' if self.gpu else 'cpu'}:{self.args['BASE_IMAGE']}{user}"


@dataclass(frozen=True)
class ImageStatus:
    """The state of one framework's image on an engine."""

    framework: str
    state: str  # ready | stale | missing
    ref: str
    image_id: str | None = None
    older: tuple[str, ...] = ()  # other builds of the framework (stale ones)


def dockerfile_of(framework: Framework, dockerfiles_dir: Path) -> Path:
    """The framework's own ``<dir>/<name>/Dockerfile`` if it has one, else the template ``<dir>/Dockerfile``."""
    own = Path(dockerfiles_dir) / framework.name / "Dockerfile"
    if own.is_file():
        return own
    template = Path(dockerfiles_dir) / TEMPLATE
    if not template.is_file():
        raise ContainerError(f"no Dockerfile for framework `{framework.name}`: neither {template} (the template every "
                             f"framework's image is built from) nor {own} exists")
    return template


def image_spec(framework: Framework, dockerfiles_dir: Path, gpu: bool = True, base: str | None = None,
               find_links: Sequence[Path] = (), run_as: str | None = None) -> ImageSpec:
    """The image of ``framework``: with its GPU builds (``gpu``) or the pins as they are, on ``base`` or its own,
    running as ``run_as`` (default :data:`IMAGE_USER`; part of the fingerprint).

    ``find_links``: folders of wheel files the framework step may install from (a wheelhouse). They change
    the Dockerfile's framework step but not the fingerprint, which covers the pins (see the module's docstring).
    """
    gpu = gpu and framework.gpu
    dockerfile = dockerfile_of(framework, dockerfiles_dir)
    args = image_spec_args(framework, gpu, base, run_as)
    if not args["BASE_IMAGE"] and re.search(r"^\s*ARG\s+BASE_IMAGE\b", dockerfile.read_text(), re.MULTILINE):
        raise ContainerError(f"frameworks/{framework.name}/framework.yaml names no `base_image` for its image; "
                             "add one (e.g. nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04), or pass --base IMAGE")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*|[0-9]+(:[0-9]+)?", args["RUN_AS"]):
        raise ContainerError(f"`{args['RUN_AS']}` is not a user an image can run as; name one (e.g. root, nbbatch) "
                             "or a uid[:gid]")
    if args["RUN_AS"] != IMAGE_USER and not re.search(r"^\s*ARG\s+RUN_AS\b", dockerfile.read_text(), re.MULTILINE):
        raise ContainerError(f"{dockerfile} cannot run as `{args['RUN_AS']}`: it has no `ARG RUN_AS`; end it as the "
                             "template does (`ARG RUN_AS=nbbatch` among its ARGs, `USER ${RUN_AS}` last)")
    text = render(dockerfile.read_text(), args)
    digest = hashlib.sha256()
    for part in (framework.fingerprint(gpu=gpu), text, "\n".join(nbbatch_requirements()), UV_VERSION):
        digest.update(part.encode())
        digest.update(b"\0")
    wheels = wheelhouse_files(find_links)
    if wheels:
        text = with_wheelhouse(text, dockerfile)
    return ImageSpec(framework, dockerfile, args, gpu, digest.hexdigest()[:16], text, wheels)


def image_spec_args(framework: Framework, gpu: bool, base: str | None, run_as: str | None = None) -> dict[str, str]:
    """The Dockerfile's ARG values for ``framework``: its base image (or ``base``), Python, GPU builds or not, and
    the user it runs as."""
    base = base or (framework.base_image if gpu or not framework.gpu else CPU_BASE_IMAGE) or ""
    return {"BASE_IMAGE": base, "FRAMEWORK": framework.name, "PYTHON_VERSION": framework.python,
            "GPU": "1" if gpu else "0", "SYSTEM_PACKAGES": " ".join(framework.system_packages),
            "RUN_AS": run_as or IMAGE_USER}


def wheelhouse_files(folders: Sequence[Path]) -> tuple[Path, ...]:
    """The wheel files (``*.whl``) of ``folders``, by name; of two with one name, the earlier folder's.

    Raises :class:`ContainerError` for a folder that does not exist or holds no wheel file.
    """
    wheels: dict[str, Path] = {}
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise ContainerError(f"--find-links {folder}: no such folder. Name a folder that holds wheel files "
                                 "(*.whl) for the image's framework step, or leave the option out")
        found = sorted(path for path in folder.glob("*.whl") if path.is_file())
        if not found:
            raise ContainerError(f"--find-links {folder} holds no wheel file (*.whl): only wheels are staged into "
                                 "the build context. Put the wheels there (`pip download --only-binary=:all: "
                                 f"--dest {folder} PACKAGE`), or leave the option out")
        for wheel in found:
            wheels.setdefault(wheel.name, wheel)
    return tuple(wheels[name] for name in sorted(wheels))


def with_wheelhouse(text: str, dockerfile: Path) -> str:
    """``text`` with its framework step (the RUN of ``nbbatch envs create``) given the staged wheels: the
    context's wheelhouse bind-mounted for that step alone (no wheel enters a layer; Podman, or Docker's
    BuildKit) and uv's ``--find-links`` set to it (``UV_FIND_LINKS``)."""
    lines = text.splitlines()
    start = _framework_step(lines)
    if start is None:
        raise ContainerError(f"{dockerfile} has no RUN step running `{ENV_STEP}`, which is the step a wheelhouse "
                             "(--find-links) is given to; build without --find-links, or install the framework "
                             f"with `{ENV_STEP}` as the template dockerfiles/{TEMPLATE} does")
    match = _RUN.match(lines[start])
    assert match is not None
    indent, words = match.group(1), match.group(2).split(" ")
    flags = list(takewhile(lambda word: word.startswith("--"), words))  # RUN's own options stay on its line
    mount = f"--mount=type=bind,source={WHEELHOUSE},target={WHEELHOUSE_MOUNT}"
    lines[start:start + 1] = [f"{indent}RUN {' '.join([*flags, mount])} \\",
                              f"{indent}    export UV_FIND_LINKS={WHEELHOUSE_MOUNT} \\",
                              f"{indent} && {' '.join(words[len(flags):])}"]
    return "\n".join(lines) + "\n"


def _framework_step(lines: list[str]) -> int | None:
    """The index of the line that starts the RUN instruction running ``nbbatch envs create``, if any."""
    start = None
    for number, line in enumerate(lines):
        continued = number > 0 and lines[number - 1].rstrip().endswith("\\")
        if not continued and _RUN.match(line):
            start = number
        if start is not None and not line.rstrip().endswith("\\"):
            if ENV_STEP in " ".join(lines[start:number + 1]):
                return start
            start = None
    return None


def render(text: str, args: dict[str, str]) -> str:
    """The Dockerfile with ``args`` as its ARGs' defaults (Azure ML's image build takes no build args)."""
    lines = []
    for line in text.splitlines():
        match = _ARG.match(line)
        if match and match.group(2) in args:
            line = f"{match.group(1)}{match.group(2)}={json.dumps(args[match.group(2)])}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def copy_sources(text: str) -> list[str]:
    """The context paths a Dockerfile's COPY and ADD instructions read (ARG defaults substituted)."""
    defaults: dict[str, str] = {}
    sources: list[str] = []
    for keyword, rest in instructions(text):
        if keyword == "ARG":
            name, _, value = rest.partition("=")
            defaults[name.strip()] = json.loads(value) if value.startswith('"') else value
        elif keyword in ("COPY", "ADD"):
            words = rest.split()
            if any(w.startswith("--from") for w in words):
                continue
            paths = [w for w in words if not w.startswith("--")][:-1]
            sources += [_VARIABLE.sub(lambda m: defaults.get(m.group(1) or m.group(2), ""), p) for p in paths]
    return sources


def instructions(text: str) -> list[tuple[str, str]]:
    """A Dockerfile's ``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        pending = ""
        out.append((keyword.upper(), rest.strip()))
    return out


def stage_context(spec: ImageSpec, dest: Path, project: Project, arch: str | None = None) -> Path:
    """Write the build context of ``spec`` into ``dest``: the filled-in Dockerfile and all it copies.

    Raises :class:`ContainerError` naming any path the Dockerfile copies that the context lacks, so a
    build never fails half-way for want of a file.
    """
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "Dockerfile").write_text(spec.text)
    shutil.copytree(Path(nbbatch.__file__).resolve().parent, dest / "src" / "nbbatch", ignore=IGNORE, dirs_exist_ok=True)
    shutil.copytree(spec.framework.folder, dest / "frameworks" / spec.framework.name, ignore=IGNORE, dirs_exist_ok=True)
    own = spec.dockerfile.parent
    if own.name == spec.framework.name:  # a framework's own Dockerfile may copy files beside it
        shutil.copytree(own, dest, ignore=IGNORE, dirs_exist_ok=True)
        (dest / "Dockerfile").write_text(spec.text)
    sources = copy_sources(spec.text)
    (dest / "context").mkdir(exist_ok=True)
    (dest / "context" / "nbbatch-requirements.txt").write_text("\n".join(nbbatch_requirements()) + "\n")
    if "context/uv" in sources:
        shutil.copy2(uv_binary(project, arch), dest / "context" / "uv")
    stage_wheels(spec.wheels, dest / WHEELHOUSE)
    missing = [src for src in sources if not (dest / src).exists()]
    if missing:
        raise ContainerError(f"{spec.dockerfile} copies {', '.join(missing)}, which the build context of "
                             f"`{spec.framework.name}` does not hold; copy only from src/, frameworks/<name>/, "
                             "context/ or files beside the framework's own Dockerfile")
    return dest


def stage_wheels(wheels: Sequence[Path], folder: Path) -> None:
    """Put ``wheels`` into ``folder``: hard links where the file system allows (no copy of hundreds of MB), else copies."""
    if not wheels:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        target = folder / wheel.name
        target.unlink(missing_ok=True)
        try:
            os.link(wheel, target)
        except OSError:  # another file system, or links refused
            shutil.copy2(wheel, target)


def nbbatch_requirements() -> list[str]:
    """nbbatch's own requirements (no extras): what runs ``nbbatch run-one`` in an image."""
    try:
        declared = metadata.requires("nbbatch") or []
    except metadata.PackageNotFoundError as exc:
        raise ContainerError("nbbatch is not installed as a package here (only on PYTHONPATH), so its requirements "
                             "are unknown; install it (`pip install -e .`) to build images") from exc
    return sorted(r.split(";")[0].strip() for r in declared if "extra ==" not in r)


def machine_arch(machine: str | None = None) -> str:
    """The CPU architecture as wheel tags name it (``x86_64``, ``aarch64``)."""
    machine = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def uv_binary(project: Project, arch: str | None = None) -> Path:
    """uv's Linux binary for ``arch`` (this machine's by default), from its PyPI wheel, cached in the project."""
    arch = machine_arch(arch)
    cached = project.cache_dir / f"uv-{UV_VERSION}-{arch}" / "uv"
    if cached.is_file():
        return cached
    with tempfile.TemporaryDirectory(prefix="nbbatch-uv-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"uv=={UV_VERSION}", "--no-deps", "--only-binary=:all:",
               "--platform", f"manylinux2014_{arch}", "--python-version", "3.11", "--dest", tmp,
               "--disable-pip-version-check", "--quiet"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("uv-*.whl"))
        if done.returncode != 0 or not wheels:
            raise ContainerError(f"cannot fetch uv {UV_VERSION}'s wheel for linux/{arch} from the package index "
                                 f"(`{' '.join(cmd[2:6])} …`): {(done.stderr or done.stdout).strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if re.search(r"\.data/scripts/uv$", n)), None)
            if member is None:
                raise ContainerError(f"{wheels[0].name} holds no uv binary")
            write_file_atomic(cached, wheel.read(member), 0o755)
    return cached


def image_status(engine: Engine, spec: ImageSpec) -> ImageStatus:
    """Whether ``spec``'s image is built (``ready``), only older builds are (``stale``), or none (``missing``)."""
    image_id = engine.image_id(spec.ref)
    builds = engine.images_labelled({LABEL_FRAMEWORK: spec.framework.name, LABEL_VARIANT: spec.variant})
    older = tuple(ref for ref, _ in builds if not ref.endswith(":" + spec.fingerprint))
    state = "ready" if image_id else "stale" if older else "missing"
    return ImageStatus(spec.framework.name, state, spec.ref, image_id, older)


def build_image(engine: Engine, spec: ImageSpec, project: Project, force: bool = False,
                on_line: Callable[[str], None] | None = None) -> ImageStatus:
    """Build ``spec``'s image unless it is ready (or ``force``); the engine's output goes to a log in the project."""
    status = image_status(engine, spec)
    if status.state == "ready" and not force:
        return status
    logs = project.state_dir / "images"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{spec.framework.name}.log"
    with tempfile.TemporaryDirectory(prefix=f"nbbatch-image-{spec.framework.name}-") as tmp:
        context = stage_context(spec, Path(tmp) / "context", project)
        cmd = engine.command("build", "--file", str(context / "Dockerfile"), "--tag", spec.ref,
                             *[arg for k, v in spec.labels.items() for arg in ("--label", f"{k}={v}")],
                             *engine.build_mounts(build_ca_bundle()), str(context))
        started = time.monotonic()
        with open(log_path, "w") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    stdin=subprocess.DEVNULL)
            assert proc.stdout is not None
            tail: list[str] = []
            for line in proc.stdout:
                log.write(line)
                tail = [*tail[-14:], line.rstrip()]
                if on_line:
                    on_line(line.rstrip())
            code = proc.wait()
            log.write(f"# exit {code} after {time.monotonic() - started:.1f} s\n")
    if code != 0:
        raise ContainerError(f"building the image of `{spec.framework.name}` with {engine.name} failed (exit {code}); "
                             f"the last lines of {log_path}:\n" + "\n".join(tail))
    return image_status(engine, spec)


def require_image(engine: Engine, spec: ImageSpec) -> ImageStatus:
    """The ready image of ``spec``, or an error naming the command that builds it."""
    status = image_status(engine, spec)
    if status.state != "ready":
        why = (f"only older builds exist ({', '.join(status.older)}): its pins, Dockerfile or base changed"
               if status.state == "stale" else "it was never built")
        raise ContainerError(f"the image of framework `{spec.framework.name}` ({spec.ref}) is not ready on "
                             f"{engine.name}: {why}. Build it with `{spec.build_command}`, or submit "
                             "with --build-envs")
    return status
