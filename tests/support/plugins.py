"""The smallest plug-ins nbbatch accepts, for tests/test_contracts.py: a backend and a share scheme, each written
against the public contract only (:class:`~nbbatch.backends.base.Backend`, :class:`~nbbatch.store.share.Share`).

:func:`install_plugins` makes them findable the way a pip-installed package is: a ``.dist-info`` folder on
``sys.path`` whose ``entry_points.txt`` names them under ``nbbatch.backends`` and ``nbbatch.shares``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from nbbatch.backends.base import Backend, Capabilities, Compute, SubmitOptions
from nbbatch.execute.attempts import execute_run
from nbbatch.execute.context import AttemptContext
from nbbatch.plan.runs import Run
from nbbatch.store.share import Share

BACKEND_NAME = "minimal"
SHARE_SCHEME = "memory"
DIST_NAME = "nbbatch_contract_plugins"


class MinimalBackend(Backend):
    """Runs each run in turn, in this process, on no GPU: only the two methods a backend must implement."""

    name = BACKEND_NAME
    capabilities = Capabilities(gpus=False)

    def compute(self) -> Compute:
        return Compute(backend=self.name, slots=1)

    def start(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        for run in runs:
            execute_run(run, share, AttemptContext(backend=self.name, on_update=options.guarded_update))


class MemoryShare:
    """A share held in memory, by URL (``memory://<name>``): every open of one URL sees the same files."""

    _by_url: dict[str, dict[str, bytes]] = {}
    _lock = threading.Lock()

    def __init__(self, url: str):
        self.url = url
        with self._lock:
            self.files = self._by_url.setdefault(url, {})

    @staticmethod
    def _key(path: str) -> str:
        return path.strip("/")

    def write_bytes(self, path: str, data: bytes) -> None:
        self.files[self._key(path)] = bytes(data)

    def read_bytes(self, path: str) -> bytes:
        try:
            return self.files[self._key(path)]
        except KeyError:
            raise FileNotFoundError(path) from None

    def exists(self, path: str) -> bool:
        key = self._key(path)
        return key in self.files or any(k.startswith(key + "/") for k in list(self.files))

    def list(self, path: str = "") -> list[str]:
        prefix = self._key(path) + "/" if self._key(path) else ""
        names = {k[len(prefix):].split("/")[0] for k in list(self.files) if k.startswith(prefix)}
        return sorted(n for n in names if not n.startswith("."))  # hidden: writers' temporaries, leases

    def remove(self, path: str) -> None:
        key = self._key(path)
        for k in [k for k in list(self.files) if k == key or k.startswith(key + "/")]:
            self.files.pop(k, None)

    def local_path(self, path: str) -> Path | None:
        return None  # not on this machine: nbbatch must go through the methods above

    def remove_partial_writes(self, folder: str) -> int:
        prefix = self._key(folder) + "/" if self._key(folder) else ""
        stale = [k for k in list(self.files) if k.startswith(prefix) and "/" not in k[len(prefix):]
                 and k[len(prefix):].startswith(".") and k.endswith(".part")]
        for key in stale:
            self.files.pop(key, None)
        return len(stale)


def install_plugins(site: Path) -> Path:
    """Write a ``.dist-info`` into ``site`` that registers :class:`MinimalBackend` and :class:`MemoryShare` by entry
    point; put ``site`` on ``sys.path`` (e.g. ``monkeypatch.syspath_prepend``) to install them."""
    info = site / f"{DIST_NAME}-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[nbbatch.backends]\n{BACKEND_NAME} = {__name__}:MinimalBackend\n\n"
        f"[nbbatch.shares]\n{SHARE_SCHEME} = {__name__}:MemoryShare\n")
    return site
