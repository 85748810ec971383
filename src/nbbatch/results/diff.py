"""Diff two executed notebooks: parameters, metrics, cell sources and outputs, with nbdime.

A run reference is a path to an ``.ipynb`` file, a run folder holding ``output.ipynb``, or
``<experiment>/<run id>`` in a share (a unique prefix of the run id is enough)::

    d = diff_runs("lr-sweep/pytorch-1a2b", "lr-sweep/keras-9f8e", share="results")
    d.print()                  # parameters, metrics, then nbdime's pretty-printed diff
    d.write_html("diff.html")  # one self-contained page

By default the diff leaves out what differs between any two executions and means nothing —
papermill's timings and cell metadata, execution counts, cell ids (``details=True`` keeps them) —
and notebook/cell metadata (``metadata=True`` keeps it); the parameters are always shown.
nbdime comes with the ``compare`` extra.
"""

from __future__ import annotations

import copy
import difflib
import io
import json
import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import nbformat

from nbbatch import __version__
from nbbatch.errors import NbbatchError, did_you_mean
from nbbatch.metrics import METRICS_MIME, metrics_from_notebook
from nbbatch.results.compare.collect import cell_source, share_location
from nbbatch.results.render import render_template
from nbbatch.store.known import open_experiment_share
from nbbatch.store.layout import OUTPUT_NOTEBOOK, run_paths
from nbbatch.store.runfiles import run_ids
from nbbatch.store.share import FILE_MODE, Share, open_share, write_file_atomic

# papermill's notebook-level metadata that changes with every execution
_VOLATILE_PAPERMILL = ("start_time", "end_time", "duration", "input_path", "output_path",
                       "environment_variables", "version", "exception")


@dataclass
class RunNotebook:
    """An executed notebook and where it came from."""

    label: str  # what the user named: a path or <experiment>/<run id>
    location: str  # a local path or a share URL
    notebook: dict[str, Any]

    @property
    def parameters(self) -> dict[str, Any]:
        """The parameters papermill injected (``metadata.papermill.parameters``)."""
        return dict(((self.notebook.get("metadata") or {}).get("papermill") or {}).get("parameters") or {})

    @property
    def metrics(self) -> dict[str, Any]:
        """The metrics the notebook recorded with ``nbbatch.record``."""
        return metrics_from_notebook(self.notebook)


def _read_notebook(data: bytes | str, where: str) -> dict[str, Any]:
    try:
        return dict(nbformat.reads(data if isinstance(data, str) else data.decode("utf-8"), as_version=4))
    except Exception as exc:  # nbformat raises several kinds (JSON, validation, version)
        raise NbbatchError(f"{where} is not a readable notebook: {exc}") from exc


def load_run_notebook(ref: str | os.PathLike[str], share: str | os.PathLike[str] | Share | None = None) -> RunNotebook:
    """The executed notebook ``ref`` names: a ``.ipynb`` path, a run folder, or ``<experiment>/<run id>`` in ``share``.

    Without ``share``, the share the experiment was submitted to from this project (default
    ``results/``). Raises :class:`NbbatchError` naming the runs there are when nothing matches.
    """
    text = os.fspath(ref)
    path = Path(text)
    if share is None:
        if path.is_file():
            return RunNotebook(text, str(path.resolve()), _read_notebook(path.read_bytes(), text))
        if path.is_dir() and (path / OUTPUT_NOTEBOOK).is_file():
            target = path / OUTPUT_NOTEBOOK
            return RunNotebook(text, str(target.resolve()), _read_notebook(target.read_bytes(), str(target)))
        if path.is_dir():
            raise NbbatchError(f"the folder `{text}` holds no {OUTPUT_NOTEBOOK}: the run has not written it yet")
    clean = text.strip("/")
    experiment, sep, run = clean.rpartition("/")
    if share is None:
        # the share this experiment was submitted to from this project (default: results/)
        opened = open_experiment_share(experiment or clean)[1]
    else:
        opened = open_share(share)
    if clean.endswith(".ipynb") and opened.exists(clean) and not opened.list(clean):
        return RunNotebook(text, share_location(opened, clean), _read_notebook(opened.read_bytes(clean), clean))
    if not sep or not experiment:
        raise NbbatchError(f"`{text}` is neither a notebook file nor `<experiment>/<run id>` in the share "
                           f"{opened.url}")
    runs = run_ids(opened, experiment)
    if not runs:
        experiments = opened.list("")
        raise NbbatchError(f"no experiment `{experiment}` in the share {opened.url}"
                           f"{did_you_mean(experiment, experiments)}"
                           + (f"; experiments there: {', '.join(experiments[:20])}" if experiments else ""))
    matches = [r for r in runs if r == run] or [r for r in runs if r.startswith(run)]
    if not matches:
        raise NbbatchError(f"no run `{run}` in experiment `{experiment}`{did_you_mean(run, runs)}; runs there: "
                           f"{', '.join(runs[:20])}{'…' if len(runs) > 20 else ''}")
    if len(matches) > 1:
        raise NbbatchError(f"`{run}` matches several runs in `{experiment}`: {', '.join(matches[:10])}; "
                           "give more of the run id")
    paths = run_paths(experiment, matches[0])
    if not opened.exists(paths.notebook):
        raise NbbatchError(f"run `{paths.folder}` has no {OUTPUT_NOTEBOOK} yet (queued, or it never "
                           "started): `nbbatch status` tells")
    return RunNotebook(paths.folder, share_location(opened, paths.notebook),
                       _read_notebook(opened.read_bytes(paths.notebook), paths.notebook))


def normalise(notebook: Mapping[str, Any], details: bool = False) -> dict[str, Any]:
    """A copy without what changes on every execution (unless ``details``): papermill timings and
    cell metadata, ``execution`` timings, execution counts, cell ids. Parameters stay."""
    nb = copy.deepcopy(dict(notebook))
    if details:
        return nb
    papermill = (nb.get("metadata") or {}).get("papermill")
    if isinstance(papermill, dict):
        for key in _VOLATILE_PAPERMILL:
            papermill.pop(key, None)
    for cell in nb.get("cells", []):
        metadata = cell.get("metadata")
        if isinstance(metadata, dict):
            metadata.pop("papermill", None)
            metadata.pop("execution", None)
        cell.pop("id", None)  # papermill gives its injected cell a new id on every execution
        if "execution_count" in cell:
            cell["execution_count"] = None
        for output in cell.get("outputs", []) or []:
            if "execution_count" in output:
                output["execution_count"] = None
    return nb


@dataclass
class NotebookDiff:
    """The difference between two executed notebooks: parameters, metrics and nbdime's notebook diff."""

    a: RunNotebook
    b: RunNotebook
    base: dict[str, Any]  # the normalised notebook ``diff`` applies to
    diff: list[Any]  # nbdime diff entries (``nbdime.diff_notebooks``)
    options: dict[str, bool] = field(default_factory=dict)

    @property
    def parameters(self) -> list[tuple[str, Any, Any]]:
        """``(name, value in a, value in b)`` for every parameter either run has (missing: :data:`None`)."""
        pa, pb = self.a.parameters, self.b.parameters
        return [(n, pa.get(n), pb.get(n)) for n in sorted(set(pa) | set(pb))]

    @property
    def changed_parameters(self) -> list[tuple[str, Any, Any]]:
        pa, pb = self.a.parameters, self.b.parameters
        return [(n, va, vb) for n, va, vb in self.parameters if (n in pa) != (n in pb) or va != vb]

    @property
    def metrics(self) -> list[tuple[str, Any, Any]]:
        """``(name, value in a, value in b)`` for every metric either notebook recorded."""
        ma, mb = self.a.metrics, self.b.metrics
        return [(n, ma.get(n), mb.get(n)) for n in list(dict.fromkeys([*ma, *mb]))]

    @property
    def identical(self) -> bool:
        """Whether nothing differs (parameters, metrics, and the notebook as diffed)."""
        return not self.diff and not self.changed_parameters and all(x == y for _, x, y in self.metrics)

    # -- terminal ------------------------------------------------------------------------------
    def pretty(self, color: bool = False) -> str:
        """The text diff: changed parameters, metrics, then nbdime's pretty printer."""
        from nbdime.prettyprint import PrettyPrintConfig, pretty_print_notebook_diff

        out = io.StringIO()
        out.write(f"nbbatch diff\n--- a: {self.a.label}  ({self.a.location})\n+++ b: {self.b.label}  "
                  f"({self.b.location})\n\n")
        changed = self.changed_parameters
        out.write(f"## parameters: {len(changed)} of {len(self.parameters)} differ\n")
        for name, va, vb in changed:
            out.write(f"   {name}: {_short(va)} -> {_short(vb)}\n")
        if self.metrics:
            out.write("## metrics\n")
            for name, va, vb in self.metrics:
                out.write(f"   {name}: {_short(va)} -> {_short(vb)}{_delta_text(va, vb)}\n")
        out.write("\n")
        if self.diff:
            config = PrettyPrintConfig(out=out, include=_Include(self.options), use_git=False, use_diff=False,
                                       use_color=color)
            pretty_print_notebook_diff(self.a.location, self.b.location, self.base, self.diff, config)
        else:
            out.write("## the notebooks' cells are the same (as diffed)\n")
        return out.getvalue()

    def print(self, file: TextIO | None = None, color: bool | None = None) -> None:
        """Print :meth:`pretty` (in colour when writing to a terminal)."""
        stream = file or sys.stdout
        if color is None:
            color = hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")
        stream.write(self.pretty(color=bool(color)))

    # -- HTML ------------------------------------------------------------------------------------
    def to_html(self, title: str | None = None) -> str:
        """One self-contained HTML page: parameter and metric tables, then the changed cells side by side."""
        pa, pb = self.a.parameters, self.b.parameters
        return render_template(
            "diff.html.j2",
            title=title or f"{self.a.label} vs. {self.b.label}",
            version=__version__,
            a=self.a, b=self.b,
            parameters=[{"name": n, "a": _short(va, 200) if n in pa else "—", "b": _short(vb, 200) if n in pb else "—",
                         "changed": (n in pa) != (n in pb) or va != vb} for n, va, vb in self.parameters],
            metrics=[{"name": n, "a": _short(va, 200), "b": _short(vb, 200), "delta": _delta_text(va, vb).strip(" ()"),
                      "changed": va != vb} for n, va, vb in self.metrics],
            blocks=_cell_blocks(self.base, self.diff),
            metadata_diff=_metadata_text(self.base, self.diff, self.options),
            options=self.options,
        )

    def write_html(self, path: str | os.PathLike[str], title: str | None = None) -> Path:
        """Write :meth:`to_html` to ``path``."""
        target = Path(path)
        write_file_atomic(target, self.to_html(title).encode("utf-8"), FILE_MODE)
        return target


class _Include:
    """What nbdime's pretty printer should show (its ``include`` object: attributes per ignorable)."""

    def __init__(self, options: Mapping[str, bool]):
        self.sources = options.get("sources", True)
        self.outputs = options.get("outputs", True)
        self.attachments = True
        self.metadata = options.get("metadata", False)
        self.id = options.get("details", False)
        self.details = options.get("details", False)


def _short(value: Any, limit: int = 80) -> str:
    if value is None:
        return "—"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if isinstance(value, float):
        text = f"{value:.6g}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _delta_text(a: Any, b: Any) -> str:
    if isinstance(a, numbers.Real) and isinstance(b, numbers.Real) and not isinstance(a, bool) \
            and not isinstance(b, bool) and math.isfinite(a) and math.isfinite(b) and a != b:
        return f"  ({b - a:+.4g})"
    return ""


def notebook_diff(a: RunNotebook, b: RunNotebook, *, sources: bool = True, outputs: bool = True,
                  metadata: bool = False, details: bool = False) -> NotebookDiff:
    """Diff two executed notebooks with ``nbdime.diff_notebooks`` (after :func:`normalise`).

    ``sources``/``outputs``/``metadata``/``details`` choose what the notebook diff covers (nbdime's
    own switches); parameters and metrics are always compared.
    """
    from nbdime.diffing.notebooks import diff_notebooks, reset_notebook_differ, set_notebook_diff_targets

    base = normalise(a.notebook, details)
    remote = normalise(b.notebook, details)
    set_notebook_diff_targets(sources=sources, outputs=outputs, attachments=True, metadata=metadata,
                              identifier=details, details=details)
    try:
        result = diff_notebooks(base, remote)
    finally:
        reset_notebook_differ()  # nbdime's differ configuration is process-wide
    options = {"sources": sources, "outputs": outputs, "metadata": metadata, "details": details}
    return NotebookDiff(a=a, b=b, base=base, diff=list(result), options=options)


def diff_runs(ref_a: str | os.PathLike[str], ref_b: str | os.PathLike[str],
              share: str | os.PathLike[str] | Share | None = None, **options: bool) -> NotebookDiff:
    """Diff two runs' executed notebooks; refs as in :func:`load_run_notebook`, options as in :func:`notebook_diff`."""
    return notebook_diff(load_run_notebook(ref_a, share), load_run_notebook(ref_b, share), **options)


# ---------------------------------------------------------------------------------------------
# The cells diff as data for templates/diff.html.j2
# ---------------------------------------------------------------------------------------------
def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _render_output(output: Mapping[str, Any]) -> dict[str, str]:
    """An output as ``{"kind": "text"|"image"|"error", "text"/"src": …}`` for the template."""
    kind = output.get("output_type")
    if kind == "stream":
        return {"kind": "text", "text": _text(output.get("text", "")), "label": output.get("name", "stream")}
    if kind == "error":
        return {"kind": "error", "text": f"{output.get('ename', '')}: {output.get('evalue', '')}", "label": "error"}
    data = output.get("data") or {}
    for mime in ("image/png", "image/jpeg"):
        if mime in data:
            return {"kind": "image", "src": f"data:{mime};base64,{_text(data[mime]).strip()}", "label": mime}
    if METRICS_MIME in data:
        return {"kind": "text", "text": "nbbatch.record: " + json.dumps(data[METRICS_MIME], default=str),
                "label": "metrics"}
    if "text/plain" in data:
        return {"kind": "text", "text": _text(data["text/plain"]), "label": "text/plain"}
    mimes = ", ".join(sorted(data)) or kind or "output"
    return {"kind": "text", "text": f"({mimes})", "label": str(kind)}


def _source_lines(a: str, b: str) -> list[dict[str, str]]:
    lines = []
    a_lines, b_lines = a.splitlines(), b.splitlines()
    for line in difflib.unified_diff(a_lines, b_lines, lineterm="", n=max(len(a_lines), len(b_lines))):
        if line.startswith(("---", "+++", "@@")):
            continue
        tag = {"+": "add", "-": "del"}.get(line[:1], "ctx")
        lines.append({"tag": tag, "text": line[1:]})
    return lines


def _cell_view(cell: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": cell.get("cell_type", "code"), "source": cell_source(cell),
            "outputs": [_render_output(o) for o in cell.get("outputs", []) or []]}


def _cell_blocks(base: Mapping[str, Any], diff: Sequence[Any]) -> list[dict[str, Any]]:
    """The cells as blocks for the template: unchanged runs, added, removed and modified cells."""
    from nbdime.patching import patch

    cells = list(base.get("cells", []))
    entries = next((e.diff for e in diff if e.key == "cells" and e.op == "patch"), [])
    blocks: list[dict[str, Any]] = []
    index = 0

    def unchanged(upto: int) -> None:
        nonlocal index
        if upto > index:
            blocks.append({"kind": "same", "first": index, "cells": [_cell_view(c) for c in cells[index:upto]]})
            index = upto

    for entry in sorted(entries, key=lambda e: (e.key, 0 if e.op == "addrange" else 1)):
        unchanged(entry.key)
        if entry.op == "addrange":
            for cell in entry.valuelist:
                blocks.append({"kind": "added", "index": entry.key, "cell": _cell_view(cell)})
        elif entry.op == "removerange":
            for offset, cell in enumerate(cells[entry.key: entry.key + entry.length]):
                blocks.append({"kind": "removed", "index": entry.key + offset, "cell": _cell_view(cell)})
            index = entry.key + entry.length
        elif entry.op == "patch":
            before = cells[entry.key]
            after = patch(before, entry.diff)
            changed = sorted({e.key for e in entry.diff})
            block: dict[str, Any] = {"kind": "modified", "index": entry.key, "changed": changed,
                                     "a": _cell_view(before), "b": _cell_view(after),
                                     "source_lines": None, "other": None}
            if "source" in changed:
                block["source_lines"] = _source_lines(cell_source(before), cell_source(after))
            others = [k for k in changed if k not in ("source", "outputs")]
            if others:
                block["other"] = {k: (json.dumps(before.get(k), default=str, indent=1),
                                      json.dumps(after.get(k), default=str, indent=1)) for k in others}
            blocks.append(block)
            index = entry.key + 1
    unchanged(len(cells))
    return blocks


def _metadata_text(base: Mapping[str, Any], diff: Sequence[Any], options: Mapping[str, bool]) -> str:
    """nbdime's pretty-printed diff of everything but the cells (notebook metadata, nbformat), as plain text."""
    from nbdime.prettyprint import PrettyPrintConfig, pretty_print_diff

    rest = [e for e in diff if e.key != "cells"]
    if not rest:
        return ""
    out = io.StringIO()
    config = PrettyPrintConfig(out=out, include=_Include(options), use_git=False, use_diff=False, use_color=False)
    pretty_print_diff(dict(base), rest, "", config)
    return out.getvalue()
