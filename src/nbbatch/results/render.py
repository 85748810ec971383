"""HTML through Jinja2 templates: :func:`render_template` renders one from ``nbbatch/results/templates/``.

Every page nbbatch writes (the compare report, the diff page, the widgets' views) comes from a
template there; Python code passes data, never markup. Templates get :func:`status_css` as a global.
Jinja2 comes with the ``compare`` extra and is imported on first use.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from nbbatch.results.status import STATUS_STYLE

if TYPE_CHECKING:  # pragma: no cover
    import jinja2


@functools.cache
def _environment() -> jinja2.Environment:
    import jinja2

    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("nbbatch.results", "templates"),
        # HTML (``*.html.j2``) and anything else is escaped; only plain-text templates are not
        autoescape=jinja2.select_autoescape(disabled_extensions=("txt", "txt.j2"), default=True),
        undefined=jinja2.StrictUndefined,
    )
    environment.globals["status_css"] = status_css
    return environment


def render_template(name: str, **context: Any) -> str:
    """Render the template ``name`` (e.g. ``"report.html.j2"``) of ``nbbatch/results/templates/`` with ``context``."""
    return _environment().get_template(name).render(**context)


# CSS colours for the colour words of STATUS_STYLE (rich's own are too bright on a light page or JupyterLab theme).
_CSS_COLOURS = {"green": "#2e7d32", "red": "#c62828", "blue": "#1565c0", "yellow": "#a15c00", "magenta": "#8e24aa",
                "cyan": "#00838f"}
_CSS_WORDS = {"bold": "font-weight:600", "dim": "opacity:0.65", **{k: f"color:{v}" for k, v in _CSS_COLOURS.items()}}


def status_css(status: str) -> str:
    """Inline CSS for a status, from :data:`~nbbatch.results.status.STATUS_STYLE` (the terminal's styles), so the
    terminal, the report and the widgets colour statuses alike; ``""`` for a status without a style."""
    return ";".join(_CSS_WORDS[word] for word in STATUS_STYLE.get(status, "").split() if word in _CSS_WORDS)
