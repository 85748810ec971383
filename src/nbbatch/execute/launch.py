"""The launch contract of ``nbbatch run-one``: what a backend hands the node launcher of one run, in one value.

Every backend, and the container runner, describes a run's launch as a :class:`LaunchSpec` and starts the command
:func:`launch_command` (or :func:`launch_shell_command`, in a job's script) gives; ``nbbatch run-one LAUNCH`` reads
it back (:func:`read_launch`), as submitit's ``python -m submitit.core._submit FOLDER``. ``LAUNCH`` is a launch
file (a private one, or one on the share such as the slurm backend's ``specs/<n>.json``) or, where a job's command
is all that reaches its node (Azure ML), the launch JSON itself, its run in a file beside the job's code
(``run_file``: Linux holds one argument to 128 KiB, and a run's parameters have no bound). This module is the only
one that knows run-one's command line (tests/test_architecture.py holds it to that): a backend fills a LaunchSpec,
never run-one's arguments.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbbatch.errors import NbbatchError
from nbbatch.execute.context import AttemptContext
from nbbatch.execute.placement import NodePlacement, local_placements
from nbbatch.plan.runs import Run
from nbbatch.redact import is_secret_value
from nbbatch.store.runjson import ContainerInfo, GpuSharing, from_json_value, to_json_value

LAUNCH_VERSION = 1  # bumped when a field changes meaning: run-one refuses a launch of a newer nbbatch
RUN_ONE = "run-one"  # the node launcher's subcommand
RUN_ONE_NOT_DONE = 1  # run-one's exit code once it recorded the run failed, cancelled or timed out: never run it again
RUN_ONE_REQUEUED = 75  # ... once its cluster stopped it and it went back in the queue (EX_TEMPFAIL: run it again)
# Set (to anything) in the environment of a job whose own output stream is its live log (Azure ML's, which
# `nbbatch logs -f` follows): run-one echoes the run's log to its stdout as well as writing log.txt
LOG_ECHO_ENV = "NBBATCH_LOG_ECHO"


@dataclass(frozen=True)
class LaunchSpec:
    """Everything ``nbbatch run-one`` needs to execute one run (or one node of a distributed run) where it starts.

    It holds nothing secret besides what the run itself carries (its ``env:`` and parameters, refused by the backends
    that would show them): variables reach run-one through its environment, by name.
    """

    run: Run
    share: str  # the share as open_share reads it (a folder, a URL; Azure ML: the mount's binding)
    backend: str = "local"  # run.json's ``backend``; also whose hook tells a gang's node its place
    project: str | None = None  # the project's root on the node (None: found from the working directory)
    gpus: tuple[int, ...] = ()  # the kernel's CUDA_VISIBLE_DEVICES
    gpus_from_env: tuple[str, ...] = ()  # without ``gpus``: the first of these variables set on the node names them
    shared_gpu: bool = False  # the GPU is shared with other runs
    inputs: Mapping[str, str] = field(default_factory=dict)  # where each of the run's inputs is on the node (mounts)
    container_images: Mapping[str, str] = field(default_factory=dict)  # framework → tag: run in its image, from here
    container_engine: str = "podman"  # what starts that image
    # Told to the run-one inside a container by the runner that started it (run.json's, as the host knows them):
    host_gpu_ids: tuple[int, ...] | None = None  # the GPUs' indices on the host
    gpu_share: GpuSharing | None = None
    container: ContainerInfo | None = None
    node: NodePlacement | None = None  # a gang's node: its place (None: from the environment, by the backend's hook)
    fresh_ports: bool = False  # that node may pick new rendezvous ports (the local backend's single node)

    def to_dict(self, run_file: str | None = None) -> dict[str, Any]:
        """The launch as JSON values (``launch_version`` first); refuses a secret-looking launch setting.

        With ``run_file`` the run is not in it but in that file (relative to run-one's working directory), which the
        caller writes with :meth:`run_json`: what keeps a job's command line bounded whatever the run's parameters."""
        settings = [self.share, self.project, *self.inputs.values(), *self.container_images.values()]
        if any(is_secret_value(value) for value in settings):
            raise NbbatchError(f"the launch of run {self.run.run_id} names a share, project, input or image whose text "
                               "looks like a credential; it would be written where the run starts. Give the share and "
                               "inputs without credentials (keys travel in the environment, e.g. AZURE_STORAGE_KEY)")
        node = self.node
        return {
            "launch_version": LAUNCH_VERSION, **({"run": self.run.to_dict()} if run_file is None else
                                                 {"run_file": run_file}),
            "share": self.share, "backend": self.backend,
            "project": self.project, "gpus": list(self.gpus), "gpus_from_env": list(self.gpus_from_env),
            "shared_gpu": self.shared_gpu, "inputs": dict(self.inputs), "container_images": dict(self.container_images),
            "container_engine": self.container_engine,
            "host_gpu_ids": None if self.host_gpu_ids is None else list(self.host_gpu_ids),
            "gpu_share": to_json_value(self.gpu_share), "container": to_json_value(self.container),
            "node": None if node is None else {"node_rank": node.node_rank, "endpoints": list(node.endpoints),
                                               "local_ranks": None if node.local_ranks is None else list(node.local_ranks)},
            "fresh_ports": self.fresh_ports,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def run_json(self) -> str:
        """The run alone, as the file :meth:`to_dict`'s ``run_file`` names holds it."""
        return json.dumps(self.run.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "the launch") -> LaunchSpec:
        """The launch ``data`` describes (:meth:`to_dict`'s); :class:`NbbatchError` naming ``source`` when it is not one."""
        version = data.get("launch_version") if isinstance(data, Mapping) else None
        if not isinstance(version, int):
            raise NbbatchError(f"run-one: {source} is not an nbbatch launch (no launch_version); it is written by the "
                               "backend that starts the run")
        if version > LAUNCH_VERSION:
            raise NbbatchError(f"run-one: {source} is launch version {version}, newer than this nbbatch reads "
                               f"({LAUNCH_VERSION}); install the submitting machine's nbbatch where the run starts")
        try:
            node, host = data.get("node"), data.get("host_gpu_ids")
            run = _read_run_file(str(data["run_file"]), source) if "run_file" in data else data["run"]
            return cls(
                run=Run.from_dict(run), share=str(data["share"]), backend=str(data.get("backend", "local")),
                project=data.get("project"), gpus=tuple(int(g) for g in data.get("gpus") or ()),
                gpus_from_env=tuple(data.get("gpus_from_env") or ()), shared_gpu=bool(data.get("shared_gpu")),
                inputs=dict(data.get("inputs") or {}), container_images=dict(data.get("container_images") or {}),
                container_engine=str(data.get("container_engine") or "podman"),
                host_gpu_ids=None if host is None else tuple(int(g) for g in host),
                gpu_share=from_json_value(GpuSharing, data["gpu_share"], source, "gpu_share")
                if data.get("gpu_share") else None,
                container=from_json_value(ContainerInfo, data["container"], source, "container")
                if data.get("container") else None,
                node=None if not node else NodePlacement(
                    int(node["node_rank"]), tuple(node["endpoints"]),
                    None if node.get("local_ranks") is None else tuple(node["local_ranks"])),
                fresh_ports=bool(data.get("fresh_ports")))
        except (KeyError, ValueError, TypeError) as exc:
            raise NbbatchError(f"run-one: {source} is not a valid launch ({type(exc).__name__}: {exc})") from exc

    @classmethod
    def from_json(cls, text: str, source: str = "the launch") -> LaunchSpec:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise NbbatchError(f"run-one: {source} is not JSON ({exc})") from exc
        return cls.from_dict(data, source)

    def gpu_ids(self, environ: Mapping[str, str]) -> list[int]:
        """The kernel's GPUs: ``gpus``, else those the first of ``gpus_from_env`` set in ``environ`` names."""
        if self.gpus:
            return list(self.gpus)
        named = next((environ[name] for name in self.gpus_from_env if environ.get(name, "").strip()), "")
        try:
            return [int(g) for g in named.split(",") if g.strip()]
        except ValueError as exc:
            raise NbbatchError(f"run-one: the GPUs this node was given ({named!r}) are not indices; start the run "
                               "where CUDA_VISIBLE_DEVICES holds GPU indices, not UUIDs") from exc

    def attempt_context(self, project_root: Path, node: NodePlacement | None,
                        environ: Mapping[str, str]) -> AttemptContext:
        """How the run's attempts execute here (``node``: this node's place in a gang, or None)."""
        return AttemptContext(
            backend=self.backend, project_root=project_root, shared_gpu=self.shared_gpu, gpu_ids=self.gpu_ids(environ),
            gpu_share=self.gpu_share, container=self.container,
            recorded_gpu_ids=None if self.host_gpu_ids is None else list(self.host_gpu_ids),
            input_paths=dict(self.inputs), placement=node,
            new_endpoints=(lambda: local_placements(self.run)[0].endpoints) if self.fresh_ports else None)


def _read_run_file(path: str, source: str) -> Any:
    """The run a launch's ``run_file`` holds (relative to the working directory: a job's code snapshot)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise NbbatchError(f"run-one: {source} names the run file {path}, which cannot be read here "
                           f"({exc.strerror or exc}); run-one starts in the folder the backend put it in") from exc
    except ValueError as exc:
        raise NbbatchError(f"run-one: the run file {path} of {source} is not JSON ({exc})") from exc


def nbbatch_launcher(python: str | os.PathLike[str]) -> list[str]:
    """The command that starts nbbatch with the interpreter ``python`` (one with nbbatch installed)."""
    return [str(python), "-m", "nbbatch"]


def launch_command(launcher: Sequence[str], launch: str | os.PathLike[str]) -> list[str]:
    """The command that executes a launch: ``launcher`` (:func:`nbbatch_launcher`'s, say) then ``run-one LAUNCH``
    (``launch``: a launch file's path, or :meth:`LaunchSpec.to_json` itself)."""
    return [*launcher, RUN_ONE, str(launch)]


def launch_shell_command(launcher: str, launch_word: str) -> str:
    """:func:`launch_command` as a line of shell: ``launcher`` is shell already (``python -m nbbatch``, maybe with
    variables set first) and so is ``launch_word``, quoted by the caller where it expands on the node
    (``$SLURM_ARRAY_TASK_ID``)."""
    return f"{launcher} {RUN_ONE} {launch_word}"


def shell_launcher(python: str) -> str:
    """:func:`nbbatch_launcher` as shell."""
    return shlex.join(nbbatch_launcher(python))


def read_launch(launch: str) -> LaunchSpec:
    """The launch run-one was given: the JSON itself (it starts with ``{``) or a launch file's path."""
    if launch.lstrip().startswith("{"):
        return LaunchSpec.from_json(launch, "the launch JSON on its command line")
    try:
        text = Path(launch).read_text(encoding="utf-8")
    except OSError as exc:
        raise NbbatchError(f"run-one: cannot read the launch file {launch} ({exc.strerror or exc}); it is written by "
                           "the backend that starts the run") from exc
    return LaunchSpec.from_json(text, f"the launch file {launch}")
