"""The experiment file's published JSON Schema (``nbbatch schema``), so editors validate ``experiment.yaml``
as people type (e.g. a ``# yaml-language-server: $schema=experiment.schema.json`` first line).

The schema is data (``experiment.schema.json``); the experiment's own validation takes its key names
from it, so the two cannot drift. Messages stay nbbatch's own ("did you mean"), not the validator's.
"""

from __future__ import annotations

import importlib.resources
import json
from functools import cache
from typing import Any

SCHEMA_FILE = "experiment.schema.json"


@cache
def experiment_schema() -> dict[str, Any]:
    """The JSON Schema of an experiment file (draft 2020-12)."""
    return json.loads(importlib.resources.files("nbbatch.spec").joinpath(SCHEMA_FILE).read_text("utf-8"))


def keys(*path: str) -> tuple[str, ...]:
    """The property names the schema allows at ``path`` (``keys()``: top level; ``keys("resources")``…)."""
    node = experiment_schema()
    for name in path:
        node = node["properties"][name]
    return tuple(node["properties"])
