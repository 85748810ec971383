"""Where the widgets show up (a live frontend, or text), and what their HTML and text renderings share.

HTML comes only from the Jinja2 templates ``results/templates/widget_*.html.j2`` (autoescaped),
through :func:`render_html`; ipywidgets' ``HTML`` widgets take the rendered strings.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from nbbatch.results.status import format_duration, format_metric  # noqa: F401 - format_duration: the widgets use it from here


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


def show(obj: Any) -> None:
    """Display ``obj`` in the notebook (the other modules call it as ``display.show``, so tests can replace it)."""
    from IPython.display import display

    display(obj)


class WithText:
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


def render_html(template: str, **context: Any) -> str:
    """The widget template ``template`` rendered with ``context`` (and :func:`status_css`), autoescaped."""
    from nbbatch.results.render import render_template

    return render_template(template, **context)


def message_html(text: str, kind: str = "plain", **context: Any) -> str:
    """One message as HTML: ``kind`` is ``plain``, ``error``, ``busy``, ``title``, ``warnings`` or ``settings``."""
    return render_html("widget_message.html.j2", text=text, kind=kind, **context)


def parse_time(text: str | None) -> datetime | None:
    """An ISO time of a run record (UTC when it names no zone); None when missing or unreadable."""
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def format_gpu_now(telemetry: Mapping[str, Any]) -> str:
    """``87% · 3.2 GB`` from a run record's live telemetry (``util_now_pct``, ``memory_now_mb``); ``""`` without."""
    util, memory = telemetry.get("util_now_pct"), telemetry.get("memory_now_mb")
    parts = []
    if _number(util):
        parts.append(f"{util:.0f}%")
    if _number(memory):
        parts.append(f"{memory / 1024:.1f} GB" if memory >= 1024 else f"{memory:.0f} MB")  # nvidia-smi's MB are MiB
    return " · ".join(parts)


CURVE_WIDTH, CURVE_HEIGHT, CURVE_PAD = 120, 24, 2.0
MAX_CURVE_POINTS = 200  # the table's HTML goes to the frontend on every poll: a longer history is thinned


def thinned(count: int, limit: int = MAX_CURVE_POINTS) -> list[int]:
    """Indices of at most ``limit`` of ``count`` items, evenly spread, the first and the last kept."""
    if count <= limit:
        return list(range(count))
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)})


def value_range(series: Iterable[Sequence[float]]) -> tuple[float, float] | None:
    """The smallest and largest finite number over all ``series``; None when there is none."""
    finite = [v for values in series for v in values if math.isfinite(v)]
    return (min(finite), max(finite)) if finite else None


def curve(steps: Sequence[float], values: Sequence[float], x_range: tuple[float, float],
          y_range: tuple[float, float]) -> dict[str, Any] | None:
    """A sparkline's geometry in a ``CURVE_WIDTH`` × ``CURVE_HEIGHT`` box: ``points`` (an SVG polyline's
    ``"x,y x,y"``, one pair per step up to :data:`MAX_CURVE_POINTS`), ``count`` and the last point ``x``, ``y``.

    Every run's curve is drawn on the same ranges, so the rows compare; non-finite values are left out.
    """
    pairs = [(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
    if not pairs:
        return None
    pairs = [pairs[i] for i in thinned(len(pairs))]

    def scale(value: float, lo: float, hi: float, size: float) -> float:
        inner = size - 2 * CURVE_PAD
        return CURVE_PAD + (inner / 2 if hi <= lo else (value - lo) / (hi - lo) * inner)

    xy = [(scale(s, *x_range, CURVE_WIDTH), CURVE_HEIGHT - scale(v, *y_range, CURVE_HEIGHT)) for s, v in pairs]
    return {"points": " ".join(f"{x:.1f},{y:.1f}" for x, y in xy), "count": len(xy),
            "x": f"{xy[-1][0]:.1f}", "y": f"{xy[-1][1]:.1f}"}


def add_curves(rows: list[dict[str, Any]], metric: str | None,
               series: Callable[[str], tuple[Sequence[int], Sequence[float]]]) -> None:
    """Set each jobs-table row's ``curve`` (:func:`curve`'s geometry and a ``title``, or None) and ``latest_text``
    (``0.51 (step 3)``) for ``metric``, from ``series(run_id)`` (its steps and values)."""
    by_run = {row["run_id"]: series(row["run_id"]) for row in rows}
    x_range = value_range([float(s) for s in steps] for steps, _ in by_run.values())
    y_range = value_range(values for _, values in by_run.values())
    for row in rows:
        steps, values = by_run[row["run_id"]]
        row["curve"], row["latest_text"] = None, ""
        if not steps or x_range is None or y_range is None:
            continue
        row["latest_text"] = f"{format_metric(values[-1])} (step {steps[-1]})"
        row["curve"] = curve(steps, values, x_range, y_range)
        low_high = value_range([values])
        if row["curve"] is not None and low_high is not None:
            row["curve"]["title"] = (f"{metric} = {format_metric(values[-1])} at step {steps[-1]}; "
                                     f"{format_metric(low_high[0])} to {format_metric(low_high[1])} "
                                     f"over {len(steps)} steps")
