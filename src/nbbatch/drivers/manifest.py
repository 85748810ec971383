"""A submission's manifest, ``<experiment>/experiment.json``: what ``status``, ``compare`` and ``check`` show.

Its ``runs`` are the experiment's current plan; the rest says where the submission came from (the experiment file,
else what it ran), so a name reused by another experiment file is told apart from an edited file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nbbatch.errors import NbbatchError
from nbbatch.spec.experiment import Experiment
from nbbatch.store.layout import experiment_paths
from nbbatch.store.runjson import utc_now
from nbbatch.store.share import Share


def write_manifest(share: Share, spec: Experiment, run_ids: list[str], source: object = None,
                   backend_settings: dict[str, Any] | None = None) -> list[str]:
    """Write the submission's manifest, ``<experiment>/experiment.json``: its ``runs`` are the experiment's
    current plan (what ``status``, ``compare`` and ``check`` show). Return a warning when the last submission
    under this name came from another experiment file: its runs are superseded by this one's."""
    path = experiment_paths(spec.name).manifest
    manifest = {
        "experiment": spec.name, "updated": utc_now(), "backend": spec.backend,
        "backend_settings": backend_settings or {},  # nothing secret (Backend.storable_settings)
        # the experiment file (None for one built in Python): tells a reused name from an edited file
        "source": str(Path(source).resolve()) if isinstance(source, (str, os.PathLike)) else None,
        "frameworks": spec.frameworks, "notebooks": [str(n.path.name) for n in spec.notebooks],
        "parameters": spec.parameters, "sweep": spec.sweep,
        **({"search": spec.search.to_dict()} if spec.search else {}),
        "runs": list(run_ids),
    }
    try:
        previous = json.loads(share.read_bytes(path))
    except (OSError, ValueError, UnicodeDecodeError, NbbatchError):
        previous = None
    share.write_bytes(path, json.dumps(manifest, indent=2, default=str).encode())
    if not isinstance(previous, dict) or not isinstance(previous.get("runs"), list):
        return []
    if previous.get("source") and manifest["source"]:
        reused = previous["source"] != manifest["source"]
    else:  # a file or a submission without a known path: another experiment if it runs other notebooks
        reused = [previous.get("frameworks"), previous.get("notebooks")] != [spec.frameworks, manifest["notebooks"]]
    if not reused:
        return []
    # a search's manifest grows as its trials start: its first write lists one run of many
    shown = (f"search (up to {spec.search.trials} trials per notebook)" if spec.search
             else f"{len(manifest['runs'])} run(s)")
    return [f"experiment name `{spec.name}` was last submitted to {share.url} from {_submitted_from(previous)} (at "
            f"{previous.get('updated')}); this submission from {_submitted_from(manifest)} reuses the name and "
            f"replaces its plan: "
            f"`nbbatch status {spec.name}` and `nbbatch compare {spec.name}` now show this submission's "
            f"{shown}, and the earlier runs stay on the share (shown with --all). If they "
            f"are different experiments, give one of the files its own `experiment:` name"]


def _submitted_from(manifest: dict[str, Any]) -> str:
    """Where a manifest's submission came from, for people: its experiment file, else what it ran."""
    if manifest.get("source"):
        return str(manifest["source"])
    ran = [str(n) for key in ("frameworks", "notebooks") if isinstance(manifest.get(key), list) for n in manifest[key]]
    return f"an experiment built in Python (running {', '.join(ran)})"

