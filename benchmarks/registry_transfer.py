"""How long images take to travel through a registry: push from here, pull on a node with none of their layers.

    python benchmarks/registry_transfer.py [--rounds 2] [FRAMEWORK_IMAGE ...]

Starts the tests' registry (tests/support/registry.py: Debian's ``docker-registry`` on 127.0.0.1, plain HTTP, marked
insecure for podman) and takes the framework images built here (every local image labelled ``nbbatch.framework``,
or the refs given). Each round, per image:

  * push: what ``nbbatch images push`` does (tag it for the registry, ``podman push``) into a new, empty registry
    each time, so no layer is there already;
  * pull: ``podman pull`` into an empty image store of its own (``--root`` in a temporary folder), as a node that has
    never pulled anything does; the machine's own store is not touched.

Prints the image's size here, its size in the registry (compressed layers) and the medians over the rounds. Needs
root, podman and docker-registry.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe, load_average, median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' registry

from support.registry import registry_missing, registry_session  # noqa: E402 - after the path above


class _Folders:
    """What :func:`registry_session` asks of pytest's tmp_path_factory: fresh folders."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))


def framework_images() -> list[tuple[str, float]]:
    """(ref, size in MB) of the local images labelled as nbbatch framework images."""
    listed = subprocess.run(["podman", "images", "--filter", "label=nbbatch.framework", "--format",
                             "{{.Repository}}:{{.Tag}}\t{{.Size}}"], capture_output=True, text=True, check=True)
    images = []
    for line in listed.stdout.splitlines():
        ref, _, _ = line.partition("\t")
        if ref and "<none>" not in ref:
            images.append((ref, size_mb(ref)))
    return images


def size_mb(ref: str) -> float:
    done = subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", ref], capture_output=True, text=True,
                          check=True)
    return int(done.stdout.strip()) / 1e6


def pushed_mb(storage: Path) -> float:
    """The registry's blobs on disk: what a pull downloads (compressed layers, config, manifest)."""
    return sum(p.stat().st_size for p in storage.rglob("data") if p.is_file()) / 1e6


def push(ref: str, remote: str, registries_conf: Path) -> float:
    """Seconds to push local image ``ref`` as ``remote``."""
    subprocess.run(["podman", "tag", ref, remote], check=True, capture_output=True)
    started = time.perf_counter()
    subprocess.run(["podman", "push", "-q", remote], check=True, capture_output=True, text=True,
                   env=_env(registries_conf))
    return time.perf_counter() - started


def pull_fresh(ref: str, registries_conf: Path) -> float:
    """Seconds to pull ``ref`` into an image store of its own, which starts empty."""
    store = Path(tempfile.mkdtemp(prefix="nbbatch-pull-"))
    try:
        started = time.perf_counter()
        subprocess.run(["podman", "--root", str(store / "root"), "--runroot", str(store / "run"), "pull", "-q", ref],
                       check=True, capture_output=True, text=True, env=_env(registries_conf))
        return time.perf_counter() - started
    finally:
        subprocess.run(["podman", "--root", str(store / "root"), "--runroot", str(store / "run"), "rmi", "-af"],
                       capture_output=True, env=_env(registries_conf))
        shutil.rmtree(store, ignore_errors=True)


def _env(registries_conf: Path) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_REGISTRIES_CONF": str(registries_conf)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="*", help="local image refs (default: every nbbatch framework image here)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if why := registry_missing():
        raise SystemExit(f"cannot run: {why}")
    engine = subprocess.run(["podman", "--version"], capture_output=True, text=True).stdout.strip()
    registry = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "docker-registry"], capture_output=True,
                              text=True).stdout.strip()
    print(describe("Images through a registry: push, pull") + f"- {engine}, docker-registry {registry or '?'} on "
          "127.0.0.1 (plain HTTP)\n")
    images = [(ref, size_mb(ref)) for ref in args.images] if args.images else framework_images()
    if not images:
        raise SystemExit("no nbbatch framework image here: build one first (nbbatch images build FRAMEWORK)")
    print("| image | size here | in the registry (compressed) | push (median) | pull into an empty store (median) |")
    print("|---|---|---|---|---|")
    for ref, size in images:
        pushes, pulls, stored = [], [], 0.0
        for _ in range(args.rounds):
            push_s, pull_s, stored = one_round(ref)
            pushes.append(push_s)
            pulls.append(pull_s)
            print(f"  {ref}: push {push_s:.1f} s, pull {pull_s:.1f} s (load {load_average()})", file=sys.stderr)
        print(f"| {ref} | {size:.0f} MB | {stored:.0f} MB | {median(pushes):.1f} s | {median(pulls):.1f} s |")


def one_round(ref: str) -> tuple[float, float, float]:
    """Push ``ref`` to a new, empty registry and pull it back into an empty store: (push s, pull s, MB stored)."""
    work = Path(tempfile.mkdtemp(prefix="nbbatch-registry-bench-"))
    session = registry_session(_Folders(work))
    registry = next(session)
    remote = f"{registry.address}/bench/image:latest"
    try:
        push_s = push(ref, remote, registry.registries_conf)
        stored = pushed_mb(next(work.glob("registry-*")) / "storage")
        return push_s, pull_fresh(remote, registry.registries_conf), stored
    finally:
        subprocess.run(["podman", "rmi", remote], capture_output=True)
        session.close()
        shutil.rmtree(work, ignore_errors=True)

if __name__ == "__main__":
    main()
