"""Container engines: Docker and Podman behind one short protocol, registered by name.

An engine knows its command, whether it can run containers now (Docker's daemon is up), how it hands
GPUs to a container (Docker's ``--gpus``, Podman's CDI devices), how files written to a bind mount
end up owned by the invoking user, and how a build reaches an extra CA bundle. ``auto`` takes Docker
when its daemon answers, else Podman, else says what to install.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from nbbatch.errors import ContainerError, did_you_mean

CA_MOUNT = "/run/nbbatch/ca.crt"  # where a build's RUN steps find an extra CA bundle (dockerfiles/Dockerfile)
CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))  # where the NVIDIA Container Toolkit writes CDI specs
_CA_VARIABLES = ("NBBATCH_BUILD_CA", "SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE")
TRANSFER_TIMEOUT_S = 3600.0  # a push or pull of a GPU image (gigabytes) on a slow link
REMOTE_TIMEOUT_S = 60.0  # asking a registry whether it holds a tag
# Podman 4.3's `manifest inspect` reads a single image's manifest, then refuses it as no manifest list: it exists.
_SINGLE_IMAGE = "Treating single images as manifest lists is not implemented"
_MISSING = ("manifest unknown", "no such manifest", "name unknown")  # the registry answered: no such tag or repository


@dataclass(frozen=True)
class Engine:
    """One container engine on this machine (its command's full path)."""

    name: ClassVar[str]
    binary: str

    def command(self, *args: str) -> list[str]:
        return [self.binary, *args]

    def query(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run an engine command and return what it printed (never raises on a non-zero exit)."""
        try:
            return subprocess.run(self.command(*args), capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return subprocess.CompletedProcess(self.command(*args), 1, "", str(exc))

    def check_running(self) -> None:
        """Raise :class:`ContainerError` when this engine cannot run containers now."""

    def gpu_args(self, gpu_ids: Sequence[int]) -> list[str]:
        """``run`` options that hand these GPUs (NVML indices) to a container."""
        raise NotImplementedError

    def check_gpus(self) -> None:
        """Raise :class:`ContainerError` when this machine cannot pass GPUs to this engine's containers."""
        raise NotImplementedError

    def user_args(self) -> list[str]:
        """``run`` options under which files written to bind mounts belong to the invoking user."""
        return ["--user", f"{os.getuid()}:{os.getgid()}"]

    def build_mounts(self, ca_bundle: Path | None) -> list[str]:
        """``build`` options that show an extra CA bundle to the RUN steps (at :data:`CA_MOUNT`), if it can."""
        return []

    def image_id(self, ref: str) -> str | None:
        """The id of the local image ``ref``, or None when there is none."""
        done = self.query("image", "inspect", "--format", "{{.Id}}", ref)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None

    def transfer(self, action: str, ref: str, timeout: float = TRANSFER_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """``push`` or ``pull`` image ``ref`` (the registry its name starts with, through the engine's own login)."""
        return self.query(action, ref, timeout=timeout)

    def remote_image_exists(self, ref: str) -> bool:
        """Whether the registry ``ref`` names holds it, read without pulling it (``manifest inspect``);
        :class:`ContainerError` with the engine's own message when the registry cannot be asked."""
        done = self.query("manifest", "inspect", *self.manifest_options(ref), ref, timeout=REMOTE_TIMEOUT_S)
        message = done.stderr.strip() or done.stdout.strip()
        if done.returncode == 0 or _SINGLE_IMAGE in message:
            return True
        if any(missing in message.lower() for missing in _MISSING):
            return False
        raise ContainerError(message or f"`{self.name} manifest inspect {ref}` failed (exit {done.returncode})")

    def manifest_options(self, ref: str) -> list[str]:
        """Options of ``manifest inspect`` for the registry ``ref`` names (Podman reads registries.conf itself)."""
        return []

    def images_labelled(self, labels: dict[str, str]) -> list[tuple[str, str]]:
        """``(reference, id)`` of the local tagged images carrying all these labels.

        The engine filters by the first label (Podman ORs repeated label filters); the rest are read back."""
        label, value = next(iter(labels.items()))
        done = self.query("images", "--filter", f"label={label}={value}", "--format", "{{.Repository}}:{{.Tag}}\t{{.ID}}")
        found = []
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            ref, _, image_id = line.partition("\t")
            if ref and image_id and "<none>" not in ref and self._has_labels(ref.strip(), labels):
                found.append((ref.strip(), image_id.strip()))
        return found

    def _has_labels(self, ref: str, labels: dict[str, str]) -> bool:
        if len(labels) == 1:
            return True
        done = self.query("image", "inspect", "--format", "{{json .Config.Labels}}", ref)
        try:
            have = json.loads(done.stdout.strip().splitlines()[0]) if done.returncode == 0 else None
        except (ValueError, IndexError):
            have = None
        return isinstance(have, dict) and all(have.get(k) == v for k, v in labels.items())


class Docker(Engine):
    """Docker: a daemon builds and runs; GPUs through the NVIDIA Container Toolkit (``--gpus``)."""

    name: ClassVar[str] = "docker"

    def check_running(self) -> None:
        done = self.query("info", "--format", "{{.ServerVersion}}", timeout=30)
        if done.returncode != 0 or not done.stdout.strip():
            why = _first_line(done.stderr) or "no answer"
            raise ContainerError(
                f"Docker is installed ({self.binary}) but its daemon is not reachable ({why}). Start it "
                "(`sudo systemctl start docker`), or use Podman, which needs no daemon: engine: podman")

    def manifest_options(self, ref: str) -> list[str]:
        """``--insecure`` where the daemon treats the registry as insecure (``insecure-registries`` in daemon.json, or
        an address in its insecure ranges, 127.0.0.0/8 by default): the CLI's ``manifest`` command, unlike pulls
        through the daemon, does not read those settings and would ask over HTTPS only."""
        done = self.query("info", "--format", "{{json .RegistryConfig}}", timeout=30)
        try:
            config = json.loads(done.stdout) if done.returncode == 0 else {}
        except ValueError:
            config = {}
        host = ref.split("/", 1)[0]
        insecure = {name for name, index in (config.get("IndexConfigs") or {}).items() if not index.get("Secure", True)}
        try:
            address = ipaddress.ip_address(host.rsplit(":", 1)[0].strip("[]"))
            in_ranges = any(address in ipaddress.ip_network(cidr) for cidr in config.get("InsecureRegistryCIDRs") or [])
        except ValueError:  # a host name
            in_ranges = False
        return ["--insecure"] if host in insecure or in_ranges else []

    def gpu_args(self, gpu_ids: Sequence[int]) -> list[str]:
        # The quotes keep Docker's CSV parser from splitting "device=0,1" at the comma.
        return ["--gpus", '"device=' + ",".join(str(g) for g in gpu_ids) + '"'] if gpu_ids else []

    def check_gpus(self) -> None:
        runtimes = self.query("info", "--format", "{{json .Runtimes}}", timeout=30).stdout
        if "nvidia" in runtimes or shutil.which("nvidia-container-cli") or shutil.which("nvidia-container-runtime-hook"):
            return
        raise ContainerError(
            "GPU runs in Docker containers need the NVIDIA Container Toolkit (it gives `docker run --gpus` the GPUs), "
            "and this machine has none (no nvidia runtime in `docker info`, no nvidia-container-cli): install it "
            "(https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/) and restart Docker, "
            "or set resources.gpus: 0")


class Podman(Engine):
    """Podman: no daemon; GPUs as CDI devices (``--device nvidia.com/gpu=N``)."""

    name: ClassVar[str] = "podman"

    def check_running(self) -> None:
        done = self.query("info", "--format", "{{.Host.OCIRuntime.Name}}", timeout=30)
        if done.returncode != 0:
            raise ContainerError(f"podman cannot run containers here: {_first_line(done.stderr) or 'podman info failed'} "
                                 "(see docs/containers.md for the settings it needs)")

    def gpu_args(self, gpu_ids: Sequence[int]) -> list[str]:
        return [arg for g in gpu_ids for arg in ("--device", f"nvidia.com/gpu={g}")]

    def check_gpus(self) -> None:
        for folder in CDI_DIRS:
            for spec in sorted(folder.glob("*")) if folder.is_dir() else []:
                try:
                    if "nvidia.com/gpu" in spec.read_text(errors="replace"):
                        return
                except OSError:
                    continue
        raise ContainerError(
            "GPU runs in Podman containers need NVIDIA's CDI spec (it gives `podman run --device nvidia.com/gpu=N` "
            f"the GPU), and none is in {' or '.join(map(str, CDI_DIRS))}: generate it with "
            "`sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml` (NVIDIA Container Toolkit), "
            "or set resources.gpus: 0")

    def user_args(self) -> list[str]:
        rootless = ["--userns=keep-id"] if os.geteuid() != 0 else []  # map the invoking user into the container
        return [*rootless, *super().user_args()]

    def build_mounts(self, ca_bundle: Path | None) -> list[str]:
        return ["--volume", f"{ca_bundle}:{CA_MOUNT}:ro"] if ca_bundle else []


ENGINES: dict[str, type[Engine]] = {"docker": Docker, "podman": Podman}
ENGINE_CHOICES = ("auto", *ENGINES)


def find_engine(name: str = "auto") -> Engine:
    """The engine called ``name`` (``auto``: Docker when its daemon answers, else Podman), checked to be usable."""
    if name == "auto":
        docker = shutil.which("docker")
        if docker:
            try:
                return _usable(Docker(docker))
            except ContainerError:
                if not shutil.which("podman"):
                    raise
        podman = shutil.which("podman")
        if podman:
            return _usable(Podman(podman))
        raise ContainerError("no container engine found: install Podman (`apt-get install podman`) or Docker, "
                             "or run without `container: true`")
    if name not in ENGINES:
        raise ContainerError(f"unknown container engine `{name}`{did_you_mean(name, ENGINES)}; "
                             f"use one of: {', '.join(ENGINE_CHOICES)}")
    binary = shutil.which(name)
    if not binary:
        other = next(n for n in ENGINES if n != name)
        raise ContainerError(f"container engine `{name}` is not installed (no `{name}` on PATH): install it, "
                             f"or use engine: {other} or engine: auto")
    return _usable(ENGINES[name](binary))


@functools.lru_cache(maxsize=8)
def _usable(engine: Engine) -> Engine:
    engine.check_running()
    return engine


def build_ca_bundle() -> Path | None:
    """The extra CA bundle this machine's downloads trust (a TLS-inspecting proxy), if one is configured."""
    for variable in _CA_VARIABLES:
        value = os.environ.get(variable)
        if value and Path(value).is_file():
            return Path(value)
    return None


def _first_line(text: str) -> str:
    return next((line.strip() for line in (text or "").splitlines() if line.strip()), "")
