"""The experiments this project has submitted: name → share and backend (``.nbbatch/experiments.json``).

``status``, ``logs`` and ``cancel`` find an experiment's share and backend here by its name alone.
Only settings safe to keep on disk are stored (:meth:`nbbatch.backends.base.Backend.storable_settings`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from nbbatch.spec.project import Project
from nbbatch.store.runrecord import utc_now

REGISTRY_FILE = "experiments.json"


def remember(project: Project, name: str, share_url: str, backend: str, settings: dict[str, Any]) -> None:
    """Record where experiment ``name`` ran (written atomically)."""
    path = project.state_dir / REGISTRY_FILE
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        known = {}
    known[name] = {"share": share_url, "backend": backend, "backend_settings": settings, "updated": utc_now()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=2, default=str))
    os.replace(tmp, path)


def lookup(project: Project, name: str) -> dict[str, Any]:
    """What :func:`remember` stored for experiment ``name`` (empty when unknown)."""
    path = project.state_dir / REGISTRY_FILE
    try:
        return json.loads(path.read_text()).get(name, {}) if path.exists() else {}
    except ValueError:
        return {}
