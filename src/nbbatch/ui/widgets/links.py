"""Links to executed notebooks: their files, the Jupyter server serving them, and copies of any share's files."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from jupyter_core.paths import jupyter_runtime_dir

import nbbatch.ui.widgets.display as display
from nbbatch import api
from nbbatch.results.status import resolve_run_id
from nbbatch.store.fetch import fetch
from nbbatch.store.layout import OUTPUT_NOTEBOOK, run_paths
from nbbatch.store.sync import FileEntry
from nbbatch.ui.widgets.submission import experiment_name

if TYPE_CHECKING:
    from nbbatch.store.share import Share


@dataclass(frozen=True)
class NotebookLinks:
    """Where a run's executed notebook is: on this machine, and as URLs of the Jupyter server showing it."""

    path: Path | None  # the file, when the share is a local folder
    open_url: str | None = None  # opens it in JupyterLab (a path on the server: ``/lab/tree/...``)
    download_url: str | None = None  # downloads it (``/files/...?download=1``)
    outputs: tuple[tuple[str, str | None], ...] = ()  # what the run wrote to NBBATCH_OUTPUT_DIR: (name, download URL)

    def html(self) -> str:
        """``open · ⤓`` (download) links, or the file's name when no Jupyter server serves it."""
        return display.render_html("widget_links.html.j2", links=self)

    def text(self) -> str:
        """The file's path (relative to the working directory when under it)."""
        if self.path is None:
            return ""
        try:
            return str(self.path.relative_to(Path.cwd()))
        except ValueError:
            return str(self.path)


_SERVERS_CACHE: dict[str, Any] = {"at": 0.0, "servers": []}


def _jupyter_servers() -> list[dict[str, Any]]:
    """Running Jupyter servers this kernel can see (their ``jpserver-*.json`` files), cached for 10 s."""
    if time.monotonic() - _SERVERS_CACHE["at"] < 10:
        return _SERVERS_CACHE["servers"]
    servers = []
    try:
        runtime = Path(jupyter_runtime_dir())
        for info_file in runtime.glob("jpserver-*.json"):
            try:
                info = json.loads(info_file.read_text())
                os.kill(int(info["pid"]), 0)
            except (ValueError, KeyError, OSError, TypeError):
                continue
            if info.get("root_dir") or info.get("notebook_dir"):
                servers.append(info)
    except Exception:  # noqa: BLE001 - no runtime dir: no links, paths instead
        servers = []
    _SERVERS_CACHE.update(at=time.monotonic(), servers=servers)
    return servers


def server_urls(path: Path) -> tuple[str, str] | None:
    """``(open_url, download_url)`` for a file under a running Jupyter server's root, else None.

    The URLs are paths on the server (no host, no token): the browser showing the notebook already
    holds the session. Among several servers, the one with the deepest root containing the file wins.
    """
    path = path.resolve()
    best: tuple[int, str, str] | None = None
    for info in _jupyter_servers():
        root = Path(info.get("root_dir") or info.get("notebook_dir")).expanduser().resolve()
        try:
            rel = path.relative_to(root)
        except ValueError:
            continue
        base = info.get("base_url") or "/"
        base = base if base.endswith("/") else base + "/"
        encoded = quote(rel.as_posix())
        candidate = (len(root.parts), f"{base}lab/tree/{encoded}", f"{base}files/{encoded}?download=1")
        if best is None or candidate[0] > best[0]:
            best = candidate
    return (best[1], best[2]) if best else None


def notebook_links_for(share: Share, experiment: str, run_id: str,
                       outputs: Sequence[FileEntry] = ()) -> NotebookLinks:
    """The executed notebook of a run (a full id) in ``share``, as a path and server URLs; with ``outputs``
    (run.json's list), download URLs of those files too (None where no Jupyter server reaches them)."""
    paths = run_paths(experiment, run_id)
    local = share.local_path(paths.notebook)
    if local is None or not local.exists():
        return NotebookLinks(None, outputs=tuple((o.name, None) for o in outputs))
    urls = server_urls(local)
    folder = share.local_path(paths.outputs)
    offered = []
    for entry in outputs:
        name = entry.name
        served = server_urls(folder / name) if folder is not None and (folder / name).is_file() else None
        offered.append((name, served[1] if served else None))
    return NotebookLinks(local, *(urls or (None, None)), outputs=tuple(offered))


def notebook_links(experiment: str, run: str, share: str | Share | None = None) -> NotebookLinks:
    """The executed notebook of ``run`` (an id or a unique prefix) of ``experiment``, as a path and server URLs."""
    name, the_share = api.open_experiment_share(experiment_name(experiment), share)
    return notebook_links_for(the_share, name, resolve_run_id(the_share, name, run))


def open_notebook(experiment: str, run: str, share: str | Share | None = None) -> NotebookLinks:
    """Show links that open or download a run's executed notebook (its path in text mode).

    Inside JupyterLab the links point at the Jupyter server that shows this notebook; when that
    server cannot reach the file (a remote share, a file outside its root) use :func:`download_files`.
    """
    links = notebook_links(experiment, run, share)
    if display.display_mode() == "widgets":
        from IPython.display import HTML, FileLink

        if links.path is not None and not links.open_url and _under_cwd(links.path):
            display.show(FileLink(os.path.relpath(links.path)))
        else:
            display.show(HTML(display.render_html("widget_open_notebook.html.j2", run=run, links=links)))
    else:
        print(links.text() or f"{run}: no executed notebook on this machine; use download_files()")
    return links


def _under_cwd(path: Path) -> bool:
    try:
        path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return False
    return True


def download_files(experiment: str, dest: str | os.PathLike[str] = "downloads", share: str | Share | None = None,
                   names: Sequence[str] | None = None) -> list[Path]:
    """Copy every run's files (or only ``names``, e.g. ``[OUTPUT_NOTEBOOK]``) to ``dest/<experiment>/<run>/``.

    Works for any share (a local folder or an Azure File share); returns the paths written.
    """
    name, the_share = api.open_experiment_share(experiment_name(experiment), share)
    written = fetch(the_share, name, Path(dest), tuple(names) if names else None)
    notebooks = [p for p in written if p.name == OUTPUT_NOTEBOOK]
    if display.display_mode() == "widgets" and notebooks:
        from IPython.display import FileLinks

        display.show(FileLinks(str(Path(dest) / name), included_suffixes=[".ipynb"], recursive=True))
    else:
        print(f"downloaded {len(written)} file(s) of {name} to {Path(dest) / name}")
    return written
