"""Framework images in a registry: ``nbbatch images push REGISTRY``, and ``registry:`` in a backend's settings.

An image travels as ``REGISTRY/nbbatch-<framework>:<fingerprint>``: the same fingerprint as its local tag, so a
node that pulls it runs exactly what was built here (its labels carry the variant). The engine does the talking,
with its own login (``podman login`` / ``docker login``) and its own idea of which registries are insecure (plain
HTTP); nbbatch never takes registry credentials.
"""

from __future__ import annotations

import re
import socket
import time

from nbbatch.containers.engines import Engine
from nbbatch.containers.images import ImageSpec
from nbbatch.errors import ContainerError, ValidationError

REPOSITORY_PREFIX = "nbbatch-"  # REGISTRY/nbbatch-<framework>:<fingerprint>
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?$")
_PATH_PART = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")  # the distribution spec's path component


class ImageNotInRegistry(ContainerError):
    """The registry answered, and has no image of that tag."""


def check_registry(registry: str) -> str:
    """``registry`` as ``host[:port][/path]`` (a trailing ``/`` dropped), or :class:`ValidationError` naming the
    mistake: a scheme, a tag or digest, a host the engines would read as a Docker Hub namespace."""
    given = str(registry or "").strip()
    what = f"registry `{given}`"
    if not given:
        raise ValidationError("the registry is empty: name it as host[:port][/path], e.g. registry.example.com/team")
    if "://" in given:
        raise ValidationError(f"{what} has a scheme: name it without one, as {given.split('://', 1)[1].rstrip('/')} "
                              "(the engine's registry settings say whether it speaks HTTPS or plain HTTP)")
    host, *path = given.rstrip("/").split("/")
    if "@" in given or any(":" in part for part in path):
        raise ValidationError(f"{what} has a tag or digest: name only host[:port][/path]; nbbatch adds "
                              f"{REPOSITORY_PREFIX}<framework>:<fingerprint> itself")
    if not _HOST.match(host):
        raise ValidationError(f"{what}: `{host}` is not a host or host:port")
    if "." not in host and ":" not in host:
        raise ValidationError(f"{what}: `{host}` has no domain and no port, so the engines would read it as a Docker "
                              f"Hub namespace (or, for `localhost`, as local images): name the registry's host with its "
                              f"domain or port (registry.example.com, {host}:5000), or docker.io/{host} for Docker Hub")
    bad = next((part for part in path if not _PATH_PART.match(part)), None)
    if bad is not None:
        raise ValidationError(f"{what}: the path part `{bad}` is not a repository name: lowercase letters and digits, "
                              "separated by single `.`, `_` or `-`")
    return "/".join([host, *path])


def registry_ref(spec: ImageSpec, registry: str) -> str:
    """Where ``spec``'s image lives in ``registry``: ``REGISTRY/nbbatch-<framework>:<fingerprint>``."""
    return f"{check_registry(registry)}/{REPOSITORY_PREFIX}{spec.framework.name}:{spec.fingerprint}"


def names_registry(ref: str) -> bool:
    """Whether image ``ref`` starts with a registry host (one with a domain or a port), i.e. can be pulled."""
    first, slash, _rest = ref.partition("/")
    return bool(slash) and ("." in first or ":" in first) and first != "localhost"


def mirrored(base: str, mirror: str | None) -> str:
    """``base`` pulled from ``mirror`` when it is a Docker Hub image (no registry host, or ``docker.io/``):
    ``nvidia/cuda:12.8.1-…`` → ``MIRROR/nvidia/cuda:12.8.1-…``, the name ``az acr import --image`` gives a copy.
    An image of another registry, or no mirror, is left as it is."""
    if not mirror or not base:
        return base
    name = base.split("/", 1)[1] if base.startswith(("docker.io/", "index.docker.io/")) else base
    return base if names_registry(name) or name.startswith("localhost/") else f"{check_registry(mirror)}/{name}"


def push_command(spec: ImageSpec, registry: str) -> str:
    """The command that pushes ``spec``'s image (with its variant's options) to ``registry``."""
    return spec.build_command.replace("nbbatch images build ", f"nbbatch images push {registry} ", 1)


def refusal_hint(message: str, ref: str, engine: Engine) -> str:
    """What to do about an engine's refusal to talk to the registry of ``ref`` (empty when nothing is known)."""
    host = ref.split("/", 1)[0]
    text = message.lower()
    if "server gave http response to https client" in text:
        where = ('add `"insecure-registries": ["' + host + '"]` to /etc/docker/daemon.json and restart Docker'
                 if engine.name == "docker" else
                 f'add `[[registry]] location = "{host}" insecure = true` to /etc/containers/registries.conf (or to '
                 "the file CONTAINERS_REGISTRIES_CONF names)")
        return f"{host} serves plain HTTP: mark it insecure in {engine.name}'s settings ({where}), or serve it with TLS"
    if any(word in text for word in ("unauthorized", "authentication required", "denied")):
        return f"log in to it first: `{engine.name} login {host}` (nbbatch uses the engine's login, never its own)"
    if any(word in text for word in ("connection refused", "no such host", "i/o timeout", "timed out",
                                     "network is unreachable", "no route to host")):
        return f"{host} is not reachable from {socket.gethostname()}: check its host and port, and that it is running"
    return ""


def engine_message(output: str) -> str:
    """The engine's own error in its output (progress lines and retries dropped)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.lower().startswith("error")]
    return (errors or lines or [""])[-1]


def _refused(action: str, ref: str, engine: Engine, output: str) -> ContainerError:
    message = engine_message(output)
    hint = refusal_hint(message, ref, engine)
    return ContainerError(f"{engine.name} could not {action} {ref} on {socket.gethostname()}: {message}"
                          + (f". Fix: {hint}" if hint else ""))


def push_image(engine: Engine, spec: ImageSpec, registry: str) -> tuple[str, float]:
    """Push ``spec``'s local image to ``registry``; ``(ref, seconds the push took)``.

    The engines push a tag that names the registry: one is added for the push and removed after it, pushed or not
    (the image keeps its own tag), so the local store ends with the tags it had. A registry tag that was there
    before stays."""
    ref = registry_ref(spec, registry)
    tagged_before = engine.image_id(ref) is not None
    tagged = engine.query("tag", spec.ref, ref)
    if tagged.returncode != 0:
        raise ContainerError(f"{engine.name} could not tag {spec.ref} as {ref}: {engine_message(tagged.stderr)}")
    try:
        started = time.monotonic()
        done = engine.transfer("push", ref)
        if done.returncode != 0:
            raise _refused("push", ref, engine, done.stderr or done.stdout)
        return ref, time.monotonic() - started
    finally:  # also after a Ctrl-C
        if not tagged_before:
            engine.query("rmi", ref)  # only the tag: the image has spec.ref too


def pull_image(engine: Engine, ref: str) -> str:
    """Pull ``ref`` from its registry; the pulled image's id, or :class:`ContainerError` with the engine's message,
    this machine's name and the fix."""
    done = engine.transfer("pull", ref)
    image_id = engine.image_id(ref) if done.returncode == 0 else None
    if image_id is None:
        raise _refused("pull", ref, engine, done.stderr or done.stdout or "the image is not there after the pull")
    return image_id


def require_remote_image(engine: Engine, spec: ImageSpec, registry: str) -> str:
    """``spec``'s ref in ``registry``, checked to be there (the registry answers and holds the tag); else
    :class:`ContainerError` naming the push command, or the registry's refusal and its fix."""
    ref = registry_ref(spec, registry)
    try:
        present = engine.remote_image_exists(ref)
    except ContainerError as exc:
        raise _refused("look up", ref, engine, str(exc)) from None
    if not present:
        raise ImageNotInRegistry(f"the image of framework `{spec.framework.name}` is not in registry {registry} (no tag "
                             f"{ref}): push it with `{push_command(spec, registry)}` (after building it here)")
    return ref
