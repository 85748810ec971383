"""The Jupyter front: set up a backend, submit, watch and steer an experiment from a notebook.

The control notebook (``notebooks/ExploringBatchAI.ipynb``) calls the same helpers the 2018
deep_bait notebook did — :func:`setup_cluster`, :func:`submit_all`, :func:`print_jobs_summary`,
:func:`wait_for_job`, :func:`download_files` — but in JupyterLab they are live ipywidgets: a form
for the backend, a progress bar, a jobs table that refreshes itself until every run is final (with
cancel buttons and links to the executed notebooks), and a log that tails a run as it executes.

Everywhere else (a plain ``python`` process, papermill executing the control notebook in CI) the
same calls print plain text, like deep_bait's helpers did. :func:`display_mode` decides which.

The state lives in small pure classes (:class:`Cluster`, :class:`SubmissionModel`,
:class:`JobsSummaryModel`, :class:`SummaryRefresher`) that render HTML or text and need no browser;
the widget code only wraps them. ``ipywidgets`` (the ``widgets`` extra) is imported only when a
widget is built, so ``import nbbatch`` and ``import nbbatch.widgets`` stay light.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from nbbatch.errors import NbbatchError, SpecError
from nbbatch.results.status import KEY_METRICS, STATUS_STYLE, format_metric, status_rows
from nbbatch.store.layout import OUTPUT_NOTEBOOK
from nbbatch.store.runrecord import RunRecord

if TYPE_CHECKING:
    from nbbatch.api import SubmitResult
    from nbbatch.backends.base import Backend, Compute
    from nbbatch.spec.experiment import Experiment
    from nbbatch.store.share import Share

__all__ = [
    "Cluster", "setup_cluster",
    "SubmissionModel", "Submission", "submit_all",
    "JobsSummaryModel", "SummaryRefresher", "JobsSummary", "print_jobs_summary",
    "JobLog", "wait_for_job",
    "NotebookLinks", "notebook_links", "open_notebook", "download_files",
    "cancel_job", "cancel_all", "display_mode",
]

#: The parameters every framework notebook shares (DESIGN.md); ``submit_all(epochs=3)`` means ``EPOCHS=3``.
SHARED_PARAMETERS = ("EPOCHS", "N_CLASSES", "BATCHSIZE", "LR", "MOMENTUM", "GPU", "SEED", "DATASET", "DATA_DIR",
                     "MAX_SAMPLES")

#: Azure ML form fields: setting name → (label, default); the keys and defaults of the ``azureml`` backend's settings.
AZUREML_FIELDS: dict[str, tuple[str, Any]] = {
    "compute": ("cluster name", "nbbatch-gpu"),
    "vm_size": ("VM size", "Standard_NC4as_T4_v3"),
    "min_nodes": ("min nodes", 0),
    "max_nodes": ("max nodes", 2),
    "tier": ("priority", "dedicated"),
}
AZUREML_VM_SIZES = ("Standard_NC4as_T4_v3", "Standard_NC6s_v3", "Standard_NC24ads_A100_v4", "Standard_ND96asr_v4",
                    "Standard_D4s_v5")
AZUREML_TIERS = ("dedicated", "low_priority")

_STATUS_CSS_COLOURS = {"green": "#2e7d32", "red": "#c62828", "blue": "#1565c0", "yellow": "#a15c00",
                       "magenta": "#8e24aa", "cyan": "#00838f"}


# --------------------------------------------------------------------------------------------------
# where we are: a live frontend, or text


def display_mode() -> str:
    """``"widgets"`` inside a Jupyter kernel driven by an interactive frontend, else ``"text"``.

    Text is used in a plain Python process, when ipywidgets is missing, and when the cell was sent
    by a headless executor (papermill/nbclient send ``allow_stdin=False``, JupyterLab sends ``True``).
    ``NBBATCH_WIDGETS=0`` forces text, ``NBBATCH_WIDGETS=1`` forces widgets (inside a kernel).
    """
    forced = os.environ.get("NBBATCH_WIDGETS", "").strip().lower()
    if forced in ("0", "no", "false", "off", "text"):
        return "text"
    try:
        from IPython import get_ipython
    except ImportError:
        return "text"
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return "text"
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return "text"
    if forced in ("1", "yes", "true", "on", "widgets"):
        return "widgets"
    return "widgets" if _frontend_is_interactive(shell.kernel) else "text"


def _frontend_is_interactive(kernel: Any) -> bool:
    try:
        parent = kernel.get_parent("shell") if hasattr(kernel, "get_parent") else {}
        content = (parent or {}).get("content") or {}
        if "allow_stdin" in content:
            return bool(content["allow_stdin"])
    except Exception:  # noqa: BLE001 - a kernel without parent tracking: fall back to its flag
        pass
    return bool(getattr(kernel, "_allow_stdin", True))


def _display(obj: Any) -> None:
    from IPython.display import display

    display(obj)


class _WithText:
    """Display a widget with a plain-text snapshot as its ``text/plain`` (what viewers without widgets show)."""

    def __init__(self, widget: Any, text: Callable[[], str]):
        self.widget, self.text = widget, text

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        try:
            bundle["text/plain"] = self.text()
        except Exception:  # noqa: BLE001 - the widget matters more than its fallback
            pass
        return bundle


# --------------------------------------------------------------------------------------------------
# formatting helpers shared by the HTML and text renderings


def format_duration(seconds: float | None) -> str:
    """``4.2s``, ``3m 05s``, ``1h 02m``; empty for None."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def status_css(status: str) -> str:
    """Inline CSS for a status, derived from :data:`nbbatch.results.status.STATUS_STYLE` (the terminal's colours)."""
    parts = []
    for word in STATUS_STYLE.get(status, "").split():
        if word == "bold":
            parts.append("font-weight:600")
        elif word == "dim":
            parts.append("opacity:0.65")
        elif word in _STATUS_CSS_COLOURS:
            parts.append(f"color:{_STATUS_CSS_COLOURS[word]}")
    return ";".join(parts)


def _shown_metrics(metrics: dict[str, Any]) -> list[str]:
    shown = [k for k in KEY_METRICS if k in metrics]
    return shown or [k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)][:3]


def _text_table(header: Sequence[str], rows: Sequence[Sequence[str]], max_width: int = 48) -> str:
    """Columns padded to their widest cell; inner cells longer than ``max_width`` are cut (the first and last never)."""
    last = len(header) - 1
    cells = [[c if len(c) <= max_width or i in (0, last) else c[: max_width - 1] + "…" for i, c in enumerate(row)]
             for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# links to executed notebooks


@dataclass(frozen=True)
class NotebookLinks:
    """Where a run's executed notebook is: on this machine, and as URLs of the Jupyter server showing it."""

    path: Path | None  # the file, when the share is a local folder
    open_url: str | None = None  # opens it in JupyterLab (a path on the server: ``/lab/tree/...``)
    download_url: str | None = None  # downloads it (``/files/...?download=1``)

    def html(self) -> str:
        """``open · ⤓`` (download) links, or the file's name when no Jupyter server serves it."""
        if self.open_url:
            return (f'<a href="{html.escape(self.open_url)}" target="_blank" rel="noopener" title="open in JupyterLab">'
                    f'open</a> · <a href="{html.escape(self.download_url or "")}" download title="download">⤓</a>')
        if self.path is not None:
            return f'<code title="{html.escape(str(self.path))}">{html.escape(self.path.name)}</code>'
        return ""

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
        from jupyter_core.paths import jupyter_runtime_dir

        runtime = Path(jupyter_runtime_dir())
        for info_file in runtime.glob("jpserver-*.json"):
            try:
                info = json.loads(info_file.read_text())
                os.kill(int(info["pid"]), 0)
            except (ValueError, KeyError, OSError, TypeError):
                continue
            if info.get("root_dir") or info.get("notebook_dir"):
                servers.append(info)
    except Exception:  # noqa: BLE001 - no jupyter_core or no runtime dir: no links, paths instead
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


def _notebook_links_for(share: Share, experiment: str, run_id: str) -> NotebookLinks:
    local = share.local_path(f"{experiment}/{run_id}/{OUTPUT_NOTEBOOK}")
    if local is None or not local.exists():
        return NotebookLinks(None)
    urls = server_urls(local)
    return NotebookLinks(local, *(urls or (None, None)))


def notebook_links(experiment: str, run: str, share: str | Share | None = None) -> NotebookLinks:
    """The executed notebook of ``run`` (an id or a unique prefix) of ``experiment``, as a path and server URLs."""
    from nbbatch.api import open_experiment_share
    from nbbatch.results.status import resolve_run_id

    name, the_share = open_experiment_share(_experiment_name(experiment), share)
    return _notebook_links_for(the_share, name, resolve_run_id(the_share, name, run))


def open_notebook(experiment: str, run: str, share: str | Share | None = None) -> NotebookLinks:
    """Show links that open or download a run's executed notebook (its path in text mode).

    Inside JupyterLab the links point at the Jupyter server that shows this notebook; when that
    server cannot reach the file (a remote share, a file outside its root) use :func:`download_files`.
    """
    links = notebook_links(experiment, run, share)
    if display_mode() == "widgets":
        from IPython.display import HTML, FileLink

        if links.open_url:
            _display(HTML(f"{html.escape(run)}: {links.html()}"))
        elif links.path is not None and _under_cwd(links.path):
            _display(FileLink(os.path.relpath(links.path)))
        else:
            _display(HTML(f"{html.escape(run)}: {links.html() or 'no executed notebook on this machine'} "
                          "(use <code>download_files()</code> to copy it next to this notebook)"))
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
    """Copy every run's files (or only ``names``, e.g. ``["output.ipynb"]``) to ``dest/<experiment>/<run>/``.

    Works for any share (a local folder or an Azure File share); returns the paths written.
    """
    from nbbatch.api import open_experiment_share
    from nbbatch.store.fetch import fetch

    name, the_share = open_experiment_share(_experiment_name(experiment), share)
    written = fetch(the_share, name, Path(dest), tuple(names) if names else None)
    notebooks = [p for p in written if p.name == OUTPUT_NOTEBOOK]
    if display_mode() == "widgets" and notebooks:
        from IPython.display import FileLinks

        _display(FileLinks(str(Path(dest) / name), included_suffixes=[".ipynb"], recursive=True))
    else:
        print(f"downloaded {len(written)} file(s) of {name} to {Path(dest) / name}")
    return written


# --------------------------------------------------------------------------------------------------
# the cluster: which backend, with which settings


@dataclass
class Cluster:
    """Where :func:`submit_all` runs an experiment: a backend, its settings, and local scheduling knobs.

    ``settings`` become the experiment's ``backend_settings`` (e.g. the Azure ML cluster name);
    ``runs_per_gpu`` and ``max_parallel`` override the experiment's resources when set.
    """

    backend: str = "local"
    settings: dict[str, Any] = field(default_factory=dict)
    runs_per_gpu: int | None = None
    max_parallel: int | None = None

    def get_backend(self) -> Backend:
        """An instance of the backend, configured with :attr:`settings`."""
        from nbbatch.backends import get_backend

        return get_backend(self.backend, **self.settings)

    def compute(self) -> Compute:
        """What the backend has to run on (GPUs, nodes, slots, backend details)."""
        return self.get_backend().compute()

    def apply(self, experiment: Experiment) -> Experiment:
        """A copy of ``experiment`` that runs on this cluster."""
        keep = experiment.backend_settings if experiment.backend == self.backend else {}
        changes: dict[str, Any] = {"backend": self.backend, "backend_settings": {**keep, **self.settings}}
        if self.runs_per_gpu is not None:
            changes["runs_per_gpu"] = self.runs_per_gpu
        if self.max_parallel is not None:
            changes["max_parallel"] = self.max_parallel
        return dataclasses.replace(experiment, **changes)

    def provision(self, wait: bool = True) -> Compute:
        """Create the backend's cluster if missing and resize it to ``min_nodes``/``max_nodes``; return its compute.

        Only backends that manage a cluster (``azureml``: its ``cluster`` with ``create``/``scale``)
        have anything to do; for the others this is :meth:`compute`.
        """
        backend = self.get_backend()
        managed = getattr(backend, "cluster", None)
        if managed is None or not callable(getattr(managed, "create", None)):
            return backend.compute()
        status = managed.create(wait=wait)
        wanted = (self.settings.get("min_nodes"), self.settings.get("max_nodes"))
        current = (getattr(status, "min_nodes", None), getattr(status, "max_nodes", None))
        if getattr(status, "exists", False) and None not in wanted and current != wanted and hasattr(managed, "scale"):
            managed.scale(*wanted, wait=wait)
        return backend.compute()

    def delete(self) -> bool:
        """Delete the backend's cluster (``azureml``); return whether there was one to delete."""
        managed = getattr(self.get_backend(), "cluster", None)
        if managed is None or not callable(getattr(managed, "delete", None)):
            return False
        return bool(managed.delete())

    def describe(self, compute: Compute | None = None) -> str:
        """A few lines of text: the backend, its settings, its compute and how many runs execute at once."""
        lines = [f"backend: {self.backend}"]
        for key, value in self.settings.items():
            if _shown_setting(key, value):
                lines.append(f"  {key}: {value}")
        if compute is not None:
            if compute.backend == "local" or compute.gpus:
                gpus = ", ".join(f"{g.get('index', '?')}: {g.get('name', 'GPU')}" for g in compute.gpus) or "none"
                lines.append(f"  GPUs: {gpus}")
            summary = compute.details.get("summary")
            if isinstance(summary, str):
                lines.extend(f"  {line}" for line in summary.splitlines())
            else:
                for node in compute.nodes:
                    lines.append(f"  node {node.get('name', '?')}: {node.get('state', '')}, "
                                 f"{_blank(node.get('cpus'), '?')} CPUs, {_blank(node.get('gpus'), 0)} GPUs")
            for key, value in compute.details.items():
                if key != "summary" and not isinstance(value, list) and not (isinstance(value, dict) and key == "cluster"):
                    lines.append(f"  {key}: {_detail_text(value)}")
            lines.append(f"  runs at once: {self.concurrency(compute)}")
        if self.runs_per_gpu is not None:
            lines.append(f"  runs per GPU: {self.runs_per_gpu}")
        return "\n".join(lines)

    def concurrency(self, compute: Compute) -> int:
        """How many runs execute at once on ``compute`` with these settings."""
        if compute.gpus:
            capacity = len(compute.gpus) * (self.runs_per_gpu or 1)
        else:
            capacity = max(compute.slots, 1)
        return min(capacity, self.max_parallel) if self.max_parallel else capacity


def _secret(key: str) -> bool:
    return any(h in key.upper() for h in ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "SAS"))


def _shown_setting(key: str, value: Any) -> bool:
    """Settings worth showing: plain values (not clients or credentials), never secrets."""
    return not _secret(key) and (value is None or isinstance(value, (str, int, float, bool)))


def _blank(value: Any, default: Any = "") -> Any:
    return default if value is None else value


def _detail_text(value: Any) -> str:
    """A detail as text; a resources mapping (Ray's ``total``/``available``) as ``CPU 4, GPU 1, memory 7.5 GB``."""
    if not isinstance(value, dict):
        return str(value)
    parts = []
    for key, amount in value.items():
        if str(key).startswith("node:"):
            continue
        if "memory" in str(key) and isinstance(amount, (int, float)):
            parts.append(f"{key} {amount / 2**30:.1f} GB")
        else:
            parts.append(f"{key} {format_metric(amount)}")
    return ", ".join(parts)


def _html_table(css_class: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cell = "padding:1px 10px 1px 0;text-align:left"
    head = "".join(f"<th style='{cell}'>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='{cell}'>{html.escape(str(_blank(v)))}</td>" for v in row) + "</tr>"
                   for row in rows)
    return f"<table class='{css_class}' style='border-collapse:collapse;line-height:1.4'><tr>{head}</tr>{body}</table>"


def compute_html(compute: Compute, cluster: Cluster | None = None) -> str:
    """An HTML summary of a backend's compute: GPUs, nodes and backend details (an Azure ML cluster's state…)."""
    parts = []
    if compute.gpus:
        parts.append(_html_table("nbbatch-gpus", ("GPU", "name", "memory (MB)"),
                                 [(g.get("index"), g.get("name"), g.get("memory_mb")) for g in compute.gpus]))
    elif compute.backend == "local":
        parts.append("<div>no NVIDIA GPU found: runs use the CPU</div>")
    summary = compute.details.get("summary")
    if isinstance(summary, str):
        parts.append(f"<pre class='nbbatch-summary' style='margin:4px 0'>{html.escape(summary)}</pre>")
    elif compute.nodes:
        parts.append(_html_table("nbbatch-nodes", ("node", "state", "CPUs", "GPUs"),
                                 [(n.get("name"), n.get("state"), n.get("cpus"), n.get("gpus")) for n in compute.nodes]))
    items = "".join(f"<li><b>{html.escape(str(k))}</b>: {html.escape(_detail_text(v))}</li>"
                    for k, v in compute.details.items() if k != "summary" and not isinstance(v, list)
                    and not (isinstance(v, dict) and k == "cluster"))
    if items:
        parts.append(f"<ul class='nbbatch-details'>{items}</ul>")
    if cluster is not None:
        parts.append(f"<div>runs at once: <b>{cluster.concurrency(compute)}</b></div>")
    return "<div class='nbbatch-compute'>" + "".join(parts) + "</div>"


def setup_cluster(backend: str = "local", **settings: Any) -> Cluster:
    """Choose where runs execute; in JupyterLab show a form for the backend, elsewhere print what it has.

    * ``local``: the detected GPUs, runs per GPU and how many runs execute at once.
    * ``azureml``: cluster name, VM size, min/max nodes and priority (settings named as in
      :data:`AZUREML_FIELDS`), with a button that creates or resizes the cluster and its live
      provisioning state.
    * ``ray``: the cluster's address and the resources it reports.

    ``settings`` are the backend's settings (as in an experiment's ``backend:`` mapping), plus
    ``runs_per_gpu`` and ``max_parallel``. The returned :class:`Cluster` follows the form's values;
    pass it to :func:`submit_all`.
    """
    from nbbatch.backends import backend_names

    if backend not in backend_names():
        from nbbatch.errors import BackendError, did_you_mean

        raise BackendError(f"unknown backend `{backend}`{did_you_mean(backend, backend_names())}; "
                           f"known backends: {', '.join(backend_names())}")
    runs_per_gpu = settings.pop("runs_per_gpu", None)
    max_parallel = settings.pop("max_parallel", None)
    if backend == "azureml":
        for key, (_label, default) in AZUREML_FIELDS.items():
            settings.setdefault(key, default)
    cluster = Cluster(backend, settings, runs_per_gpu, max_parallel)
    if display_mode() != "widgets":
        try:
            compute = cluster.compute()
        except Exception as exc:  # noqa: BLE001 - an unreachable cluster is reported, not raised
            print(f"backend {backend}: {exc}")
            compute = None
        print(cluster.describe(compute))
        return cluster
    form = ClusterForm(cluster)
    _display(_WithText(form.widget, lambda: cluster.describe(form.compute)))
    form.start()
    return cluster


class ClusterForm:
    """The widget form behind :func:`setup_cluster`; edits :attr:`cluster` in place."""

    def __init__(self, cluster: Cluster, poll_s: float = 10.0):
        import ipywidgets as w

        self.cluster = cluster
        self.compute: Compute | None = None
        self.poll_s = poll_s
        self._stop = threading.Event()
        self.title = w.HTML(f"<b>nbbatch backend: {html.escape(cluster.backend)}</b>")
        self.state = w.HTML("<i>asking the backend what it has…</i>")
        self.message = w.HTML("")
        self.fields: dict[str, Any] = {}
        style = {"description_width": "140px"}
        controls: list[Any] = []
        if cluster.backend == "local":
            self.fields["runs_per_gpu"] = w.BoundedIntText(value=cluster.runs_per_gpu or 1, min=1, max=64,
                                                           description="runs per GPU", style=style)
            self.fields["max_parallel"] = w.BoundedIntText(value=cluster.max_parallel or (os.cpu_count() or 1), min=1,
                                                           max=1024, description="max parallel runs", style=style)
            controls = list(self.fields.values())
        elif cluster.backend == "azureml":
            for key, (label, default) in AZUREML_FIELDS.items():
                value = cluster.settings.get(key, default)
                if key == "vm_size":
                    self.fields[key] = w.Combobox(value=str(value), options=list(AZUREML_VM_SIZES), description=label,
                                                  ensure_option=False, style=style)
                elif key == "tier":
                    options = list(dict.fromkeys([*AZUREML_TIERS, str(value)]))
                    self.fields[key] = w.Dropdown(value=str(value), options=options, description=label, style=style)
                elif isinstance(default, int):
                    self.fields[key] = w.BoundedIntText(value=int(value), min=0, max=1000, description=label, style=style)
                else:
                    self.fields[key] = w.Text(value=str(value), description=label, style=style)
            others = {k: v for k, v in cluster.settings.items() if k not in AZUREML_FIELDS and _shown_setting(k, v)}
            if others:
                self.message.value = "<br>".join(f"{html.escape(k)}: <code>{html.escape(str(v))}</code>"
                                                 for k, v in others.items())
            self.apply_button = w.Button(description="Create / resize cluster", icon="cloud", button_style="primary")
            self.apply_button.on_click(lambda _b: self._in_thread(self._provision))
            controls = [*self.fields.values(), self.apply_button]
        else:  # ray and any registered backend: its plain settings, each as a field of its type
            if cluster.backend == "ray":
                cluster.settings.setdefault("address", "auto")
            for key, value in cluster.settings.items():
                if not _shown_setting(key, value):
                    continue
                if isinstance(value, bool):
                    self.fields[key] = w.Checkbox(value=value, description=key, style=style)
                elif isinstance(value, int):
                    self.fields[key] = w.IntText(value=value, description=key, style=style)
                elif isinstance(value, float):
                    self.fields[key] = w.FloatText(value=value, description=key, style=style)
                else:
                    self.fields[key] = w.Text(value="" if value is None else str(value), description=key, style=style)
            self.apply_button = w.Button(description="Connect", icon="plug", button_style="primary")
            self.apply_button.on_click(lambda _b: self._in_thread(self._refresh))
            controls = [*self.fields.values(), self.apply_button]
        for key, widget in self.fields.items():
            widget.observe(lambda change, key=key: self._changed(key, change["new"]), names="value")
        self.widget = w.VBox([self.title, *controls, self.state, self.message],
                             layout=w.Layout(border="1px solid var(--jp-border-color2, #ccc)", padding="6px"))
        self.widget.add_class("nbbatch-cluster")

    def _changed(self, key: str, value: Any) -> None:
        if key in ("runs_per_gpu", "max_parallel") and self.cluster.backend == "local":
            setattr(self.cluster, key, int(value))
        else:
            default = AZUREML_FIELDS.get(key, (None, None))[1] if self.cluster.backend == "azureml" else None
            self.cluster.settings[key] = int(value) if isinstance(default, int) else value
        if self.compute is not None:
            self.state.value = compute_html(self.compute, self.cluster)

    def _in_thread(self, target: Callable[[], None]) -> None:
        threading.Thread(target=target, name="nbbatch-cluster", daemon=True).start()

    def start(self) -> None:
        """Ask the backend for its compute (in the background); keep polling Azure ML while it provisions."""
        if self.cluster.backend == "local":
            self.cluster.runs_per_gpu = self.fields["runs_per_gpu"].value
            self.cluster.max_parallel = self.fields["max_parallel"].value
        self._in_thread(self._refresh)

    def stop(self) -> None:
        """Stop polling the backend."""
        self._stop.set()

    def _refresh(self) -> None:
        try:
            self.compute = self.cluster.compute()
        except Exception as exc:  # noqa: BLE001 - show it in the form, never a traceback in a thread
            self.state.value = f"<span style='{status_css('failed')}'>{html.escape(str(exc))}</span>"
            return
        if self.cluster.backend == "local":
            self.fields["runs_per_gpu"].disabled = not self.compute.gpus
            if self.compute.gpus and self.cluster.max_parallel == (os.cpu_count() or 1):
                self.fields["max_parallel"].value = len(self.compute.gpus) * (self.cluster.runs_per_gpu or 1)
        self.state.value = compute_html(self.compute, self.cluster)
        if self.cluster.backend == "azureml" and not self._stop.is_set() and _provisioning(self.compute):
            self._stop.wait(self.poll_s)
            if not self._stop.is_set():
                self._refresh()

    def _provision(self) -> None:
        self.apply_button.disabled = True
        self.message.value = "<i>creating or resizing the cluster…</i>"
        try:
            self.compute = self.cluster.provision(wait=False)
            self.message.value = html.escape(_unchangeable(self.compute, self.cluster))
        except Exception as exc:  # noqa: BLE001
            self.message.value = f"<span style='{status_css('failed')}'>{html.escape(str(exc))}</span>"
        finally:
            self.apply_button.disabled = False
        self._refresh()


def _unchangeable(compute: Compute, cluster: Cluster) -> str:
    """A note when an existing Azure ML cluster's VM size or tier differ from the form (only its nodes can change)."""
    status = compute.details.get("cluster")
    if not isinstance(status, dict) or not status.get("exists"):
        return ""
    differ = [f"{key} is {status[key]}" for key in ("vm_size", "tier")
              if status.get(key) and cluster.settings.get(key) and str(status[key]).lower() != str(cluster.settings[key]).lower()]
    if not differ:
        return ""
    return (f"cluster {status.get('name')} exists and its {' and its '.join(differ)}: only its node range changes; "
            "delete it (cluster.delete()) or choose another cluster name to change the others")


def _provisioning(compute: Compute) -> bool:
    """Whether a cluster is still changing (being created, updated, resized or deleted)."""
    details = dict(compute.details)
    if isinstance(details.get("cluster"), dict):  # the azureml backend's ClusterStatus
        details.update(details["cluster"])
    state = str(details.get("provisioning_state") or "").lower()
    allocation = str(details.get("allocation_state") or "").lower()
    return state in ("creating", "updating", "deleting") or allocation == "resizing"


# --------------------------------------------------------------------------------------------------
# submission


class SubmissionModel:
    """The state of one submission: planned runs, their records as they change, and the outcome."""

    def __init__(self, experiment: str):
        self.experiment = experiment
        self.state = "planning"  # planning | running | done | error
        self.run_ids: list[str] = []
        self.skipped: list[str] = []
        self.records: dict[str, RunRecord] = {}
        self.error: str | None = None
        self.result: SubmitResult | None = None
        self._lock = threading.Lock()

    def planned(self, run_ids: Iterable[str]) -> None:
        """The plan is known: these runs will be submitted (or skipped)."""
        with self._lock:
            self.run_ids = list(run_ids)
            self.state = "running"

    def update(self, record: RunRecord) -> None:
        """A run changed (what :func:`nbbatch.api.submit` reports through its ``progress`` callback)."""
        with self._lock:
            self.records[record.run_id] = record
            if record.run_id not in self.run_ids:
                self.run_ids.append(record.run_id)

    def finished(self, result: SubmitResult) -> None:
        """The submission returned."""
        with self._lock:
            self.result = result
            self.skipped = list(result.skipped)
            for record in result.records:
                self.records[record.run_id] = record
                if record.run_id not in self.run_ids:
                    self.run_ids.append(record.run_id)
            self.state = "done"

    def failed(self, error: BaseException) -> None:
        """The submission raised ``error`` (a plan error, a locked experiment…)."""
        with self._lock:
            self.error = str(error) if isinstance(error, NbbatchError) else f"{type(error).__name__}: {error}"
            self.state = "error"

    @property
    def total(self) -> int:
        """How many runs the submission covers (skipped ones included)."""
        return len(self.run_ids)

    def counts(self) -> dict[str, int]:
        """Runs per status (runs not reported yet count as ``queued``)."""
        with self._lock:
            counts: dict[str, int] = {}
            for run_id in self.run_ids:
                record = self.records.get(run_id)
                status = record.status if record else ("succeeded" if run_id in self.skipped else "queued")
                counts[status] = counts.get(status, 0) + 1
            return counts

    @property
    def finished_count(self) -> int:
        """Runs that are final (skipped ones count as succeeded)."""
        counts = self.counts()
        return sum(n for s, n in counts.items() if s not in ("queued", "running"))

    @property
    def active(self) -> bool:
        """Whether the submission is still planning or running."""
        return self.state in ("planning", "running")

    def bar_style(self) -> str:
        """The progress bar's style: ``success``, ``danger`` (a run failed), ``warning`` or ``info``."""
        counts = self.counts()
        if self.state == "error" or counts.get("failed") or counts.get("timed_out"):
            return "danger"
        if counts.get("cancelled"):
            return "warning"
        return "success" if self.state == "done" else "info"

    def label(self) -> str:
        """One line: what the submission is doing."""
        if self.state == "planning":
            return f"{self.experiment}: planning and validating…"
        if self.state == "error":
            return f"{self.experiment}: submission failed: {self.error}"
        counts = self.counts()
        detail = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        skipped = f" ({len(self.skipped)} skipped: already succeeded)" if self.skipped else ""
        verb = "done" if self.state == "done" else "running"
        return f"{self.experiment}: {verb}, {self.finished_count}/{self.total} finished — {detail}{skipped}"


_SUBMISSIONS: dict[str, Submission] = {}  # the latest submission of each experiment made in this process


class Submission:
    """A submission running in a background thread: what :func:`submit_all` returns."""

    def __init__(self, experiment: Experiment, force: bool = False, only: list[str] | None = None,
                 build_envs: bool = False):
        self.experiment = experiment
        self.force, self.only, self.build_envs = force, only, build_envs
        self.model = SubmissionModel(experiment.name)
        self.widget: Any = None
        self._planned = threading.Event()
        self._done = threading.Event()
        self._exception: BaseException | None = None
        self._render_lock = threading.Lock()
        self._printed: set[str] = set()
        self.thread = threading.Thread(target=self._work, name=f"nbbatch-submit-{experiment.name}", daemon=True)

    @property
    def name(self) -> str:
        """The experiment's name."""
        return self.experiment.name

    @property
    def share(self) -> str:
        """The share the runs write to."""
        return self.experiment.share

    @property
    def done(self) -> bool:
        """Whether the submission has returned (every run final, or an error)."""
        return self._done.is_set()

    def start(self) -> Submission:
        """Start the background thread (once)."""
        _SUBMISSIONS[self.name] = self
        self.thread.start()
        return self

    def _work(self) -> None:
        from nbbatch import api

        try:
            the_plan, _backend, _share = api.prepare(self.experiment, build_envs=self.build_envs, progress=False)
            runs = the_plan.runs
            if self.only:
                runs = [r for r in runs if any(r.run_id.startswith(o) for o in self.only)]
            self.model.planned(r.run_id for r in runs)
            self._planned.set()
            self._render()
            result = api.submit(self.experiment, force=self.force, build_envs=False, wait=True, progress=self._on_update,
                                only=self.only)
            self.model.finished(result)
        except BaseException as exc:  # noqa: BLE001 - shown in the widget and raised again by wait()
            self._exception = exc
            self.model.failed(exc)
        finally:
            self._planned.set()
            self._done.set()
            self._render(force=True)

    def _on_update(self, record: RunRecord) -> None:
        self.model.update(record)
        self._render()

    def _render(self, force: bool = False) -> None:
        if self.widget is None:
            return
        with self._render_lock:
            label, bar, details = self.widget.children
            bar.max = max(self.model.total, 1)
            bar.value = self.model.finished_count
            bar.bar_style = self.model.bar_style()
            text = html.escape(self.model.label())
            style = status_css("failed") if self.model.state == "error" else ""
            label.value = f"<span style='{style}'>{text}</span>"
            if self.model.state == "done" and self.model.result is not None:
                warnings = self.model.result.warnings
                details.value = "".join(f"<div>⚠ {html.escape(w)}</div>" for w in warnings[:5])

    def planned_runs(self, timeout: float | None = 300) -> list[str]:
        """The ids of the submitted runs, once planning is done (waits up to ``timeout`` seconds)."""
        self._planned.wait(timeout)
        if self._exception is not None and not self.model.run_ids:
            raise self._exception
        return list(self.model.run_ids)

    def wait(self, timeout: float | None = None, quiet: bool = False) -> SubmitResult | None:
        """Block until every run is final; return the :class:`~nbbatch.api.SubmitResult`.

        In text mode print one line per run as it ends (unless ``quiet``). Re-raises the
        submission's error (e.g. a parameter the notebook lacks). Returns None on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        text = self.widget is None and not quiet
        while not self._done.wait(0.5):
            if text:
                self._print_finished()
            if deadline is not None and time.monotonic() > deadline:
                return None
        if text:
            self._print_finished()
        if self._exception is not None:
            raise self._exception
        if text:
            print(self.model.label())
        return self.model.result

    def _print_finished(self) -> None:
        for run_id in list(self.model.run_ids):
            record = self.model.records.get(run_id)
            if record is None or not record.final or run_id in self._printed:
                continue
            self._printed.add(run_id)
            took = f" in {format_duration(record.duration_s)}" if record.duration_s else ""
            why = f" ({record.error.summary()})" if record.error else ""
            print(f"{run_id}: {record.status}{took}{why}", flush=True)

    def cancel(self, runs: Sequence[str] | None = None) -> list[str]:
        """Cancel runs of this submission (all unfinished ones by default)."""
        return cancel_all(self.name, share=self.share) if not runs else cancel_job(self.name, list(runs), self.share)

    def _ipython_display_(self) -> None:
        """Already shown by :func:`submit_all`: a cell ending with the call shows it once."""

    def __repr__(self) -> str:
        return f"<Submission {self.model.label()}>"


def _experiment_from(experiment: Any) -> Experiment:
    from nbbatch.spec.experiment import Experiment, load_experiment

    if isinstance(experiment, Submission):
        return experiment.experiment
    if isinstance(experiment, Experiment):
        return experiment
    if isinstance(experiment, dict):
        return Experiment.from_dict(experiment)
    return load_experiment(experiment)


def _apply_overrides(experiment: Experiment, overrides: dict[str, Any]) -> Experiment:
    if not overrides:
        return experiment
    known = {name.upper(): name for name in (*SHARED_PARAMETERS, *experiment.parameters)}
    swept = set()
    for kind in experiment.sweep.values():
        if isinstance(kind, dict):
            swept.update(k for k in kind if k not in ("seed", "samples", "n"))
    parameters = dict(experiment.parameters)
    for key, value in overrides.items():
        name = key if key in experiment.parameters else known.get(key.upper(), key)
        if name in swept:
            raise SpecError(f"`{key}` is swept in experiment `{experiment.name}`; change the sweep instead of "
                            "overriding it in submit_all()")
        parameters[name] = value
    return dataclasses.replace(experiment, parameters=parameters)


def submit_all(experiment: Any, cluster: Cluster | None = None, *, force: bool = False, only: list[str] | None = None,
               build_envs: bool = False, **overrides: Any) -> Submission:
    """Submit every run of an experiment in a background thread, with a progress bar; return at once.

    ``experiment`` is an :class:`~nbbatch.spec.Experiment`, an experiment YAML path or its dict.
    ``cluster`` (from :func:`setup_cluster`) picks the backend. ``overrides`` set notebook
    parameters for every run: ``epochs=10`` is ``EPOCHS=10`` (the shared parameters are matched
    without case, as deep_bait's ``submit_all(epochs=10)`` did). Runs that already succeeded are
    skipped unless ``force``. Call :meth:`Submission.wait` to block until every run is final.
    """
    spec = _apply_overrides(_experiment_from(experiment), overrides)
    if cluster is not None:
        spec = cluster.apply(spec)
    submission = Submission(spec, force=force, only=only, build_envs=build_envs)
    if display_mode() == "widgets":
        import ipywidgets as w

        label = w.HTML(html.escape(submission.model.label()))
        bar = w.IntProgress(value=0, min=0, max=1, bar_style="info", layout=w.Layout(width="60%"))
        details = w.HTML("")
        submission.widget = w.VBox([label, bar, details])
        submission.widget.add_class("nbbatch-submission")
        _display(_WithText(submission.widget, submission.model.label))
    else:
        print(f"submitting {spec.name} to the {spec.backend} backend (results in {spec.share})")
    return submission.start()


# --------------------------------------------------------------------------------------------------
# the jobs table


class JobsSummaryModel:
    """The runs of one experiment as the jobs table shows them; records go in, HTML or text comes out.

    :meth:`replace_all` and :meth:`update` take run records and remember every status transition;
    :attr:`all_final` says when there is nothing left to watch.
    """

    def __init__(self, experiment: str, expected: Iterable[str] = (),
                 links: Callable[[RunRecord], NotebookLinks] | None = None):
        self.experiment = experiment
        self.expected: list[str] = list(expected)
        self.records: dict[str, RunRecord] = {}
        self.transitions: list[tuple[str, str | None, str]] = []  # (run id, old status, new status)
        self.problems: list[str] = []
        self.message: str = ""
        self.links = links
        self._lock = threading.RLock()

    def expect(self, run_ids: Iterable[str]) -> None:
        """Runs that will appear (a submission's plan): the table is not final until they are."""
        with self._lock:
            for run_id in run_ids:
                if run_id not in self.expected:
                    self.expected.append(run_id)

    def update(self, record: RunRecord) -> bool:
        """Take one record; return whether anything shown changed."""
        with self._lock:
            old = self.records.get(record.run_id)
            if old is not None and old.to_dict() == record.to_dict():
                return False
            if old is None or old.status != record.status:
                self.transitions.append((record.run_id, old.status if old else None, record.status))
            self.records[record.run_id] = record
            return True

    def replace_all(self, records: Iterable[RunRecord]) -> bool:
        """Take the experiment's current records (runs not among them are kept); return whether anything changed."""
        changed = False
        for record in records:
            changed = self.update(record) or changed
        return changed

    @property
    def missing(self) -> list[str]:
        """Expected runs without a record yet."""
        with self._lock:
            return [r for r in self.expected if r not in self.records]

    @property
    def active(self) -> list[str]:
        """Runs not final yet (queued, running, or expected but not recorded)."""
        with self._lock:
            return [r.run_id for r in self.records.values() if not r.final] + self.missing

    @property
    def all_final(self) -> bool:
        """Whether there are runs and every one of them (and every expected one) is final."""
        with self._lock:
            return bool(self.records) and not self.active

    def counts(self) -> dict[str, int]:
        """Runs per status (expected runs without a record count as queued)."""
        with self._lock:
            counts: dict[str, int] = {}
            for record in self.records.values():
                counts[record.status] = counts.get(record.status, 0) + 1
            if self.missing:
                counts["queued"] = counts.get("queued", 0) + len(self.missing)
            return counts

    def headline(self) -> str:
        """``exploring: 3 runs — 1 running, 2 succeeded``."""
        counts = self.counts()
        total = sum(counts.values())
        detail = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no runs yet"
        return f"{self.experiment}: {total} run{'s' if total != 1 else ''} — {detail}"

    def varying_parameters(self) -> list[str]:
        """Parameter names whose values differ between runs (what tells the runs apart)."""
        with self._lock:
            records = list(self.records.values())
        names: list[str] = []
        for record in records:
            names.extend(k for k in record.parameters if k not in names)
        return [n for n in names
                if len({json.dumps(r.parameters.get(n), sort_keys=True, default=str) for r in records}) > 1]

    def rows(self, now: datetime | None = None) -> list[dict[str, Any]]:
        """One dict per run (and per expected run without a record), ready to render."""
        now = now or datetime.now(timezone.utc)
        with self._lock:
            records = list(self.records.values())
            missing = self.missing
        varying = self.varying_parameters()
        rows = []
        by_id = {r.run_id: r for r in records}
        for row in status_rows(records):
            record = by_id[row["run_id"]]
            params = row["parameters"]
            names = varying or list(params)[:4]
            row["parameters_shown"] = ", ".join(f"{k}={format_metric(params[k])}" for k in names if k in params)
            row["parameters_all"] = ", ".join(f"{k}={format_metric(v)}" for k, v in params.items())
            metrics = row["metrics"]
            row["metrics_shown"] = ", ".join(f"{k}={format_metric(metrics[k])}" for k in _shown_metrics(metrics))
            duration = row["duration_s"]
            if record.status == "running" and duration is None:
                started = _parse_time(record.started_at)
                duration = (now - started).total_seconds() if started else None
                row["duration_text"] = format_duration(duration) + "…" if duration is not None else ""
            else:
                row["duration_text"] = format_duration(duration)
            row["gpu_text"] = ",".join(map(str, row["gpu_ids"])) or "cpu"
            row["links"] = self.links(record) if self.links and record.status != "queued" else NotebookLinks(None)
            rows.append(row)
        for run_id in missing:
            rows.append({"run_id": run_id, "framework": "", "parameters": {}, "status": "queued", "attempts": 0,
                         "progress": "", "duration_s": None, "gpu_ids": [], "metrics": {}, "error": "",
                         "parameters_shown": "", "parameters_all": "", "metrics_shown": "", "duration_text": "",
                         "gpu_text": "", "links": NotebookLinks(None)})
        return rows

    COLUMNS = ("run", "framework", "parameters", "status", "try", "duration", "GPU", "metrics", "notebook")

    def to_text(self, now: datetime | None = None) -> str:
        """The table as plain text (what a terminal or papermill's output shows)."""
        rows = self.rows(now)
        body = []
        for row in rows:
            status = row["status"] + (f" {row['progress']}" if row["progress"] else "")
            body.append([row["run_id"], str(row["framework"]), row["parameters_shown"], status, str(row["attempts"]),
                         row["duration_text"], row["gpu_text"], row["metrics_shown"], row["links"].text()])
        lines = [self.headline()]
        if body:
            lines.append(_text_table(self.COLUMNS, body))
        errors = [f"  {row['run_id']}: {row['error']}" for row in rows if row["error"]]
        if errors:
            lines += ["errors:", *errors]
        if self.message:
            lines.append(self.message)
        lines += [f"warning: {p}" for p in self.problems]
        return "\n".join(lines)

    def to_html(self, now: datetime | None = None) -> str:
        """The table as HTML: one ``<tr data-run=… data-status=…>`` per run, status in colour, notebook links."""
        rows = self.rows(now)
        head = "".join(f"<th style='text-align:left;padding:2px 6px'>{c}</th>" for c in self.COLUMNS)
        cell = "<td style='padding:2px 6px;vertical-align:top{nowrap}'{extra}>{text}</td>"
        nowrap = ";white-space:nowrap"
        body = []
        for row in rows:
            status = row["status"]
            shown = html.escape(status + (f" {row['progress']}" if row["progress"] else ""))
            error = html.escape(row["error"])
            status_html = f"<span class='nbbatch-status' style='{status_css(status)}'>{shown}</span>"
            if error and status in ("failed", "timed_out"):  # a cancel's reason stays in the tooltip
                status_html += (f"<div style='font-size:90%;white-space:normal;max-width:28em;{status_css('failed')}'>"
                                f"{html.escape(row['error'][:160])}</div>")
            cells = [
                cell.format(nowrap=nowrap, extra="", text=f"<code>{html.escape(row['run_id'])}</code>"),
                cell.format(nowrap=nowrap, extra="", text=html.escape(str(row["framework"]))),
                cell.format(nowrap="", extra=f" title='{html.escape(row['parameters_all'])}'",
                            text=html.escape(row["parameters_shown"])),
                cell.format(nowrap=nowrap, extra=f" title='{error}'" if error else "", text=status_html),
                cell.format(nowrap=nowrap, extra="", text=str(row["attempts"])),
                cell.format(nowrap=nowrap, extra="", text=html.escape(row["duration_text"])),
                cell.format(nowrap=nowrap, extra="", text=html.escape(row["gpu_text"])),
                cell.format(nowrap=";min-width:10em;max-width:18em", extra="", text=html.escape(row["metrics_shown"])),
                cell.format(nowrap=nowrap, extra="", text=row["links"].html()),
            ]
            body.append(f"<tr data-run='{html.escape(row['run_id'])}' data-status='{html.escape(status)}' "
                        f"style='border-top:1px solid var(--jp-border-color2, #ddd)'>{''.join(cells)}</tr>")
        if not body:
            body.append(f"<tr><td colspan='{len(self.COLUMNS)}' style='padding:2px 8px'><i>no runs yet</i></td></tr>")
        extra = ""
        if self.message:
            extra += f"<div class='nbbatch-message'>{html.escape(self.message)}</div>"
        extra += "".join(f"<div class='nbbatch-problem' style='{status_css('failed')}'>{html.escape(p)}</div>"
                         for p in self.problems)
        state = "final" if self.all_final else "live"
        return (f"<div class='nbbatch-jobs' data-experiment='{html.escape(self.experiment)}' data-state='{state}' "
                f"style='line-height:1.4;overflow-x:auto'>"
                f"<div style='font-weight:600;margin-bottom:4px'>{html.escape(self.headline())}</div>"
                f"<table class='nbbatch-jobs-table' style='border-collapse:collapse;font-size:var(--jp-ui-font-size1, 13px)'>"
                f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{extra}</div>")


class SummaryRefresher:
    """Polls an experiment's records into a :class:`JobsSummaryModel` until every run is final.

    ``load`` returns the current records (it may raise :class:`NbbatchError`, shown as the
    model's message); ``render`` is called after each poll that changed something, and every poll
    while a run is running (its duration grows). ``keep_going`` says that more runs may still
    appear (a submission still planning). With nothing to show and nothing in flight the
    refresher gives up after ``idle_timeout`` seconds.
    """

    def __init__(self, model: JobsSummaryModel, load: Callable[[], list[RunRecord]],
                 render: Callable[[JobsSummaryModel], None], interval: float = 1.0,
                 keep_going: Callable[[], bool] | None = None, idle_timeout: float = 30.0):
        self.model, self.load, self.render = model, load, render
        self.interval, self.idle_timeout = interval, idle_timeout
        self.keep_going = keep_going or (lambda: False)
        self.polls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle_since = time.monotonic()

    def poll_once(self) -> bool:
        """Load, update, render; return whether to keep polling."""
        self.polls += 1
        try:
            records = self.load()
            changed = self.model.replace_all(records)
            if self.model.message:
                self.model.message, changed = "", True
        except NbbatchError as exc:
            changed = self.model.message != str(exc)
            self.model.message = str(exc)
        running = any(r.status == "running" for r in self.model.records.values())
        more = self.keep_going()
        if changed or running or self.polls == 1:
            self.render(self.model)
        if self.model.all_final and not more:
            return False
        if self.model.records or more:
            self._idle_since = time.monotonic()
            return True
        return time.monotonic() - self._idle_since < self.idle_timeout

    def run(self) -> None:
        """Poll until final or :meth:`stop` (blocking); render once more at the end."""
        while not self._stop.is_set():
            try:
                again = self.poll_once()
            except Exception as exc:  # noqa: BLE001 - a broken share must not kill the thread silently
                self.model.message = f"stopped refreshing: {type(exc).__name__}: {exc}"
                again = False
            if not again:
                break
            self._stop.wait(self.interval)
        self.render(self.model)

    def start(self) -> SummaryRefresher:
        """Poll in a daemon thread."""
        self._thread = threading.Thread(target=self.run, name=f"nbbatch-summary-{self.model.experiment}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (the table keeps its last state)."""
        self._stop.set()

    @property
    def running(self) -> bool:
        """Whether the polling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; return whether it did."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running


_REFRESHERS: dict[str, SummaryRefresher] = {}


def _experiment_name(experiment: Any) -> str:
    if isinstance(experiment, Submission):
        return experiment.name
    if isinstance(experiment, str):
        return experiment
    return _experiment_from(experiment).name


def _resolve(experiment: Any, share: str | Share | None) -> tuple[str, Share, Submission | None]:
    """The experiment's name, share and (when this process submitted it) its submission."""
    from nbbatch.api import open_experiment_share
    from nbbatch.store.share import open_share

    submission = experiment if isinstance(experiment, Submission) else None
    if submission is None and not isinstance(experiment, str):
        spec = _experiment_from(experiment)
        return spec.name, open_share(share or spec.share), _SUBMISSIONS.get(spec.name)
    if submission is not None:
        return submission.name, open_share(share or submission.share), submission
    name = experiment
    submission = _SUBMISSIONS.get(name)
    if submission is not None and not share:
        return name, open_share(submission.share), submission
    name, the_share = open_experiment_share(name, share)
    return name, the_share, _SUBMISSIONS.get(name)


class JobsSummary:
    """A jobs table: the model, its widget (in JupyterLab) and the thread refreshing it."""

    def __init__(self, model: JobsSummaryModel, share: Share, submission: Submission | None = None,
                 backend_refresh_s: float = 15.0):
        self.model, self.share, self.submission = model, share, submission
        self.widget: Any = None
        self.refresher: SummaryRefresher | None = None
        self.backend_refresh_s = backend_refresh_s
        self._backend_refreshed = time.monotonic()
        self._buttons: dict[str, Any] = {}
        self._lock = threading.Lock()

    def load(self) -> list[RunRecord]:
        """The experiment's records from the share (corrupt ones become the model's problems).

        Every ``backend_refresh_s`` seconds the backend first brings them up to date with its own
        view (:func:`nbbatch.api.status`), e.g. a job Azure ML failed to start, or a run whose
        driver process died.
        """
        from nbbatch.store.records import load_records

        if self.submission is not None:
            self.model.expect(self.submission.model.run_ids)
        records, problems = load_records(self.share, self.model.experiment)
        if records and not problems and time.monotonic() - self._backend_refreshed > self.backend_refresh_s:
            from nbbatch import api

            self._backend_refreshed = time.monotonic()
            records = api.status(self.model.experiment, share=self.share, refresh=True)
        self.model.problems = problems
        if self.model.expected:
            wanted = set(self.model.expected)
            records = [r for r in records if r.run_id in wanted]
        return records

    def text(self) -> str:
        """The table as text."""
        return self.model.to_text()

    def build_widget(self) -> Any:
        """The ipywidgets view: headline + table (one HTML widget), cancel buttons, messages."""
        import ipywidgets as w

        self.table = w.HTML(self.model.to_html())
        self.cancel_all_button = w.Button(description="Cancel all", icon="stop", button_style="danger",
                                          tooltip="cancel every unfinished run of this experiment")
        self.cancel_all_button.on_click(lambda _b: self._cancel(None))
        self.actions = w.HBox([self.cancel_all_button], layout=w.Layout(flex_flow="row wrap"))
        self.notice = w.HTML("")
        self.widget = w.VBox([self.table, self.actions, self.notice])
        self.widget.add_class("nbbatch-jobs-summary")
        self.render(self.model)
        return self.widget

    def render(self, model: JobsSummaryModel) -> None:
        """Refresh the widget from the model (called by the refresher's thread)."""
        if self.widget is None:
            return
        import ipywidgets as w

        with self._lock:
            self.table.value = model.to_html()
            active = [r for r in model.active if r in model.records]
            for run_id in active:
                if run_id not in self._buttons:
                    button = w.Button(description=f"Cancel {run_id}", icon="times", tooltip=f"cancel run {run_id}",
                                      layout=w.Layout(width="auto"))
                    button.on_click(lambda _b, run_id=run_id: self._cancel([run_id]))
                    self._buttons[run_id] = button
            children = [self.cancel_all_button, *(self._buttons[r] for r in active)]
            if tuple(children) != tuple(self.actions.children):
                self.actions.children = children
            self.cancel_all_button.disabled = not model.active
            self.actions.layout.display = "none" if model.all_final else "flex"

    def _cancel(self, runs: list[str] | None) -> None:
        try:
            asked = cancel_job(self.model.experiment, runs, self.share) if runs else cancel_all(self.model.experiment,
                                                                                               self.share)
            self.notice.value = html.escape(f"asked to stop: {', '.join(asked)}" if asked else "nothing left to cancel")
        except NbbatchError as exc:
            self.notice.value = f"<span style='{status_css('failed')}'>{html.escape(str(exc))}</span>"

    def start(self, interval: float | None = None) -> None:
        """Refresh in the background until every run is final."""
        if interval is None:
            interval = 1.0 if self.share.local_path("") is not None else 5.0
        previous = _REFRESHERS.get(self.model.experiment)
        if previous is not None:
            previous.stop()
        submission = self.submission

        def keep_going() -> bool:
            return submission is not None and submission.model.active

        self.refresher = SummaryRefresher(self.model, self.load, self.render, interval, keep_going).start()
        _REFRESHERS[self.model.experiment] = self.refresher

    def stop(self) -> None:
        """Stop refreshing."""
        if self.refresher is not None:
            self.refresher.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the refresher stopped (every run final); return whether it did."""
        return self.refresher.join(timeout) if self.refresher is not None else True

    def show(self) -> None:
        """Display the table again (the live widget in JupyterLab, the text elsewhere)."""
        if self.widget is not None:
            _display(_WithText(self.widget, self.model.to_text))
        else:
            print(self.model.to_text())

    def _ipython_display_(self) -> None:
        """Already shown by :func:`print_jobs_summary`: a cell ending with the call shows it once."""

    def __repr__(self) -> str:
        return f"<JobsSummary {self.model.headline()}>"


def print_jobs_summary(experiment: Any, share: str | Share | None = None, interval: float | None = None) -> JobsSummary:
    """Show every run of an experiment: framework, parameters, status, attempt, duration, GPU, metrics, notebook.

    In JupyterLab: a table that refreshes itself while runs are active and stops when all are
    final, with cancel buttons (per run and all) and links that open each executed notebook.
    Elsewhere: the table printed once as text. ``experiment`` is a name known to this project,
    an experiment file, an :class:`~nbbatch.spec.Experiment` or the :class:`Submission` from
    :func:`submit_all`; ``share`` overrides where its results are.
    """
    name, the_share, submission = _resolve(experiment, share)
    model = JobsSummaryModel(name, links=lambda r: _notebook_links_for(the_share, name, r.run_id))
    summary = JobsSummary(model, the_share, submission)
    try:
        model.replace_all(summary.load())
    except NbbatchError as exc:
        model.message = str(exc)
    if not model.records and not (submission and submission.model.active):
        model.message = model.message or (f"experiment `{name}` has no runs in {the_share.url} yet; "
                                          "submit it with submit_all()")
    if display_mode() != "widgets":
        print(model.to_text())
        return summary
    _display(_WithText(summary.build_widget(), model.to_text))
    if not model.all_final or (submission and submission.model.active):
        summary.start(interval)
    return summary


# --------------------------------------------------------------------------------------------------
# one run's log


class JobLog:
    """A run's log as it grows (what :func:`wait_for_job` shows); keeps the last ``max_chars`` characters."""

    def __init__(self, experiment: str, run: str, share: Share, max_chars: int = 100_000):
        self.experiment, self.run, self.share = experiment, run, share
        self.run_id: str | None = None
        self.text = ""
        self.record: RunRecord | None = None
        self.max_chars = max_chars
        self.widget: Any = None
        self.done = threading.Event()
        self.error: str | None = None
        self._last_push = 0.0
        self._lock = threading.Lock()

    def resolve(self, submission: Submission | None, timeout: float = 60.0) -> str:
        """The full run id of :attr:`run`; waits (up to ``timeout`` s) while a submission of this experiment is active."""
        from nbbatch.results.status import resolve_run_id

        deadline = time.monotonic() + timeout
        while True:
            try:
                self.run_id = resolve_run_id(self.share, self.experiment, self.run)
                return self.run_id
            except NbbatchError:
                waiting = submission is not None and submission.model.active
                if not waiting or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def append(self, chunk: str) -> None:
        """Add log text (and show it, at most four times a second)."""
        with self._lock:
            self.text = (self.text + chunk)[-self.max_chars:]
        if time.monotonic() - self._last_push > 0.25:
            self.push()

    def push(self) -> None:
        """Send the log's text to the Output widget."""
        if self.widget is None:
            return
        with self._lock:
            header, output = self.widget.children
            output.outputs = ({"output_type": "stream", "name": "stdout", "text": self.text},)
            self._last_push = time.monotonic()
            header.value = self.header_html()

    def header_html(self) -> str:
        """The run id, its status and a link to its executed notebook."""
        run = html.escape(self.run_id or self.run)
        if self.error:
            return f"<b>{run}</b>: <span style='{status_css('failed')}'>{html.escape(self.error)}</span>"
        if self.record is None:
            return f"<b>{run}</b>: <span style='{status_css('running')}'>following the log…</span>"
        status = self.record.status
        took = f" in {format_duration(self.record.duration_s)}" if self.record.duration_s else ""
        why = f" — {html.escape(self.record.error.summary())}" if self.record.error else ""
        links = _notebook_links_for(self.share, self.experiment, self.record.run_id).html()
        return (f"<b>{run}</b>: <span class='nbbatch-status' data-status='{status}' style='{status_css(status)}'>"
                f"{status}</span>{took}{why} {links}")

    def _ipython_display_(self) -> None:
        """Already shown by :func:`wait_for_job`: a cell ending with the call shows it once."""

    def __repr__(self) -> str:
        status = self.record.status if self.record else ("error" if self.error else "following")
        return f"<JobLog {self.run_id or self.run}: {status}>"

    def follow(self, submission: Submission | None, on_chunk: Callable[[str], None]) -> RunRecord | None:
        """Resolve the run, stream its log to ``on_chunk`` until it is final; return its final record."""
        from nbbatch import api
        from nbbatch.store.records import read_record

        try:
            run_id = self.resolve(submission)
            for chunk in api.logs(self.experiment, run_id, follow=True, share=self.share):
                on_chunk(chunk)
            self.record = read_record(self.share, self.experiment, run_id)
        except NbbatchError as exc:
            self.error = str(exc)
        finally:
            self.done.set()
        return self.record


def wait_for_job(experiment: Any, run: str, share: str | Share | None = None, block: bool = True,
                 timeout: float | None = None) -> JobLog:
    """Follow one run's log until it ends; ``run`` is a run id or a unique prefix (``"pytorch"``).

    In JupyterLab the log streams into an Output widget under a status line that ends with a link
    to the executed notebook; elsewhere it is printed. ``block=False`` returns at once (JupyterLab
    keeps streaming in the background, so the notebook stays usable and buttons keep working).
    """
    name, the_share, submission = _resolve(experiment, share)
    job = JobLog(name, run, the_share)
    if display_mode() != "widgets":
        def write(chunk: str) -> None:
            sys.stdout.write(chunk)
            sys.stdout.flush()

        if block:
            record = job.follow(submission, write)
            if job.error:
                print(job.error)
            elif record is not None:
                took = f" in {format_duration(record.duration_s)}" if record.duration_s else ""
                print(f"{record.run_id}: {record.status}{took}")
                if submission is not None:
                    submission._printed.add(record.run_id)  # Submission.wait() need not say it again
        else:
            from nbbatch.results.status import read_log

            try:
                print(read_log(the_share, name, job.resolve(submission, timeout=0), tail=20))
            except NbbatchError as exc:
                print(exc)
        return job
    import ipywidgets as w

    header = w.HTML(job.header_html())
    output = w.Output(layout=w.Layout(max_height="320px", overflow="auto",
                                      border="1px solid var(--jp-border-color2, #ddd)"))
    job.widget = w.VBox([header, output])
    job.widget.add_class("nbbatch-job-log")
    _display(_WithText(job.widget, lambda: f"{job.run_id or run}: log of a run (live in JupyterLab)"))

    def follow() -> None:
        job.follow(submission, job.append)
        job.push()

    thread = threading.Thread(target=follow, name=f"nbbatch-log-{run}", daemon=True)
    thread.start()
    if block:
        job.done.wait(timeout)
    return job


# --------------------------------------------------------------------------------------------------
# cancelling


def cancel_job(experiment: Any, runs: str | Sequence[str], share: str | Share | None = None) -> list[str]:
    """Cancel one run (or several): they end as ``cancelled`` with their partial output; return those asked."""
    from nbbatch import api

    name, the_share, _ = _resolve(experiment, share)
    return api.cancel(name, [runs] if isinstance(runs, str) else list(runs), share=the_share)


def cancel_all(experiment: Any, share: str | Share | None = None) -> list[str]:
    """Cancel every unfinished run of an experiment (deep_bait's ``delete_all_jobs``); return those asked.

    The unfinished runs are named one by one (every backend cancels named runs the same way).
    """
    from nbbatch import api
    from nbbatch.store.records import load_records

    name, the_share, _ = _resolve(experiment, share)
    records, _problems = load_records(the_share, name)
    unfinished = [r.run_id for r in records if not r.final]
    return api.cancel(name, unfinished, share=the_share) if unfinished else []
