"""Where the widgets show up (a live frontend, or text), and what their HTML and text renderings share.

HTML comes only from the Jinja2 templates ``results/templates/widget_*.html.j2`` (autoescaped),
through :func:`render_html`; ipywidgets' ``HTML`` widgets take the rendered strings.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any


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


def parse_time(text: str | None) -> datetime | None:
    """An ISO time of a run record (UTC when it names no zone); None when missing or unreadable."""
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
