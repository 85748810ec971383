"""A container registry on this machine for the tests (the ``image_registry`` fixture of tests/conftest.py).

Debian's ``docker-registry`` (the CNCF distribution registry 2.8) serves on 127.0.0.1 at a free port, with its own
config and storage in a temporary folder. It speaks plain HTTP, so a private registries.conf marks it insecure,
named by ``CONTAINERS_REGISTRIES_CONF`` for the whole session (as containers.conf is by ``CONTAINERS_CONF``); it keeps
the system's own settings (short-name search) and adds the one entry.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nbbatch.containers.images import ImageSpec
from nbbatch.containers.registry import registry_ref
from nbbatch.execute.placement import free_port
from support.containers import BASE, nbbatch_cli, podman
from support.waiting import wait_until

SYSTEM_REGISTRIES_CONF = Path("/etc/containers/registries.conf")


@dataclass(frozen=True)
class Registry:
    """The running test registry."""

    address: str  # 127.0.0.1:PORT, as nbbatch's `registry:` names it
    registries_conf: Path
    log: Path


@contextlib.contextmanager
def pushed_elsewhere(image: ImageSpec, registry: str) -> Iterator[str]:
    """``image`` pushed to ``registry`` with the CLI, which leaves no registry tag here (the image keeps its local tag,
    which other tests use), so a run with ``registry:`` must pull it; its registry ref. The pulled tag goes after."""
    remote = registry_ref(image, registry)
    pushed = nbbatch_cli("images", "push", registry, image.framework.name, "--base", BASE, "--engine", "podman",
                         *(["--cpu"] if image.framework.gpu and not image.gpu else []))
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert podman("image", "exists", remote, check=False).returncode == 1, "the push left its registry tag here"
    try:
        yield remote
    finally:
        podman("rmi", remote, check=False)


def registry_missing() -> str:
    """Why the test registry cannot run here, or an empty string when it can."""
    if os.geteuid() != 0:
        return "needs root (rootful podman pushes and pulls)"
    absent = [tool for tool in ("docker-registry", "podman") if not shutil.which(tool)]
    return f"needs {', '.join(absent)} (apt-get install docker-registry podman)" if absent else ""


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError):
        return False


def registry_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """The ``image_registry`` fixture: the registry started, insecure for podman, stopped by its pid at the end."""
    if why := registry_missing():
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("registry")
    address = f"127.0.0.1:{free_port()}"
    config = folder / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {folder / 'storage'}\n"
                      f"  delete:\n    enabled: true\nhttp:\n  addr: {address}\n")
    system = SYSTEM_REGISTRIES_CONF.read_text() if SYSTEM_REGISTRIES_CONF.is_file() else ""
    conf = folder / "registries.conf"
    conf.write_text(f'{system}\n[[registry]]\nlocation = "{address}"\ninsecure = true\n')
    log = folder / "registry.log"
    with open(log, "w") as out:
        server = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: _answers(f"http://{address}/v2/") or server.poll() is not None, timeout=60,
                   message=f"the registry did not answer on {address}", interval=0.1)
        assert server.poll() is None, f"docker-registry exited: {log.read_text()[-2000:]}"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("CONTAINERS_REGISTRIES_CONF", str(conf))
            yield Registry(address, conf, log)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(server.pid, signal.SIGKILL)
                server.wait()
