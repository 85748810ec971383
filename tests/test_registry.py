"""Framework images through a registry: ``nbbatch images push REGISTRY`` and ``backend: {..., registry: REGISTRY}``.

For real (``-m container``): the Chainer image is pushed to Debian's docker-registry on 127.0.0.1
(tests/support/registry.py), removed here, and pulled back by a local ``container: true, registry:`` run that then
executes in it; an unreachable registry, an image never pushed and malformed registry names are refused before any
run starts. Without podman: the ref naming, the validation of a registry's name, and how an engine's answers and
refusals are read.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
from pathlib import Path

import pytest
from support.containers import BASE
from support.containers import nbbatch_cli as _nbbatch
from support.containers import podman as _podman
from support.machine import REPO
from support.waiting import wait_until

from nbbatch.containers.engines import Docker, Podman
from nbbatch.containers.images import image_spec
from nbbatch.containers.node import node_image
from nbbatch.containers.registry import (
    check_registry,
    names_registry,
    push_command,
    push_image,
    refusal_hint,
    registry_ref,
)
from nbbatch.errors import ContainerError, ValidationError
from nbbatch.execute.placement import free_port
from nbbatch.spec.frameworks import list_frameworks
from nbbatch.spec.project import Project


def _chainer_spec():
    return image_spec(list_frameworks(Project(REPO))["chainer"], REPO / "dockerfiles", base=BASE)


# --- naming and validation (no engine) ----------------------------------------------------------------------------


def test_registry_ref_is_the_framework_and_its_fingerprint():
    spec = _chainer_spec()
    assert registry_ref(spec, "registry.example.com/team/") == \
        f"registry.example.com/team/nbbatch-chainer:{spec.fingerprint}"
    assert registry_ref(spec, "127.0.0.1:5001") == f"127.0.0.1:5001/nbbatch-chainer:{spec.fingerprint}"
    assert push_command(spec, "reg.example.com") == f"nbbatch images push reg.example.com chainer --base {BASE}"


@pytest.mark.parametrize(("registry", "says"), [
    ("", "empty"),
    ("https://reg.example.com", "has a scheme: name it without one, as reg.example.com"),
    ("reg.example.com/team:v1", "has a tag or digest"),
    ("reg.example.com/team@sha256:0123", "has a tag or digest"),
    ("myregistry", "Docker Hub namespace"),
    ("localhost/team", "Docker Hub namespace"),
    ("reg.example.com/Team", "path part `Team`"),
    ("reg_example!:5000", "not a host"),
])
def test_malformed_registries_are_refused_saying_why(registry, says):
    with pytest.raises(ValidationError) as caught:
        check_registry(registry)
    assert says in str(caught.value)


def test_which_refs_name_a_registry():
    assert names_registry("127.0.0.1:5000/nbbatch-chainer:abc")
    assert names_registry("registry.example.com/team/nbbatch-chainer:abc")
    assert names_registry("localhost:5000/nbbatch-chainer:abc")
    assert not names_registry("nbbatch/chainer:abc")  # a local build's tag
    assert not names_registry("localhost/nbbatch/chainer:abc")  # podman's name for it
    assert not names_registry("chainer:abc")


class _Answering(Podman):
    """Podman whose commands answer with canned output."""

    def answer(self, code: int, stderr: str) -> _Answering:
        object.__setattr__(self, "_answer", (code, stderr))  # a frozen dataclass, as every engine
        return self

    def query(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        code, stderr = self._answer  # type: ignore[attr-defined]
        return subprocess.CompletedProcess(["podman", *args], code, "", stderr)


def test_a_registry_lookup_reads_the_engines_answer():
    engine = _Answering("podman")
    ref = "127.0.0.1:5000/nbbatch-chainer:abc"
    assert engine.answer(0, "").remote_image_exists(ref)
    # podman 4.3 reads a single image's manifest, then refuses it as no manifest list: the tag exists
    assert engine.answer(125, 'Error: parsing manifest blob "{}": Treating single images as manifest lists is not '
                              "implemented").remote_image_exists(ref)
    assert not engine.answer(125, f'Error: reading image "docker://{ref}": reading manifest abc in x: manifest '
                                  "unknown").remote_image_exists(ref)
    engine.answer(125, 'Error: pinging container registry 127.0.0.1:5000: Get "https://127.0.0.1:5000/v2/": dial '
                       "tcp 127.0.0.1:5000: connect: connection refused")
    with pytest.raises(ContainerError, match="connection refused"):
        engine.remote_image_exists(ref)


class _LocalStore(Podman):
    """Podman whose local store holds these tags; its push answers ``code`` or is cut off by a Ctrl-C."""

    def holding(self, *tags: str, push: int | type[BaseException] = 0) -> _LocalStore:
        object.__setattr__(self, "tags", set(tags))
        object.__setattr__(self, "push", push)
        return self

    def query(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        if args[0] == "tag":
            self.tags.add(args[2])  # type: ignore[attr-defined]
        elif args[0] == "rmi":
            self.tags.discard(args[1])  # type: ignore[attr-defined]
        return subprocess.CompletedProcess(["podman", *args], 0, "", "")

    def image_id(self, ref: str) -> str | None:
        return "sha256:abc" if ref in self.tags else None  # type: ignore[attr-defined]

    def transfer(self, action: str, ref: str, timeout: float = 0) -> subprocess.CompletedProcess[str]:
        if not isinstance(self.push, int):  # type: ignore[attr-defined]
            raise self.push()  # type: ignore[attr-defined]
        return subprocess.CompletedProcess([action], self.push, "", "Error: denied")  # type: ignore[attr-defined]


@pytest.mark.parametrize("push", [0, 125, KeyboardInterrupt], ids=["pushed", "refused", "ctrl-c"])
def test_a_push_leaves_the_local_store_with_the_tags_it_had(push):
    """Issue 45, item 21: the registry-named tag a push adds goes after it, pushed or not; one there before stays."""
    spec = _chainer_spec()
    remote = registry_ref(spec, "127.0.0.1:5000")
    for before in ({spec.ref}, {spec.ref, remote}):
        engine = _LocalStore("podman").holding(*before, push=push)
        with contextlib.suppress(ContainerError, KeyboardInterrupt):
            assert push_image(engine, spec, "127.0.0.1:5000")[0] == remote
        assert engine.tags == before  # type: ignore[attr-defined]


class _DockerDaemon(Docker):
    """Docker whose daemon has these registry settings (``docker info``'s RegistryConfig); the commands it ran."""

    def configured(self, config: dict) -> _DockerDaemon:
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "ran", [])
        return self

    def query(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        self.ran.append(args)  # type: ignore[attr-defined]
        out = json.dumps(self.config) if args[0] == "info" else "{}"  # type: ignore[attr-defined]
        return subprocess.CompletedProcess(["docker", *args], 0, out, "")


def test_docker_asks_a_registry_its_daemon_treats_as_insecure_with_insecure():
    """Docker's `manifest inspect` (the CLI, not the daemon) needs --insecure for a plain-HTTP registry, which the
    daemon knows from insecure-registries or its insecure address ranges (127.0.0.0/8 by default)."""
    config = {"InsecureRegistryCIDRs": ["127.0.0.0/8", "::1/128"],
              "IndexConfigs": {"docker.io": {"Name": "docker.io", "Secure": True},
                               "10.0.0.5:5000": {"Name": "10.0.0.5:5000", "Secure": False}}}
    for ref, insecure in [("10.0.0.5:5000/team/nbbatch-chainer:abc", True), ("127.0.0.1:5000/nbbatch-chainer:abc", True),
                          ("[::1]:5000/nbbatch-chainer:abc", True), ("10.0.0.6:5000/nbbatch-chainer:abc", False),
                          ("registry.example.com/nbbatch-chainer:abc", False)]:
        docker = _DockerDaemon("docker").configured(config)
        assert docker.remote_image_exists(ref)
        assert docker.ran[-1] == ("manifest", "inspect", *(["--insecure"] if insecure else []), ref), ref
    assert _Answering("podman").manifest_options("127.0.0.1:5000/x:y") == []  # registries.conf says it to podman


def test_refusals_come_with_their_fix():
    ref = "reg.example.com:5000/nbbatch-chainer:abc"
    podman, docker = Podman("podman"), Docker("docker")
    plain = "http: server gave HTTP response to HTTPS client"
    assert 'location = "reg.example.com:5000" insecure = true' in refusal_hint(plain, ref, podman)
    assert '"insecure-registries": ["reg.example.com:5000"]' in refusal_hint(plain, ref, docker)
    assert "`podman login reg.example.com:5000`" in refusal_hint("unauthorized: authentication required", ref, podman)
    assert "`docker login reg.example.com:5000`" in refusal_hint("denied: requested access is denied", ref, docker)
    assert "not reachable" in refusal_hint("dial tcp: lookup reg.example.com: no such host", ref, podman)
    assert refusal_hint("something else", ref, podman) == ""


class _Node(Podman):
    """Podman on a node without the image: ``pull`` answers with ``pull_answer`` and, if it succeeded, brings it."""

    def setup(self, code: int, stderr: str) -> _Node:
        object.__setattr__(self, "pull_answer", (code, stderr))
        object.__setattr__(self, "pulled", [])
        return self

    def image_id(self, ref: str) -> str | None:
        return "sha256:pulled" if self.pulled and self.pull_answer[0] == 0 else None  # type: ignore[attr-defined]

    def transfer(self, action: str, ref: str, timeout: float = 0) -> subprocess.CompletedProcess[str]:
        self.pulled.append((action, ref))  # type: ignore[attr-defined]
        return subprocess.CompletedProcess([action], self.pull_answer[0], "", self.pull_answer[1])  # type: ignore[attr-defined]


def test_a_node_pulls_a_registry_image_it_lacks():
    remote = "10.0.0.5:5000/nbbatch-chainer:abc"
    node = _Node("podman").setup(0, "")
    assert node_image(node, remote) == "sha256:pulled" and node.pulled == [("pull", remote)]
    refused = _Node("podman").setup(125, 'Error: pinging container registry 10.0.0.5:5000: Get "https://10.0.0.5:5000/'
                                         'v2/": http: server gave HTTP response to HTTPS client')
    with pytest.raises(ContainerError) as caught:
        node_image(refused, remote)
    assert socket.gethostname() in str(caught.value) and 'location = "10.0.0.5:5000" insecure = true' in str(caught.value)
    local = _Node("podman").setup(0, "")
    with pytest.raises(ContainerError, match="is not on node"):  # a local build's tag: nothing to pull it from
        node_image(local, "nbbatch/chainer:abc")
    assert local.pulled == []


# --- for real: push, remove, pull back and run ----------------------------------------------------------------------


def _experiment(tmp_path: Path, name: str, registry: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"experiment: {name}\nframeworks: [chainer]\n"
                    'parameters: {"DATASET": "digits", "EPOCHS": 1, "MAX_SAMPLES": 200}\n'
                    f"backend: {{name: local, container: true, engine: podman, base_image: '{BASE}', "
                    f"registry: '{registry}'}}\nshare: {tmp_path / 'share'}\n")
    return path


def _exists(ref: str) -> bool:
    return _podman("image", "exists", ref, check=False).returncode == 0


def _wait_unused(ref: str, timeout: float = 120.0) -> None:
    """Wait until no container uses image ``ref``: an earlier test's container (a run's, a build's) may still be on its
    way out when this test starts (podman then refuses to remove the image)."""
    def users() -> list[str]:
        listed = _podman("ps", "--all", "--external", "--filter", f"ancestor={ref}", "--format", "{{.ID}} {{.Names}}")
        return listed.stdout.split()

    wait_until(lambda: not users(), timeout=timeout, message=f"no container using {ref}", interval=1.0)


@pytest.mark.container
@pytest.mark.timeout(900)
def test_pushed_image_is_pulled_back_by_a_run_that_executes_in_it(chainer_image, image_registry, tmp_path):
    remote = registry_ref(chainer_image, image_registry.address)
    image_id = _podman("image", "inspect", "--format", "{{.Id}}", chainer_image.ref).stdout.strip()
    pushed = _nbbatch("images", "push", image_registry.address, "chainer", "--base", BASE, "--engine", "podman")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert f"chainer: pushed {remote} in " in pushed.stdout
    assert not _exists(remote), "the push took its registry tag away again (issue 45, item 21)"
    try:
        _wait_unused(chainer_image.ref)
        # the last tag: the image itself goes (--force: also a build's leftover working container, which podman lists
        # as external and which no filter names)
        _podman("rmi", "--force", chainer_image.ref)
        assert not _exists(remote) and not _exists(image_id)
        done = _nbbatch("submit", str(_experiment(tmp_path, "reg-ok", image_registry.address)), "-q")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"pulling the image of chainer: {remote}" in done.stderr
        [record] = [json.loads(p.read_text()) for p in (tmp_path / "share" / "reg-ok").glob("*/run.json")]
        assert record["status"] == "succeeded" and record["metrics"]["accuracy"] > 0
        assert record["container"]["image"] == remote and record["container"]["image_id"] == image_id
    finally:  # other tests of the session use chainer_image: give it its local tag back
        if not _exists(chainer_image.ref):
            if not _exists(remote):
                _podman("pull", remote)
            _podman("tag", remote, chainer_image.ref)
        _podman("rmi", remote, check=False)  # only the registry's tag; the image keeps the local one
    assert _podman("image", "inspect", "--format", "{{.Id}}", chainer_image.ref).stdout.strip() == image_id


@pytest.mark.container
@pytest.mark.timeout(600)
def test_registry_mistakes_are_refused_before_any_run(podman_env, image_registry, tmp_path):
    unreachable = f"127.0.0.1:{free_port()}"
    spec = _chainer_spec()
    cases = [
        (unreachable, f"{unreachable} is not reachable"),
        (f"{image_registry.address}/never-pushed",
         f"push it with `nbbatch images push {image_registry.address}/never-pushed chainer --base {BASE}`"),
        ("http://" + image_registry.address, "has a scheme"),
        ("registry:5000/team:v2", "has a tag or digest"),
    ]
    for index, (registry, says) in enumerate(cases):
        name = f"reg-bad-{index}"
        done = _nbbatch("submit", str(_experiment(tmp_path, name, registry)), "-q", timeout=300)
        assert done.returncode != 0, done.stdout
        assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert not list((tmp_path / "share").glob(f"{name}/*/run.json")), "a run started"
    assert not _exists(registry_ref(spec, f"{image_registry.address}/never-pushed"))


@pytest.mark.container
@pytest.mark.timeout(300)
def test_a_push_of_a_variant_not_built_names_the_options_the_image_was_built_with(chainer_image):
    """Chainer is built on the test base (`--base`); a push without it finds no image of the default variant, and
    says which options the image here was built with. Nothing is pushed (the registry is never reached)."""
    done = _nbbatch("images", "push", f"127.0.0.1:{free_port()}", "chainer", "--engine", "podman")
    assert done.returncode != 0
    assert "not built here (podman): chainer" in done.stderr
    assert f"chainer is built here with other options (`--base {BASE}`)" in done.stderr, done.stderr
