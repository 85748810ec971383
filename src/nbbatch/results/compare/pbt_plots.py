"""Population-based training in the report: each member's parameters by the resource, generation by generation
(a step line per member, coloured by its final value, a dashed connector where it copied another member), and a
small table per member of its schedule (:func:`~nbbatch.results.compare.trials.member_schedules`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nbbatch.results.compare.collect import METRIC
from nbbatch.results.compare.plots import _figure, _numeric
from nbbatch.results.compare.trials import member_schedules, searched_names
from nbbatch.results.status import format_metric

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure

COPIED = "tab:red"
LABELLED_MEMBERS = 16  # up to this many members, each line ends in its trial number


def pbt_caption(search: Mapping[str, Any]) -> str:
    """The figure's title: ``population-based training: each member's parameters by <resource>``."""
    return f"population-based training: each member's parameters by {search.get('resource') or 'resource'}"


def _members(frame: pd.DataFrame, search: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each member (trial number, final value, schedule), best first; one without a value last."""
    column = f"{METRIC}{search['metric']}"
    values = _numeric(frame, column) if column in frame else None
    members = []
    for index, schedule in member_schedules(frame).items():
        value = None if values is None or math.isnan(values[index]) else float(values[index])
        members.append({"trial": int(frame.loc[index, "trial"]), "value": value, "schedule": schedule})
    sign = 1 if search.get("mode", "min") == "min" else -1
    return sorted(members, key=lambda m: (m["value"] is None, sign * (m["value"] or 0.0), m["trial"]))


def _axis_values(values: list[Any]) -> tuple[list[float], list[str] | None]:
    """A parameter's values as numbers on its axis, and the tick labels of a categorical one (None for numbers)."""
    if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
        return [float(v) for v in values], None
    names = sorted({str(v) for v in values})
    return [float(names.index(str(v))) for v in values], names


def plot_pbt_schedule(frame: pd.DataFrame, search: Mapping[str, Any]) -> Figure | None:
    """One panel per searched parameter: x the resource a segment trained over, y its value of the parameter (log
    scale for a ``loguniform`` one), one step line per member coloured by its final value (best brightest), and a
    dashed red connector from the copied member's value where a member copied another (exploit)."""
    members = _members(frame, search)
    names = searched_names(frame)
    if not members or not names:
        return None
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    finals = [m["value"] for m in members if m["value"] is not None]
    norm = Normalize(min(finals, default=0.0), max(finals, default=1.0))
    cmap = colormaps["viridis_r" if search.get("mode", "min") == "min" else "viridis"]
    columns = min(len(names), 3)
    rows = math.ceil(len(names) / columns)
    fig = _figure(width=4.6 * columns + 1.0, height=3.4 * rows + 0.6)
    space = search.get("params") or {}
    by_run = {(m["trial"], s["segment"]): s for m in members for s in m["schedule"]}
    for number, name in enumerate(names):
        ax = fig.add_subplot(rows, columns, number + 1)
        values, labels = _axis_values([s["params"][name] for m in members for s in m["schedule"]])
        at = iter(values)
        lines = []
        for member in members:
            xs, ys = [], []
            for segment in member["schedule"]:
                y = next(at)
                if segment["exploited"] and xs:  # the copied member's value where it was copied, to the new one
                    xs.append(math.nan)  # its own line breaks: it goes on from the member it copied
                    ys.append(math.nan)
                    source = _copied_value(by_run, segment, name, labels)
                    if source is not None:
                        ax.plot([segment["from"]] * 2, [source, y], color=COPIED, linestyle="--", linewidth=0.9)
                        ax.scatter([segment["from"]], [y], color=COPIED, marker="v", s=16, zorder=3)
                xs += [segment["from"], segment["to"]]
                ys += [y, y]
            lines.append((member, xs, ys))
        for member, xs, ys in reversed(lines):  # the best drawn last, on top
            colour = "lightgray" if member["value"] is None else cmap(norm(member["value"]))
            ax.plot(xs, ys, color=colour, linewidth=1.3, alpha=0.9)
            if len(members) <= LABELLED_MEMBERS and xs:
                ax.annotate(str(member["trial"]), (xs[-1], ys[-1]), textcoords="offset points", xytext=(3, 0),
                            fontsize="xx-small", va="center")
        if "loguniform" in (space.get(name) or {}) and labels is None and min(values) > 0:
            ax.set_yscale("log")
        if labels is not None:
            ax.set_yticks(range(len(labels)), labels)
        ax.set_ylabel(name)
        ax.set_xlabel(search.get("resource") or "resource")
        ax.grid(True, alpha=0.3)
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=fig.axes, label=f"final {search['metric']}", shrink=0.8)
    fig.suptitle(f"{pbt_caption(search)} ({len(members)} members; red ▼: copied another member)", fontsize="medium")
    return fig


def _copied_value(by_run: Mapping[tuple[int, int], Mapping[str, Any]], segment: Mapping[str, Any], name: str,
                  labels: list[str] | None) -> float | None:
    """The value of ``name`` in the segment the member copied (the copied member's run that ended where this one
    starts), on the panel's axis."""
    copied = segment["exploited"]["trial"]
    source = next((s for (trial, _), s in by_run.items() if trial == copied and s["to"] == segment["from"]), None)
    if source is None:
        return None
    value = source["params"].get(name)
    if labels is not None:
        return float(labels.index(str(value))) if str(value) in labels else None
    return float(value) if isinstance(value, numbers.Real) else None


def pbt_members(frame: pd.DataFrame, search: Mapping[str, Any]) -> dict[str, Any] | None:
    """The report's table per member: the searched parameters' ``names``, the ``resource``'s name and the
    ``members``, best first, each its trial number, final value and, generation by generation, the resource it
    trained over, its parameters and whom it copied. None for a search that is no PBT."""
    members = _members(frame, search)
    if not members:
        return None
    return {"names": searched_names(frame), "resource": search.get("resource") or "resource", "members": [
        {"trial": m["trial"], "value": "" if m["value"] is None else format_metric(m["value"]),
         "generations": [{"segment": s["segment"], "span": f"{s['from']}–{s['to']}",
                          "params": [format_metric(v) for v in s["params"].values()],
                          "copied": "" if not s["exploited"] else
                          f"trial {s['exploited']['trial']} (run {s['exploited']['run_id']})"}
                         for s in m["schedule"]]}
        for m in members]}
