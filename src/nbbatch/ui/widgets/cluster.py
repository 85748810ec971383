"""Where runs execute: a backend with its settings (:class:`Cluster`), and the form that sets it up.

Nothing here knows a backend by name: the form follows the backend's
:class:`~nbbatch.backends.base.Capabilities` and its labelled settings
(:meth:`~nbbatch.backends.base.Backend.form_settings`, with their defaults, choices and suggestions).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import nbbatch.ui.widgets.display as display
from nbbatch.backends import Backend, Capabilities, Compute, Setting, backend_class, backend_names, get_backend
from nbbatch.backends.base import parallel_limit
from nbbatch.errors import BackendError
from nbbatch.redact import is_secret
from nbbatch.results.status import format_metric
from nbbatch.spec.resources import AUTO, auto_cap

if TYPE_CHECKING:
    from nbbatch.spec.experiment import Experiment


def _backend_class(name: str) -> Any:
    """The backend's class, or None when it cannot load (its extra is missing: its compute() says so)."""
    try:
        return backend_class(name)
    except BackendError:
        return None


def capabilities(backend: str) -> Capabilities:
    """What the backend called ``backend`` can do (the defaults for a registered factory, or one that cannot load)."""
    return getattr(_backend_class(backend), "capabilities", None) or Capabilities()


def form_settings(backend: str) -> dict[str, Setting]:
    """The backend's settings a form shows (those with a label), by name."""
    return getattr(_backend_class(backend), "form_settings", dict)()


@dataclass
class Cluster:
    """Where :func:`submit_all` runs an experiment: a backend, its settings, and local scheduling knobs.

    ``settings`` become the experiment's ``backend_settings`` (e.g. the Azure ML cluster name);
    ``runs_per_gpu`` and ``max_parallel`` override the experiment's resources when set.
    """

    backend: str = "local"
    settings: dict[str, Any] = field(default_factory=dict)
    runs_per_gpu: int | str | None = None  # a number, or "auto" (packed by memory)
    max_parallel: int | None = None
    note: str = field(default="", init=False, repr=False, compare=False)  # what the last provision could not change

    def get_backend(self) -> Backend:
        """An instance of the backend, configured with :attr:`settings`."""
        return get_backend(self.backend, **self.settings)

    def compute(self) -> Compute:
        """What the backend has to run on (GPUs, nodes, slots, backend details)."""
        return self.get_backend().compute()

    def apply(self, experiment: Experiment) -> Experiment:
        """A copy of ``experiment`` that runs on this cluster."""
        keep = experiment.backend_settings if experiment.backend == self.backend else {}
        changes: dict[str, Any] = {"backend": self.backend, "backend_settings": {**keep, **self.settings}}
        scheduling = {key: value for key, value in (("runs_per_gpu", self.runs_per_gpu), ("max_parallel", self.max_parallel))
                      if value is not None}
        changes["resources"] = dataclasses.replace(experiment.resources, **scheduling)
        return dataclasses.replace(experiment, **changes)

    def provision(self, wait: bool = True) -> Compute:
        """Create the backend's cluster if missing, else resize its node range to the settings; return its compute.

        Only backends that manage a cluster (:attr:`Capabilities.managed_cluster`: their ``cluster``, a
        :class:`~nbbatch.backends.cluster.ManagedCluster`) have anything to do; for the others this is :meth:`compute`.
        :attr:`note` says what an existing cluster could not change (its VM size…).
        """
        backend = self.get_backend()
        if capabilities(self.backend).managed_cluster:
            self.note = backend.cluster.provision(wait=wait)
        return backend.compute()

    def delete(self) -> bool:
        """Delete the backend's cluster (a managed cluster's); return whether there was one to delete."""
        if not capabilities(self.backend).managed_cluster:
            return False
        return bool(self.get_backend().cluster.delete())

    def describe(self, compute: Compute | None = None) -> str:
        """A few lines of text: the backend, its settings, its compute and how many runs execute at once."""
        lines = [f"backend: {self.backend}"]
        lines += [f"  {key}: {value}" for key, value in self.settings.items() if _shown_setting(key, value)]
        if compute is not None:
            if compute.gpus or capabilities(compute.backend).gpu_slots:
                gpus = ", ".join(f"{_gpu_place(g)}: {g.get('name', 'GPU')}" for g in compute.gpus) or "none"
                lines.append(f"  GPUs: {gpus}")
            summary = compute.details.get("summary")
            if isinstance(summary, str):
                lines.extend(f"  {line}" for line in summary.splitlines())
            else:
                for node in compute.nodes:
                    lines.append(f"  node {node.get('name', '?')}: {node.get('state', '')}, "
                                 f"{_blank(node.get('cpus'), '?')} CPUs, {_blank(node.get('gpus'), 0)} GPUs")
            lines += [f"  {key}: {text}" for key, text in _details(compute)]
            lines.append(f"  runs at once: {self.concurrency(compute)}")
        if self.runs_per_gpu is not None:
            lines.append(f"  runs per GPU: {self.runs_per_gpu}")
        return "\n".join(lines)

    def concurrency(self, compute: Compute) -> int:
        """How many runs execute at once on ``compute`` with these settings."""
        if compute.gpus:
            per_gpu = self.runs_per_gpu or 1
            if per_gpu == AUTO:  # at most: how many fit depends on each run's memory
                per_gpu = auto_cap(len(compute.gpus), max((n.get("cpus") or 0 for n in compute.nodes), default=0) or None)
            capacity = len(compute.gpus) * int(per_gpu)
        else:
            capacity = max(compute.slots, 1)
        limit = parallel_limit(self.max_parallel, self.settings.get("max_parallel"))  # the form's, not validated yet
        return min(capacity, limit) if limit else capacity


def _knob(key: str, value: Any) -> int | str:
    """A form field's value as the cluster takes it: runs per GPU ``auto`` (or 0) is ``auto``."""
    return AUTO if key == "runs_per_gpu" and value in (AUTO, 0, "0") else int(value)


RUNS_PER_GPU_CHOICES: tuple[int | str, ...] = (AUTO, 1, 2, 3, 4, 6, 8)  # the form's dropdown (a value given is added)


def _shown_setting(key: str, value: Any) -> bool:
    """Settings worth showing: plain values (not clients or credentials), never secrets."""
    return not is_secret(key, value) and (value is None or isinstance(value, (str, int, float, bool)))


def _gpu_place(gpu: dict[str, Any]) -> str:
    """A GPU's index, with its node where the compute spans several (a Slurm or Ray cluster's ``node1/0``)."""
    return f"{gpu['node']}/{gpu.get('index', '?')}" if gpu.get("node") else str(gpu.get("index", "?"))


def _field_value(setting: Setting | None, value: Any) -> Any:
    """A form field's value as the backend's settings take it: a text field left empty is an optional setting's
    None, and digits typed into one are a number where the setting takes only numbers (``max_parallel``)."""
    if setting is None or not isinstance(value, str) or str in setting.kinds:
        return value
    text = value.strip()
    if not text and setting.default is None:
        return None
    for kind in (int, float):
        if kind in setting.kinds:
            try:
                return kind(text)
            except ValueError:
                pass
    return value


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


def _details(compute: Compute) -> list[tuple[str, str]]:
    """The compute's details worth a line each (not its summary, lists of records, or a managed cluster's raw
    status); a list of names (a Slurm cluster's partitions) as one line."""
    shown = []
    for key, value in compute.details.items():
        if key == "summary" or (isinstance(value, dict) and key == "cluster"):
            continue
        if isinstance(value, list):
            if not all(isinstance(item, (str, int, float)) for item in value):
                continue
            value = ", ".join(str(item) for item in value) or "none"
        shown.append((str(key), _detail_text(value)))
    return shown


def compute_html(compute: Compute, cluster: Cluster | None = None) -> str:
    """An HTML summary of a backend's compute: GPUs, nodes and backend details (an Azure ML cluster's state…)."""
    return display.render_html(
        "widget_compute.html.j2", compute=compute, summary=compute.details.get("summary"), details=_details(compute),
        cpu_only=not compute.gpus and capabilities(compute.backend).gpu_slots,
        concurrency=cluster.concurrency(compute) if cluster is not None else None)


def setup_cluster(backend: str = "local", **settings: Any) -> Cluster:
    """Choose where runs execute; in JupyterLab show a form for the backend, elsewhere print what it has.

    The form follows what the backend can do:

    * on this machine's GPU slots (``local``): the detected GPUs, runs per GPU and how many runs
      execute at once;
    * with a cluster of its own (``azureml``): its labelled settings (cluster name, VM size, min/max
      nodes, priority), with a button that creates or resizes the cluster and its live provisioning state;
    * otherwise (``ray``): its labelled settings (the cluster's address) and the plain settings given,
      with a button that connects and shows the resources the backend reports.

    ``settings`` are the backend's settings (as in an experiment's ``backend:`` mapping), plus
    ``runs_per_gpu`` and ``max_parallel``. The returned :class:`Cluster` follows the form's values;
    pass it to :func:`submit_all`.
    """
    if backend not in backend_names():
        backend_class(backend)  # raises: unknown backend (did you mean…)
    runs_per_gpu = settings.pop("runs_per_gpu", None)
    runs_per_gpu = None if runs_per_gpu is None else _knob("runs_per_gpu", runs_per_gpu)  # 0 is auto, as in the form
    max_parallel = settings.pop("max_parallel", None)
    if capabilities(backend).managed_cluster:
        for key, setting in form_settings(backend).items():
            settings.setdefault(key, setting.default)
    cluster = Cluster(backend, settings, runs_per_gpu, max_parallel)
    if display.display_mode() != "widgets":
        try:
            compute = cluster.compute()
        except Exception as exc:  # noqa: BLE001 - an unreachable cluster is reported, not raised
            print(f"backend {backend}: {exc}")
            compute = None
        print(cluster.describe(compute))
        return cluster
    form = ClusterForm(cluster)
    display.show(display.WithText(form.widget, lambda: cluster.describe(form.compute)))
    form.start()
    return cluster


def _label_style(labels: list[str]) -> dict[str, str]:
    """A form's label width: its longest label in full (a cut label hides what the field means); ``ch`` is a digit's
    width, wider than the average letter of JupyterLab's fonts."""
    return {"description_width": f"{max([14, *map(len, labels)]) + 2}ch"}


def _field(w: Any, label: str, value: Any, setting: Setting | None, style: dict[str, str]) -> Any:
    """The input for one setting: a dropdown of its choices, a combobox of its suggestions, else one of its type."""
    return _sized(_input(w, label, value, setting, style), style)


def _sized(field: Any, style: dict[str, str]) -> Any:
    """``field`` as wide as its label plus room for its value (ipywidgets' fixed 300 px would squeeze the input)."""
    field.layout.width = f"calc({style['description_width']} + 24ch)"
    return field


def _input(w: Any, label: str, value: Any, setting: Setting | None, style: dict[str, str]) -> Any:
    if setting is not None and setting.choices:
        options = list(dict.fromkeys([*setting.choices, value]))
        return w.Dropdown(value=value, options=options, description=label, style=style)
    if setting is not None and setting.suggestions:
        return w.Combobox(value=str(value), options=[str(s) for s in setting.suggestions], description=label,
                          ensure_option=False, style=style)
    if setting is not None and str in setting.kinds and not isinstance(value, bool):  # text takes every form
        return w.Text(value="" if value is None else str(value), description=label, style=style)  # (Slurm's 90 or 1:30:00)
    if isinstance(value, bool):
        return w.Checkbox(value=value, description=label, style=style)
    if isinstance(value, int) and setting is not None and setting.minimum is not None:
        return w.BoundedIntText(value=value, min=int(setting.minimum), max=1000, description=label, style=style)
    if isinstance(value, int):
        return w.IntText(value=value, description=label, style=style)
    if isinstance(value, float):
        return w.FloatText(value=value, description=label, style=style)
    return w.Text(value="" if value is None else str(value), description=label, style=style)


class ClusterForm:
    """The widget form behind :func:`setup_cluster`; edits :attr:`cluster` in place."""

    def __init__(self, cluster: Cluster, poll_s: float = 10.0):
        import ipywidgets as w

        self.cluster = cluster
        self.capabilities = capabilities(cluster.backend)
        self.compute: Compute | None = None
        self.poll_s = poll_s
        self._stop = threading.Event()
        self.title = w.HTML(display.message_html(f"nbbatch backend: {cluster.backend}", "title"))
        self.state = w.HTML(display.message_html("asking the backend what it has…", "busy"))
        self.message = w.HTML("")
        self.fields: dict[str, Any] = {}
        self.knobs: set[str] = set()  # fields that set the cluster's runs_per_gpu and max_parallel
        controls: list[Any] = []
        if self.capabilities.gpu_slots:  # auto: as many runs as fit in a GPU's memory (the experiments' default)
            per_gpu = AUTO if cluster.runs_per_gpu in (None, 0, AUTO) else int(cluster.runs_per_gpu)
            style = _label_style(["runs per GPU", "max parallel runs"])
            choices = list(dict.fromkeys([*RUNS_PER_GPU_CHOICES, per_gpu]))
            self.fields["runs_per_gpu"] = _sized(w.Dropdown(value=per_gpu, options=choices, description="runs per GPU",
                                                            style=style), style)
            self.fields["runs_per_gpu"].tooltip = "auto: runs share a GPU as far as its memory goes; N: N runs on each"
            parallel = cluster.max_parallel or (os.cpu_count() or 1)
            self.fields["max_parallel"] = _sized(w.BoundedIntText(value=parallel, min=1, max=1024, style=style,
                                                                  description="max parallel runs"), style)
            self.knobs = set(self.fields)
            controls = list(self.fields.values())
        else:
            labelled = form_settings(cluster.backend)
            for key, setting in labelled.items():
                cluster.settings.setdefault(key, setting.default)
            shown = {k: v for k, v in cluster.settings.items() if _shown_setting(k, v)}
            if self.capabilities.managed_cluster:  # its settings in the form, the others listed
                keys = list(labelled)
                others = {k: v for k, v in shown.items() if k not in labelled}
                if others:
                    self.message.value = display.message_html("", "settings", settings=others)
                self.apply_button = w.Button(description="Create / resize cluster", icon="cloud", button_style="primary")
                self.apply_button.on_click(lambda _b: self._in_thread(self._provision))
            else:  # every plain setting, each as a field of its type
                keys = list(shown)
                self.apply_button = w.Button(description="Connect", icon="plug", button_style="primary")
                self.apply_button.on_click(lambda _b: self._in_thread(self._refresh))
            labels = {key: labelled[key].label if key in labelled else key for key in keys}
            style = _label_style(list(labels.values()))
            for key in keys:
                self.fields[key] = _field(w, labels[key], cluster.settings[key], labelled.get(key), style)
            controls = [*self.fields.values(), self.apply_button]
        for key, widget in self.fields.items():
            widget.observe(lambda change, key=key: self._changed(key, change["new"]), names="value")
        self.widget = w.VBox([self.title, *controls, self.state, self.message],
                             layout=w.Layout(border="1px solid var(--jp-border-color2, #ccc)", padding="6px"))
        self.widget.add_class("nbbatch-cluster")

    def _changed(self, key: str, value: Any) -> None:
        if key in self.knobs:
            setattr(self.cluster, key, _knob(key, value))
        else:
            self.cluster.settings[key] = _field_value(form_settings(self.cluster.backend).get(key), value)
        if self.compute is not None:
            self.state.value = compute_html(self.compute, self.cluster)

    def _in_thread(self, target: Callable[[], None]) -> None:
        threading.Thread(target=target, name="nbbatch-cluster", daemon=True).start()

    def start(self) -> None:
        """Ask the backend for its compute (in the background); keep polling a managed cluster while it provisions."""
        for key in self.knobs:
            setattr(self.cluster, key, _knob(key, self.fields[key].value))
        self._in_thread(self._refresh)

    def stop(self) -> None:
        """Stop polling the backend."""
        self._stop.set()

    def _refresh(self) -> None:
        try:
            self.compute = self.cluster.compute()
        except Exception as exc:  # noqa: BLE001 - show it in the form, never a traceback in a thread
            self.state.value = display.message_html(str(exc), "error")
            return
        if self.knobs:
            self.fields["runs_per_gpu"].disabled = not self.compute.gpus
            if self.compute.gpus and self.cluster.max_parallel == (os.cpu_count() or 1):
                self.fields["max_parallel"].value = self.cluster.concurrency(self.compute)
        self.state.value = compute_html(self.compute, self.cluster)
        if self.capabilities.managed_cluster and not self._stop.is_set() and _provisioning(self.compute):
            self._stop.wait(self.poll_s)
            if not self._stop.is_set():
                self._refresh()

    def _provision(self) -> None:
        self.apply_button.disabled = True
        self.message.value = display.message_html("creating or resizing the cluster…", "busy")
        try:
            self.compute = self.cluster.provision(wait=False)
            self.message.value = display.message_html(self.cluster.note)
        except Exception as exc:  # noqa: BLE001
            self.message.value = display.message_html(str(exc), "error")
        finally:
            self.apply_button.disabled = False
        self._refresh()


def _provisioning(compute: Compute) -> bool:
    """Whether a cluster is still changing (being created, updated, resized or deleted)."""
    details = dict(compute.details)
    if isinstance(details.get("cluster"), dict):  # a managed cluster's status
        details.update(details["cluster"])
    state = str(details.get("provisioning_state") or "").lower()
    allocation = str(details.get("allocation_state") or "").lower()
    return state in ("creating", "updating", "deleting") or allocation == "resizing"
